"""Int8Linear: accuracy against float64 within a derived W8A8 bound, state dict, devices, errors.

The W8A8 error bound used here (and, summed over layers, in test_apply.py)
---------------------------------------------------------------------------
Per token m the activation is rounded on a grid of step dx_m = max_k|x_mk| / 127 and per output
channel n the weight on a grid of step dw_n = max_k|W_nk| / 127. Round-to-nearest errors are
(to a very good approximation) independent, zero-mean, uniform on [-step/2, step/2], variance
step^2 / 12. To first order

    y^_mn - y_mn = sum_k (e^x_mk W_nk + x_mk e^w_nk)
    E[(y^_mn - y_mn)^2] = dx_m^2 / 12 * ||W_n||^2 + dw_n^2 / 12 * ||x_m||^2          (1)

(the e^x e^w cross term is smaller by another factor 1/127). Summing (1) over m, n gives the
predicted squared error P of the whole output; the test asserts

    0.85 * sqrt(P) <= ||y^ - y||_F <= 1.15 * sqrt(P).

Dividing by ||y||_F ~ ||x|| ||W|| / sqrt(K) shows the size: relative error ~ sqrt((c_x^2 + c_w^2) / 12)
/ 127 with c the crest factor max/rms of a row — about 1.2 % for Gaussian rows at K = 256, growing
with outliers, independent of K otherwise. Measured ratios err / sqrt(P) are 0.97-1.04 over 32 draws
(fp32 and bf16, with and without outlier channels, both backends): the sum of ~15 000 squared errors
concentrates within a few percent, so the +-15 % window is not loose. A systematic scale error adds in
quadrature (measured: 1 % -> ratio 1.11, so ~1.5 % leaves the window); a transposed, missing or
per-tensor-instead-of-per-token scale, a dropped bias or smoothing applied once instead of cancelled
are far outside it, and the lower bound catches a backend that silently skips quantization.
"""
import pytest
import torch

from quant.linear import Int8Linear
from quant.quantize import QMAX


def predicted_error(x: torch.Tensor, w: torch.Tensor) -> float:
    """sqrt(P) from equation (1) of the module docstring (x [M, K], w [N, K] as the GEMM sees them)."""
    x, w = x.double(), w.double()
    dx2 = (x.abs().amax(1) / QMAX) ** 2 / 12          # [M]
    dw2 = (w.abs().amax(1) / QMAX) ** 2 / 12          # [N]
    p = dx2[:, None] * (w * w).sum(1)[None, :] + dw2[None, :] * (x * x).sum(1)[:, None]
    return p.sum().sqrt().item()


