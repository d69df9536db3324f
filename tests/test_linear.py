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
    assert set(sd) == {"weight", "weight_scale", "bias", "smooth"}  # inv_smooth is derived, not saved
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


def test_weight_is_the_int8_parameter_and_old_qweight_files_load():
    """``weight`` is the int8 tensor (a no-grad Parameter ComfyUI can count, move and stage); ``qweight`` is
    an alias; state dicts saved under the old name ``qweight`` still load; unknown names still raise."""
    w = torch.randn(32, 32)
    layer = Int8Linear.from_float(w, torch.randn(32), name="layers.3.attention.qkv")
    assert isinstance(layer.weight, torch.nn.Parameter) and layer.weight.dtype == torch.int8
    assert layer.qweight is layer.weight and not layer.weight.requires_grad
    # per-channel symmetric: row n's scale is max|W[n]| / 127, by hand
    torch.testing.assert_close(layer.weight_scale, w.abs().amax(1) / 127)
    old = {("qweight" if k == "weight" else k): v.clone() for k, v in layer.state_dict().items()}
    fresh = Int8Linear(32, 32, bias=True)
    fresh.load_state_dict(old)
    assert torch.equal(fresh.weight, layer.weight)
    with pytest.raises(AttributeError, match="no_such"):
        layer.no_such


def test_weight_patches_after_quantization_are_refused():
    """A LoRA added after quantization reaches the layer through ComfyUI's ``set_weight`` (a float, merged
    weight) or its weight-function lists: both refuse with the fix; a plain int8 move is accepted."""
    layer = Int8Linear.from_float(torch.randn(16, 32), name="blk.0.o")
    moved = layer.weight.detach().clone()
    layer.set_weight(moved)
    assert layer.weight.data_ptr() == moved.data_ptr()
    with pytest.raises(RuntimeError, match="BEFORE 'Apply Fused INT8 GEMM'"):
        layer.set_weight(torch.randn(16, 32))
    layer.weight_function = [lambda t: t]
    with pytest.raises(RuntimeError, match="blk.0.o"):
        layer(torch.randn(2, 32))


def test_every_backend_refuses_non_float_inputs_alike():
    """int32 / int8 activations are refused with one message on every backend (no silent int32 output)."""
    w = torch.randn(16, 32)
    for backend in ("dequant_bf16", "torch_int_mm", "fused_triton", "comfy_kitchen", "fp8_rowwise"):
        layer = Int8Linear.from_float(w, backend=backend, name="blk.9")
        for dt in (torch.int32, torch.int8, torch.float64):
            with pytest.raises(TypeError, match=r"blk.9 takes torch.bfloat16, torch.float16, torch.float32 "
                                                 rf"activations, got {dt}"):
                layer(torch.ones(3, 32, dtype=dt))


def test_bad_inputs_name_the_layer():
    layer = Int8Linear.from_float(torch.randn(32, 48), name="blk.1.ff")
    with pytest.raises(ValueError, match=r"blk.1.ff expects inputs \[..., 48\]"):
        layer(torch.randn(3, 47))
    with pytest.raises(ValueError, match="smoothing vector for blk.2 has 5 entries, the layer has K=48"):
        Int8Linear.from_float(torch.randn(32, 48), smooth=torch.ones(5), name="blk.2")
    with pytest.raises(ValueError, match="finite and positive"):
        Int8Linear.from_float(torch.randn(32, 48), smooth=-torch.ones(48))
    assert layer(torch.randn(0, 48)).shape == (0, 32)


