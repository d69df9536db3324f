"""Issue 8 fusions on the CPU (TRITON_INTERPRET=1): the producer-fused quantization kernels against their
torch definition and against the unfused torch sequence, the fused FeedForward / Ideogram 4 block against
the per-linear INT8 path (built by the Lumina 2 and Ideogram 4 adapters, on stand-ins of ComfyUI's classes; the real
classes: tests/test_adapters.py), and the llm_cond_proj cache.

Run: TRITON_INTERPRET=1 .runtime/venv/bin/python -m pytest tests/test_fused.py -q
"""
import dataclasses
import functools
import math
import os
import sys
import types
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

import adapters  # noqa: E402
from adapters import ideogram4, lumina2  # noqa: E402
from quant import blocks as qf  # noqa: E402
from quant import cached_linear  # noqa: E402
from quant.linear import Int8Linear  # noqa: E402
from quant.quantize import quantize_per_token_ref  # noqa: E402

import fused_block_helpers as fbh  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# CPU under the interpreter (CI); on a CUDA machine without TRITON_INTERPRET the same tests check the compiled
# kernels against torch's CUDA ops (exact equalities then become flip-rate bounds: sum order, rsqrt).
DEV = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
EXACT = DEV == "cpu"
pytestmark = pytest.mark.interpreter  # conftest: skipped only where neither the interpreter nor a CUDA GPU runs them


@pytest.fixture(scope="module")
def kf():
    import kernel.ops
    kernel.ops.row_modules()
    return kernel


def _flips(q, ref):
    d = (q.int() - ref.int()).abs()
    return (d > 0).float().mean().item(), d.max().item()


