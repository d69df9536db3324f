"""Calibration library (quant/calibrate.py, calib_capture.py, calib_smooth.py): plain torch, no ComfyUI."""
import json
import math
import os

import pytest
import torch
from torch import nn

from quant.calib_capture import ActivationCapture, LayerStats
from quant.calib_smooth import (ALPHA_GRID, search_alpha, smooth_factors, w8a8_error,
                                weight_col_absmax)
from quant.calibrate import Calibration, LayerCalibration, build_calibration, static_act_scales


def outlier_acts(M, K, n_out, lo, hi, seed):
    """Gaussian activations with ``n_out`` input channels scaled by lo..hi (the DiT outlier pattern)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    idx = torch.randperm(K, generator=g)[:n_out]
    x[:, idx] *= torch.linspace(lo, hi, n_out)
    w = torch.randn(96, K, generator=g) / K ** 0.5
    return x, w


def ref_w8a8_error(x, w, s=None):
    """Independent float64 reference: per-token / per-channel absmax quantization, round half even."""
    x, w = x.double(), w.double()
    if s is not None:
        x, w = x / s.double(), w * s.double()
    qa = x.abs().amax(1, keepdim=True) / 127
    qw = w.abs().amax(1, keepdim=True) / 127
    xq = torch.round(x / qa).clamp(-127, 127) * qa
    wq = torch.round(w / qw).clamp(-127, 127) * qw
    ref = x @ w.t()
    return float((xq @ wq.t() - ref).norm() / ref.norm())


# ---------------------------------------------------------------------- SmoothQuant math
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_smoothquant_lowers_error_on_outlier_channels(seed):
    x, w = outlier_acts(384, 256, 6, 20.0, 80.0, seed)
    s = smooth_factors(x.abs().amax(0), weight_col_absmax(w), 0.5)
    e_plain, e_smooth = w8a8_error(x, w), w8a8_error(x, w, s)
    # the layer error matches an independent float64 quantization within fp32 rounding
    assert e_plain == pytest.approx(ref_w8a8_error(x, w), rel=2e-3)
    assert e_smooth == pytest.approx(ref_w8a8_error(x, w, s.double()), rel=2e-3)
    # stated factor: >= 3x lower output error with alpha = 0.5 (measured ~4x)
    assert e_plain / e_smooth >= 3.0, (e_plain, e_smooth)


def test_smooth_factors_formula_normalisation_and_dead_channels():
    g = torch.Generator().manual_seed(3)
    a = torch.rand(64, generator=g) * 10 + 0.1
    wc = torch.rand(64, generator=g) + 0.05
    a[5], wc[9] = 0.0, 0.0
    s = smooth_factors(a, wc, 0.6)
    raw = a.double() ** 0.6 / wc.double() ** 0.4
    live = torch.ones(64, dtype=torch.bool)
    live[[5, 9]] = False
    ratio = s.double()[live] / raw[live]  # a single positive factor relates s to the formula
    assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-5)
    assert s[5] == 1 and s[9] == 1
    assert abs(float(s.double()[live].log().mean())) < 1e-5  # geometric mean 1
    assert s.dtype == torch.float32 and (s > 0).all()
    with pytest.raises(ValueError, match="alpha"):
        smooth_factors(a, wc, 1.5)


@pytest.mark.parametrize("seed,lo,hi", [(0, 5, 30), (1, 20, 80), (2, 50, 200), (3, 1, 1)])
def test_alpha_search_never_worse_than_half(seed, lo, hi):
    x, w = outlier_acts(256, 128, 4, lo, hi, seed)
    act = x.abs().amax(0)
    e_half = w8a8_error(x, w, smooth_factors(act, weight_col_absmax(w), 0.5))
    a, s, e_best, errs = search_alpha(x, w, act)
    assert e_best <= e_half + 1e-12
    assert e_best == min(errs.values())
    assert set(errs) == {"none", *ALPHA_GRID}
    if a is None:
        assert s is None and e_best == errs["none"]


def test_error_backends_agree():
    x, w = outlier_acts(64, 128, 3, 10, 40, 5)
    s = smooth_factors(x.abs().amax(0), weight_col_absmax(w), 0.5)
    assert w8a8_error(x, w, s, "torch_int_mm") == pytest.approx(w8a8_error(x, w, s, "dequant_bf16"), rel=1e-3)
    with pytest.raises(ValueError, match="error backend"):
        w8a8_error(x, w, s, "fused_triton")


# ---------------------------------------------------------------------- capture
class Toy(nn.Module):
    """Two 'blocks' whose first linear sees injected outlier channels."""

    def __init__(self, K=64, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList()
        for _ in range(2):
            blk = nn.Module()
            blk.up = nn.Linear(K, 2 * K)
            blk.down = nn.Linear(2 * K, K)
            for lin in (blk.up, blk.down):
                lin.weight.data = torch.randn(lin.weight.shape, generator=g) / lin.in_features ** 0.5
            self.layers.append(blk)
        self.gain = torch.ones(K)
        self.gain[[3, 17, 40]] = torch.tensor([30.0, 60.0, 90.0])

    def forward(self, x):
        for blk in self.layers:
            x = x + blk.down(torch.relu(blk.up(x * self.gain))) / self.gain
        return x


def test_capture_statistics_exact_and_sample_capped():
    torch.manual_seed(0)
    model = Toy()
    named = [(f"layers.{i}.{p}", getattr(b, p)) for i, b in enumerate(model.layers) for p in ("up", "down")]
    seen = {n: [] for n, _ in named}
    handles = [m.register_forward_pre_hook(lambda mod, a, n=n: seen[n].append(a[0].detach().reshape(-1, a[0].shape[-1])))
               for n, m in named]
    cap = ActivationCapture(named, n_buckets=2, row_cap=50, seed=1)
    with cap:
        for step in range(4):
            cap.set_bucket(step // 2)
            model(torch.randn(3, 20, 64))
    for h in handles:
        h.remove()
    assert not cap.installed and all(not m._forward_pre_hooks for _, m in named)
    for n, _ in named:
        st, rows = cap.stats[n], seen[n]
        allx = torch.cat(rows)
        assert st.tokens == allx.shape[0] == 240
        assert torch.equal(st.act_absmax(), allx.abs().amax(0))
        assert torch.equal(st.bucket_absmax()[0], torch.cat(rows[:2]).abs().amax(0))
        assert torch.equal(st.bucket_absmax()[1], torch.cat(rows[2:]).abs().amax(0))
        tok = allx.abs().amax(1)
        ts = st.token_summary()
        assert ts["max"] == pytest.approx(float(tok.max())) and ts["mean"] == pytest.approx(float(tok.mean()), rel=1e-5)
        assert st.sample.shape == (50, st.in_features)
        # every sampled row is a real row, and the sample reaches beyond the first call
        idx = [int((allx == r).all(1).nonzero()[0]) for r in st.sample]
        assert max(idx) >= 60


def test_capture_hooks_removed_on_error():
    model = Toy()
    named = [("layers.0.up", model.layers[0].up)]
    cap = ActivationCapture(named)
    with pytest.raises(KeyboardInterrupt):
        with cap:
            model(torch.randn(2, 5, 64))
            raise KeyboardInterrupt
    assert not model.layers[0].up._forward_pre_hooks


def test_nonfinite_activations_name_the_layer():
    st = LayerStats("layers.3.ffn.w2", 8, 4)
    x = torch.randn(4, 8)
    x[1, 2] = float("nan")
    st.observe(x)
    with pytest.raises(ValueError, match="layers.3.ffn.w2.*NaN"):
        st.check_finite()


# ---------------------------------------------------------------------- building
def calibrate_toy(record=None, **kw):
    """Calibrate the toy on 3 steps (bucket = step % n_buckets). ``record``: a dict that receives
    {layer: [(bucket, input rows)]}, seen by hooks of the test's own, independent of the capture."""
    torch.manual_seed(1)
    model = Toy()
    named = [(f"layers.{i}.{p}", getattr(b, p)) for i, b in enumerate(model.layers) for p in ("up", "down")]
    cap = ActivationCapture(named, n_buckets=kw.pop("n_buckets", 1), row_cap=64)
    handles = [] if record is None else [
        m.register_forward_pre_hook(lambda mod, a, n=n: record.setdefault(n, []).append(
            (cap.bucket, a[0].detach().reshape(-1, a[0].shape[-1]).clone()))) for n, m in named]
    with cap:
        for step in range(3):
            cap.set_bucket(step % cap.n_buckets)
            model(torch.randn(2, 32, 64))
    for h in handles:
        h.remove()
    return build_calibration(cap, lambda n, m: m.weight, meta={"arch": "toy"}, **kw), cap, model


