"""Fused Chroma and Chroma Radiance blocks (adapters/flux/external_mod.py) on the CPU (TRITON_INTERPRET=1).

Chroma (``comfy.ldm.chroma.model.Chroma``) and Chroma Radiance (its subclass, pixel space with a NeRF head) run
ComfyUI's Flux ``DoubleStreamBlock`` / ``SingleStreamBlock`` with ``modulation=False``: each block gets its slices
of one approximator output (``ChromaModulationOut`` [B, 1, K] views). The Flux adapter serves both (Chroma's class
is in its model classes; Radiance matches through ``__mro__``) and fuses these blocks as
``ExternalModDoubleBlock`` / ``ExternalModSingleBlock``: Flux.1's fused blocks with the modulation taken from
``vec``. A tiny model of each (width 128, 2 heads; Chroma 2 double + 2 single blocks, so block 1 reads its own
slices; Radiance 1 + 1) is built through ComfyUI's model config (``model_base.Chroma`` / ``ChromaRadiance``),
pinned 0.3.75 in-process and the current ComfyUI (COMFYUI_CURRENT, 0.33.0) in a subprocess, and goes through the
Apply node and ComfyUI's ModelPatcher:

* Apply's object patches are the fused blocks (every double and single block), and Save's view of the INT8 layers
  is the per-linear one;
* the fused forward ran (no fallback to ComfyUI's block forward): the norm · modulation kernel once per stream of
  each double block and once per single block, the MLP input of each double-block stream from the residual-tail
  kernel (also for Radiance, whose img enters the first block as a transposed conv output);
* ``apply_model`` output vs the per-linear INT8 model (the same Apply with ``INT8_FUSED_FUSION=0``) within
  ``REL_MODEL``, derived as in tests/test_flux_external_mod_fused.py: the fused blocks are Flux.1's (same kernels,
  same roundings as ComfyUI's ops), so every GEMM receives the per-linear path's int8 codes; what remains is fp32
  op order in the float glue (0 on the CPU) and, on a GPU, a rare +-1 code (rate p < 1e-3) moving a GEMM output by
  about sqrt(p) * crest / 127 <= 0.03 * 4 / 127 ~ 1e-3 relative. Against the float model the INT8 error is larger
  (< 5e-2).

Run: bash scripts/test.sh tests/test_chroma_fused.py
"""
import dataclasses

import pytest
import torch

import fused_block_helpers as fbh

REL_MODEL = 2e-3
BF16 = torch.bfloat16

# unet_config keys as comfy/model_detection.py sets them for Chroma (widths reduced); the Approximator's input is
# 16 + 16 + 32 = 64 wide and its output the hidden size. Keys a ComfyUI's params class lacks are dropped.
CHROMA = {"in_channels": 64, "out_channels": 64, "context_in_dim": 64, "hidden_size": 128, "mlp_ratio": 4.0,
          "num_heads": 2, "depth": 2, "depth_single_blocks": 2, "axes_dim": [8, 28, 28], "theta": 10000,
          "patch_size": 2, "qkv_bias": True, "in_dim": 64, "out_dim": 128, "hidden_dim": 64, "n_layers": 2,
          "txt_ids_dims": [], "vec_in_dim": None}
RADIANCE = {**CHROMA, "in_channels": 3, "out_channels": 3, "patch_size": 4, "depth": 1, "depth_single_blocks": 1,
            "nerf_hidden_size": 16, "nerf_mlp_ratio": 2, "nerf_depth": 1, "nerf_max_freqs": 4, "nerf_tile_size": 0,
            "nerf_final_head_type": "linear", "nerf_embedder_dtype": torch.float32, "use_x0": False,
            "use_sequential_txt_ids": False}


def tiny_chroma(dtype, radiance=False, seed=0):
    """The BaseModel of a tiny Chroma (or Chroma Radiance) from the running ComfyUI's model config, random
    weights."""
    import comfy.ldm.chroma.model as chroma
    import comfy.ldm.chroma_radiance.model as radiance_model
    import comfy.model_detection
    params = radiance_model.ChromaRadianceParams if radiance else chroma.ChromaParams
    names = {f.name for f in dataclasses.fields(params)}
    cfg = {"image_model": "chroma_radiance" if radiance else "chroma",
           **{k: v for k, v in (RADIANCE if radiance else CHROMA).items() if k in names}}
    mc = comfy.model_detection.model_config_from_unet_config(cfg)
    mc.set_inference_dtype(dtype, None)
    model = mc.get_model({}, "", device=torch.device("cpu"))
    fbh.randomize(model.diffusion_model, seed)
    return model