def _assert_within_rounding(got, ref, rel=5e-3):
    """Fused vs per-linear INT8 output: equal except where an activation code flipped by 1 (an ulp-level
    exp / sum-order difference crossing a rounding boundary), which moves that row by ~1/127 of a step."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < rel, f"fused output differs from the per-linear INT8 path by {err:.2e} (rel L2)"


def _rand(shape, dtype, gen, std=2.0):
    return (torch.randn(shape, generator=gen) * std).to(dtype).to(DEV)


# ----------------------------------------------------------------------------------- kernels
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _spy_launches(mod, monkeypatch):
    """Records the constexprs (BLOCK, SINGLE, S0..S2) of every row-kernel launch of the kernel module ``mod``."""
    seen, real = [], mod.launch

    def spy(fn, grid, args, constexprs, *rest):
        seen.append(dict(constexprs))
        return real(fn, grid, args, constexprs, *rest)

    monkeypatch.setattr(mod, "launch", spy)
    return seen


def _pow2(n):
    return 1 << max(n - 1, 15).bit_length()   # the one-pass tile: next power of 2, at least 16


@pytest.mark.parametrize("dtype,m,k,b,smooth,path", [
    (BF16, 7, 64, 1, False, "single"), (BF16, 8, 100, 2, True, "single"), (BF16, 1, 48, 1, True, "single"),
    (BF16, 6, 100, 3, False, "chunked"), (FP16, 6, 130, 2, True, "chunked"), (FP16, 5, 64, 1, False, "single"),
    (FP32, 4, 100, 2, True, "single"), (FP32, 6, 70, 3, False, "chunked"), (BF16, 8, 100, 2, True, "segments"),
    (BF16, 5, 160, 5, False, "segments"), (FP16, 6, 70, 3, True, "segments"), (FP32, 4, 100, 2, True, "segments")])
def test_rmsnorm_modulate_quantize(kf, monkeypatch, dtype, m, k, b, smooth, path):
    # segments: the one-pass kernel with 16-wide minimum segments (100 -> 64 + 32 + 16, the last partial; 160 ->
    # 128 + 32; 70 -> 64 + 16); single: the register-resident tile of the multi-pass kernel; chunked: its 32-wide
    # chunks, the last one partial
    monkeypatch.setattr(kf.norm, "RMS_ONE_PASS", kf.quantize.SegmentPlan(max_row=8192, min_seg=16, warps=4)
                        if path == "segments" else None)
    if path == "chunked":
        monkeypatch.setattr(kf.norm, "RMS_PLAN", kf.rowtile.TilePlan(max_single=32, chunk=32, chunk_warps=4))
    seen = _spy_launches(kf.norm, monkeypatch)
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = _rand((m, k), dtype, g)
    w = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype).to(DEV)
    s = (1 + 0.5 * torch.randn(b, k, generator=g)).to(dtype).to(DEV)
    inv = (0.5 + torch.rand(k, generator=g)).to(DEV) if smooth else None
    tpb = m // b
    q, qs = kf.norm.rmsnorm_modulate_quantize(x, w, 1e-5, s, tpb, inv)
    want = {"segments": {100: (64, 32, 16), 160: (128, 32, 0), 70: (64, 16, 0)}.get(k),
            "single": (True, _pow2(k)), "chunked": (False, 32)}[path]
    assert [(c["S0"], c["S1"], c["S2"]) if path == "segments" else (c["SINGLE"], c["BLOCK"]) for c in seen] == [want]
    rq, rs = qf.rmsnorm_modulate_quantize_ref(x, w, 1e-5, s, tpb, inv)
    # the unfused torch sequence: ComfyUI's RMSNorm (F.rms_norm) in the model dtype, times 1 + s, quantize
    y = F.rms_norm(x, (k,), w, 1e-5).reshape(b, tpb, k) * s.reshape(b, 1, k)
    uq, us = quantize_per_token_ref(y.reshape(m, k), inv)
    assert q.dtype == torch.int8 and qs.dtype == torch.float32 and q.shape == (m, k) and qs.shape == (m,)
    if dtype == torch.float32:  # nothing rounds: the fp32 sum order / rsqrt show as ulp-level scale changes
        for ref_q, ref_s in ((rq, rs), (uq, us)):
            frac, mx = _flips(q, ref_q)
            assert frac < 1e-3 and mx <= 1
            torch.testing.assert_close(qs, ref_s, rtol=1e-6, atol=0)
    else:
        if EXACT:
            assert torch.equal(q, rq) and torch.equal(qs, rs)
        frac, mx = _flips(q, uq)
        assert frac < 1e-3 and mx <= 1, (frac, mx)
        torch.testing.assert_close(qs, us, rtol=1e-6, atol=0)


def test_rmsnorm_modulate_quantize_flip_rate_large(kf):
    """A full Ideogram 4 row width (K = 4608) against the unfused bf16 path: rare +-1 flips at most."""
    g = torch.Generator().manual_seed(7)
    m, k = 8, 4608
    x, w = _rand((m, k), torch.bfloat16, g, 3.0), (1 + 0.1 * torch.randn(k, generator=g)).bfloat16().to(DEV)
    s = (1 + 0.3 * torch.randn(1, k, generator=g)).bfloat16().to(DEV)
    q, qs = kf.norm.rmsnorm_modulate_quantize(x, w, 1e-6, s, m)
    uq, us = quantize_per_token_ref(F.rms_norm(x, (k,), w, 1e-6) * s, None)
    frac, mx = _flips(q, uq)
    assert frac < 1e-3 and mx <= 1
    torch.testing.assert_close(qs, us, rtol=1e-6, atol=0)


@pytest.mark.parametrize("one_pass", [True, False], ids=["segments", "one_tile"])
def test_rmsnorm_modulate_quantize_zero_and_nan_rows(kf, monkeypatch, one_pass):
    if not one_pass:
        monkeypatch.setattr(kf.norm, "RMS_ONE_PASS", None)
    g = torch.Generator().manual_seed(3)
    x = _rand((5, 64), torch.bfloat16, g)
    x[1] = 0
    x[3, 7] = float("nan")
    x[4, 9] = float("inf")
    one = torch.ones(1, 64, device=DEV)
    q, qs = kf.norm.rmsnorm_modulate_quantize(x, one[0], 1e-5, one, 5)
    assert qs[1] == 0 and not q[1].any()                        # zero row: scale 0, zeros, no NaN
    assert math.isnan(qs[3]) and math.isnan(qs[4]) and not q[3].any() and not q[4].any()
    rq, rs = qf.rmsnorm_modulate_quantize_ref(x[[0, 2]], one[0], 1e-5, one, 2)
    assert _flips(q[[0, 2]], rq)[1] <= 1 and torch.allclose(qs[[0, 2]], rs)   # other rows unaffected


def test_rmsnorm_modulate_quantize_errors(kf):
    x = torch.randn(6, 32).bfloat16().to(DEV)
    with pytest.raises(ValueError, match="tokens_per_batch"):
        kf.norm.rmsnorm_modulate_quantize(x, torch.ones(32), 1e-5, torch.ones(4, 32), 2)
    with pytest.raises(ValueError, match="scale must be"):
        kf.norm.rmsnorm_modulate_quantize(x, torch.ones(32), 1e-5, torch.ones(2, 31), 3)
    with pytest.raises(ValueError, match="norm_weight"):
        kf.norm.rmsnorm_modulate_quantize(x, torch.ones(31), 1e-5, torch.ones(1, 32), 6)
    q, qs = kf.norm.rmsnorm_modulate_quantize(x[:0], torch.ones(32), 1e-5, torch.ones(1, 32), 1)
    assert q.shape == (0, 32) and qs.shape == (0,)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_norm_without_eps_uses_torchs_fp32_epsilon(kf, dtype):
    """An RMSNorm built with eps=None (torch.nn.RMSNorm's default; ComfyUI's ops.RMSNorm keeps it): F.rms_norm then
    adds float32's epsilon (1.2e-7) for bf16 / fp16 / fp32 inputs, not the input dtype's (bf16: 7.8e-3). The fused
    norm + quantize must equal ``quantize(F.rms_norm(x) * s)`` from the module itself; small-magnitude rows make a
    wrong eps visible (rstd off by ~eps / (2 mean x^2))."""
    from quant import blocks as qf
    from quant.quantize import quantize_per_token_ref
    g = torch.Generator().manual_seed(11)
    norm = torch.nn.RMSNorm(64, eps=None).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=g))
    x = (0.05 * torch.randn(6, 64, generator=g)).to(dtype)
    s = (1 + 0.1 * torch.randn(1, 64, generator=g)).to(dtype)
    assert qf.norm_eps(norm, x) == torch.finfo(torch.float32).eps
    q, qs = qf.norm_modulate_quantize(norm, x, s, 6, None)
    with torch.no_grad():
        rq, rs = quantize_per_token_ref(norm(x) * s)
    assert torch.equal(q, rq) and torch.allclose(qs, rs, rtol=2 ** -20, atol=0)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("shape", [(1, 1, 4 * 48), (2, 1, 4 * 48), (3, 4 * 40)], ids=["B1", "B2", "2d"])
def test_adaln_chunks_equals_the_blocks_four_ops(dtype, shape):
    """``qf.adaln_chunks`` (two launches on strided views) against the blocks' own code: ``chunk(4, -1)``, then
    ``1 + s`` and ``tanh(g)`` each on its own chunk, bit for bit, same shapes; values large enough that tanh
    saturates and 1 + s rounds."""
    torch.manual_seed(7)
    mod = (torch.randn(shape) * 4).to(dtype)
    s1, g1, s2, g2 = mod.chunk(4, dim=-1)
    want = (1.0 + s1, torch.tanh(g1), 1.0 + s2, torch.tanh(g2))
    got = qf.adaln_chunks(mod)
    for w, g in zip(want, got):
        assert g.shape == w.shape and g.dtype == dtype and g.stride(-1) == 1
        bits = torch.int32 if dtype == FP32 else torch.int16
        assert torch.equal(g.contiguous().view(bits), w.contiguous().view(bits))


@pytest.mark.parametrize("dtype,m,f,smooth,pair,path", [
    (BF16, 5, 160, False, False, "one_pass"), (BF16, 1, 48, True, True, "single"),
    (BF16, 6, 100, True, False, "chunked"), (BF16, 6, 100, True, False, "one_pass"),
    (FP16, 4, 70, False, True, "chunked"), (FP16, 3, 100, True, False, "one_pass"),
    (FP16, 3, 100, True, False, "single"), (FP32, 4, 70, True, False, "chunked"),
    (FP32, 4, 70, True, True, "one_pass")])
def test_swiglu_quantize(kf, monkeypatch, dtype, m, f, smooth, pair, path):
    # one_pass: the segmented kernel with 16-wide minimum segments (160 -> 128 + 32; 100 -> 64 + 32 + 16, the
    # last partial; 70 -> 64 + 16); single: the register-resident tile of the two-pass kernel; chunked: its
    # 32-wide chunks, the last one partial
    monkeypatch.setattr(kf.swiglu, "SWIGLU_ONE_PASS", kf.quantize.SegmentPlan(max_row=16384, min_seg=16, warps=4)
                        if path == "one_pass" else None)
    if path == "chunked":
        monkeypatch.setattr(kf.swiglu, "SWIGLU_PLAN", kf.rowtile.TilePlan(max_single=32, chunk=32, chunk_warps=8))
    seen = _spy_launches(kf.swiglu, monkeypatch)
    g = torch.Generator().manual_seed(m * 100 + f)
    h = _rand((m, 2 * f), dtype, g, 3.0)
    a, b = h.chunk(2, dim=1)
    inv = (0.5 + torch.rand(f, generator=g)).to(DEV) if smooth else None
    q, qs = kf.swiglu.swiglu_quantize((a, b) if pair else h, inv)
    want = {"one_pass": {160: (128, 32, 0), 100: (64, 32, 16), 70: (64, 16, 0)}.get(f),
            "single": (True, _pow2(f)), "chunked": (False, 32)}[path]
    assert [(c["S0"], c["S1"], c["S2"]) if path == "one_pass" else (c["SINGLE"], c["BLOCK"]) for c in seen] == [want]
    rq, rs = qf.swiglu_quantize_ref(a, b, inv)
    uq, us = quantize_per_token_ref(F.silu(a) * b, inv)       # the unfused torch sequence
    for ref_q, ref_s in ((rq, rs), (uq, us)):
        frac, mx = _flips(q, ref_q)
        assert frac < 1e-3 and mx <= 1, (frac, mx)
        torch.testing.assert_close(qs, ref_s, rtol=1e-6, atol=0)
    if dtype != torch.float32 and EXACT:  # rounded intermediates: exact (up to exp ulps, none at this size)
        assert torch.equal(q, rq) and torch.equal(qs, rs)


@pytest.mark.parametrize("one_pass", [True, False], ids=["one_pass", "two_pass"])
def test_swiglu_quantize_zero_nan_and_fp16_clamp(kf, monkeypatch, one_pass):
    if not one_pass:
        monkeypatch.setattr(kf.swiglu, "SWIGLU_ONE_PASS", None)
    g = torch.Generator().manual_seed(5)
    h = _rand((4, 64), torch.float16, g)
    h[0] = 0
    h[1, 3] = float("nan")
    h[2, 0], h[2, 32] = 400.0, 400.0                 # silu(400) * 400 = 160000 -> inf in fp16
    q, qs = kf.swiglu.swiglu_quantize(h)
    assert qs[0] == 0 and not q[0].any()
    assert math.isnan(qs[1]) and math.isnan(qs[2]) and not q[1].any()
    qc, qsc = kf.swiglu.swiglu_quantize(h, clamp_fp16=True)  # current ComfyUI's clamp_fp16: nan -> 0, inf -> 65504
    rq, rs = qf.swiglu_quantize_ref(*h.chunk(2, 1), clamp_fp16=True)
    assert torch.equal(qc, rq) and torch.equal(qsc, rs)
    assert qsc[2].item() == pytest.approx(65504.0 / 127, rel=1e-6) and qc[2, 0] == 127
    with pytest.raises(ValueError, match="2F"):
        kf.swiglu.swiglu_quantize(h[:, :63])


def _int8_operands(m, f, k, dtype, gen, bias, w_scale=0.02):
    """An int8 activation (quantized by the kernel, with a zero row and, from 5 rows, a NaN row) and a merged
    w1+w3 weight [2F, K] with scales and an optional bias."""
    import kernel
    x = torch.randn(m, k, generator=gen) * 3
    x[min(2, m - 1)] = 0
    if m >= 5:
        x[4, 1] = float("nan")
    a_q, a_s = kernel.quantize_per_token(x.to(dtype).to(DEV))
    w = torch.randint(-127, 128, (2 * f, k), generator=gen, dtype=torch.int8).to(DEV)
    ws = (torch.rand(2 * f, generator=gen) * w_scale).to(DEV)
    b = torch.randn(2 * f, generator=gen).to(DEV) if bias else None
    return a_q, a_s, w, ws, b


@pytest.mark.parametrize("dtype,m,f,k,bias,clamp,w_scale", [
    (BF16, 37, 48, 64, False, False, 0.02), (BF16, 5, 72, 40, True, False, 0.02),   # ragged M / F, K % BLOCK_K
    (FP16, 20, 40, 96, True, True, 2.0), (FP16, 9, 24, 64, False, False, 2.0),      # fp16 overflow: clamp / NaN
    (FP32, 33, 16, 32, True, False, 0.02)])
def test_gemm_swiglu_equals_gemm_then_swiglu(kf, dtype, m, f, k, bias, clamp, w_scale):
    """SwiGLU in the merged GEMM's epilogue: h equals silu(a) * b of the [a | b] the plain GEMM writes, with
    torch's roundings (the exp of fp32 rows aside), and h quantized gives swiglu_quantize's codes and scales."""
    import kernel
    g = torch.Generator().manual_seed(m * 1000 + f)
    a_q, a_s, w, ws, b = _int8_operands(m, f, k, dtype, g, bias, w_scale)
    ab = kernel.int8_gemm(a_q, a_s, w, ws, b, out_dtype=dtype)
    h = kf.swiglu.gemm_swiglu(a_q, a_s, w, ws, b, out_dtype=dtype, clamp_fp16=clamp)
    assert h.shape == (m, f) and h.dtype == dtype
    ref = qf.swiglu_ref(*ab.chunk(2, dim=1), clamp_fp16=clamp)
    if dtype != FP32 and EXACT:
        assert torch.equal(h.float().nan_to_num(nan=7.0), ref.nan_to_num(nan=7.0))
    else:  # fp32: libdevice / numpy exp against torch's, ulps apart
        torch.testing.assert_close(h.float(), ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    inv = (0.5 + torch.rand(f, generator=g)).to(DEV)
    q0, s0 = kf.swiglu.swiglu_quantize(ab, inv, clamp)
    q1, s1 = kernel.quantize_per_token(h, inv)
    if EXACT:
        assert torch.equal(q0, q1)
    else:
        frac, mx = _flips(q1, q0)
        assert frac < 1e-3 and mx <= 1
    torch.testing.assert_close(s1, s0, rtol=0 if EXACT else 1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype,m,f,k,bias,clamp", [
    (BF16, 150, 48, 96, True, False),   # 5 row tiles x 3 F tiles (HALF 16) over 4 programs, a bias
    (FP16, 37, 40, 80, False, True),    # F tail (40 = 2.5 x 16) and K tail: TMA reads zero there; fp16 clamped
])
def test_gemm_swiglu_persistent_kernel_gives_the_plain_kernels_bits(kf, dtype, m, f, k, bias, clamp):
    """The persistent TMA form of the SwiGLU-epilogue GEMM (its W13 as [2, F, K]: one load of a tile's w1 and w3
    rows, F tails read as zero) against the plain kernel of the same tile, bit for bit (NaN rows included), into a
    poisoned strided output."""
    from kernel import autotune, launch, s8wgmma
    if DEV != "cpu":
        pytest.skip("the interpreter's run of the kernel; the GPU's comparison is in bench/RESULTS.md")
    g = torch.Generator().manual_seed(m + f)
    a_q, a_s, w, ws, b = _int8_operands(m, f, k, dtype, g, bias, 2.0 if dtype == FP16 else 0.02)
    cfg = autotune.interpreter_configs()[0]
    plain = kf.swiglu._launch_gemm_swiglu(a_q, a_s, w, ws, b, torch.empty((m, f), dtype=dtype), clamp, cfg)
    h = torch.full((m + 2, f + 8), float("nan"), dtype=dtype)[:m, :f]
    with launch.record() as rec:
        kf.swiglu._launch_gemm_swiglu(a_q, a_s, w, ws, b, h, clamp, {**cfg, "S8": True, "PERSIST": True})
    assert [ln.jit_fn for ln in rec] == [kf.swiglu._gemm_swiglu_persistent_kernel]
    assert s8wgmma.same_bits(h.contiguous(), plain)


def test_gemm_swiglu_edges(kf):
    import kernel
    g = torch.Generator().manual_seed(3)
    a_q, a_s, w, ws, b = _int8_operands(4, 16, 32, BF16, g, True)
    with pytest.raises(ValueError, match="2F"):
        kf.swiglu.gemm_swiglu(a_q, a_s, w[:31], ws[:31], b[:31])
    with pytest.raises(ValueError, match="K mismatch"):
        kf.swiglu.gemm_swiglu(a_q, a_s, w[:, :16], ws, b)
    assert kf.swiglu.gemm_swiglu(a_q[:0], a_s[:0], w, ws, b).shape == (0, 16)
    h0 = kf.swiglu.gemm_swiglu(a_q[:, :0], a_s, w[:, :0], ws, b)      # K = 0: silu(bias_a) * bias_b
    bb = b.to(BF16)
    torch.testing.assert_close(h0, (F.silu(bb[:16]) * bb[16:]).expand(4, 16))


@pytest.mark.parametrize("clamp", [False, True])
def test_fused_feed_forward_runs_swiglu_in_the_gemm_epilogue(clamp):
    """The fused FeedForward computes SwiGLU in the merged GEMM's epilogue (one ``_gemm_swiglu_kernel`` launch, no
    ``_swiglu_quant_kernel``) and equals the per-linear INT8 path: w1 and w3 as their own Int8Linear, torch's
    ``silu(a) * b`` (``swiglu_ref``, clamped for fp16), w2's Int8Linear on that."""
    import kernel.gemm as kgm
    import kernel.swiglu as ksw
    torch.manual_seed(1)
    dtype = FP16 if clamp else BF16
    ff = LuminaFeedForwardStandIn(64, 96).to(DEV, dtype)
    s13 = 0.5 + torch.rand(64, device=DEV)
    layers = {"w1": _int8(ff.w1, "w1", s13), "w3": _int8(ff.w3, "w3", s13),
              "w2": _int8(ff.w2, "w2", 0.5 + torch.rand(96, device=DEV))}
    fused = lumina2.fuse(nn.ModuleDict({"ff": ff}), {f"ff.{k}": v for k, v in layers.items()}, clamp_fp16=clamp)["ff"]
    x = (torch.randn(2, 7, 64, device=DEV) * 4).to(dtype)
    seen, real = [], ksw.launch

    def spy(fn, *a, **kw):
        seen.append(fn)
        return real(fn, *a, **kw)
    ksw.launch = kgm.launch = spy  # the GEMM kernels launch through kernel.gemm.run_launch
    try:
        got = fused(x)
    finally:
        ksw.launch = kgm.launch = real
    assert [fn for fn in seen if fn is not kgm._int8_gemm_kernel] == [ksw._gemm_swiglu_kernel]  # w2's GEMM aside
    h = qf.swiglu_ref(layers["w1"](x), layers["w3"](x), clamp_fp16=clamp).to(dtype)
    ref = layers["w2"](h)
    if EXACT:
        assert torch.equal(got, ref)
    else:
        _assert_within_rounding(got, ref)


