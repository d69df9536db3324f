"""The backend registry: every way this pack can run an INT8 linear, with declared constraints.

Each backend has one signature, ``linear(x2d, layer) -> y2d``: ``x2d`` is [M, K] float activations,
``layer`` an :class:`quant.linear.Int8Linear` (or its fetched operands; nothing here imports it), ``y2d`` [M, N] in ``x2d.dtype``. Whether a backend can
run is decided once per layer at patch time (``resolve``), never on every call; a layer a backend
cannot take goes to the backend's stated fallback with one log line for the whole model.

What a backend can do besides ``linear`` its record declares (:class:`Backend`: ``per_shape_dispatch`` with its
``dispatch_int8`` path, ``feeds_fused``, ``pad_elision_by_default``, ``quantizes``), as comfy-kitchen's backends
declare their constraints: the layer, dispatch, the fused blocks, ConvRot and the nodes ask the record
(:func:`capabilities`), never compare a backend's name (``tests/test_structure.py`` scans for such comparisons).

Backends:
  fused_triton   this pack's Triton kernels: per-token quantization, int8 x int8 -> int32 tensor-core
                 GEMM, dequantization and bias in the epilogue (CUDA, compute capability >= 8.0).
  torch_int_mm   torch's quantization ops + ``torch._int_mm`` (cuBLASLt int8) + torch dequantization.
  dequant_bf16   the common "production INT8" path: quantize, dequantize to the compute dtype, float
                 matmul. Slow on purpose; it is the baseline and the always-available fallback.
  fp8_rowwise    FP8 e4m3 with per-row/per-channel scales through ``torch._scaled_mm`` (compute
                 capability >= 8.9); it runs from the INT8 weights dequantized and requantized to FP8.
  comfy_kitchen  ``comfy_kitchen.int8_linear`` (ComfyUI's own kernel library: per-row activation
                 quantization, int8 GEMM, fused dequantization and bias) when that package is importable
                 and accepts per-channel weight scales on the device (checked once, numerically).
  bf16           the unquantized model: the control. It never quantizes a layer.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch
import torch.nn.functional as F

from .. import kernel as _kernel
from ..kernel import config
from .quantize import dequantize, quantize_per_token_ref, quantize_weight_per_channel

log = logging.getLogger("int8_fused")


@dataclasses.dataclass(frozen=True)
class Backend:
    """A way to run an INT8 linear. ``device_reason``/``shape_reason`` return None when it can run.

    What it can do, which callers ask instead of its name:

    ``quantizes``             False for the unquantized control (``bf16``): Apply passes the model through.
    ``dispatch_int8``         per-shape dispatch (``quant.dispatch``): each call shape of a layer runs the INT8 path
                              or a float ``F.linear`` on the dequantized weight, whichever is faster. This is the
                              INT8 side, ``(x2d, layer) -> y2d``; eager calls go through the layer's prepared
                              launches (``run_int8`` of an ``Int8Linear`` or of its fetched operands). None: every
                              call runs ``linear`` (``per_shape_dispatch`` is False).
    ``feeds_fused``           the pack's kernels may hand its layers an already-quantized input
                              (``Int8Linear.gemm_call``): the fused blocks' norm / activation kernels, ConvRot's
                              rotate + quantize (``quant.blocks.fusable``, ``quant.convrot``).
    ``pad_elision_by_default`` ``INT8_FUSED_PAD_ELISION`` unset / ``auto`` drops padded text tokens on this backend
                              (``adapters.pad_elision_enabled``).
    """
    name: str
    description: str
    device_reason: Callable[[torch.device], str | None]
    shape_reason: Callable[[int, int], str | None]
    linear: Callable | None  # (x2d, layer) -> y2d; None for the bf16 control (no quantization)
    fallback: str | None = "dequant_bf16"
    quantizes: bool = True
    dispatch_int8: Callable | None = None
    feeds_fused: bool = False
    pad_elision_by_default: bool = False

    @property
    def per_shape_dispatch(self) -> bool:
        """Whether its layers' calls are dispatched per shape between INT8 and float (``dispatch_int8``)."""
        return self.dispatch_int8 is not None


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