def _inputs(radiance, b=2, seed=1):
    """(x, sigma, context, guidance): latents [B, 16, 8, 8] (Radiance: pixels [B, 3, 16, 16])."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((b, 3, 16, 16) if radiance else (b, 16, 8, 8), generator=g)
    return x, torch.tensor([0.8, 0.4][:b]), torch.randn(b, 6, 64, generator=g), torch.zeros(b)


def chroma_apply(pack, radiance=False) -> dict:
    """Apply (fused and ``INT8_FUSED_FUSION=0``) on a tiny Chroma through ComfyUI's ModelPatcher."""
    import comfy.model_management as mm
    import comfy.model_patcher
    qf = pack.quant.blocks
    model = tiny_chroma(BF16, radiance)
    dm = model.diffusion_model
    cpu = torch.device("cpu")
    mp = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    apply = pack.nodes.apply.ApplyFusedInt8GEMM()
    (fused,) = apply.apply(mp, "fused_triton")
    with qf.config.override(INT8_FUSED_FUSION=False):
        (plain,) = apply.apply(mp, "fused_triton")
    blocks = {k[len("diffusion_model."):]: type(v).__name__ for k, v in fused.object_patches.items()
              if k.count(".") == 2}
    x, sigma, ctx, guidance = _inputs(radiance)
    ln, calls = qf.ln_mod_quant, []

    def spy(*a):
        calls.append(1)
        return ln(*a)

    def run(m, count=False):
        mm.load_models_gpu([m])
        qf.ln_mod_quant = spy if count else ln
        try:
            with torch.no_grad():
                return m.model.apply_model(x, sigma, c_crossattn=ctx, guidance=guidance).float()
        finally:
            qf.ln_mod_quant = ln

    try:
        flt = run(mp)
        got, ref = run(fused, True), run(plain)
        mm.unload_all_models()
        unpatched = torch.equal(run(mp), flt)
    finally:
        mm.unload_all_models()
    return {"adapter": pack.adapters.adapter_for(dm).name, "model": type(dm).__name__, "blocks": blocks,
            "depth": [dm.params.depth, dm.params.depth_single_blocks], "ln_calls": len(calls),
            "same_layers": set(pack.nodes.weights.int8_layers(fused)) == set(pack.nodes.weights.int8_layers(plain)),
            "rel": fbh.rel(got, ref), "rel_float": fbh.rel(ref, flt), "unpatched": unpatched}


def _check(res, model):
    assert res["adapter"] == "flux" and res["model"] == model, res
    d, s = res["depth"]
    assert res["blocks"] == {**{f"double_blocks.{i}": "ExternalModDoubleBlock" for i in range(d)},
                             **{f"single_blocks.{i}": "ExternalModSingleBlock" for i in range(s)}}, res
    assert res["same_layers"] and res["unpatched"], res
    # img and txt qkv of each double block, linear1 of each single (mlp.0's input comes with the residual sum)
    assert res["ln_calls"] == 2 * d + s, res
    assert res["rel"] <= REL_MODEL and res["rel_float"] < 5e-2, res


# ----------------------------------------------------------------------------------- pinned ComfyUI (in-process)
@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("radiance", [False, True], ids=["chroma", "chroma_radiance"])
def test_tiny_chroma_fused_vs_per_linear_pinned(pack, radiance):
    res = chroma_apply(pack, radiance)
    print(res)
    _check(res, "ChromaRadiance" if radiance else "Chroma")


# ----------------------------------------------------------------------------------- current ComfyUI (subprocess)
def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    from comfyui_version import __version__
    return {"comfyui": __version__, "chroma": chroma_apply(pack), "radiance": chroma_apply(pack, True)}


def test_tiny_chroma_fused_on_the_current_comfyui(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res)
    _check(res["chroma"], "Chroma")
    _check(res["radiance"], "ChromaRadiance")