@pytest.mark.parametrize("one_pass", [True, False], ids=["segments", "one_tile"])
@pytest.mark.parametrize("dtype,m,k,b,nxt", [(BF16, 6, 64, 2, True), (BF16, 5, 100, 1, False),
                                             (BF16, 5, 100, 5, True), (FP16, 6, 48, 3, True),
                                             (FP32, 4, 64, 2, True)])
def test_gated_residual_rmsnorm(kf, monkeypatch, dtype, m, k, b, nxt, one_pass):
    """``x + gate * rms_norm(o)`` (the block's residual tail) and the next norm * (1 + s) quantized, against
    ComfyUI's torch sequence; segments of at least 16 (100 -> 64 + 32 + 16, the last partial) or one tile."""
    monkeypatch.setattr(kf.residual, "RESIDUAL_ONE_PASS", kf.quantize.SegmentPlan(max_row=8192, min_seg=16, warps=4)
                        if one_pass else None)
    seen = _spy_launches(kf.residual, monkeypatch)
    g = torch.Generator().manual_seed(m * 10 + k)
    x, o = _rand((m, k), dtype, g), _rand((m, k), dtype, g, 5.0)
    wn, w2 = [(1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEV) for _ in range(2)]
    gate = torch.tanh(torch.randn(b, k, generator=g)).to(dtype).to(DEV)
    s2 = (1 + 0.3 * torch.randn(b, k, generator=g)).to(dtype).to(DEV)
    inv = (0.5 + torch.rand(k, generator=g)).to(DEV)
    tpb = m // b
    y, q, qs = kf.residual.gated_residual_rmsnorm(x, o, wn, 1e-5, gate, tpb, *((w2, 1e-6, s2, inv) if nxt else ()))
    assert [(c["S0"] > 0, c["S1"] if c["S0"] else None, c["S2"] if c["S0"] else None) for c in seen] == (
        [(True, {64: 0, 100: 32, 48: 16}[k], {64: 0, 100: 16, 48: 0}[k])] if one_pass else [(False, None, None)])
    yr = (x.reshape(b, tpb, k) + gate.reshape(b, 1, k) * F.rms_norm(o, (k,), wn, 1e-5).reshape(b, tpb, k))
    yr = yr.reshape(m, k)
    if EXACT and dtype != FP32:
        assert torch.equal(y, yr)
    else:
        torch.testing.assert_close(y, yr, rtol=1e-2 if dtype != FP32 else 1e-5, atol=1e-5)
    if not nxt:
        assert q is None and qs is None
        return
    z = F.rms_norm(y, (k,), w2, 1e-6).reshape(b, tpb, k) * s2.reshape(b, 1, k)
    rq, rs = quantize_per_token_ref(z.reshape(m, k), inv)
    frac, mx = _flips(q, rq)
    assert frac < 1e-3 and mx <= 1
    torch.testing.assert_close(qs, rs, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="gate has"):
        kf.residual.gated_residual_rmsnorm(x, o, wn, 1e-5, gate.repeat(2, 1), tpb)


