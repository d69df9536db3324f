"""Every ``torch.ops.int8_fused`` custom op, and the module data that chooses the fused row kernels' launches.

The custom ops make ``torch.compile`` trace a model as opaque nodes with shape-only fake implementations (no Triton
runs while tracing). Eager callers call the wrappers directly (no dispatcher overhead on hundreds of calls a step);
the fused blocks (``quant.blocks``) call the ops while torch.compile traces (``torch.compiler.is_compiling()``).

    linear(Tensor x, Tensor w_q, Tensor w_scale, Tensor? bias, Tensor? inv_smooth) -> Tensor     (kernel.int8_linear)
    act_quant / gemm_dequant                                       (kernel.quantize_per_token / kernel.int8_gemm)
    rms_mod_quant / ln_mod_quant                                   (kernel.norm)
    swiglu_quant                                                   (kernel.swiglu)
    cat_gelu_quant                                                 (kernel.gelu)
    gated_residual                                                 (kernel.residual)
    hadamard_quant                                                 (kernel.hadamard: ConvRot rotation + quantize)

Registered by ``register_ops()`` (idempotent), so importing this module (or the pack) defines no op and loads no
triton.
"""
from __future__ import annotations

import functools
import threading

import torch

from . import linear as _linear  # torch only: the Triton kernels load on their first launch
from .config import gemm_switches

_LOCK = threading.Lock()
_READY = False


@functools.cache
def row_modules() -> tuple:
    """(kernel.norm, .swiglu, .gelu, .residual, .rope, .rowtile, .quantize, .launch): the fused row kernels' modules,
    imported (with triton) on the first call."""
    from . import gelu, hadamard, launch, norm, quantize, residual, rope, rowtile, swiglu  # noqa: F401 (hadamard)
    return norm, swiglu, gelu, residual, rope, rowtile, quantize, launch


def tunables() -> tuple:
    """The module data the row kernels' wrappers read at each call to choose kernels and tiles (the tests
    change them), the launcher they call, and what chooses the GEMMs' tiles (``kernel.gemm_switches``): part
    of a prepared call's key (``kernel.plan.call``), so a change is never served a stale plan (without the GEMM
    switches, an A/B of the s8 path would re-issue the SwiGLU GEMM planned before it)."""
    norm, swiglu, gelu, residual, rope, rowtile, quantize, _ = row_modules()
    return (norm.RMS_PLAN, norm.RMS_ONE_PASS, norm.LN_PLAN, norm.LN_ONE_PASS, swiglu.SWIGLU_PLAN,
            swiglu.SWIGLU_ONE_PASS, residual.RESIDUAL_ONE_PASS, residual.RESIDUAL_LN_ONE_PASS, rowtile.MAX_SINGLE,
            gelu.GELU_PLAN, gelu.GELU_FAST, gelu.GELU_ONE_PASS, rope.QK_GROUP_ELEMS, rope.QK_PREFETCH,
            quantize.QUANT_ONE_PASS, quantize.QUANT_ROW_LOOP, rowtile.plan_tiles,
            norm.launch, swiglu.launch, gelu.launch, residual.launch, rope.launch, *gemm_switches())


def _linear_impl(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 inv_smooth: torch.Tensor | None) -> torch.Tensor:
    return _linear.int8_linear(x, w_q, w_scale, bias, inv_smooth, out_dtype=x.dtype)


def _linear_fake(x, w_q, w_scale, bias, inv_smooth):
    torch._check(x.shape[-1] == w_q.shape[1], lambda: "int8_fused::linear: x and w_q disagree on K")
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))


def _rows_fake(x, n=None):
    """(int8 [M, n], fp32 [M]): a quantizing row kernel's outputs (n: x's columns unless given)."""
    return (x.new_empty((x.shape[0], x.shape[1] if n is None else n), dtype=torch.int8),
            x.new_empty(x.shape[:1], dtype=torch.float32))


def _gated_residual_fake(x, o, wn, eps, gate, t, w2, eps2, s2, inv):
    dt = torch.promote_types(x.dtype, torch.promote_types(o.dtype, gate.dtype))
    n = x.shape[0] if w2 is not None else 0
    return (x.new_empty(x.shape, dtype=dt), x.new_empty((n, x.shape[1] if n else 0), dtype=torch.int8),
            x.new_empty((n,), dtype=torch.float32))


def _gated_residual(x, o, wn, eps, gate, tokens_per_batch, w2, eps2, s2, inv_smooth):
    y, q, qs = row_modules()[3].gated_residual_rmsnorm(x, o, wn, eps, gate, tokens_per_batch, w2, eps2, s2,
                                                       inv_smooth)
    if q is None:
        q, qs = x.new_empty((0,), dtype=torch.int8), x.new_empty((0,), dtype=torch.float32)
    return y, q, qs


