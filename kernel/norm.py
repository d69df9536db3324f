"""Norm + modulation + per-token quantization in one kernel: the int8 input of the GEMM after an adaLN-modulated
norm, read once and written once as int8 (instead of a bf16 write and a quantizer's re-read).

- ``rmsnorm_modulate_quantize(x [M, K], norm_weight [K], eps, scale [B | 1, K], tokens_per_batch, inv_smooth [K] |
  None)`` -> (int8 [M, K], fp32 [M]): the adaLN-modulated RMSNorm feeding qkv / w1+w3 (Ideogram 4, Lumina 2).
- ``layernorm_modulate_quantize(x [M, K], scale [B | 1, K], shift [B | 1, K], tokens_per_batch, inv_smooth, eps)``
  -> (int8, fp32): LayerNorm (no affine) * (1 + scale) + shift feeding qkv / mlp.0 / linear1 (Flux.1, Wan).

With ``dt`` = x's dtype and all arithmetic fp32 (``quant.blocks.rmsnorm_modulate_quantize_ref`` /
``layernorm_modulate_quantize_ref`` are this definition in torch)::

    rmsnorm_modulate:   n = dt(x * rsqrt(mean(x^2) + eps) * w)        # F.rms_norm: fp32 math, one rounding
                        y = pt(n * scale[row // tokens_per_batch])     # pt = promote_types(dt, scale.dtype)
    layernorm_modulate: n = dt(layer_norm(x, eps))                    # two-pass mean / variance, fp32
                        y = pt(n * st(1 + scale) + shift)             # torch.addcmul; st = scale's dtype
    then                quantize_per_token_ref(y, inv_smooth)          # quant/quantize.py rules, bit for bit

The kernels agree with the references exactly except where the fp32 ``sum(x^2)`` order or ``rsqrt`` differ by an
ulp and that moves a dt rounding: rare +-1 code flips (tests/test_fused.py and tests/test_flux_fused.py bound them).
The segment helpers here also serve the residual tails (``kernel.residual``). Importing this module imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch  # the compiled kernel re-launched directly (kernel/launch.py)
from .quantize import INTERPRET, SegmentPlan, amax_bad, finish_segments, finish_tile, quant_params, store_q
from .checks import check_2d, check_usable, smooth_vector, vector
from .rowtile import DT_CODE, FLOAT, TilePlan, batch_rows, round_to, row_major, row_tiles, rsqrt_mean

# Module data, read at each call (the tests set them).
# RMSNorm: one pass over segments (K = 4608: 4096 + 512, the row read once) for rows up to 8192, 4 warps (more
# warps were slower on the H200); other rows in RMS_PLAN's tiles (K = 4608 there: 1024-wide chunks, three passes).
RMS_PLAN = TilePlan(max_single=1024, chunk=1024, chunk_warps=4)
RMS_ONE_PASS: SegmentPlan | None = SegmentPlan(max_row=8192, min_seg=256, warps=4)
# LayerNorm: one pass over segments (K = 3072: 2048 + 1024; Wan's 1536 / 5120: 1024 + 512 / 4096 + 1024) for rows up
# to 8192, 4 warps; other rows in LN_PLAN's tiles (up to 4096 in one register tile, longer in 1024-wide chunks).
LN_PLAN = TilePlan(max_single=4096, chunk=1024, chunk_warps=4)
LN_ONE_PASS: SegmentPlan | None = SegmentPlan(max_row=8192, min_seg=256, warps=4)


@triton.jit
def rmsmod_tile(x, w_ptr, s_row, inv_ptr, ks, mask, rstd,
                 HAS_SMOOTH: tl.constexpr, NORM_DT: tl.constexpr, PROD_DT: tl.constexpr,
                 INTERPRET: tl.constexpr):
    w = tl.load(w_ptr + ks, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_row + ks, mask=mask, other=0.0).to(tl.float32)
    y = round_to(round_to(x * rstd * w, NORM_DT, INTERPRET) * s, PROD_DT, INTERPRET)
    if HAS_SMOOTH:
        y = y * tl.load(inv_ptr + ks, mask=mask, other=1.0)
    return y


@triton.jit
def _seg_sq(o_row, K, OFF: tl.constexpr, SEG: tl.constexpr):
    ks = OFF + tl.arange(0, SEG)
    o = tl.load(o_row + ks, mask=ks < K, other=0.0).to(tl.float32)
    return o, tl.sum(o * o, axis=0)


@triton.jit
def seg_rows_sq(o_row, K, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    """A row's used segments (fp32; an unused one is a placeholder) and their sum of squares, added per segment."""
    o0, ssq = _seg_sq(o_row, K, 0, S0)
    o1, o2 = o0, o0
    if S1 > 0:
        o1, ssq1 = _seg_sq(o_row, K, S0, S1)
        ssq += ssq1
    if S2 > 0:
        o2, ssq2 = _seg_sq(o_row, K, S0 + S1, S2)
        ssq += ssq2
    return o0, o1, o2, ssq