# ----------------------------------------------------------------------------------- FeedForward
class LuminaFeedForwardStandIn(nn.Module):
    """Structure of comfy.ldm.lumina.model.FeedForward (used when ComfyUI is not importable)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def _forward_silu_gating(self, x1, x3):
        return F.silu(x1) * x3

    def forward(self, x):
        return self.w2(self._forward_silu_gating(self.w1(x), self.w3(x)))


LuminaFeedForwardStandIn.__name__ = "FeedForward"


# The Lumina 2 adapter without the ComfyUI lookup of clamp_fp16 (the stand-ins run without ComfyUI).
LUMINA = dataclasses.replace(lumina2.ADAPTER, fuse=functools.partial(lumina2.fuse, clamp_fp16=False))


def _int8(lin, name, smooth=None, backend="fused_triton"):
    return Int8Linear.from_float(lin.weight, getattr(lin, "bias", None), smooth=smooth, backend=backend, name=name)


def _unfused_copy(module, layers, prefix=""):
    """A deep copy of ``module`` with the named linears replaced by their Int8Linear (the plain path)."""
    import copy
    m = copy.deepcopy(module)
    for name, layer in layers.items():
        if not name.startswith(prefix):
            continue
        parent, _, attr = name[len(prefix):].rpartition(".")
        setattr(m.get_submodule(parent) if parent else m, attr, layer)
    return m


@pytest.mark.parametrize("smooth,w2_int8", [(False, True), (True, True), (True, False)])
def test_fused_feed_forward_matches_unfused(smooth, w2_int8):
    torch.manual_seed(0)
    ff = LuminaFeedForwardStandIn(64, 160).to(DEV, torch.bfloat16)
    s13 = 0.5 + torch.rand(64, device=DEV) if smooth else None
    layers = {"w1": _int8(ff.w1, "w1", s13), "w3": _int8(ff.w3, "w3", s13)}
    if w2_int8:
        layers["w2"] = _int8(ff.w2, "w2", 0.5 + torch.rand(160, device=DEV) if smooth else None)
    fused = lumina2.fuse(nn.ModuleDict({"ff": ff}), {f"ff.{k}": v for k, v in layers.items()}, clamp_fp16=False)["ff"]
    assert isinstance(fused, qf.FusedFeedForward)
    assert set(fused.covers) == {f"ff.{k}" for k in layers}
    x = torch.randn(3, 3, 64, device=DEV).bfloat16()              # ragged M = 9
    ref = _unfused_copy(ff, layers)(x)
    got = fused(x)
    _assert_within_rounding(got, ref)
    flt = ff(x).float()
    assert ((got.float() - flt).norm() / flt.norm()).item() < 3e-2  # and close to the float FFN


def test_merge_refuses_different_smoothing():
    ff = LuminaFeedForwardStandIn(32, 48)
    layers = {"w1": _int8(ff.w1, "w1", 0.5 + torch.rand(32)), "w3": _int8(ff.w3, "w3", 0.5 + torch.rand(32)),
              "w2": _int8(ff.w2, "w2")}
    assert lumina2.fuse(nn.ModuleDict({"ff": ff}), {f"ff.{k}": v for k, v in layers.items()}, clamp_fp16=False) == {}
    with pytest.raises(ValueError, match="SmoothQuant"):
        qf.merge_int8(layers["w1"], layers["w3"], "ff.w1+w3")


def test_other_backends_and_architectures_stay_plain():
    ff = LuminaFeedForwardStandIn(32, 48)
    layers = {f"ff.{k}": _int8(getattr(ff, k), k, backend="torch_int_mm") for k in ("w1", "w2", "w3")}
    assert adapters.object_patches(nn.ModuleDict({"ff": ff}), layers, LUMINA) == layers
    flux_like = nn.ModuleDict({"mlp": nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))})
    layers = {"mlp.0": _int8(flux_like.mlp[0], "mlp.0"), "mlp.2": _int8(flux_like.mlp[2], "mlp.2")}
    assert adapters.adapter_for(flux_like) is None               # no adapter: per-linear INT8
    assert adapters.object_patches(flux_like, layers) == layers


def test_fusion_switch():
    ff = LuminaFeedForwardStandIn(32, 48)
    layers = {f"ff.{k}": _int8(getattr(ff, k), k) for k in ("w1", "w2", "w3")}
    tree = nn.ModuleDict({"ff": ff})
    assert set(adapters.object_patches(tree, layers, LUMINA)) == {"ff"}
    with qf.config.override(INT8_FUSED_FUSION=False):
        assert adapters.object_patches(tree, layers, LUMINA) == layers


# ----------------------------------------------------------------------------------- Ideogram 4 block
# A miniature of comfy/ldm/ideogram4/model.py's block (current ComfyUI; not in the pinned runtime): the same
# attribute names and forward bodies, with stand-ins for the ComfyUI functions its forward calls. The adapter is
# handed the same stand-ins (STAND_IN) in place of the ComfyUI functions it imports.
def _rope(x, freqs):  # stand-in for _apply_rope_split_half1: rotate halves by per-position angles
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = freqs
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


_apply_rope_split_half1 = _rope


def optimized_attention_masked(q, k, v, heads, mask=None, skip_reshape=False, transformer_options={}):
    b, h, l, d = q.shape
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, l, h * d)


def _rms_rope_split_half(q, k, freqs, q_scale, k_scale, eps):
    return (_rope(F.rms_norm(q, q.shape[-1:], q_scale, eps), freqs),
            _rope(F.rms_norm(k, k.shape[-1:], k_scale, eps), freqs))


comfy = types.SimpleNamespace(
    model_management=types.SimpleNamespace(in_training=False),
    ops=types.SimpleNamespace(cast_bias_weight=lambda m, x, offloadable=False: (m.weight.to(x.dtype), None, None),
                              uncast_bias_weight=lambda *a: None),
    quant_ops=types.SimpleNamespace(ck=types.SimpleNamespace(rms_rope_split_half=_rms_rope_split_half)))


STAND_IN = ideogram4.ComfyFunctions(
    in_training=lambda: comfy.model_management.in_training, cast_bias_weight=comfy.ops.cast_bias_weight,
    uncast_bias_weight=comfy.ops.uncast_bias_weight, rms_rope_split_half=_rms_rope_split_half,
    attention=optimized_attention_masked, rope=_rope, clamp_fp16=False)
IDEOGRAM4 = dataclasses.replace(ideogram4.ADAPTER, fuse=functools.partial(ideogram4.fuse, functions=STAND_IN))


class Ideogram4Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.num_heads, self.head_dim, self.hidden_size = heads, hidden // heads, hidden
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.norm_q, self.norm_k = nn.RMSNorm(self.head_dim, eps=1e-5), nn.RMSNorm(self.head_dim, eps=1e-5)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, attn_mask, freqs_cis, transformer_options={}):
        b, l, _ = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.num_heads, self.head_dim).unbind(dim=2)
        if comfy.model_management.in_training:
            q = _apply_rope_split_half1(self.norm_q(q), freqs_cis)
            k = _apply_rope_split_half1(self.norm_k(k), freqs_cis)
        else:
            q, k = comfy.quant_ops.ck.rms_rope_split_half(q, k, freqs_cis, self.norm_q.weight, self.norm_k.weight,
                                                          self.norm_q.eps)
        out = optimized_attention_masked(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         self.num_heads, attn_mask, skip_reshape=True)
        return self.o(out)


class Ideogram4TransformerBlock(nn.Module):
    def __init__(self, hidden, ffn, heads, adaln):
        super().__init__()
        self.attention = Ideogram4Attention(hidden, heads)
        self.feed_forward = LuminaFeedForwardStandIn(hidden, ffn)
        for n in ("attention_norm1", "ffn_norm1", "attention_norm2", "ffn_norm2"):
            setattr(self, n, nn.RMSNorm(hidden, eps=1e-5))
        self.adaln_modulation = nn.Linear(adaln, 4 * hidden)

    def forward(self, x, attn_mask, freqs_cis, adaln_input, transformer_options={}):
        mod = self.adaln_modulation(adaln_input)
        scale_msa, gate_msa, scale_mlp, gate_mlp = mod.chunk(4, dim=-1)
        gate_msa, gate_mlp = torch.tanh(gate_msa), torch.tanh(gate_mlp)
        scale_msa, scale_mlp = 1.0 + scale_msa, 1.0 + scale_mlp
        attn_out = self.attention(self.attention_norm1(x) * scale_msa, attn_mask, freqs_cis)
        x = x + gate_msa * self.attention_norm2(attn_out)
        return x + gate_mlp * self.ffn_norm2(self.feed_forward(self.ffn_norm1(x) * scale_mlp))


def _mini_ideogram(layers=2, hidden=64, heads=4, ffn=96, adaln=32, seed=0):
    torch.manual_seed(seed)
    dm = nn.Module()
    dm.layers = nn.ModuleList([Ideogram4TransformerBlock(hidden, ffn, heads, adaln) for _ in range(layers)])
    dm.llm_cond_norm = nn.RMSNorm(48)
    dm.llm_cond_proj = nn.Linear(48, hidden)
    with torch.no_grad():
        for n, p in dm.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return dm.to(DEV, torch.bfloat16)


def _block_inputs(b=2, l=3, hidden=64, heads=4, adaln=32):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(b, l, hidden, generator=g).bfloat16().to(DEV)
    ang = torch.randn(l, hidden // heads // 2, generator=g).to(DEV)
    freqs = (ang.cos()[None, :, None, :], ang.sin()[None, :, None, :])  # broadcast over batch and heads
    ada = F.silu(torch.randn(b, 1, adaln, generator=g)).bfloat16().to(DEV)
    return x, freqs, ada


@pytest.mark.parametrize("in_training", [False, True])
def test_fused_ideogram4_block_matches_unfused(monkeypatch, in_training):
    monkeypatch.setattr(comfy.model_management, "in_training", in_training)
    dm = _mini_ideogram()
    names = [f"layers.{i}.{n}" for i in range(2) for n in
             ("attention.qkv", "attention.o", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
    layers = {n: _int8(dm.get_submodule(n), n) for n in names}
    patches = adapters.object_patches(dm, layers, IDEOGRAM4)
    assert set(patches) == {"layers.0", "layers.1", "llm_cond_proj"}   # every block linear is covered
    blk = patches["layers.0"]
    assert isinstance(blk, ideogram4.FusedIdeogram4Block) and set(blk.covers) == {n for n in names if "layers.0" in n}
    assert {f"layers.0.{n}" for n in blk.int8_layers()} == set(blk.covers)
    assert not [n for n, m in blk.named_modules() if type(m) is nn.Linear and n != "adaln_modulation"]
    x, freqs, ada = _block_inputs()
    for i in range(1):  # layer 1 is built the same way; one keeps the interpreter time down
        ref = _unfused_copy(dm.layers[i], layers, f"layers.{i}.")(x, None, freqs, ada)
        got = patches[f"layers.{i}"](x, None, freqs, ada)
        _assert_within_rounding(got, ref)
        flt = dm.layers[i](x, None, freqs, ada).float()
        assert ((got.float() - flt).norm() / flt.norm()).item() < 3e-2


def test_ideogram4_partial_quantization_falls_back():
    dm = _mini_ideogram(layers=1)
    # only the FFN is INT8 (qkv kept float): the block stays, its FeedForward is fused on its own
    layers = {f"layers.0.feed_forward.{w}": _int8(dm.get_submodule(f"layers.0.feed_forward.{w}"), w)
              for w in ("w1", "w2", "w3")}
    patches = adapters.object_patches(dm, layers, IDEOGRAM4)
    assert isinstance(patches["layers.0.feed_forward"], qf.FusedFeedForward)
    assert "layers.0" not in patches and not any(k.endswith((".w1", ".w2", ".w3")) for k in patches)


def test_ideogram4_blocks_stay_unfused_without_the_comfy_functions(monkeypatch, caplog):
    """A ComfyUI lacking what Ideogram4Attention calls (0.3.75: no comfy.ldm.ideogram4, in_training, quant_ops.ck):
    no block is fused, one log line says why, the FeedForwards are still fused."""
    def missing():
        raise ImportError("No module named 'comfy.ldm.ideogram4'")
    monkeypatch.setattr(ideogram4, "comfy_functions", missing)
    dm = _mini_ideogram(layers=1)
    names = [f"layers.0.{n}" for n in ("attention.qkv", "attention.o", "feed_forward.w1", "feed_forward.w2",
                                       "feed_forward.w3")]
    with caplog.at_level("INFO", logger="int8_fused"):
        patches = adapters.object_patches(dm, {n: _int8(dm.get_submodule(n), n) for n in names}, ideogram4.ADAPTER)
    assert "layers.0" not in patches and isinstance(patches["layers.0.feed_forward"], qf.FusedFeedForward)
    assert "lacks what Ideogram4Attention calls" in caplog.text


@pytest.fixture
def pinned_comfy(request):
    if DEV != "cpu":
        pytest.skip("runs the pinned CPU runtime (TRITON_INTERPRET=1)")
    return request.getfixturevalue("comfy_inprocess")


def test_lumina2_real_feed_forward_and_block(pinned_comfy):
    """The pinned runtime's real Lumina 2 classes: FeedForward fused inside a JointTransformerBlock."""
    import comfy.ops
    import comfy.ldm.lumina.model as lm
    torch.manual_seed(1)
    ops = {"operations": comfy.ops.disable_weight_init, "dtype": torch.bfloat16, "device": "cpu"}
    blk = lm.JointTransformerBlock(0, 64, 4, 4, 16, None, 1e-5, True, operation_settings=ops)
    with torch.no_grad():
        for n, p in blk.named_parameters():
            p.copy_((1 + 0.1 * torch.randn_like(p)) if "norm" in n else torch.randn_like(p) * p.shape[-1] ** -0.5)
    names = [f"feed_forward.{w}" for w in ("w1", "w2", "w3")] + ["attention.qkv", "attention.out"]
    layers = {n: _int8(blk.get_submodule(n), n) for n in names}
    patches = adapters.object_patches(blk, layers, lumina2.ADAPTER)
    assert isinstance(patches["feed_forward"], qf.FusedFeedForward)
    assert set(patches) == {"feed_forward", "attention.qkv", "attention.out"}
    ref_blk = _unfused_copy(blk, layers)
    fused_blk = _unfused_copy(blk, patches)
    x = torch.randn(2, 5, 64).bfloat16()
    freqs = torch.ones(2, 5, 1, 8, 2, 2)  # identity rotation
    freqs[..., 0, 1] = 0
    freqs[..., 1, 0] = 0
    ada = torch.randn(2, 64).bfloat16()
    ref, got = ref_blk(x, None, freqs, ada), fused_blk(x, None, freqs, ada)
    _assert_within_rounding(got, ref)


