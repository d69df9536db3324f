"""Fused W8A8 GEMM: int8 x int8 -> int32 on tensor cores, per-token x per-channel dequant and bias in the epilogue.

``out[m, n] = acc[m, n] * a_scale[m] * w_scale[n] + bias[n]`` in fp32, stored as bf16 / fp16 / fp32, where
``acc = A_q @ W_q.T`` is the exact int32 accumulator (``OUT_INT32`` stores ``acc`` itself).

Layouts: A int8 [M, K] and W int8 [N, K] (nn.Linear layout, K-major: the layout Hopper's 8-bit wgmma reads;
an [K, N] weight runs ~4x slower, so W is never transposed). Any strides are taken as given (no copies); the
fast path is unit K-stride, which Triton specialises on. Any M, N, K: M/N tails wrap on load (``% M``) and are
masked on store, K tails are masked (``EVEN_K`` drops that mask when BLOCK_K divides K).

``_int8_gemm_persistent_kernel`` (sm_90, the s8 tile of ``kernel.s8wgmma``): the same GEMM, same output bits, as a
persistent kernel with TMA loads and stores, an autotune candidate where its operands suit TMA (``persistent_ok``).

Both run the tail split of ``kernel.tailsplit`` where it timed faster (``SPLIT`` in the config): the tiles of the
last partial wave in K pieces, the same int32 sums.

``_w8a8_small_m_kernel``: the whole W8A8 linear for M <= 16 rows in one launch (per-row absmax over K, quantize
on the fly with the quantizer's exact arithmetic, GEMM, epilogue): bit-identical to quantize + GEMM, one launch and
two allocations fewer on the adaLN / time-embedding GEMVs, which are host-bound.

NOTE: int32 accumulation is exact while K * 127 * 127 < 2**31, i.e. K < 133,143 (the largest K in Ideogram 4
is 53,248). Importing this module imports triton.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import quantize as _quantize  # noqa: F401  (applies the interpreter compat shim under TRITON_INTERPRET=1)
from .quantize import rint, sm_count
from .config import force_generation, gemm_switches
from .launch import launch, not_recorded
from . import ahead, deferred, retune, s8wgmma
from .tailsplit import choose_split, program_slots, program_tile, split_launch, sum_pieces, tile_sum


@triton.jit
def _to_bf16_rne_bits(v):
    # fp32 -> bf16 rounding to nearest even on the bit pattern (finite values; NaN stays NaN).
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def store_out(c_ptrs, v, c_mask, INTERPRET: tl.constexpr):
    # NOTE: Triton 3.6's interpreter truncates fp32 -> bf16 casts (compiled code rounds to nearest even,
    # cvt.rn.bf16.f32), so under TRITON_INTERPRET=1 round on the bits to test the same numbers on the CPU.
    if INTERPRET:
        if c_ptrs.dtype.element_ty == tl.bfloat16:
            tl.store(c_ptrs, _to_bf16_rne_bits(v), mask=c_mask)
        else:
            tl.store(c_ptrs, v.to(c_ptrs.dtype.element_ty), mask=c_mask)
    else:
        tl.store(c_ptrs, v.to(c_ptrs.dtype.element_ty), mask=c_mask)


@triton.jit
def tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped ordering of tile ``pid``: GROUP_M row-tiles sweep N together, so the W tiles they share stay in L2
    # (the standard Triton matmul trick; worth a few % on the 4608-row block GEMMs).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def acc_tile(a_ptr, w_ptr, offs_am, offs_wn, K, stride_am, stride_ak, stride_wn, stride_wk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The exact int32 tile ``A[offs_am, :] @ W[offs_wn, :].T`` (rows / columns in range: callers wrap tails).
    Operands passed as fp8 (int8 bytes, ``kernel.s8wgmma``): the dot is built as fp8 wgmma, which that module
    rewrites to s8; the accumulator registers then hold int32 sums, read back with a bitcast."""
    FP8: tl.constexpr = a_ptr.dtype.element_ty == tl.float8e4nv
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + offs_wn[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    if FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_K
            if FP8:  # +0.0: the same zero bytes
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            else:
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)
                w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0)
        if FP8:
            acc = tl.dot(a, w, acc)
        else:
            acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if FP8:
        acc = acc.to(tl.int32, bitcast=True)
    return acc


