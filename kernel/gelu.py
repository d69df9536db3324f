"""tanh GELU + per-token quantization, optionally after a concatenation that is never built.

- ``gelu_tanh_quantize(h [M, F], inv_smooth)`` -> (int8 [M, F], fp32 [M]): ``dt(gelu(h, approximate="tanh"))``
  feeding Flux.1's mlp.2 / Wan's ffn.2.
- ``concat_gelu_quantize(a [M, K], h [M, F], inv_smooth [K + F])`` -> (int8 [M, K + F], fp32 [M]):
  ``cat(a, gelu(h))`` quantized with one absmax per row over both parts (Flux.1's single block feeding linear2).

``GELU_FAST`` (default) computes ``dt(h / (1 + exp(-2 b (h + k h^3))))``, the same function as torch's
``0.5 h (1 + tanh(b (h + k h^3)))`` with other fp32 roundings (``kernel.rowtile.gelu_tanh``);
``quant.blocks.gelu_tanh_quantize_ref`` / ``concat_gelu_quantize_ref`` are the definition in torch
(tests/test_flux_fused.py bounds the code flips).
Importing this module imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch  # the compiled kernel re-launched directly (kernel/launch.py)
from .quantize import INTERPRET, SegmentPlan, amax_bad, finish_tile, quant_params, seg_warps, segments, store_q
from .checks import check_2d, check_usable, smooth_vector
from .rowtile import (DT_CODE, FLOAT, TilePlan, gelu_tanh, round_to, row_major, row_ptrs, row_tiles, seg_keep,
                      seg_store, smooth)

# Module data, read at each call (the tests set them).
# GELU_FAST: tanh GELU as h * sigmoid(2u) with the hardware exp2 instead of libdevice tanhf (much faster on the H200;
# on Flux's data its codes equalled torch's unfused path's, on Wan's they differed by 1 in about 1e-7).
# GELU_ONE_PASS: each part over up to three (a: two) power-of-2 segments, gelu(h) computed once and kept in registers
# in the model dtype, for parts up to 16384 wide; None: GELU_PLAN's tiles, which compute gelu twice (its exp and
# IEEE division bound them). Both forms give the same codes.
GELU_PLAN = TilePlan(max_single=2048, chunk=1024, chunk_warps=4)
GELU_FAST = True
GELU_ONE_PASS: SegmentPlan | None = SegmentPlan(max_row=16384, min_seg=256, warps=8)


@triton.jit
def _part_vals(p_row, ks, mask, GELU: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr,
               FAST: tl.constexpr):
    """One tile of a part of the concatenated row, fp32, before the smoothing: the values as they are (GELU
    False) or gelu(h) rounded to DT (gelu(0) = 0: masked lanes stay 0)."""
    y = tl.load(p_row + ks, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        y = round_to(gelu_tanh(y, INTERPRET, FAST), DT, INTERPRET)
    return y


@triton.jit
def _part_tile(p_row, inv_ptr, ks, mask, GELU: tl.constexpr, HAS_SMOOTH: tl.constexpr, DT: tl.constexpr,
               INTERPRET: tl.constexpr, FAST: tl.constexpr):
    # one segment of the concatenated row, smoothed
    return smooth(_part_vals(p_row, ks, mask, GELU, DT, INTERPRET, FAST), inv_ptr, ks, mask, HAS_SMOOTH)


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
        store_q(q_row + ks, y, mult, usable, mask, INTERPRET)


@triton.jit
def _gelu_seg(p_row, inv_ptr, n, OFF: tl.constexpr, SEG: tl.constexpr, amax, bad, GELU: tl.constexpr,
              HAS_SMOOTH: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr, FAST: tl.constexpr):
    """One segment of a part of the one-pass (concat +) GELU row: gelu(h) rounded to DT (GELU) or the values as
    they are, in the part's dtype (exact: they are values of it), with the row's running |max| and non-finite
    flag updated; the same values as ``_part_tile``."""
    ks = OFF + tl.arange(0, SEG)
    mask = ks < n
    return seg_keep(_part_vals(p_row, ks, mask, GELU, DT, INTERPRET, FAST), p_row, inv_ptr, ks, mask, amax, bad,
                     HAS_SMOOTH)


@triton.jit
def _concat_gelu_quant_kernel(a_ptr, h_ptr, inv_ptr, q_ptr, qs_ptr,
                              KA, F, stride_am, stride_hm, stride_qm,
                              HAS_A: tl.constexpr, HAS_SMOOTH: tl.constexpr, DT: tl.constexpr,
                              SCALE_RECIP: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
                              A0: tl.constexpr, A1: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
                              S2: tl.constexpr, INTERPRET: tl.constexpr, FAST: tl.constexpr):
    # q = quantize(cat(a, dt(gelu(h)))) per row, one absmax over both parts; HAS_A False: gelu(h) alone.
    # S0 > 0: one pass, a over segments A0 (+ A1), h over S0 (+ S1 + S2) (Flux's single block: 2048 + 1024 and
    # 8192 + 4096; Wan 1.3B's F = 8960: 8192 + 512 + 256, no masked lanes). Else each part in one BLOCK-wide tile
    # held in registers (SINGLE) or in BLOCK-wide chunks, read twice.
    if S0 > 0:
        row = tl.program_id(0)
        a_row, h_row, q_row = row_ptrs(a_ptr, h_ptr, q_ptr, stride_am, stride_hm, stride_qm)
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
        scale, mult, usable = quant_params(amax, bad > 0, SCALE_RECIP)
        tl.store(qs_ptr + row, scale)
        if HAS_A:
            seg_store(q_row, a0, inv_ptr, KA, 0, A0, mult, usable, HAS_SMOOTH, INTERPRET)
            if A1 > 0:
                seg_store(q_row, a1, inv_ptr, KA, A0, A1, mult, usable, HAS_SMOOTH, INTERPRET)
        qh = q_row + KA
        seg_store(qh, y0, ih, F, 0, S0, mult, usable, HAS_SMOOTH, INTERPRET)
        if S1 > 0:
            seg_store(qh, y1, ih, F, S0, S1, mult, usable, HAS_SMOOTH, INTERPRET)
        if S2 > 0:
            seg_store(qh, y2, ih, F, S0 + S1, S2, mult, usable, HAS_SMOOTH, INTERPRET)
    else:
        row = tl.program_id(0)
        a_row, h_row, q_row = row_ptrs(a_ptr, h_ptr, q_ptr, stride_am, stride_hm, stride_qm)
        cols = tl.arange(0, BLOCK)
        if SINGLE:
            amax = tl.zeros([], dtype=tl.float32)
            bad = tl.zeros([], dtype=tl.int32)
            if HAS_A:
                ma = cols < KA
                ya = _part_tile(a_row, inv_ptr, cols, ma, False, HAS_SMOOTH, DT, INTERPRET, FAST)
                amax, bad = amax_bad(ya, amax, bad)
            mh = cols < F
            yh = _part_tile(h_row, inv_ptr + KA, cols, mh, True, HAS_SMOOTH, DT, INTERPRET, FAST)
            mult, usable = finish_tile(q_row + KA + cols, qs_ptr, row, yh, mh, amax, bad, SCALE_RECIP, INTERPRET)
            if HAS_A:
                store_q(q_row + cols, ya, mult, usable, ma, INTERPRET)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            bad = tl.zeros([BLOCK], dtype=tl.int32)
            if HAS_A:
                amax, bad = _part_amax(a_row, inv_ptr, KA, cols, amax, bad, False, HAS_SMOOTH, DT, BLOCK, INTERPRET,
                                       FAST)
            amax, bad = _part_amax(h_row, inv_ptr + KA, F, cols, amax, bad, True, HAS_SMOOTH, DT, BLOCK, INTERPRET,
                                   FAST)
            scale, mult, usable = quant_params(tl.max(amax, axis=0), tl.max(bad, axis=0) > 0, SCALE_RECIP)
            tl.store(qs_ptr + row, scale)
            if HAS_A:
                _part_store(a_row, inv_ptr, q_row, KA, cols, mult, usable, False, HAS_SMOOTH, DT, BLOCK, INTERPRET,
                            FAST)
            _part_store(h_row, inv_ptr + KA, q_row + KA, F, cols, mult, usable, True, HAS_SMOOTH, DT, BLOCK,
                        INTERPRET, FAST)


def concat_operands(a: torch.Tensor | None, h: torch.Tensor) -> int:
    """Checks the parts of ``cat(a, gelu(h))`` (a may be None) and returns a's width (0 without a)."""
    check_2d(h, "h (the GELU input)", FLOAT, "pass the pre-activation as [tokens, F]")
    if a is None:
        return 0
    check_2d(a, "a (the part before the GELU part)", FLOAT, "pass it as [tokens, K]")
    if a.shape[0] != h.shape[0] or a.dtype != h.dtype or a.device != h.device:
        raise ValueError(f"a {tuple(a.shape)} {a.dtype} on {a.device} must match h {tuple(h.shape)} {h.dtype} "
                         f"on {h.device} in rows, dtype and device (torch.cat would promote)")
    return a.shape[1]


