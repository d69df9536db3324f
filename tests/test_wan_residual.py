"""``kernel.residual.residual_add`` / ``residual_add_layernorm`` / ``residual_add_layernorm_modulate_quantize`` (Wan's
residual tails, issue 13) on the CPU (TRITON_INTERPRET=1), against torch and float64:

* the sum: ``torch.addcmul(x, y, gate)`` (``x + y`` without a gate) computes ``x + y * g`` in fp32 and rounds
  once, as the kernel does; the two agree exactly except where fp32's ``y * g`` rounding (an FMA on one side, not
  the other) moves the result across a rounding midpoint of the dtype: at most one ulp, in at most 1 % of elements
  (without a gate: no product, always equal);
* the LayerNorm with affine against ``F.layer_norm`` of torch's sum: one ulp at most, rarely (the mean / variance
  sum in another order); against float64: within two roundings of the dtype;
* the modulated, quantized LayerNorm against the float64 definition with the tie analysis of
  tests/test_flux_fused.py (``check_within_ties``: codes differ by one only at a rounding tie);
* ``round_product`` (Flux's ``x += y * gate``: two roundings) bit for bit against torch's two ops, in place;
* bad input: mixed dtypes (torch would promote) and rows too long for registers raise ValueError naming the fix;
  no rows: empty outputs;
* the compiled kernel builds for sm_90 in its three modes and both roundings of the sum (fp16, Wan's width), the
  segmented one too (Wan's and Flux's widths);
* every kernel test runs twice: the segmented kernel (``RESIDUAL_LN_ONE_PASS``, the default) and the one-tile one.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import fused_block_helpers as fbh

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(scope="module")
def kf():
    import kernel.ops
    kernel.ops.row_modules()
    return kernel


@pytest.fixture(autouse=True, params=["seg", "single"])
def form(request, monkeypatch, kf):
    """Every test twice: the segmented kernel with segments of 16 and up (so that these small rows take two or
    three: 96 = 64 + 32, 160 = 128 + 32, 192 = 128 + 64, 200 = 128 + 64 + 16), and the one-tile kernel."""
    monkeypatch.setattr(kf.residual, "RESIDUAL_LN_ONE_PASS", kf.quantize.SegmentPlan(max_row=8192, min_seg=16, warps=4)
                        if request.param == "seg" else None)
    seen, real = [], kf.residual.launch

    def spy(fn, grid, args, constexprs, *rest):  # which form ran: S0 > 0 the segments
        seen.append((fn.fn.__name__, constexprs.get("S0", 0) > 0))
        return real(fn, grid, args, constexprs, *rest)
    monkeypatch.setattr(kf.residual, "launch", spy)
    yield request.param
    assert all(seg == (request.param == "seg") for n, seg in seen if n == "_residual_layernorm_kernel"), seen


_ulps = fbh.ulps


def _close_to_torch(got, want, what, scale=None):
    """Equal, or one ulp apart in at most 1 % of the elements (module doc). fp32 (no rounding after fp32's):
    within 2^-23 of ``scale`` (the operands' magnitude; an FMA's skipped rounding is that large)."""
    if got.dtype == FP32:
        assert bool(((got.double() - want.double()).abs() <= 2.0 ** -23 * scale.double()).all()), what
        return
    u = _ulps(got, want)
    assert float(u.max()) <= 1.0, (what, float(u.max()))
    assert float((u > 0).float().mean()) <= 0.01, (what, float((u > 0).float().mean()))


def _operands(dtype, m, k, b, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3 + 0.5).to(dtype)
    y = (torch.randn(m, k, generator=g) * 2).to(dtype)
    gate = (torch.randn(b, 1, k, generator=g) * 0.5).to(dtype)   # Wan's e[i]: [B, 1, C]
    return x, y, gate, g


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("m,k,b", [(12, 96, 2), (5, 200, 1)])
def test_residual_add(kf, dtype, m, k, b):
    x, y, gate, _ = _operands(dtype, m, k, b, m * 31 + k)
    tpb = m // b
    got = kf.residual.residual_add(x, y, gate, tpb)
    want = torch.addcmul(x.view(b, tpb, k), y.view(b, tpb, k), gate).view(m, k)
    assert got.dtype == dtype and got.shape == (m, k)
    yg = y.double() * gate.double().expand(b, tpb, k).reshape(m, k)
    mag = x.double().abs() + yg.abs()
    _close_to_torch(got, want, "addcmul", mag)
    # float64: the exact value rounded once to the dtype (fp32: plus the product's rounding, if not fused)
    want64 = x.double() + yg
    tol = torch.finfo(dtype).eps * (want64.abs() if dtype != FP32 else mag)
    assert bool(((got.double() - want64).abs() <= tol).all())
    assert torch.equal(kf.residual.residual_add(x, y), x + y)  # no gate: one fp32 add, one rounding: bit for bit


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("affine", [True, False])
def test_residual_add_layernorm(kf, dtype, affine):
    m, k, b = 10, 160, 2
    x, y, gate, g = _operands(dtype, m, k, b, 5 + affine)
    w = (1 + 0.3 * torch.randn(k, generator=g)).to(dtype) if affine else None
    bias = (0.2 * torch.randn(k, generator=g)).to(dtype) if affine else None
    r, n = kf.residual.residual_add_layernorm(x, y, gate, m // b, 1e-6, w, bias)
    r_t = torch.addcmul(x.view(b, -1, k), y.view(b, -1, k), gate).view(m, k)
    _close_to_torch(r, r_t, "sum", x.double().abs() + (y.double().view(b, -1, k) * gate.double()).abs().view(m, k))
    want = F.layer_norm(r, (k,), w, bias, 1e-6)  # of the kernel's own sum: the norm alone
    # fp32: the mean / variance add K terms in another order: ~log2(K) ulps of the data's scale (|r| / std ~ 4,
    # after the normalization ~1) on top of the value's own ulps
    _close_to_torch(n, want, "layer_norm", 2 * want.double().abs() + 32)
    r64 = r.double()
    n64 = (r64 - r64.mean(-1, keepdim=True)) / torch.sqrt(r64.var(-1, unbiased=False, keepdim=True) + 1e-6)
    if affine:
        n64 = n64 * w.double() + bias.double()
    # bf16 / fp16: the fp32 math's error is far below one rounding (two roundings allowed); fp32: as above
    eps = torch.finfo(dtype).eps
    tol = 2 * eps * (n64.abs() + 1e-3) if dtype != FP32 else 32 * eps * (n64.abs() + 1)
    assert bool(((n.double() - n64).abs() <= tol).all())


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,smooth", [(BF16, False), (FP16, True), (FP32, False)])
def test_residual_add_layernorm_modulate_quantize(kf, dtype, smooth):
    import test_flux_fused as tf
    m, k, b = 12, 192, 3
    x, c, _, g = _operands(dtype, m, k, b, 17)
    mod = (torch.randn(b, 1, 2 * k, generator=g) * 0.4).to(dtype)
    shift, scale = mod[..., :k], mod[..., k:]                  # views of one modulation tensor, as Wan's chunks
    inv = (0.5 + torch.rand(k, generator=g)) if smooth else None
    r, q, s = kf.residual.residual_add_layernorm_modulate_quantize(x, c, None, m // b, 1e-6, scale, shift, inv)
    assert torch.equal(r, x + c)
    y_ideal, marked = tf.layernorm_modulate_ideal(x + c, scale, shift, m // b)
    tf.check_within_ties(q, s, y_ideal, marked, dtype, inv, "residual + layernorm_modulate")
    # and what the separate kernel gives on torch's sum (the fused blocks' unfused twin): the same codes but at ties
    q2, s2 = kf.norm.layernorm_modulate_quantize(x + c, scale, shift, m // b, inv, 1e-6)
    assert int((q.int() - q2.int()).abs().max()) <= 1


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_round_product_in_place(kf, dtype):
    """Flux's ``x += y * gate`` (two torch ops: the product rounds to the dtype, then the sum): bit for bit, written
    into x itself (``out=x``); and with the next LayerNorm · modulation + quantization, codes as the separate kernel
    gives them on torch's sum."""
    m, k, b = 8, 96, 2
    x, y, gate, g = _operands(dtype, m, k, b, 23)
    want = (x.view(b, -1, k) + y.view(b, -1, k) * gate).view(m, k)  # torch's two ops
    x1 = x.clone()
    r = kf.residual.residual_add(x1, y, gate, m // b, round_product=True, out=x1)
    assert r.data_ptr() == x1.data_ptr() and torch.equal(x1, want)
    mod = (torch.randn(b, 1, 2 * k, generator=g) * 0.4).to(dtype)
    x2 = x.clone()
    r, q, s = kf.residual.residual_add_layernorm_modulate_quantize(x2, y, gate, m // b, 1e-6, mod[..., k:], mod[..., :k],
                                                          None, round_product=True, out=x2)
    assert torch.equal(x2, want)
    q2, s2 = kf.norm.layernorm_modulate_quantize(want, mod[..., k:], mod[..., :k], m // b, None, 1e-6)
    assert int((q.int() - q2.int()).abs().max()) <= 1 and torch.allclose(s, s2, rtol=2.0 ** -7, atol=0)
    with pytest.raises(ValueError, match="out must be"):
        kf.residual.residual_add(x, y, gate, m // b, out=x.t())


@pytest.mark.interpreter
def test_bad_input_and_empty_rows(kf):
    x = torch.randn(4, 32).to(BF16)
    with pytest.raises(ValueError, match="promote"):
        kf.residual.residual_add(x, x.half())
    with pytest.raises(ValueError, match="promote"):
        kf.residual.residual_add(x, x, torch.ones(1, 32, dtype=FP32), 4)
    with pytest.raises(ValueError, match="registers"):
        big = torch.zeros(1, kf.rowtile.MAX_SINGLE + 1, dtype=BF16)
        kf.residual.residual_add_layernorm(big, big, None, 1, 1e-6)
    with pytest.raises(ValueError, match="batch rows"):
        kf.residual.residual_add(x, x, torch.ones(3, 32, dtype=BF16), 2)
    e = torch.empty(0, 32, dtype=BF16)
    r, q, s = kf.residual.residual_add_layernorm_modulate_quantize(e, e, None, 1, 1e-6, torch.zeros(1, 32, dtype=BF16),
                                                          torch.zeros(1, 32, dtype=BF16))
    assert r.shape == (0, 32) and q.shape == (0, 32) and s.shape == (0,)


def _hopper_check() -> str:
    """Builds ``_residual_layernorm_kernel`` for sm_90 in its three modes, the sum with one or two roundings (fp16,
    K 1536 -> one 2048 tile)."""
    import inspect

    import kernel.residual as kres
    fn = kres._residual_layernorm_kernel
    types = {p: "*fp16" for p in inspect.signature(fn.fn).parameters if p.endswith("_ptr")}
    types.update(inv_ptr="*fp32", q_ptr="*i8", qs_ptr="*fp32", eps="fp32")
    for mode, extra in ((0, {}), (0, {"ROUND_PRODUCT": True}), (1, {"HAS_W": True, "HAS_B": True}),
                        (2, {"HAS_SMOOTH": True, "HAS_GATE": True, "ROUND_PRODUCT": True})):
        consts = {"HAS_GATE": mode != 2, "ROUND_PRODUCT": False, "MODE": mode, "HAS_W": False, "HAS_B": False,
                  "HAS_SMOOTH": False, "DT": 2, "SCALE_DT": 2, "PROD_DT": 2, "SCALE_RECIP": True, "BLOCK": 2048,
                  "INTERPRET": False}
        problem = fbh.build_sm90(fn, types, {**consts, **extra, "S0": 0, "S1": 0, "S2": 0}, num_warps=4)
        if problem:
            return problem
        # the segmented kernel: Wan 1.3B's K 1536 = 1024 + 512 (fp16), Flux's 3072 = 2048 + 1024 (bf16)
        consts["BLOCK"] = 0
        for dt, ty, segs in ((2, "*fp16", (1024, 512, 0)), (1, "*bf16", (2048, 1024, 0))):
            seg_types = {p: (ty if v == "*fp16" else v) for p, v in types.items()}
            problem = fbh.build_sm90(fn, seg_types,
                                     {**consts, **extra, "DT": dt, "SCALE_DT": dt, "PROD_DT": dt,
                                      "S0": segs[0], "S1": segs[1], "S2": segs[2]}, num_warps=4)
            if problem:
                return problem
    return "OK"


def test_residual_kernel_compiles_for_hopper():
    """In a subprocess without TRITON_INTERPRET (under it kernels are not compilable); skipped without ptxas."""
    fbh.hopper_check_in_subprocess("test_wan_residual")