def test_modelpatcher_object_patches_lumina2(pinned_comfy):
    """The integration recipe through ComfyUI's ModelPatcher on the pinned runtime: a miniature Lumina 2 with
    ``object_patches`` (fused FeedForwards + plain qkv/out patches in the same blocks) gives the per-linear
    INT8 result within rounding, and unpatching gives back the float model exactly."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models
    from comfy_harness import miniature
    from quant.patch import build_int8_layers
    mini = miniature()
    mc = comfy.supported_models.Lumina2(dict(mini.TINY_UNET_CONFIG["lumina2"]))
    mc.set_inference_dtype(torch.bfloat16, None)
    model = mc.get_model({}, "", device=torch.device("cpu"))
    model.diffusion_model.load_state_dict(mini.tiny_state_dict("lumina2", 0), strict=True)
    base = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))
    dm = model.diffusion_model
    pairs = [(n, m) for n, m in dm.named_modules() if n.startswith("layers.") and isinstance(m, nn.Linear)
             and "adaLN" not in n]
    layers, _ = build_int8_layers(pairs, "fused_triton")
    patches = adapters.object_patches(dm, layers)   # the registry finds the Lumina 2 adapter (NextDiT)
    assert sum(isinstance(m, qf.FusedFeedForward) for p in patches.values() for m in p.modules()) == len(dm.layers)
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(1, 16, 4, 4, generator=g), torch.randn(1, 4, 64, generator=g)

    def run(mp):
        comfy.model_management.load_models_gpu([mp])
        with torch.no_grad():
            return mp.model.apply_model(x, torch.tensor([0.6]), c_crossattn=ctx, num_tokens=4).float()

    flt = run(base)
    outs = []
    for ps in (layers, patches):
        mp = base.clone()
        for name, mod in ps.items():
            mp.add_object_patch("diffusion_model." + name, mod)
        outs.append(run(mp))
    comfy.model_management.unload_all_models()
    assert ((outs[1] - outs[0]).norm() / outs[0].norm()).item() < 5e-3
    assert ((outs[1] - flt).norm() / flt.norm()).item() < 5e-2
    assert torch.equal(run(base), flt)           # object patches undone: the float model again
    comfy.model_management.unload_all_models()


# ----------------------------------------------------------------------------------- llm_cond_proj cache
def test_cached_linear_reuses_only_under_a_verified_key():
    lin = nn.Linear(16, 8)
    c = cached_linear.CachedLinear(lin, "llm_cond_proj")
    x = torch.randn(5, 16)
    assert torch.equal(c(x), lin(x)) and c.misses == 0          # no key bound: plain call, nothing stored
    k1 = (uuid.uuid4(),)
    with c.bind(k1):
        y1 = c(x)
        y2 = c(x.clone())                                        # a new tensor with the same content
        assert y2 is y1 and c.hits == 1 and c.misses == 1
        changed = x.clone()
        changed[2, 3] += 1
        assert c(changed) is y1                                  # verified key: trusted for this run
    with c.bind((uuid.uuid4(),)):                                # another cond / run: computed afresh
        assert torch.equal(c(changed), lin(changed))
    c.invalidate()
    with c.bind(k1):
        y = c(x)
        assert torch.equal(c(changed), lin(changed))             # first reuse sees the change: not stale
        assert k1 in c._bad and torch.equal(c(x), lin(x))        # and caching is off for that key
    with c.bind(k1):
        assert c(torch.randn(3, 16)).shape == (3, 8)            # other shape never hits
    assert y.shape == (5, 8)


def test_cached_linear_follows_weight_changes_and_patching():
    lin = nn.Linear(16, 8)
    c = cached_linear.CachedLinear(lin)
    x = torch.randn(4, 16)
    with c.bind("run"):
        y1 = c(x)
        with torch.no_grad():
            lin.weight.add_(1.0)                                  # in-place patch (LoRA merge): version bump
        y2 = c(x)
        assert not torch.equal(y1, y2) and torch.allclose(y2, lin(x))
        c.weight = nn.Parameter(torch.zeros(8, 16))              # ComfyUI set_attr_param: reaches the inner
        assert lin.weight.abs().sum() == 0 and "weight" not in c._parameters
        assert torch.allclose(c(x), lin.bias.expand(4, 8))


def test_cache_wrappers_bind_uuids_and_invalidate():
    dm = _mini_ideogram(layers=1)
    cache = ideogram4.fuse(dm, {}, functions=STAND_IN)["llm_cond_proj"]
    dm.llm_cond_proj = cache
    x = torch.randn(3, 48).bfloat16()

    class Executor:                                              # what ComfyUI's WrapperExecutor passes
        class_obj = dm

        def __call__(self, x_, t, context, mask, transformer_options):
            return dm.llm_cond_proj(context)

    to = {"uuids": [uuid.uuid4()], "cond_or_uncond": [0]}
    y1 = cached_linear.diffusion_model_wrapper(Executor(), None, None, x, None, to)
    y2 = cached_linear.diffusion_model_wrapper(Executor(), None, None, x.clone(), None, to)
    assert y2 is y1 and cache.hits == 1
    cached_linear.outer_sample_wrapper(lambda: None)
    assert not cache._entries
    cached_linear.diffusion_model_wrapper(Executor(), None, None, x, None, {})  # no uuids: not cached
    assert not cache._entries


def test_fused_block_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) traces the fused block: every kernel is a custom op with a fake
    implementation (aot_eager on the CPU; the H200 run measures inductor)."""
    dm = _mini_ideogram(layers=1)
    names = [f"layers.0.{n}" for n in ("attention.qkv", "attention.o", "feed_forward.w1", "feed_forward.w2",
                                       "feed_forward.w3", "adaln_modulation")]
    blk = adapters.object_patches(dm, {n: _int8(dm.get_submodule(n), n) for n in names}, IDEOGRAM4)["layers.0"]
    x, freqs, ada = _block_inputs(b=1, l=2)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(blk, backend="aot_eager", fullgraph=True)(x, None, freqs, ada)
        assert torch.equal(got, blk(x, None, freqs, ada))