def _rms_mod_quant(x, w, eps, scale, tokens_per_batch, inv_smooth):
    return row_modules()[0].rmsnorm_modulate_quantize(x, w, eps, scale, tokens_per_batch, inv_smooth)


def _swiglu_quant(h13, inv_smooth, clamp_fp16):
    return row_modules()[1].swiglu_quantize(h13, inv_smooth, clamp_fp16)


def _ln_mod_quant(x, scale, shift, tokens_per_batch, inv_smooth, eps):
    return row_modules()[0].layernorm_modulate_quantize(x, scale, shift, tokens_per_batch, inv_smooth, eps)


def _cat_gelu_quant(a, h, inv_smooth):
    gelu = row_modules()[2]
    return gelu.concat_gelu_quantize(a, h, inv_smooth) if a is not None else gelu.gelu_tanh_quantize(h, inv_smooth)


def _act_quant(x, inv_smooth):
    return _linear.quantize_per_token(x, inv_smooth)


def _hadamard_quant(x, group):
    from .hadamard import hadamard_quantize
    return hadamard_quantize(x, group)


def _gemm_dequant(a_q, a_scale, w_q, w_scale, bias, out_dtype):
    return _linear.int8_gemm(a_q, a_scale, w_q, w_scale, bias, out_dtype=out_dtype)


# (name, schema, implementation, fake) of every op; an implementation imports the row kernels (and triton) when it
# first runs, so registering the ops imports neither
_OPS = [
    ("linear", "(Tensor x, Tensor w_q, Tensor w_scale, Tensor? bias, Tensor? inv_smooth) -> Tensor",
     _linear_impl, _linear_fake),
    ("gated_residual", "(Tensor x, Tensor o, Tensor wn, float eps, Tensor gate, int tokens_per_batch, "
                       "Tensor? w2, float eps2, Tensor? s2, Tensor? inv_smooth) -> (Tensor, Tensor, Tensor)",
     _gated_residual, _gated_residual_fake),
    ("rms_mod_quant", "(Tensor x, Tensor w, float eps, Tensor scale, int tokens_per_batch, Tensor? inv_smooth)"
                      " -> (Tensor, Tensor)", _rms_mod_quant, lambda x, w, eps, s, t, inv: _rows_fake(x)),
    ("swiglu_quant", "(Tensor h13, Tensor? inv_smooth, bool clamp_fp16) -> (Tensor, Tensor)", _swiglu_quant,
     lambda h, inv, c: _rows_fake(h, h.shape[1] // 2)),
    ("ln_mod_quant", "(Tensor x, Tensor scale, Tensor shift, int tokens_per_batch, Tensor? inv_smooth, "
                     "float eps) -> (Tensor, Tensor)", _ln_mod_quant, lambda x, s, sh, t, inv, eps: _rows_fake(x)),
    ("cat_gelu_quant", "(Tensor? a, Tensor h, Tensor? inv_smooth) -> (Tensor, Tensor)", _cat_gelu_quant,
     lambda a, h, inv: _rows_fake(h, h.shape[1] + (a.shape[1] if a is not None else 0))),
    ("act_quant", "(Tensor x, Tensor? inv_smooth) -> (Tensor, Tensor)", _act_quant, lambda x, inv: _rows_fake(x)),
    ("hadamard_quant", "(Tensor x, int group) -> (Tensor, Tensor)", _hadamard_quant, lambda x, g: _rows_fake(x)),
    ("gemm_dequant", "(Tensor a_q, Tensor a_scale, Tensor w_q, Tensor w_scale, Tensor? bias, "
                     "ScalarType out_dtype) -> Tensor", _gemm_dequant,
     lambda a, sa, w, sw, b, dt: a.new_empty((a.shape[0], w.shape[0]), dtype=dt)),
]


def register_ops() -> None:
    """Registers every ``int8_fused::`` op (idempotent; imports no triton)."""
    global _READY
    with _LOCK:
        if _READY:
            return
        for name, schema, impl, fake in _OPS:
            torch.library.custom_op(f"int8_fused::{name}", mutates_args=(), schema=schema)(impl).register_fake(fake)
        _READY = True


def linear_op(x, w_q, w_scale, bias=None, inv_smooth=None) -> torch.Tensor:
    """``torch.ops.int8_fused.linear`` (registering the ops on the first call)."""
    if not _READY:
        register_ops()
    return torch.ops.int8_fused.linear(x, w_q, w_scale, bias, inv_smooth)
