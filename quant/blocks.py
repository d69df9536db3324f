"""The pieces every model's fused blocks are built from (``adapters/<model>/blocks.py``), pure torch + ``kernel``;
no ComfyUI import, and no architecture recognition: the model adapters decide which module of which architecture
becomes which fused module, and build it from the pieces here.

* Kernel calls, eager or as custom ops under torch.compile: ``act_quant`` / ``gemm`` / ``linear`` (the quantizer and
  GEMM a fused_triton ``Int8Linear`` launches), ``gemm_swiglu``, ``norm_modulate_quantize`` (adaLN-modulated RMSNorm
  + per-token quantization, the int8 input of the next GEMM), ``ln_mod_quant`` (the LayerNorm twin, with shift),
  ``cat_gelu_quant`` (tanh GELU + quantization, optionally after a concatenation that is never written),
  ``gated_residual`` (a residual tail ``x + gate * norm2(branch)``, optionally with the next norm + quantization);
  ``call`` launches any kernel wrapper of ``kernels()`` through its prepared launches.
* ``FusedFeedForward``: a SwiGLU FeedForward (``w2(silu(w1 x) * w3 x)``) with w1 and w3 as one int8 GEMM over
  the concatenated weight [2F, K] (identical smoothing only, ``merge_int8``) computing ``silu(a) * b`` in its
  epilogue (``gemm_swiglu``; under torch.compile the GEMM writes [a | b] and ``swiglu_quantize`` quantizes
  silu(a) * b), then quantization feeding w2; the int8 codes are the same either way.
* ``FetchedBlock``: the base of the fused blocks (one fetch of a block's ComfyUI-managed weights a call).
* Structural twins (``rebind``, ``with_layers``): a block's copy with its INT8 layers in place, every other module
  shared; norm weights and eps as ComfyUI's norms apply them (``norm_weight``, ``qk_norm_weights``, ``norm_eps``).
* ``*_ref``: the torch definitions every row kernel of ``kernel`` implements.
Numerics equal the unfused INT8 path within rounding (see kernel/rowtile.py). Only layers on the ``fused_triton``
backend are fused (the kernels are Triton); nothing here branches on tensor values or synchronises with the host.
Every fused module exposes the INT8 layers it holds with ``int8_layers()`` ({name relative to the module:
Int8Linear}, a merged w1+w3 as two row views).
"""
from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernel as _kernel
from ..kernel import config, plan as _PLAN  # torch only: importing them loads no Triton
from . import backends
from .convrot import ConvRotLinear, rotate_quantize
from .linear import Int8Linear, block_fetch, derived
from .quantize import quantize_per_token_ref

log = logging.getLogger("int8_fused")


_KF = None


def kernels():
    """The kernel package with its fused row kernels imported on first use (``kernels().norm``, ``.swiglu`` with
    ``gemm_swiglu``, ``.gelu``, ``.residual``, ``.rope``, ``.rowtile``; they import triton; ``.ops`` holds the custom
    ops and ``tunables()``); then a plain global, which torch.compile reads without tracing an import (the fused
    modules' constructors import it)."""
    global _KF
    if _KF is None:
        from ..kernel import ops
        ops.row_modules()
        _KF = _kernel
    return _KF


# ------------------------------------------------------------------------------------ references (torch)
def _round_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if dtype == torch.float32 else t.to(dtype).float()


def rmsnorm_modulate_quantize_ref(x, norm_weight, eps, scale, tokens_per_batch, inv_smooth=None):
    """The definition ``kernel.norm.rmsnorm_modulate_quantize`` implements: fp32 math with the roundings of
    ``F.rms_norm`` (one, to x.dtype) and of ``normed * scale`` (to the promoted dtype), then
    ``quantize_per_token_ref``."""
    k = x.shape[-1]
    xf = x.float()
    n = _round_to(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float(), x.dtype)
    s = scale.reshape(-1, k)
    rows = torch.arange(x.shape[0], device=x.device) // max(tokens_per_batch, 1)
    s_rows = s.float()[rows if s.shape[0] > 1 else torch.zeros_like(rows)]
    y = _round_to(n * s_rows, torch.promote_types(x.dtype, scale.dtype))
    return quantize_per_token_ref(y, inv_smooth)


def swiglu_ref(a: torch.Tensor, b: torch.Tensor, clamp_fp16: bool = False) -> torch.Tensor:
    """``silu(a) * b`` with torch's roundings (each op rounds to a.dtype), as fp32 values."""
    af = a.float()
    y = _round_to(_round_to(af / (1.0 + torch.exp(-af)), a.dtype) * b.float(), a.dtype)
    if clamp_fp16 and a.dtype == torch.float16:
        y = torch.nan_to_num(y, nan=0.0, posinf=65504.0, neginf=-65504.0)
    return y


