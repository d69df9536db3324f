"""SmoothQuant factors and the W8A8 output error of one linear on captured activations.

SmoothQuant moves activation outliers into the weights: with ``s`` [K] positive,
``X W^T = (X / s) (W * s)^T`` exactly, and per-token INT8 quantization of ``X / s`` loses less when
``s_j`` is large on the outlier channels j. The SmoothQuant rule (Xiao et al. 2023):

    s_j = max_t |X[t, j]| ** alpha / max_n |W[n, j]| ** (1 - alpha)

Per-token activation scales and per-output-channel weight scales make the product invariant to a
global factor on ``s``, so ``s`` is normalised to geometric mean 1 over live channels and clamped to
[1e-4, 1e4] (keeps ``X / s`` and ``W * s`` far from bf16/fp32 range limits). A channel whose
activations or weights are all zero gets ``s_j = 1`` (any value is exact there).

Errors are relative Frobenius errors of the W8A8 product against the float product, both in fp32,
bias excluded (it is added unchanged by every backend and would only dilute the error):

    err = ||Y_int8 - X W^T||_F / ||X W^T||_F
"""
from __future__ import annotations

import math

import torch

from .linear import Int8Linear

S_MIN, S_MAX = 1e-4, 1e4
ALPHA_GRID = tuple(round(0.30 + 0.05 * i, 2) for i in range(11))  # 0.30 ... 0.80
ERROR_BACKENDS = ("dequant_bf16", "torch_int_mm")


def smooth_factors(act_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant divisor s (fp32 [K], on the CPU) from per-channel activation and weight-column absmax [K],
    which may sit on different devices (the capture keeps its statistics on the CPU, the weight is read on the
    GPU)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    a, w = act_absmax.detach().double().flatten().cpu(), w_absmax.detach().double().flatten().cpu()
    if a.shape != w.shape:
        raise ValueError(f"activation absmax has {a.numel()} channels, weight columns {w.numel()}")
    live = (a > 0) & (w > 0) & torch.isfinite(a) & torch.isfinite(w)
    if not live.any():
        return torch.ones_like(a, dtype=torch.float32)
    log_s = alpha * a.clamp(min=1e-30).log() - (1.0 - alpha) * w.clamp(min=1e-30).log()
    log_s = log_s - log_s[live].mean()
    s = log_s.exp().clamp(S_MIN, S_MAX)
    return torch.where(live, s, torch.ones_like(s)).float()


def weight_col_absmax(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [K]: max over output rows of |W[:, j]| (column j of the [N, K] weight)."""
    return weight.detach().float().abs().amax(dim=0)


def w8a8_error(x: torch.Tensor, weight: torch.Tensor, smooth: torch.Tensor | None = None,
               backend: str = "dequant_bf16") -> float:
    """Relative output error of the W8A8 layer (``Int8Linear``, fp32 compute) on rows ``x`` [M, K]."""
    if backend not in ERROR_BACKENDS:
        raise ValueError(f"error backend must be one of {ERROR_BACKENDS}, got {backend!r}")
    w = weight.detach().float()
    xf = x.detach().to(w.device, torch.float32)
    ref = xf @ w.t()
    lin = Int8Linear.from_float(w, None, smooth, backend=backend)
    y = lin(xf).float()
    den = ref.norm()
    num = (y - ref).norm()
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return float(num / den)


def search_alpha(x: torch.Tensor, weight: torch.Tensor, act_absmax: torch.Tensor,
                 grid=ALPHA_GRID, backend: str = "dequant_bf16"
                 ) -> tuple[float | None, torch.Tensor | None, float, dict]:
    """Best SmoothQuant alpha on ``grid`` for rows ``x``, "no smoothing" included as a candidate.

    Returns (alpha or None, s or None, its error, {alpha or "none": error}). Ties go to the
    earlier candidate; "none" is tried first, so smoothing is kept only when it strictly helps.
    """
    a, s, errs, table = search_alpha_group([x], [weight], act_absmax, grid, backend)
    return a, s, errs[0], {k: v[0] for k, v in table.items()}


def shared_col_absmax(weights) -> torch.Tensor:
    """fp32 [K] on the CPU: the column absmax over several [N_i, K] weights that read one activation."""
    return torch.stack([weight_col_absmax(w).cpu() for w in weights]).amax(dim=0)


def search_alpha_group(xs, weights, act_absmax: torch.Tensor, grid=ALPHA_GRID, backend: str = "dequant_bf16"
                       ) -> tuple[float | None, torch.Tensor | None, list[float], dict]:
    """``search_alpha`` for layers that read one activation and so share one smoothing vector (SwiGLU's w1 and
    w3: a fused kernel quantizes their input once). ``xs`` / ``weights``: each layer's captured rows and weight;
    the vector comes from the shared activation absmax and the column absmax over all the weights.

    The pick: the lowest summed error among the candidates ("none" first, then ``grid``) that leave no layer worse
    than at alpha 0.5 (when 0.5 is on the grid), ties to the earlier. For one layer that is the lowest error.
    Returns (alpha or None, s or None, [error per layer], {alpha or "none": [error per layer]}).
    """
    wabs = shared_col_absmax(weights)
    cands = [("none", None)] + [(float(a), smooth_factors(act_absmax, wabs, float(a))) for a in grid]
    table = {k: [w8a8_error(x, w, s, backend) for x, w in zip(xs, weights)] for k, s in cands}
    cap = table.get(0.5)
    best = None
    for k, s in cands:
        e = table[k]
        if cap is not None and any(a > b for a, b in zip(e, cap)):
            continue
        if best is None or sum(e) < sum(table[best[0]]):
            best = (k, s)
    k, s = best
    return (None if k == "none" else k), s, table[k], table