@triton.jit
def dequant(acc, as_ptr, ws_ptr, bias_ptr, offs_cm, offs_wn, M, stride_as, stride_ws, stride_bias,
             HAS_BIAS: tl.constexpr):
    """The epilogue's fp32 ``acc * a_scale[m] * w_scale[n] + bias[n]`` (``offs_wn`` in range)."""
    a_s = tl.load(as_ptr + offs_cm * stride_as, mask=offs_cm < M, other=0.0)
    w_s = tl.load(ws_ptr + offs_wn * stride_ws)
    out = acc.to(tl.float32) * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_wn * stride_bias).to(tl.float32)[None, :]
    return out


@triton.jit
def dot16(a, b, acc, INTERPRET: tl.constexpr):
    """``acc + a @ b`` for bf16 / fp16 operands, the products summed in fp32. NOTE: Triton 3.6's interpreter
    multiplies bf16 operands as their raw bits; there the operands go in as fp32 (exact) with IEEE products."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def lora_up(out, lh_ptr, lu_ptr, rows, offs_wn, stride_lh, stride_lu, LORA_R: tl.constexpr,
            INTERPRET: tl.constexpr, LORA_STEP: tl.constexpr):
    """``out + h[rows, :] @ u[offs_wn, :].T`` in fp32: a LoRA's up-projection added in the epilogue (h [M, R] the
    low-rank activations, u [N, R] the up weights times their scales, both bf16 or fp16 with unit last stride; rows
    and columns in range). R (a multiple of ``kernel.checks.LORA_CHUNK``) is taken LORA_STEP at a time (a loop, not
    unrolled: ``lora_step``), so the operands held at once stay small beside the main loop's buffers; on sm_90 each
    step is a bf16 wgmma into the dequantized tile's registers (no layout change: tests/test_lora_gemm.py)."""
    offs_r = tl.arange(0, LORA_STEP)
    h_ptrs = lh_ptr + rows[:, None].to(tl.int64) * stride_lh + offs_r[None, :]
    u_ptrs = lu_ptr + offs_wn[None, :].to(tl.int64) * stride_lu + offs_r[:, None]
    for _ in range(0, LORA_R, LORA_STEP):
        out = dot16(tl.load(h_ptrs), tl.load(u_ptrs), out, INTERPRET)
        h_ptrs += LORA_STEP
        u_ptrs += LORA_STEP
    return out


LORA_STEP_MAX = 32  # the widest rank step of lora_up (module data: bench/lora.py --lora-step sets it)


def lora_step(r: int) -> int:
    """The rank step of ``lora_up`` for rank ``r`` (a multiple of 16): the widest power of 2 up to
    ``LORA_STEP_MAX`` that divides it. Each step is one round trip to memory for h and u before its MMA, so a wider
    step waits less, at the cost of its tiles in shared memory (16 KB a 32-wide step at 128 x 256 bf16)."""
    if r == 0:
        return 0
    step = 16
    while step * 2 <= LORA_STEP_MAX and r % (step * 2) == 0:
        step *= 2
    return step


