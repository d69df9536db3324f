"""Load Ideogram 4.0 INT8 installs what Apply installs (issue 14): the ``attention`` input's Router and Ideogram 4
pad-token elision, on a current ComfyUI (0.33.0; skipped naming COMFYUI_CURRENT without it), on the CPU.

One 1-layer Ideogram 4 backbone at narrow widths (ComfyUI's config narrowed: ``comfy_harness.narrow_ideogram4``),
random weights, its block linears quantized, written in the
transformerlab layout as both branches. Checked through the loader node itself:

* ``attention="math"``: both MODEL outputs carry a Router in ``transformer_options`` (what ComfyUI's ``wrap_attn``
  hands every attention call to), and sampling runs every attention call on torch's math backend;
* pad elision is installed for ``fused_triton`` (its default) and not for other backends unless switched on;
* on ``fused_triton`` the block is fused as Apply fuses it: the Ideogram 4 adapter's ``FusedIdeogram4Block`` as an
  object patch holding the loader's own int8 layers, plus the per-run ``llm_cond_proj`` cache (their numerics against per-linear INT8 are tested in
  test_fused.py / test_adapters.py at small widths; at the real widths the Triton interpreter would take
  tens of minutes), and none with ``INT8_FUSED_FUSION=0``;
* sampled with a padded text conditioning (``attention_mask`` ending in zeros), the elided model equals the same file
  loaded with elision off within bf16 rounding, while dropping one real token instead changes the result far more.
"""
import json
import sys

import torch

TOL = 2e-2  # the backbone runs in bf16: a different token count changes summation order only


def test_loader_installs_attention_and_pad_elision(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(json.dumps(res, indent=1))
    assert res["router_modes"] == ["math", "math"]
    assert res["default_router"] == "auto"  # the loader's default attention
    assert res["elision_installed"] == {"fused_triton": True, "torch_int_mm": False, "torch_int_mm_on": True}
    assert res["ran"] and set(res["ran"]) == {"math"}
    assert res["tokens_removed"] > 0
    assert res["err_elided_vs_masked"] <= TOL
    assert res["err_drop_real_token"] >= 5 * max(res["err_elided_vs_masked"], 1e-4)
    assert res["fused"] == {"modules": 2, "patch": ["diffusion_model.layers.0", "FusedIdeogram4Block"],
                            "same_layers": ["adaln_modulation", "attention.o", "attention.qkv", "feed_forward.w2"],
                            "unfused_modules": 0}
    assert res["patches"] == {"diffusion_model.layers.0": "FusedIdeogram4Block",
                              "diffusion_model.llm_cond_proj": "CachedLinear"}  # the per-run llm_cond_proj cache


def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess, ``models`` a fresh default diffusion_models folder)."""
    import importlib

    import comfy.patcher_extension
    i4 = sys.modules["comfyui_int8_fused.adapters.ideogram4.layout"]
    W = sys.modules["comfyui_int8_fused.quant.fmt_write"]
    pe = sys.modules["comfyui_int8_fused.adapters.ideogram4.pad_elision"]
    config = importlib.import_module(pack.__name__ + ".kernel.config")
    glue = pack.nodes.pad_elision
    from comfy_harness import narrow_ideogram4
    w = narrow_ideogram4()  # ComfyUI's Ideogram 4 config at narrow widths (the loader checks the file against it)
    names = [n for n in i4.linear_specs(1, w) if n.startswith("layers.")]
    q, f = i4.quantize_state_dict(i4.random_state_dict(1, w, seed=0), names)
    W.write_transformerlab(str(models / "one.safetensors"), {"conditional": (q, f), "unconditional": (q, f)})
    del q, f
    node = pack.nodes.loader.LoadIdeogram4Int8()
    key = comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL

    def router(m):
        r = m.model_options.get("transformer_options", {}).get("optimized_attention_override")
        return None if r is None else r.mode

    res = {}
    cond, uncond = node.load("one.safetensors", "fused_triton", "none", "none", attention="math")
    res["router_modes"] = [router(cond), router(uncond)]
    installed = {"fused_triton": bool(cond.get_wrappers(key, glue.KEY))}
    plain, _ = node.load("one.safetensors", "torch_int_mm", "none", "none")
    res["default_router"] = router(plain)
    installed["torch_int_mm"] = bool(plain.get_wrappers(key, glue.KEY))
    with config.override(INT8_FUSED_PAD_ELISION="1"):
        elided, _ = node.load("one.safetensors", "torch_int_mm", "none", "none", attention="math")
    installed["torch_int_mm_on"] = bool(elided.get_wrappers(key, glue.KEY))
    res["elision_installed"] = installed

    g = torch.Generator().manual_seed(5)
    ctx = torch.randn(1, 12, w["text"], generator=g)
    mask = torch.ones(1, 12)
    mask[:, 8:] = 0
    latent = torch.zeros(1, 128, 2, 2)

    def run(m, c, msk):
        extra = {} if msk is None else {"attention_mask": msk}
        return sample_image_only_cfg(m, [[c, extra]], latent, 1, None)  # noqa: F821 (tests/comfy_harness.py)

    r = elided.model_options["transformer_options"]["optimized_attention_override"]
    r.counts.clear()
    pe.stats.clear()
    got = run(elided, ctx, mask)
    res["ran"] = dict(r.counts)
    res["tokens_removed"] = pe.stats.get("tokens_removed", 0)
    ref = run(plain, ctx, mask)  # same file, elision off: ComfyUI's masked computation
    drop = run(plain, ctx[:, :7], None)  # one real token fewer: what a wrong elision would look like

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())
    res["err_elided_vs_masked"] = rel(got, ref)
    res["err_drop_real_token"] = rel(drop, ref)

    # fused_triton: the loader fuses what Apply fuses
    Int8Linear = sys.modules["comfyui_int8_fused.quant.linear"].Int8Linear
    res["patches"] = {k: type(v).__name__ for k, v in cond.object_patches.items()}
    name, blk = next((k, v) for k, v in cond.object_patches.items() if k.endswith("layers.0"))
    dm = cond.model.diffusion_model
    own = {n: m for n, m in dm.named_modules() if isinstance(m, Int8Linear)}
    # the fused block runs the loader's own int8 layers (w1 and w3 merged into one GEMM, as Apply does)
    same = sorted(n for n, m in blk.int8_layers().items() if own.get(f"layers.0.{n}") is m)
    with config.override(INT8_FUSED_FUSION=False):
        unfused, _ = node.load("one.safetensors", "fused_triton", "none", "none", attention="math")
    res["fused"] = {"modules": cond.int8_fused_modules, "patch": [name, type(blk).__name__], "same_layers": same,
                    "unfused_modules": unfused.int8_fused_modules}
    return res
