"""The W8A8 linear and GEMM entry points the package ``kernel`` re-exports: per-token activation quantization
(``quantize_per_token``), the fused dequant GEMM (``int8_gemm``), the linear (``int8_linear``: quantize, then GEMM;
for M <= ``SMALL_M_ROWS`` one launch) and their prepared forms (``int8_linear_planned`` / ``int8_gemm_planned``).

Torch only at import: the Triton kernels (``kernel.quantize``, ``kernel.gemm``) load on the first launch.
"""
from __future__ import annotations

import torch

from .checks import FLOAT_IN, check_2d, check_usable, gemm_operands, lora_operands, small_m_operands, smooth_vector

_MODS: dict[str, object] = {}  # kernel modules, imported (with triton) on the first launch


def _mod(name: str):
    mod = _MODS.get(name)
    if mod is None:
        if name == "gemm":
            from . import gemm as mod
        elif name == "lora":
            from . import lora as mod
        else:
            from . import quantize as mod
        _MODS[name] = mod
    return mod


def quantize_per_token(x: torch.Tensor, inv_smooth: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] bf16/fp16/fp32 (any strides) -> (int8 [M, K] contiguous, fp32 scale [M]).

    scale = max|x * inv_smooth| / 127 per row; q = clamp(rint(x * inv_smooth * 127 / absmax), +-127), half to
    even; all-zero rows -> scale 0, zeros; rows with NaN/Inf -> scale NaN, zeros. Bit-exact with
    ``quant.quantize.quantize_per_token_ref``."""
    check_2d(x, "x", FLOAT_IN, "pass activations as [tokens, K] in bf16, fp16 or fp32")
    m, k = x.shape
    inv_smooth = smooth_vector(inv_smooth, k, x.device)
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    check_usable(x, "quantize_per_token")
    _mod("quantize").launch_quantize_per_token(x, inv_smooth, q, scale)
    return q, scale


def int8_gemm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              out_int32: bool = False, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """A_q int8 [M, K] x W_q int8 [N, K] (nn.Linear layout) -> [M, N].

    ``out_int32``: the exact int32 accumulator ``A_q @ W_q.T``. Otherwise
    ``acc * a_scale[m] * w_scale[n] + bias[n]`` in fp32, stored as ``out_dtype`` (bf16, fp16, fp32).
    Any M, N, K (tails masked) and any strides. Scales are fp32 [M] / [N] (other float dtypes are upcast
    exactly; a 1-entry w_scale is a per-tensor scale); bias is [N] in any float dtype. ``out`` (optional):
    a preallocated [M, N] result of the output dtype, e.g. to check that every element is written."""
    a_scale, w_scale, bias = gemm_operands(a_q, a_scale, w_q, w_scale, bias, out_dtype, out_int32)
    m, k = a_q.shape
    n = w_q.shape[0]
    dtype = torch.int32 if out_int32 else out_dtype
    if out is None:
        out = torch.empty((m, n), dtype=dtype, device=a_q.device)
    elif out.shape != (m, n) or out.dtype != dtype or out.device != a_q.device:
        raise ValueError(f"out must be [{m}, {n}] {dtype} on {a_q.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    if m == 0 or n == 0:
        return out
    if k == 0:  # empty sum: acc = 0 (scales still propagate NaN rows)
        acc = torch.zeros((m, n), dtype=torch.float32, device=a_q.device)
        res = acc if out_int32 else acc * a_scale[:, None] * w_scale[None, :]
        if bias is not None and not out_int32:
            res = res + bias.float()[None, :]
        return out.copy_(res)
    check_usable(a_q, "int8_gemm")
    gemm = _mod("gemm")
    cfg = gemm.select_config(a_q, a_scale, w_q, w_scale, bias, out)
    return gemm.launch_int8_gemm(a_q, a_scale, w_q, w_scale, bias, out, cfg)


def int8_gemm_lora(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, lora_down: torch.Tensor, lora_up: torch.Tensor,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``int8_gemm`` plus a LoRA from the same int8 input, in two launches: ``h = (a_q @ lora_down.T) * a_scale``
    (``kernel.lora``; [M, R] in the LoRA's dtype, the sum in fp32), then the GEMM with ``h @ lora_up.T`` added in its
    epilogue in fp32 before the one rounding to ``out_dtype``. ``lora_down`` [R, K], ``lora_up`` [N, R] (scales
    folded in): contiguous, both bf16 or both fp16 (any float ``out_dtype``), R a multiple of
    ``kernel.checks.LORA_CHUNK`` (zero-padded).
    Against ``int8_gemm`` + a float ``addmm`` of the same h: the output is rounded once instead of twice."""
    return _int8_gemm_lora(a_q, a_scale, w_q, w_scale, bias, lora_down, lora_up, out_dtype)[0]