_REAL_IDEOGRAM4 = r'''
import copy, os, sys, uuid
import torch
root, comfy_dir = sys.argv[1], sys.argv[2]
sys.path.insert(0, comfy_dir)
sys.path[:0] = [root, root + "/tests"]; import pack_import; pack_import.install()
dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
import comfy.cli_args
comfy.cli_args.args.cpu = dev == "cpu"
import comfy.ops, comfy.utils, comfy.model_management as mm
import comfy.ldm.ideogram4.model as im
import adapters
from adapters import ideogram4
from quant import blocks as qf, cached_linear
from quant.linear import Int8Linear
if dev == "cpu":
    mm.in_training = True  # the rms+rope path through comfy_kitchen's fused op needs its GPU backend
torch.manual_seed(0)
m = im.Ideogram4Transformer2DModel(in_channels=16, num_layers=2, num_attention_heads=2, attention_head_dim=64,
                                   intermediate_size=256, adaln_dim=32, llm_features_dim=64, dtype=torch.bfloat16,
                                   device=dev, operations=comfy.ops.disable_weight_init)
with torch.no_grad():
    for n, p in m.named_parameters():
        p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else torch.randn_like(p) * p.shape[-1] ** -0.5)
names = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear) and
         (n.split(".")[-1] in ("qkv", "o", "w1", "w2", "w3") or n == "llm_cond_proj")]
layers = {n: Int8Linear.from_float(m.get_submodule(n).weight, m.get_submodule(n).bias, backend="fused_triton",
                                   name=n) for n in names}
assert adapters.adapter_for(m) is ideogram4.ADAPTER
patches = adapters.object_patches(m, layers)
assert {"layers.0", "layers.1", "llm_cond_proj"} <= set(patches), sorted(patches)
assert all(isinstance(patches[f"layers.{i}"], ideogram4.FusedIdeogram4Block) for i in range(2))
plain, fused = copy.deepcopy(m), copy.deepcopy(m)
for n, l in layers.items():
    comfy.utils.set_attr(plain, n, l)
for n, l in patches.items():
    comfy.utils.set_attr(fused, n, l)
x = torch.randn(1, 16, 4, 4, device=dev, dtype=torch.bfloat16)
ctx = torch.randn(1, 5, 64, device=dev, dtype=torch.bfloat16)
t = torch.full((1,), 0.4, device=dev)
with torch.no_grad():
    for c in (ctx, None):
        ref, got = plain(x, t, context=c), fused(x, t, context=c)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 5e-3, err
    cache = fused.llm_cond_proj
    with cached_linear.bind_caches(fused, (uuid.uuid4(),)):
        a = fused(x, t, context=ctx)
        b = fused(x, t, context=ctx.clone())
    assert cache.hits == 1 and torch.equal(a, b), (cache.hits, cache.misses)
print("OK", dev, err)
'''