@triton.jit(do_not_specialize=["M", "DP_TILES"])
def _int8_gemm_kernel(a_ptr, w_ptr, c_ptr, as_ptr, ws_ptr, bias_ptr, part_ptr, cnt_ptr,
                      M, N, K, DP_TILES, K_PIECE,
                      stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
                      stride_as, stride_ws, stride_bias, lh_ptr, lu_ptr, stride_lh, stride_lu,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_INT32: tl.constexpr,
                      EVEN_K: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr, LORA_R: tl.constexpr,
                      LORA_STEP: tl.constexpr):
    # SPLIT > 1 (the tail split, ``kernel.tailsplit``): programs below DP_TILES run whole tiles; the rest run
    # K_PIECE-long pieces of the last tiles, SPLIT a tile, and the last piece of a tile to finish sums the
    # pieces' exact int32 partials (any order: same sum) and runs the epilogue.
    tile, a_ptr, w_ptr, k_len = program_tile(a_ptr, w_ptr, DP_TILES, K_PIECE, K, stride_ak, stride_wk, SPLIT)
    pid_m, pid_n = tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # Row / column tails wrap (% M, % N) so the loads need no mask; the store masks them.
    offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_wn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    acc = acc_tile(a_ptr, w_ptr, offs_am, offs_wn, k_len, stride_am, stride_ak, stride_wn, stride_wk,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    acc, finish = tile_sum(acc, tile, part_ptr, cnt_ptr, DP_TILES, BLOCK_M, BLOCK_N, SPLIT)
    if finish:  # a constant True without the split: no branch
        _gemm_epilogue(acc, c_ptr, as_ptr, ws_ptr, bias_ptr, pid_m, pid_n, offs_wn, M, N, stride_cm, stride_cn,
                       stride_as, stride_ws, stride_bias, lh_ptr, lu_ptr, stride_lh, stride_lu, BLOCK_M, BLOCK_N,
                       HAS_BIAS, OUT_INT32, INTERPRET, LORA_R, LORA_STEP)


@triton.jit
def acc_tile_tma(a_desc, w_desc, off_m, off_n, k_lo, k_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, W_HALVES: tl.constexpr):
    """``acc_tile`` through TMA descriptors: the exact int32 tile of A rows ``off_m``.. and W rows ``off_n``.. over
    K elements ``k_lo``..``k_lo + k_len`` (rows and K past the ends read as zero; ``k_len`` a multiple of BLOCK_K
    unless the range ends at K). ``W_HALVES``: ``w_desc`` describes W as [2, N / 2, K] and the tile's rows are
    BLOCK_N / 2 rows of each half from ``off_n`` on (the SwiGLU GEMM's w1 and w3 rows), one load of both."""
    FP8: tl.constexpr = a_desc.dtype == tl.float8e4nv
    if FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for kk in range(tl.cdiv(k_len, BLOCK_K)):
        k = k_lo + kk * BLOCK_K
        a = a_desc.load([off_m, k])
        if W_HALVES:
            w = tl.reshape(w_desc.load([0, off_n, k]), (BLOCK_N, BLOCK_K))
        else:
            w = w_desc.load([off_n, k])
        if FP8:
            acc = tl.dot(a, w.T, acc)
        else:
            acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
    if FP8:
        acc = acc.to(tl.int32, bitcast=True)
    return acc


@triton.jit(do_not_specialize=["M", "DP_TILES"])
def _int8_gemm_persistent_kernel(a_desc, w_desc, c_desc, as_ptr, ws_ptr, bias_ptr, part_ptr, cnt_ptr, M, N, K,
                                 DP_TILES, K_PIECE, stride_as, stride_ws, stride_bias, NUM_PROGS,
                                 lh_ptr, lu_ptr, stride_lh, stride_lu,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                                 INTERPRET: tl.constexpr, LORA_R: tl.constexpr, LORA_STEP: tl.constexpr):
    # The same GEMM as _int8_gemm_kernel (same sums, same epilogue arithmetic: same output bits) as a persistent
    # kernel: NUM_PROGS programs (a runtime value: one binary for any grid) loop over the tiles in grouped order,
    # A / W tiles come through TMA descriptors (rows / K past the end read as zero) and the output tile leaves
    # through a TMA store in two halves (clipped at M / N). The tile loop is flattened into the K loop, so the next
    # tile's loads are in flight while this one's epilogue runs. Operands as fp8: the s8 rewrite (kernel.s8wgmma),
    # as in acc_tile. SPLIT > 1 (the tail split, ``tail_layout`` with a slot a program): the loop runs the first
    # DP_TILES tiles (whole waves), then program q runs piece q % SPLIT (K_PIECE long) of tile DP_TILES + q //
    # SPLIT, and a tile's last piece to finish sums the exact int32 partials (``sum_pieces``) and stores it.
    for tile in tl.range(tl.program_id(0), DP_TILES, NUM_PROGS, flatten=True):
        pid_m, pid_n = tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = acc_tile_tma(a_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, False)
        _persistent_store(acc, c_desc, as_ptr, ws_ptr, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N,
                          stride_as, stride_ws, stride_bias, lh_ptr, lu_ptr, stride_lh, stride_lu, BLOCK_M, BLOCK_N,
                          HAS_BIAS, INTERPRET, LORA_R, LORA_STEP)
    if SPLIT > 1:
        q = tl.program_id(0)
        tile = DP_TILES + q // SPLIT
        if tile < tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N):
            pid_m, pid_n = tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            k_lo = (q % SPLIT) * K_PIECE
            acc = acc_tile_tma(a_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k_lo, tl.minimum(K - k_lo, K_PIECE),
                                BLOCK_M, BLOCK_N, BLOCK_K, False)
            acc, last = sum_pieces(acc, part_ptr, cnt_ptr, tile - DP_TILES, q % SPLIT, BLOCK_M, BLOCK_N, SPLIT)
            if last:
                _persistent_store(acc, c_desc, as_ptr, ws_ptr, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N,
                                  stride_as, stride_ws, stride_bias, lh_ptr, lu_ptr, stride_lh, stride_lu,
                                  BLOCK_M, BLOCK_N, HAS_BIAS, INTERPRET, LORA_R, LORA_STEP)


