"""The kernels' input checks: whether Triton can run on a tensor's device, and the shape / dtype / device checks of
the operands every wrapper (``kernel``, ``kernel.norm``, ``.swiglu``, ...) shares. torch only: importing this module
imports no triton.
"""
from __future__ import annotations

import importlib.util

import torch

from . import config

FLOAT_OUT = (torch.bfloat16, torch.float16, torch.float32)
FLOAT_IN = (torch.bfloat16, torch.float16, torch.float32)

INTERPRET_AT_IMPORT = config.get("TRITON_INTERPRET")  # Triton takes it when the kernels are defined

#: ConvRot group sizes the pack runs: powers of 4 from 16, the regular Hadamard orders tl.dot takes
#: (``kernel.hadamard``'s rotation, ``quant.convrot``'s layers).
CONVROT_GROUPS = (16, 64, 256, 1024)


def convrot_group(k: int, group: int, what: str = "ConvRot", supported: bool | None = None) -> None:
    """Raises ValueError (naming ``what``, the group and K) unless ``group`` is a supported ConvRot group size
    (``supported``; default: one of ``CONVROT_GROUPS``) that divides K."""
    if not (group in CONVROT_GROUPS if supported is None else supported):
        raise ValueError(f"{what}: group size {group} is not supported: ConvRot's rotation is a regular Hadamard "
                         f"matrix, which exists for powers of 4 only; the pack runs "
                         f"{', '.join(map(str, CONVROT_GROUPS))} (input width K = {k})")
    if k <= 0 or k % group:
        raise ValueError(f"{what}: group size {group} does not divide the input width K = {k} (ragged K: it must "
                         f"be a multiple of {group})")


def triton_status(device: torch.device | None = None) -> tuple[bool, str]:
    """Whether the Triton kernels can run on ``device`` (default: the current CUDA device), and why not."""
    if importlib.util.find_spec("triton") is None:
        return False, "Triton is not installed: pip install triton (triton-windows on Windows)"
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cpu":
        if config.get("TRITON_INTERPRET"):
            return True, "Triton interpreter (TRITON_INTERPRET=1) on CPU tensors"
        return False, ("CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing "
                       "(tests only; it is far too slow for inference)")
    if device is not None and device.type != "cuda":
        return False, f"device {device} is not a CUDA GPU; the INT8 kernels need an NVIDIA GPU (sm_80 or newer)"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU: torch.cuda.is_available() is False (CPU-only torch build or no driver)"
    idx = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(idx)
    if major < 8:
        name = torch.cuda.get_device_name(idx)
        return False, (f"GPU '{name}' has compute capability {major}.{minor}; INT8 tensor cores need >= 8.0 "
                       "(Ampere or newer): use the bf16 or fp8 path on this GPU")
    return True, f"Triton on '{torch.cuda.get_device_name(idx)}' (sm_{major}{minor})"


_USABLE: dict[tuple, tuple[bool, str]] = {}  # per device: the status is checked once, not per call


def check_usable(t: torch.Tensor, what: str) -> None:
    """Raises (naming ``what``) unless the kernels can run on ``t``'s device."""
    key = (t.device, INTERPRET_AT_IMPORT)
    if key not in _USABLE:
        _USABLE[key] = triton_status(t.device)
    ok, reason = _USABLE[key]
    if not ok:
        raise RuntimeError(f"{what}: {reason}")


def check_2d(t: torch.Tensor, name: str, dtypes: tuple, fix: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}: {fix}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}: {fix}")


def vector(t: torch.Tensor, n: int, name: str, device: torch.device, allow_scalar: bool) -> torch.Tensor:
    """A float vector of n entries (or one entry broadcast with stride 0) on ``device``, as a 1-D view."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise ValueError(f"{name} must be a float tensor of {n} entries, got "
                         f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the int8 operands are on {device}: move it with .to()")
    if t.dim() == 1 and t.shape[0] == n:  # the common case: no torch op (each costs microseconds of host time)
        return t
    if t.numel() == 1 and allow_scalar and n != 1:
        return t.reshape(1).expand(n)
    if t.numel() != n:
        raise ValueError(f"{name} has shape {tuple(t.shape)} ({t.numel()} entries), expected [{n}]")
    return t.reshape(n)


def fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()  # bf16/fp16 -> fp32 is exact


def smooth_vector(inv_smooth: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor | None:
    """The 1/smooth vector of n entries as fp32 with unit stride (the reference's dtype; bf16 -> fp32 is exact), or
    None without smoothing."""
    if inv_smooth is None:
        return None
    inv = vector(inv_smooth, n, "inv_smooth", device, allow_scalar=False)
    return inv if inv.dtype == torch.float32 and inv.stride(0) == 1 else inv.float().contiguous()


def gemm_operands(a_q, a_scale, w_q, w_scale, bias, out_dtype, out_int32=False):
    """int8_gemm's checks of its operands; returns (a_scale fp32 [M], w_scale fp32 [N] or a broadcast scalar,
    bias [N] or None) on a_q's device."""
    fix = "quantize with kernel.quantize_per_token / quant.quantize.quantize_weight_per_channel"
    check_2d(a_q, "a_q", (torch.int8,), fix)
    check_2d(w_q, "w_q", (torch.int8,), fix + " (weight in nn.Linear layout [N, K])")
    m, k = a_q.shape
    n, k_w = w_q.shape
    if k != k_w:
        raise ValueError(f"K mismatch: a_q is [{m}, {k}] but w_q is [{n}, {k_w}]; w_q must be [N, K] "
                         "(nn.Linear layout), not transposed")
    if w_q.device != a_q.device:
        raise ValueError(f"a_q is on {a_q.device} but w_q is on {w_q.device}")
    if not out_int32 and out_dtype not in FLOAT_OUT:
        raise ValueError(f"out_dtype {out_dtype} is not supported: use torch.bfloat16, float16 or float32 "
                         "(or out_int32=True for the raw accumulator)")
    a_scale = fp32(vector(a_scale, m, "a_scale", a_q.device, allow_scalar=False))
    w_scale = fp32(vector(w_scale, n, "w_scale", a_q.device, allow_scalar=True))
    if bias is not None:
        bias = vector(bias, n, "bias", a_q.device, allow_scalar=False)
    return a_scale, w_scale, bias


