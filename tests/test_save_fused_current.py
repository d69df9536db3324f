"""Save INT8 Model of an Ideogram 4 that Apply fused on ``fused_triton`` writes every tensor of the model (issue 35,
item 1), on a current ComfyUI (0.33.0; skipped naming COMFYUI_CURRENT without it), on the CPU.

On ``fused_triton`` Apply patches Ideogram 4 with the adapter's object patches: fused blocks and a per-run cache
(``CachedLinear``) over the float ``llm_cond_proj`` linear that covers no INT8 layer. Save used to collect the
layers the fused modules cover and not the float linear inside the cache, so both formats lacked
``llm_cond_proj.weight``/``.bias``: the pack's loader refused the file and plain ComfyUI crashed when sampling. On
the CPU this path is the real one: ``fused_triton`` is offered under the Triton interpreter (TRITON_INTERPRET=1),
so Apply builds exactly what it builds on a GPU (no kernel runs while building or saving).

One 1-layer Ideogram 4 at narrow widths (ComfyUI's config narrowed: ``comfy_harness.narrow_ideogram4``), random
bf16 weights, loaded by ComfyUI from its
state dict, through Apply Fused INT8 GEMM (defaults) and Save INT8 Model (both formats). Checked: every key of the
float model's state dict is in each file (for the int8 layers of the pack format as ``<layer>.qweight``), the pack's
loader loads the pack file (and its MODEL deep-clones for MultiGPU CFG Split with INT8 layers of its own), and plain ComfyUI loads and samples the core-format file (1 step, a 2 x 2 latent)
within the W8A8 bound of the float model (test_ideogram4_current.py: <= 5 %).
"""
import json

import pytest
import torch

BOUND = 0.05


def test_save_of_a_fused_ideogram4_holds_every_tensor(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(json.dumps(res, indent=1))
    assert res["patches"]["diffusion_model.llm_cond_proj"] == "CachedLinear"  # the wrapping fused_triton builds
    assert res["cache_covers"] == []  # over the float linear: nothing INT8 inside
    for fmt in ("int8_fused", "comfy_int8_tensorwise"):
        assert res[fmt]["missing"] == [], (fmt, res[fmt]["missing"])
        assert res[fmt]["llm_cond_proj"] == ["llm_cond_proj.bias", "llm_cond_proj.weight"], fmt
        assert res[fmt]["equal_floats"], fmt  # the float tensors are the model's, bit for bit
    assert res["pack_load"]["llm_cond_proj_equal"] is True
    mg = res["multigpu_clone"]
    assert mg["own_model"] and mg["layers"] > 0 and mg["same_names"] and mg["shared"] == 0 and mg["codes_equal"], mg
    assert mg["non_dynamic_layers"] == mg["layers"], mg
    assert res["core_load"]["llm_cond_proj_weight"] is True
    assert 0 < res["core_vs_float"] <= BOUND


def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess, ``models`` a fresh default diffusion_models folder)."""
    import comfy.sd
    from comfy_harness import narrow_ideogram4
    from safetensors import safe_open
    w = narrow_ideogram4()
    sd = pack.adapters.ideogram4.layout.random_state_dict(1, w, seed=0)  # Ideogram 4's keys, random bf16 weights
    model = comfy.sd.load_diffusion_model_state_dict(dict(sd), {"dtype": torch.bfloat16})
    float_sd = {k: v for k, v in model.model.diffusion_model.state_dict().items()}
    assert set(float_sd) == set(sd), sorted(set(float_sd) ^ set(sd))[:8]
    (applied,) = pack.nodes.apply.ApplyFusedInt8GEMM().apply(model, "fused_triton")
    res = {"patches": {k: type(v).__name__ for k, v in applied.object_patches.items()},
           "cache_covers": list(applied.object_patches["diffusion_model.llm_cond_proj"].covers)}
    save = pack.nodes.save.SaveInt8Model()
    paths = {}
    for fmt in ("int8_fused", "comfy_int8_tensorwise"):
        (paths[fmt],) = save.save(applied, f"fused_{fmt}", fmt, False, "blocks")["result"]
        with safe_open(paths[fmt], framework="pt") as f:
            keys = set(f.keys())
            int8 = {k.rsplit(".", 1)[0] for k in keys if k.endswith((".qweight", ".comfy_quant"))}
            packed = int8 if fmt == "int8_fused" else set()  # core keeps <layer>.weight (int8) and .bias
            missing = sorted(k for k in float_sd if k not in keys and k.rpartition(".")[0] not in packed)
            floats = [k for k in float_sd if k in keys and k.rpartition(".")[0] not in int8]
            equal = all(torch.equal(f.get_tensor(k), float_sd[k].cpu()) for k in floats)
        res[fmt] = {"missing": missing, "llm_cond_proj": sorted(k for k in keys if k.startswith("llm_cond_proj.")),
                    "equal_floats": equal and len(floats) > 0}
    del applied

    # the pack's loader takes the pack file (it used to raise CheckpointError: llm_cond_proj missing)
    ours, _ = pack.nodes.loader.load_ideogram4(paths["int8_fused"], "dequant_bf16", None, None)
    lin = ours.model.diffusion_model.llm_cond_proj
    res["pack_load"] = {"llm_cond_proj_equal": all(
        torch.equal(getattr(lin, a).float().cpu(), float_sd[f"llm_cond_proj.{a}"].float()) for a in ("weight", "bias"))}
    # MultiGPU CFG Split's deep clone of the loader's MODEL (issue 51): the loader records how to build it again
    # (cached_patcher_init), so the clone holds a model and INT8 layers of its own, with the same codes
    Int8Linear = pack.quant.linear.Int8Linear
    clone = ours.deepclone_multigpu(new_load_device=torch.device("cpu"))

    def layers(p):
        return {n: m for n, m in p.model.diffusion_model.named_modules() if isinstance(m, Int8Linear)}
    a, b = layers(ours), layers(clone)
    res["multigpu_clone"] = {
        "own_model": clone.model is not ours.model, "layers": len(a), "same_names": sorted(a) == sorted(b),
        "shared": sum(b[n] is a[n] or b[n].qweight.data_ptr() == a[n].qweight.data_ptr() for n in a if n in b),
        "codes_equal": all(torch.equal(a[n].qweight, b[n].qweight) and torch.equal(a[n].weight_scale, b[n].weight_scale)
                           for n in a if n in b)}
    # ComfyUI's non-DynamicVRAM delegate (TorchCompileModel) calls the factory with disable_dynamic=True
    fn, args = ours.cached_patcher_init[:2]
    res["multigpu_clone"]["non_dynamic_layers"] = len(layers(fn(*args, disable_dynamic=True)))
    del ours, clone
    # plain ComfyUI takes the core file and samples it (it used to fail in _backbone: llm_cond_proj.weight None)
    core = comfy.sd.load_diffusion_model(paths["comfy_int8_tensorwise"], model_options={"dtype": torch.bfloat16})
    res["core_load"] = {"llm_cond_proj_weight": core.model.diffusion_model.llm_cond_proj.weight is not None}
    g = torch.Generator().manual_seed(5)
    positive = [[torch.randn(1, 4, w["text"], generator=g), {}]]
    latent = torch.zeros(1, 128, 2, 2)
    out_core = sample_image_only_cfg(core, positive, latent, 1, None)  # noqa: F821 (tests/comfy_harness.py)
    out_float = sample_image_only_cfg(model, positive, latent, 1, None)  # noqa: F821
    res["core_vs_float"] = float((out_core.double() - out_float.double()).norm() / out_float.double().norm())
    return res
