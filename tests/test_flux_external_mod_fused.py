"""Flux blocks with modulation passed in (adapters/flux/external_mod.py): Flux.2 (``global_modulation``, SiLU-gated
MLPs) on the tiny Flux of test_flux_fused, pinned 0.3.75 in-process and current ComfyUI (0.33.0) in a subprocess.

Bound, derived: the fused blocks are Flux.1's (same kernels, same roundings as ComfyUI's ops, RoPE rotations fp32 as
ComfyUI's own), and ``silu(a) * b`` + quantization rounds as torch's two ops (``swiglu_quantize``); the int8 codes
every GEMM receives equal the per-linear path's, leaving fp32 op order in the float glue: REL_MODEL as Flux.1's.
A ``modulation_dims`` call runs ComfyUI's own forward on the twin.

Run: bash scripts/test.sh tests/test_flux_external_mod_fused.py
"""
import pytest
import torch

import fused_block_helpers as fbh

REL_MODEL = 2e-3
BF16 = torch.bfloat16


def flux2_equivalence(pack) -> dict:
    import test_flux_fused as tf
    A, cfg = pack.adapters, pack.quant.blocks.config
    dm = tf.tiny_flux(BF16, depth=1, single=1, global_modulation=True, mlp_silu_act=True, ops_bias=False,
                      qkv_bias=False, vec_in_dim=None)
    layers = fbh.int8_layers(pack, dm)
    patches = A.object_patches(dm, layers)
    with cfg.override(INT8_FUSED_FUSION=False):
        plain = A.object_patches(dm, layers)
    back = A.int8_layers_of(patches)
    x, t, ctx, _ = tf._inputs(BF16)
    with torch.no_grad():
        ref, got, flt = fbh.swapped(dm, plain)(x, t, ctx), fbh.swapped(dm, patches)(x, t, ctx), dm(x, t, ctx)
    return {"adapter": A.adapter_for(dm).name, "kinds": sorted({type(m).__name__ for m in patches.values()}),
            "fused": sorted(k for k in patches if k.count(".") == 1), "same_layers": back.keys() == layers.keys(),
            "rel": fbh.rel(got, ref), "rel_float": fbh.rel(ref, flt)}


def _check(res):
    assert res["adapter"] == "flux", res
    assert res["kinds"] == ["ExternalModDoubleBlock", "ExternalModSingleBlock"], res
    assert res["fused"] == ["double_blocks.0", "single_blocks.0"] and res["same_layers"], res
    assert res["rel"] <= REL_MODEL and res["rel_float"] < 5e-2, res


@pytest.mark.interpreter
def test_flux2_fused_vs_per_linear_pinned(pack):
    res = flux2_equivalence(pack)
    print(res)
    _check(res)


def body(pack, models) -> dict:
    from comfyui_version import __version__
    return {"comfyui": __version__, "flux2": flux2_equivalence(pack)}


def test_flux2_fused_on_the_current_comfyui(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res)
    _check(res["flux2"])