def test_build_calibration_smoothing_and_protection():
    cal, cap, _ = calibrate_toy(alpha=0.5, protect_top_k=1)
    assert set(cal.layers) == set(cap.stats)
    up = cal.layers["layers.0.up"]  # sees the outlier channels
    assert up.smooth is not None and up.alpha == 0.5 and up.err_smoothed < up.err_plain / 2
    worst = max(cal.layers.values(), key=lambda l: l.err)
    assert cal.protected_names() == [worst.name]
    cal_t, _, _ = calibrate_toy(alpha=0.5, protect_threshold=min(l.err for l in cal.layers.values()) * 1.0001)
    assert len(cal_t.protected_names()) == len(cal.layers) - 1
    text = cal.summary_text()
    assert "layers.0.up" in text and "1 kept in float" in text


def test_build_calibration_search_and_static_scales():
    seen = {}
    cal, cap, _ = calibrate_toy(record=seen, alpha_search=True, static_scales=True, n_buckets=3)
    fixed, _, _ = calibrate_toy(alpha=0.5)
    for n, l in cal.layers.items():
        assert l.err <= fixed.layers[n].err + 1e-12
        assert l.static_act_scale.shape == (3,)
        s = l.smooth.double() if l.smooth is not None else torch.ones(l.in_features, dtype=torch.float64)
        # reference from the raw inputs the test's own hooks saw: per bucket max_{t,j} |x[t, j] / s_j| / 127
        want = [max(float((x.double() / s).abs().max()) for b, x in seen[n] if b == k) / 127 for k in range(3)]
        torch.testing.assert_close(l.static_act_scale.double(), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-6, atol=0)
    assert cal.meta["alpha_mode"] == "search" and cal.meta["activation_scales"] == "static"