@triton.jit
def _persistent_store(acc, c_desc, as_ptr, ws_ptr, bias_ptr, off_m, off_n, M, N, stride_as, stride_ws, stride_bias,
                      lh_ptr, lu_ptr, stride_lh, stride_lu, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr, LORA_R: tl.constexpr,
                      LORA_STEP: tl.constexpr):
    """The persistent kernel's epilogue: ``dequant`` of the int32 tile at (``off_m``, ``off_n``) (plus the LoRA
    up-projection, ``lora_up``), stored through ``c_desc`` in two halves (clipped at M / N)."""
    HALF: tl.constexpr = BLOCK_N // 2
    offs_cm = off_m + tl.arange(0, BLOCK_M)
    offs_wn = (off_n + tl.arange(0, BLOCK_N)) % N  # a column tail wraps; the store clips it
    out = dequant(acc, as_ptr, ws_ptr, bias_ptr, offs_cm, offs_wn, M, stride_as, stride_ws, stride_bias, HAS_BIAS)
    if LORA_R > 0:
        out = lora_up(out, lh_ptr, lu_ptr, offs_cm % M, offs_wn, stride_lh, stride_lu, LORA_R, INTERPRET,
                      LORA_STEP)
    if INTERPRET and c_desc.dtype == tl.bfloat16:  # round as compiled code does (see store_out)
        y = _to_bf16_rne_bits(out)
    else:
        y = out.to(c_desc.dtype)
    y0, y1 = tl.split(tl.permute(tl.reshape(y, (BLOCK_M, 2, HALF)), (0, 2, 1)))
    c_desc.store([off_m, off_n], y0)
    c_desc.store([off_m, off_n + HALF], y1)


@triton.jit
def _gemm_epilogue(acc, c_ptr, as_ptr, ws_ptr, bias_ptr, pid_m, pid_n, offs_wn, M, N, stride_cm, stride_cn,
                   stride_as, stride_ws, stride_bias, lh_ptr, lu_ptr, stride_lh, stride_lu, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_INT32: tl.constexpr, INTERPRET: tl.constexpr,
                   LORA_R: tl.constexpr, LORA_STEP: tl.constexpr):
    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
    c_ptrs = c_ptr + offs_cm[:, None].to(tl.int64) * stride_cm + offs_cn[None, :] * stride_cn
    if OUT_INT32:
        tl.store(c_ptrs, acc, mask=c_mask)
    else:
        out = dequant(acc, as_ptr, ws_ptr, bias_ptr, offs_cm, offs_wn, M, stride_as, stride_ws, stride_bias,
                       HAS_BIAS)
        if LORA_R > 0:
            out = lora_up(out, lh_ptr, lu_ptr, offs_cm % M, offs_wn, stride_lh, stride_lu, LORA_R, INTERPRET,
                          LORA_STEP)
        store_out(c_ptrs, out, c_mask, INTERPRET)


