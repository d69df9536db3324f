"""A LoRA's down-projection from the int8 codes the GEMM reads, for the LoRA-in-the-epilogue GEMM.

A LoRA after Apply on an INT8 layer adds ``(x D^T) U^T`` to its output (``quant.lora``: D [R, K] every down
projection, U [N, R] every up projection times its scale). Where the layer's input arrives as int8 codes
``a_q`` with per-token scales ``a_s`` (a fused block's quantizing row kernel made them), the low-rank activation is

    h[m, :] = (a_q[m, :] @ D^T) * a_s[m]           (a_q exact in bf16 / fp16, the sum in fp32, one rounding)

(``lora_down``), and the GEMM adds ``h @ U^T`` in its epilogue before the output's one rounding
(``kernel.gemm.lora_up``): the output is read and written once, as without a LoRA, and the codes are read once more
as int8 (the old branch read them as bf16 after converting them: two more passes over the activation, and four
launches a layer instead of one).

``_lora_down_kernel``: a program a BLOCK_M-row tile, the whole rank at once (R, a multiple of 16, is small; padded
to a power of 2 inside, masked), K in BLOCK_K steps; the codes are converted to the LoRA's dtype in registers.
Importing this module imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import quantize as _quantize  # the interpreter compat shim
from .gemm import dot16, store_out
from .launch import launch


@triton.jit(do_not_specialize=["M"])
def _lora_down_kernel(a_ptr, as_ptr, d_ptr, h_ptr, M, K, stride_am, stride_dr, stride_hm,
                      R: tl.constexpr, RP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m % M  # a row tail wraps on load; the store masks it
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, RP)  # R padded to a power of 2 (tl.arange's rule), the padding masked
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    d_ptrs = d_ptr + offs_r[None, :] * stride_dr + offs_k[:, None]  # D^T tile [BLOCK_K, R]
    dt = h_ptr.dtype.element_ty
    in_r = offs_r[None, :] < R
    acc = tl.zeros((BLOCK_M, RP), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            d = tl.load(d_ptrs, mask=in_r, other=0.0)
        else:
            left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < left, other=0)
            d = tl.load(d_ptrs, mask=(offs_k[:, None] < left) & in_r, other=0.0)
        if INTERPRET:  # the interpreter converts int8 -> bf16 as bits (see kernel.gemm.dot16): via fp32, exact
            acc = dot16(a.to(tl.float32), d, acc, INTERPRET)
        else:
            acc = dot16(a.to(dt), d, acc, INTERPRET)
        a_ptrs += BLOCK_K
        d_ptrs += BLOCK_K
    s = tl.load(as_ptr + rows)
    h = acc * s[:, None]
    store_out(h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_r[None, :], h, (offs_m < M)[:, None] & in_r,
               INTERPRET)


LORA_DOWN_BM = 0  # rows a program (module data; 0: by M; bench/lora.py --down-rows): each program reads all of D


def launch_lora_down(a_q: torch.Tensor, a_s: torch.Tensor, d: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``h = (a_q @ d.T) * a_s[:, None]`` into ``h`` [M, R] (inputs checked by ``kernel.checks.lora_operands``;
    a_q int8 [M, K] with unit column stride, a_s fp32 [M] contiguous, d [R, K] contiguous in h's dtype, bf16 or
    fp16)."""
    m, k = a_q.shape
    r = d.shape[0]
    bm = LORA_DOWN_BM or (32 if m >= 32 * 128 or m <= 32 else 16)  # programs enough to spread the read over the SMs
    bk = 128 if r <= 64 else 64
    launch(_lora_down_kernel, (-(-m // bm),), (a_q, a_s, d, h, m, k, a_q.stride(0), d.stride(0), h.stride(0)),
           dict(R=r, RP=triton.next_power_of_2(r), BLOCK_M=bm, BLOCK_K=bk, EVEN_K=k % bk == 0,
                INTERPRET=_quantize.INTERPRET), 4, 2, a_q.device)
    return h