def test_static_scales_fill_unreached_bucket():
    ab = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    assert torch.equal(static_act_scales(ab, None), torch.tensor([2.0, 2.0]) / 127)


def test_empty_selection_and_unreached_layers_raise():
    with pytest.raises(ValueError, match="no linear layers were selected"):
        build_calibration(ActivationCapture([]), lambda n, m: m.weight)
    lin = nn.Linear(32, 32)
    with pytest.raises(ValueError, match="none of the 1 selected layers ran.*blk.lin"):
        build_calibration(ActivationCapture([("blk.lin", lin)]), lambda n, m: m.weight)


# ---------------------------------------------------------------------- files and checks
def test_round_trip_bit_exact(tmp_path):
    cal, _, _ = calibrate_toy(alpha_search=True, static_scales=True, n_buckets=2, protect_top_k=1)
    p = cal.save(tmp_path / "c.safetensors")
    back = Calibration.load(p)
    assert back.meta == json.loads(json.dumps(cal.meta))
    assert back.layers.keys() == cal.layers.keys()
    for n, l in cal.layers.items():
        b = back.layers[n]
        for f in ("name", "in_features", "out_features", "alpha", "protected", "err_plain", "err_smoothed"):
            assert getattr(b, f) == getattr(l, f), f
        for f in ("smooth", "static_act_scale"):
            x, y = getattr(l, f), getattr(b, f)
            assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y))
    assert os.listdir(tmp_path) == ["c.safetensors"]


