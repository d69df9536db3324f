"""Shared helpers of the fused row kernels (``kernel.norm``, ``.swiglu``, ``.gelu``, ``.residual``, ``.rope``,
``.hadamard``): how a row is tiled, the roundings to the model dtype, the activations more than one kernel computes
(``swiglu_math``, ``gelu_tanh``), and the operand checks their wrappers share.

Tiling. A kernel reads a row of up to ``max_single`` elements (``TilePlan``) into registers in one BLOCK-wide tile;
a longer row runs in ``chunk``-wide tiles whose later passes re-read the row from L2. Most kernels also have a
one-pass form over up to three power-of-2 segments (``kernel.quantize.SegmentPlan``: 12288 = 8192 + 4096,
4608 = 4096 + 512, 8960 = 8192 + 512 + 256), which keeps the row in registers without masked lanes. Each such kernel
is one Triton kernel whose constexprs choose the form (``row_tiles``): ``S0 > 0`` the segments, else the tile.
Rows must have unit stride along the row (16-byte vector loads: Triton specialises the unit stride away).

Numerics. Each kernel reproduces the unfused torch sequence including its roundings to the model dtype
(``round_to``): a bf16 rounding of an intermediate is about a quarter of an int8 step near the row maximum, so
computing everything in fp32 would flip about 5 % of the codes against the unfused path. fp32 division and exp use
the IEEE / libdevice versions torch's CUDA kernels use. Importing this module imports triton.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .quantize import SegmentPlan, amax_bad, seg_warps, segments, store_q


@dataclass(frozen=True)
class TilePlan:
    """How a row kernel tiles a row of n elements (see ``plan_tiles``): up to ``max_single`` elements in registers,
    one pass; longer rows in ``chunk``-wide tiles (a power of 2) with ``chunk_warps`` warps."""
    max_single: int
    chunk: int
    chunk_warps: int


MAX_SINGLE = 8192   # the kernels that only keep a row in registers (residual tails): rows up to this

DT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FLOAT = tuple(DT_CODE)


def fits(k: int) -> bool:
    """Whether a row of k elements runs in the one-pass (register-resident) kernels."""
    return k <= MAX_SINGLE


def plan_tiles(n: int, plan: TilePlan | None = None) -> tuple[int, bool, int]:
    """(BLOCK, SINGLE, num_warps) for a row of n elements: in registers (BLOCK = next power of 2, 4 / 8 / 16
    warps by size) up to ``plan.max_single`` (no plan: MAX_SINGLE, one pass only), else ``plan.chunk``-wide
    chunks with ``plan.chunk_warps`` warps (the later passes re-read the row from L2). Long rows run faster in
    chunks than in one wide register tile on the H200. Chunks give the same codes where the
    row's scale is a max reduction (SwiGLU); a norm's sum of squares then adds in another order (a last-bit change
    of rstd, i.e. rare +-1 code flips against torch)."""
    if n <= (MAX_SINGLE if plan is None else plan.max_single):
        block = triton.next_power_of_2(max(n, 16))
        return block, True, 4 if block <= 2048 else 8 if block <= 4096 else 16
    return plan.chunk, False, plan.chunk_warps


def row_tiles(n: int, one_pass: SegmentPlan | None, plan: TilePlan | None = None) -> tuple[dict, int]:
    """(constexprs, warps) of a row kernel that has both forms, for a row of n elements: the segments of
    ``one_pass`` where they cover n (``S0 > 0``; ``BLOCK`` unused), else ``plan_tiles(n, plan)``'s tile (``S0`` 0).
    ``SINGLE`` (one tile or chunks) is among them for the kernels that chunk, i.e. where ``plan`` is given."""
    segs = segments(n, one_pass)
    if segs is not None:
        tiles, warps, single = dict(BLOCK=0, S0=segs[0], S1=segs[1], S2=segs[2]), seg_warps(segs, one_pass), False
    else:
        block, single, warps = plan_tiles(n, plan)
        tiles = dict(BLOCK=block, S0=0, S1=0, S2=0)
    if plan is not None:
        tiles["SINGLE"] = single
    return tiles, warps


def row_major(t: torch.Tensor, name: str) -> torch.Tensor:
    """Unit stride along the row (the 16-byte vector loads rely on it); copies only when it is not."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def batch_rows(t: torch.Tensor, k: int, m: int, tokens_per_batch: int, name: str, device) -> torch.Tensor:
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
    return row_major(t2, name)