@pytest.mark.slow
def test_real_ideogram4_model_fused_vs_plain(tmp_path):
    """The real Ideogram 4 classes of a current ComfyUI (COMFYUI_CURRENT), in a subprocess (the pinned
    runtime's ``comfy`` package may already be imported here): a 2-layer model, fused patches vs the
    per-linear INT8 patches, with and without text; the llm_cond_proj cache under a bound key."""
    cu = os.environ.get("COMFYUI_CURRENT")
    if not cu or not (Path(cu) / "comfy" / "ldm" / "ideogram4").is_dir():
        pytest.skip("COMFYUI_CURRENT is not set to a ComfyUI checkout with comfy/ldm/ideogram4")
    import subprocess
    script = tmp_path / "real_ideogram4.py"
    script.write_text(_REAL_IDEOGRAM4)
    python = os.environ.get("COMFYUI_CURRENT_PYTHON") or sys.executable  # as conftest's run_in_current_comfy
    r = subprocess.run([python, str(script), str(ROOT), cu], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def _sm90_compile(kf, fn, consts, warps, types_extra=None):
    """PTX + cubin for sm_90 (no GPU needed: Triton ships ptxas), with the 16-divisibility Triton sees at run
    time on Ideogram 4 shapes (aligned pointers, row strides and widths multiples of 16)."""
    import inspect
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    params = list(inspect.signature(fn.fn).parameters)
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16",
             "o_ptr": "*bf16", "wn_ptr": "*bf16", "g_ptr": "*bf16", "y_ptr": "*bf16", "w2_ptr": "*bf16",
             "s2_ptr": "*bf16", "inv_ptr": "*fp32", "q_ptr": "*i8", "qs_ptr": "*fp32", "eps": "fp32", "eps2": "fp32",
             **(types_extra or {})}
    sig = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if p not in consts and p not in ("eps", "eps2", "tokens_per_batch")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return len(re.findall(r"ld\.global[^\n]*\.v4", k.asm["ptx"])), "cubin" in k.asm, k.asm["ptx"]