def test_save_never_overwrites_and_leaves_no_temp(tmp_path, monkeypatch):
    cal, _, _ = calibrate_toy()
    p = tmp_path / "c.safetensors"
    cal.save(p)
    before = p.read_bytes()
    with pytest.raises(FileExistsError, match="exists"):
        cal.save(p)
    assert p.read_bytes() == before

    def half_write(tensors, path, metadata=None):  # a crash (disk full) in the middle of writing
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("No space left on device")
    import safetensors.torch
    monkeypatch.setattr(safetensors.torch, "save_file", half_write)
    with pytest.raises(OSError, match="No space"):
        cal.save(p, overwrite=True)
    with pytest.raises(OSError, match="No space"):
        cal.save(tmp_path / "d.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["c.safetensors"] and p.read_bytes() == before
    monkeypatch.undo()
    cal.save(p, overwrite=True)
    assert Calibration.load(p).layers.keys() == cal.layers.keys()


def test_empty_calibration_errors(tmp_path):
    with pytest.raises(ValueError, match="empty calibration"):
        Calibration({}).save(tmp_path / "e.safetensors")
    assert not os.listdir(tmp_path)
    from safetensors.torch import save_file
    save_file({}, str(tmp_path / "e.safetensors"), metadata={"format": "int8_fused_calibration",
                                                            "version": "1", "meta": "{}", "layers": "{}"})
    with pytest.raises(ValueError, match="empty calibration"):
        Calibration.load(tmp_path / "e.safetensors")
    save_file({"a": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match="not an INT8 calibration file"):
        Calibration.load(tmp_path / "m.safetensors")


def test_mismatched_model_named_in_errors():
    cal, _, model = calibrate_toy()
    named = [(f"layers.{i}.{p}", getattr(b, p)) for i, b in enumerate(model.layers) for p in ("up", "down")]
    cal.check_model(named)  # its own model passes
    other = dict(named)
    other["layers.1.down"] = nn.Linear(256, 64)
    del other["layers.0.up"]
    with pytest.raises(ValueError) as e:
        cal.check_model(other)
    msg = str(e.value)
    assert "layers.0.up" in msg and "layers.1.down" in msg and "[64, 128]" in msg and "[64, 256]" in msg
    with pytest.raises(ValueError, match=r"layers.1.down.*\[64, 128\].*\[64, 256\]"):
        cal.for_layer("layers.1.down", 64, 256)
    assert cal.for_layer("nope", 1, 1) is None
    assert cal.for_layer("layers.1.down", 64, 128) is cal.layers["layers.1.down"]


def test_weight_mismatches_tell_same_shaped_models_apart():
    cal, _, model = calibrate_toy()
    named = {f"layers.{i}.{p}": getattr(b, p) for i, b in enumerate(model.layers) for p in ("up", "down")}
    get = lambda n, m: m.weight
    assert cal.weight_mismatches(get, named) == []
    other = Toy(seed=5)  # same shapes, other weights (the other Ideogram 4 backbone, say)
    named2 = {f"layers.{i}.{p}": getattr(b, p) for i, b in enumerate(other.layers) for p in ("up", "down")}
    cal.check_model(named2)  # shapes alone cannot tell
    assert cal.weight_mismatches(get, named2) == list(named2)
    back = Calibration.load(cal.save(os.path.join(__import__("tempfile").mkdtemp(), "w.safetensors")))
    assert back.weight_mismatches(get, named) == [] and back.weight_mismatches(get, named2)


# ---------------------------------------------------------------------- damaged files, one "exists" type
def _damaged(path, smooth=(1.0, 1.0, 1.0, 1.0), **header):
    from safetensors.torch import save_file
    meta = {"format": "int8_fused_calibration", "version": "1", "meta": "{}",
            "layers": json.dumps({"a.b": {"in_features": 4, "out_features": 2, "alpha": 0.5, "protected": False,
                                          "err_plain": 0.1, "err_smoothed": 0.05}})}
    meta.update(header)
    save_file({"a.b.smooth": torch.tensor(smooth)}, str(path),
              metadata={k: v for k, v in meta.items() if v is not None})
    return path


@pytest.mark.parametrize("header,msg", [
    ({"layers": "{not json"}, "metadata entry 'layers' is not valid JSON"),
    ({"meta": None}, "metadata entry 'meta' is missing"),
    ({"meta": "[1]"}, "metadata entry 'meta' should be an object but is list"),
    ({"layers": '{"a.b": {"out_features": 2}}'}, "calibration layer 'a.b' lacks 'in_features'"),
    ({"layers": '{"a.b": [4, 2]}'}, "calibration layer 'a.b' is list, not an object"),
    ({"version": "one"}, "invalid calibration format version 'one'"),
])
def test_damaged_calibration_file_named(tmp_path, header, msg):
    from quant.formats import CheckpointError
    p = _damaged(tmp_path / "dmg.safetensors", **header)
    with pytest.raises(CheckpointError, match=r"dmg\.safetensors.*" + msg.replace("[", r"\[")):
        Calibration.load(p)


def test_nonpositive_smooth_in_calibration_refused(tmp_path):
    from quant.formats import CheckpointError
    p = _damaged(tmp_path / "s.safetensors", smooth=(1.0, -2.0, 1.0, 1.0))
    with pytest.raises(CheckpointError, match=r"s\.safetensors.*a\.b\.smooth holds non-positive"):
        Calibration.load(p)


def test_exists_error_is_one_type(tmp_path):
    from quant.formats import CheckpointError
    cal, _, _ = calibrate_toy()
    p = cal.save(tmp_path / "c.safetensors")
    with pytest.raises(FileExistsError, match=r"c\.safetensors already exists") as e:
        cal.save(p)
    assert isinstance(e.value, CheckpointError)  # the same type Save INT8 Model and the writers raise