@triton.jit
def round_to(y, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> nearest (ties to even) value of dtype DT (0 fp32, 1 bf16, 2 fp16), returned as fp32."""
    if DT == 1:
        if INTERPRET:
            # NOTE: Triton 3.6's interpreter rounds fp32 -> bf16 by truncation (and its 'rtne' mode neither
            # breaks ties to even nor carries into the exponent), so round on the bits: add 0x7FFF plus the
            # lowest kept bit, drop the low half. NaN stays NaN (its payload could carry into the sign).
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
def swiglu_math(a, b, DT: tl.constexpr, CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """``dt(dt(silu(a)) * b)`` of fp32 values of dtype DT (clamped for fp16 when asked), as fp32: ``kernel.swiglu``'s
    SwiGLU (its epilogue and its quantizer) and ``kernel.hadamard``'s SwiGLU-fed rotation."""
    if INTERPRET:
        e = tl.exp(-a)
    else:
        e = libdevice.exp(-a)  # expf, as torch's CUDA silu
    s = round_to(tl.math.div_rn(a, 1.0 + e), DT, INTERPRET)
    y = round_to(s * b, DT, INTERPRET)
    if CLAMP_FP16:  # comfy.ldm.lumina.model.clamp_fp16: nan_to_num(nan=0, posinf=65504, neginf=-65504)
        y = tl.where(y != y, 0.0, tl.minimum(tl.maximum(y, -65504.0), 65504.0))
    return y


# fp32(sqrt(2 / pi)) and fp32(0.044715): the constants of torch's tanh GELU (ATen's kBeta / kKappa in opmath)
_GELU_BETA = tl.constexpr(0.7978845608028654)
_GELU_KAPPA = tl.constexpr(0.044715)


@triton.jit
def gelu_tanh(h, INTERPRET: tl.constexpr, FAST: tl.constexpr):
    """torch's ``gelu(h, approximate="tanh")`` in fp32, op for op: ``0.5 * h * (1 + tanh(beta * (h + kappa *
    h^3)))``. tanh: libdevice tanhf compiled (torch's CUDA kernel calls tanhf); ``1 - 2 / (exp(2u) + 1)`` in the
    interpreter (no libdevice there; within a few fp32 ulps). FAST: the same function as ``h / (1 + exp(-2u))``
    (= h * sigmoid(2u)), one exp2 and one division instead of tanhf: within a few fp32 ulps of torch's where
    the value matters (torch's ``1 + tanh`` cancels for u < -4, where both are < 1e-3 |h|). ``kernel.gelu``'s
    quantizer and ``kernel.hadamard``'s GELU-fed rotation."""
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
def rsqrt_mean(ssq, K, eps, INTERPRET: tl.constexpr):
    """rsqrt(sum(x^2) / K + eps) as torch computes it: IEEE mean; rsqrtf (libdevice) on the GPU like
    torch's CUDA rms_norm, 1 / sqrt like torch's CPU one in the interpreter."""
    v = tl.math.div_rn(ssq, K * 1.0) + eps
    if INTERPRET:
        return 1.0 / tl.sqrt_rn(v)
    else:
        return libdevice.rsqrt(v)


@triton.jit
def smooth(y, inv_ptr, ks, mask, HAS_SMOOTH: tl.constexpr):
    if HAS_SMOOTH:
        y = y * tl.load(inv_ptr + ks, mask=mask, other=1.0)
    return y


@triton.jit
def row_ptrs(a_ptr, b_ptr, q_ptr, stride_am, stride_bm, stride_qm):
    """This program's row of two inputs and of the int8 output (one program a row)."""
    row = tl.program_id(0).to(tl.int64)
    return a_ptr + row * stride_am, b_ptr + row * stride_bm, q_ptr + row * stride_qm


@triton.jit
def seg_keep(y, like_row, inv_ptr, ks, mask, amax, bad, HAS_SMOOTH: tl.constexpr):
    """A one-pass segment's values ``y`` (fp32) kept in ``like_row``'s dtype (exact: values of it), with the row's
    running |max| (of the smoothed values) and non-finite flag updated."""
    amax, bad = amax_bad(smooth(y, inv_ptr, ks, mask, HAS_SMOOTH), amax, bad)
    return y.to(like_row.dtype.element_ty), amax, bad


@triton.jit
def seg_store(q_row, y, inv_ptr, F, OFF: tl.constexpr, SEG: tl.constexpr, mult, usable,
               HAS_SMOOTH: tl.constexpr, INTERPRET: tl.constexpr):
    """Quantize and store one segment of a one-pass row (``y`` in the model dtype, smoothed here)."""
    ks = OFF + tl.arange(0, SEG)
    mask = ks < F
    store_q(q_row + ks, smooth(y.to(tl.float32), inv_ptr, ks, mask, HAS_SMOOTH), mult, usable, mask, INTERPRET)