@triton.jit
def rmsmod_seg(y, w2_ptr, s2_row, inv_ptr, K, rstd2, amax, bad, OFF: tl.constexpr, SEG: tl.constexpr,
              HAS_SMOOTH: tl.constexpr, OUT_DT: tl.constexpr, NEXT_PROD_DT: tl.constexpr, INTERPRET: tl.constexpr):
    ks = OFF + tl.arange(0, SEG)
    z = rmsmod_tile(y, w2_ptr, s2_row, inv_ptr, ks, ks < K, rstd2, HAS_SMOOTH, OUT_DT, NEXT_PROD_DT, INTERPRET)
    amax, bad = amax_bad(z, amax, bad)
    return z, amax, bad


@triton.jit(do_not_specialize=["tokens_per_batch"])
def _rmsnorm_modulate_quant_kernel(x_ptr, w_ptr, s_ptr, inv_ptr, q_ptr, qs_ptr,
                                   K, tokens_per_batch, eps,
                                   stride_xm, stride_sb, stride_qm,
                                   HAS_SMOOTH: tl.constexpr, NORM_DT: tl.constexpr, PROD_DT: tl.constexpr,
                                   SCALE_RECIP: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
                                   S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, INTERPRET: tl.constexpr):
    # S0 > 0: one read of the row over up to three power-of-2 segments (K = 4608: 4096 + 512), kept in registers;
    # the sums of squares add per segment. Else one BLOCK-wide tile (SINGLE: the whole row in registers, one read
    # of x, one write of q) or BLOCK-wide chunks over three passes.
    if S0 > 0:
        row = tl.program_id(0)
        r64 = row.to(tl.int64)
        x_row, q_row = x_ptr + r64 * stride_xm, q_ptr + r64 * stride_qm
        s_row = s_ptr + (row // tokens_per_batch).to(tl.int64) * stride_sb
        x0, x1, x2, ssq = seg_rows_sq(x_row, K, S0, S1, S2)
        rstd = rsqrt_mean(ssq, K, eps, INTERPRET)
        amax = tl.zeros([], dtype=tl.float32)
        bad = tl.zeros([], dtype=tl.int32)
        z0, amax, bad = rmsmod_seg(x0, w_ptr, s_row, inv_ptr, K, rstd, amax, bad, 0, S0, HAS_SMOOTH, NORM_DT, PROD_DT,
                                  INTERPRET)
        z1, z2 = z0, z0  # placeholders for unused segments
        if S1 > 0:
            z1, amax, bad = rmsmod_seg(x1, w_ptr, s_row, inv_ptr, K, rstd, amax, bad, S0, S1, HAS_SMOOTH, NORM_DT,
                                      PROD_DT, INTERPRET)
        if S2 > 0:
            z2, amax, bad = rmsmod_seg(x2, w_ptr, s_row, inv_ptr, K, rstd, amax, bad, S0 + S1, S2, HAS_SMOOTH, NORM_DT,
                                      PROD_DT, INTERPRET)
        finish_segments(q_row, qs_ptr, row, z0, z1, z2, K, S0, S1, S2, amax, bad, SCALE_RECIP, INTERPRET)
    else:
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_xm
        q_row = q_ptr + row.to(tl.int64) * stride_qm
        s_row = s_ptr + (row // tokens_per_batch).to(tl.int64) * stride_sb
        cols = tl.arange(0, BLOCK)
        if SINGLE:  # the whole row in registers: one read of x, one write of q
            mask = cols < K
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = rsqrt_mean(tl.sum(x * x, axis=0), K, eps, INTERPRET)
            y = rmsmod_tile(x, w_ptr, s_row, inv_ptr, cols, mask, rstd, HAS_SMOOTH, NORM_DT, PROD_DT, INTERPRET)
            finish_tile(q_row + cols, qs_ptr, row, y, mask, 0.0, 0, SCALE_RECIP, INTERPRET)
        else:
            ssq = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                ks = k0 + cols
                x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
                ssq += x * x
            rstd = rsqrt_mean(tl.sum(ssq, axis=0), K, eps, INTERPRET)
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            bad = tl.zeros([BLOCK], dtype=tl.int32)
            for k0 in range(0, K, BLOCK):
                ks = k0 + cols
                mask = ks < K
                x = tl.load(x_row + ks, mask=mask, other=0.0).to(tl.float32)
                ay = tl.abs(rmsmod_tile(x, w_ptr, s_row, inv_ptr, ks, mask, rstd,
                                         HAS_SMOOTH, NORM_DT, PROD_DT, INTERPRET))
                bad = tl.maximum(bad, tl.where(ay < float("inf"), 0, 1))
                amax = tl.maximum(amax, ay)
            scale, mult, usable = quant_params(tl.max(amax, axis=0), tl.max(bad, axis=0) > 0, SCALE_RECIP)
            tl.store(qs_ptr + row, scale)
            for k0 in range(0, K, BLOCK):
                ks = k0 + cols
                mask = ks < K
                x = tl.load(x_row + ks, mask=mask, other=0.0).to(tl.float32)
                y = rmsmod_tile(x, w_ptr, s_row, inv_ptr, ks, mask, rstd, HAS_SMOOTH, NORM_DT, PROD_DT, INTERPRET)
                store_q(q_row + ks, y, mult, usable, mask, INTERPRET)


@triton.jit
def lnmod_tile(x, s_row, sh_row, inv_ptr, ks, mask, mean, rstd,
                HAS_SMOOTH: tl.constexpr, NORM_DT: tl.constexpr, SCALE_DT: tl.constexpr, PROD_DT: tl.constexpr,
                INTERPRET: tl.constexpr):
    # F.layer_norm (one rounding to x's dtype), then torch.addcmul(shift, n, 1 + scale): 1 + scale rounds to
    # scale's dtype, the addcmul computes in fp32 and rounds once. Masked lanes give 0 (they must not reach amax).
    s = tl.load(s_row + ks, mask=mask, other=0.0).to(tl.float32)
    sh = tl.load(sh_row + ks, mask=mask, other=0.0).to(tl.float32)
    n = round_to((x - mean) * rstd, NORM_DT, INTERPRET)
    y = round_to(n * round_to(1.0 + s, SCALE_DT, INTERPRET) + sh, PROD_DT, INTERPRET)
    if HAS_SMOOTH:
        y = y * tl.load(inv_ptr + ks, mask=mask, other=1.0)
    return tl.where(mask, y, 0.0)


@triton.jit
def _ln_seg_x(x_row, K, OFF: tl.constexpr, SEG: tl.constexpr):
    ks = OFF + tl.arange(0, SEG)
    x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
    return x, tl.sum(x, axis=0)


@triton.jit
def _ln_seg_dev(x, K, mean, OFF: tl.constexpr, SEG: tl.constexpr):
    ks = OFF + tl.arange(0, SEG)
    d = tl.where(ks < K, x - mean, 0.0)
    return tl.sum(d * d, axis=0)


@triton.jit
def _ln_seg_z(x, s_row, sh_row, inv_ptr, K, mean, rstd, amax, bad, OFF: tl.constexpr, SEG: tl.constexpr,
              HAS_SMOOTH: tl.constexpr, NORM_DT: tl.constexpr, SCALE_DT: tl.constexpr, PROD_DT: tl.constexpr,
              INTERPRET: tl.constexpr):
    ks = OFF + tl.arange(0, SEG)
    z = lnmod_tile(x, s_row, sh_row, inv_ptr, ks, ks < K, mean, rstd, HAS_SMOOTH, NORM_DT, SCALE_DT, PROD_DT,
                    INTERPRET)
    amax, bad = amax_bad(z, amax, bad)
    return z, amax, bad


@triton.jit
def ln_seg_stats(x0, x1, x2, tot, K, eps, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """(mean, rstd) of a segmented row (fp32 segments, masked lanes 0) from its sum ``tot``: the variance as the
    mean of squared deviations, added per segment."""
    mean = tl.math.div_rn(tot, K * 1.0)
    ssd = _ln_seg_dev(x0, K, mean, 0, S0)
    if S1 > 0:
        ssd += _ln_seg_dev(x1, K, mean, S0, S1)
    if S2 > 0:
        ssd += _ln_seg_dev(x2, K, mean, S0 + S1, S2)
    return mean, rsqrt_mean(ssd, K, eps, INTERPRET)


@triton.jit
def ln_seg_quant(x0, x1, x2, s_row, sh_row, inv_ptr, q_row, qs_ptr, row, K, mean, rstd, S0: tl.constexpr,
                  S1: tl.constexpr, S2: tl.constexpr, HAS_SMOOTH: tl.constexpr, NORM_DT: tl.constexpr,
                  SCALE_DT: tl.constexpr, PROD_DT: tl.constexpr, SCALE_RECIP: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """The LayerNorm · modulation of a segmented row, quantized per row and stored (codes at ``q_row``, the scale
    at ``qs_ptr + row``)."""
    amax = tl.zeros([], dtype=tl.float32)
    bad = tl.zeros([], dtype=tl.int32)
    z0, amax, bad = _ln_seg_z(x0, s_row, sh_row, inv_ptr, K, mean, rstd, amax, bad, 0, S0, HAS_SMOOTH, NORM_DT,
                              SCALE_DT, PROD_DT, INTERPRET)
    z1, z2 = z0, z0  # placeholders for unused segments
    if S1 > 0:
        z1, amax, bad = _ln_seg_z(x1, s_row, sh_row, inv_ptr, K, mean, rstd, amax, bad, S0, S1, HAS_SMOOTH,
                                  NORM_DT, SCALE_DT, PROD_DT, INTERPRET)
    if S2 > 0:
        z2, amax, bad = _ln_seg_z(x2, s_row, sh_row, inv_ptr, K, mean, rstd, amax, bad, S0 + S1, S2, HAS_SMOOTH,
                                  NORM_DT, SCALE_DT, PROD_DT, INTERPRET)
    finish_segments(q_row, qs_ptr, row, z0, z1, z2, K, S0, S1, S2, amax, bad, SCALE_RECIP, INTERPRET)


@triton.jit(do_not_specialize=["tokens_per_batch"])
def _layernorm_modulate_quant_kernel(x_ptr, s_ptr, sh_ptr, inv_ptr, q_ptr, qs_ptr,
                                     K, tokens_per_batch, eps,
                                     stride_xm, stride_sb, stride_shb, stride_qm,
                                     HAS_SMOOTH: tl.constexpr, NORM_DT: tl.constexpr, SCALE_DT: tl.constexpr,
                                     PROD_DT: tl.constexpr, SCALE_RECIP: tl.constexpr, BLOCK: tl.constexpr,
                                     SINGLE: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                                     INTERPRET: tl.constexpr):
    # Mean, then the variance as the mean of squared deviations (fp32). S0 > 0: one read of the row over up to
    # three power-of-2 segments (K = 3072: 2048 + 1024), kept in registers, the sums added per segment. Else one
    # BLOCK-wide tile (SINGLE) or BLOCK-wide chunks, each pass re-reading the row.
    if S0 > 0:
        row = tl.program_id(0)
        bidx = (row // tokens_per_batch).to(tl.int64)
        x_row = x_ptr + row.to(tl.int64) * stride_xm
        q_row = q_ptr + row.to(tl.int64) * stride_qm
        s_row = s_ptr + bidx * stride_sb
        sh_row = sh_ptr + bidx * stride_shb
        x0, tot = _ln_seg_x(x_row, K, 0, S0)
        x1, x2 = x0, x0  # placeholders for unused segments
        if S1 > 0:
            x1, t1 = _ln_seg_x(x_row, K, S0, S1)
            tot += t1
        if S2 > 0:
            x2, t2 = _ln_seg_x(x_row, K, S0 + S1, S2)
            tot += t2
        mean, rstd = ln_seg_stats(x0, x1, x2, tot, K, eps, S0, S1, S2, INTERPRET)
        ln_seg_quant(x0, x1, x2, s_row, sh_row, inv_ptr, q_row, qs_ptr, row, K, mean, rstd, S0, S1, S2, HAS_SMOOTH,
                      NORM_DT, SCALE_DT, PROD_DT, SCALE_RECIP, INTERPRET)
    else:
        row = tl.program_id(0)
        bidx = (row // tokens_per_batch).to(tl.int64)
        x_row = x_ptr + row.to(tl.int64) * stride_xm
        q_row = q_ptr + row.to(tl.int64) * stride_qm
        s_row = s_ptr + bidx * stride_sb
        sh_row = sh_ptr + bidx * stride_shb
        cols = tl.arange(0, BLOCK)
        if SINGLE:
            mask = cols < K
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.math.div_rn(tl.sum(x, axis=0), K * 1.0)
            d = tl.where(mask, x - mean, 0.0)
            rstd = rsqrt_mean(tl.sum(d * d, axis=0), K, eps, INTERPRET)
            y = lnmod_tile(x, s_row, sh_row, inv_ptr, cols, mask, mean, rstd,
                            HAS_SMOOTH, NORM_DT, SCALE_DT, PROD_DT, INTERPRET)
            finish_tile(q_row + cols, qs_ptr, row, y, mask, 0.0, 0, SCALE_RECIP, INTERPRET)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                ks = k0 + cols
                acc += tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            mean = tl.math.div_rn(tl.sum(acc, axis=0), K * 1.0)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                ks = k0 + cols
                mask = ks < K
                d = tl.where(mask, tl.load(x_row + ks, mask=mask, other=0.0).to(tl.float32) - mean, 0.0)
                acc += d * d
            rstd = rsqrt_mean(tl.sum(acc, axis=0), K, eps, INTERPRET)
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            bad = tl.zeros([BLOCK], dtype=tl.int32)
            for k0 in range(0, K, BLOCK):
                ks = k0 + cols
                mask = ks < K
                x = tl.load(x_row + ks, mask=mask, other=0.0).to(tl.float32)
                ay = tl.abs(lnmod_tile(x, s_row, sh_row, inv_ptr, ks, mask, mean, rstd,
                                        HAS_SMOOTH, NORM_DT, SCALE_DT, PROD_DT, INTERPRET))
                bad = tl.maximum(bad, tl.where(ay < float("inf"), 0, 1))
                amax = tl.maximum(amax, ay)
            scale, mult, usable = quant_params(tl.max(amax, axis=0), tl.max(bad, axis=0) > 0, SCALE_RECIP)
            tl.store(qs_ptr + row, scale)
            for k0 in range(0, K, BLOCK):
                ks = k0 + cols
                mask = ks < K
                x = tl.load(x_row + ks, mask=mask, other=0.0).to(tl.float32)
                y = lnmod_tile(x, s_row, sh_row, inv_ptr, ks, mask, mean, rstd,
                                HAS_SMOOTH, NORM_DT, SCALE_DT, PROD_DT, INTERPRET)
                store_q(q_row + ks, y, mult, usable, mask, INTERPRET)


def rmsnorm_modulate_quantize(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, scale: torch.Tensor,
                              tokens_per_batch: int, inv_smooth: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, rows = batch-major tokens) -> (int8 [M, K], fp32 scale [M]) of
    ``(rms_norm(x, norm_weight, eps) * scale[row // tokens_per_batch]) * inv_smooth`` with the roundings of
    the module docstring. ``scale``: the adaLN ``1 + s`` as [B, K] (or [1, K] / [K] for every row) in any
    float dtype; B * tokens_per_batch must equal M unless B is 1. ``norm_weight`` [K] any float dtype (it is
    used in fp32; cast it to x.dtype first to mimic a casting layer)."""
    check_2d(x, "x", FLOAT, "pass the hidden states as [tokens, K] in bf16, fp16 or fp32")
    m, k = x.shape
    w = vector(norm_weight, k, "norm_weight", x.device, allow_scalar=False)
    s2 = batch_rows(scale, k, m, tokens_per_batch, "scale", x.device)  # the adaLN 1 + s
    inv = smooth_vector(inv_smooth, k, x.device)
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    qs = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, qs.zero_()
    check_usable(x, "rmsnorm_modulate_quantize")
    x, w = row_major(x, "x"), row_major(w, "norm_weight")
    args = (x, w, s2, inv if inv is not None else qs, q, qs, k, max(int(tokens_per_batch), 1), float(eps),
            x.stride(0), 0 if s2.shape[0] == 1 else s2.stride(0), q.stride(0))
    common = dict(HAS_SMOOTH=inv is not None, NORM_DT=DT_CODE[x.dtype],
                  PROD_DT=DT_CODE[torch.promote_types(x.dtype, s2.dtype)], SCALE_RECIP=x.is_cuda, INTERPRET=INTERPRET)
    tiles, warps = row_tiles(k, RMS_ONE_PASS, RMS_PLAN)
    launch(_rmsnorm_modulate_quant_kernel, (m,), args, dict(common, **tiles), warps, 1, x.device)
    return q, qs


def modulation_operands(scale, shift, inv_smooth, m: int, k: int, tpb: int, device):
    """(scale [B, K], shift [B, K], inv_smooth | None, int8 [M, K], fp32 [M]): the checked modulation rows and the
    empty outputs of a LayerNorm-modulate-quantize kernel."""
    s2 = batch_rows(scale, k, m, tpb, "scale", device)
    sh2 = batch_rows(shift, k, m, tpb, "shift", device)
    inv = smooth_vector(inv_smooth, k, device)
    return (s2, sh2, inv, torch.empty((m, k), dtype=torch.int8, device=device),
            torch.empty((m,), dtype=torch.float32, device=device))


def layernorm_modulate_quantize(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, tokens_per_batch: int,
                                inv_smooth: torch.Tensor | None = None, eps: float = 1e-6
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, rows = batch-major tokens) -> (int8 [M, K], fp32 scale [M]) of
    ``addcmul(shift, layer_norm(x, eps), 1 + scale) * inv_smooth`` (LayerNorm without affine; Flux's
    ``apply_mod(norm(x), 1 + mod.scale, mod.shift)``) with torch's roundings: the norm rounds to x's dtype,
    ``1 + scale`` to scale's, the addcmul (fp32 inside) to the promoted dtype of the three. ``scale`` / ``shift``:
    [B | 1, K] or [B, 1, K] in any float dtype (the raw adaLN outputs, not 1 + scale), row ``r`` uses batch row
    ``r // tokens_per_batch``."""
    check_2d(x, "x", FLOAT, "pass the hidden states as [tokens, K] in bf16, fp16 or fp32")
    m, k = x.shape
    tpb = max(int(tokens_per_batch), 1)
    s2, sh2, inv, q, qs = modulation_operands(scale, shift, inv_smooth, m, k, tpb, x.device)
    if m == 0 or k == 0:
        return q, qs.zero_()
    check_usable(x, "layernorm_modulate_quantize")
    x = row_major(x, "x")
    prod = torch.promote_types(torch.promote_types(x.dtype, s2.dtype), sh2.dtype)
    args = (x, s2, sh2, inv if inv is not None else qs, q, qs, k, tpb, float(eps),
            x.stride(0), 0 if s2.shape[0] == 1 else s2.stride(0), 0 if sh2.shape[0] == 1 else sh2.stride(0),
            q.stride(0))
    common = dict(HAS_SMOOTH=inv is not None, NORM_DT=DT_CODE[x.dtype], SCALE_DT=DT_CODE[s2.dtype],
                  PROD_DT=DT_CODE[prod], SCALE_RECIP=x.is_cuda, INTERPRET=INTERPRET)
    tiles, warps = row_tiles(k, LN_ONE_PASS, LN_PLAN)
    launch(_layernorm_modulate_quant_kernel, (m,), args, dict(common, **tiles), warps, 1, x.device)
    return q, qs
