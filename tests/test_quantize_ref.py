"""The torch reference quantizers (quant/quantize.py), which every kernel and backend is tested against, against the
rule of that module's docstring computed with numpy, row by row: step ``absmax / 127`` (fp32), codes
``clamp(rint(x * (127 / absmax)), -127, 127)`` with 127 / absmax one fp32 division and the product one fp32 rounding;
an all-zero row scale 0 and zeros; a row holding NaN or Inf (activations) scale NaN and zeros; a weight holding NaN or
Inf refused, naming its rows."""
import numpy as np
import pytest
import torch

from quant.quantize import quantize_per_token_ref, quantize_weight_per_channel


def _numpy_rule(x: np.ndarray):
    x = x.astype(np.float32)
    q = np.zeros(x.shape, np.int8)
    s = np.zeros(x.shape[0], np.float32)
    for r, row in enumerate(x):
        if not np.all(np.isfinite(row)):
            s[r] = np.nan
            continue
        amax = np.float32(np.max(np.abs(row))) if row.size else np.float32(0)
        if amax == 0:
            continue
        mult = np.float32(127.0) / amax
        q[r] = np.clip(np.rint((row * mult).astype(np.float32)), -127, 127).astype(np.int8)
        s[r] = amax / np.float32(127.0)
    return q, s


def _rows(k: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(9, k, generator=g) * torch.rand(9, 1, generator=g) * 8
    if k:
        x[1] = 0.0
        x[2] = -0.0
        x[3, k // 2] = -x[3].abs().max() * 3  # the |max| on a negative value
        x[4] = torch.randint(-3, 4, (k,), generator=g) * 0.5  # values on rounding midpoints
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [0, 1, 7, 300])
def test_weight_quantizer_follows_the_rule(dtype, k):
    w = _rows(k, dtype)
    q, s = quantize_weight_per_channel(w)
    qn, sn = _numpy_rule(w.float().numpy())
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert np.array_equal(q.numpy(), qn) and np.array_equal(s.numpy(), sn)


@pytest.mark.parametrize("k", [1, 64])
def test_activation_quantizer_non_finite_rows(k):
    x = _rows(k, torch.float32)
    x[5, 0] = float("nan")
    x[6, -1] = float("inf")
    x[7, 0] = -float("inf")
    q, s = quantize_per_token_ref(x)
    qn, sn = _numpy_rule(x.numpy())
    assert np.array_equal(q.numpy(), qn)
    assert np.array_equal(np.isnan(s.numpy()), np.isnan(sn)) and np.isnan(sn[5:8]).all()
    assert np.array_equal(np.nan_to_num(s.numpy(), nan=-1), np.nan_to_num(sn, nan=-1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_weight_quantizer_refuses_non_finite_rows(bad):
    w = _rows(16, torch.float32)
    w[3, 2] = bad
    w[7, 0] = bad
    with pytest.raises(ValueError, match=r"NaN/Inf in output rows \[3, 7\]"):
        quantize_weight_per_channel(w)