def test_comfy_memory_manager_contract_attributes():
    """ComfyUI's ModelPatcher counts, moves and pins Parameters, and hands ``comfy_cast_weights`` modules
    their weights through cast_bias_weight: weight and bias are no-grad Parameters, nothing is a buffer. The small
    vectors are not Parameters (DynamicVRAM would copy them to the GPU at every sample) but are state-dict entries
    (ComfyUI's module_size counts them, Save writes them) and load back, copied in place or assigned."""
    layer = Int8Linear.from_float(torch.randn(32, 48), torch.randn(32), smooth=torch.ones(48) * 2)
    assert hasattr(layer, "comfy_cast_weights") and layer.weight_function == [] and layer.bias_function == []
    params = dict(layer.named_parameters())
    assert set(params) == {"weight", "bias"}
    assert not any(p.requires_grad for p in params.values()) and list(layer.buffers()) == []
    assert not isinstance(layer.weight_scale, torch.nn.Parameter) and not layer.weight_scale.requires_grad
    sd = layer.state_dict()
    assert set(sd) == {"weight", "weight_scale", "bias", "smooth"}
    assert layer.nbytes() == 32 * 48 + 4 * (32 + 32 + 48)
    other = Int8Linear.from_float(torch.randn(32, 48), torch.randn(32), smooth=torch.ones(48))
    scale_before = other.weight_scale
    other.load_state_dict(sd)  # copied in place, as nn.Module loads a Parameter
    assert other.weight_scale is scale_before and torch.equal(other.weight_scale, layer.weight_scale)
    assert torch.equal(other.smooth, layer.smooth) and torch.equal(other.weight, layer.weight)
    third = Int8Linear.from_float(torch.randn(32, 48), torch.randn(32), smooth=torch.ones(48))
    third.load_state_dict(sd, assign=True)
    assert third.weight_scale.data_ptr() == sd["weight_scale"].data_ptr()  # taken as it is (no CUDA: no pinning)
    bad = {**sd, "weight_scale": torch.ones(31)}
    with pytest.raises(RuntimeError, match="size mismatch for weight_scale"):
        other.load_state_dict(bad)
    missing = {k: v for k, v in sd.items() if k != "smooth"}
    with pytest.raises(RuntimeError, match='Missing key.*"smooth"'):
        other.load_state_dict(missing)
    assert other.load_state_dict(missing, strict=False).missing_keys == ["smooth"]
    plain = Int8Linear.from_float(torch.randn(32, 48), torch.randn(32))  # no smoothing: a stored one is unexpected
    with pytest.raises(RuntimeError, match='Unexpected key.*"smooth"'):
        plain.load_state_dict(sd)
    # .to() / a cast moves them with the Parameters
    half = Int8Linear.from_float(torch.randn(32, 48), torch.randn(32), smooth=torch.ones(48)).to(torch.float64)
    assert half.weight_scale.dtype == torch.float64 and half.smooth.dtype == torch.float64
    assert half.weight.dtype == torch.int8


def test_managed_layer_fetches_through_the_installed_cast_once_per_call():
    """With ``comfy_cast_weights`` set (ComfyUI manages the weights), weight and bias come from the
    installed cast (ComfyUI's cast_bias_weight in the nodes package), released after the call; the small
    vectors are copied to the device once and reused, not per call. 'meta' stands in for the GPU."""
    import quant.linear as L
    w, b = torch.randn(32, 48), torch.randn(32)
    layer = Int8Linear.from_float(w, b, smooth=torch.ones(48) * 2, name="blk.0.qkv")
    calls, released = [], []

    def cast(lay, device):
        calls.append((lay.name, device.type))
        return lay.weight.to(device), lay.bias.to(device), lambda: released.append(lay.name)

    layer.comfy_cast_weights = True
    prev = L._COMFY_CAST  # the pack's nodes may have installed ComfyUI's (one quant.linear in the session)
    L.set_comfy_cast(cast)
    try:
        for _ in range(3):
            y = layer(torch.empty(2, 48, device="meta"))
        assert y.shape == (2, 32) and y.device.type == "meta"
        assert calls == [("blk.0.qkv", "meta")] * 3 and released == ["blk.0.qkv"] * 3
        with layer.operands(torch.device("meta")) as t1:
            s1, i1 = t1.weight_scale, t1.inv_smooth
        with layer.operands(torch.device("meta")) as t2:
            assert t2.weight_scale is s1 and t2.inv_smooth is i1  # one copy, reused
        layer.weight_scale = layer.weight_scale.detach() * 1  # ComfyUI swaps the tensor: copy remade
        with layer.operands(torch.device("meta")) as t3:
            assert t3.weight_scale is not s1
    finally:
        L.set_comfy_cast(prev)
    # on the layer's own device nothing is fetched: the layer's own tensors
    calls.clear()
    x = torch.randn(3, 48)
    ref = (x / 2) @ (w * 2).T + b  # smoothing is exact in exact arithmetic
    assert ((layer(x) - ref).norm() / ref.norm()).item() < 2e-2 and calls == []


def test_offloaded_layer_runs_on_the_activation_device():
    """lowvram: ComfyUI may leave the layer on the offload device; the forward copies its tensors to the
    activation's device for the call (here 'meta' stands in for the GPU) and leaves the module where it is."""
    layer = Int8Linear.from_float(torch.randn(32, 48), torch.randn(32), smooth=torch.ones(48), name="blk.0.qkv")
    y = layer(torch.empty(2, 5, 48, device="meta"))
    assert y.device.type == "meta" and y.shape == (2, 5, 32)
    assert layer.qweight.device.type == "cpu" and layer.inv_smooth.device.type == "cpu"