def swiglu_quantize_ref(a, b, inv_smooth=None, clamp_fp16=False):
    return quantize_per_token_ref(swiglu_ref(a, b, clamp_fp16), inv_smooth)


def layernorm_modulate_quantize_ref(x, scale, shift, tokens_per_batch, inv_smooth=None, eps=1e-6):
    """The definition ``kernel.norm.layernorm_modulate_quantize`` implements: ``F.layer_norm`` (no affine; fp32
    math, one rounding to x.dtype), ``torch.addcmul(shift, n, 1 + scale)`` (``1 + scale`` rounded to scale's
    dtype, the addcmul in fp32 rounded once to the promoted dtype), then ``quantize_per_token_ref``."""
    k = x.shape[-1]
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    n = _round_to((xf - mean) * torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps), x.dtype)
    rows = torch.arange(x.shape[0], device=x.device) // max(tokens_per_batch, 1)

    def per_row(t):
        t2 = t.reshape(-1, k)
        return t2.float()[rows if t2.shape[0] > 1 else torch.zeros_like(rows)]

    s1 = _round_to(1.0 + per_row(scale), scale.dtype)
    y = _round_to(n * s1 + per_row(shift), torch.promote_types(torch.promote_types(x.dtype, scale.dtype),
                                                                shift.dtype))
    return quantize_per_token_ref(y, inv_smooth)


def gelu_tanh_ref(h: torch.Tensor) -> torch.Tensor:
    """``F.gelu(h, approximate="tanh")`` with torch's rounding (fp32 math, one rounding to h.dtype), as fp32."""
    return _round_to(F.gelu(h.float(), approximate="tanh"), h.dtype)


def gelu_tanh_quantize_ref(h, inv_smooth=None):
    return quantize_per_token_ref(gelu_tanh_ref(h), inv_smooth)


def concat_gelu_quantize_ref(a, h, inv_smooth=None):
    """``quantize_per_token_ref(cat((a, gelu_tanh(h)), -1), inv_smooth)``: what a parallel block (attention and MLP
    side by side) feeds its output projection."""
    return quantize_per_token_ref(torch.cat((a.float(), gelu_tanh_ref(h)), dim=-1), inv_smooth)


# ------------------------------------------------------------------------------------ helpers
def inv_smooth_of(layer, device: torch.device):
    """The layer's 1/smooth on ``device`` (None without smoothing)."""
    return layer.vector_on("inv_smooth", device)


def call(fn, *args):
    """``fn(*args)`` for a kernel wrapper of ``kernel`` / its row-kernel modules that only checks, allocates its outputs and
    launches, through the launches prepared for its argument key (``kernel.plan.call``)."""
    return _PLAN.call(fn, *args, salt=kernels().ops.tunables())


def compiling() -> bool:
    return torch.compiler.is_compiling()


def gemm(a_q, a_s, layer, dtype):
    """``layer``'s int8 GEMM from an already-quantized input (int8 [M, K], fp32 [M]) -> [M, N] in ``dtype``
    (``Int8Linear.gemm_call``: ComfyUI's cast when ComfyUI manages the weights, prepared launches). A LoRA after
    Apply (``quant.lora``) reads the same int8 input: its up-projection is added in the GEMM's epilogue
    (``Int8Linear.gemm_lora_call``), or where that cannot run (torch.compile tracing, a float32 output, a failed
    build: :func:`quant.backends.lora_epilogue_state`) as a small GEMM pair beside it."""
    lora = layer.derived.lora
    if lora is not None and dtype in _LORA_DTYPES and backends.lora_epilogue_on() and not compiling() \
            and not rotation(layer) and a_q.stride(-1) == 1 and a_s.is_contiguous():
        ops = lora.epilogue(a_q.device, dtype, inv_smooth_of(layer, a_q.device))
        if ops is not None:
            try:
                y = layer.gemm_lora_call(a_q, a_s, dtype, *ops)
            except torch.OutOfMemoryError:  # not the kernel's fault: the pair would need the memory too
                raise
            except Exception as e:  # a kernel build that fails on this GPU / Triton: the branch pair instead
                backends.lora_epilogue_failed(e)
            else:
                return lora.add_bias(y)
    if compiling():  # one opaque custom op per kernel for torch.compile (registered in the constructors)
        with layer.operands(a_q.device) as t:
            y = torch.ops.int8_fused.gemm_dequant(a_q, a_s, t.qweight, t.weight_scale, t.bias, dtype)
    else:
        y = layer.gemm_call(a_q, a_s, dtype)
    lora = layer.derived.lora
    if lora is None:
        return y
    if rotation(layer):  # its codes are of the rotated input: never fed here (norm_fusable), said if it were
        raise RuntimeError(f"INT8 layer {layer.name or '?'} is a ConvRot layer with LoRA side branches fed a "
                           "pre-quantized input; load that LoRA BEFORE 'Apply Fused INT8 GEMM'")
    # LoRA after Apply (quant.lora): the low-rank branch reads the same int8 input, added to the output
    return lora.add_quantized(a_q, a_s, y, inv_smooth_of(layer, a_q.device))


