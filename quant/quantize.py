"""Plain-torch quantizers: the reference every kernel and backend is tested against.

Conventions (shared with the Triton kernels in ``kernel/``, which must match them bit for bit):

* weights, per output channel: ``w_scale[n] = max_k |W[n, k]| / 127`` (fp32),
  ``W_q = clamp(rint(W * (127 / absmax[n])), -127, 127)``; an all-zero row gets scale 0 and zeros.
* activations, per token (row): ``x' = x.float() * inv_smooth`` (when a SmoothQuant vector is given,
  ``inv_smooth = 1 / smooth`` in fp32), ``a_scale[m] = max_k |x'[m, k]| / 127``,
  ``A_q = clamp(rint(x' * (127 / absmax[m])), -127, 127)``.
  ``rint`` rounds half to even. An all-zero row gives scale 0 and zeros (never NaN).
* non-finite input: a row holding NaN or ±Inf gets ``a_scale = NaN`` and zeros, so its output row is
  NaN — loud, like a float matmul would be — and no other row is affected.

The dequantized product is ``(A_q @ W_q.T) * a_scale[:, None] * w_scale[None, :] + bias``.
"""
from __future__ import annotations

import torch

QMAX = 127.0


def _row_absmax(x: torch.Tensor) -> torch.Tensor:
    """max_k |x[r, k]| of a 2-D tensor (NaN where a row holds NaN, 0 for no columns): the larger of the row's max and
    minus its min, which is the same value as ``x.abs().amax(1)`` without a second copy of ``x``."""
    if not x.shape[1]:
        return x.new_zeros(x.shape[0])
    return torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_())


def _absmax_quantize(x: torch.Tensor, absmax: torch.Tensor | None = None, all_finite: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise symmetric quantization of a 2-D fp32 tensor: returns (int8 [R, C], fp32 scale [R]). ``absmax``: the
    rows' |max| where the caller has it; ``all_finite``: the caller checked that every row is finite (then no row
    needs zeroing: an all-zero row's codes are 0 anyway)."""
    if absmax is None:
        absmax = _row_absmax(x)
    finite = torch.isfinite(absmax)
    safe = torch.where(finite & (absmax > 0), absmax, torch.ones_like(absmax))
    q = x * (QMAX / safe)[:, None]
    q.round_().clamp_(-QMAX, QMAX)
    if not all_finite:  # a non-finite row: zeros (its scale NaN); no host sync, so the same on every device
        q = torch.where(finite[:, None], q, torch.zeros_like(q))
    scale = torch.where(finite, absmax / QMAX, torch.full_like(absmax, float("nan")))
    return q.to(torch.int8), scale


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (int8 [N, K], fp32 scale [N]). Non-finite weights raise."""
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(w.shape)}")
    wf = w.detach().float()
    absmax = _row_absmax(wf)  # NaN or Inf in a row makes its |max| non-finite
    bad = ~torch.isfinite(absmax)
    if bool(bad.any()):
        rows = bad.nonzero().flatten()[:5].tolist()
        raise ValueError(f"weight holds NaN/Inf in output rows {rows}: the checkpoint is damaged")
    return _absmax_quantize(wf, absmax, all_finite=True)


def quantize_per_token_ref(x: torch.Tensor, inv_smooth: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (int8 [M, K], fp32 scale [M]); see the module docstring for the rules."""
    if x.dim() != 2:
        raise ValueError(f"activations must be 2-D [tokens, K], got shape {tuple(x.shape)}")
    xf = x.float()
    if inv_smooth is not None:
        xf = xf * inv_smooth.float()[None, :]
    return _absmax_quantize(xf)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [R, C] with fp32 row scale [R] -> fp32 [R, C]."""
    return q.float() * scale.float()[:, None]


def int8_matmul_ref(a_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """Exact int32 accumulator of A_q @ W_q.T through an int64 matmul (any shape, any device)."""
    return (a_q.long() @ w_q.long().t()).to(torch.int32)


def dequant_epilogue_ref(acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """float64 reference of the GEMM epilogue ``acc * a_scale[m] * w_scale[n] + bias[n]``."""
    y = acc.double() * a_scale.double()[:, None] * w_scale.double()[None, :]
    if bias is not None:
        y = y + bias.double()[None, :]
    return y
