"""QK RMSNorm + RoPE written straight into the attention layout, in one pass (no quantization).

- ``qk_norm_rope(qkv [B, L, 3 H D], heads, q_weight, k_weight, eps_q, eps_k, pe, q, k, v, row_offset,
  split_half)``: per-head norms (Flux.1, Ideogram 4, Lumina 2) into rows of the concatenated [B, H, L_all, D] q, k, v.
- ``qk_rmsnorm_rope_rows(xq, xk, heads, ...)``: the same for Wan, whose norm spans the whole row.

Roundings as ComfyUI's ops: ``n = dt(x * rstd * w)`` (F.rms_norm), then ``dt(f0 * n0 + f1 * n1)`` (``apply_rope1``).
Importing this module imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch  # the compiled kernel re-launched directly (kernel/launch.py)
from .quantize import INTERPRET
from .checks import check_usable, vector
from .rowtile import DT_CODE, FLOAT, round_to, row_major, rsqrt_mean

# Module data, read at each call (the tests set them).
# Per-head norms: heads per program, a power of 2 dividing H with at most this many elements.
QK_GROUP_ELEMS = 1024
# The token's rotations loaded as 16-byte vectors, and (split-half pairs, Ideogram 4) q's and k's halves all loaded
# before either is normalised; False: scalar loads, q then k. Same outputs; the vector loads were faster on the H200.
QK_PREFETCH = True


@triton.jit
def _half_rope_store(x0, x1, wp, eps, f00, f01, f10, f11, out, mask, half, D: tl.constexpr, DT: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """Heads' halves x0 = x[:, :D/2], x1 = x[:, D/2:] (fp32): rms_norm with weight ``wp``, split-half RoPE, stored
    at ``out`` (the first half's pointers) and ``out + D/2``; roundings as the per-part loop of the kernel."""
    w0 = tl.load(wp + half).to(tl.float32)[None, :]
    w1 = tl.load(wp + D // 2 + half).to(tl.float32)[None, :]
    rstd = rsqrt_mean(tl.sum(x0 * x0, axis=1) + tl.sum(x1 * x1, axis=1), D, eps, INTERPRET)[:, None]
    n0 = round_to(x0 * rstd * w0, DT, INTERPRET)
    n1 = round_to(x1 * rstd * w1, DT, INTERPRET)
    tl.store(out, round_to(f00 * n0 + f01 * n1, DT, INTERPRET).to(out.dtype.element_ty), mask=mask)
    tl.store(out + D // 2, round_to(f10 * n0 + f11 * n1, DT, INTERPRET).to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["L", "row_offset"])
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
                rstd = rsqrt_mean(tl.sum(tl.sum(x * x, axis=1), axis=0), H * D, eps_q if part == 0 else eps_k,
                                  INTERPRET)
                n = round_to(x * rstd * w, DT, INTERPRET)
            else:
                w = tl.load((wq_ptr if part == 0 else wk_ptr) + cols).to(tl.float32)
                rstd = rsqrt_mean(tl.sum(x * x, axis=1), D, eps_q if part == 0 else eps_k, INTERPRET)
                n = round_to(x * rstd[:, None] * w[None, :], DT, INTERPRET)
            if HAS_PE:
                if SPLIT_HALF:  # [h, r * D/2 + i] -> [h, i, r]
                    x0, x1 = tl.split(tl.permute(tl.reshape(n, (BLOCK_H, 2, D // 2)), (0, 2, 1)))
                else:
                    x0, x1 = tl.split(tl.reshape(n, (BLOCK_H, D // 2, 2)))
                o0 = round_to(f00 * x0 + f01 * x1, DT, INTERPRET)
                o1 = round_to(f10 * x0 + f11 * x1, DT, INTERPRET)
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
    wq = row_major(vector(wq, n_w, "q_weight", src.device, allow_scalar=False), "q_weight")
    wk = row_major(vector(wk, n_w, "k_weight", src.device, allow_scalar=False), "k_weight")
    if bsz == 0 or l == 0:
        return
    check_usable(src, "qk_norm_rope")
    if norm_row:  # the norm spans every head: one program a token (Wan: 4 warps up to 4096 elements)
        block_h = triton.next_power_of_2(heads)
        warps = 4 if block_h * d <= 4096 else 8
    else:  # a power-of-2 group of heads that divides H (no masked heads: Ideogram 4's 18 -> 9 groups of 2)
        block_h = max(1, min(heads & -heads, QK_GROUP_ELEMS // d))
        warps = max(2, min(8, block_h * d // 256))  # 2 warps for 2 x 256, 4 for 8 x 128
    groups = -(-heads // block_h)
    launch(_qk_norm_rope_kernel, (bsz * l, groups),
           (src, ksrc, wq, wk, pe if pe is not None else wq, q, k, v if v is not None else q, l, heads,
            int(row_offset), int(k_off), float(eps_q), float(eps_k),
            src.stride(0), src.stride(1), 0 if pe is None or pe.shape[0] == 1 else pe.stride(0),
            0 if pe is None else pe.stride(2), q.stride(0), q.stride(1), q.stride(2)),
           dict(D=d, BLOCK_H=block_h, DT=DT_CODE[src.dtype], HAS_PE=pe is not None, SPLIT_HALF=bool(split_half),
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
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 3 or qkv.dtype not in FLOAT:
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
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype not in FLOAT or t.stride(-1) != 1:
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