_LORA_DTYPES = (torch.bfloat16, torch.float16)


def gemm_swiglu(a_q, a_s, w13, dtype, clamp_fp16=False):
    """``silu(a) * b`` [M, F] of the merged w1+w3 layer's GEMM ([a | b]) from an already-quantized input, the SwiGLU
    computed in the GEMM's epilogue (``kernel.swiglu.gemm_swiglu``)."""
    with w13.operands(a_q.device) as t:
        return call(kernels().swiglu.gemm_swiglu, a_q, a_s, t.qweight, t.weight_scale, t.bias, dtype, clamp_fp16)


def input_quant(layer, x2):
    """(int8, fp32) input of ``layer``'s GEMM from its float input x2 [M, K]: rotated first for a ConvRot layer
    (``quant.convrot.rotate_quantize``), else divided by its smoothing (:func:`act_quant`)."""
    group = rotation(layer)
    return rotate_quantize(x2, group) if group else act_quant(x2, inv_smooth_of(layer, x2.device))


def act_quant(x2, inv_smooth):
    """Per-token int8 quantization of x2 [M, K] (divided by the smoothing first): (int8 [M, K], fp32 [M])."""
    if compiling():
        return torch.ops.int8_fused.act_quant(x2, inv_smooth)
    return call(_kernel.quantize_per_token, x2, inv_smooth)


def linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``; a fused_triton Int8Linear runs as quantize + GEMM here (the same two kernels its backend
    launches) so that torch.compile sees the custom ops instead of the backend registry. A layer with LoRA branches
    runs as quantize + :func:`gemm`, which adds the LoRA from the int8 input as in a fused block (while
    torch.compile traces: its module call, the branch reading the float input ``x``)."""
    if not fusable(layer) or (layer.derived.lora is not None and compiling()):
        return layer(x)
    if layer.derived.lora is None and not compiling():
        return layer.int8_call(x)  # the same two kernels, prepared (Int8Linear.int8_call)
    lead, k = x.shape[:-1], x.shape[-1]
    a_q, a_s = act_quant(x.reshape(-1, k), inv_smooth_of(layer, x.device))
    return gemm(a_q, a_s, layer, x.dtype).reshape(*lead, -1)


def silu_mul(a: torch.Tensor, b: torch.Tensor, clamp_fp16: bool = False) -> torch.Tensor:
    """``silu(a) * b`` in torch (ComfyUI's ``clamp_fp16`` on an fp16 product when asked)."""
    h = F.silu(a) * b
    if clamp_fp16 and h.dtype == torch.float16:
        h = torch.nan_to_num(h, nan=0.0, posinf=65504.0, neginf=-65504.0)
    return h


def swiglu_quant(h13, inv_smooth, clamp_fp16: bool = False, group: int = 0):
    """(int8, fp32) of ``silu(a) * b`` (h13 = [a | b], [M, 2F]) quantized per token: one kernel
    (``swiglu_quantize``). ``group``: the ConvRot group of a rotated layer (:func:`rotation`; no smoothing then),
    whose input the kernel also rotates (``swiglu_hadamard_quantize``)."""
    if group:
        if compiling():  # torch's SwiGLU, then the rotation's custom op
            return rotate_quantize(silu_mul(*h13.chunk(2, dim=-1), clamp_fp16), group)
        return call(kernels().hadamard.swiglu_hadamard_quantize, h13, group, clamp_fp16)
    if compiling():
        return torch.ops.int8_fused.swiglu_quant(h13, inv_smooth, clamp_fp16)
    return call(kernels().swiglu.swiglu_quantize, h13, inv_smooth, clamp_fp16)


def _rms_mod_quant(x2, w, eps, scale, tokens, inv_smooth):
    if compiling():
        return torch.ops.int8_fused.rms_mod_quant(x2, w, eps, scale, tokens, inv_smooth)
    return call(kernels().norm.rmsnorm_modulate_quantize, x2, w, eps, scale, tokens, inv_smooth)


def ln_mod_quant(x2, scale, shift, tokens, inv_smooth, eps, group: int = 0):
    """int8 input of the next GEMM from ``LayerNorm(x2) * (1 + scale) + shift`` (no affine; [M, K], scale / shift
    one row per sample): one kernel (``layernorm_modulate_quantize``). ``group``: the ConvRot group of a rotated
    layer (:func:`rotation`; no smoothing then), whose input the kernel also rotates
    (``layernorm_modulate_hadamard_quantize``)."""
    if group:
        if compiling():  # torch's norm and modulation, then the rotation's custom op
            k = x2.shape[-1]
            nb = max(scale.reshape(-1, k).shape[0], shift.reshape(-1, k).shape[0])
            y = torch.addcmul(shift.reshape(-1, 1, k), F.layer_norm(x2, (k,), eps=eps).reshape(nb, -1, k),
                              1 + scale.reshape(-1, 1, k))
            return rotate_quantize(y.reshape(x2.shape), group)
        return call(kernels().hadamard.layernorm_modulate_hadamard_quantize, x2, scale, shift, tokens, group, eps)
    if compiling():
        return torch.ops.int8_fused.ln_mod_quant(x2, scale, shift, tokens, inv_smooth, eps)
    return call(kernels().norm.layernorm_modulate_quantize, x2, scale, shift, tokens, inv_smooth, eps)


def cat_gelu_quant(a2, h2, inv_smooth, group: int = 0):
    """(int8, fp32) of ``cat(a2, gelu_tanh(h2))`` (``a2`` None: ``gelu_tanh(h2)`` alone). ``group``: the ConvRot
    group of a rotated layer (:func:`act_fusable`; no smoothing then), whose input the kernel also rotates
    (``concat_gelu_hadamard_quantize``)."""
    if group:
        if compiling():  # torch's GELU (and concatenation), then the rotation's custom op
            g = F.gelu(h2, approximate="tanh")
            return rotate_quantize(g if a2 is None else torch.cat((a2, g), dim=-1), group)
        return call(kernels().hadamard.concat_gelu_hadamard_quantize, a2, h2, group)
    if compiling():
        return torch.ops.int8_fused.cat_gelu_quant(a2, h2, inv_smooth)
    if a2 is None:
        return call(kernels().gelu.gelu_tanh_quantize, h2, inv_smooth)
    return call(kernels().gelu.concat_gelu_quantize, a2, h2, inv_smooth)


def promote(*ts: torch.Tensor) -> torch.dtype:
    """The dtype torch promotes ``ts`` to (no ``promote_types`` call where they all have one dtype: the usual case,
    and this runs per block call)."""
    dt = ts[0].dtype
    for t in ts[1:]:
        if t.dtype != dt:
            dt = torch.promote_types(dt, t.dtype)
    return dt


def fusable(layer) -> bool:
    """Whether ``layer`` is an Int8Linear on a backend whose input the kernels feed (its record declares
    ``feeds_fused``: fused_triton); not a ConvRot layer (``quant.convrot``: it rotates its float input itself). A layer
    with LoRA branches this run (``quant.lora``) stays fusable: :func:`gemm` adds its branch from the int8 input."""
    return _fed(layer) and not getattr(layer, "rotation", 0)


def _fed(layer) -> bool:
    """An Int8Linear whose backend takes an already-quantized input (``backends.Backend.feeds_fused``)."""
    return isinstance(layer, Int8Linear) and backends.capabilities(layer.backend).feeds_fused


def rotation(layer) -> int:
    """The ConvRot group size of ``layer`` (``quant.convrot``), 0 for an unrotated layer."""
    return getattr(layer, "rotation", 0) or 0


def norm_fusable(layer) -> bool:
    """:func:`fusable`, or a ConvRot layer on fused_triton without LoRA branches this run, outside torch.compile: a
    block's modulated-norm kernel then rotates its input too (``group`` of :func:`ln_mod_quant` /
    :func:`norm_modulate_quantize`)."""
    return fusable(layer) or (_fed(layer) and rotation(layer) > 0 and layer.derived.lora is None and not compiling())


def act_fusable(layer, ka: int = 0) -> bool:
    """Whether an activation kernel (GELU, SwiGLU) can feed ``layer``: :func:`norm_fusable`, and for a ConvRot layer
    fed by a concatenation whose first part is ``ka`` wide, a group that divides ``ka`` (a group then lies in one
    part)."""
    return norm_fusable(layer) and ka % (rotation(layer) or 1) == 0


def stackable(layers) -> bool:
    """Whether ``layers`` can take one int8 activation from one kernel (one stacked GEMM, or a shared input): all
    :func:`fusable` (unrotated; equal smoothing is the caller's check), or all ConvRot layers of one group size
    (:func:`norm_fusable`)."""
    if all(fusable(m) for m in layers):
        return True
    return all(norm_fusable(m) for m in layers) and len({rotation(m) for m in layers}) == 1


_LAYERS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def lora_active(module: nn.Module) -> bool:
    """Whether an INT8 layer under ``module`` carries LoRA branches this run (``quant.lora``) that cannot read its
    int8 input: a ConvRot layer's (its codes are of the rotated input). A fused block that feeds a layer pre-quantized
    input without a per-layer :func:`norm_fusable` check then runs its per-linear path. Unrotated layers' branches
    run inside the fused block (:func:`gemm`)."""
    ls = _LAYERS.get(module)
    if ls is None:
        ls = _LAYERS[module] = tuple(m for m in module.modules() if isinstance(m, Int8Linear))
    return any(m.derived.lora is not None and rotation(m) for m in ls)


_SMALL: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def norm_weight(norm: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The RMSNorm's weight on x's device in x's dtype (what ComfyUI's casting RMSNorm hands F.rms_norm), or
    None when weight functions (lowvram LoRA) must run: then the caller uses the module itself.

    ComfyUI keeps such tiny weights (< 16 KiB) outside DynamicVRAM's vbar and may leave them on the CPU
    (restored backups); its own RMSNorm then copies them on every call. Here one device copy per norm is
    kept and remade only when ComfyUI swaps the tensor (a few KiB per norm)."""
    if getattr(norm, "weight_function", None) or getattr(norm, "bias_function", None):
        return None
    w = norm.weight
    if w is None:
        return torch.ones(x.shape[-1], device=x.device, dtype=x.dtype)
    return _small_param(norm, "weight", w, x)


def norm_bias(norm: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """A LayerNorm's bias like :func:`norm_weight` its weight (None: no bias; callers check weight functions
    through :func:`norm_weight` first)."""
    b = getattr(norm, "bias", None)
    return None if b is None else _small_param(norm, "bias", b, x)


def _small_param(norm: nn.Module, name: str, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if t.device == x.device and t.dtype == x.dtype:
        return t
    return derived(_SMALL.setdefault(norm, {}), (name, x.device, x.dtype), t,
                   lambda v: v.detach().to(x.device, x.dtype))


def rms(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for a ComfyUI RMSNorm, with its weight from :func:`norm_weight` (same F.rms_norm call)."""
    w = norm_weight(norm, x) if getattr(norm, "weight", None) is not None else None
    if w is None or not hasattr(norm, "normalized_shape"):
        return norm(x)
    return F.rms_norm(x, norm.normalized_shape, w, norm.eps)