@triton.jit
def _w8a8_small_m_kernel(x_ptr, inv_ptr, w_ptr, c_ptr, ws_ptr, bias_ptr,
                         M, N, K,
                         stride_xm, stride_xk, stride_wn, stride_wk, stride_cm, stride_cn, stride_ws, stride_bias,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         HAS_SMOOTH: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_RECIP: tl.constexpr,
                         INTERPRET: tl.constexpr):
    # The whole W8A8 linear for a few rows (M <= 16: adaLN / time-embedding GEMVs) in one launch: every program
    # first finds the absmax of its rows over all of K (the activation is a few KB, read from L2), then quantizes
    # its A tiles on the fly with exactly the per-token quantizer's arithmetic (kernel/quantize.py), so the result
    # is bit-identical to quantize_per_token + int8_gemm while saving a launch and two allocations.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m % M
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk

    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    bad = tl.zeros([BLOCK_M], dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = offs_k < K - k * BLOCK_K
        x = tl.load(x_ptrs + k * BLOCK_K * stride_xk, mask=kmask[None, :], other=0.0).to(tl.float32)
        if HAS_SMOOTH:
            x = x * tl.load(inv_ptr + k * BLOCK_K + offs_k, mask=kmask, other=1.0).to(tl.float32)[None, :]
        ax = tl.abs(x)
        bad = tl.maximum(bad, tl.max(tl.where(ax < float("inf"), 0, 1), axis=1))
        amax = tl.maximum(amax, tl.max(ax, axis=1))
    row_bad = bad > 0
    usable = (amax > 0.0) & (~row_bad)
    if SCALE_RECIP:
        a_s = amax * 0.007874015718698502  # as kernel/quantize.py: fp32(1/127) on CUDA
    else:
        a_s = tl.math.div_rn(amax, 127.0)
    a_s = tl.where(row_bad, float("nan"), a_s)
    mult = tl.math.div_rn(1.0, tl.where(usable, amax, 1.0)) * 127.0

    offs_wn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    w_ptrs = w_ptr + offs_wn[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = offs_k < K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=kmask[None, :], other=0.0).to(tl.float32)
        if HAS_SMOOTH:
            x = x * tl.load(inv_ptr + k * BLOCK_K + offs_k, mask=kmask, other=1.0).to(tl.float32)[None, :]
        q = tl.minimum(tl.maximum(rint(x * mult[:, None], INTERPRET), -127.0), 127.0)
        a = tl.where(usable[:, None], q, 0.0).to(tl.int8)
        w = tl.load(w_ptrs, mask=kmask[:, None], other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = (offs_m[:, None] < M) & (offs_cn[None, :] < N)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_cn[None, :] * stride_cn
    w_s = tl.load(ws_ptr + offs_cn * stride_ws, mask=offs_cn < N, other=0.0)
    out = acc.to(tl.float32) * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_cn * stride_bias, mask=offs_cn < N, other=0.0).to(tl.float32)[None, :]
    store_out(c_ptrs, out, c_mask, INTERPRET)


def launch_w8a8_small_m(x: torch.Tensor, inv_smooth: torch.Tensor | None, w_q: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None, out: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The one-launch W8A8 linear for M <= 16 (``_w8a8_small_m_kernel``); inputs already validated, M, N, K > 0,
    ``inv_smooth`` fp32 with unit stride."""
    m, k = x.shape
    n = w_q.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    has_bias = bias is not None
    launch(_w8a8_small_m_kernel, (-(-n // bn), -(-m // bm)),
           (x, inv_smooth if inv_smooth is not None else w_scale, w_q, out, w_scale, bias if has_bias else w_scale,
            m, n, k,
            x.stride(0), x.stride(1), w_q.stride(0), w_q.stride(1), out.stride(0), out.stride(1),
            w_scale.stride(0), bias.stride(0) if has_bias else 0),
           dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_SMOOTH=inv_smooth is not None, HAS_BIAS=has_bias,
                SCALE_RECIP=x.is_cuda, INTERPRET=_quantize.INTERPRET),
           cfg["num_warps"], cfg["num_stages"], x.device)
    return out


def select_small_m_config(x, inv_smooth, w_q, w_scale, bias, out) -> dict:
    """The config of the one-launch small-M kernel for this (N, K): memoised, cached on disk under the key
    ``XQ_N.._K.._M16``, else chosen without timing and timed between samples (``autotune.choose``; under
    ``INT8_FUSED_TUNE=first_call`` timed now, as ``select_config``)."""
    m, k = x.shape
    n = w_q.shape[0]
    dev = x.device
    forced = gemm_switches()[1]
    memo_key = ("xq", dev, n, k, forced)
    cfg = _TUNED.get(memo_key)
    if cfg is not None:
        return cfg
    from . import autotune
    if dev.type != "cuda":
        return autotune.interpreter_run_config(m)
    cap, smem = _generation(dev, forced)
    key = "XQ_" + autotune.ConfigCache.key(n, k, autotune.SMALL_M)
    ckey = retune.class_key(dev, "xq", n, k, "small", False, forced)
    tune = deferred.mode()
    cands = autotune.candidates(cap, smem, autotune.SMALL_M)

    def run(c):
        launch_w8a8_small_m(x, inv_smooth, w_q, w_scale, bias, out, c)

    def time_fn(c):
        return timed_ms(lambda: run(c))

    later = _later(dev, n, k, key, ckey, cands, lambda ops, c: launch_w8a8_small_m(*ops, c),
                   (x, inv_smooth, w_q, w_scale, bias, out))
    with not_recorded():  # the candidates' timing launches are not part of a recorded call (kernel.plan)
        cfg = autotune.choose(device_cache(dev), key, retune.built_for(ckey),
                              cands if tune == "first_call" else autotune.predicted(cap, smem, m), tune, time_fn,
                              tuning_meta(dev), check=run, later=later)
    retune.built(ckey, cfg)
    _TUNED[memo_key] = cfg
    return cfg


def _later(dev, n: int, k: int, key: str, ckey: tuple, cands: list, launcher, operands: tuple, m: int | None = None,
           split_slots=None):
    """``autotune.choose``'s ``later``: queues the background job of ``key`` (``kernel.retune``). ``launcher(ops,
    config)`` runs one call on fresh operands of the shapes of ``operands`` (tensors, specs or None; only their
    specs are kept); ``m`` / ``split_slots``: also time the tail split of an M-row call after the tile
    (``choose_split``)."""
    def later(what: str, entry):
        specs = [retune.spec(t) for t in operands]
        cache = device_cache(dev)
        meta = tuning_meta(dev)

        def job(stop):
            def work():
                ops = [retune.fresh(s_) for s_ in specs]

                def time_fn(c):
                    stop()
                    return timed_ms(lambda: launcher(ops, c))
                if what == "adopt":
                    stop()
                    launcher(ops, entry)   # builds it (and checks an s8 build) off the critical path
                    best = entry
                elif what == "split":
                    best = entry           # the tile in use; only its tail split is timed
                else:
                    from . import autotune
                    best = autotune.tune_now(cache, key, cands, time_fn, meta)
                retune.built(ckey, best)
                if m is not None and split_slots is not None:
                    retune.built(ckey, choose_split(best, m, n, k, split_slots(best), cache, time_fn, meta))
            retune.run_on(dev, work, specs)
            retune.forget([_TUNED], dev, n, k)
        # one job a key and M: the first queued (a tile's tuning or adoption, which time the split too) covers a
        # later split request
        retune.submit(f"gemm {key}" + (f" M{m}" if m is not None else ""), job)
    return later


def launch_int8_gemm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None, out: torch.Tensor, cfg: dict, lora: tuple | None = None
                     ) -> torch.Tensor:
    """Runs the kernel with one config into ``out`` (int32 or float [M, N]); inputs already validated,
    M, N, K > 0. ``a_scale``/``w_scale``/``bias`` may have stride 0 (a broadcast scalar). ``cfg["SPLIT"]`` > 1:
    the tiles of the last partial wave run in K pieces (``tail_layout``); same int32 sums, same output bits.
    ``lora`` = (h [M, R], u [N, R]) (checked by ``kernel.checks.lora_operands``: both bf16 or both fp16,
    contiguous, R a multiple of ``kernel.checks.LORA_CHUNK``): the epilogue adds ``h @ u.T`` in fp32 before the
    one rounding (an int32 output takes no LoRA)."""
    m, k = a_q.shape
    n = w_q.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles = -(-m // bm) * -(-n // bn)  # integer ceil: triton.cdiv is a ConstexprFunction (~2 us a call)
    out_int32 = out.dtype == torch.int32
    has_bias = bias is not None and not out_int32
    lora_args, lora_r = lora_launch_args(lora, a_scale)
    if cfg.get("PERSIST") and persistent_ok(a_q, w_q, out):
        _launch_persistent(a_q, a_scale, w_q, w_scale, bias if has_bias else None, out, cfg, tiles, lora_args,
                           lora_r)
        return out
    progs, dp, k_piece, split, part, cnt, opts = split_launch(cfg, tiles, k, a_q.device, a_scale)
    run_launch(cfg, _int8_gemm_kernel, (progs,),
               (a_q, w_q, out, a_scale, w_scale, bias if has_bias else a_scale, part, cnt,
                m, n, k, dp, k_piece,
                a_q.stride(0), a_q.stride(1), w_q.stride(0), w_q.stride(1), out.stride(0), out.stride(1),
                a_scale.stride(0), w_scale.stride(0), bias.stride(0) if has_bias else 0, *lora_args),
               dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
                    HAS_BIAS=has_bias, OUT_INT32=out_int32, EVEN_K=k % bk == 0, SPLIT=split,
                    INTERPRET=_quantize.INTERPRET, LORA_R=lora_r, LORA_STEP=lora_step(lora_r), **opts),
               a_q.device)
    return out


def lora_launch_args(lora: tuple | None, dummy: torch.Tensor) -> tuple[tuple, int]:
    """(the GEMM kernels' LoRA arguments ``lh_ptr, lu_ptr, stride_lh, stride_lu``, ``LORA_R``) for ``lora`` = (h,
    u) or None (then ``dummy`` stands in for both pointers and LORA_R is 0: the epilogue has no LoRA code)."""
    if lora is None:
        return (dummy, dummy, 0, 0), 0
    h, u = lora
    return (h, u, h.stride(0), u.stride(0)), h.shape[1]


def persistent_ok(a_q: torch.Tensor, w_q: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the persistent kernel takes these operands (else the same tile runs as ``_int8_gemm_kernel``, same
    bits): what TMA descriptors need (16-byte aligned bases and row strides, unit last strides) and a 2-byte
    output (its tile's half staged for the TMA store)."""
    return out.dtype in (torch.bfloat16, torch.float16) and all(tma_ok(t) for t in (a_q, w_q, out))


def tma_ok(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can describe the 2-D tensor ``t``: unit column stride, 16-byte aligned base and
    row stride."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def persistent_programs(tiles: int, device: torch.device) -> int:
    """The persistent kernels' grid: a program an SM (4 on the interpreter), no more than there are tiles."""
    return min(tiles, sm_count(device) if device.type == "cuda" else 4)


def _launch_persistent(a_q, a_scale, w_q, w_scale, bias, out, cfg: dict, tiles: int, lora_args: tuple,
                       lora_r: int) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor
    m, k = a_q.shape
    n = w_q.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    dev = a_q.device
    progs = persistent_programs(tiles, dev)
    _, dp, k_piece, split, part, cnt, _ = split_launch(cfg, tiles, k, dev, a_scale)
    run_launch(cfg, _int8_gemm_persistent_kernel, (progs,),
               (TensorDescriptor(a_q, [m, k], [a_q.stride(0), 1], [bm, bk]),
                TensorDescriptor(w_q, [n, k], [w_q.stride(0), 1], [bn, bk]),
                TensorDescriptor(out, [m, n], [out.stride(0), 1], [bm, bn // 2]),
                a_scale, w_scale, a_scale if bias is None else bias, part, cnt, m, n, k, dp, k_piece,
                a_scale.stride(0), w_scale.stride(0), 0 if bias is None else bias.stride(0), progs, *lora_args),
               dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
                    HAS_BIAS=bias is not None, SPLIT=split, INTERPRET=_quantize.INTERPRET, LORA_R=lora_r,
                    LORA_STEP=lora_step(lora_r)),
               dev)


def run_launch(cfg: dict, jit_fn, grid: tuple, args: tuple, constexprs: dict, device: torch.device) -> None:
    """One GEMM kernel launch with ``cfg``'s warps and stages: as s8 wgmma n256 where ``cfg["S8"]``
    (``kernel.s8wgmma``; ``args[2]`` is the output its first call checks), else Triton's int8 build."""
    if cfg.get("S8"):
        s8wgmma.launch_s8(jit_fn, grid, args, constexprs, cfg["num_warps"], cfg["num_stages"], device, 2)
    else:
        launch(jit_fn, grid, args, constexprs, cfg["num_warps"], cfg["num_stages"], device)


def timed_ms(fn) -> float:
    """Median ms of ``fn`` (``triton.testing.do_bench``, the L2 flushed before each call): how every tuner of the
    pack's GEMMs times a candidate."""
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def tuning_meta(device: torch.device) -> dict:
    """What an autotune file records about the tuning: the GPU and the Triton version."""
    return {"gpu": torch.cuda.get_device_name(device), "triton": triton.__version__}


_TUNED: dict[tuple, dict] = {}      # (device, N, K, M bucket, ..) or (.., exact M, split asked, ..) -> config
_CACHES: dict[tuple, object] = {}   # (device index, forced generation) -> autotune.ConfigCache


def _forget_chosen() -> None:
    """A compile of ``kernel.ahead``'s dry run failed: its configs were chosen without a real check launch, so the
    real call chooses again (with its checks)."""
    _TUNED.clear()
    retune.COMPILED.clear()


ahead.on_failure.append(_forget_chosen)


def device_cache(device: torch.device):
    """The device's autotune file; under ``forced_generation`` another file, named after the forced capability too."""
    from . import autotune
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, gemm_switches()[1])
    if key not in _CACHES:
        name = torch.cuda.get_device_name(idx) + (f" as sm_{key[1][0]}{key[1][1]}" if key[1] else "")
        _CACHES[key] = autotune.ConfigCache(autotune.cache_file(name, triton.__version__), gpu=name)
    return _CACHES[key]


def _generation(device: torch.device, forced: tuple | None) -> tuple[tuple[int, int], int | None]:
    """(capability, opt-in shared memory a block) whose tile set ``select_config`` offers on ``device``: the GPU's
    own, or under ``forced_generation`` the forced capability with ``autotune.SMEM_OPTIN``'s figure for it."""
    if forced is not None:
        return forced, None
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor), props.shared_memory_per_block_optin


@contextlib.contextmanager
def forced_generation(capability: tuple[int, int]):
    """Bench hook, not a user switch (bench/checks/consumer_tiles.py): inside, the INT8 GEMMs choose their tiles as on a GPU
    of ``capability`` (its ``autotune.candidates`` at its shared-memory limit, no s8 wgmma tiles unless it is sm_90),
    timed on the GPU at hand, in an autotune file of their own; the row kernels' plans are the same on every GPU.
    Part of ``kernel.gemm_switches()`` inside, so no prepared call (``kernel.plan``) crosses the boundary."""
    force_generation(tuple(capability))
    try:
        yield
    finally:
        force_generation(None)


def select_config(a_q, a_scale, w_q, w_scale, bias, out, out_dtype: torch.dtype | None = None,
                  tail_split: bool = True) -> dict:
    """The config for this (N, K, M bucket): memoised, else from the on-disk cache, else timed now with
    ``triton.testing.do_bench`` on these very tensors (``out`` is overwritten by the real call after; None: an
    [M, N] ``out_dtype`` buffer is made for the timing, e.g. for the SwiGLU-epilogue kernel, which shares the
    merged w1+w3 GEMM's config and passes ``tail_split=False``). With ``tail_split`` the config carries this M's
    tail split, see ``kernel.tailsplit.choose_split``."""
    m, k = a_q.shape
    n = w_q.shape[0]
    dev = a_q.device
    # exact-M memo first (the s8 path in the key: A/B rows in one process); the per-call path is a lookup
    s8 = s8wgmma.usable(dev)  # the s8 tiles are offered with their persistent form too
    forced = gemm_switches()[1]
    exact = (dev, n, k, m, tail_split, s8, forced)
    cfg = _TUNED.get(exact)
    if cfg is not None:
        return cfg
    from . import autotune
    bucket = autotune.m_bucket(m)
    if dev.type != "cuda":  # TRITON_INTERPRET=1 on CPU: no timing, the interpreter's run tile
        return autotune.interpreter_run_config(m)
    memo_key = (dev, n, k, bucket, s8, forced)
    cfg = _TUNED.get(memo_key)
    if cfg is None or tail_split:
        cap, smem = _generation(dev, forced)
        meta = tuning_meta(dev)
        buf = [out]
        tune = deferred.mode()
        ckey = retune.class_key(dev, "gemm", n, k, autotune.m_class(m), s8, forced)
        fresh_ok = not retune.built_for(ckey)   # nothing built for this class yet: this call may build

        def run(c):  # one launch; also how a shipped config is checked before it is trusted (autotune.seed_entry)
            if buf[0] is None:  # made only when something runs (a merged w1+w3 output is large)
                buf[0] = torch.empty((m, n), dtype=out_dtype, device=dev)
            launch_int8_gemm(a_q, a_scale, w_q, w_scale, bias, buf[0], c)

        def time_fn(c):
            return timed_ms(lambda: run(c))

        cands = autotune.candidates(cap, smem, bucket, s8=s8, persist=s8)
        later = _later(dev, n, k, autotune.ConfigCache.key(n, k, bucket, s8, s8), ckey, cands,
                       lambda ops, c: launch_int8_gemm(*ops, c),
                       (a_q, a_scale, w_q, w_scale, bias, ((m, n), (n, 1), out_dtype, dev) if out is None else out),
                       m if tail_split else None, lambda c: program_slots(c, dev))
        with not_recorded():
            if cfg is None:
                cfg = _TUNED[memo_key] = autotune.choose(
                    device_cache(dev), autotune.ConfigCache.key(n, k, bucket, s8, s8), retune.built_for(ckey),
                    cands if tune == "first_call" else autotune.predicted(cap, smem, m, s8=s8, persist=s8), tune,
                    time_fn, meta, check=run, later=later)
                retune.built(ckey, cfg)
            if tail_split:
                cfg = choose_split(cfg, m, n, k, program_slots(cfg, dev), device_cache(dev), time_fn, meta, check=run,
                                   tune=tune, may_build=lambda c: fresh_ok or retune.is_built(ckey, c), later=later)
                retune.built(ckey, cfg)
    _TUNED[exact] = cfg
    return cfg
