"""Load Ideogram 4.0 INT8 with a file holding one backbone, against a current ComfyUI (issue 12, items 3, 4
and the loader part of 7). Needs COMFYUI_CURRENT (and COMFYUI_CURRENT_PYTHON), like test_ideogram4_current.py;
skipped with the reason otherwise. The work runs in a subprocess (tests/comfy_harness.run_in_current_comfy).

One 1-layer Ideogram 4 backbone at narrow widths (ComfyUI's config narrowed: ``comfy_harness.narrow_ideogram4``),
random weights, written twice in
the transformerlab layout: under ``conditional.`` only and under ``unconditional.`` only.

* A conditional-only file: its ``model_unconditional`` must fail wherever it is sampled. Wired into
  DualModelGuider's ``model_negative`` it used to run the conditional backbone silently (bit-identical to
  wiring ``model_conditional`` there), because its refusal was a ``model_function_wrapper``, which
  DualModelGuider never calls for the negative model (it runs that pass with the main model's options).
* An unconditional-only file: used to return None as ``model_conditional`` (an AttributeError in a core
  node). It now fills ``model_unconditional`` with that backbone (so two loaders feed DualModelGuider)
  and ``model_conditional`` errors when sampled, naming the file and what to do.
"""
import json
import sys

import torch


def test_single_backbone_files(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(json.dumps(res, indent=1))
    # item 3: the empty model_unconditional of a conditional-only file fails as DualModelGuider's negative
    # model and as a main model, with the pack's error naming the file
    for case in ("cond_only_as_negative", "cond_only_empty_as_main"):
        assert res[case].startswith("int8_fused.CheckpointError: Load Ideogram 4.0 INT8: cond_only.safetensors "
                                    "holds a single backbone"), (case, res[case])
        assert "model_unconditional output is empty" in res[case]
    # item 4: an unconditional-only file fills model_unconditional with its INT8 backbone ...
    assert res["uncond_only_outputs"] == {"conditional": "empty", "unconditional": "int8"}
    assert res["uncond_only_cond_as_main"].startswith(
        "int8_fused.CheckpointError: Load Ideogram 4.0 INT8: uncond_only.safetensors holds only the unconditional "
        "backbone"), res["uncond_only_cond_as_main"]
    # ... and two loaders (one file each) feed DualModelGuider: the unconditional backbone really runs
    assert res["two_loaders"]["finite"] and res["two_loaders"]["uncond_calls"] > 0
    # item 7: the timing layer gets what was asked and what ran (fp8_rowwise needs a CUDA GPU: its fallback)
    assert res["instrumented_backends"] == [["fp8_rowwise", {"dequant_bf16": 4}]], res["instrumented_backends"]
    assert any("INT8 linears on dequant_bf16: 4 (asked fp8_rowwise)" in ln for ln in res["log"]), res["log"]


def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess, ``models`` a fresh default diffusion_models folder)."""
    return _body(pack, models)


def _err(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reports whatever is raised
        return f"{type(e).__module__}.{type(e).__qualname__}: {e}"
    return "no error"


def _sample(model, model_neg, positive, latent):
    return sample_image_only_cfg(model, positive, latent, 1, model_neg)  # noqa: F821 (tests/comfy_harness.py)


def _body(pack, models):
    import logging
    i4 = sys.modules["comfyui_int8_fused.adapters.ideogram4.layout"]
    W = sys.modules["comfyui_int8_fused.quant.fmt_write"]
    Int8Linear = sys.modules["comfyui_int8_fused.quant.linear"].Int8Linear
    loader = pack.nodes.loader
    from comfy_harness import narrow_ideogram4
    w = narrow_ideogram4()  # ComfyUI's Ideogram 4 config at narrow widths (the loader checks the file against it)
    names = [n for n in i4.linear_specs(1, w) if n.startswith("layers.") and n.split(".")[-1] in
             ("qkv", "o", "w1", "w3")]
    q, f = i4.quantize_state_dict(i4.random_state_dict(1, w, seed=0), names)
    W.write_transformerlab(str(models / "cond_only.safetensors"), {"conditional": (q, f)})
    W.write_transformerlab(str(models / "uncond_only.safetensors"), {"unconditional": (q, f)})
    del q, f
    g = torch.Generator().manual_seed(5)
    positive = [[torch.randn(1, 4, w["text"], generator=g), {}]]
    latent = torch.zeros(1, 128, 2, 2)

    backends_seen, log_lines = [], []
    real_instrument = loader._instrument

    def spy(patcher, node_id, backend):
        backends_seen.append([backend, dict(getattr(patcher, "int8_backends", {}))])
        return real_instrument(patcher, node_id, backend)
    loader._instrument = spy

    class Grab(logging.Handler):
        def emit(self, record):
            log_lines.append(record.getMessage())
    logging.getLogger("int8_fused").addHandler(Grab(level=logging.INFO))
    logging.getLogger("int8_fused").setLevel(logging.INFO)

    node = loader.LoadIdeogram4Int8()
    res = {}
    cond, empty_uncond = node.load("cond_only.safetensors", "fp8_rowwise", "none", "none")
    res["instrumented_backends"] = list(backends_seen)
    res["log"] = [ln for ln in log_lines if "INT8 linears" in ln]
    res["cond_only_as_negative"] = _err(lambda: _sample(cond, empty_uncond, positive, latent))
    res["cond_only_empty_as_main"] = _err(lambda: _sample(empty_uncond, cond, positive, latent))

    c2, u2 = node.load("uncond_only.safetensors", "dequant_bf16", "none", "none")

    def kind(m):
        if m is None:
            return "None"
        if not hasattr(m.model.diffusion_model, "layers"):
            return "empty"
        return "int8" if isinstance(m.model.diffusion_model.layers[0].attention.qkv, Int8Linear) else "float"
    res["uncond_only_outputs"] = {"conditional": kind(c2), "unconditional": kind(u2)}
    res["uncond_only_cond_as_main"] = _err(lambda: _sample(c2, u2, positive, latent))

    calls = []
    h = u2.model.diffusion_model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        out = _sample(cond, u2, positive, latent)
    finally:
        h.remove()
    res["two_loaders"] = {"finite": bool(torch.isfinite(out).all()), "uncond_calls": len(calls)}
    return res