def _int8_gemm_lora(a_q, a_scale, w_q, w_scale, bias, lora_down, lora_up, out_dtype):
    """``int8_gemm_lora``: (out, the temporaries it allocated before out)."""
    a_scale, w_scale, bias = gemm_operands(a_q, a_scale, w_q, w_scale, bias, out_dtype)
    m, k = a_q.shape
    n = w_q.shape[0]
    lora_operands(a_q, a_scale, lora_down, lora_up, n, out_dtype)
    if m == 0 or n == 0 or k == 0:
        return int8_gemm(a_q, a_scale, w_q, w_scale, bias, out_dtype=out_dtype), ()  # no LoRA term: h is 0
    check_usable(a_q, "int8_gemm_lora")
    h = torch.empty((m, lora_down.shape[0]), dtype=lora_down.dtype, device=a_q.device)
    _mod("lora").launch_lora_down(a_q, a_scale, lora_down, h)
    out = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    gemm = _mod("gemm")
    cfg = gemm.select_config(a_q, a_scale, w_q, w_scale, bias, out)
    gemm.launch_int8_gemm(a_q, a_scale, w_q, w_scale, bias, out, cfg, lora=(h, lora_up))
    return out, (h,)


def int8_gemm_lora_planned(a_q, a_scale, w_q, w_scale, bias, lora_down, lora_up, out_dtype=torch.bfloat16):
    """``int8_gemm_lora(...)`` and a ``kernel.plan.Plan`` repeating it:
    ``plan(a_q, a_scale, w_q, w_scale, bias, lora_down, lora_up)``."""
    from . import launch, plan
    with launch.record() as rec:
        out, temps = _int8_gemm_lora(a_q, a_scale, w_q, w_scale, bias, lora_down, lora_up, out_dtype)
    return out, plan.build(rec, (a_q, a_scale, w_q, w_scale, bias, lora_down, lora_up), (*temps, out), out,
                           out.device)


SMALL_M_ROWS = 16             # rows up to here run the one-launch kernel (adaLN / time-embedding GEMVs)
SMALL_M_MAX_K = 16384         # ... when K is at most this: every program re-reads its rows' K (from L2)
# Under TRITON_INTERPRET=1 (CPU tensors: the tests, the CPU demo) the one-launch kernel takes up to this many rows:
# its bits are quantize_per_token + int8_gemm's (tests/test_dispatch.py checks both routes up to 150 rows), and the
# interpreter runs it as a few large-tile programs, where the per-token quantizer is a program a row (half of a tiny
# model's interpreted time). The kernel tests set it to SMALL_M_ROWS to run the GPU's two launches. Module data.
INTERPRETER_ONE_LAUNCH_ROWS = 1024


def int8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                inv_smooth: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """W8A8 linear: x [..., K] float -> quantize_per_token -> int8_gemm -> [..., N] in ``out_dtype``
    (default x.dtype). Two launches; the activation is read once and written once as int8. With at most
    ``SMALL_M_ROWS`` rows (under the interpreter ``INTERPRETER_ONE_LAUNCH_ROWS``) and K <= ``SMALL_M_MAX_K`` one
    launch that quantizes inside the GEMM, bit-identical."""
    return _int8_linear(x, w_q, w_scale, bias, inv_smooth, out_dtype)[0]


def _int8_linear(x, w_q, w_scale, bias, inv_smooth, out_dtype):
    """``int8_linear``: (y, x as the kernels saw it, the tensors it allocated, y before the reshape)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a tensor [..., K]")
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    if 0 < m <= (SMALL_M_ROWS if x2.is_cuda else INTERPRETER_ONE_LAUNCH_ROWS) and 0 < k <= SMALL_M_MAX_K:
        y = _linear_small_m(x2, w_q, w_scale, bias, inv_smooth, out_dtype or x.dtype)
        temps = ()
    else:
        a_q, a_scale = quantize_per_token(x2, inv_smooth)
        y = int8_gemm(a_q, a_scale, w_q, w_scale, bias, out_dtype=out_dtype or x.dtype)
        temps = (a_q, a_scale)
    return (y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])), x2, temps, y


def int8_linear_planned(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None = None, inv_smooth: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None):
    """``int8_linear(...)`` and a ``kernel.plan.Plan`` that repeats it for operands of the same signature:
    ``plan(x, w_q, w_scale, bias, inv_smooth)`` (same order; None when the call cannot be repeated that way)."""
    from . import launch, plan
    with launch.record() as rec:
        y, x2, temps, y2 = _int8_linear(x, w_q, w_scale, bias, inv_smooth, out_dtype)
    p = plan.build(rec, ((x, x2), w_q, w_scale, bias, inv_smooth), (*temps, (y2, y.shape)), y2, y.device)
    return y, p


def int8_gemm_planned(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16):
    """``int8_gemm(...)`` and a ``kernel.plan.Plan`` that repeats it: ``plan(a_q, a_scale, w_q, w_scale, bias)``."""
    from . import launch, plan
    with launch.record() as rec:
        out = int8_gemm(a_q, a_scale, w_q, w_scale, bias, out_dtype=out_dtype)
    return out, plan.build(rec, (a_q, a_scale, w_q, w_scale, bias), (out,), out, out.device)


def _linear_small_m(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                    inv_smooth: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``int8_linear`` for 1..SMALL_M_ROWS rows in one launch (kernel/gemm.py ``_w8a8_small_m_kernel``), with the
    checks of quantize_per_token and int8_gemm."""
    inv_smooth, w_scale, bias = small_m_operands(x, w_q, w_scale, bias, inv_smooth, out_dtype)
    m, n = x.shape[0], w_q.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if n == 0:
        return out
    check_usable(x, "int8_linear")
    gemm = _mod("gemm")
    cfg = gemm.select_small_m_config(x, inv_smooth, w_q, w_scale, bias, out)
    return gemm.launch_w8a8_small_m(x, inv_smooth, w_q, w_scale, bias, out, cfg)
