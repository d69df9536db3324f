"""ConvRot activation rotation fused with per-token quantization: one Triton kernel.

``x [M, K]`` float -> ``(int8 [M, K], fp32 scale [M])`` of ``y = x @ blockdiag(H, ..., H)``, where H is the
normalized *regular* Hadamard matrix of order G (ComfyUI / comfy-kitchen's ConvRot rotation: the Kronecker power
of ``[[1,1,1,-1],[1,1,-1,1],[1,-1,1,1],[-1,1,1,1]]``, divided by sqrt(G); symmetric, so ``H @ H = I``) applied to
each group of G columns. The quantization of y is ``quant.quantize.quantize_per_token_ref``'s, rounding for
rounding (the same helpers as ``kernel.quantize``).

``layernorm_modulate_hadamard_quantize`` / ``rmsnorm_modulate_hadamard_quantize`` put a block's adaLN norm in front
(a ConvRot layer fed by Flux's, Qwen-Image's or Wan's LayerNorm, by Lumina 2's or Ideogram 4's RMSNorm):
``kernel.norm``'s modulated values, rounded to their dtype, then rotated and quantized as above, in one kernel
instead of torch's norm and modulation plus this one. ``swiglu_hadamard_quantize`` / ``concat_gelu_hadamard_quantize``
put an MLP's activation in front (a ConvRot layer fed by a SwiGLU or tanh GELU: Lumina 2's / Ideogram 4's w2, Flux's
mlp.2 and linear2, Wan's ffn.2, Qwen-Image's fc2): ``kernel.swiglu``'s / ``kernel.gelu``'s values, rounded to the
input's dtype, rotated and quantized in the same kernel.

How. A program takes BLOCK_M rows and walks their K / G groups twice: pass 1 rotates each group and keeps the
rows' |max|, pass 2 rotates it again (the same operations, the same bits) and stores the codes. The rotation of
a group is tensor-core matrix products with H's entries (+-2^-k, exact in bf16 / fp16) generated in registers:
G <= 64 one [BLOCK_M, G] @ H_G; G >= 256 two, through H_G = H_G1 (x) H_16 (the group as a [G1, 16] matrix X,
``H_G1^T X H_16``). A float32 operand is split into a bf16 head and a bf16 tail (two products, about 16 correct
bits past the head's 8), so bf16 / fp16 inputs are rotated with exact products and fp32 sums, fp32 inputs and the
second stage's fp32 intermediate to about 2^-16 relative. Importing this module imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gelu
from .launch import launch
from .gelu import concat_operands
from .norm import modulation_operands
from .quantize import INTERPRET, quant_params, store_q
from .checks import check_2d, check_usable, convrot_group, vector
from .rowtile import DT_CODE, FLOAT, batch_rows, gelu_tanh, round_to, row_major, rsqrt_mean, swiglu_math
from .swiglu import swiglu_operands

BLOCK_M = 16


@triton.jit
def _h(N: tl.constexpr, DT: tl.constexpr):
    """The normalized regular Hadamard matrix of order N (a power of 4) in dtype DT: entry (i, j) is
    (-1)^(number of base-4 digit positions where i_d + j_d == 3) / sqrt(N)."""
    i = tl.arange(0, N)[:, None]
    j = tl.arange(0, N)[None, :]
    neg = tl.zeros([N, N], dtype=tl.int32)
    for d in tl.static_range(0, 12, 2):
        if (1 << d) < N:
            neg += (((i >> d) & 3) + ((j >> d) & 3) == 3).to(tl.int32)
    scale = 1.0 / tl.sqrt(N * 1.0)
    return tl.where((neg & 1) == 1, -scale, scale).to(DT)


@triton.jit
def _mm(a, h, INTERPRET: tl.constexpr):
    # NOTE: Triton 3.6's interpreter keeps bf16 as raw uint16 and multiplies those in tl.dot, so there the
    # (exactly representable) operands go through an fp32 product instead: the same products, fp32 sums.
    if INTERPRET:
        return tl.dot(a.to(tl.float32), h.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
    else:
        return tl.dot(a, h, out_dtype=tl.float32)


@triton.jit
def _dot_h(a, h, INTERPRET: tl.constexpr):
    """a @ h (fp32 result): a in bf16 / fp16 as it is (h in its dtype); a fp32 as bf16 head + bf16 tail."""
    if a.dtype == tl.float32:
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
        return _mm(hi, h, INTERPRET) + _mm(lo, h, INTERPRET)
    else:
        return _mm(a, h, INTERPRET)


@triton.jit
def _rotate(x, h1, h2, h2f, BM: tl.constexpr, G1: tl.constexpr, G2: tl.constexpr, INTERPRET: tl.constexpr):
    """One group of BM rows (x [BM, G1 * G2]) times H_G1 (x) H_G2, as fp32 [BM, G1 * G2] (G1 == 1: x @ H_G2)."""
    if G1 == 1:
        if x.dtype == tl.float32:
            return _dot_h(x, h2f, INTERPRET)
        else:
            return _dot_h(x, h2, INTERPRET)
    else:
        if x.dtype == tl.float32:
            z = _dot_h(tl.reshape(x, [BM * G1, G2]), h2f, INTERPRET)
        else:
            z = _dot_h(tl.reshape(x, [BM * G1, G2]), h2, INTERPRET)
        zt = tl.reshape(tl.permute(tl.reshape(z, [BM, G1, G2]), (0, 2, 1)), [BM * G2, G1])
        y = _dot_h(zt, h1, INTERPRET)
        return tl.reshape(tl.permute(tl.reshape(y, [BM, G2, G1]), (0, 2, 1)), [BM, G1 * G2])


@triton.jit
def _matrices(G1: tl.constexpr, G2: tl.constexpr, HALF: tl.constexpr):
    """(H_G1, H_G2 in the input's dtype, H_G2 in bf16): stage 1 on the input's dtype (bf16 / fp16: exact) or on
    bf16 pieces of fp32; stage 2 (G1 > 1) on bf16 pieces of stage 1's fp32 (H_G1 unused where G1 == 1)."""
    h2f = _h(G2, tl.bfloat16)
    if HALF:
        h2 = _h(G2, tl.float16)
    else:
        h2 = h2f
    if G1 > 1:
        h1 = _h(G1, tl.bfloat16)
    else:
        h1 = h2f
    return h1, h2, h2f


@triton.jit(do_not_specialize=["M"])
def _hadamard_quant_kernel(x_ptr, b_ptr, q_ptr, s_ptr, f_ptr, M, K, KA, stride_xm, stride_bm, stride_qm, stride_fm,
                           G1: tl.constexpr, G2: tl.constexpr, BM: tl.constexpr, HALF: tl.constexpr,
                           ACT: tl.constexpr, DT: tl.constexpr, CLAMP_FP16: tl.constexpr, FAST: tl.constexpr,
                           SCALE_RECIP: tl.constexpr, STORE_FLOAT: tl.constexpr, INTERPRET: tl.constexpr):
    G: tl.constexpr = G1 * G2
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rmask = rows < M
    cols = tl.arange(0, G)
    x_rows = x_ptr + rows[:, None] * stride_xm
    b_rows = b_ptr + rows[:, None] * stride_bm
    h1, h2, h2f = _matrices(G1, G2, HALF)
    amax = tl.zeros([BM], dtype=tl.float32)
    bad = tl.zeros([BM], dtype=tl.int32)
    for g0 in range(0, K, G):
        x = _act_group(x_rows, b_rows, g0, KA, cols, rmask, ACT, DT, CLAMP_FP16, FAST, INTERPRET)
        y = _rotate(x, h1, h2, h2f, BM, G1, G2, INTERPRET)
        ay = tl.abs(y)
        amax = tl.maximum(amax, tl.max(ay, axis=1))
        bad = tl.maximum(bad, tl.max(tl.where(ay < float("inf"), 0, 1), axis=1))  # NaN fails `< inf` too
        if STORE_FLOAT:
            tl.store(f_ptr + rows[:, None] * stride_fm + g0 + cols[None, :], y, mask=rmask[:, None])
    scale, mult, usable = quant_params(amax, bad > 0, SCALE_RECIP)
    tl.store(s_ptr + rows, scale, mask=rmask)
    for g0 in range(0, K, G):
        x = _act_group(x_rows, b_rows, g0, KA, cols, rmask, ACT, DT, CLAMP_FP16, FAST, INTERPRET)
        y = _rotate(x, h1, h2, h2f, BM, G1, G2, INTERPRET)
        store_q(q_ptr + rows[:, None] * stride_qm + g0 + cols[None, :], y, mult[:, None], usable[:, None],
                rmask[:, None], INTERPRET)


@triton.jit
def _act_group(x_rows, b_rows, g0, KA, cols, rmask, ACT: tl.constexpr, DT: tl.constexpr, CLAMP_FP16: tl.constexpr,
               FAST: tl.constexpr, INTERPRET: tl.constexpr):
    """One group of G columns of the rotation's input, in the input's dtype. ACT 0: x as stored; 1 (SwiGLU):
    ``dt(dt(silu(a)) * b)`` with a at x, b at b (``rowtile.swiglu_math``, as ``kernel.swiglu``); 2 (GELU):
    ``cat(x[:, :KA], dt(gelu_tanh(h)))`` with h at b (``rowtile.gelu_tanh``, as ``kernel.gelu``, its ``GELU_FAST``
    form; G divides KA, so a group lies in one part)."""
    m2 = rmask[:, None]
    if ACT == 0:
        y = tl.load(x_rows + g0 + cols[None, :], mask=m2, other=0.0)
    else:
        if ACT == 1:
            a = tl.load(x_rows + g0 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            b = tl.load(b_rows + g0 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            v = swiglu_math(a, b, DT, CLAMP_FP16, INTERPRET)
        else:
            if g0 < KA:
                v = tl.load(x_rows + g0 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            else:
                h = tl.load(b_rows + (g0 - KA) + cols[None, :], mask=m2, other=0.0).to(tl.float32)
                v = round_to(gelu_tanh(h, INTERPRET, FAST), DT, INTERPRET)
        if DT == 1:
            y = v.to(tl.bfloat16)
        elif DT == 2:
            y = v.to(tl.float16)
        else:
            y = v
    return y


def group_split(group: int) -> tuple[int, int]:
    """(G1, G2) of the kernels' two-stage rotation: H_G = H_G1 (x) H_G2 (G1 = 1: one stage)."""
    return (1, group) if group <= 64 else (group // 16, 16)


def _run(x: torch.Tensor, group: int, store_float: bool):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in FLOAT:
        raise ValueError(f"hadamard_quantize: x must be a float32 / bfloat16 / float16 tensor [M, K], got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__} "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else ''}")
    convrot_group(x.shape[1], group, "hadamard_quantize")
    x = row_major(x, "x")
    return _launch_act(x, x, x.shape[1], x.shape[1], group, 0, store_float=store_float)


def _launch_act(x, b, k, ka, group, act, clamp_fp16=False, store_float=False):
    """Codes [M, K], scales [M] (and the fp32 rotated values when ``store_float``) of ``_act_group``'s values."""
    m = x.shape[0]
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    f = torch.empty((m, k), dtype=torch.float32, device=x.device) if store_float else s
    if m:
        g1, g2 = group_split(group)
        launch(_hadamard_quant_kernel, (triton.cdiv(m, BLOCK_M),),
               (x, b, q, s, f, m, k, ka, x.stride(0), b.stride(0), q.stride(0), f.stride(0) if store_float else 0),
               dict(G1=g1, G2=g2, BM=BLOCK_M, HALF=x.dtype == torch.float16, ACT=act, DT=DT_CODE[x.dtype],
                    CLAMP_FP16=bool(clamp_fp16) and x.dtype == torch.float16,
                    FAST=act == 2 and gelu.GELU_FAST, SCALE_RECIP=x.is_cuda, STORE_FLOAT=store_float,
                    INTERPRET=INTERPRET), 4, 1, x.device)
    return q, s, (f if store_float else None)


def hadamard_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], fp32 scale [M]) of ``x [M, K]`` rotated by ConvRot's block Hadamard of order ``group``
    (module doc). Raises ValueError for a group size outside ``checks.CONVROT_GROUPS`` or one that does not divide
    K."""
    q, s, _ = _run(x, group, False)
    return q, s


def hadamard_rotate(x: torch.Tensor, group: int) -> torch.Tensor:
    """The fp32 rotated values the quantizer of :func:`hadamard_quantize` rounds (for tests and benches)."""
    return _run(x, group, True)[2]


def swiglu_hadamard_quantize(h13, group: int, clamp_fp16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, F], fp32 [M]) of ``hadamard_quantize(silu(a) * b, group)`` in one kernel, the SwiGLU rounded as
    ``kernel.swiglu.swiglu_quantize`` rounds it (no smoothing: ConvRot layers have none). ``h13``: [M, 2F] (the w1
    half first) or a pair (a, b) of [M, F]. What a ConvRot w2 takes from a SwiGLU FeedForward."""
    a, b = swiglu_operands(h13)
    f = a.shape[1]
    convrot_group(f, group, "swiglu_hadamard_quantize")
    if a.shape[0]:
        check_usable(a, "swiglu_hadamard_quantize")
    a, b = row_major(a, "a"), row_major(b, "b")
    q, s, _ = _launch_act(a, b, f, f, group, 1, clamp_fp16)
    return q, s


def concat_gelu_hadamard_quantize(a: torch.Tensor | None, h: torch.Tensor, group: int
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, KA + F], fp32 [M]) of ``hadamard_quantize(cat(a, gelu_tanh(h)), group)`` in one kernel, never
    building the concatenation (``a`` None: ``gelu_tanh(h)`` alone); the GELU rounded as ``kernel.gelu`` rounds it.
    ``group`` must divide both widths. What a ConvRot layer takes from a GELU MLP (Flux's mlp.2, Wan's ffn.2,
    Qwen-Image's fc2) or from Flux's single block (linear2: attention and MLP side by side)."""
    ka = concat_operands(a, h)
    m, f = h.shape
    if a is not None:
        convrot_group(ka, group, "concat_gelu_hadamard_quantize (the first part)")
    convrot_group(f, group, "concat_gelu_hadamard_quantize")
    if m:
        check_usable(h, "concat_gelu_hadamard_quantize")
    h = row_major(h, "h")
    a = row_major(a, "a") if a is not None else h
    q, s, _ = _launch_act(a, h, ka + f, ka, group, 2)
    return q, s


@triton.jit(do_not_specialize=["M", "tokens_per_batch"])
def _norm_mod_hadamard_quant_kernel(x_ptr, w_ptr, s_ptr, sh_ptr, q_ptr, qs_ptr, M, K, tokens_per_batch, eps,
                                    stride_xm, stride_sb, stride_shb, stride_qm,
                                    RMS: tl.constexpr, G1: tl.constexpr, G2: tl.constexpr, BM: tl.constexpr,
                                    NORM_DT: tl.constexpr, SCALE_DT: tl.constexpr, PROD_DT: tl.constexpr,
                                    SCALE_RECIP: tl.constexpr, INTERPRET: tl.constexpr):
    # BM rows a program. Passes over the row's groups: the row statistics (LayerNorm: the mean, then the variance as
    # the mean of squared deviations; RMS: the mean square; fp32), then the rotated |max| and, again, the rotated
    # codes. The norm and modulation are kernel.norm's lnmod_tile / rmsmod_tile per element (rounded as there); the
    # product is rotated in its own dtype.
    G: tl.constexpr = G1 * G2
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rmask = rows < M
    cols = tl.arange(0, G)
    x_rows = x_ptr + rows[:, None] * stride_xm
    bidx = rows // tokens_per_batch
    s_rows = s_ptr + bidx[:, None] * stride_sb
    sh_rows = sh_ptr + bidx[:, None] * stride_shb
    mean = tl.zeros([BM], dtype=tl.float32)
    if not RMS:
        acc = tl.zeros([BM], dtype=tl.float32)
        for g0 in range(0, K, G):
            acc += tl.sum(tl.load(x_rows + g0 + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32), axis=1)
        mean = tl.math.div_rn(acc, K * 1.0)
    acc = tl.zeros([BM], dtype=tl.float32)
    for g0 in range(0, K, G):
        d = tl.load(x_rows + g0 + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32) - mean[:, None]
        acc += tl.sum(d * d, axis=1)
    rstd = rsqrt_mean(acc, K, eps, INTERPRET)
    h1, h2, h2f = _matrices(G1, G2, PROD_DT == 2)
    amax = tl.zeros([BM], dtype=tl.float32)
    bad = tl.zeros([BM], dtype=tl.int32)
    for g0 in range(0, K, G):
        y = _norm_mod_group(x_rows, w_ptr, s_rows, sh_rows, g0, cols, rmask, mean, rstd, RMS, NORM_DT, SCALE_DT,
                            PROD_DT, INTERPRET)
        ay = tl.abs(_rotate(y, h1, h2, h2f, BM, G1, G2, INTERPRET))
        amax = tl.maximum(amax, tl.max(ay, axis=1))
        bad = tl.maximum(bad, tl.max(tl.where(ay < float("inf"), 0, 1), axis=1))  # NaN fails `< inf` too
    scale, mult, usable = quant_params(amax, bad > 0, SCALE_RECIP)
    tl.store(qs_ptr + rows, scale, mask=rmask)
    for g0 in range(0, K, G):
        y = _norm_mod_group(x_rows, w_ptr, s_rows, sh_rows, g0, cols, rmask, mean, rstd, RMS, NORM_DT, SCALE_DT,
                            PROD_DT, INTERPRET)
        store_q(q_ptr + rows[:, None] * stride_qm + g0 + cols[None, :], _rotate(y, h1, h2, h2f, BM, G1, G2, INTERPRET),
                mult[:, None], usable[:, None], rmask[:, None], INTERPRET)


@triton.jit
def _norm_mod_group(x_rows, w_ptr, s_rows, sh_rows, g0, cols, rmask, mean, rstd, RMS: tl.constexpr,
                    NORM_DT: tl.constexpr, SCALE_DT: tl.constexpr, PROD_DT: tl.constexpr, INTERPRET: tl.constexpr):
    """One group of the modulated norm rounded to the product's dtype and returned in it (exact: the rotation's
    products stay exact for bf16 / fp16). LayerNorm: ``addcmul(shift, dt(norm), st(1 + scale))``; RMS:
    ``dt(x * rstd * w) * scale`` (``scale`` the adaLN 1 + s itself)."""
    m2 = rmask[:, None]
    x = tl.load(x_rows + g0 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    s = tl.load(s_rows + g0 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    if RMS:
        w = tl.load(w_ptr + g0 + cols).to(tl.float32)
        n = round_to(x * rstd[:, None] * w[None, :], NORM_DT, INTERPRET)
        y = tl.where(m2, round_to(n * s, PROD_DT, INTERPRET), 0.0)
    else:
        sh = tl.load(sh_rows + g0 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        n = round_to((x - mean[:, None]) * rstd[:, None], NORM_DT, INTERPRET)
        y = tl.where(m2, round_to(n * round_to(1.0 + s, SCALE_DT, INTERPRET) + sh, PROD_DT, INTERPRET), 0.0)
    if PROD_DT == 1:
        return y.to(tl.bfloat16)
    elif PROD_DT == 2:
        return y.to(tl.float16)
    else:
        return y


def layernorm_modulate_hadamard_quantize(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                                         tokens_per_batch: int, group: int, eps: float = 1e-6
                                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], fp32 [M]) of ``hadamard_quantize(addcmul(shift, layer_norm(x, eps), 1 + scale), group)``:
    ``kernel.norm.layernorm_modulate_quantize``'s modulated norm (no smoothing: ConvRot layers have none), rotated
    in the product's dtype and quantized per token, in one kernel. Raises ValueError as both of those do."""
    check_2d(x, "x", FLOAT, "pass the hidden states as [tokens, K] in bf16, fp16 or fp32")
    m, k = x.shape
    convrot_group(k, group, "layernorm_modulate_hadamard_quantize")
    tpb = max(int(tokens_per_batch), 1)
    s2, sh2, _, q, qs = modulation_operands(scale, shift, None, m, k, tpb, x.device)
    if m == 0:
        return q, qs
    check_usable(x, "layernorm_modulate_hadamard_quantize")
    x = row_major(x, "x")
    prod = torch.promote_types(torch.promote_types(x.dtype, s2.dtype), sh2.dtype)
    _launch(x, x, s2, sh2, q, qs, tpb, eps, group, False, DT_CODE[s2.dtype], prod)
    return q, qs


def rmsnorm_modulate_hadamard_quantize(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, scale: torch.Tensor,
                                       tokens_per_batch: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], fp32 [M]) of ``hadamard_quantize(rms_norm(x, norm_weight, eps) * scale, group)``:
    ``kernel.norm.rmsnorm_modulate_quantize``'s values (``scale`` the adaLN 1 + s, [B | 1, K]; no smoothing),
    rotated in the product's dtype and quantized per token, in one kernel."""
    check_2d(x, "x", FLOAT, "pass the hidden states as [tokens, K] in bf16, fp16 or fp32")
    m, k = x.shape
    convrot_group(k, group, "rmsnorm_modulate_hadamard_quantize")
    w = vector(norm_weight, k, "norm_weight", x.device, allow_scalar=False)
    tpb = max(int(tokens_per_batch), 1)
    s2 = batch_rows(scale, k, m, tpb, "scale", x.device)
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    qs = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, qs
    check_usable(x, "rmsnorm_modulate_hadamard_quantize")
    _launch(row_major(x, "x"), row_major(w, "norm_weight"), s2, s2, q, qs, tpb, eps, group, True, 0,
            torch.promote_types(x.dtype, s2.dtype))
    return q, qs


def _launch(x, w, s2, sh2, q, qs, tpb, eps, group, rms, scale_dt, prod):
    g1, g2 = group_split(group)
    m, k = x.shape
    launch(_norm_mod_hadamard_quant_kernel, (triton.cdiv(m, BLOCK_M),),
           (x, w, s2, sh2, q, qs, m, k, tpb, float(eps), x.stride(0), 0 if s2.shape[0] == 1 else s2.stride(0),
            0 if sh2.shape[0] == 1 else sh2.stride(0), q.stride(0)),
           dict(RMS=rms, G1=g1, G2=g2, BM=BLOCK_M, NORM_DT=DT_CODE[x.dtype], SCALE_DT=scale_dt,
                PROD_DT=DT_CODE[prod], SCALE_RECIP=x.is_cuda, INTERPRET=INTERPRET), 4, 1, x.device)