def _data(M=96, K=256, N=160, outliers=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    if outliers:  # a few loud channels, as in real DiT activations
        x[:, :4] *= 8
    w = torch.randn(N, K, generator=g) / K ** 0.5 * torch.linspace(0.5, 2, N)[:, None]
    b = torch.randn(N, generator=g) * 0.1
    return x, w, b


@pytest.mark.parametrize("backend", ["dequant_bf16", "torch_int_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_within_derived_w8a8_bound(backend, dtype):
    x, w, b = _data()
    layer = Int8Linear.from_float(w, b, backend=backend)
    y = layer(x.to(dtype).reshape(4, 24, -1)).reshape(96, -1).double()  # 3-D input: leading dims
    assert y.dtype == torch.float64 and layer(x.to(dtype)).dtype == dtype
    ref = x.to(dtype).double() @ w.double().t() + b.double()
    err = (y - ref).norm().item()
    pred = predicted_error(x.to(dtype).float(), w)
    slack = 0.0 if dtype == torch.float32 else ref.norm().item() * 2 ** -8  # bf16 output rounding
    assert 0.85 * pred <= err <= 1.15 * pred + slack, (err, pred)


def test_smoothing_keeps_product_and_bound():
    """With SmoothQuant s the GEMM sees x/s and W*s; the bound (1) applies to those operands."""
    x, w, b = _data()
    s = x.abs().amax(0).clamp(min=1e-3).sqrt() / w.abs().amax(0).sqrt()
    layer = Int8Linear.from_float(w, b, smooth=s, backend="torch_int_mm")
    # element error <= half a step of the smoothed row, divided back by s_k
    half_step = (w * s).abs().amax(1, keepdim=True) / QMAX / 2 / s[None, :]
    assert ((layer.dequantized_weight() - w).abs() <= half_step * (1 + 1e-5) + 1e-7).all()
    ref = x.double() @ w.double().t() + b.double()
    err = (layer(x).double() - ref).norm().item()
    pred = predicted_error(x / s, w * s)
    assert 0.85 * pred <= err <= 1.15 * pred
    # smoothing must help on outlier channels: compare with the unsmoothed layer
    plain = (Int8Linear.from_float(w, b, backend="torch_int_mm")(x).double() - ref).norm().item()
    assert err < plain


def test_state_dict_round_trip_and_inv_smooth_refresh():
    x, w, b = _data(M=8)
    s = torch.rand(w.shape[1]) + 0.5
    a = Int8Linear.from_float(w, b, smooth=s, backend="torch_int_mm", name="blk.0.qkv")
    sd = a.state_dict()
    assert set(sd) == {"qweight", "weight_scale", "bias", "smooth"}  # inv_smooth is derived, not saved
    fresh = Int8Linear(w.shape[1], w.shape[0], bias=True, smooth=True, backend="torch_int_mm")
    fresh.load_state_dict(sd)
    torch.testing.assert_close(fresh.inv_smooth, 1 / s)
    assert torch.equal(fresh(x), a(x))


def test_to_moves_every_tensor_and_nbytes_counts_them():
    _, w, b = _data(M=4, K=64, N=32)
    layer = Int8Linear.from_float(w, b, smooth=torch.ones(64) * 2)
    assert layer.nbytes() == 32 * 64 + 32 * 4 + 32 * 4 + 64 * 4
    moved = layer.to("meta")
    assert {t.device.type for t in [moved.qweight, moved.weight_scale, moved.bias, moved.smooth,
                                     moved.inv_smooth]} == {"meta"}


def test_weight_reads_none_and_other_attributes_still_raise():
    """No float weight: ``.weight`` is None (current ComfyUI's load planner probes it on every module
    with ``comfy_cast_weights``); the int8 tensor is ``qweight``; unknown names still raise."""
    layer = Int8Linear.from_float(torch.randn(32, 32), name="layers.3.attention.qkv")
    assert layer.weight is None and "weight" not in layer.state_dict()
    with pytest.raises(AttributeError, match="no_such"):
        layer.no_such


def test_bad_inputs_name_the_layer():
    layer = Int8Linear.from_float(torch.randn(32, 48), name="blk.1.ff")
    with pytest.raises(ValueError, match=r"blk.1.ff expects inputs \[..., 48\]"):
        layer(torch.randn(3, 47))
    with pytest.raises(ValueError, match="smoothing vector for blk.2 has 5 entries, the layer has K=48"):
        Int8Linear.from_float(torch.randn(32, 48), smooth=torch.ones(5), name="blk.2")
    with pytest.raises(ValueError, match="finite and positive"):
        Int8Linear.from_float(torch.randn(32, 48), smooth=-torch.ones(48))
    assert layer(torch.randn(0, 48)).shape == (0, 32)


def test_comfy_lowvram_contract_attributes():
    """ComfyUI's ModelPatcher moves/counts only modules with parameters or ``comfy_cast_weights``."""
    layer = Int8Linear.from_float(torch.randn(32, 48))
    assert hasattr(layer, "comfy_cast_weights") and layer.weight_function == [] and layer.bias_function == []
    assert list(layer.parameters()) == []


def test_offloaded_layer_runs_on_the_activation_device():
    """lowvram: ComfyUI may leave the layer on the offload device; the forward copies its tensors to the
    activation's device for the call (here 'meta' stands in for the GPU) and leaves the module where it is."""
    layer = Int8Linear.from_float(torch.randn(32, 48), torch.randn(32), smooth=torch.ones(48), name="blk.0.qkv")
    y = layer(torch.empty(2, 5, 48, device="meta"))
    assert y.device.type == "meta" and y.shape == (2, 5, 32)
    assert layer.qweight.device.type == "cpu" and layer.inv_smooth.device.type == "cpu"