def _concat_gelu(a: torch.Tensor | None, h: torch.Tensor, inv_smooth, what: str):
    ka = concat_operands(a, h)
    m, f = h.shape
    inv = smooth_vector(inv_smooth, ka + f, h.device)
    q = torch.empty((m, ka + f), dtype=torch.int8, device=h.device)
    qs = torch.empty((m,), dtype=torch.float32, device=h.device)
    if m == 0 or ka + f == 0:
        return q, qs.zero_()
    check_usable(h, what)
    h = row_major(h, "h")
    a = row_major(a, "a") if a is not None else None
    args = (a if a is not None else h, h, inv if inv is not None else qs, q, qs, ka, f,
            a.stride(0) if a is not None else 0, h.stride(0), q.stride(0))
    common = dict(HAS_A=a is not None, HAS_SMOOTH=inv is not None, DT=DT_CODE[h.dtype], SCALE_RECIP=h.is_cuda)
    segs = segments(f, GELU_ONE_PASS)
    asegs = segments(ka, GELU_ONE_PASS) if ka else (0, 0, 0)
    if segs is not None and asegs is not None and asegs[2] == 0:  # one pass: a in at most two segments
        tiles = dict(BLOCK=0, SINGLE=False, A0=asegs[0], A1=asegs[1], S0=segs[0], S1=segs[1], S2=segs[2])
        warps = seg_warps(tuple(asegs) + tuple(segs), GELU_ONE_PASS)
    else:
        tiles, warps = row_tiles(max(ka, f), None, GELU_PLAN)
        tiles.update(A0=0, A1=0)
    launch(_concat_gelu_quant_kernel, (m,), args, dict(common, **tiles, INTERPRET=INTERPRET, FAST=GELU_FAST), warps, 1,
           h.device)
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