def rope_rows(freqs: torch.Tensor, b: int, l: int, d: int, device, at_least: bool = False):
    """ComfyUI's per-token RoPE rotations ``freqs`` [B | 1, L, 1, D/2, 2, 2] fp32 as the QK kernel's ``pe``
    [B | 1, 1, L, D/2, 2, 2] (a view), or None when they are not that for a batch of ``b``, ``l`` tokens
    (``at_least``: L >= l) and a power-of-2 head_dim ``d``: the caller then runs ComfyUI's ops."""
    if (not isinstance(freqs, torch.Tensor) or freqs.dim() != 6 or freqs.dtype != torch.float32
            or freqs.shape[0] not in (1, b) or freqs.shape[2] != 1 or tuple(freqs.shape[3:]) != (d // 2, 2, 2)
            or d < 2 or d & (d - 1) or freqs.device != device
            or (freqs.shape[1] < l if at_least else freqs.shape[1] != l)):
        return None
    return freqs.transpose(1, 2)


def rms_weight(norm: nn.Module, x: torch.Tensor):
    """(weight in x's dtype on x's device, eps) of a QK RMSNorm as its forward applies them: ComfyUI's
    ``ops.RMSNorm`` (0.33.0: ``weight``, ``eps``) or 0.3.75's ``RMSNorm`` with a ``scale`` (eps 1e-6 in its
    forward); (None, None) for anything else (weight functions included): the caller runs the module."""
    if "weight" in norm._parameters:
        return norm_weight(norm, x), norm_eps(norm, x)
    s = norm._parameters.get("scale")
    if s is None or getattr(norm, "weight_function", None):
        return None, None
    return (s if s.device == x.device and s.dtype == x.dtype else s.detach().to(x.device, x.dtype)), 1e-6


def qk_norm_weights(norm_q: nn.Module, norm_k: nn.Module, x: torch.Tensor, width: int):
    """(wq, eps_q, wk, eps_k) of two RMSNorms with a weight over ``width`` (ComfyUI's ``ops.RMSNorm``), as their
    forwards apply them; None when either is something else (Identity: no QK norm) or carries weight functions."""
    for nm in (norm_q, norm_k):
        if "weight" not in nm._parameters or tuple(getattr(nm, "normalized_shape", ())) != (width,):
            return None
    (wq, eq), (wk, ek) = rms_weight(norm_q, x), rms_weight(norm_k, x)
    return None if wq is None or wk is None else (wq, eq, wk, ek)


def attn_patches(transformer_options) -> bool:
    """Whether the call carries self-attention patches (``attn1_patch`` / ``attn1_output_patch``, applied by current
    ComfyUI's block forwards, ignored by 0.3.75's): such calls run the block's own forward."""
    p = transformer_options.get("patches") if isinstance(transformer_options, dict) else None
    return bool(p) and ("attn1_patch" in p or "attn1_output_patch" in p)


def residual_operands(x: torch.Tensor, *ts: torch.Tensor) -> bool:
    """Whether the residual-tail kernels take these operands: not under torch.compile, x [B, L, K] with rows that
    fit in registers, each other operand of x's dtype and device (torch would promote a mixed one) and either x's
    shape or one modulation row per sample ([B | 1, 1, K]). The callers add their switch."""
    if compiling() or x.dim() != 3 or not kernels().rowtile.fits(x.shape[-1]):
        return False
    b, _, k = x.shape
    return all(t.dtype == x.dtype and t.device == x.device and (
        t.shape == x.shape or (t.dim() == 3 and t.shape[1] == 1 and t.shape[0] in (1, b) and t.shape[2] == k))
        for t in ts)


def norm_eps(norm: nn.Module, x: torch.Tensor) -> float:
    """The eps the norm's forward uses. ``eps=None`` (torch.nn.RMSNorm's default, which ComfyUI's ops.RMSNorm
    keeps unless told): F.rms_norm then takes the epsilon of its fp32 compute type for bf16 / fp16 / fp32
    inputs (fp64's for fp64), not the input dtype's (which is 65536x larger for bf16)."""
    eps = getattr(norm, "eps", None)
    if eps is not None:
        return float(eps)
    return torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps


def adaln_chunks(mod: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(1 + scale_msa, tanh(gate_msa), 1 + scale_mlp, tanh(gate_mlp)) of an adaLN modulation ``mod`` [..., 4 K]
    holding scale_msa, gate_msa, scale_mlp, gate_mlp along its last dim (``mod.chunk(4, -1)``), each [..., K]:
    two launches (both 1 + s, both tanh, on strided views) where the blocks' code issues four, each element as
    torch's own op computes it. The results are views of [..., 2, K] tensors (unit last stride)."""
    m4 = mod.unflatten(-1, (4, -1))
    s, g = 1.0 + m4[..., 0::2, :], torch.tanh(m4[..., 1::2, :])
    return s[..., 0, :], g[..., 0, :], s[..., 1, :], g[..., 1, :]


def norm_modulate_quantize(norm: nn.Module, x2: torch.Tensor, scale: torch.Tensor, tokens: int,
                           inv_smooth: torch.Tensor | None, group: int = 0):
    """int8 input of the next GEMM from ``norm(x2) * scale`` ([M, K], scale [B, K]): one kernel, or the
    module + kernel quantizer when the norm carries weight functions. ``group``: the ConvRot group of a rotated
    next layer (no smoothing then), whose input the kernel also rotates."""
    w = norm_weight(norm, x2)
    if w is None or (group and compiling()):
        y = norm(x2).reshape(-1, tokens, x2.shape[-1]) * scale.reshape(-1, 1, x2.shape[-1])
        return rotate_quantize(y.reshape(x2.shape), group) if group else act_quant(y.reshape(x2.shape), inv_smooth)
    if group:
        return call(kernels().hadamard.rmsnorm_modulate_hadamard_quantize, x2, w, norm_eps(norm, x2), scale, tokens,
                    group)
    return _rms_mod_quant(x2, w, norm_eps(norm, x2), scale, tokens, inv_smooth)


# The residual-tail kernel (gated_residual_rmsnorm) is built without FMA contraction: with it, the compiler fuses
# gate * norm(o) into the add and y's elements differ from torch's; without, they differ only by torch's own
# reduction order for mean(o^2).


def residual_then_quant(x, o, norm, gate, tokens, nxt, next_scale, layer):
    """(x + gate * norm(o) [B, L, K], int8, fp32): the residual tail of an RMSNorm block and the int8 input
    ``nxt(y) * next_scale`` of ``layer``'s GEMM, in one kernel (:func:`gated_residual`), or for a ConvRot ``layer``
    the tail's kernel then the rotating norm kernel (:func:`norm_modulate_quantize`); torch where a kernel cannot
    run. ``gate`` / ``next_scale``: [B, K] rows (tanh(g), 1 + s)."""
    b, l, k = x.shape
    group, inv = rotation(layer), inv_smooth_of(layer, x.device)
    tail = gated_residual(x.reshape(-1, k), o.reshape(-1, k), norm, gate, tokens,
                          *((nxt, next_scale, inv) if not group else ()))
    if tail is None:
        y = x + gate.reshape(b, 1, k) * rms(norm, o.reshape(b, l, -1))
    elif not group:
        return tail[0].view(b, l, k), tail[1], tail[2]
    else:
        y = tail[0].view(b, l, k)
    return (y, *norm_modulate_quantize(nxt, y.reshape(-1, k), next_scale, tokens, inv, group))


def gated_residual(x2, o2, norm, gate, tokens, nxt=None, next_scale=None, inv_smooth=None):
    """(y [M, K], int8 | None, fp32 | None): ``x + gate * norm(o)`` and, with ``nxt`` (the next RMSNorm),
    the int8 input ``nxt(y) * next_scale`` of the next GEMM; None when a norm needs its module (weight
    functions) or the row is too long for the one-pass kernel: the caller then runs torch."""
    k = x2.shape[-1]
    wn = norm_weight(norm, o2)
    w2 = norm_weight(nxt, x2) if nxt is not None else None
    if wn is None or (nxt is not None and w2 is None) or k > kernels().rowtile.MAX_SINGLE:
        return None
    eps, eps2 = norm_eps(norm, o2), (norm_eps(nxt, x2) if nxt is not None else 0.0)
    if compiling():
        y, q, s = torch.ops.int8_fused.gated_residual(x2, o2, wn, eps, gate, tokens, w2, eps2, next_scale,
                                                      inv_smooth)
        return y, (q if nxt is not None else None), (s if nxt is not None else None)
    return call(kernels().residual.gated_residual_rmsnorm, x2, o2, wn, eps, gate, tokens, w2, eps2, next_scale, inv_smooth)


def merge_int8(first: Int8Linear, second: Int8Linear, name: str = "") -> Int8Linear:
    """One Int8Linear computing [first(x), second(x)] (weights stacked along N; a ConvRotLinear for two ConvRot
    layers of one group size). Both must read the same activation: equal K, identical smoothing and rotation
    (checked once here, at patch time)."""
    if first.in_features != second.in_features:
        raise ValueError(f"{name}: cannot merge layers with K={first.in_features} and K={second.in_features}")
    group = rotation(first)
    if rotation(second) != group:
        raise ValueError(f"{name}: the layers are ConvRot-rotated differently (group sizes {group or 'none'} and "
                         f"{rotation(second) or 'none'}), so their activations differ; they stay separate")
    s1, s2 = first.smooth, second.smooth
    if (s1 is None) != (s2 is None) or (s1 is not None and not torch.equal(s1.cpu(), s2.cpu())):
        raise ValueError(f"{name}: w1 and w3 have different SmoothQuant vectors, so their activations differ; "
                         "calibrate them with a shared vector to merge them")
    if (first.bias is None) != (second.bias is None):
        raise ValueError(f"{name}: one of the two layers has a bias and the other not")
    dev = first.qweight.device
    merged = Int8Linear.from_quantized(
        torch.cat([first.qweight, second.qweight.to(dev)]),
        torch.cat([first.weight_scale, second.weight_scale.to(dev)]),
        None if first.bias is None else torch.cat([first.bias, second.bias.to(dev)]),
        None if s1 is None else s1.clone(), backend=first.backend, name=name)
    return ConvRotLinear.of(merged, group) if group else merged


# ------------------------------------------------------------------------------------ structural twins
def rebind(module: nn.Module, children: dict[str, nn.Module]) -> nn.Module:
    """A new instance of ``module``'s class with its plain attributes, parameters and buffers (shared tensors) and
    its child modules, the ones named in ``children`` replaced. ``module`` itself is not modified."""
    new = type(module).__new__(type(module))
    nn.Module.__init__(new)
    for k, v in module.__dict__.items():
        if not k.startswith("_"):
            new.__dict__[k] = v
    for k, p in module._parameters.items():
        new._parameters[k] = p
    for k, b in module._buffers.items():
        new._buffers[k] = b
    new._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    for k, m in module._modules.items():
        new._modules[k] = children.get(k, m)
    return new


def with_layers(module: nn.Module, prefix: str, layers: dict) -> nn.Module:
    """``module`` (named ``prefix``) with each descendant named in ``layers`` replaced by that layer; ``module``
    itself when ``layers`` names none of them, else a :func:`rebind` copy (recursively)."""
    if prefix in layers:
        return layers[prefix]
    p = f"{prefix}."
    if not any(n.startswith(p) for n in layers):
        return module
    return rebind(module, {k: with_layers(m, p + k, layers) for k, m in module._modules.items() if m is not None})


# ------------------------------------------------------------------------------------ modules
class FetchedBlock(nn.Module):
    """Base of the fused blocks: when ComfyUI manages the block's weights (DynamicVRAM), one call fetches all
    of them before the forward and releases them after it (``quant.linear.set_block_fetch``, installed by
    nodes/comfy_cast.py), so that each layer's own fetch inside finds its weights already fetched and skips
    the per-layer stream synchronisation and vbar fault. The same weights, the same kernels: only host time
    changes. Without ComfyUI a plain module call."""

    def __call__(self, *args, **kwargs):
        fetch, release = block_fetch(), None
        if fetch is not None and not compiling():
            x = args[0] if args else next(iter(kwargs.values()), None)
            release = fetch(self, x.device) if isinstance(x, torch.Tensor) else None
        if release is None:
            return super().__call__(*args, **kwargs)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            release()


class FusedFeedForward(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` with w1+w3 as one int8 GEMM and SwiGLU fused with w2's quantization.

    ``w13``: merged Int8Linear [2F, K] (w1 rows first; a ConvRotLinear where w1 and w3 are ConvRot layers of one
    group: their input is rotated); ``w2``: an Int8Linear on fused_triton (input from ``swiglu_quantize``) or any
    module (kept float or protected: then ``silu * b`` runs in torch). A ConvRot w2 takes its input from the
    SwiGLU GEMM's epilogue and the rotate + quantize kernel.
    ``clamp_fp16``: ComfyUI's ``clamp_fp16`` on the SwiGLU product (current ComfyUI; fp16 only)."""

    def __init__(self, w13: Int8Linear, w2: nn.Module, clamp_fp16: bool = False, covers=()):
        super().__init__()
        self.w13, self.w2 = w13, w2
        self.clamp_fp16 = clamp_fp16
        kernels().register_ops()
        self.covers = tuple(covers)

    @classmethod
    def build(cls, name: str, ff: nn.Module, int8_layers: dict, clamp_fp16: bool = False):
        """The fused replacement of the SwiGLU FeedForward ``ff`` (attributes w1, w2, w3) named ``name``, or None
        (one log line saying why) unless ``int8_layers`` puts w1 and w3 on fused_triton with equal smoothing.
        w2 is taken from ``int8_layers`` when there, else ``ff.w2`` (kept float)."""
        p = f"{name}." if name else ""
        w1, w3 = int8_layers.get(p + "w1"), int8_layers.get(p + "w3")
        if not stackable((w1, w3)):
            return None
        try:
            w13 = merge_int8(w1, w3, name=f"{p}w1+w3")
        except ValueError as e:
            log.info("INT8 fusion: %s stays unfused: %s", name, e)
            return None
        w2 = int8_layers.get(p + "w2", ff.w2)
        covers = [f"{p}w1", f"{p}w3"] + ([f"{p}w2"] if isinstance(w2, Int8Linear) else [])
        return cls(w13, w2, clamp_fp16, covers)

    def int8_layers(self) -> dict[str, Int8Linear]:
        """{"w1", "w3" (row views of the merged GEMM), "w2" (when INT8): Int8Linear}."""
        n1 = self.w13.out_features // 2
        out = {"w1": self.w13.rows(0, n1, "w1"), "w3": self.w13.rows(n1, self.w13.out_features, "w3")}
        if isinstance(self.w2, Int8Linear):
            out["w2"] = self.w2
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if lora_active(self):  # per linear, each layer's module call adding its LoRA branch (quant.lora)
            return self.w2(silu_mul(*self.w13(x).chunk(2, dim=-1), self.clamp_fp16))
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        a_q, a_s = input_quant(self.w13, x2)
        return self.forward_quantized(a_q, a_s, x.dtype).reshape(*lead, -1)

    def forward_quantized(self, a_q: torch.Tensor, a_s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """From the already-quantized input (int8 [M, K], fp32 [M]) -> [M, dim] in ``dtype``."""
        if act_fusable(self.w2) and not compiling() and self.w13.derived.lora is None:
            # [M, F] from the GEMM's epilogue, then quantized for w2 (rotated first for a ConvRot w2); a LoRA on
            # w1 / w3 has to reach [a | b] before the SwiGLU: the GEMM then writes [a | b] (below)
            h = gemm_swiglu(a_q, a_s, self.w13, dtype, self.clamp_fp16)
            return gemm(*input_quant(self.w2, h), self.w2, dtype)
        h13 = gemm(a_q, a_s, self.w13, dtype)
        if fusable(self.w2):
            q, s = swiglu_quant(h13, inv_smooth_of(self.w2, a_q.device), self.clamp_fp16)
            return gemm(q, s, self.w2, dtype)
        return linear(self.w2, silu_mul(*h13.chunk(2, dim=-1), self.clamp_fp16))

    def extra_repr(self) -> str:
        return f"clamp_fp16={self.clamp_fp16}, covers={list(self.covers)}"