# --------------------------------------------------------------------------- per-backend math
def _quantize_act(x2d: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_token_ref(x2d, layer.inv_smooth)


def _dequant_bf16_linear(x2d: torch.Tensor, layer) -> torch.Tensor:
    a_q, a_s = _quantize_act(x2d, layer)
    dt = x2d.dtype
    a = dequantize(a_q, a_s).to(dt)
    w = dequantize(layer.qweight, layer.weight_scale).to(dt)
    return F.linear(a, w, None if layer.bias is None else layer.bias.to(dt))


def _torch_int_mm_linear(x2d: torch.Tensor, layer) -> torch.Tensor:
    a_q, a_s = _quantize_act(x2d, layer)
    M = a_q.shape[0]
    if M <= 16:  # torch._int_mm's CUDA rule is M > 16: pad with zero rows (exact), slice after
        a_q = torch.cat([a_q, a_q.new_zeros(17 - M, a_q.shape[1])])
    acc = torch._int_mm(a_q, layer.qweight.t())[:M]
    y = acc.float() * a_s[:, None] * layer.weight_scale[None, :]
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.to(x2d.dtype)


def _int_mm_shape(N: int, K: int) -> str | None:
    if K % 8 or N % 8:
        return f"torch._int_mm needs N and K divisible by 8 (got N={N}, K={K})"
    return None


def _fused_triton_linear(x2d: torch.Tensor, layer) -> torch.Tensor:
    k = _kernel  # the package imports no Triton; its kernels do, on their first call
    if torch.compiler.is_compiling():  # one opaque custom op (fake impl for shapes): no graph break
        return k.int8_linear_op(x2d, layer.qweight, layer.weight_scale, layer.bias, layer.inv_smooth)
    return k.int8_linear(x2d, layer.qweight, layer.weight_scale, layer.bias, layer.inv_smooth,
                         out_dtype=x2d.dtype)


def _fused_triton_dispatch_int8(x2d: torch.Tensor, layer) -> torch.Tensor:
    """fused_triton's INT8 side of per-shape dispatch: its kernels through the layer's prepared launches
    (``run_int8`` of an Int8Linear or of its fetched operands); while torch.compile traces, the custom op."""
    if torch.compiler.is_compiling():
        return _fused_triton_linear(x2d, layer)
    return layer.run_int8(x2d)


def _comfy_kitchen_linear(x2d: torch.Tensor, layer) -> torch.Tensor:
    import comfy_kitchen as ck
    if layer.inv_smooth is not None:  # kitchen has no smoothing input: divide in fp32, then round once
        x2d = (x2d.float() * layer.inv_smooth[None, :]).to(x2d.dtype)
    return ck.int8_linear(x2d, layer.qweight, layer.weight_scale, layer.bias, out_dtype=x2d.dtype)


_KITCHEN_OK: dict[tuple, str | None] = {}


def _comfy_kitchen_device(device: torch.device) -> str | None:
    """Importable, and on ``device`` its int8_linear matches the reference with per-channel scales.

    The probe runs once per device (a 32x64x48 problem): kitchen versions differ in the weight-scale
    shapes they take, and a silently wrong scale would be worse than not offering the backend."""
    key = (device.type, device.index)
    if key in _KITCHEN_OK:
        return _KITCHEN_OK[key]
    try:
        import comfy_kitchen  # noqa: F401
    except Exception as e:  # ImportError, or a binary that fails to load
        _KITCHEN_OK[key] = (f"comfy_kitchen is not importable ({type(e).__name__}: {e}); "
                            "pip install comfy-kitchen with the Python that runs ComfyUI")
        return _KITCHEN_OK[key]
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=g) * torch.linspace(0.1, 4.0, 48)[:, None]
        qw, ws = quantize_weight_per_channel(w)
        layer = _Probe(qw.to(device), ws.to(device), torch.randn(48, generator=g).to(device))
        x = torch.randn(32, 64, generator=g).to(device=device, dtype=torch.bfloat16)
        ref = _dequant_bf16_linear(x.float(), layer)
        got = _comfy_kitchen_linear(x, layer).float()
        err = ((got - ref).norm() / ref.norm()).item()
        _KITCHEN_OK[key] = None if err < 2e-2 else (
            f"comfy_kitchen.int8_linear disagrees with the reference by {err:.1%} with per-channel "
            "weight scales on this device (this kitchen version expects a per-tensor scale)")
    except Exception as e:
        _KITCHEN_OK[key] = f"comfy_kitchen.int8_linear failed on {device}: {type(e).__name__}: {e}"
    return _KITCHEN_OK[key]


