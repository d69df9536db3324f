"""The blocks' residual tails: the residual add and the norm after it in one read of the row, optionally with the
next GEMM's int8 input from the same registers. Rows up to ``rowtile.MAX_SINGLE`` (``fits``).

- ``gated_residual_rmsnorm(x, o, norm_weight, eps, gate, tokens_per_batch[, next_norm_weight, next_eps, next_scale,
  inv_smooth])`` -> (y, int8 | None, fp32 | None): ``y = x + gate * rms_norm(o)`` (Ideogram 4, Lumina 2),
  optionally with ``rmsnorm_modulate_quantize(y, ...)`` of the next norm.
- ``residual_add(x, y, gate)`` (``torch.addcmul``, or ``x + y * gate`` as two ops), ``residual_add_layernorm`` (with
  the affine LayerNorm after it) and ``residual_add_layernorm_modulate_quantize`` (with the modulated, quantized
  LayerNorm feeding the next GEMM): Wan's and Flux.1's tails.

Each rounds as torch's ops do. ``gated_residual_rmsnorm`` is built without FMA contraction
(``enable_fp_fusion=False``): torch rounds ``gate * norm(o)`` to the dtype before the add. Importing this module
imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch  # the compiled kernel re-launched directly (kernel/launch.py)
from .norm import lnmod_tile, ln_seg_quant, ln_seg_stats, modulation_operands, rmsmod_seg, rmsmod_tile, seg_rows_sq
from .checks import check_2d, check_usable, smooth_vector, vector
from .quantize import INTERPRET, SegmentPlan, finish_segments, finish_tile
from .rowtile import DT_CODE, FLOAT, MAX_SINGLE, batch_rows, fits, round_to, row_major, row_tiles, rsqrt_mean

# Module data, read at each call (the tests set them).
# gated_residual_rmsnorm over segments (K = 4608: 4096 + 512, where one tile masks 3584 of 8192 lanes) for rows up
# to MAX_SINGLE, 4 warps; None: one tile.
RESIDUAL_ONE_PASS: SegmentPlan | None = SegmentPlan(max_row=8192, min_seg=256, warps=4)
# residual_add* over segments for rows of 4097 to 8192 (whose one tile would be 8192 wide, 37-50 % masked); shorter
# rows, or None: one masked tile (in the models, segments did not pay below 4096).
RESIDUAL_LN_ONE_PASS: SegmentPlan | None = SegmentPlan(max_row=8192, min_seg=256, warps=4, min_row=4097)


@triton.jit
def _gr_seg_y(o, x_row, wn_ptr, g_row, y_row, K, rstd, OFF: tl.constexpr, SEG: tl.constexpr,
              NORM_DT: tl.constexpr, GATE_DT: tl.constexpr, OUT_DT: tl.constexpr, INTERPRET: tl.constexpr):
    ks = OFF + tl.arange(0, SEG)
    mask = ks < K
    wn = tl.load(wn_ptr + ks, mask=mask, other=0.0).to(tl.float32)
    n = round_to(o * rstd * wn, NORM_DT, INTERPRET)
    t = round_to(tl.load(g_row + ks, mask=mask, other=0.0).to(tl.float32) * n, GATE_DT, INTERPRET)
    y = round_to(tl.load(x_row + ks, mask=mask, other=0.0).to(tl.float32) + t, OUT_DT, INTERPRET)
    tl.store(y_row + ks, y.to(y_row.dtype.element_ty), mask=mask)
    return y, tl.sum(y * y, axis=0)


@triton.jit(do_not_specialize=["tokens_per_batch"])
def _gated_residual_kernel(x_ptr, o_ptr, wn_ptr, g_ptr, y_ptr, w2_ptr, s2_ptr, inv_ptr, q_ptr, qs_ptr,
                           K, tokens_per_batch, eps, eps2,
                           stride_xm, stride_om, stride_gb, stride_ym, stride_sb, stride_qm,
                           NORM_DT: tl.constexpr, GATE_DT: tl.constexpr, OUT_DT: tl.constexpr,
                           HAS_NEXT: tl.constexpr, HAS_SMOOTH: tl.constexpr, NEXT_PROD_DT: tl.constexpr,
                           SCALE_RECIP: tl.constexpr, BLOCK: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
                           S2: tl.constexpr, INTERPRET: tl.constexpr):
    # y = x + gate * rms_norm(o) * wn, then (HAS_NEXT) the int8 input of the next GEMM from
    # rms_norm(y) * w2 * scale2: the block's residual tail and the next norm in one read of x and o, the row in
    # registers. S0 > 0: over up to three power-of-2 segments (K = 4608: 4096 + 512), the sums of squares added per
    # segment; else one BLOCK-wide tile.
    if S0 > 0:
        row = tl.program_id(0)
        r64 = row.to(tl.int64)
        bidx = (row // tokens_per_batch).to(tl.int64)
        o_row, x_row, y_row = o_ptr + r64 * stride_om, x_ptr + r64 * stride_xm, y_ptr + r64 * stride_ym
        g_row = g_ptr + bidx * stride_gb
        o0, o1, o2, ssq = seg_rows_sq(o_row, K, S0, S1, S2)
        rstd = rsqrt_mean(ssq, K, eps, INTERPRET)
        y0, ysq = _gr_seg_y(o0, x_row, wn_ptr, g_row, y_row, K, rstd, 0, S0, NORM_DT, GATE_DT, OUT_DT, INTERPRET)
        if S1 > 0:
            y1, ysq1 = _gr_seg_y(o1, x_row, wn_ptr, g_row, y_row, K, rstd, S0, S1, NORM_DT, GATE_DT, OUT_DT, INTERPRET)
            ysq += ysq1
        if S2 > 0:
            y2, ysq2 = _gr_seg_y(o2, x_row, wn_ptr, g_row, y_row, K, rstd, S0 + S1, S2, NORM_DT, GATE_DT, OUT_DT,
                                 INTERPRET)
            ysq += ysq2
        if HAS_NEXT:
            rstd2 = rsqrt_mean(ysq, K, eps2, INTERPRET)
            s2_row = s2_ptr + bidx * stride_sb
            q_row = q_ptr + r64 * stride_qm
            amax = tl.zeros([], dtype=tl.float32)
            bad = tl.zeros([], dtype=tl.int32)
            z0, amax, bad = rmsmod_seg(y0, w2_ptr, s2_row, inv_ptr, K, rstd2, amax, bad, 0, S0, HAS_SMOOTH, OUT_DT,
                                      NEXT_PROD_DT, INTERPRET)
            z1, z2 = z0, z0  # placeholders for unused segments
            if S1 > 0:
                z1, amax, bad = rmsmod_seg(y1, w2_ptr, s2_row, inv_ptr, K, rstd2, amax, bad, S0, S1, HAS_SMOOTH, OUT_DT,
                                          NEXT_PROD_DT, INTERPRET)
            if S2 > 0:
                z2, amax, bad = rmsmod_seg(y2, w2_ptr, s2_row, inv_ptr, K, rstd2, amax, bad, S0 + S1, S2, HAS_SMOOTH,
                                          OUT_DT, NEXT_PROD_DT, INTERPRET)
            finish_segments(q_row, qs_ptr, row, z0, z1, z2, K, S0, S1, S2, amax, bad, SCALE_RECIP, INTERPRET)
    else:
        row = tl.program_id(0)
        bidx = (row // tokens_per_batch).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < K
        o = tl.load(o_ptr + row.to(tl.int64) * stride_om + cols, mask=mask, other=0.0).to(tl.float32)
        wn = tl.load(wn_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        n = round_to(o * rsqrt_mean(tl.sum(o * o, axis=0), K, eps, INTERPRET) * wn, NORM_DT, INTERPRET)
        g = tl.load(g_ptr + bidx * stride_gb + cols, mask=mask, other=0.0).to(tl.float32)
        t = round_to(g * n, GATE_DT, INTERPRET)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        y = round_to(x + t, OUT_DT, INTERPRET)
        tl.store(y_ptr + row.to(tl.int64) * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        if HAS_NEXT:
            rstd2 = rsqrt_mean(tl.sum(y * y, axis=0), K, eps2, INTERPRET)
            z = rmsmod_tile(y, w2_ptr, s2_ptr + bidx * stride_sb, inv_ptr, cols, mask, rstd2,
                             HAS_SMOOTH, OUT_DT, NEXT_PROD_DT, INTERPRET)
            finish_tile(q_ptr + row.to(tl.int64) * stride_qm + cols, qs_ptr, row, z, mask, 0.0, 0, SCALE_RECIP,
                        INTERPRET)


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
            r = round_to(x + round_to(y * gv, DT, INTERPRET), DT, INTERPRET)
        else:
            r = round_to(x + y * gv, DT, INTERPRET)
    else:
        r = round_to(x + y, DT, INTERPRET)
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
    tl.store(n_row + ks, round_to(n, DT, INTERPRET).to(n_row.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["tokens_per_batch"])
def _residual_layernorm_kernel(x_ptr, y_ptr, g_ptr, r_ptr, w_ptr, b_ptr, s_ptr, sh_ptr, inv_ptr, n_ptr, q_ptr,
                               qs_ptr, K, tokens_per_batch, eps,
                               stride_xm, stride_ym, stride_gb, stride_rm, stride_sb, stride_shb, stride_nm,
                               HAS_GATE: tl.constexpr, ROUND_PRODUCT: tl.constexpr, MODE: tl.constexpr,
                               HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_SMOOTH: tl.constexpr, DT: tl.constexpr,
                               SCALE_DT: tl.constexpr, PROD_DT: tl.constexpr, SCALE_RECIP: tl.constexpr,
                               BLOCK: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                               INTERPRET: tl.constexpr):
    # One row in registers. r = dt(x + y * g[row // tokens_per_batch]) (torch.addcmul: fp32 inside, one rounding),
    # dt(x + dt(y * g)) with ROUND_PRODUCT (``x += y * g``: two torch ops, two roundings), or dt(x + y) -> r_ptr
    # (which may be x_ptr: the row, or each segment, is read before it is written).
    # MODE 1: n = dt(layer_norm(r) * w + b) (F.layer_norm with its affine, one rounding) -> n_ptr.
    # MODE 2: the int8 input of the next GEMM, addcmul(shift, dt(layer_norm(r)), 1 + scale) quantized per row
    # (as _layernorm_modulate_quant_kernel). Mean and variance: two passes over the registers, fp32.
    # S0 > 0: over up to three power-of-2 segments (Wan 14B's 5120: 4096 + 1024), the sums added per segment; else
    # one masked BLOCK-wide tile.
    if S0 > 0:
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
            mean, rstd = ln_seg_stats(r0, r1, r2, tot, K, eps, S0, S1, S2, INTERPRET)
            n_row = n_ptr + r64 * stride_nm
            if MODE == 1:
                _res_seg_n(r0, w_ptr, b_ptr, n_row, K, mean, rstd, 0, S0, HAS_W, HAS_B, DT, INTERPRET)
                if S1 > 0:
                    _res_seg_n(r1, w_ptr, b_ptr, n_row, K, mean, rstd, S0, S1, HAS_W, HAS_B, DT, INTERPRET)
                if S2 > 0:
                    _res_seg_n(r2, w_ptr, b_ptr, n_row, K, mean, rstd, S0 + S1, S2, HAS_W, HAS_B, DT, INTERPRET)
            else:
                ln_seg_quant(r0, r1, r2, s_ptr + bidx * stride_sb, sh_ptr + bidx * stride_shb, inv_ptr, n_row, qs_ptr,
                              row, K, mean, rstd, S0, S1, S2, HAS_SMOOTH, DT, SCALE_DT, PROD_DT, SCALE_RECIP, INTERPRET)
    else:
        row = tl.program_id(0)
        bidx = (row // tokens_per_batch).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < K
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row.to(tl.int64) * stride_ym + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            gv = tl.load(g_ptr + bidx * stride_gb + cols, mask=mask, other=0.0).to(tl.float32)
            if ROUND_PRODUCT:
                r = round_to(x + round_to(y * gv, DT, INTERPRET), DT, INTERPRET)
            else:
                r = round_to(x + y * gv, DT, INTERPRET)
        else:
            r = round_to(x + y, DT, INTERPRET)
        tl.store(r_ptr + row.to(tl.int64) * stride_rm + cols, r.to(r_ptr.dtype.element_ty), mask=mask)
        if MODE > 0:
            mean = tl.math.div_rn(tl.sum(r, axis=0), K * 1.0)  # masked lanes hold 0
            d = tl.where(mask, r - mean, 0.0)
            rstd = rsqrt_mean(tl.sum(d * d, axis=0), K, eps, INTERPRET)
            if MODE == 1:
                n = (r - mean) * rstd
                if HAS_W:
                    n = n * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_B:
                    n = n + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(n_ptr + row.to(tl.int64) * stride_nm + cols,
                         round_to(n, DT, INTERPRET).to(n_ptr.dtype.element_ty), mask=mask)
            else:
                yq = lnmod_tile(r, s_ptr + bidx * stride_sb, sh_ptr + bidx * stride_shb, inv_ptr, cols, mask, mean,
                                 rstd, HAS_SMOOTH, DT, SCALE_DT, PROD_DT, INTERPRET)
                finish_tile(q_ptr + row.to(tl.int64) * stride_nm + cols, qs_ptr, row, yq, mask, 0.0, 0, SCALE_RECIP,
                            INTERPRET)


def gated_residual_rmsnorm(x: torch.Tensor, o: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           gate: torch.Tensor, tokens_per_batch: int, next_norm_weight: torch.Tensor | None = None,
                           next_eps: float = 1e-6, next_scale: torch.Tensor | None = None,
                           inv_smooth: torch.Tensor | None = None):
    """``y = x + gate[row // tokens_per_batch] * rms_norm(o, norm_weight, eps)`` ([M, K] each, gate [B | 1, K]),
    rounded as torch's three ops (to o's dtype, the gate product's, then y's). With ``next_norm_weight``
    and ``next_scale`` also the int8 input of the next GEMM, ``rmsnorm_modulate_quantize(y, ...)`` from the
    same registers. Returns (y, int8 [M, K] | None, fp32 [M] | None). Rows up to MAX_SINGLE only (the
    Ideogram 4 / Lumina widths); ``fits(K)`` says whether a row fits."""
    check_2d(x, "x", FLOAT, "pass the residual stream as [tokens, K]")
    check_2d(o, "o", FLOAT, "pass the branch output as [tokens, K]")
    m, k = x.shape
    if o.shape != x.shape or o.device != x.device:
        raise ValueError(f"o {tuple(o.shape)} on {o.device} must match x {tuple(x.shape)} on {x.device}")
    if not fits(k):
        raise ValueError(f"gated_residual_rmsnorm keeps a row in registers: K={k} > {MAX_SINGLE}")
    wn = vector(norm_weight, k, "norm_weight", x.device, allow_scalar=False)
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
    check_usable(x, "gated_residual_rmsnorm")
    x, o, wn, g2 = row_major(x, "x"), row_major(o, "o"), row_major(wn, "norm_weight"), row_major(g2, "gate")
    if nxt:
        w2 = row_major(vector(next_norm_weight, k, "next_norm_weight", x.device, allow_scalar=False), "w")
        s2 = row_major(next_scale.reshape(-1, k), "next_scale")
        if s2.shape[0] != 1 and s2.shape[0] * tokens_per_batch != m:
            raise ValueError(f"next_scale has {s2.shape[0]} batch rows for {m} tokens ({tokens_per_batch} a batch)")
        inv = smooth_vector(inv_smooth, k, x.device)
    else:
        w2, s2, inv = wn, g2, None
    dummy = y
    consts = dict(NORM_DT=DT_CODE[o.dtype], GATE_DT=DT_CODE[gate_dt], OUT_DT=DT_CODE[out_dt], HAS_NEXT=nxt,
                  HAS_SMOOTH=inv is not None,
                  NEXT_PROD_DT=DT_CODE[torch.promote_types(out_dt, s2.dtype)] if nxt else 0,
                  SCALE_RECIP=x.is_cuda)
    tiles, warps = row_tiles(k, RESIDUAL_ONE_PASS)
    launch(_gated_residual_kernel, (m,),
           (x, o, wn, g2, y, w2, s2, inv if inv is not None else dummy, q if nxt else dummy,
            qs if nxt else dummy, k, max(int(tokens_per_batch), 1), float(eps), float(next_eps),
            x.stride(0), o.stride(0), 0 if nb == 1 else g2.stride(0), y.stride(0),
            0 if s2.shape[0] == 1 else s2.stride(0), q.stride(0) if nxt else 0),
           dict(consts, **tiles, INTERPRET=INTERPRET,
                # no FMA contraction: torch rounds gate * norm(o) to the gate dtype before the add, so the
                # compiler must not fuse that multiply into x + t (with it, y differs from torch's in many
                # elements; without, in about one in a million)
                enable_fp_fusion=False), warps, 1, x.device)
    return y, q, qs


def _residual(x, y, gate, tokens_per_batch: int, mode: int, eps: float = 1e-6, weight=None, bias=None, scale=None,
              shift=None, inv_smooth=None, what: str = "residual_add", round_product: bool = False, out=None):
    """Checks and one launch of ``_residual_layernorm_kernel`` (see the public functions below); ``out``: where the
    sum goes (x itself for ``x += ...``; default a new tensor)."""
    check_2d(x, "x", FLOAT, "pass the residual stream as [tokens, K]")
    check_2d(y, "y", FLOAT, "pass the branch output as [tokens, K]")
    m, k = x.shape
    if y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
        raise ValueError(f"{what}: y {tuple(y.shape)} {y.dtype} on {y.device} must match x {tuple(x.shape)} "
                         f"{x.dtype} on {x.device} (torch would promote a mixed dtype)")
    if not fits(k):
        raise ValueError(f"{what} keeps a row in registers: K={k} > {MAX_SINGLE}")
    tpb = max(int(tokens_per_batch), 1)
    g2 = None
    if gate is not None:
        g2 = batch_rows(gate, k, m, tpb, "gate", x.device)
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
        w = None if weight is None else row_major(vector(weight, k, "weight", x.device, False), "weight")
        b = None if bias is None else row_major(vector(bias, k, "bias", x.device, False), "bias")
    elif mode == 2:
        s2, sh2, inv, q, qs = modulation_operands(scale, shift, inv_smooth, m, k, tpb, x.device)
    if m == 0 or k == 0:
        return r, n, q, (qs.zero_() if qs is not None else None)
    check_usable(x, what)
    x, y = row_major(x, "x"), row_major(y, "y")
    dummy = r
    prod = torch.promote_types(torch.promote_types(x.dtype, s2.dtype), sh2.dtype) if mode == 2 else x.dtype
    tiles, warps = row_tiles(k, RESIDUAL_LN_ONE_PASS)
    out2 = n if mode == 1 else q if mode == 2 else dummy
    launch(_residual_layernorm_kernel, (m,),
           (x, y, g2 if g2 is not None else dummy, r, w if w is not None else dummy, b if b is not None else dummy,
            s2 if s2 is not None else dummy, sh2 if sh2 is not None else dummy, inv if inv is not None else dummy,
            out2, out2, qs if qs is not None else dummy, k, tpb, float(eps),
            x.stride(0), y.stride(0), 0 if g2 is None or g2.shape[0] == 1 else g2.stride(0), r.stride(0),
            0 if s2 is None or s2.shape[0] == 1 else s2.stride(0),
            0 if sh2 is None or sh2.shape[0] == 1 else sh2.stride(0), out2.stride(0)),
           dict(HAS_GATE=g2 is not None, ROUND_PRODUCT=bool(round_product), MODE=mode, HAS_W=w is not None,
                HAS_B=b is not None,
                HAS_SMOOTH=inv is not None, DT=DT_CODE[x.dtype],
                SCALE_DT=DT_CODE[s2.dtype] if s2 is not None else 0, PROD_DT=DT_CODE[prod],
                SCALE_RECIP=x.is_cuda, INTERPRET=INTERPRET, **tiles), warps, 1, x.device)
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
