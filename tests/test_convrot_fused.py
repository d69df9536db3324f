"""ConvRot layers inside fused blocks (issue 39 item 1: the rotation fused with the block's norm).

1. ``kernel.hadamard.layernorm_modulate_hadamard_quantize`` against ComfyUI's unfused sequence: torch's
   ``F.layer_norm`` and ``addcmul`` in the model dtype, then ``hadamard_quantize`` (checked against a float64
   Hadamard in tests/test_convrot.py). Tolerance, derived: the kernel computes the same roundings; only its fp32
   mean / variance sum order differs from torch's, which can move a value lying within a few fp32 ulps of a
   dtype rounding boundary by one dtype ulp. One such move shifts the group's rotated values by at most
   ulp / sqrt(G), far below an int8 step, so a code can flip by 1 only where it sat on a rounding midpoint: codes
   equal except at most 1 % of them by +-1, scales within 2^-12. Also zero rows, NaN / Inf rows, refusals.
2. Tiny Flux.1 and Wan 2.1 (ComfyUI's classes, pinned 0.3.75 in-process) with ConvRot layers on fused_triton
   (Wan: every block linear; Flux.1: the LayerNorm-fed ones, beside unrotated INT8 layers): the adapters build fused blocks, the LayerNorm-fed layers get their input from the new kernel
   (Wan's q / k / v from one call), and the whole model equals the per-linear ConvRot path (ComfyUI's torch norm,
   then each layer's rotate + quantize kernel) within ``REL_MODEL``, as the unrotated fused blocks do.

Run: TRITON_INTERPRET=1 .runtime/venv/bin/python -m pytest tests/test_convrot_fused.py -q
"""
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import fused_block_helpers as fbh  # noqa: E402

REL_MODEL = 2e-3
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels on the CPU (TRITON_INTERPRET=1)")


@pytest.fixture(scope="module")
def hd():
    from kernel import hadamard
    return hadamard


def _unfused(hd, x, scale, shift, group, eps=1e-6):
    """ComfyUI's sequence: the model-dtype LayerNorm and addcmul, then the ConvRot layer's rotate + quantize."""
    m, k = x.shape
    b = scale.reshape(-1, k).shape[0]
    y = torch.addcmul(shift.reshape(b, 1, k), F.layer_norm(x, (k,), eps=eps).reshape(b, -1, k),
                      1 + scale.reshape(b, 1, k))
    return hd.hadamard_quantize(y.reshape(m, k), group)


def _close(q, s, rq, rs):
    d = (q.int() - rq.int()).abs()
    ok = torch.isfinite(rs)
    assert d.max() <= 1 and (d > 0).float().mean() <= 0.01, (d.max(), (d > 0).float().mean())
    assert torch.equal(s.isnan(), rs.isnan())
    assert ((s[ok] - rs[ok]).abs() <= 2.0 ** -12 * rs[ok].abs()).all()


@needs_interpreter
@pytest.mark.parametrize("dtype,group,m,k,b", [(BF16, 64, 37, 192, 1), (BF16, 256, 20, 512, 2), (BF16, 16, 12, 48, 3),
                                               (FP16, 64, 9, 128, 3), (FP32, 256, 8, 256, 2)])
def test_kernel_against_unfused_sequence(hd, dtype, group, m, k, b):
    g = torch.Generator().manual_seed(m * 100 + k)
    x = (torch.randn(m, k, generator=g) * 2 + 0.7)
    x[:, 5] *= 25.0                                   # an outlier channel: what the rotation is for
    x = x.to(dtype)
    mod = (torch.randn(b, 1, 3 * k, generator=g) * 0.4).to(dtype)  # Flux's ModulationOut: views of one output
    shift, scale = mod[..., :k], mod[..., k:2 * k]
    q, s = hd.layernorm_modulate_hadamard_quantize(x, scale, shift, m // b, group)
    assert q.dtype == torch.int8 and q.shape == (m, k) and s.dtype == torch.float32 and s.shape == (m,)
    _close(q, s, *_unfused(hd, x, scale, shift, group))


@needs_interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (the interpreter) on NaN / Inf rows
def test_kernel_zero_nan_rows_and_refusals(hd):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 128, generator=g).to(BF16)
    zero = torch.zeros(1, 128, dtype=BF16)
    x[1] = 0
    x[3, 7] = float("nan")
    x[4, 9] = float("inf")
    q, s = hd.layernorm_modulate_hadamard_quantize(x, zero, zero, 6, 64)
    assert s[1] == 0 and not q[1].any()                                # norm of a zero row with zero shift: 0
    assert all(math.isnan(s[i]) and not q[i].any() for i in (3, 4))    # NaN / Inf: scale NaN, zeros
    ok = [0, 2, 5]
    rq, rs = _unfused(hd, x[ok], zero, zero, 64)
    _close(q[ok], s[ok], rq, rs)                                       # the other rows untouched
    q, s = hd.layernorm_modulate_hadamard_quantize(x[:0], zero, zero, 1, 64)
    assert q.shape == (0, 128) and s.shape == (0,)
    with pytest.raises(ValueError, match="group size 64 does not divide the input width K = 96"):
        hd.layernorm_modulate_hadamard_quantize(torch.randn(2, 96), torch.zeros(1, 96), torch.zeros(1, 96), 2, 64)
    with pytest.raises(ValueError, match="group size 128 is not supported"):
        hd.layernorm_modulate_hadamard_quantize(x, zero, zero, 6, 128)
    with pytest.raises(ValueError, match="scale has 4 batch rows"):
        hd.layernorm_modulate_hadamard_quantize(x, torch.zeros(4, 128), torch.zeros(4, 128), 6, 64)