class _Probe:
    """The tensors a backend reads of a layer (``quant.linear._Operands``' fields), for a check of its own."""
    __slots__ = ("qweight", "weight_scale", "bias", "inv_smooth")

    def __init__(self, qweight, weight_scale, bias, inv_smooth=None):
        self.qweight, self.weight_scale, self.bias, self.inv_smooth = qweight, weight_scale, bias, inv_smooth


def _fp8_weight(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 copy of the layer's (smoothed) weight with per-channel scales, made once per device and kept by the
    Int8Linear (``Int8Linear.fp8_weight``)."""
    owner = getattr(layer, "owner", layer)  # the Int8Linear itself, also when handed its fetched operands

    def make():
        w = dequantize(layer.qweight, layer.weight_scale)
        s = (w.abs().amax(1).clamp(min=1e-12) / 448.0)
        w8 = (w / s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        return w8, s.float()
    return owner.fp8_weight(layer.qweight.device, make)


def _fp8_rowwise_linear(x2d: torch.Tensor, layer) -> torch.Tensor:
    xf = x2d.float()
    if layer.inv_smooth is not None:
        xf = xf * layer.inv_smooth[None, :]
    s_a = xf.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
    a8 = (xf / s_a).clamp(-448, 448).to(torch.float8_e4m3fn)
    w8, s_w = _fp8_weight(layer)
    bias = None if layer.bias is None else layer.bias.to(torch.bfloat16)
    y = torch._scaled_mm(a8, w8.t(), scale_a=s_a, scale_b=s_w[None, :], bias=bias,
                         out_dtype=torch.bfloat16)
    return y.to(x2d.dtype)


# --------------------------------------------------------------------------- constraints
def _any_device(device: torch.device) -> str | None:
    return None


def _any_shape(N: int, K: int) -> str | None:
    return None


def _fused_triton_device(device: torch.device) -> str | None:
    try:
        ok, reason = _kernel.triton_status(device)
    except ImportError as e:
        return f"the pack's kernels cannot load ({e})"
    if ok:  # define torch.ops.int8_fused.linear now (no Triton import), never inside a compile trace
        _kernel.register_ops()
    return None if ok else reason


def _fused_triton_shape(N: int, K: int) -> str | None:
    return None  # the kernel masks every tail; any N and K run


def _fp8_device(device: torch.device) -> str | None:
    cc = _cuda_capability(device)
    if cc is None:
        return "FP8 tensor cores need a CUDA GPU"
    if cc < (8, 9):
        return f"FP8 needs compute capability >= 8.9 (Ada/Hopper); this GPU is {cc[0]}.{cc[1]}"
    return None


def _fp8_shape(N: int, K: int) -> str | None:
    if K % 16 or N % 16:
        return f"torch._scaled_mm needs N and K divisible by 16 (got N={N}, K={K})"
    return None


#: The backend of this pack's own Triton kernels (the default where it runs).
FUSED_BACKEND = "fused_triton"

BACKENDS: dict[str, Backend] = {b.name: b for b in [
    Backend(FUSED_BACKEND, "fused Triton INT8 GEMM (this pack)", _fused_triton_device,
            _fused_triton_shape, _fused_triton_linear, fallback="torch_int_mm",
            dispatch_int8=_fused_triton_dispatch_int8, feeds_fused=True, pad_elision_by_default=True),
    Backend("torch_int_mm", "torch._int_mm (cuBLASLt INT8) + torch quantize/dequantize",
            _any_device, _int_mm_shape, _torch_int_mm_linear, fallback="dequant_bf16"),
    Backend("dequant_bf16", "quantize, dequantize to the compute dtype, float matmul (baseline)",
            _any_device, _any_shape, _dequant_bf16_linear, fallback=None),
    Backend("fp8_rowwise", "FP8 e4m3 row-wise torch._scaled_mm", _fp8_device, _fp8_shape,
            _fp8_rowwise_linear, fallback="dequant_bf16"),
    Backend("comfy_kitchen", "comfy_kitchen.int8_linear (ComfyUI's kernel library)", _comfy_kitchen_device,
            _any_shape, _comfy_kitchen_linear, fallback="torch_int_mm"),
    Backend("bf16", "unquantized float model (control)", _any_device, _any_shape, None,
            fallback=None, quantizes=False),
]}

PREFERENCE = [FUSED_BACKEND, "comfy_kitchen", "torch_int_mm", "fp8_rowwise", "dequant_bf16", "bf16"]


def get(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown INT8 backend {name!r}; known: {', '.join(BACKENDS)}") from None


# what a name that is no backend can do: nothing (a capability query never raises; ``get`` does)
_NOTHING = Backend("", "no backend of this pack", lambda device: "no backend", lambda N, K: "no backend", None,
                   fallback=None, quantizes=False)


def capabilities(name: str | None) -> Backend:
    """The record of backend ``name``, to ask what it can do (``.per_shape_dispatch``, ``.feeds_fused``, ...); for
    None or a name that is no backend, a record that declares nothing."""
    return BACKENDS.get(name, _NOTHING)


def device_reasons(device: torch.device) -> dict[str, str | None]:
    """Every backend's verdict for ``device``: None when it runs there, else why not."""
    return {name: b.device_reason(device) for name, b in BACKENDS.items()}


def available(device: torch.device) -> list[str]:
    """Names of the backends that run on ``device``, the default (fastest) first."""
    ok = [n for n, r in device_reasons(device).items() if r is None]
    return sorted(ok, key=lambda n: PREFERENCE.index(n) if n in PREFERENCE else len(PREFERENCE))


def default_backend(device: torch.device) -> str:
    return available(device)[0]


def resolve(name: str, device: torch.device, N: int, K: int) -> tuple[str, str | None]:
    """Pick the backend that runs an [N, K] layer on ``device``, walking fallbacks.

    Returns (backend name, note) where note says why the asked-for backend was passed over (None when
    it was taken). Raises ValueError listing every rejection when nothing can run it.
    """
    reasons = []
    cur: str | None = name
    while cur is not None:
        b = get(cur)
        why = b.device_reason(device) or b.shape_reason(N, K)
        if why is None:
            return cur, (None if cur == name else "; ".join(reasons))
        reasons.append(f"{cur}: {why}")
        cur = b.fallback
    raise ValueError(f"no backend can run a {N}x{K} linear on {device}: " + "; ".join(reasons))


def env_override() -> str | None:
    """INT8_FUSED_BACKEND (``kernel.config``) forces a backend for every node (A/B runs from the shell)."""
    return config.get("INT8_FUSED_BACKEND")


# ------------------------------------------------------------------ LoRA after Apply on fused_triton's fused layers
# Whether a LoRA runs inside the int8 GEMM (``kernel.int8_gemm_lora``: quant.blocks.gemm) or as the branch pair beside
# it (``quant.lora.Branches.add_quantized``): the switch, and a build that failed in this process.
_LORA_EPILOGUE_FAILED: str | None = None  # why the LoRA epilogue GEMM is off in this process, else None


def lora_epilogue_on() -> bool:
    """Whether fused layers run a LoRA inside their GEMM (``INT8_FUSED_LORA_EPILOGUE``, no failed build)."""
    return _LORA_EPILOGUE_FAILED is None and config.get("INT8_FUSED_LORA_EPILOGUE")


def lora_epilogue_failed(e: BaseException) -> None:
    """The LoRA epilogue GEMM raised ``e``: off for the rest of the process, said once in the log."""
    global _LORA_EPILOGUE_FAILED
    _LORA_EPILOGUE_FAILED = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    log.warning("INT8 LoRA: the LoRA-in-the-epilogue GEMM failed (%s); LoRAs after Apply run as a GEMM pair beside "
                "the int8 GEMM for the rest of this process (slower, same results within rounding)",
                _LORA_EPILOGUE_FAILED)


def lora_epilogue_state() -> str:
    """How a LoRA after Apply runs on the fused layers in this process (for the dispatch report)."""
    if not config.get("INT8_FUSED_LORA_EPILOGUE"):
        return "a GEMM pair beside the int8 GEMM (INT8_FUSED_LORA_EPILOGUE=0)"
    if _LORA_EPILOGUE_FAILED is not None:
        return f"a GEMM pair beside the int8 GEMM (the epilogue GEMM failed: {_LORA_EPILOGUE_FAILED})"
    return "up-projection in the int8 GEMM's epilogue"