LORA_CHUNK = 16  # the rank of a LoRA in the GEMM's epilogue is a multiple of this (kernel.gemm.lora_up)


def lora_operands(a_q, a_scale, d, u, n: int, out_dtype) -> None:
    """The LoRA-in-the-epilogue GEMM's checks (``kernel.int8_gemm_lora``) beyond ``gemm_operands``: d [R, K] and
    u [N, R] contiguous, both bf16 or both fp16 (the MMA's inputs; the output may be any float dtype: the epilogue
    sums in fp32), R a positive multiple of ``LORA_CHUNK`` (pad with zero rows / columns), the per-token scale
    contiguous, a_q with unit column stride, all on a_q's device."""
    m, k = a_q.shape
    if out_dtype not in FLOAT_OUT:
        raise ValueError(f"a LoRA in the GEMM epilogue needs a float output (bf16, fp16, fp32), not {out_dtype}")
    half = d.dtype if isinstance(d, torch.Tensor) and d.dtype in (torch.bfloat16, torch.float16) else None
    for name, t, shape in (("lora down", d, (None, k)), ("lora up", u, (n, None))):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != half or t.device != a_q.device:
            raise ValueError(f"{name} must be a 2-D bf16 or fp16 tensor on {a_q.device} (down and up of one dtype), "
                             f"got {(t.dtype, tuple(t.shape), t.device) if isinstance(t, torch.Tensor) else type(t)}")
        if any(want is not None and got != want for got, want in zip(t.shape, shape)) or not t.is_contiguous():
            raise ValueError(f"{name} has shape {tuple(t.shape)} (contiguous: {t.is_contiguous()}); expected a "
                             f"contiguous {['[R, %d]' % k, '[%d, R]' % n][name == 'lora up']}")
    r = d.shape[0]
    if r <= 0 or r % LORA_CHUNK or u.shape[1] != r:
        raise ValueError(f"lora down [{r}, K] and up [N, {u.shape[1]}] must share a rank that is a positive "
                         f"multiple of {LORA_CHUNK} (pad with zeros)")
    if a_q.stride(1) != 1 or a_scale.stride(0) != 1:
        raise ValueError("the LoRA GEMM reads a_q with unit column stride and a contiguous a_scale")


def small_m_operands(x, w_q, w_scale, bias, inv_smooth, out_dtype):
    """The one-launch small-M linear's checks (those of quantize_per_token and int8_gemm); returns (inv_smooth fp32
    [K] | None, w_scale fp32 [N] or a broadcast scalar, bias [N] | None) on x's device."""
    check_2d(x, "x", FLOAT_IN, "pass activations as [tokens, K] in bf16, fp16 or fp32")
    fix = "quantize with quant.quantize.quantize_weight_per_channel (weight in nn.Linear layout [N, K])"
    check_2d(w_q, "w_q", (torch.int8,), fix)
    m, k = x.shape
    n, k_w = w_q.shape
    if k != k_w:
        raise ValueError(f"K mismatch: x is [{m}, {k}] but w_q is [{n}, {k_w}]; w_q must be [N, K] "
                         "(nn.Linear layout), not transposed")
    if w_q.device != x.device:
        raise ValueError(f"x is on {x.device} but w_q is on {w_q.device}")
    if out_dtype not in FLOAT_OUT:
        raise ValueError(f"out_dtype {out_dtype} is not supported: use torch.bfloat16, float16 or float32")
    inv_smooth = smooth_vector(inv_smooth, k, x.device)
    w_scale = fp32(vector(w_scale, n, "w_scale", x.device, allow_scalar=True))
    if bias is not None:
        bias = vector(bias, n, "bias", x.device, allow_scalar=False)
    return inv_smooth, w_scale, bias
