"""``torch.ops.int8_fused.linear``: the whole W8A8 linear as one custom op, so ``torch.compile`` traces a model
that uses it as a single opaque node (fake implementation below gives shapes without running Triton).

    int8_fused::linear(Tensor x, Tensor w_q, Tensor w_scale, Tensor? bias, Tensor? inv_smooth) -> Tensor
    x [..., K] float, w_q int8 [N, K], w_scale fp32 [N] -> [..., N] in x.dtype

Registered lazily by ``register_ops()`` (idempotent) so importing the pack defines no op and loads no triton.
"""
from __future__ import annotations

import threading

import torch

_LOCK = threading.Lock()
_OP = None


def _linear_impl(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 inv_smooth: torch.Tensor | None) -> torch.Tensor:
    from . import int8_linear
    return int8_linear(x, w_q, w_scale, bias, inv_smooth, out_dtype=x.dtype)


def _linear_fake(x, w_q, w_scale, bias, inv_smooth):
    torch._check(x.shape[-1] == w_q.shape[1], lambda: "int8_fused::linear: x and w_q disagree on K")
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))


def register_ops() -> None:
    global _OP
    with _LOCK:
        if _OP is not None:
            return
        op = torch.library.custom_op(
            "int8_fused::linear", mutates_args=(),
            schema="(Tensor x, Tensor w_q, Tensor w_scale, Tensor? bias, Tensor? inv_smooth) -> Tensor",
        )(_linear_impl)
        op.register_fake(_linear_fake)
        _OP = op


def linear_op(x, w_q, w_scale, bias=None, inv_smooth=None) -> torch.Tensor:
    if _OP is None:
        register_ops()
    return torch.ops.int8_fused.linear(x, w_q, w_scale, bias, inv_smooth)