def _hopper_check() -> str:
    """Builds every case; returns 'OK' or the first problem (run in a process without TRITON_INTERPRET)."""
    import kernel as kf
    import kernel.ops
    import kernel.quantize as kq
    kernel.ops.row_modules()
    common = {"SCALE_RECIP": True, "INTERPRET": False}
    cases = [
        (kf.norm._rmsnorm_modulate_quant_kernel, {"HAS_SMOOTH": True, "NORM_DT": 1, "PROD_DT": 1, "S0": 4096,
                                                  "S1": 512, "S2": 0}),
        (kf.norm._rmsnorm_modulate_quant_kernel, {"HAS_SMOOTH": False, "NORM_DT": 1, "PROD_DT": 0, "S0": 4096,
                                                  "S1": 2048, "S2": 1024}),
        (kq._quant_rows_seg_kernel, {"HAS_SMOOTH": True, "S0": 4096, "S1": 512, "S2": 0}),
        (kq._quant_rows_seg_kernel, {"HAS_SMOOTH": False, "S0": 8192, "S1": 4096, "S2": 0}),
        (kq._quant_rows_loop_kernel, {"HAS_SMOOTH": True, "S0": 4096, "S1": 512, "S2": 0}),
        (kq._quant_rows_loop_kernel, {"HAS_SMOOTH": False, "S0": 8192, "S1": 4096, "S2": 0}),
        (kf.norm._rmsnorm_modulate_quant_kernel, {"HAS_SMOOTH": True, "NORM_DT": 1, "PROD_DT": 1, "BLOCK": 8192,
                                                  "SINGLE": True}),
        (kf.norm._rmsnorm_modulate_quant_kernel, {"HAS_SMOOTH": False, "NORM_DT": 0, "PROD_DT": 0, "BLOCK": 4096,
                                                  "SINGLE": False}),
        (kf.swiglu._swiglu_quant_kernel, {"HAS_SMOOTH": True, "DT": 1, "CLAMP_FP16": False, "BLOCK": 16384,
                                          "SINGLE": True}),
        (kf.swiglu._swiglu_quant_kernel, {"HAS_SMOOTH": False, "DT": 2, "CLAMP_FP16": True, "BLOCK": 4096,
                                          "SINGLE": False}),
        (kf.swiglu._swiglu_quant_kernel, {"HAS_SMOOTH": True, "DT": 1, "CLAMP_FP16": False, "S0": 8192, "S1": 4096,
                                          "S2": 0}),
        (kf.swiglu._swiglu_quant_kernel, {"HAS_SMOOTH": False, "DT": 2, "CLAMP_FP16": True, "S0": 8192, "S1": 1024,
                                          "S2": 512}),
        (kf.residual._gated_residual_kernel, {"NORM_DT": 1, "GATE_DT": 1, "OUT_DT": 1, "HAS_NEXT": True,
                                              "HAS_SMOOTH": True, "NEXT_PROD_DT": 1, "BLOCK": 8192}),
        (kf.residual._gated_residual_kernel, {"NORM_DT": 1, "GATE_DT": 1, "OUT_DT": 1, "HAS_NEXT": True,
                                              "HAS_SMOOTH": True, "NEXT_PROD_DT": 1, "S0": 4096, "S1": 512, "S2": 0}),
        (kf.residual._gated_residual_kernel, {"NORM_DT": 1, "GATE_DT": 1, "OUT_DT": 1, "HAS_NEXT": True,
                                              "HAS_SMOOTH": False, "NEXT_PROD_DT": 1, "S0": 4096, "S1": 2048, "S2": 1024}),
    ]
    for fn, consts in cases:
        # a row kernel's other form (one tile / segments) is off: its constexprs 0
        consts = {**{p: 0 for p in ("BLOCK", "SINGLE", "S0", "S1", "S2") if p in fn.arg_names}, **consts}
        v4, cubin, ptx = _sm90_compile(kf, fn, {**consts, **common}, 16,
                                       {"s_ptr": "*fp32"} if fn in (kq._quant_rows_seg_kernel,
                                                                    kq._quant_rows_loop_kernel) else None)
        if not (cubin and v4 > 0):
            return f"{fn.fn.__name__} {consts}: cubin={cubin}, 16-byte loads={v4}"
        if "cvt.rni" not in ptx:  # the int8 codes from libdevice rint
            return f"{fn.fn.__name__} {consts}: no cvt.rni in the default build"
    return _hopper_check_gemm_swiglu(kf)


def _hopper_check_gemm_swiglu(kf) -> str:
    """The SwiGLU-epilogue GEMM with the tile the H200 autotune picks for the block GEMMs (128 x 128 x 128, 8 warps,
    3 stages) and the register cap ``gemm_swiglu`` gives it: it builds for sm_90, its main loop runs on the 8-bit
    wgmma (s8 x s8 -> s32) and the cap reaches the PTX."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = kf.swiglu._gemm_swiglu_kernel
    types = {"a_ptr": "*i8", "w_ptr": "*i8", "h_ptr": "*bf16", "as_ptr": "*fp32", "ws_ptr": "*fp32",
             "bias_ptr": "*fp32"}
    for dt, clamp in ((1, False), (2, True)):
        consts = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "HAS_BIAS": False, "EVEN_K": True,
                  "DT": dt, "CLAMP_FP16": clamp, "INTERPRET": False}
        params = list(inspect.signature(fn.fn).parameters)
        sig = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
        if dt == 2:
            sig["h_ptr"] = "*fp16"
        attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p not in consts}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 8, "num_stages": 3, "maxnreg": 128})  # as gemm_swiglu launches it
        ptx = k.asm["ptx"]
        if "cubin" not in k.asm or "wgmma.mma_async" not in ptx or ".s32.s8.s8" not in ptx:
            return f"_gemm_swiglu_kernel DT={dt}: cubin={'cubin' in k.asm}, no s8 wgmma in the PTX"
        if ".maxnreg 128" not in ptx:
            return f"_gemm_swiglu_kernel DT={dt}: no register cap in the PTX (two CTAs an SM need <= 128)"
    return _hopper_check_gemm_split()


def _hopper_check_gemm_split() -> str:
    """The plain GEMM and its tail-split builds (SPLIT 2 / 3 / 4) with the 128 x 128 x 128 tile at 8 warps, built as
    ``launch_int8_gemm`` launches them (the split ones under its register cap): all on the 8-bit wgmma with 16-byte
    async copies, at most 128 registers a thread (two CTAs an SM, which ``_slots`` counts); the plain build spills
    nothing, the split builds at most a few words (Triton 3.6: SPLIT 2 with bias 8 bytes, SPLIT 3 56, the builds
    the H200 timed); the split builds publish their partials with a CTA barrier, an acq_rel gpu-scope atomic and L2
    (.cg) reloads."""
    import inspect
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernel import gemm
    fn = gemm._int8_gemm_kernel
    types = {"a_ptr": "*i8", "w_ptr": "*i8", "c_ptr": "*bf16", "as_ptr": "*fp32", "ws_ptr": "*fp32",
             "bias_ptr": "*bf16", "part_ptr": "*i32", "cnt_ptr": "*i32", "lh_ptr": "*fp32", "lu_ptr": "*fp32"}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cap = 65536 // (2 * 32 * 8)  # launch_int8_gemm's cap for two CTAs an SM at 8 warps
    for split in (1, 2, 3, 4):
        consts = {"stride_ak": 1, "stride_wk": 1, "stride_cn": 1, "stride_as": 1, "stride_ws": 1, "stride_bias": 1,
                  "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "HAS_BIAS": True,
                  "OUT_INT32": False, "EVEN_K": True, "SPLIT": split, "INTERPRET": False, "LORA_R": 0, "LORA_STEP": 0}
        params = list(inspect.signature(fn.fn).parameters)
        sig = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
        attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p not in consts}
        opts = {"num_warps": 8, "num_stages": 3, **({"maxnreg": cap} if split > 1 else {})}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=opts)
        ptx = k.asm["ptx"]
        if ".s32.s8.s8" not in ptx or not re.search(r"cp\.async\.cg\.shared\.global[^\n]*0x10", ptx):
            return f"_int8_gemm_kernel SPLIT={split}: no s8 wgmma or no 16-byte async copies"
        if split > 1 and not ("bar.sync" in ptx and re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)
                              and "ld.global.cg" in ptx):
            return f"_int8_gemm_kernel SPLIT={split}: partials not published with barrier + acq_rel atomic + .cg"
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(k.asm["cubin"])
            usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        if not m or int(m.group(1)) > cap or int(m.group(2)) > (64 if split > 1 else 0):
            return f"_int8_gemm_kernel SPLIT={split}: registers / spill stack {m.groups() if m else usage[-300:]}"
    return "OK"


def test_kernels_compile_for_hopper():
    """The compiled (non-interpreter) branches build for sm_90 (Triton's bundled ptxas; no GPU needed) and
    load rows with 16-byte vectors. In a subprocess: under TRITON_INTERPRET=1 kernels are not compilable."""
    fbh.hopper_check_in_subprocess("test_fused")
