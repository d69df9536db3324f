"""Producer-fused activation quantization for DiT blocks (issue 8): the per-token int8 quantizer of
``kernel/quantize.py`` folded into the elementwise op that produces the GEMM input, so that input is read
once and written once, as int8, instead of being written in bf16 and re-read by a separate quantizer.

- ``rmsnorm_modulate_quantize(x [M, K], norm_weight [K], eps, scale [B | 1, K], tokens_per_batch,
  inv_smooth [K] | None)`` -> (int8 [M, K], fp32 [M]): the adaLN-modulated RMSNorm feeding qkv / w1+w3.
- ``swiglu_quantize(h13 [M, 2F] | (a [M, F], b [M, F]), inv_smooth [F] | None)`` -> (int8 [M, F], fp32 [M]):
  ``silu(a) * b`` feeding w2.
- ``gated_residual_rmsnorm(x, o, norm_weight, eps, gate, tokens_per_batch[, next_norm_weight, next_eps,
  next_scale, inv_smooth])`` -> (y, int8 | None, fp32 | None): the block's ``x + gate * norm2(o)`` tail, optionally
  with the next ``rmsnorm_modulate_quantize`` of y from the same registers (rows <= MAX_SINGLE).
- Flux.1 (issue 13): ``layernorm_modulate_quantize(x [M, K], scale [B | 1, K], shift [B | 1, K], tokens_per_batch,
  inv_smooth, eps)`` -> (int8, fp32): LayerNorm (no affine) * (1 + scale) + shift feeding qkv / mlp.0 / linear1;
  ``gelu_tanh_quantize(h [M, F], inv_smooth)``: tanh GELU feeding mlp.2; ``concat_gelu_quantize(a [M, K],
  h [M, F], inv_smooth [K + F])``: ``cat(a, gelu(h))`` quantized with one absmax per row, never materialized
  (the single block's linear2 input); ``qk_norm_rope(qkv [B, L, 3 H D], heads, q_weight, k_weight, eps_q, eps_k,
  pe, q, k, v, row_offset)`` (issue 14, optional): the QK RMSNorm + RoPE written straight into the concatenated
  [B, H, L_all, D] attention layout (no quantization; ``n = dt(x * rstd * w)``, then ``dt(f0 * n0 + f1 * n1)``
  as ComfyUI's ``apply_rope1``); ``qk_rmsnorm_rope_rows(xq, xk, heads, ...)``: the same for Wan, whose norm
  spans the row. Wan (issue 13): ``residual_add(x, y, gate)`` (``torch.addcmul``), ``residual_add_layernorm``
  (with the LayerNorm after it, affine) and ``residual_add_layernorm_modulate_quantize`` (with the modulated,
  quantized LayerNorm feeding the next GEMM), one row in registers. ``gated_residual_rmsnorm`` is built without
  FMA contraction
  (``enable_fp_fusion=False``): torch rounds ``gate * norm(o)`` to the dtype before the add.

Numerics. Each kernel reproduces the unfused torch sequence *including its roundings to the model dtype*
(bf16 rounding of an intermediate is ~1/4 of an int8 step near the row maximum, so computing everything in
fp32 would flip ~5 % of the codes against the unfused path). With ``dt`` = the input dtype:

    rmsnorm_modulate:  n = dt(x * rsqrt(mean(x^2) + eps) * w)       # F.rms_norm: fp32 math, one rounding
                       y = pt(n * scale[row // tokens_per_batch])    # pt = promote_types(dt, scale.dtype)
    swiglu:            s = dt(a / (1 + exp(-a)))                     # F.silu
                       y = dt(s * b)                                 # (fp16 + clamp_fp16: nan->0, inf->+-65504)
    layernorm_modulate: n = dt(layer_norm(x, eps))                  # two-pass mean / variance, fp32
                       y = pt(n * st(1 + scale) + shift)             # torch.addcmul; st = scale's dtype
    gelu_tanh:         y = dt(0.5 h (1 + tanh(b (h + k h^3))))       # F.gelu(approximate="tanh"); GELU_FAST
                                                                     # (default): dt(h / (1 + exp(-2 b (h + k h^3))))
    then               quantize_per_token_ref(y, inv_smooth)          # quant/quantize.py rules, bit for bit

(all arithmetic fp32). ``quant.fused.rmsnorm_modulate_quantize_ref`` / ``swiglu_quantize_ref`` /
``layernorm_modulate_quantize_ref`` / ``gelu_tanh_quantize_ref`` / ``concat_gelu_quantize_ref`` are this
definition in torch. The kernels agree with them exactly except where the fp32 ``sum(x^2)`` order, ``rsqrt``,
``exp`` or ``tanh`` differ by an ulp and that moves a dt rounding: rare ±1 code flips (tests/test_fused.py and
tests/test_flux_fused.py bound them).

Hopper notes: rows must have unit stride along K/F (16-byte vector loads: Triton specialises the unit stride away).
Each row kernel has a tile plan (``RMS_PLAN``, ``SWIGLU_PLAN``, ``LN_PLAN``, ``GELU_PLAN``): a row of up to
``max_single`` elements stays in registers (one DRAM read, one int8 write); longer rows run in ``chunk``-wide tiles
and the later passes re-read the row from L2. ``rmsnorm_modulate_quantize``, ``swiglu_quantize``,
``gated_residual_rmsnorm``, ``layernorm_modulate_quantize``, the ``residual_add*`` tails and the GELU kernels also
have a one-pass form over up to three power-of-2 segments (``RMS_ONE_PASS``, ``SWIGLU_ONE_PASS``,
``RESIDUAL_ONE_PASS``, ``LN_ONE_PASS``, ``RESIDUAL_LN_ONE_PASS``, ``GELU_ONE_PASS``; kernel/quantize.py's
``QUANT_ONE_PASS``: 12288 = 8192 + 4096, 4608 = 4096 + 512, 8960 = 8192 + 512 + 256), which keeps the row in
registers without masked lanes; ``gated_residual_rmsnorm`` has no chunked form (rows up to ``MAX_SINGLE``). fp32
division and exp use the IEEE / libdevice versions torch's CUDA kernels use, so compiled results match torch's bit
for bit more often. Importing this module imports triton.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import _check_2d, _check_usable, _gemm_operands, _vector, gemm_switches
from .gemm import (_acc_tile, _acc_tile_tma, _dequant, _program_tile, _tile_ids, _tile_sum, choose_split,
                   select_config, split_launch, tail_split_on)
from . import gemm
from . import quantize as _q
from . import config
from .launch import launch, not_recorded  # launch: the compiled kernel re-launched directly (kernel/launch.py)
# the quantizer's row helpers and rounding (importing it installs its interpreter shim too)
from .quantize import (ALU_ROUND, INTERPRET, SegmentPlan, _amax_bad, _finish_segments, _quant_params, _seg_warps,
                       _segments, _store_q)


@dataclass(frozen=True)
class TilePlan:
    """How a row kernel tiles a row of n elements (see ``_plan``): up to ``max_single`` elements in registers,
    one pass; longer rows in ``chunk``-wide tiles (a power of 2) with ``chunk_warps`` warps."""
    max_single: int
    chunk: int
    chunk_warps: int


# Module data, read at each call (tests set smaller plans). Measured on the H200, see _plan.
RMS_PLAN = TilePlan(max_single=1024, chunk=1024, chunk_warps=4)     # K = 4608: 1024-wide chunks, 3 passes
SWIGLU_PLAN = TilePlan(max_single=2048, chunk=2048, chunk_warps=8)  # F = 12288: 2048-wide chunks, 2 passes


# SwiGLU in one pass (silu(a) * b computed once, kept in registers in the model dtype) for rows up to 16384;
# None: the chunked two-pass kernel of SWIGLU_PLAN. Module data, read at each call (the sweep sets it).
# H200 (bench/fused_sweep.py, run y, M 4608, F 12288): 117 us with 16 or 32 warps, 124 with 8; the chunked kernel's
# best plan 156 us (2048-wide, 8 warps); output identical.
SWIGLU_ONE_PASS: SegmentPlan | None = SegmentPlan(max_row=16384, min_seg=256, warps=16)
# gated_residual_rmsnorm over segments (K = 4608: 4096 + 512) for rows up to MAX_SINGLE; None: one tile.
# H200 (run y, with the next norm + quantization): 57.5 us with 4 warps, 70 with 8 or 16; one 8192 tile 89-96 us.
RESIDUAL_ONE_PASS: SegmentPlan | None = SegmentPlan(max_row=8192, min_seg=256, warps=4)
# rmsnorm_modulate_quantize over segments (K = 4608: 4096 + 512, the row read once) for rows up to max_row; None,
# or a longer row: the kernel of RMS_PLAN (K = 4608 there: 1024-wide chunks, three passes). H200 (bench/fused_sweep.py,
# run bb, M 4608): 35.0 us with 4 warps, 39.7 with 8 or 16; RMS_PLAN's 48.1, its other tiles 49.6-74.2 (memory
# floor 14.8). Module data, read at each call.
RMS_ONE_PASS: SegmentPlan | None = SegmentPlan(max_row=8192, min_seg=256, warps=4)
# qk_norm_rope (per-head norms): heads per program, a power of 2 dividing H with at most this many elements
QK_GROUP_ELEMS = 1024
# qk_norm_rope: the token's rotations loaded as 16-byte vectors, and (split-half pairs, Ideogram 4) q's and k's
# halves all loaded before either is normalised; False: scalar loads, q then k. H200 (bench/fused_sweep.py, run bj,
# M 4608): Ideogram 4 (18 x 256) 64.4 us against 73.4, Flux (24 x 128) 46.1 against 48.2; outputs identical. Module
# data, read at each call.
QK_PREFETCH = True
MAX_SINGLE = 8192   # gated_residual_rmsnorm (one pass only): rows up to this (K = 4608 -> one 8192 tile)
# The LayerNorm kernel's plan where LN_ONE_PASS does not apply: rows up to 4096 in one register tile (Flux's 3072
# before LN_ONE_PASS: 36.3 us at M 4608, run bj), longer ones in 1024-wide chunks.
LN_PLAN = TilePlan(max_single=4096, chunk=1024, chunk_warps=4)
# layernorm_modulate_quantize over segments (K = 3072: 2048 + 1024; Wan's 1536 / 5120: 1024 + 512 / 4096 + 1024),
# the row read once and kept in registers, for rows up to max_row; None, or a longer row: the kernel of LN_PLAN.
# H200 (bench/fused_sweep.py, run bj): Flux M 4608 K 3072 30.0 us with 4 warps (8: 39.1), LN_PLAN's one 4096 tile
# 36.3; Wan M 14040 K 1536 47.9 (one 2048 tile 48.2), K 5120 120.6 (one 8192 tile 175.9). Module data, read at
# each call.
LN_ONE_PASS: SegmentPlan | None = SegmentPlan(max_row=8192, min_seg=256, warps=4)
# residual_add* (Wan's and Flux's residual + LayerNorm tails) over segments, the same way, for rows of 4097 to 8192
# (whose one tile would be 8192 wide, 37-50 % masked); shorter rows, or None: one masked tile. H200
# (bench/fused_sweep.py, run bk, with the LayerNorm · mod + quantize): Wan M 14040 K 5120 140.1 us with 4 warps (8:
# 165.3) against 192.4 in one 8192 tile; Flux M 4608 K 3072 70.1 with 8 warps (4: 79.3) against 76.8 in one 4096
# tile, Wan K 1536 75.3 against 75.1. In the models (run bn) the segments did not pay below 4096: Wan 1.3B's tails
# took 5.07 ms a step against 3.66-3.68 in one 2048 tile (runs t, al), Flux's 1.98 against 1.94 (run x). Module
# data, read at each call.
RESIDUAL_LN_ONE_PASS: SegmentPlan | None = SegmentPlan(max_row=8192, min_seg=256, warps=4, min_row=4097)
# GELU (bench/fused_sweep.py, H200, 2026-12-01): Flux's concat + GELU + quantize (M 4608, 3072 + 12288) 191 us with
# tanhf in 2048-wide chunks, 150 us with GELU_FAST in 1024-wide chunks (148 in 2048-wide); Wan 1.3B's GELU
# (M 14040, F 8960) 405 us -> 265 us. GELU_FAST: tanh GELU as h * sigmoid(2u) with the hardware exp2 (see
# _gelu_tanh) instead of libdevice tanhf; there the codes equalled torch's unfused path's on Flux's data and
# differed by 1 in 1.0e-7 of Wan's. Both module data, read at each call.
GELU_PLAN = TilePlan(max_single=2048, chunk=1024, chunk_warps=4)
GELU_FAST = True
# (concat +) GELU + quantize in one pass (each part over up to three / two power-of-2 segments, gelu(h) computed
# once and kept in registers in the model dtype) for parts up to 16384 wide; None: the chunked kernel of GELU_PLAN,
# which computes gelu twice (its exp and IEEE division bound it, as they bound the chunked SwiGLU). Read at each call.
# H200 (bench/fused_sweep.py, run ah, GELU_FAST): Flux's concat 125.0 us with 8 warps (16: 144.7; the chunked
# kernel's best 138.1), Wan 1.3B's F = 8960 190.1 us (16: 228.0; chunked best 256.1); codes and scales identical.
GELU_ONE_PASS: SegmentPlan | None = SegmentPlan(max_row=16384, min_seg=256, warps=8)


def tunables() -> tuple:
    """The module data the wrappers read at each call to choose kernels and tiles (the sweep and tests change
    them) and the switches that choose the GEMMs' tiles (tail split, s8 path, persistent kernels): part of a
    prepared call's key (``kernel.plan.call``), so a change is never served a stale plan. (H200, run cb: without
    the last two, an ``INT8_FUSED_PERSISTENT=0`` row re-issued the persistent SwiGLU GEMM planned by an earlier row.)"""
    return (RMS_PLAN, RMS_ONE_PASS, SWIGLU_PLAN, SWIGLU_ONE_PASS, RESIDUAL_ONE_PASS, QK_GROUP_ELEMS, QK_PREFETCH,
            MAX_SINGLE, LN_PLAN, LN_ONE_PASS, RESIDUAL_LN_ONE_PASS, GELU_PLAN, GELU_FAST, GELU_ONE_PASS,
            _q.QUANT_ONE_PASS, _q.QUANT_ROW_LOOP, _plan, launch, *gemm_switches())


_DT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FLOAT = tuple(_DT_CODE)


@triton.jit
def _round(y, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> nearest (ties to even) value of dtype DT (0 fp32, 1 bf16, 2 fp16), returned as fp32."""
    if DT == 1:
        if INTERPRET or ALU_ROUND:
            # NOTE: Triton 3.6's interpreter rounds fp32 -> bf16 by truncation (and its 'rtne' mode neither
            # breaks ties to even nor carries into the exponent), so round on the bits: add 0x7FFF plus the
            # lowest kept bit, drop the low half. NaN stays NaN (its payload could carry into the sign).
            # Compiled with ALU_ROUND the same integer ops replace cvt.rn.bf16.f32 (same result).
            bits = y.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return tl.where(y != y, y, bits.to(tl.float32, bitcast=True))
        else:
            return y.to(tl.bfloat16).to(tl.float32)  # cvt.rn.bf16.f32
    elif DT == 2:
        return y.to(tl.float16).to(tl.float32)       # RNE compiled and in the interpreter (numpy astype)
    else:
        return y