# ------------------------------------------------------------------------------ 2. tiny Flux.1 / Wan, pinned
def _rotated_layers(pack, dm, only=()) -> dict:
    """{name: layer} of ``dm``'s block linears on fused_triton: ConvRotLinear as Apply's ``rotation: convrot`` builds
    them (the float weight rotated in float64, quantized per channel), or, for names not ending in one of ``only``
    (when given), plain Int8Linear."""
    A, convrot = pack.adapters, pack.quant.convrot
    pairs = pack.quant.select.select_linears(dm, "blocks", rules=A.block_rules(dm))
    groups = {n: convrot.group_for(m.in_features) for n, m in pairs if not only or n.endswith(only)}
    assert groups and all(groups.values())
    layers = pack.quant.patch.build_int8_layers(
        pairs, "fused_triton", weight_fn=lambda n, m: convrot.rotate(m.weight.detach().float(), groups[n],
                                                                     torch.float64)
        if n in groups else m.weight.detach().float())[0]
    return {n: convrot.ConvRotLinear.of(m, groups[n]) if n in groups else m for n, m in layers.items()}


def _equivalence(pack, dm, run, only=()) -> dict:
    A, cfg, qb = pack.adapters, pack.quant.blocks.config, pack.quant.blocks
    layers = _rotated_layers(pack, dm, only)
    patches = A.object_patches(dm, layers)
    with cfg.override(INT8_FUSED_FUSION=False):
        plain = A.object_patches(dm, layers)
    hmod = qb.kernels().hadamard
    real, calls = hmod.layernorm_modulate_hadamard_quantize, []

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    with torch.no_grad():
        ref = run(fbh.swapped(dm, plain))
        hmod.layernorm_modulate_hadamard_quantize = spy
        try:
            with fbh.unplanned(qb.kernels().plan):
                got = run(fbh.swapped(dm, patches))
        finally:
            hmod.layernorm_modulate_hadamard_quantize = real
        again = run(fbh.swapped(dm, patches))  # prepared calls re-issue the kernel: the same bits
    return {"kinds": sorted({type(m).__name__ for m in patches.values()}), "plain_is_per_linear": plain == layers,
            "rotated": sum(getattr(m, "rotation", 0) > 0 for m in layers.values()), "layers": len(layers),
            "calls": len(calls), "rel": fbh.rel(got, ref), "again_equal": bool(torch.equal(again, got))}


@needs_interpreter
def test_tiny_flux_convrot_fused_pinned(pack):
    """Flux.1 blocks whose LayerNorm-fed layers are ConvRot and the others not (Flux blocks with no unrotated INT8
    layer stay per-linear: module doc of adapters/flux)."""
    from test_flux_fused import _inputs, tiny_flux
    dm = tiny_flux(BF16)
    x, t, ctx, y = _inputs(BF16)
    fed = ("attn.qkv", "mlp.0", "linear1")
    res = _equivalence(pack, dm, lambda m: m(x, t, ctx, y=y), fed)
    print(res)
    assert res["kinds"] == ["FusedFluxDoubleBlock", "FusedFluxSingleBlock"] and res["plain_is_per_linear"], res
    assert res["rotated"] == 4 * dm.params.depth + dm.params.depth_single_blocks, res
    # per double block: img / txt qkv and img / txt mlp.0 (the residual tail kernel takes no ConvRot layer); per
    # single block: linear1
    double, single = dm.params.depth, dm.params.depth_single_blocks
    assert res["calls"] == 4 * double + single, res
    assert res["rel"] <= REL_MODEL and res["again_equal"], res


@needs_interpreter
def test_tiny_wan_convrot_fused_pinned(pack):
    from test_wan_fused import _inputs, tiny_wan
    dm = tiny_wan(BF16, layers=2)
    x, t, ctx = _inputs(BF16)
    res = _equivalence(pack, dm, lambda m: m(x, t, ctx))
    print(res)
    assert res["kinds"] == ["FusedWanBlock"] and res["plain_is_per_linear"], res
    assert res["rotated"] == res["layers"] > 0, res
    assert res["calls"] == 2 * len(dm.blocks), res  # q / k / v share one rotated input; ffn.0 its own
    assert res["rel"] <= REL_MODEL and res["again_equal"], res