@triton.jit
def _rstd(ssq, K, eps, INTERPRET: tl.constexpr):
    """rsqrt(sum(x^2) / K + eps) as torch computes it: IEEE mean; rsqrtf (libdevice) on the GPU like
    torch's CUDA rms_norm, 1 / sqrt like torch's CPU one in the interpreter."""
    v = tl.math.div_rn(ssq, K * 1.0) + eps
    if INTERPRET:
        return 1.0 / tl.sqrt_rn(v)
    else:
        return libdevice.rsqrt(v)


@triton.jit
def _rmsmod_tile(x, w_ptr, s_row, inv_ptr, ks, mask, rstd,
                 HAS_SMOOTH: tl.constexpr, NORM_DT: tl.constexpr, PROD_DT: tl.constexpr,
                 INTERPRET: tl.constexpr):
    w = tl.load(w_ptr + ks, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_row + ks, mask=mask, other=0.0).to(tl.float32)
    y = _round(_round(x * rstd * w, NORM_DT, INTERPRET) * s, PROD_DT, INTERPRET)
    if HAS_SMOOTH:
        y = y * tl.load(inv_ptr + ks, mask=mask, other=1.0)
    return y


@triton.jit
def _rmsnorm_modulate_quant_kernel(x_ptr, w_ptr, s_ptr, inv_ptr, q_ptr, qs_ptr,
                                   K, tokens_per_batch, eps,
                                   stride_xm, stride_sb, stride_qm,
                                   HAS_SMOOTH: tl.constexpr, NORM_DT: tl.constexpr, PROD_DT: tl.constexpr,
                                   SCALE_RECIP: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
                                   INTERPRET: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    s_row = s_ptr + (row // tokens_per_batch).to(tl.int64) * stride_sb
    cols = tl.arange(0, BLOCK)
    if SINGLE:  # the whole row in registers: one read of x, one write of q
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = _rstd(tl.sum(x * x, axis=0), K, eps, INTERPRET)
        y = _rmsmod_tile(x, w_ptr, s_row, inv_ptr, cols, mask, rstd, HAS_SMOOTH, NORM_DT, PROD_DT, INTERPRET)
        ay = tl.abs(y)
        bad = tl.max(tl.where(ay < float("inf"), 0, 1), axis=0) > 0  # NaN fails `< inf` as Inf does
        scale, mult, usable = _quant_params(tl.max(ay, axis=0), bad, SCALE_RECIP)
        tl.store(qs_ptr + row, scale)
        _store_q(q_row + cols, y, mult, usable, mask, INTERPRET)
    else:
        ssq = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            ks = k0 + cols
            x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            ssq += x * x
        rstd = _rstd(tl.sum(ssq, axis=0), K, eps, INTERPRET)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for k0 in range(0, K, BLOCK):
            ks = k0 + cols
            mask = ks < K
            x = tl.load(x_row + ks, mask=mask, other=0.0).to(tl.float32)
            ay = tl.abs(_rmsmod_tile(x, w_ptr, s_row, inv_ptr, ks, mask, rstd,
                                     HAS_SMOOTH, NORM_DT, PROD_DT, INTERPRET))
            bad = tl.maximum(bad, tl.where(ay < float("inf"), 0, 1))
            amax = tl.maximum(amax, ay)
        scale, mult, usable = _quant_params(tl.max(amax, axis=0), tl.max(bad, axis=0) > 0, SCALE_RECIP)
        tl.store(qs_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            ks = k0 + cols
            mask = ks < K
            x = tl.load(x_row + ks, mask=mask, other=0.0).to(tl.float32)
            y = _rmsmod_tile(x, w_ptr, s_row, inv_ptr, ks, mask, rstd, HAS_SMOOTH, NORM_DT, PROD_DT, INTERPRET)
            _store_q(q_row + ks, y, mult, usable, mask, INTERPRET)


@triton.jit
def _swiglu_vals(a_row, b_row, ks, mask, DT: tl.constexpr, CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """``dt(silu(a) * b)`` (clamped for fp16 when asked) as fp32, before the smoothing."""
    a = tl.load(a_row + ks, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_row + ks, mask=mask, other=0.0).to(tl.float32)
    return _swiglu_math(a, b, DT, CLAMP_FP16, INTERPRET)


@triton.jit
def _swiglu_math(a, b, DT: tl.constexpr, CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """``dt(dt(silu(a)) * b)`` of fp32 values of dtype DT (clamped for fp16 when asked), as fp32."""
    if INTERPRET:
        e = tl.exp(-a)
    else:
        e = libdevice.exp(-a)  # expf, as torch's CUDA silu
    s = _round(tl.math.div_rn(a, 1.0 + e), DT, INTERPRET)
    y = _round(s * b, DT, INTERPRET)
    if CLAMP_FP16:  # comfy.ldm.lumina.model.clamp_fp16: nan_to_num(nan=0, posinf=65504, neginf=-65504)
        y = tl.where(y != y, 0.0, tl.minimum(tl.maximum(y, -65504.0), 65504.0))
    return y


@triton.jit
def _gemm_swiglu_kernel(a_ptr, w_ptr, h_ptr, as_ptr, ws_ptr, bias_ptr, part_ptr, cnt_ptr,
                        M, F, K, DP_TILES, K_PIECE,
                        stride_am, stride_ak, stride_wn, stride_wk, stride_hm, stride_hn,
                        stride_as, stride_ws, stride_bias,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
                        DT: tl.constexpr, CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    # The merged w1+w3 GEMM with SwiGLU in its epilogue: a tile's BLOCK_N weight rows are HALF rows of w1 and the
    # same HALF rows of w3 (W13 rows j and F + j), so the tile holds a and b of HALF output columns; both are
    # rounded to the model dtype as the GEMM would store them, and h = dt(dt(silu(a)) * b) is stored [M, F].
    # SPLIT > 1: the tail split of kernel/gemm.py (the last piece of a tail tile runs the epilogue).
    HALF: tl.constexpr = BLOCK_N // 2
    tile, a_ptr, w_ptr, k_len = _program_tile(a_ptr, w_ptr, DP_TILES, K_PIECE, K, stride_ak, stride_wk, SPLIT)
    pid_m, pid_n = _tile_ids(tile, M, F, BLOCK_M, HALF, GROUP_M)
    offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_wn = _swiglu_w_rows(pid_n, F, BLOCK_N)
    acc = _acc_tile(a_ptr, w_ptr, offs_am, offs_wn, k_len, stride_am, stride_ak, stride_wn, stride_wk,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    acc, finish = _tile_sum(acc, tile, part_ptr, cnt_ptr, DP_TILES, BLOCK_M, BLOCK_N, SPLIT)
    if finish:  # a constant True without the split: no branch
        _swiglu_epilogue(acc, h_ptr, as_ptr, ws_ptr, bias_ptr, pid_m, pid_n, offs_wn, M, F, stride_hm, stride_hn,
                         stride_as, stride_ws, stride_bias, BLOCK_M, BLOCK_N, HAS_BIAS, DT, CLAMP_FP16, INTERPRET)


@triton.jit
def _swiglu_values(acc, as_ptr, ws_ptr, bias_ptr, offs_cm, offs_wn, M, stride_as, stride_ws, stride_bias,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, DT: tl.constexpr,
                   CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """h of a [BLOCK_M, BLOCK_N] int32 tile of a (w1 rows) and b (w3 rows), as fp32 values of dtype DT."""
    HALF: tl.constexpr = BLOCK_N // 2
    v = _round(_dequant(acc, as_ptr, ws_ptr, bias_ptr, offs_cm, offs_wn, M, stride_as, stride_ws, stride_bias,
                        HAS_BIAS), DT, INTERPRET)
    a, b = tl.split(tl.permute(tl.reshape(v, (BLOCK_M, 2, HALF)), (0, 2, 1)))
    return _swiglu_math(a, b, DT, CLAMP_FP16, INTERPRET)


@triton.jit
def _swiglu_w_rows(pid_n, F, BLOCK_N: tl.constexpr):
    """The W13 rows of output column tile ``pid_n``: HALF rows of w1 (j) and the same of w3 (F + j), a column tail
    wrapped (its results are not stored)."""
    HALF: tl.constexpr = BLOCK_N // 2
    r = tl.arange(0, BLOCK_N)
    return (pid_n * HALF + r % HALF) % F + tl.where(r < HALF, 0, F)


@triton.jit
def _gemm_swiglu_persistent_kernel(a_desc, w_desc, h_desc, as_ptr, ws_ptr, bias_ptr, M, F, K,
                                   stride_as, stride_ws, stride_bias, NUM_PROGS,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                   GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, DT: tl.constexpr,
                                   CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    # _gemm_swiglu_kernel (same sums, same epilogue: same bits) as the persistent TMA kernel of kernel/gemm.py:
    # w_desc views W13 as [2, F, K], so one load brings a tile's w1 and w3 rows (F tails read as zero).
    HALF: tl.constexpr = BLOCK_N // 2
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(F, HALF)
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGS, flatten=True):
        pid_m, pid_n = _tile_ids(tile, M, F, BLOCK_M, HALF, GROUP_M)
        acc = _acc_tile_tma(a_desc, w_desc, pid_m * BLOCK_M, pid_n * HALF, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, True)
        y = _swiglu_values(acc, as_ptr, ws_ptr, bias_ptr, pid_m * BLOCK_M + tl.arange(0, BLOCK_M),
                           _swiglu_w_rows(pid_n, F, BLOCK_N), M, stride_as, stride_ws, stride_bias, BLOCK_M, BLOCK_N,
                           HAS_BIAS, DT, CLAMP_FP16, INTERPRET)
        h_desc.store([pid_m * BLOCK_M, pid_n * HALF], y.to(h_desc.dtype))  # exact: y holds values of that dtype


@triton.jit
def _swiglu_epilogue(acc, h_ptr, as_ptr, ws_ptr, bias_ptr, pid_m, pid_n, offs_wn, M, F, stride_hm, stride_hn,
                     stride_as, stride_ws, stride_bias, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_BIAS: tl.constexpr, DT: tl.constexpr, CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    HALF: tl.constexpr = BLOCK_N // 2
    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    y = _swiglu_values(acc, as_ptr, ws_ptr, bias_ptr, offs_cm, offs_wn, M, stride_as, stride_ws, stride_bias,
                       BLOCK_M, BLOCK_N, HAS_BIAS, DT, CLAMP_FP16, INTERPRET)
    offs_hn = pid_n * HALF + tl.arange(0, HALF)
    h_ptrs = h_ptr + offs_cm[:, None].to(tl.int64) * stride_hm + offs_hn[None, :] * stride_hn
    tl.store(h_ptrs, y.to(h_ptr.dtype.element_ty), mask=(offs_cm[:, None] < M) & (offs_hn[None, :] < F))


@triton.jit
def _smooth(y, inv_ptr, ks, mask, HAS_SMOOTH: tl.constexpr):
    if HAS_SMOOTH:
        y = y * tl.load(inv_ptr + ks, mask=mask, other=1.0)
    return y


@triton.jit
def _swiglu_tile(a_row, b_row, inv_ptr, ks, mask,
                 HAS_SMOOTH: tl.constexpr, DT: tl.constexpr, CLAMP_FP16: tl.constexpr,
                 INTERPRET: tl.constexpr):
    return _smooth(_swiglu_vals(a_row, b_row, ks, mask, DT, CLAMP_FP16, INTERPRET), inv_ptr, ks, mask, HAS_SMOOTH)


@triton.jit
def _row_ptrs(a_ptr, b_ptr, q_ptr, stride_am, stride_bm, stride_qm):
    """This program's row of two inputs and of the int8 output (one program a row)."""
    row = tl.program_id(0).to(tl.int64)
    return a_ptr + row * stride_am, b_ptr + row * stride_bm, q_ptr + row * stride_qm


@triton.jit
def _swiglu_seg(a_row, b_row, inv_ptr, F, OFF: tl.constexpr, SEG: tl.constexpr, amax, bad,
                HAS_SMOOTH: tl.constexpr, DT: tl.constexpr, CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """One segment of the one-pass SwiGLU: its values in the model dtype (exact: they are rounded to it), with
    the row's running |max| and non-finite flag updated."""
    ks = OFF + tl.arange(0, SEG)
    mask = ks < F
    y = _swiglu_vals(a_row, b_row, ks, mask, DT, CLAMP_FP16, INTERPRET)
    return _seg_keep(y, a_row, inv_ptr, ks, mask, amax, bad, HAS_SMOOTH)


@triton.jit
def _seg_keep(y, like_row, inv_ptr, ks, mask, amax, bad, HAS_SMOOTH: tl.constexpr):
    """A one-pass segment's values ``y`` (fp32) kept in ``like_row``'s dtype (exact: values of it), with the row's
    running |max| (of the smoothed values) and non-finite flag updated."""
    amax, bad = _amax_bad(_smooth(y, inv_ptr, ks, mask, HAS_SMOOTH), amax, bad)
    return y.to(like_row.dtype.element_ty), amax, bad


@triton.jit
def _seg_store(q_row, y, inv_ptr, F, OFF: tl.constexpr, SEG: tl.constexpr, mult, usable,
               HAS_SMOOTH: tl.constexpr, INTERPRET: tl.constexpr):
    """Quantize and store one segment of a one-pass row (``y`` in the model dtype, smoothed here)."""
    ks = OFF + tl.arange(0, SEG)
    mask = ks < F
    _store_q(q_row + ks, _smooth(y.to(tl.float32), inv_ptr, ks, mask, HAS_SMOOTH), mult, usable, mask, INTERPRET)


@triton.jit
def _swiglu_quant_seg_kernel(a_ptr, b_ptr, inv_ptr, q_ptr, qs_ptr,
                             F, stride_am, stride_bm, stride_qm,
                             HAS_SMOOTH: tl.constexpr, DT: tl.constexpr, CLAMP_FP16: tl.constexpr,
                             SCALE_RECIP: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                             INTERPRET: tl.constexpr):
    # One pass over a row split into up to three power-of-2 segments (F = 12288: 8192 + 4096, no masked lanes):
    # silu(a) * b is computed once and kept in registers in the model dtype until the row's scale is known
    # (the chunked kernel computes it twice: its exp and IEEE division bound it, not DRAM).
    row = tl.program_id(0)
    a_row, b_row, q_row = _row_ptrs(a_ptr, b_ptr, q_ptr, stride_am, stride_bm, stride_qm)
    amax = tl.zeros([], dtype=tl.float32)
    bad = tl.zeros([], dtype=tl.int32)
    y0, amax, bad = _swiglu_seg(a_row, b_row, inv_ptr, F, 0, S0, amax, bad, HAS_SMOOTH, DT, CLAMP_FP16, INTERPRET)
    if S1 > 0:
        y1, amax, bad = _swiglu_seg(a_row, b_row, inv_ptr, F, S0, S1, amax, bad, HAS_SMOOTH, DT, CLAMP_FP16,
                                    INTERPRET)
    if S2 > 0:
        y2, amax, bad = _swiglu_seg(a_row, b_row, inv_ptr, F, S0 + S1, S2, amax, bad, HAS_SMOOTH, DT, CLAMP_FP16,
                                    INTERPRET)
    scale, mult, usable = _quant_params(amax, bad > 0, SCALE_RECIP)
    tl.store(qs_ptr + row, scale)
    _seg_store(q_row, y0, inv_ptr, F, 0, S0, mult, usable, HAS_SMOOTH, INTERPRET)
    if S1 > 0:
        _seg_store(q_row, y1, inv_ptr, F, S0, S1, mult, usable, HAS_SMOOTH, INTERPRET)
    if S2 > 0:
        _seg_store(q_row, y2, inv_ptr, F, S0 + S1, S2, mult, usable, HAS_SMOOTH, INTERPRET)


@triton.jit
def _swiglu_quant_kernel(a_ptr, b_ptr, inv_ptr, q_ptr, qs_ptr,
                         F, stride_am, stride_bm, stride_qm,
                         HAS_SMOOTH: tl.constexpr, DT: tl.constexpr, CLAMP_FP16: tl.constexpr,
                         SCALE_RECIP: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
                         INTERPRET: tl.constexpr):
    row = tl.program_id(0)
    a_row, b_row, q_row = _row_ptrs(a_ptr, b_ptr, q_ptr, stride_am, stride_bm, stride_qm)
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < F
        y = _swiglu_tile(a_row, b_row, inv_ptr, cols, mask, HAS_SMOOTH, DT, CLAMP_FP16, INTERPRET)
        ay = tl.abs(y)
        bad = tl.max(tl.where(ay < float("inf"), 0, 1), axis=0) > 0  # NaN fails `< inf` as Inf does
        scale, mult, usable = _quant_params(tl.max(ay, axis=0), bad, SCALE_RECIP)
        tl.store(qs_ptr + row, scale)
        _store_q(q_row + cols, y, mult, usable, mask, INTERPRET)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for f0 in range(0, F, BLOCK):
            ks = f0 + cols
            ay = tl.abs(_swiglu_tile(a_row, b_row, inv_ptr, ks, ks < F, HAS_SMOOTH, DT, CLAMP_FP16, INTERPRET))
            bad = tl.maximum(bad, tl.where(ay < float("inf"), 0, 1))
            amax = tl.maximum(amax, ay)
        scale, mult, usable = _quant_params(tl.max(amax, axis=0), tl.max(bad, axis=0) > 0, SCALE_RECIP)
        tl.store(qs_ptr + row, scale)
        for f0 in range(0, F, BLOCK):
            ks = f0 + cols
            mask = ks < F
            y = _swiglu_tile(a_row, b_row, inv_ptr, ks, mask, HAS_SMOOTH, DT, CLAMP_FP16, INTERPRET)
            _store_q(q_row + ks, y, mult, usable, mask, INTERPRET)


@triton.jit
def _gated_residual_kernel(x_ptr, o_ptr, wn_ptr, g_ptr, y_ptr, w2_ptr, s2_ptr, inv_ptr, q_ptr, qs_ptr,
                           K, tokens_per_batch, eps, eps2,
                           stride_xm, stride_om, stride_gb, stride_ym, stride_sb, stride_qm,
                           NORM_DT: tl.constexpr, GATE_DT: tl.constexpr, OUT_DT: tl.constexpr,
                           HAS_NEXT: tl.constexpr, HAS_SMOOTH: tl.constexpr, NEXT_PROD_DT: tl.constexpr,
                           SCALE_RECIP: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    # y = x + gate * rms_norm(o) * wn, then (HAS_NEXT) the int8 input of the next GEMM from
    # rms_norm(y) * w2 * scale2: the block's residual tail and the next norm in one read of x and o.
    row = tl.program_id(0)
    bidx = (row // tokens_per_batch).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    o = tl.load(o_ptr + row.to(tl.int64) * stride_om + cols, mask=mask, other=0.0).to(tl.float32)
    wn = tl.load(wn_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    n = _round(o * _rstd(tl.sum(o * o, axis=0), K, eps, INTERPRET) * wn, NORM_DT, INTERPRET)
    g = tl.load(g_ptr + bidx * stride_gb + cols, mask=mask, other=0.0).to(tl.float32)
    t = _round(g * n, GATE_DT, INTERPRET)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    y = _round(x + t, OUT_DT, INTERPRET)
    tl.store(y_ptr + row.to(tl.int64) * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    if HAS_NEXT:
        rstd2 = _rstd(tl.sum(y * y, axis=0), K, eps2, INTERPRET)
        z = _rmsmod_tile(y, w2_ptr, s2_ptr + bidx * stride_sb, inv_ptr, cols, mask, rstd2,
                         HAS_SMOOTH, OUT_DT, NEXT_PROD_DT, INTERPRET)
        az = tl.abs(z)
        bad = tl.max(tl.where(az < float("inf"), 0, 1), axis=0) > 0
        scale, mult, usable = _quant_params(tl.max(az, axis=0), bad, SCALE_RECIP)
        tl.store(qs_ptr + row, scale)
        _store_q(q_ptr + row.to(tl.int64) * stride_qm + cols, z, mult, usable, mask, INTERPRET)


@triton.jit
def _gr_seg_o(o_row, K, OFF: tl.constexpr, SEG: tl.constexpr):
    ks = OFF + tl.arange(0, SEG)
    o = tl.load(o_row + ks, mask=ks < K, other=0.0).to(tl.float32)
    return o, tl.sum(o * o, axis=0)


@triton.jit
def _gr_seg_rows(o_row, K, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    """A row's used segments (fp32; an unused one is a placeholder) and their sum of squares, added per segment."""
    o0, ssq = _gr_seg_o(o_row, K, 0, S0)
    o1, o2 = o0, o0
    if S1 > 0:
        o1, ssq1 = _gr_seg_o(o_row, K, S0, S1)
        ssq += ssq1
    if S2 > 0:
        o2, ssq2 = _gr_seg_o(o_row, K, S0 + S1, S2)
        ssq += ssq2
    return o0, o1, o2, ssq


@triton.jit
def _gr_seg_y(o, x_row, wn_ptr, g_row, y_row, K, rstd, OFF: tl.constexpr, SEG: tl.constexpr,
              NORM_DT: tl.constexpr, GATE_DT: tl.constexpr, OUT_DT: tl.constexpr, INTERPRET: tl.constexpr):
    ks = OFF + tl.arange(0, SEG)
    mask = ks < K
    wn = tl.load(wn_ptr + ks, mask=mask, other=0.0).to(tl.float32)
    n = _round(o * rstd * wn, NORM_DT, INTERPRET)
    t = _round(tl.load(g_row + ks, mask=mask, other=0.0).to(tl.float32) * n, GATE_DT, INTERPRET)
    y = _round(tl.load(x_row + ks, mask=mask, other=0.0).to(tl.float32) + t, OUT_DT, INTERPRET)
    tl.store(y_row + ks, y.to(y_row.dtype.element_ty), mask=mask)
    return y, tl.sum(y * y, axis=0)


@triton.jit
def _gr_seg_z(y, w2_ptr, s2_row, inv_ptr, K, rstd2, amax, bad, OFF: tl.constexpr, SEG: tl.constexpr,
              HAS_SMOOTH: tl.constexpr, OUT_DT: tl.constexpr, NEXT_PROD_DT: tl.constexpr, INTERPRET: tl.constexpr):
    ks = OFF + tl.arange(0, SEG)
    z = _rmsmod_tile(y, w2_ptr, s2_row, inv_ptr, ks, ks < K, rstd2, HAS_SMOOTH, OUT_DT, NEXT_PROD_DT, INTERPRET)
    amax, bad = _amax_bad(z, amax, bad)
    return z, amax, bad


@triton.jit
def _gated_residual_seg_kernel(x_ptr, o_ptr, wn_ptr, g_ptr, y_ptr, w2_ptr, s2_ptr, inv_ptr, q_ptr, qs_ptr,
                               K, tokens_per_batch, eps, eps2,
                               stride_xm, stride_om, stride_gb, stride_ym, stride_sb, stride_qm,
                               NORM_DT: tl.constexpr, GATE_DT: tl.constexpr, OUT_DT: tl.constexpr,
                               HAS_NEXT: tl.constexpr, HAS_SMOOTH: tl.constexpr, NEXT_PROD_DT: tl.constexpr,
                               SCALE_RECIP: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                               INTERPRET: tl.constexpr):
    # _gated_residual_kernel over up to three power-of-2 segments of the row (K = 4608: 4096 + 512, where the
    # one-tile kernel masks 3584 of 8192 lanes); the row stays in registers. The sums of squares add per segment.
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    bidx = (row // tokens_per_batch).to(tl.int64)
    o_row, x_row, y_row = o_ptr + r64 * stride_om, x_ptr + r64 * stride_xm, y_ptr + r64 * stride_ym
    g_row = g_ptr + bidx * stride_gb
    o0, o1, o2, ssq = _gr_seg_rows(o_row, K, S0, S1, S2)
    rstd = _rstd(ssq, K, eps, INTERPRET)
    y0, ysq = _gr_seg_y(o0, x_row, wn_ptr, g_row, y_row, K, rstd, 0, S0, NORM_DT, GATE_DT, OUT_DT, INTERPRET)
    if S1 > 0:
        y1, ysq1 = _gr_seg_y(o1, x_row, wn_ptr, g_row, y_row, K, rstd, S0, S1, NORM_DT, GATE_DT, OUT_DT, INTERPRET)
        ysq += ysq1
    if S2 > 0:
        y2, ysq2 = _gr_seg_y(o2, x_row, wn_ptr, g_row, y_row, K, rstd, S0 + S1, S2, NORM_DT, GATE_DT, OUT_DT,
                             INTERPRET)
        ysq += ysq2
    if HAS_NEXT:
        rstd2 = _rstd(ysq, K, eps2, INTERPRET)
        s2_row = s2_ptr + bidx * stride_sb
        q_row = q_ptr + r64 * stride_qm
        amax = tl.zeros([], dtype=tl.float32)
        bad = tl.zeros([], dtype=tl.int32)
        z0, amax, bad = _gr_seg_z(y0, w2_ptr, s2_row, inv_ptr, K, rstd2, amax, bad, 0, S0, HAS_SMOOTH, OUT_DT,
                                  NEXT_PROD_DT, INTERPRET)
        z1, z2 = z0, z0  # placeholders for unused segments
        if S1 > 0:
            z1, amax, bad = _gr_seg_z(y1, w2_ptr, s2_row, inv_ptr, K, rstd2, amax, bad, S0, S1, HAS_SMOOTH, OUT_DT,
                                      NEXT_PROD_DT, INTERPRET)
        if S2 > 0:
            z2, amax, bad = _gr_seg_z(y2, w2_ptr, s2_row, inv_ptr, K, rstd2, amax, bad, S0 + S1, S2, HAS_SMOOTH,
                                      OUT_DT, NEXT_PROD_DT, INTERPRET)
        _finish_segments(q_row, qs_ptr, row, z0, z1, z2, K, S0, S1, S2, amax, bad, SCALE_RECIP, INTERPRET)


@triton.jit
def _rmsnorm_modulate_quant_seg_kernel(x_ptr, w_ptr, s_ptr, inv_ptr, q_ptr, qs_ptr,
                                       K, tokens_per_batch, eps,
                                       stride_xm, stride_sb, stride_qm,
                                       HAS_SMOOTH: tl.constexpr, NORM_DT: tl.constexpr, PROD_DT: tl.constexpr,
                                       SCALE_RECIP: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
                                       S2: tl.constexpr, INTERPRET: tl.constexpr):
    # _rmsnorm_modulate_quant_kernel over up to three power-of-2 segments (K = 4608: 4096 + 512): one read of the
    # row, kept in registers; the sums of squares add per segment (as the residual tail's next norm does).
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    x_row, q_row = x_ptr + r64 * stride_xm, q_ptr + r64 * stride_qm
    s_row = s_ptr + (row // tokens_per_batch).to(tl.int64) * stride_sb
    x0, x1, x2, ssq = _gr_seg_rows(x_row, K, S0, S1, S2)
    rstd = _rstd(ssq, K, eps, INTERPRET)
    amax = tl.zeros([], dtype=tl.float32)
    bad = tl.zeros([], dtype=tl.int32)
    z0, amax, bad = _gr_seg_z(x0, w_ptr, s_row, inv_ptr, K, rstd, amax, bad, 0, S0, HAS_SMOOTH, NORM_DT, PROD_DT,
                              INTERPRET)
    z1, z2 = z0, z0  # placeholders for unused segments
    if S1 > 0:
        z1, amax, bad = _gr_seg_z(x1, w_ptr, s_row, inv_ptr, K, rstd, amax, bad, S0, S1, HAS_SMOOTH, NORM_DT,
                                  PROD_DT, INTERPRET)
    if S2 > 0:
        z2, amax, bad = _gr_seg_z(x2, w_ptr, s_row, inv_ptr, K, rstd, amax, bad, S0 + S1, S2, HAS_SMOOTH, NORM_DT,
                                  PROD_DT, INTERPRET)
    _finish_segments(q_row, qs_ptr, row, z0, z1, z2, K, S0, S1, S2, amax, bad, SCALE_RECIP, INTERPRET)


# ------------------------------------------------------------------------------------ Flux.1 (issue 13)
# fp32(sqrt(2 / pi)) and fp32(0.044715): the constants of torch's tanh GELU (ATen's kBeta / kKappa in opmath)
_GELU_BETA = tl.constexpr(0.7978845608028654)
_GELU_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _gelu_tanh(h, INTERPRET: tl.constexpr, FAST: tl.constexpr):
    """torch's ``gelu(h, approximate="tanh")`` in fp32, op for op: ``0.5 * h * (1 + tanh(beta * (h + kappa *
    h^3)))``. tanh: libdevice tanhf compiled (torch's CUDA kernel calls tanhf); ``1 - 2 / (exp(2u) + 1)`` in the
    interpreter (no libdevice there; within a few fp32 ulps). FAST: the same function as ``h / (1 + exp(-2u))``
    (= h * sigmoid(2u)), one exp2 and one division instead of tanhf: within a few fp32 ulps of torch's where
    the value matters (torch's ``1 + tanh`` cancels for u < -4, where both are < 1e-3 |h|)."""
    inner = _GELU_BETA * (h + _GELU_KAPPA * (h * h * h))
    if FAST:  # exp(88) is finite: no overflow for u < -44 (the value there is < 1e-38 |h| either way)
        return h / (1.0 + tl.exp(tl.minimum(-2.0 * inner, 88.0)))
    if INTERPRET:  # |u| <= 15 keeps exp finite (tanh(15) is 1 in fp32); NaN passes through
        u = tl.minimum(tl.maximum(inner, -15.0), 15.0)
        t = 1.0 - tl.math.div_rn(2.0, tl.exp(2.0 * u) + 1.0)
    else:
        t = libdevice.tanh(inner)
    return (0.5 * h) * (1.0 + t)


@triton.jit
def _lnmod_tile(x, s_row, sh_row, inv_ptr, ks, mask, mean, rstd,
                HAS_SMOOTH: tl.constexpr, NORM_DT: tl.constexpr, SCALE_DT: tl.constexpr, PROD_DT: tl.constexpr,
                INTERPRET: tl.constexpr):
    # F.layer_norm (one rounding to x's dtype), then torch.addcmul(shift, n, 1 + scale): 1 + scale rounds to
    # scale's dtype, the addcmul computes in fp32 and rounds once. Masked lanes give 0 (they must not reach amax).
    s = tl.load(s_row + ks, mask=mask, other=0.0).to(tl.float32)
    sh = tl.load(sh_row + ks, mask=mask, other=0.0).to(tl.float32)
    n = _round((x - mean) * rstd, NORM_DT, INTERPRET)
    y = _round(n * _round(1.0 + s, SCALE_DT, INTERPRET) + sh, PROD_DT, INTERPRET)
    if HAS_SMOOTH:
        y = y * tl.load(inv_ptr + ks, mask=mask, other=1.0)
    return tl.where(mask, y, 0.0)


@triton.jit
def _layernorm_modulate_quant_kernel(x_ptr, s_ptr, sh_ptr, inv_ptr, q_ptr, qs_ptr,
                                     K, tokens_per_batch, eps,
                                     stride_xm, stride_sb, stride_shb, stride_qm,
                                     HAS_SMOOTH: tl.constexpr, NORM_DT: tl.constexpr, SCALE_DT: tl.constexpr,
                                     PROD_DT: tl.constexpr, SCALE_RECIP: tl.constexpr, BLOCK: tl.constexpr,
                                     SINGLE: tl.constexpr, INTERPRET: tl.constexpr):
    # mean, then the variance as the mean of squared deviations (two passes over the row, fp32)
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
        rstd = _rstd(tl.sum(d * d, axis=0), K, eps, INTERPRET)
        y = _lnmod_tile(x, s_row, sh_row, inv_ptr, cols, mask, mean, rstd,
                        HAS_SMOOTH, NORM_DT, SCALE_DT, PROD_DT, INTERPRET)
        ay = tl.abs(y)
        bad = tl.max(tl.where(ay < float("inf"), 0, 1), axis=0) > 0  # NaN fails `< inf` as Inf does
        scale, mult, usable = _quant_params(tl.max(ay, axis=0), bad, SCALE_RECIP)
        tl.store(qs_ptr + row, scale)
        _store_q(q_row + cols, y, mult, usable, mask, INTERPRET)
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
        rstd = _rstd(tl.sum(acc, axis=0), K, eps, INTERPRET)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for k0 in range(0, K, BLOCK):
            ks = k0 + cols
            mask = ks < K
            x = tl.load(x_row + ks, mask=mask, other=0.0).to(tl.float32)
            ay = tl.abs(_lnmod_tile(x, s_row, sh_row, inv_ptr, ks, mask, mean, rstd,
                                    HAS_SMOOTH, NORM_DT, SCALE_DT, PROD_DT, INTERPRET))
            bad = tl.maximum(bad, tl.where(ay < float("inf"), 0, 1))
            amax = tl.maximum(amax, ay)
        scale, mult, usable = _quant_params(tl.max(amax, axis=0), tl.max(bad, axis=0) > 0, SCALE_RECIP)
        tl.store(qs_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            ks = k0 + cols
            mask = ks < K
            x = tl.load(x_row + ks, mask=mask, other=0.0).to(tl.float32)
            y = _lnmod_tile(x, s_row, sh_row, inv_ptr, ks, mask, mean, rstd,
                            HAS_SMOOTH, NORM_DT, SCALE_DT, PROD_DT, INTERPRET)
            _store_q(q_row + ks, y, mult, usable, mask, INTERPRET)


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
    z = _lnmod_tile(x, s_row, sh_row, inv_ptr, ks, ks < K, mean, rstd, HAS_SMOOTH, NORM_DT, SCALE_DT, PROD_DT,
                    INTERPRET)
    amax, bad = _amax_bad(z, amax, bad)
    return z, amax, bad


@triton.jit
def _ln_seg_stats(x0, x1, x2, tot, K, eps, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """(mean, rstd) of a segmented row (fp32 segments, masked lanes 0) from its sum ``tot``: the variance as the
    mean of squared deviations, added per segment."""
    mean = tl.math.div_rn(tot, K * 1.0)
    ssd = _ln_seg_dev(x0, K, mean, 0, S0)
    if S1 > 0:
        ssd += _ln_seg_dev(x1, K, mean, S0, S1)
    if S2 > 0:
        ssd += _ln_seg_dev(x2, K, mean, S0 + S1, S2)
    return mean, _rstd(ssd, K, eps, INTERPRET)


@triton.jit
def _ln_seg_quant(x0, x1, x2, s_row, sh_row, inv_ptr, q_row, qs_ptr, row, K, mean, rstd, S0: tl.constexpr,
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
    _finish_segments(q_row, qs_ptr, row, z0, z1, z2, K, S0, S1, S2, amax, bad, SCALE_RECIP, INTERPRET)


@triton.jit
def _layernorm_modulate_quant_seg_kernel(x_ptr, s_ptr, sh_ptr, inv_ptr, q_ptr, qs_ptr,
                                         K, tokens_per_batch, eps,
                                         stride_xm, stride_sb, stride_shb, stride_qm,
                                         HAS_SMOOTH: tl.constexpr, NORM_DT: tl.constexpr, SCALE_DT: tl.constexpr,
                                         PROD_DT: tl.constexpr, SCALE_RECIP: tl.constexpr, S0: tl.constexpr,
                                         S1: tl.constexpr, S2: tl.constexpr, INTERPRET: tl.constexpr):
    # _layernorm_modulate_quant_kernel over up to three power-of-2 segments (Flux's K = 3072: 2048 + 1024, where
    # the one-tile kernel masks 1024 of 4096 lanes): one read of the row, kept in registers; the sums (of x, then
    # of the squared deviations) add per segment.
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
    mean, rstd = _ln_seg_stats(x0, x1, x2, tot, K, eps, S0, S1, S2, INTERPRET)
    _ln_seg_quant(x0, x1, x2, s_row, sh_row, inv_ptr, q_row, qs_ptr, row, K, mean, rstd, S0, S1, S2, HAS_SMOOTH,
                  NORM_DT, SCALE_DT, PROD_DT, SCALE_RECIP, INTERPRET)


@triton.jit
def _part_vals(p_row, ks, mask, GELU: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr,
               FAST: tl.constexpr):
    """One tile of a part of the concatenated row, fp32, before the smoothing: the values as they are (GELU
    False) or gelu(h) rounded to DT (gelu(0) = 0: masked lanes stay 0)."""
    y = tl.load(p_row + ks, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        y = _round(_gelu_tanh(y, INTERPRET, FAST), DT, INTERPRET)
    return y


@triton.jit
def _gelu_tile(h_row, inv_ptr, ks, mask, HAS_SMOOTH: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr,
               FAST: tl.constexpr):
    return _smooth(_part_vals(h_row, ks, mask, True, DT, INTERPRET, FAST), inv_ptr, ks, mask, HAS_SMOOTH)


@triton.jit
def _part_tile(p_row, inv_ptr, ks, mask, GELU: tl.constexpr, HAS_SMOOTH: tl.constexpr, DT: tl.constexpr,
               INTERPRET: tl.constexpr, FAST: tl.constexpr):
    # one segment of the concatenated row, smoothed
    return _smooth(_part_vals(p_row, ks, mask, GELU, DT, INTERPRET, FAST), inv_ptr, ks, mask, HAS_SMOOTH)


@triton.jit
def _part_amax(p_row, inv_ptr, n, cols, amax, bad, GELU: tl.constexpr, HAS_SMOOTH: tl.constexpr,
               DT: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr, FAST: tl.constexpr):
    for k0 in range(0, n, BLOCK):
        ks = k0 + cols
        ay = tl.abs(_part_tile(p_row, inv_ptr, ks, ks < n, GELU, HAS_SMOOTH, DT, INTERPRET, FAST))
        bad = tl.maximum(bad, tl.where(ay < float("inf"), 0, 1))
        amax = tl.maximum(amax, ay)
    return amax, bad


@triton.jit
def _part_store(p_row, inv_ptr, q_row, n, cols, mult, usable, GELU: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                DT: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr, FAST: tl.constexpr):
    for k0 in range(0, n, BLOCK):
        ks = k0 + cols
        mask = ks < n
        y = _part_tile(p_row, inv_ptr, ks, mask, GELU, HAS_SMOOTH, DT, INTERPRET, FAST)
        _store_q(q_row + ks, y, mult, usable, mask, INTERPRET)


@triton.jit
def _concat_gelu_quant_kernel(a_ptr, h_ptr, inv_ptr, q_ptr, qs_ptr,
                              KA, F, stride_am, stride_hm, stride_qm,
                              HAS_A: tl.constexpr, HAS_SMOOTH: tl.constexpr, DT: tl.constexpr,
                              SCALE_RECIP: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
                              INTERPRET: tl.constexpr, FAST: tl.constexpr):
    # q = quantize(cat(a, dt(gelu(h)))) per row, one absmax over both parts; HAS_A False: gelu(h) alone.
    # SINGLE: each part fits one BLOCK-wide tile held in registers; else BLOCK-wide chunks, read twice.
    row = tl.program_id(0)
    a_row, h_row, q_row = _row_ptrs(a_ptr, h_ptr, q_ptr, stride_am, stride_hm, stride_qm)
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mh = cols < F
        yh = _gelu_tile(h_row, inv_ptr + KA, cols, mh, HAS_SMOOTH, DT, INTERPRET, FAST)
        ay = tl.abs(yh)
        bad = tl.where(ay < float("inf"), 0, 1)
        if HAS_A:
            ma = cols < KA
            ya = _part_tile(a_row, inv_ptr, cols, ma, False, HAS_SMOOTH, DT, INTERPRET, FAST)
            aa = tl.abs(ya)
            bad = tl.maximum(bad, tl.where(aa < float("inf"), 0, 1))
            ay = tl.maximum(ay, aa)
        scale, mult, usable = _quant_params(tl.max(ay, axis=0), tl.max(bad, axis=0) > 0, SCALE_RECIP)
        tl.store(qs_ptr + row, scale)
        if HAS_A:
            _store_q(q_row + cols, ya, mult, usable, ma, INTERPRET)
        _store_q(q_row + KA + cols, yh, mult, usable, mh, INTERPRET)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        if HAS_A:
            amax, bad = _part_amax(a_row, inv_ptr, KA, cols, amax, bad, False, HAS_SMOOTH, DT, BLOCK, INTERPRET,
                                   FAST)
        amax, bad = _part_amax(h_row, inv_ptr + KA, F, cols, amax, bad, True, HAS_SMOOTH, DT, BLOCK, INTERPRET,
                               FAST)
        scale, mult, usable = _quant_params(tl.max(amax, axis=0), tl.max(bad, axis=0) > 0, SCALE_RECIP)
        tl.store(qs_ptr + row, scale)
        if HAS_A:
            _part_store(a_row, inv_ptr, q_row, KA, cols, mult, usable, False, HAS_SMOOTH, DT, BLOCK, INTERPRET,
                        FAST)
        _part_store(h_row, inv_ptr + KA, q_row + KA, F, cols, mult, usable, True, HAS_SMOOTH, DT, BLOCK,
                    INTERPRET, FAST)


@triton.jit
def _gelu_seg(p_row, inv_ptr, n, OFF: tl.constexpr, SEG: tl.constexpr, amax, bad, GELU: tl.constexpr,
              HAS_SMOOTH: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr, FAST: tl.constexpr):
    """One segment of a part of the one-pass (concat +) GELU row: gelu(h) rounded to DT (GELU) or the values as
    they are, in the part's dtype (exact: they are values of it), with the row's running |max| and non-finite
    flag updated; the same values as ``_part_tile``."""
    ks = OFF + tl.arange(0, SEG)
    mask = ks < n
    return _seg_keep(_part_vals(p_row, ks, mask, GELU, DT, INTERPRET, FAST), p_row, inv_ptr, ks, mask, amax, bad,
                     HAS_SMOOTH)


@triton.jit
def _concat_gelu_quant_seg_kernel(a_ptr, h_ptr, inv_ptr, q_ptr, qs_ptr,
                                  KA, F, stride_am, stride_hm, stride_qm,
                                  HAS_A: tl.constexpr, HAS_SMOOTH: tl.constexpr, DT: tl.constexpr,
                                  SCALE_RECIP: tl.constexpr, A0: tl.constexpr, A1: tl.constexpr,
                                  S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                                  INTERPRET: tl.constexpr, FAST: tl.constexpr):
    # q = quantize(cat(a, dt(gelu(h)))) per row in one pass: a over segments A0 (+ A1), h over S0 (+ S1 + S2)
    # (Flux's single block: 2048 + 1024 and 8192 + 4096; Wan 1.3B's F = 8960: 8192 + 512 + 256, no masked lanes).
    row = tl.program_id(0)
    a_row, h_row, q_row = _row_ptrs(a_ptr, h_ptr, q_ptr, stride_am, stride_hm, stride_qm)
    amax = tl.zeros([], dtype=tl.float32)
    bad = tl.zeros([], dtype=tl.int32)
    if HAS_A:
        a0, amax, bad = _gelu_seg(a_row, inv_ptr, KA, 0, A0, amax, bad, False, HAS_SMOOTH, DT, INTERPRET, FAST)
        if A1 > 0:
            a1, amax, bad = _gelu_seg(a_row, inv_ptr, KA, A0, A1, amax, bad, False, HAS_SMOOTH, DT, INTERPRET, FAST)
    ih = inv_ptr + KA
    y0, amax, bad = _gelu_seg(h_row, ih, F, 0, S0, amax, bad, True, HAS_SMOOTH, DT, INTERPRET, FAST)
    if S1 > 0:
        y1, amax, bad = _gelu_seg(h_row, ih, F, S0, S1, amax, bad, True, HAS_SMOOTH, DT, INTERPRET, FAST)
    if S2 > 0:
        y2, amax, bad = _gelu_seg(h_row, ih, F, S0 + S1, S2, amax, bad, True, HAS_SMOOTH, DT, INTERPRET, FAST)
    scale, mult, usable = _quant_params(amax, bad > 0, SCALE_RECIP)
    tl.store(qs_ptr + row, scale)
    if HAS_A:
        _seg_store(q_row, a0, inv_ptr, KA, 0, A0, mult, usable, HAS_SMOOTH, INTERPRET)
        if A1 > 0:
            _seg_store(q_row, a1, inv_ptr, KA, A0, A1, mult, usable, HAS_SMOOTH, INTERPRET)
    qh = q_row + KA
    _seg_store(qh, y0, ih, F, 0, S0, mult, usable, HAS_SMOOTH, INTERPRET)
    if S1 > 0:
        _seg_store(qh, y1, ih, F, S0, S1, mult, usable, HAS_SMOOTH, INTERPRET)
    if S2 > 0:
        _seg_store(qh, y2, ih, F, S0 + S1, S2, mult, usable, HAS_SMOOTH, INTERPRET)


# ----------------------------------------------------------------------------------------------- launchers
def _plan(n: int, plan: TilePlan | None = None) -> tuple[int, bool, int]:
    """(BLOCK, SINGLE, num_warps) for a row of n elements: in registers (BLOCK = next power of 2, 4 / 8 / 16
    warps by size) up to ``plan.max_single`` (no plan: MAX_SINGLE, one pass only), else ``plan.chunk``-wide
    chunks with ``plan.chunk_warps`` warps (the later passes re-read the row from L2).
    Measured on the H200 (bench/fused_sweep.py, 2026-11-29, M = 4608): swiglu F = 12288 one 16384-wide pass
    with 16 warps 240 us, 2048-wide chunks with 8 warps 162 us (bit-equal: a max reduction); rmsnorm K = 4608
    one 8192-wide pass with 16 warps 86 us, 1024-wide chunks with 4 warps 49 us (the sum of squares then adds
    in another order: a last-bit change of rstd, i.e. rare +-1 code flips against torch)."""
    if n <= (MAX_SINGLE if plan is None else plan.max_single):
        block = triton.next_power_of_2(max(n, 16))
        return block, True, 4 if block <= 2048 else 8 if block <= 4096 else 16
    return plan.chunk, False, plan.chunk_warps


def _row_major(t: torch.Tensor, name: str) -> torch.Tensor:
    """Unit stride along the row (the 16-byte vector loads rely on it); copies only when it is not."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _inv_smooth(inv_smooth, n, device) -> torch.Tensor | None:
    if inv_smooth is None:
        return None
    inv = _vector(inv_smooth, n, "inv_smooth", device, allow_scalar=False)
    return inv if inv.dtype == torch.float32 and inv.stride(0) == 1 else inv.float().contiguous()


def rmsnorm_modulate_quantize(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, scale: torch.Tensor,
                              tokens_per_batch: int, inv_smooth: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, rows = batch-major tokens) -> (int8 [M, K], fp32 scale [M]) of
    ``(rms_norm(x, norm_weight, eps) * scale[row // tokens_per_batch]) * inv_smooth`` with the roundings of
    the module docstring. ``scale``: the adaLN ``1 + s`` as [B, K] (or [1, K] / [K] for every row) in any
    float dtype; B * tokens_per_batch must equal M unless B is 1. ``norm_weight`` [K] any float dtype (it is
    used in fp32; cast it to x.dtype first to mimic a casting layer)."""
    _check_2d(x, "x", _FLOAT, "pass the hidden states as [tokens, K] in bf16, fp16 or fp32")
    m, k = x.shape
    w = _vector(norm_weight, k, "norm_weight", x.device, allow_scalar=False)
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or scale.shape[-1] != k:
        raise ValueError(f"scale must be a float tensor [B, {k}] (the adaLN 1 + s), got "
                         f"{tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    s2 = scale.reshape(-1, k)
    nb = s2.shape[0]
    if nb != 1 and nb * tokens_per_batch != m:
        raise ValueError(f"scale has {nb} batch rows but x has {m} tokens = {tokens_per_batch} tokens per "
                         f"batch x {m / max(tokens_per_batch, 1):g}: pass tokens_per_batch = M // B")
    if s2.device != x.device:
        raise ValueError(f"scale is on {s2.device} but x is on {x.device}")
    inv = _inv_smooth(inv_smooth, k, x.device)
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    qs = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, qs.zero_()
    _check_usable(x, "rmsnorm_modulate_quantize")
    x, w, s2 = _row_major(x, "x"), _row_major(w, "norm_weight"), _row_major(s2, "scale")
    args = (x, w, s2, inv if inv is not None else qs, q, qs, k, max(int(tokens_per_batch), 1), float(eps),
            x.stride(0), 0 if nb == 1 else s2.stride(0), q.stride(0))
    common = dict(HAS_SMOOTH=inv is not None, NORM_DT=_DT_CODE[x.dtype],
                  PROD_DT=_DT_CODE[torch.promote_types(x.dtype, s2.dtype)], SCALE_RECIP=x.is_cuda, INTERPRET=INTERPRET)
    segs = _segments(k, RMS_ONE_PASS)
    if segs is not None:
        launch(_rmsnorm_modulate_quant_seg_kernel, (m,), args, dict(common, S0=segs[0], S1=segs[1], S2=segs[2]),
               _seg_warps(segs, RMS_ONE_PASS), 1, x.device)
        return q, qs
    block, single, warps = _plan(k, RMS_PLAN)
    launch(_rmsnorm_modulate_quant_kernel, (m,), args, dict(common, BLOCK=block, SINGLE=single), warps, 1, x.device)
    return q, qs


def gemm_swiglu(a_q: torch.Tensor, a_scale: torch.Tensor, w13: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                clamp_fp16: bool = False) -> torch.Tensor:
    """SwiGLU of the merged w1+w3 GEMM without writing its [M, 2F] output: ``h = silu(a) * b`` [M, F] in
    ``out_dtype``, where ``[a | b] = int8_gemm(a_q, a_scale, w13, w_scale, bias, out_dtype)`` (w13 int8 [2F, K],
    the w1 rows first). Equal to ``swiglu_ref(a, b, clamp_fp16)`` of that output element for element: a and b
    are rounded to ``out_dtype`` as the GEMM stores them, then silu and the product round as torch's ops do.
    Runs with the merged GEMM's tile config (the same main loop: a tile's weight rows are half w1, half w3)."""
    a_scale, w_scale, bias = _gemm_operands(a_q, a_scale, w13, w_scale, bias, out_dtype)
    m, k = a_q.shape
    n2 = w13.shape[0]
    if n2 % 2:
        raise ValueError(f"w13 has {n2} rows; it must be [2F, K] (w1 rows, then w3 rows)")
    f = n2 // 2
    h = torch.empty((m, f), dtype=out_dtype, device=a_q.device)
    if m == 0 or f == 0:
        return h
    if k == 0:  # an empty sum (int8_gemm's own K = 0 path), then torch's ops
        from . import int8_gemm
        a, b = int8_gemm(a_q, a_scale, w13, w_scale, bias, out_dtype=out_dtype).chunk(2, dim=1)
        y = torch.nn.functional.silu(a) * b
        if clamp_fp16 and out_dtype == torch.float16:
            y = torch.nan_to_num(y, nan=0.0, posinf=65504.0, neginf=-65504.0)
        return h.copy_(y)
    _check_usable(a_q, "gemm_swiglu")
    cfg = select_config(a_q, a_scale, w13, w_scale, bias, None, out_dtype, tail_split=False)
    if a_q.is_cuda:
        cfg = _swiglu_config(cfg, a_q, a_scale, w13, w_scale, bias, h, clamp_fp16)
    if a_q.is_cuda and tail_split_on("swiglu"):  # not yet timed on a GPU: INT8_FUSED_TAIL_SPLIT=all only
        cfg = _swiglu_split(cfg, a_q, a_scale, w13, w_scale, bias, h, clamp_fp16)
    return _launch_gemm_swiglu(a_q, a_scale, w13, w_scale, bias, h, clamp_fp16, cfg)


def _launch_gemm_swiglu(a_q, a_scale, w13, w_scale, bias, h, clamp_fp16, cfg: dict) -> torch.Tensor:
    m, k = a_q.shape
    f = h.shape[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    half = bn // 2
    if cfg.get("PERSIST") and gemm.persistent_ok(a_q, w13, h):
        _launch_gemm_swiglu_persistent(a_q, a_scale, w13, w_scale, bias, h, clamp_fp16, cfg)
        return h
    progs, dp, k_piece, split, part, cnt, _ = split_launch(cfg, -(-m // bm) * -(-f // half), k, a_q.device,
                                                           a_scale)
    # As many CTAs an SM as the plain GEMM gets (two at 128 x 128 tiles, 119 registers a thread at 8 warps): one
    # CTA's epilogue then overlaps the other's main loop. The SwiGLU epilogue alone would take 148 (sm_90 ptxas),
    # i.e. one CTA an SM: 45 % slower on the H200 (run am). Capped at 128 ptxas spills 16 bytes. Tiles whose
    # shared memory allows one CTA an SM (128 x 256) are not capped.
    opts = {}
    if a_q.is_cuda:
        ctas = max(1, gemm._slots(cfg, a_q.device) // _q._sm_count(a_q.device))
        regs = 65536 // (ctas * 32 * cfg["num_warps"]) // 8 * 8
        opts = {"maxnreg": regs} if regs < 255 else {}
    gemm.run_launch(cfg, _gemm_swiglu_kernel, (progs,),
                    (a_q, w13, h, a_scale, w_scale, bias if bias is not None else a_scale, part, cnt,
                     m, f, k, dp, k_piece,
                     a_q.stride(0), a_q.stride(1), w13.stride(0), w13.stride(1), h.stride(0), h.stride(1),
                     a_scale.stride(0), w_scale.stride(0), bias.stride(0) if bias is not None else 0),
                    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], HAS_BIAS=bias is not None,
                         EVEN_K=k % bk == 0, SPLIT=split, DT=_DT_CODE[h.dtype],
                         CLAMP_FP16=bool(clamp_fp16) and h.dtype == torch.float16, INTERPRET=INTERPRET, **opts),
                    a_q.device)
    return h


def _launch_gemm_swiglu_persistent(a_q, a_scale, w13, w_scale, bias, h, clamp_fp16, cfg: dict) -> None:
    """The persistent TMA form of the same tile (``_gemm_swiglu_persistent_kernel``): same bits."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    m, k = a_q.shape
    f = h.shape[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    half = bn // 2
    progs = gemm.persistent_programs(-(-m // bm) * -(-f // half), a_q.device)
    gemm.run_launch(cfg, _gemm_swiglu_persistent_kernel, (progs,),
                    (TensorDescriptor(a_q, [m, k], [a_q.stride(0), 1], [bm, bk]),
                     TensorDescriptor(w13, [2, f, k], [f * w13.stride(0), w13.stride(0), 1], [2, half, bk]),
                     TensorDescriptor(h, [m, f], [h.stride(0), 1], [bm, half]),
                     a_scale, w_scale, bias if bias is not None else a_scale, m, f, k,
                     a_scale.stride(0), w_scale.stride(0), bias.stride(0) if bias is not None else 0, progs),
                    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
                         HAS_BIAS=bias is not None, DT=_DT_CODE[h.dtype],
                         CLAMP_FP16=bool(clamp_fp16) and h.dtype == torch.float16, INTERPRET=INTERPRET),
                    a_q.device)


_SW_SPLIT: dict[tuple, dict] = {}   # (device, F, K, M, tile config) -> the config with its tail split, this process
_SW_TILE: dict[tuple, dict] = {}    # (device, F, K, M bucket, the merged GEMM's config) -> the SwiGLU GEMM's config


def _swiglu_config(cfg, a_q, a_scale, w13, w_scale, bias, h, clamp_fp16) -> dict:
    """The tile config of the SwiGLU-epilogue GEMM: where the s8 wgmma n256 tiles may run (``kernel.s8wgmma``),
    whichever of the merged w1+w3 GEMM's config, the s8 128 x 256 tile, its persistent TMA form and the first
    Hopper tile this kernel timed fastest (medians of interleaved rounds; kept in the autotune file under
    ``SW_..._tilep``, or ``SW_..._tile`` without the persistent form). Its epilogue is heavier than the plain
    GEMM's, and a 128 x 256 tile runs one CTA an SM: the plain GEMM's pick need not be its own. Elsewhere
    ``cfg``."""
    from . import autotune, s8wgmma
    persist = bool(gemm_switches()[2])
    if not s8wgmma.usable(a_q.device):
        return cfg
    m, k = a_q.shape
    bucket = autotune.m_bucket(m)
    memo = (a_q.device, h.shape[1], k, bucket, tuple(sorted(cfg.items())), persist)
    hit = _SW_TILE.get(memo)
    if hit is None:
        cache = gemm._device_cache(a_q.device)
        key = f"SW_{autotune.ConfigCache.key(w13.shape[0], k, bucket)}_tile" + ("p" if persist else "")
        hit = cache.get(key)
        if hit is None:
            # the merged GEMM's config first: it wins ties, and its failure is raised
            cands = [cfg, *(c for c in (*autotune.s8_configs(persist), autotune.hopper_configs()[0]) if c != cfg)]

            def time_fn(c):
                return gemm.timed_ms(lambda: _launch_gemm_swiglu(a_q, a_scale, w13, w_scale, bias, h, clamp_fp16,
                                                                 c))
            with not_recorded():
                med = autotune.interleaved_medians(dict(enumerate(cands)), time_fn)
            hit = cands[min(med, key=lambda i: (med[i], i))]
            cache.put(key, hit, gemm.tuning_meta(a_q.device))
        hit = _SW_TILE[memo] = {k_: v for k_, v in hit.items() if k_ != "SPLIT"}
    return hit


def _swiglu_split(cfg, a_q, a_scale, w13, w_scale, bias, h, clamp_fp16) -> dict:
    """``cfg`` with the tail split the SwiGLU-epilogue kernel itself timed fastest for this M (``gemm.choose_split``
    with these operands, kept in the autotune file under ``SW_...``)."""
    from . import gemm
    m, k = a_q.shape
    key = (a_q.device, h.shape[1], k, m, tuple(sorted(cfg.items())))
    hit = _SW_SPLIT.get(key)
    if hit is None:
        def time_fn(c):
            return gemm.timed_ms(lambda: _launch_gemm_swiglu(a_q, a_scale, w13, w_scale, bias, h, clamp_fp16, c))
        with not_recorded():
            hit = _SW_SPLIT[key] = choose_split(
                cfg, m, w13.shape[0], k, gemm._slots(cfg, a_q.device), gemm._device_cache(a_q.device), time_fn,
                gemm.tuning_meta(a_q.device), kind="SW_")
    return hit


def swiglu_quantize(h13, inv_smooth: torch.Tensor | None = None, clamp_fp16: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``h13`` = [M, 2F] (the w1 half first, as the merged w1+w3 GEMM writes it) or a pair (a [M, F],
    b [M, F]) -> (int8 [M, F], fp32 scale [M]) of ``silu(a) * b * inv_smooth`` with the roundings of the
    module docstring. ``clamp_fp16``: apply ComfyUI's ``clamp_fp16`` (fp16 inputs only; current ComfyUI's
    FeedForward does, 0.3.75 does not)."""
    if isinstance(h13, (tuple, list)):
        a, b = h13
        _check_2d(a, "a (the w1 output)", _FLOAT, "pass silu's input as [tokens, F]")
        _check_2d(b, "b (the w3 output)", _FLOAT, "pass the gate as [tokens, F]")
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            raise ValueError(f"a and b must match: a {tuple(a.shape)} {a.dtype} on {a.device}, "
                             f"b {tuple(b.shape)} {b.dtype} on {b.device}")
    else:
        _check_2d(h13, "h13", _FLOAT, "pass the merged w1+w3 output as [tokens, 2F]")
        if h13.shape[1] % 2:
            raise ValueError(f"h13 has {h13.shape[1]} columns; it must be [M, 2F] (w1 half, then w3 half)")
        a, b = h13.chunk(2, dim=1)
    m, f = a.shape
    inv = _inv_smooth(inv_smooth, f, a.device)
    q = torch.empty((m, f), dtype=torch.int8, device=a.device)
    qs = torch.empty((m,), dtype=torch.float32, device=a.device)
    if m == 0 or f == 0:
        return q, qs.zero_()
    _check_usable(a, "swiglu_quantize")
    a, b = _row_major(a, "a"), _row_major(b, "b")
    segs = _segments(f, SWIGLU_ONE_PASS)
    if segs is not None:
        launch(_swiglu_quant_seg_kernel, (m,),
               (a, b, inv if inv is not None else qs, q, qs, f, a.stride(0), b.stride(0), q.stride(0)),
               dict(HAS_SMOOTH=inv is not None, DT=_DT_CODE[a.dtype],
                    CLAMP_FP16=bool(clamp_fp16) and a.dtype == torch.float16, SCALE_RECIP=a.is_cuda,
                    S0=segs[0], S1=segs[1], S2=segs[2], INTERPRET=INTERPRET),
               _seg_warps(segs, SWIGLU_ONE_PASS), 1, a.device)
        return q, qs
    block, single, warps = _plan(f, SWIGLU_PLAN)
    launch(_swiglu_quant_kernel, (m,),
           (a, b, inv if inv is not None else qs, q, qs, f, a.stride(0), b.stride(0), q.stride(0)),
           dict(HAS_SMOOTH=inv is not None, DT=_DT_CODE[a.dtype],
                CLAMP_FP16=bool(clamp_fp16) and a.dtype == torch.float16, SCALE_RECIP=a.is_cuda,
                BLOCK=block, SINGLE=single, INTERPRET=INTERPRET), warps, 1, a.device)
    return q, qs


def gated_residual_rmsnorm(x: torch.Tensor, o: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           gate: torch.Tensor, tokens_per_batch: int, next_norm_weight: torch.Tensor | None = None,
                           next_eps: float = 1e-6, next_scale: torch.Tensor | None = None,
                           inv_smooth: torch.Tensor | None = None):
    """``y = x + gate[row // tokens_per_batch] * rms_norm(o, norm_weight, eps)`` ([M, K] each, gate [B | 1, K]),
    rounded as torch's three ops (to o's dtype, the gate product's, then y's). With ``next_norm_weight``
    and ``next_scale`` also the int8 input of the next GEMM, ``rmsnorm_modulate_quantize(y, ...)`` from the
    same registers. Returns (y, int8 [M, K] | None, fp32 [M] | None). Rows up to MAX_SINGLE only (the
    Ideogram 4 / Lumina widths); ``fits(K)`` says whether a row fits."""
    _check_2d(x, "x", _FLOAT, "pass the residual stream as [tokens, K]")
    _check_2d(o, "o", _FLOAT, "pass the branch output as [tokens, K]")
    m, k = x.shape
    if o.shape != x.shape or o.device != x.device:
        raise ValueError(f"o {tuple(o.shape)} on {o.device} must match x {tuple(x.shape)} on {x.device}")
    if not fits(k):
        raise ValueError(f"gated_residual_rmsnorm keeps a row in registers: K={k} > {MAX_SINGLE}")
    wn = _vector(norm_weight, k, "norm_weight", x.device, allow_scalar=False)
    g2 = gate.reshape(-1, k)
    nb = g2.shape[0]
    if nb != 1 and nb * tokens_per_batch != m:
        raise ValueError(f"gate has {nb} batch rows but x has {m} tokens ({tokens_per_batch} a batch)")
    nxt = next_norm_weight is not None
    gate_dt = torch.promote_types(o.dtype, g2.dtype)
    out_dt = torch.promote_types(x.dtype, gate_dt)
    y = torch.empty((m, k), dtype=out_dt, device=x.device)
    q = torch.empty((m, k), dtype=torch.int8, device=x.device) if nxt else None
    qs = torch.empty((m,), dtype=torch.float32, device=x.device) if nxt else None
    if m == 0:
        return y, q, qs
    _check_usable(x, "gated_residual_rmsnorm")
    x, o, wn, g2 = _row_major(x, "x"), _row_major(o, "o"), _row_major(wn, "norm_weight"), _row_major(g2, "gate")
    if nxt:
        w2 = _row_major(_vector(next_norm_weight, k, "next_norm_weight", x.device, allow_scalar=False), "w")
        s2 = _row_major(next_scale.reshape(-1, k), "next_scale")
        if s2.shape[0] != 1 and s2.shape[0] * tokens_per_batch != m:
            raise ValueError(f"next_scale has {s2.shape[0]} batch rows for {m} tokens ({tokens_per_batch} a batch)")
        inv = _inv_smooth(inv_smooth, k, x.device)
    else:
        w2, s2, inv = wn, g2, None
    dummy = y
    consts = dict(NORM_DT=_DT_CODE[o.dtype], GATE_DT=_DT_CODE[gate_dt], OUT_DT=_DT_CODE[out_dt], HAS_NEXT=nxt,
                  HAS_SMOOTH=inv is not None,
                  NEXT_PROD_DT=_DT_CODE[torch.promote_types(out_dt, s2.dtype)] if nxt else 0,
                  SCALE_RECIP=x.is_cuda)
    segs = _segments(k, RESIDUAL_ONE_PASS)
    if segs is not None:
        fn, warps = _gated_residual_seg_kernel, _seg_warps(segs, RESIDUAL_ONE_PASS)
        consts.update(S0=segs[0], S1=segs[1], S2=segs[2])
    else:
        block, _, warps = _plan(k)
        fn = _gated_residual_kernel
        consts.update(BLOCK=block)
    launch(fn, (m,),
           (x, o, wn, g2, y, w2, s2, inv if inv is not None else dummy, q if nxt else dummy,
            qs if nxt else dummy, k, max(int(tokens_per_batch), 1), float(eps), float(next_eps),
            x.stride(0), o.stride(0), 0 if nb == 1 else g2.stride(0), y.stride(0),
            0 if s2.shape[0] == 1 else s2.stride(0), q.stride(0) if nxt else 0),
           dict(consts, INTERPRET=INTERPRET,
                # no FMA contraction: torch rounds gate * norm(o) to the gate dtype before the add, so the
                # compiler must not fuse that multiply into x + t (with it, 22 % of y's elements differed from
                # torch's on the H200; without, 1.5e-6, bench/RESULTS.md)
                enable_fp_fusion=False), warps, 1, x.device)
    return y, q, qs


def fits(k: int) -> bool:
    """Whether a row of k elements runs in the one-pass (register-resident) kernels."""
    return k <= MAX_SINGLE


def _batch_rows(t: torch.Tensor, k: int, m: int, tokens_per_batch: int, name: str, device) -> torch.Tensor:
    """A per-batch modulation tensor ([B | 1, K], or [B, 1, K] as Flux's ModulationOut holds it) as a [B, K] view."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.shape[-1] != k:
        raise ValueError(f"{name} must be a float tensor [B, {k}] (per batch row), got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    t2 = t.reshape(-1, k)
    nb = t2.shape[0]
    if nb != 1 and nb * tokens_per_batch != m:
        raise ValueError(f"{name} has {nb} batch rows but x has {m} tokens = {tokens_per_batch} tokens per "
                         f"batch x {m / max(tokens_per_batch, 1):g}: pass tokens_per_batch = M // B")
    if t2.device != device:
        raise ValueError(f"{name} is on {t2.device} but x is on {device}")
    return _row_major(t2, name)


def _modulation_operands(scale, shift, inv_smooth, m: int, k: int, tpb: int, device):
    """(scale [B, K], shift [B, K], inv_smooth | None, int8 [M, K], fp32 [M]): the checked modulation rows and the
    empty outputs of a LayerNorm-modulate-quantize kernel."""
    s2 = _batch_rows(scale, k, m, tpb, "scale", device)
    sh2 = _batch_rows(shift, k, m, tpb, "shift", device)
    inv = _inv_smooth(inv_smooth, k, device)
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
    _check_2d(x, "x", _FLOAT, "pass the hidden states as [tokens, K] in bf16, fp16 or fp32")
    m, k = x.shape
    tpb = max(int(tokens_per_batch), 1)
    s2, sh2, inv, q, qs = _modulation_operands(scale, shift, inv_smooth, m, k, tpb, x.device)
    if m == 0 or k == 0:
        return q, qs.zero_()
    _check_usable(x, "layernorm_modulate_quantize")
    x = _row_major(x, "x")
    prod = torch.promote_types(torch.promote_types(x.dtype, s2.dtype), sh2.dtype)
    args = (x, s2, sh2, inv if inv is not None else qs, q, qs, k, tpb, float(eps),
            x.stride(0), 0 if s2.shape[0] == 1 else s2.stride(0), 0 if sh2.shape[0] == 1 else sh2.stride(0),
            q.stride(0))
    common = dict(HAS_SMOOTH=inv is not None, NORM_DT=_DT_CODE[x.dtype], SCALE_DT=_DT_CODE[s2.dtype],
                  PROD_DT=_DT_CODE[prod], SCALE_RECIP=x.is_cuda, INTERPRET=INTERPRET)
    segs = _segments(k, LN_ONE_PASS)
    if segs is not None:
        launch(_layernorm_modulate_quant_seg_kernel, (m,), args, dict(common, S0=segs[0], S1=segs[1], S2=segs[2]),
               _seg_warps(segs, LN_ONE_PASS), 1, x.device)
        return q, qs
    block, single, warps = _plan(k, LN_PLAN)
    launch(_layernorm_modulate_quant_kernel, (m,), args, dict(common, BLOCK=block, SINGLE=single), warps, 1,
           x.device)
    return q, qs


def _concat_gelu(a: torch.Tensor | None, h: torch.Tensor, inv_smooth, what: str):
    _check_2d(h, "h (the GELU input)", _FLOAT, "pass the pre-activation as [tokens, F]")
    m, f = h.shape
    ka = 0
    if a is not None:
        _check_2d(a, "a (the part before the GELU part)", _FLOAT, "pass it as [tokens, K]")
        if a.shape[0] != m or a.dtype != h.dtype or a.device != h.device:
            raise ValueError(f"a {tuple(a.shape)} {a.dtype} on {a.device} must match h {tuple(h.shape)} {h.dtype} "
                             f"on {h.device} in rows, dtype and device (torch.cat would promote)")
        ka = a.shape[1]
    inv = _inv_smooth(inv_smooth, ka + f, h.device)
    q = torch.empty((m, ka + f), dtype=torch.int8, device=h.device)
    qs = torch.empty((m,), dtype=torch.float32, device=h.device)
    if m == 0 or ka + f == 0:
        return q, qs.zero_()
    _check_usable(h, what)
    h = _row_major(h, "h")
    a = _row_major(a, "a") if a is not None else None
    args = (a if a is not None else h, h, inv if inv is not None else qs, q, qs, ka, f,
            a.stride(0) if a is not None else 0, h.stride(0), q.stride(0))
    common = dict(HAS_A=a is not None, HAS_SMOOTH=inv is not None, DT=_DT_CODE[h.dtype], SCALE_RECIP=h.is_cuda)
    segs = _segments(f, GELU_ONE_PASS)
    asegs = _segments(ka, GELU_ONE_PASS) if ka else (0, 0, 0)
    if segs is not None and asegs is not None and asegs[2] == 0:
        launch(_concat_gelu_quant_seg_kernel, (m,), args,
               dict(common, A0=asegs[0], A1=asegs[1], S0=segs[0], S1=segs[1], S2=segs[2], INTERPRET=INTERPRET,
                    FAST=GELU_FAST), _seg_warps(tuple(asegs) + tuple(segs), GELU_ONE_PASS), 1, h.device)
        return q, qs
    block, single, warps = _plan(max(ka, f), GELU_PLAN)
    launch(_concat_gelu_quant_kernel, (m,), args,
           dict(common, BLOCK=block, SINGLE=single, INTERPRET=INTERPRET, FAST=GELU_FAST), warps, 1, h.device)
    return q, qs


def gelu_tanh_quantize(h: torch.Tensor, inv_smooth: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, F] -> (int8 [M, F], fp32 scale [M]) of ``gelu(h, approximate="tanh")`` rounded to h's dtype,
    times inv_smooth (Flux's ``mlp.1`` feeding ``mlp.2``)."""
    return _concat_gelu(None, h, inv_smooth, "gelu_tanh_quantize")


def concat_gelu_quantize(a: torch.Tensor, h: torch.Tensor, inv_smooth: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """a [M, K], h [M, F] (same dtype) -> (int8 [M, K + F], fp32 scale [M]) of
    ``cat((a, gelu(h, approximate="tanh")), -1) * inv_smooth`` without building the concatenation: one absmax
    per row over both parts (Flux's single block: attention output and MLP activation feeding ``linear2``).
    ``h`` may be a column slice of a wider tensor (unit stride along the row)."""
    return _concat_gelu(a, h, inv_smooth, "concat_gelu_quantize")


# ------------------------------------------------------------------- Wan's residual + LayerNorm (issue 13)
@triton.jit
def _residual_layernorm_kernel(x_ptr, y_ptr, g_ptr, r_ptr, w_ptr, b_ptr, s_ptr, sh_ptr, inv_ptr, n_ptr, q_ptr,
                               qs_ptr, K, tokens_per_batch, eps,
                               stride_xm, stride_ym, stride_gb, stride_rm, stride_sb, stride_shb, stride_nm,
                               HAS_GATE: tl.constexpr, ROUND_PRODUCT: tl.constexpr, MODE: tl.constexpr,
                               HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_SMOOTH: tl.constexpr, DT: tl.constexpr,
                               SCALE_DT: tl.constexpr, PROD_DT: tl.constexpr, SCALE_RECIP: tl.constexpr,
                               BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    # One row in registers. r = dt(x + y * g[row // tokens_per_batch]) (torch.addcmul: fp32 inside, one rounding),
    # dt(x + dt(y * g)) with ROUND_PRODUCT (``x += y * g``: two torch ops, two roundings), or dt(x + y) -> r_ptr
    # (which may be x_ptr: the row is read before it is written).
    # MODE 1: n = dt(layer_norm(r) * w + b) (F.layer_norm with its affine, one rounding) -> n_ptr.
    # MODE 2: the int8 input of the next GEMM, addcmul(shift, dt(layer_norm(r)), 1 + scale) quantized per row
    # (as _layernorm_modulate_quant_kernel). Mean and variance: two passes over the registers, fp32.
    row = tl.program_id(0)
    bidx = (row // tokens_per_batch).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row.to(tl.int64) * stride_ym + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        gv = tl.load(g_ptr + bidx * stride_gb + cols, mask=mask, other=0.0).to(tl.float32)
        if ROUND_PRODUCT:
            r = _round(x + _round(y * gv, DT, INTERPRET), DT, INTERPRET)
        else:
            r = _round(x + y * gv, DT, INTERPRET)
    else:
        r = _round(x + y, DT, INTERPRET)
    tl.store(r_ptr + row.to(tl.int64) * stride_rm + cols, r.to(r_ptr.dtype.element_ty), mask=mask)
    if MODE > 0:
        mean = tl.math.div_rn(tl.sum(r, axis=0), K * 1.0)  # masked lanes hold 0
        d = tl.where(mask, r - mean, 0.0)
        rstd = _rstd(tl.sum(d * d, axis=0), K, eps, INTERPRET)
        if MODE == 1:
            n = (r - mean) * rstd
            if HAS_W:
                n = n * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_B:
                n = n + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(n_ptr + row.to(tl.int64) * stride_nm + cols,
                     _round(n, DT, INTERPRET).to(n_ptr.dtype.element_ty), mask=mask)
        else:
            yq = _lnmod_tile(r, s_ptr + bidx * stride_sb, sh_ptr + bidx * stride_shb, inv_ptr, cols, mask, mean,
                             rstd, HAS_SMOOTH, DT, SCALE_DT, PROD_DT, INTERPRET)
            ay = tl.abs(yq)
            bad = tl.max(tl.where(ay < float("inf"), 0, 1), axis=0) > 0  # NaN fails `< inf` as Inf does
            scale, mult, usable = _quant_params(tl.max(ay, axis=0), bad, SCALE_RECIP)
            tl.store(qs_ptr + row, scale)
            _store_q(q_ptr + row.to(tl.int64) * stride_nm + cols, yq, mult, usable, mask, INTERPRET)


@triton.jit
def _res_seg_r(x_row, y_row, g_row, r_row, K, OFF: tl.constexpr, SEG: tl.constexpr, HAS_GATE: tl.constexpr,
               ROUND_PRODUCT: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr):
    # one segment of the residual sum (as _residual_layernorm_kernel), stored, and its sum; masked lanes hold 0
    ks = OFF + tl.arange(0, SEG)
    mask = ks < K
    x = tl.load(x_row + ks, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_row + ks, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        gv = tl.load(g_row + ks, mask=mask, other=0.0).to(tl.float32)
        if ROUND_PRODUCT:
            r = _round(x + _round(y * gv, DT, INTERPRET), DT, INTERPRET)
        else:
            r = _round(x + y * gv, DT, INTERPRET)
    else:
        r = _round(x + y, DT, INTERPRET)
    tl.store(r_row + ks, r.to(r_row.dtype.element_ty), mask=mask)
    return r, tl.sum(r, axis=0)


@triton.jit
def _res_seg_n(r, w_ptr, b_ptr, n_row, K, mean, rstd, OFF: tl.constexpr, SEG: tl.constexpr, HAS_W: tl.constexpr,
               HAS_B: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr):
    ks = OFF + tl.arange(0, SEG)
    mask = ks < K
    n = (r - mean) * rstd
    if HAS_W:
        n = n * tl.load(w_ptr + ks, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        n = n + tl.load(b_ptr + ks, mask=mask, other=0.0).to(tl.float32)
    tl.store(n_row + ks, _round(n, DT, INTERPRET).to(n_row.dtype.element_ty), mask=mask)


@triton.jit
def _residual_layernorm_seg_kernel(x_ptr, y_ptr, g_ptr, r_ptr, w_ptr, b_ptr, s_ptr, sh_ptr, inv_ptr, n_ptr, q_ptr,
                                   qs_ptr, K, tokens_per_batch, eps,
                                   stride_xm, stride_ym, stride_gb, stride_rm, stride_sb, stride_shb, stride_nm,
                                   HAS_GATE: tl.constexpr, ROUND_PRODUCT: tl.constexpr, MODE: tl.constexpr,
                                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                                   DT: tl.constexpr, SCALE_DT: tl.constexpr, PROD_DT: tl.constexpr,
                                   SCALE_RECIP: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                                   INTERPRET: tl.constexpr):
    # _residual_layernorm_kernel over up to three power-of-2 segments (Flux's K = 3072: 2048 + 1024; Wan 14B's
    # 5120: 4096 + 1024) instead of one masked power-of-2 tile: the sums add per segment. r_ptr may be x_ptr: each
    # segment is read before it is written, and the segments do not overlap.
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    bidx = (row // tokens_per_batch).to(tl.int64)
    x_row, y_row, r_row = x_ptr + r64 * stride_xm, y_ptr + r64 * stride_ym, r_ptr + r64 * stride_rm
    g_row = g_ptr + bidx * stride_gb
    r0, tot = _res_seg_r(x_row, y_row, g_row, r_row, K, 0, S0, HAS_GATE, ROUND_PRODUCT, DT, INTERPRET)
    r1, r2 = r0, r0  # placeholders for unused segments
    if S1 > 0:
        r1, t1 = _res_seg_r(x_row, y_row, g_row, r_row, K, S0, S1, HAS_GATE, ROUND_PRODUCT, DT, INTERPRET)
        tot += t1
    if S2 > 0:
        r2, t2 = _res_seg_r(x_row, y_row, g_row, r_row, K, S0 + S1, S2, HAS_GATE, ROUND_PRODUCT, DT, INTERPRET)
        tot += t2
    if MODE > 0:
        mean, rstd = _ln_seg_stats(r0, r1, r2, tot, K, eps, S0, S1, S2, INTERPRET)
        n_row = n_ptr + r64 * stride_nm
        if MODE == 1:
            _res_seg_n(r0, w_ptr, b_ptr, n_row, K, mean, rstd, 0, S0, HAS_W, HAS_B, DT, INTERPRET)
            if S1 > 0:
                _res_seg_n(r1, w_ptr, b_ptr, n_row, K, mean, rstd, S0, S1, HAS_W, HAS_B, DT, INTERPRET)
            if S2 > 0:
                _res_seg_n(r2, w_ptr, b_ptr, n_row, K, mean, rstd, S0 + S1, S2, HAS_W, HAS_B, DT, INTERPRET)
        else:
            _ln_seg_quant(r0, r1, r2, s_ptr + bidx * stride_sb, sh_ptr + bidx * stride_shb, inv_ptr, n_row, qs_ptr,
                          row, K, mean, rstd, S0, S1, S2, HAS_SMOOTH, DT, SCALE_DT, PROD_DT, SCALE_RECIP, INTERPRET)


def _residual(x, y, gate, tokens_per_batch: int, mode: int, eps: float = 1e-6, weight=None, bias=None, scale=None,
              shift=None, inv_smooth=None, what: str = "residual_add", round_product: bool = False, out=None):
    """Checks and one launch of ``_residual_layernorm_kernel`` (see the public functions below); ``out``: where the
    sum goes (x itself for ``x += ...``; default a new tensor)."""
    _check_2d(x, "x", _FLOAT, "pass the residual stream as [tokens, K]")
    _check_2d(y, "y", _FLOAT, "pass the branch output as [tokens, K]")
    m, k = x.shape
    if y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
        raise ValueError(f"{what}: y {tuple(y.shape)} {y.dtype} on {y.device} must match x {tuple(x.shape)} "
                         f"{x.dtype} on {x.device} (torch would promote a mixed dtype)")
    if not fits(k):
        raise ValueError(f"{what} keeps a row in registers: K={k} > {MAX_SINGLE}")
    tpb = max(int(tokens_per_batch), 1)
    g2 = None
    if gate is not None:
        g2 = _batch_rows(gate, k, m, tpb, "gate", x.device)
        if g2.dtype != x.dtype:
            raise ValueError(f"{what}: gate is {g2.dtype} but x is {x.dtype} (torch would promote the result)")
    if out is None:
        r = torch.empty((m, k), dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(f"{what}: out must be a row-major {tuple(x.shape)} {x.dtype} tensor on {x.device}")
    else:
        r = out
    n = q = qs = None
    w = b = s2 = sh2 = inv = None
    if mode == 1:
        n = torch.empty((m, k), dtype=x.dtype, device=x.device)
        w = None if weight is None else _row_major(_vector(weight, k, "weight", x.device, False), "weight")
        b = None if bias is None else _row_major(_vector(bias, k, "bias", x.device, False), "bias")
    elif mode == 2:
        s2, sh2, inv, q, qs = _modulation_operands(scale, shift, inv_smooth, m, k, tpb, x.device)
    if m == 0 or k == 0:
        return r, n, q, (qs.zero_() if qs is not None else None)
    _check_usable(x, what)
    x, y = _row_major(x, "x"), _row_major(y, "y")
    dummy = r
    prod = torch.promote_types(torch.promote_types(x.dtype, s2.dtype), sh2.dtype) if mode == 2 else x.dtype
    segs = _segments(k, RESIDUAL_LN_ONE_PASS)
    if segs is not None:
        fn, tile, warps = (_residual_layernorm_seg_kernel, dict(S0=segs[0], S1=segs[1], S2=segs[2]),
                           _seg_warps(segs, RESIDUAL_LN_ONE_PASS))
    else:
        block, _, warps = _plan(k)
        fn, tile = _residual_layernorm_kernel, dict(BLOCK=block)
    out2 = n if mode == 1 else q if mode == 2 else dummy
    launch(fn, (m,),
           (x, y, g2 if g2 is not None else dummy, r, w if w is not None else dummy, b if b is not None else dummy,
            s2 if s2 is not None else dummy, sh2 if sh2 is not None else dummy, inv if inv is not None else dummy,
            out2, out2, qs if qs is not None else dummy, k, tpb, float(eps),
            x.stride(0), y.stride(0), 0 if g2 is None or g2.shape[0] == 1 else g2.stride(0), r.stride(0),
            0 if s2 is None or s2.shape[0] == 1 else s2.stride(0),
            0 if sh2 is None or sh2.shape[0] == 1 else sh2.stride(0), out2.stride(0)),
           dict(HAS_GATE=g2 is not None, ROUND_PRODUCT=bool(round_product), MODE=mode, HAS_W=w is not None,
                HAS_B=b is not None,
                HAS_SMOOTH=inv is not None, DT=_DT_CODE[x.dtype],
                SCALE_DT=_DT_CODE[s2.dtype] if s2 is not None else 0, PROD_DT=_DT_CODE[prod],
                SCALE_RECIP=x.is_cuda, INTERPRET=INTERPRET, **tile), warps, 1, x.device)
    return r, n, q, qs


def residual_add(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None = None, tokens_per_batch: int = 1,
                 round_product: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.addcmul(x, y, gate[row // tokens_per_batch])`` (gate [B | 1, K] or [B, 1, K]) or ``x + y``: x, y
    [M, K] of one dtype (gate too), one rounding to it (fp32 inside, as torch). ``round_product``: ``x + y * gate``
    as two torch ops (the product rounded to the dtype first: Flux's ``img += y * gate``). ``out``: the result's
    tensor (``x`` for in place). Rows up to MAX_SINGLE."""
    return _residual(x, y, gate, tokens_per_batch, 0, round_product=round_product, out=out)[0]


def residual_add_layernorm(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None, tokens_per_batch: int,
                           eps: float, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, n): ``r = residual_add(x, y, gate)`` and ``n = F.layer_norm(r, (K,), weight, bias, eps)`` from the same
    registers (Wan's ``x = addcmul(x, y, e[2])`` then ``norm3(x)``), each rounded once to x's dtype."""
    r, n, _, _ = _residual(x, y, gate, tokens_per_batch, 1, eps, weight, bias, what="residual_add_layernorm")
    return r, n


def residual_add_layernorm_modulate_quantize(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None,
                                             tokens_per_batch: int, eps: float, scale: torch.Tensor,
                                             shift: torch.Tensor, inv_smooth: torch.Tensor | None = None,
                                             round_product: bool = False, out: torch.Tensor | None = None
                                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(r, int8 [M, K], fp32 [M]): ``r = residual_add(x, y, gate)`` and the next GEMM's int8 input
    ``layernorm_modulate_quantize(r, scale, shift, tokens_per_batch, inv_smooth, eps)`` from the same registers
    (Wan's ``x = x + cross_attn(...)`` then ``norm2(x) * (1 + e[4]) + e[3]`` feeding ``ffn.0``; Flux's
    ``img += proj * gate`` then ``img_norm2`` with ``round_product`` and ``out=x``)."""
    r, _, q, qs = _residual(x, y, gate, tokens_per_batch, 2, eps, scale=scale, shift=shift, inv_smooth=inv_smooth,
                            what="residual_add_layernorm_modulate_quantize", round_product=round_product, out=out)
    return r, q, qs


# ------------------------------------------------------------------------- QK norm + RoPE (issue 14)
@triton.jit
def _half_rope_store(x0, x1, wp, eps, f00, f01, f10, f11, out, mask, half, D: tl.constexpr, DT: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """Heads' halves x0 = x[:, :D/2], x1 = x[:, D/2:] (fp32): rms_norm with weight ``wp``, split-half RoPE, stored
    at ``out`` (the first half's pointers) and ``out + D/2``; roundings as the per-part loop of the kernel."""
    w0 = tl.load(wp + half).to(tl.float32)[None, :]
    w1 = tl.load(wp + D // 2 + half).to(tl.float32)[None, :]
    rstd = _rstd(tl.sum(x0 * x0, axis=1) + tl.sum(x1 * x1, axis=1), D, eps, INTERPRET)[:, None]
    n0 = _round(x0 * rstd * w0, DT, INTERPRET)
    n1 = _round(x1 * rstd * w1, DT, INTERPRET)
    tl.store(out, _round(f00 * n0 + f01 * n1, DT, INTERPRET).to(out.dtype.element_ty), mask=mask)
    tl.store(out + D // 2, _round(f10 * n0 + f11 * n1, DT, INTERPRET).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(src_ptr, ksrc_ptr, wq_ptr, wk_ptr, pe_ptr, q_ptr, k_ptr, v_ptr,
                         L, H, row_offset, k_off, eps_q, eps_k,
                         stride_sb, stride_sl, stride_pb, stride_pl, stride_ob, stride_oh, stride_ol,
                         D: tl.constexpr, BLOCK_H: tl.constexpr, DT: tl.constexpr, HAS_PE: tl.constexpr,
                         SPLIT_HALF: tl.constexpr, NORM_ROW: tl.constexpr, WRITE_V: tl.constexpr,
                         PREFETCH: tl.constexpr, INTERPRET: tl.constexpr):
    # One token: its q [H, D] (at src), k [H, D] (at ksrc + k_off) and v (at src + 2 H D) -> rows row_offset + l
    # of q, k, v [B, H, L_all, D]. q, k: rms_norm with the norm's weight (rounded to the dtype, as F.rms_norm) over
    # each head's D (per head, Flux / Ideogram 4 / Lumina 2) or over the whole H * D row (NORM_ROW, Wan), then RoPE
    # with the token's [D/2, 2, 2] fp32 rotations, ``x_out[r] = f[r, 0] * x0 + f[r, 1] * x1`` rounded to the dtype
    # (as comfy.ldm.flux.math.apply_rope1); v copied. SPLIT_HALF (Ideogram 4): pair i is (x[i], x[i + D/2])
    # instead of (x[2i], x[2i + 1]), as comfy_kitchen's rms_rope_split_half and ComfyUI's _apply_rope_split_half1.
    # Programs: (token, group of BLOCK_H heads); NORM_ROW takes all heads in one group (its norm spans them).
    pid = tl.program_id(0)
    b = pid // L
    l = pid % L
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (hs < H)[:, None]
    src_row = b.to(tl.int64) * stride_sb + l.to(tl.int64) * stride_sl
    dst_row = (b.to(tl.int64) * stride_ob + hs[:, None].to(tl.int64) * stride_oh
               + (row_offset + l).to(tl.int64) * stride_ol)
    half = tl.arange(0, D // 2)
    if HAS_PE:
        pe = pe_ptr + (b.to(tl.int64) * stride_pb + (row_offset + l).to(tl.int64) * stride_pl) + half * 4
        if PREFETCH:  # the token's [D/2, 2, 2] rotations as 16-byte vectors, split in registers
            fa, fb = tl.split(tl.reshape(tl.load(pe[:, None] + tl.arange(0, 4)[None, :]), (D // 2, 2, 2)))
            f00, f10 = tl.split(fa)
            f01, f11 = tl.split(fb)
            f00, f01, f10, f11 = f00[None, :], f01[None, :], f10[None, :], f11[None, :]
        else:
            f00 = tl.load(pe)[None, :]
            f01 = tl.load(pe + 1)[None, :]
            f10 = tl.load(pe + 2)[None, :]
            f11 = tl.load(pe + 3)[None, :]
    if SPLIT_HALF and HAS_PE and not NORM_ROW:
        # Ideogram 4's split-half pairs (x[i], x[i + D/2]): the two halves of each head loaded as two tiles, so the
        # rotation needs no register shuffles; PREFETCH: q's and k's halves all loaded before either is computed
        t0 = hs[:, None] * D + half[None, :]
        qb, kb = src_ptr + src_row, ksrc_ptr + k_off + src_row
        qo, ko = q_ptr + dst_row + half[None, :], k_ptr + dst_row + half[None, :]
        if PREFETCH:
            q0 = tl.load(qb + t0, mask=mask, other=0.0).to(tl.float32)
            q1 = tl.load(qb + t0 + D // 2, mask=mask, other=0.0).to(tl.float32)
            k0 = tl.load(kb + t0, mask=mask, other=0.0).to(tl.float32)
            k1 = tl.load(kb + t0 + D // 2, mask=mask, other=0.0).to(tl.float32)
            _half_rope_store(q0, q1, wq_ptr, eps_q, f00, f01, f10, f11, qo, mask, half, D, DT, INTERPRET)
            _half_rope_store(k0, k1, wk_ptr, eps_k, f00, f01, f10, f11, ko, mask, half, D, DT, INTERPRET)
        else:
            for part in tl.static_range(2):
                base = qb if part == 0 else kb
                x0 = tl.load(base + t0, mask=mask, other=0.0).to(tl.float32)
                x1 = tl.load(base + t0 + D // 2, mask=mask, other=0.0).to(tl.float32)
                _half_rope_store(x0, x1, wq_ptr if part == 0 else wk_ptr, eps_q if part == 0 else eps_k,
                                 f00, f01, f10, f11, qo if part == 0 else ko, mask, half, D, DT, INTERPRET)
    else:
        cols = tl.arange(0, D)
        tile = hs[:, None] * D + cols[None, :]
        for part in tl.static_range(2):
            if part == 0:
                x = tl.load(src_ptr + src_row + tile, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(ksrc_ptr + k_off + src_row + tile, mask=mask, other=0.0).to(tl.float32)
            if NORM_ROW:
                w = tl.load((wq_ptr if part == 0 else wk_ptr) + tile, mask=mask, other=0.0).to(tl.float32)
                rstd = _rstd(tl.sum(tl.sum(x * x, axis=1), axis=0), H * D, eps_q if part == 0 else eps_k, INTERPRET)
                n = _round(x * rstd * w, DT, INTERPRET)
            else:
                w = tl.load((wq_ptr if part == 0 else wk_ptr) + cols).to(tl.float32)
                rstd = _rstd(tl.sum(x * x, axis=1), D, eps_q if part == 0 else eps_k, INTERPRET)
                n = _round(x * rstd[:, None] * w[None, :], DT, INTERPRET)
            if HAS_PE:
                if SPLIT_HALF:  # [h, r * D/2 + i] -> [h, i, r]
                    x0, x1 = tl.split(tl.permute(tl.reshape(n, (BLOCK_H, 2, D // 2)), (0, 2, 1)))
                else:
                    x0, x1 = tl.split(tl.reshape(n, (BLOCK_H, D // 2, 2)))
                o0 = _round(f00 * x0 + f01 * x1, DT, INTERPRET)
                o1 = _round(f10 * x0 + f11 * x1, DT, INTERPRET)
                if SPLIT_HALF:
                    n = tl.reshape(tl.permute(tl.join(o0, o1), (0, 2, 1)), (BLOCK_H, D))
                else:
                    n = tl.reshape(tl.join(o0, o1), (BLOCK_H, D))
            tl.store((q_ptr if part == 0 else k_ptr) + dst_row + cols[None, :], n.to(q_ptr.dtype.element_ty),
                     mask=mask)
    if WRITE_V:
        cv = tl.arange(0, D)
        v = tl.load(src_ptr + src_row + 2 * H * D + hs[:, None] * D + cv[None, :], mask=mask, other=0.0)
        tl.store(v_ptr + dst_row + cv[None, :], v, mask=mask)


def _qk_outputs(bsz: int, heads: int, d: int, dtype, device, q, k, v) -> None:
    want = (bsz, heads, q.shape[2] if q.dim() == 4 else -1, d)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is None and name == "v":
            continue
        if t.dim() != 4 or tuple(t.shape) != want or t.stride(-1) != 1 or t.stride() != q.stride() \
                or t.dtype != dtype or t.device != device:
            raise ValueError(f"{name} must be a [B, heads, L_all, head_dim] = {want} {dtype} tensor on "
                             f"{device} with unit stride along head_dim and q's strides (contiguous, or the "
                             f"[B, L_all, heads, head_dim] layout transposed), got {tuple(t.shape)} {t.dtype} "
                             f"strides {t.stride() if t.dim() == 4 else '-'}")


def _qk_launch(src, ksrc, k_off: int, heads: int, d: int, wq, wk, eps_q, eps_k, pe, q, k, v, row_offset: int,
               split_half: bool, norm_row: bool) -> None:
    """Checks shared by :func:`qk_norm_rope` and :func:`qk_rmsnorm_rope_rows`, then one launch: a program per token
    and group of heads (per-head norms), or per token (``norm_row``)."""
    bsz, l = src.shape[0], src.shape[1]
    if d < 2 or d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two (>= 2) for the fused QK norm + RoPE")
    _qk_outputs(bsz, heads, d, src.dtype, src.device, q, k, v)
    if not 0 <= row_offset <= q.shape[2] - l:
        raise ValueError(f"rows {row_offset}..{row_offset + l} do not fit L_all = {q.shape[2]}")
    if pe is not None:
        if (pe.dim() != 6 or pe.dtype != torch.float32 or tuple(pe.shape[3:]) != (d // 2, 2, 2)
                or pe.shape[0] not in (1, bsz) or pe.shape[1] != 1 or pe.shape[2] < row_offset + l):
            raise ValueError(f"pe must be fp32 [B | 1, 1, L_all, {d // 2}, 2, 2], got {tuple(pe.shape)} {pe.dtype}")
        pe = pe if pe.stride(-1) == 1 and pe.stride(-2) == 2 and pe.stride(-3) == 4 else pe.contiguous()
    n_w = heads * d if norm_row else d
    wq = _row_major(_vector(wq, n_w, "q_weight", src.device, allow_scalar=False), "q_weight")
    wk = _row_major(_vector(wk, n_w, "k_weight", src.device, allow_scalar=False), "k_weight")
    if bsz == 0 or l == 0:
        return
    _check_usable(src, "qk_norm_rope")
    if norm_row:  # the norm spans every head: one program a token (Wan: 4 warps up to 4096 elements, as measured)
        block_h = triton.next_power_of_2(heads)
        warps = 4 if block_h * d <= 4096 else 8
    else:  # a power-of-2 group of heads that divides H (no masked heads: Ideogram 4's 18 -> 9 groups of 2)
        block_h = max(1, min(heads & -heads, QK_GROUP_ELEMS // d))
        warps = max(2, min(8, block_h * d // 256))  # H200, run y: 2 warps for 2 x 256, 4 for 8 x 128
    groups = -(-heads // block_h)
    launch(_qk_norm_rope_kernel, (bsz * l, groups),
           (src, ksrc, wq, wk, pe if pe is not None else wq, q, k, v if v is not None else q, l, heads,
            int(row_offset), int(k_off), float(eps_q), float(eps_k),
            src.stride(0), src.stride(1), 0 if pe is None or pe.shape[0] == 1 else pe.stride(0),
            0 if pe is None else pe.stride(2), q.stride(0), q.stride(1), q.stride(2)),
           dict(D=d, BLOCK_H=block_h, DT=_DT_CODE[src.dtype], HAS_PE=pe is not None, SPLIT_HALF=bool(split_half),
                NORM_ROW=bool(norm_row), WRITE_V=v is not None, PREFETCH=QK_PREFETCH, INTERPRET=INTERPRET),
           warps, 1, src.device)


def qk_norm_rope(qkv: torch.Tensor, heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps_q: float,
                 eps_k: float, pe: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                 row_offset: int = 0, split_half: bool = False) -> None:
    """Flux's QK RMSNorm, RoPE and attention layout in one pass: ``qkv`` [B, L, 3 * heads * D] (the qkv GEMM
    output; unit stride along the last dim, rows may be strided, e.g. the first part of the single block's
    linear1 output) -> rows ``row_offset .. row_offset + L`` of ``q``, ``k``, ``v`` [B, heads, L_all, D]
    (``qkv``'s dtype; contiguous or, better for SDPA, the [B, L_all, heads, D] layout transposed: then cuDNN's
    output is laid out so that ComfyUI's final ``transpose(1, 2).reshape`` copies nothing; k and v with q's
    strides): ``q = rope(rms_norm(q_h, q_weight, eps_q))`` per head, ``k`` likewise, ``v`` copied (``v`` None:
    not written, the caller uses its view of ``qkv``).
    ``pe``: [B | 1, 1, L_all, D / 2, 2, 2] fp32 rotations (``comfy.ldm.flux.math.rope``) or None (no RoPE).
    Each step rounds to the dtype as ComfyUI's ops do (F.rms_norm; apply_rope1 in fp32, rounded once).
    ``split_half`` (Ideogram 4): RoPE pairs are (x[i], x[i + D/2]) (``rms_rope_split_half``), not (x[2i], x[2i+1])."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 3 or qkv.dtype not in _FLOAT:
        raise ValueError(f"qkv must be a [B, L, 3 * heads * D] float tensor, got "
                         f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    width = qkv.shape[-1]
    if heads <= 0 or width % (3 * heads):
        raise ValueError(f"qkv's last dim {width} is not 3 * heads ({heads}) * head_dim")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    d = width // (3 * heads)
    _qk_launch(qkv, qkv, heads * d, heads, d, q_weight, k_weight, eps_q, eps_k, pe, q, k, v, row_offset,
               split_half, norm_row=False)


def qk_rmsnorm_rope_rows(xq: torch.Tensor, xk: torch.Tensor, heads: int, q_weight: torch.Tensor,
                         k_weight: torch.Tensor, eps_q: float, eps_k: float, pe: torch.Tensor | None,
                         q: torch.Tensor, k: torch.Tensor) -> None:
    """Wan's QK norm + RoPE in one pass: ``xq``, ``xk`` [B, L, heads * D] (the q and k GEMM outputs, same shape,
    dtype and strides, unit stride along the last dim) -> ``q``, ``k`` [B, heads, L, D] (layouts as in
    :func:`qk_norm_rope`): ``q = rope(rms_norm(xq, q_weight [heads * D], eps_q))`` with the norm over the whole
    row (``WanSelfAttention``'s ``norm_q`` / ``norm_k``), then the interleaved-pair RoPE of ``apply_rope1`` with
    ``pe`` [B | 1, 1, L, D / 2, 2, 2] fp32; roundings as in :func:`qk_norm_rope`."""
    for name, t in (("xq", xq), ("xk", xk)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype not in _FLOAT or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a [B, L, heads * D] float tensor with unit stride along the last dim, "
                             f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if xk.shape != xq.shape or xk.stride() != xq.stride() or xk.dtype != xq.dtype or xk.device != xq.device:
        raise ValueError(f"xk must match xq (shape, strides, dtype, device), got {tuple(xk.shape)} / "
                         f"{tuple(xq.shape)}")
    width = xq.shape[-1]
    if heads <= 0 or width % heads:
        raise ValueError(f"xq's last dim {width} is not heads ({heads}) * head_dim")
    _qk_launch(xq, xk, 0, heads, width // heads, q_weight, k_weight, eps_q, eps_k, pe, q, k, None, 0,
               split_half=False, norm_row=True)


# ----------------------------------------------------------------------------------- torch.compile ops
# The fused modules call the functions above directly in eager mode (no dispatcher overhead on ~400 calls a
# step) and these custom ops while torch.compile traces (``torch.compiler.is_compiling()``), so a compiled
# model sees each kernel as one opaque node with a shape-only fake implementation.
_OPS_READY = False


def register_ops() -> None:
    """Registers ``int8_fused::{gated_residual, rms_mod_quant, swiglu_quant, ln_mod_quant, cat_gelu_quant,
    act_quant, gemm_dequant}``
    (idempotent)."""
    global _OPS_READY
    if _OPS_READY:
        return
    from . import int8_gemm, quantize_per_token
    lib = torch.library

    def _aq(x, inv_smooth):
        return quantize_per_token(x, inv_smooth)

    def _rmq(x, w, eps, scale, tokens_per_batch, inv_smooth):
        return rmsnorm_modulate_quantize(x, w, eps, scale, tokens_per_batch, inv_smooth)

    def _swq(h13, inv_smooth, clamp_fp16):
        return swiglu_quantize(h13, inv_smooth, clamp_fp16)

    def _lnq(x, scale, shift, tokens_per_batch, inv_smooth, eps):
        return layernorm_modulate_quantize(x, scale, shift, tokens_per_batch, inv_smooth, eps)

    def _cgq(a, h, inv_smooth):
        return concat_gelu_quantize(a, h, inv_smooth) if a is not None else gelu_tanh_quantize(h, inv_smooth)

    def _gemm(a_q, a_scale, w_q, w_scale, bias, out_dtype):
        return int8_gemm(a_q, a_scale, w_q, w_scale, bias, out_dtype=out_dtype)

    def _gr(x, o, wn, eps, gate, tokens_per_batch, w2, eps2, s2, inv_smooth):
        y, q, qs = gated_residual_rmsnorm(x, o, wn, eps, gate, tokens_per_batch, w2, eps2, s2, inv_smooth)
        if q is None:
            q, qs = x.new_empty((0,), dtype=torch.int8), x.new_empty((0,), dtype=torch.float32)
        return y, q, qs

    def _gr_fake(x, o, wn, eps, gate, t, w2, eps2, s2, inv):
        dt = torch.promote_types(x.dtype, torch.promote_types(o.dtype, gate.dtype))
        n = x.shape[0] if w2 is not None else 0
        return (x.new_empty(x.shape, dtype=dt), x.new_empty((n, x.shape[1] if n else 0), dtype=torch.int8),
                x.new_empty((n,), dtype=torch.float32))

    ops = [
        ("gated_residual", "(Tensor x, Tensor o, Tensor wn, float eps, Tensor gate, int tokens_per_batch, "
                           "Tensor? w2, float eps2, Tensor? s2, Tensor? inv_smooth) -> (Tensor, Tensor, Tensor)",
         _gr, _gr_fake),
        ("rms_mod_quant", "(Tensor x, Tensor w, float eps, Tensor scale, int tokens_per_batch, Tensor? inv_smooth)"
                          " -> (Tensor, Tensor)", _rmq,
         lambda x, w, eps, s, t, inv: (x.new_empty(x.shape, dtype=torch.int8),
                                       x.new_empty(x.shape[:1], dtype=torch.float32))),
        ("swiglu_quant", "(Tensor h13, Tensor? inv_smooth, bool clamp_fp16) -> (Tensor, Tensor)", _swq,
         lambda h, inv, c: (h.new_empty((h.shape[0], h.shape[1] // 2), dtype=torch.int8),
                            h.new_empty(h.shape[:1], dtype=torch.float32))),
        ("ln_mod_quant", "(Tensor x, Tensor scale, Tensor shift, int tokens_per_batch, Tensor? inv_smooth, "
                         "float eps) -> (Tensor, Tensor)", _lnq,
         lambda x, s, sh, t, inv, eps: (x.new_empty(x.shape, dtype=torch.int8),
                                        x.new_empty(x.shape[:1], dtype=torch.float32))),
        ("cat_gelu_quant", "(Tensor? a, Tensor h, Tensor? inv_smooth) -> (Tensor, Tensor)", _cgq,
         lambda a, h, inv: (h.new_empty((h.shape[0], h.shape[1] + (a.shape[1] if a is not None else 0)),
                                        dtype=torch.int8), h.new_empty(h.shape[:1], dtype=torch.float32))),
        ("act_quant", "(Tensor x, Tensor? inv_smooth) -> (Tensor, Tensor)", _aq,
         lambda x, inv: (x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:1], dtype=torch.float32))),
        ("gemm_dequant", "(Tensor a_q, Tensor a_scale, Tensor w_q, Tensor w_scale, Tensor? bias, "
                         "ScalarType out_dtype) -> Tensor", _gemm,
         lambda a, sa, w, sw, b, dt: a.new_empty((a.shape[0], w.shape[0]), dtype=dt)),
    ]
    for name, schema, impl, fake in ops:
        op = lib.custom_op(f"int8_fused::{name}", mutates_args=(), schema=schema)(impl)
        op.register_fake(fake)
    _OPS_READY = True
