"""quant/dispatch.py: per-shape int8/float dispatch of fused_triton layers (issue 14 item 5).

On the CPU nothing is timed: the decision rule is a pure function of two timings (tested here with given numbers),
the cache is a JSON file (round trip, merge, atomic write, corrupt file ignored with a warning), and
``INT8_FUSED_DISPATCH=int8|float`` forces each path so both are checked against independent float64 references.
The ``auto`` path's timing step is replaced by a fake clock (``measure``) and a fake "can time" device check, so
the whole decide -> cache -> run -> count chain runs on CPU tensors. bench/shapes.py times it on the GPU.

Run: TRITON_INTERPRET=1 python -m pytest tests/test_dispatch.py -q
"""
import json
import logging
import math

import pytest
import torch
from torch import nn

pytest.importorskip("triton")
from kernel import autotune, config  # noqa: E402
from quant import dispatch  # noqa: E402
from quant.linear import Int8Linear  # noqa: E402
from quant.quantize import quantize_per_token_ref  # noqa: E402
from launch_standins import int8_layer  # noqa: E402


@pytest.fixture(autouse=True)
def fresh(tmp_path):
    """An empty decision cache folder and no in-process decisions, for every test."""
    dispatch.forget()
    with config.override(INT8_FUSED_CACHE_DIR=str(tmp_path)):
        yield tmp_path
    dispatch.forget()


def _layer(n=40, k=72, bias=True, smooth=True, seed=0) -> Int8Linear:
    return int8_layer(n, k, bias, smooth, seed)


def _x(m, k, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    if m > 3:
        x[:, 3] *= 20  # an outlier channel, as DiTs have
    return x.to(dtype)


def _w8a8_ref(x2, layer) -> torch.Tensor:
    """float64 W8A8: the reference quantizer on x / smooth, exact integer products, both scales, bias."""
    a_q, a_s = quantize_per_token_ref(x2, layer.inv_smooth)
    acc = a_q.double() @ layer.qweight.double().t()  # exact (|acc| < 2**53)
    y = acc * a_s.double()[:, None] * layer.weight_scale.double()[None, :]
    return y if layer.bias is None else y + layer.bias.double()[None, :]


def _float_ref(x2, layer) -> torch.Tensor:
    """float64 weight-only: x @ (dequantized W / smooth).T + bias."""
    w = layer.qweight.double() * layer.weight_scale.double()[:, None]
    if layer.smooth is not None:
        w = w / layer.smooth.double()[None, :]
    y = x2.double() @ w.t()
    return y if layer.bias is None else y + layer.bias.double()[None, :]


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- the decision rule (pure)
@pytest.mark.parametrize("t8, tf, incumbent, want", [
    (1.0, 2.0, "int8", "int8"),        # int8 faster
    (2.0, 1.0, "int8", "float"),       # float clearly faster
    (1.0, 1.0, "int8", "int8"),        # exact tie: the incumbent (int8 keeps its memory saving)
    (1.02, 1.0, "int8", "int8"),       # float 2 % faster: inside the margin, no flip
    (1.04, 1.0, "int8", "float"),      # float 4 % faster: beyond the 3 % margin
    (1.0, 1.02, "float", "float"),     # hysteresis: an earlier float decision survives int8 being 2 % faster
    (1.0, 1.04, "float", "int8"),      # ... but not 4 %
    (math.nan, 1.0, "int8", "float"),  # a failed int8 timing counts as infinitely slow
    (1.0, math.inf, "int8", "int8"),
    (None, 1.0, "int8", "float"),
    (1.0, -1.0, "int8", "int8"),       # a negative time is garbage: ignored
    (math.inf, math.nan, "float", "float"),  # both failed: the incumbent
])
def test_decide(t8, tf, incumbent, want):
    assert dispatch.decide(t8, tf, incumbent=incumbent) == want


@pytest.mark.parametrize("t8, tf, g8, gf, incumbent, want", [
    (0.030, 0.030, 0.024, 0.0196, "int8", "float"),   # costs tie (host-bound), float's GPU time 18 % lower
    (0.030, 0.0295, 0.020, 0.0199, "int8", "int8"),   # ... GPU times within the margin: the incumbent
    (0.030, 0.0305, 0.024, 0.0196, "int8", "float"),  # float's cost 1.7 % higher: still a tie, GPU decides
    (0.030, 0.032, 0.010, 0.020, "int8", "int8"),     # int8's GPU time lower: int8
    (0.030, 0.035, 0.024, 0.0196, "int8", "int8"),    # int8's cost beyond the margin: no GPU tie-break
    (0.030, 0.030, 0.0196, 0.024, "float", "int8"),   # the same rule for a float incumbent
    (0.030, 0.030, None, 0.010, "int8", "float"),     # int8's GPU time failed: infinitely slow
    (0.030, 0.030, 0.024, math.nan, "int8", "int8"),  # float's GPU time failed
])
def test_decide_ties_go_by_gpu_time(t8, tf, g8, gf, incumbent, want):
    assert dispatch.decide(t8, tf, incumbent=incumbent, int8_gpu_ms=g8, float_gpu_ms=gf) == want


def test_decide_margin_and_bad_incumbent():
    assert dispatch.decide(1.02, 1.0, margin=0.0) == "float"
    assert dispatch.decide(1.5, 1.0, margin=0.6) == "int8"
    with pytest.raises(ValueError, match="incumbent"):
        dispatch.decide(1.0, 1.0, incumbent="bf16")


def test_shape_key_buckets_m_like_the_gemm_autotuner():
    assert dispatch.shape_key(77, 4608, 4608, False, torch.bfloat16) == "M128_N4608_K4608_nobias_bfloat16"
    assert dispatch.shape_key(100, 4608, 4608, False, torch.bfloat16) == dispatch.shape_key(
        128, 4608, 4608, False, torch.bfloat16)
    assert dispatch.shape_key(1, 18432, 3072, True, torch.float16) == "M16_N18432_K3072_bias_float16"
    assert dispatch.m_bucket(0) == dispatch.m_bucket(1) == autotune.m_bucket(1)


def test_unknown_mode_warns_and_means_auto(caplog):
    with config.override(INT8_FUSED_DISPATCH="fastest"), caplog.at_level(logging.WARNING, "int8_fused"):
        assert dispatch.mode() == "auto"
    assert "INT8_FUSED_DISPATCH" in caplog.text
    with config.override(INT8_FUSED_DISPATCH="FLOAT"):
        assert dispatch.mode() == "float"
    assert config.get("INT8_FUSED_DISPATCH") == "auto"  # the default
    assert "INT8_FUSED_DISPATCH" in config.markdown_table()


# ---------------------------------------------------------------- the cache file
def test_cache_file_sits_next_to_the_gemm_autotune_cache(fresh):
    p = dispatch.cache_path("NVIDIA H200", "2.11.0+cu130", "3.6.0")
    assert p.parent == autotune.cache_file("NVIDIA H200", "3.6.0").parent == fresh
    assert p.name.startswith("dispatch-") and "H200" in p.name and "3.6.0" in p.name and p.suffix == ".json"


def test_cache_round_trip_merge_and_atomic_write(fresh, monkeypatch):
    atomic = __import__("kernel.atomic", fromlist=["atomic_write"])
    writes = []
    real = atomic.atomic_write
    monkeypatch.setattr(atomic, "atomic_write", lambda path, fn, **kw: writes.append(path) or real(path, fn, **kw))
    path = fresh / "dispatch-test.json"
    a = dispatch.DecisionCache(path)
    entry = {"path": "float", "int8_ms": 0.05, "float_ms": 0.02, "m": 77}
    a.put("M128_N4608_K4608_nobias_bfloat16", entry, {"gpu": "NVIDIA H200"})
    assert writes == [path]
    assert [p.name for p in fresh.iterdir()] == [path.name]  # no temporary left behind
    data = json.loads(path.read_text())
    assert data["gpu"] == "NVIDIA H200" and data["decisions"]["M128_N4608_K4608_nobias_bfloat16"] == entry
    # a second process reads it; a third adds a shape: both survive (merge on write)
    b = dispatch.DecisionCache(path)
    assert b.get("M128_N4608_K4608_nobias_bfloat16") == entry
    dispatch.DecisionCache(path).put("M16_N18432_K3072_bias_bfloat16", {"path": "int8", "m": 1})
    a.put("M1024_N3000_K1000_bias_float16", {"path": "int8", "m": 1000})
    assert set(json.loads(path.read_text())["decisions"]) == {
        "M128_N4608_K4608_nobias_bfloat16", "M16_N18432_K3072_bias_bfloat16", "M1024_N3000_K1000_bias_float16"}


@pytest.mark.parametrize("text", ["{not json", '{"decisions": [1, 2]}', "[]", '{"other": 1}'])
def test_corrupt_cache_file_is_ignored_with_a_log_line(fresh, caplog, text):
    path = fresh / "dispatch-bad.json"
    path.write_text(text)
    cache = dispatch.DecisionCache(path)
    with caplog.at_level(logging.WARNING, "int8_fused"):
        assert cache.get("M16_N8_K8_nobias_float32") is None
        assert cache.get("anything else") is None
    assert caplog.text.count("ignoring the unreadable decision cache") == 1 and str(path) in caplog.text
    cache.put("M16_N8_K8_nobias_float32", {"path": "int8"})  # rewritten as a valid file
    assert json.loads(path.read_text())["decisions"] == {"M16_N8_K8_nobias_float32": {"path": "int8"}}


def test_entries_with_an_unknown_path_are_dropped(fresh):
    path = fresh / "dispatch-x.json"
    path.write_text(json.dumps({"decisions": {"a": {"path": "bf16"}, "b": {"path": "float"}, "c": 3}}))
    cache = dispatch.DecisionCache(path)
    assert cache.get("a") is None and cache.get("c") is None and cache.get("b") == {"path": "float"}


# ---------------------------------------------------------------- forced paths, numerically
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias, smooth", [(True, True), (False, False), (True, False)])
def test_forced_paths_match_independent_references(dtype, bias, smooth):
    layer = _layer(bias=bias, smooth=smooth)
    x = _x(2 * 9, 72, dtype).reshape(2, 9, 72)  # leading dims are flattened and restored
    x2 = x.reshape(-1, 72)
    w8a8, wonly = _w8a8_ref(x2, layer), _float_ref(x2, layer)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # fp32 epilogue / bf16 output rounding
    with config.override(INT8_FUSED_DISPATCH="int8"):
        y8 = layer(x)
    with config.override(INT8_FUSED_DISPATCH="float"):
        yf = layer(x)
    assert y8.shape == yf.shape == (2, 9, 40) and y8.dtype == yf.dtype == dtype
    assert _rel(y8.reshape(-1, 40), w8a8) < tol, "int8 path != float64 W8A8 reference"
    assert _rel(yf.reshape(-1, 40), wonly) < tol, "float path != float64 weight-only reference"
    # the two paths differ by the activation quantization only (a W8A8-sized difference, not a bug-sized one)
    assert _rel(yf.reshape(-1, 40), w8a8) < 0.05
    assert dict(layer.dispatch_calls) == {"int8": 1, "float": 1}


def test_int8_path_agrees_with_torch_int_mm_when_available():
    layer = _layer(n=32, k=64, bias=True, smooth=True)
    x2 = _x(24, 64)
    a_q, a_s = quantize_per_token_ref(x2, layer.inv_smooth)
    try:
        acc = torch._int_mm(a_q, layer.qweight.t())
    except RuntimeError:
        pytest.skip("torch._int_mm does not run on this CPU build")
    ref = acc.double() * a_s.double()[:, None] * layer.weight_scale.double()[None, :] + layer.bias.double()
    with config.override(INT8_FUSED_DISPATCH="int8"):
        assert _rel(layer(x2), ref) < 1e-6


def test_float_weight_made_once_and_only_for_layers_that_run_float(monkeypatch):
    made = []
    real = dispatch.dequantized
    monkeypatch.setattr(dispatch, "dequantized", lambda layer, dt: made.append(dt) or real(layer, dt))
    a, b = _layer(seed=1), _layer(seed=2)
    x = _x(5, 72)
    with config.override(INT8_FUSED_DISPATCH="int8"):
        a(x), a(x)
    assert made == [] and not any(k[0] == "dispatch_float" for k in a.derived.tensors if isinstance(k, tuple))
    with config.override(INT8_FUSED_DISPATCH="float"):
        b(x), b(x), b(x[:2])
        b(x.to(torch.bfloat16))
    assert made == [torch.float32, torch.bfloat16]  # one copy per dtype, reused across calls and M
    b.to(torch.device("cpu"))  # unchanged device: kept
    b._apply(lambda t: t)      # ComfyUI moving / casting: dropped, made again on the next float call
    with config.override(INT8_FUSED_DISPATCH="float"):
        b(x)
    assert made == [torch.float32, torch.bfloat16, torch.float32]


def _spy_slow_forward(monkeypatch):
    """Counts calls of Int8Linear's full forward (``_forward``): a hot float-path call does not make one."""
    calls = []
    real = Int8Linear._forward
    monkeypatch.setattr(Int8Linear, "_forward", lambda self, x: calls.append(tuple(x.shape)) or real(self, x))
    return calls


def test_hot_float_path_is_a_bare_f_linear_on_the_kept_weight(monkeypatch):
    """After a call shape ran on the float path, its later calls are one F.linear on the kept float weight: the
    same output bit for bit, counted, without the full forward; other shapes and dtypes keep their own entries."""
    slow = _spy_slow_forward(monkeypatch)
    layer = _layer()
    x3 = _x(6, 72).reshape(2, 3, 72)
    with config.override(INT8_FUSED_DISPATCH="float"):
        first = layer(x3)
        again = [layer(x3) for _ in range(3)]
        other = layer(x3[:1])
        other_again = layer(x3[:1])
        half = layer(x3.to(torch.bfloat16))
    assert slow == [(2, 3, 72), (1, 3, 72), (2, 3, 72)]  # each (shape, dtype) once through the full forward
    assert all(torch.equal(y, first) for y in again) and torch.equal(other_again, other)
    assert first.shape == (2, 3, 40) and half.dtype == torch.bfloat16
    assert _rel(first.reshape(6, 40), _float_ref(x3.reshape(6, 72), layer)) < 1e-5
    w, b = dispatch.float_operands(layer, torch.float32)
    assert torch.equal(again[0], torch.nn.functional.linear(x3, w, b))
    assert dict(layer.dispatch_calls) == {"float": 7}


def test_hot_float_path_is_dropped_when_its_conditions_change(monkeypatch):
    slow = _spy_slow_forward(monkeypatch)
    layer = _layer()
    x = _x(5, 72)
    with config.override(INT8_FUSED_DISPATCH="float"):
        layer(x), layer(x)
    assert len(slow) == 1
    with config.override(INT8_FUSED_DISPATCH="int8"):  # another mode: the int8 path, through the full forward
        y8 = layer(x)
    assert len(slow) == 2 and layer.dispatch_calls["int8"] == 1
    assert _rel(y8, _w8a8_ref(x, layer)) < 1e-5
    with config.override(INT8_FUSED_DISPATCH="float"):
        layer(x)                      # hot again (the float mode's entry)
        assert len(slow) == 2
        dispatch.forget()             # new decisions: stale
        layer(x)
        assert len(slow) == 3
        old = layer.weight
        layer.weight = layer.weight.detach().clone()  # ComfyUI swapping the int8 weight: another tensor
        assert not layer.derived.hot  # nothing keeps the old weight (or its float copy) alive
        del old
        y_new = layer(x)
        assert len(slow) == 4 and _rel(y_new, _float_ref(x, layer)) < 1e-5
        layer(x)
        assert len(slow) == 4
        layer._apply(lambda t: t)     # a move / cast by ComfyUI drops it
        layer(x)
        assert len(slow) == 5
        layer.weight_function = [lambda w: w]  # a LoRA patch after Apply: refused on the hot path too
        with pytest.raises(RuntimeError, match="BEFORE 'Apply Fused INT8 GEMM'"):
            layer(x)
        layer.weight_function = []


def test_hot_path_under_auto_keeps_each_shapes_decision(fresh, fake_gpu, monkeypatch, first_call_tuning):
    """Under auto each call shape stays on the path decided for it: after its first (full) call M 5 runs the hot
    float path and M 100 the hot int8 path (its prepared launches, kernel/plan.py), each with correct results."""
    fake_gpu["times"] = {16: (0.030, 0.010), 128: (0.010, 0.030)}  # M <= 16 float, M 100 int8
    slow = _spy_slow_forward(monkeypatch)
    layer = _layer(seed=7)
    x = _x(100, 72)
    for _ in range(3):
        assert _rel(layer(x[:5]), _float_ref(x[:5], layer)) < 1e-5
        assert _rel(layer(x), _w8a8_ref(x, layer)) < 1e-5
    assert slow == [(5, 72), (100, 72)]
    assert dict(layer.dispatch_calls) == {"float": 3, "int8": 3}


@pytest.mark.parametrize("mode", ["int8", "float", "auto"])
def test_zero_rows_work_on_every_path(mode):
    layer = _layer()
    with config.override(INT8_FUSED_DISPATCH=mode):
        y = layer(torch.zeros(0, 72))
        y3 = layer(torch.zeros(2, 0, 72, dtype=torch.bfloat16))
    assert y.shape == (0, 40) and y3.shape == (2, 0, 40) and y3.dtype == torch.bfloat16
    assert sum(layer.dispatch_calls.values()) == 0  # nothing ran
    x0 = torch.zeros(0, 72)  # and the two paths themselves, called directly
    assert dispatch.float_linear(x0, layer).shape == (0, 40)
    assert dispatch.int8_linear(x0, layer).shape == (0, 40)


# ---------------------------------------------------------------- auto: decide, cache, run, count
@pytest.fixture
def fake_gpu(monkeypatch):
    """``auto`` as on a GPU, on CPU tensors: timing allowed, a fake clock {M bucket: (int8 ms, float ms)}."""
    clock = {"calls": [], "times": {}}

    def fake_measure(layer, x2d):
        clock["calls"].append(x2d.shape[0])
        t8, tf, *gpu = clock["times"][dispatch.m_bucket(x2d.shape[0])]
        g8, gf = gpu or (t8, tf)  # GPU times: the costs unless given
        return dispatch.Cost(t8, g8), dispatch.Cost(tf, gf), dispatch.dequantized(layer, x2d.dtype)

    monkeypatch.setattr(dispatch, "_can_time", lambda dev: True)
    monkeypatch.setattr(dispatch, "_device_cache", lambda dev: dispatch.DecisionCache(
        dispatch.cache_path("Fake GPU", "t", "3.6.0")))
    monkeypatch.setattr(dispatch, "_meta", lambda dev: {"gpu": "Fake GPU"})
    monkeypatch.setattr(dispatch, "measure", fake_measure)
    return clock


def test_auto_times_each_shape_once_caches_it_and_runs_the_winner(fresh, fake_gpu, first_call_tuning):
    fake_gpu["times"] = {16: (0.030, 0.010),   # GEMV: float faster -> float
                         64: (0.020, 0.0199),  # a tie within the margin, on GPU time too -> int8
                         128: (0.010, 0.030),  # int8 faster
                         256: (0.025, 0.025, 0.020, 0.015)}  # a host-bound tie, float's GPU time lower -> float
    a, b = _layer(seed=3), _layer(seed=4)  # same shape: one decision serves both
    x = _x(100, 72)
    ya = a(x[:5])
    assert fake_gpu["calls"] == [5]
    b(x[:3])  # same bucket (M <= 16), other layer: decided already
    a(x[:64]), a(x[:100]), b(x[:40])
    assert fake_gpu["calls"] == [5, 64, 100]  # buckets 16, 64, 128 timed once each (M 40 is bucket 64)
    assert dict(a.dispatch_calls) == {"float": 1, "int8": 2} and dict(b.dispatch_calls) == {"float": 1, "int8": 1}
    b(_x(200, 72))
    assert fake_gpu["calls"] == [5, 64, 100, 200] and dict(b.dispatch_calls) == {"float": 2, "int8": 1}
    assert _rel(ya, _float_ref(x[:5], a)) < 1e-5  # the float path really ran
    data = json.loads(dispatch.cache_path("Fake GPU", "t", "3.6.0").read_text())
    assert {k: v["path"] for k, v in data["decisions"].items()} == {
        "M16_N40_K72_bias_float32": "float", "M64_N40_K72_bias_float32": "int8",
        "M128_N40_K72_bias_float32": "int8", "M256_N40_K72_bias_float32": "float"}
    assert data["decisions"]["M16_N40_K72_bias_float32"]["float_ms"] == 0.010 and data["gpu"] == "Fake GPU"
    assert data["decisions"]["M256_N40_K72_bias_float32"]["float_gpu_ms"] == 0.015
    # a new process: decisions come from the file, nothing is timed
    dispatch.forget()
    c = _layer(seed=5)
    c(x[:7]), c(x[:99]), c(_x(256, 72))
    assert fake_gpu["calls"] == [5, 64, 100, 200] and dict(c.dispatch_calls) == {"float": 2, "int8": 1}


def test_auto_without_a_gpu_runs_int8_and_times_nothing(monkeypatch):
    monkeypatch.setattr(dispatch, "measure", lambda *a: pytest.fail("timed on the CPU"))
    layer = _layer()
    layer(_x(3, 72))
    assert dict(layer.dispatch_calls) == {"int8": 1}


def test_a_failed_timing_falls_back_to_int8(fresh, fake_gpu, caplog, first_call_tuning):
    def boom(layer, x2d):
        raise torch.cuda.OutOfMemoryError("no room for the float copy")
    dispatch.measure = boom  # fake_gpu's monkeypatch restores it
    layer = _layer()
    with caplog.at_level(logging.WARNING, "int8_fused"):
        layer(_x(3, 72))
    assert dict(layer.dispatch_calls) == {"int8": 1} and "could not time" in caplog.text
    assert not dispatch.cache_path("Fake GPU", "t", "3.6.0").exists()  # not cached: timed again next process


def test_other_backends_do_not_dispatch():
    layer = _layer()
    layer.backend = "dequant_bf16"
    with config.override(INT8_FUSED_DISPATCH="float"):
        layer(_x(3, 72))
    assert sum(layer.dispatch_calls.values()) == 0
    assert dispatch.report_line(nn.Sequential(layer)) is None  # no fused_triton layer: no line


# ---------------------------------------------------------------- the report line
def test_report_line_counts_what_actually_ran(fresh, fake_gpu, first_call_tuning):
    model = nn.Sequential(_layer(seed=1), _layer(seed=2), _layer(n=24, k=72, seed=3), nn.Linear(4, 4))
    line = dispatch.report_line(model)
    assert line.startswith("dispatch auto: 3 fused_triton linears, no calls yet")
    fake_gpu["times"] = {16: (0.03, 0.01), 64: (0.01, 0.03)}
    x = _x(40, 72)
    model[0](x[:4]), model[0](x[:40]), model[1](x[:40]), model[2](x[:2])
    c = dispatch.counts(model)
    assert c == {"layers": 3, "int8_layers": 2, "float_layers": 2, "int8_calls": 2, "float_calls": 2, "lora_layers": 0,
                 "float_shapes": ["M<=16 24x72", "M<=16 40x72"]}
    line = dispatch.report_line(model)
    assert line == ("dispatch auto: 2 linears ran int8, 2 on float (float faster, unless forced): 2 shapes "
                    "M<=16 24x72, M<=16 40x72; calls int8 2, float 2")
    with config.override(INT8_FUSED_DISPATCH="int8"):
        model[1](x[:4])
        assert dispatch.report_line(model).startswith("dispatch int8: 2 linears ran int8")  # model[1] again
    with config.override(INT8_FUSED_DISPATCH="float"):
        model[1](x[:40])
    assert "M<=64 40x72 (forced)" in dispatch.report_line(model)
    assert dispatch.report_line(model).endswith("calls int8 3, float 3")


# ---------------------------------------------------------------- the INT8 path's host work: one launch for M <= 16
def _launches(monkeypatch):
    import kernel.gemm as kg
    import kernel.quantize as kq
    seen = []
    for mod in (kg, kq):
        real = mod.launch
        monkeypatch.setattr(mod, "launch", lambda fn, *a, _real=real, **kw: seen.append(fn.__name__) or _real(fn, *a, **kw))
    return seen


@pytest.mark.parametrize("m, dtype, smooth, bias", [(1, torch.bfloat16, True, True), (5, torch.float32, False, False),
                                                     (16, torch.float16, True, False), (3, torch.bfloat16, False, True),
                                                     (40, torch.bfloat16, True, True), (150, torch.float16, False, True)])
def test_small_m_one_launch_is_bit_identical_to_quantize_then_gemm(monkeypatch, m, dtype, smooth, bias):
    """Up to 16 rows on a GPU; under the interpreter up to ``INTERPRETER_ONE_LAUNCH_ROWS`` (40 and 150 rows: more
    than one BLOCK_M tile of the interpreter's run tile, rows of a tile past M masked)."""
    import kernel
    assert m <= max(kernel.linear.SMALL_M_ROWS, kernel.linear.INTERPRETER_ONE_LAUNCH_ROWS)
    g = torch.Generator().manual_seed(m)
    k, n = 200, 36
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    if m > 2:
        x[1] = 0                   # an all-zero row: scale 0, zeros
        x[2, 7] = float("nan")     # a row with NaN: scale NaN, as the quantizer
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    ws = torch.rand(n, generator=g) * 1e-2
    b = torch.randn(n, generator=g) if bias else None
    inv = (torch.rand(k, generator=g) + 0.5) if smooth else None
    seen = _launches(monkeypatch)
    y = kernel.int8_linear(x.reshape(1, m, k), w, ws, b, inv)
    assert seen == ["_w8a8_small_m_kernel"] and y.shape == (1, m, n) and y.dtype == dtype
    a_q, a_s = kernel.quantize_per_token(x, inv)
    ref = kernel.int8_gemm(a_q, a_s, w, ws, b, out_dtype=dtype)
    assert torch.equal(y.reshape(m, n).nan_to_num(-9.0), ref.nan_to_num(-9.0))
    # and the GPU's route for those rows (two launches above 16) gives them too
    monkeypatch.setattr(kernel.linear, "INTERPRETER_ONE_LAUNCH_ROWS", kernel.linear.SMALL_M_ROWS)
    before = len(seen)
    two = kernel.int8_linear(x, w, ws, b, inv)
    assert torch.equal(two.nan_to_num(-9.0), ref.nan_to_num(-9.0))
    assert len(seen) - before == (1 if m <= kernel.linear.SMALL_M_ROWS else 2), seen[before:]
    if m > 2:
        assert torch.isnan(y[0, 2]).all() and not torch.isnan(y[0, 0]).any()


def test_two_launches_above_16_rows_or_for_long_k(monkeypatch):
    import kernel
    monkeypatch.setattr(kernel.linear, "INTERPRETER_ONE_LAUNCH_ROWS", kernel.linear.SMALL_M_ROWS)  # a GPU's routes
    seen = _launches(monkeypatch)
    w, ws = torch.randint(-127, 128, (8, 64), dtype=torch.int8), torch.rand(8)
    kernel.int8_linear(torch.randn(17, 64), w, ws)  # 17 rows: the row loop where QUANT_ROW_LOOP x 4 "SMs" < 17
    quantizer = "_quant_rows_loop_kernel" if 0 < kernel.quantize.QUANT_ROW_LOOP * 4 < 17 else "_quant_rows_seg_kernel"
    assert seen == [quantizer, "_int8_gemm_kernel"]
    seen.clear()
    monkeypatch.setattr(kernel.linear, "SMALL_M_MAX_K", 32)  # kernel.linear: the module whose int8_linear reads it
    kernel.int8_linear(torch.randn(2, 64), w, ws)
    assert seen == ["_quant_rows_seg_kernel", "_int8_gemm_kernel"]


def test_small_m_path_checks_its_operands():
    import kernel
    w, ws = torch.randint(-127, 128, (8, 64), dtype=torch.int8), torch.rand(8)
    with pytest.raises(ValueError, match="K mismatch"):
        kernel.int8_linear(torch.randn(2, 32), w, ws)
    with pytest.raises(ValueError, match="w_scale"):
        kernel.int8_linear(torch.randn(2, 64), w, torch.rand(5))
    with pytest.raises(ValueError, match="inv_smooth"):
        kernel.int8_linear(torch.randn(2, 64), w, ws, None, torch.rand(3))
    with pytest.raises(ValueError, match="x has dtype"):
        kernel.int8_linear(torch.randn(2, 64).to(torch.float64), w, ws)
    y = kernel.int8_linear(torch.randn(2, 64), w, torch.tensor([0.5]))  # a per-tensor scale broadcasts
    assert y.shape == (2, 8)


def test_medium_m_tiles_are_candidates_only_for_short_m():
    h200 = (9, 0), 232448
    mid = autotune.candidates(*h200, autotune.m_bucket(77))
    assert all(c in mid for c in autotune.medium_m_configs())
    assert any(c["BLOCK_N"] <= 64 for c in mid)
    big = autotune.candidates(*h200, autotune.m_bucket(4608))
    assert not any(c in big for c in autotune.medium_m_configs() if c not in autotune.hopper_configs())
    for c in autotune.medium_m_configs():  # wgmma-eligible, and within an H200's shared memory
        assert c["BLOCK_M"] % 64 == 0 and c["num_warps"] % 4 == 0 and c["BLOCK_K"] >= 32
        assert autotune.fits_smem(c, 232448)
    rtx = autotune.candidates((8, 9), 101376, autotune.m_bucket(77))
    assert rtx and all(autotune.fits_smem(c, 101376) for c in rtx)


# ---------------------------------------------------------------- the Apply node's report line (ComfyUI in-process)
def test_apply_report_line_and_counts_in_a_real_model(comfy_inprocess, pack, caplog):
    """Apply fused_triton to the Flux miniature (fusion off, so every layer is a per-linear Int8Linear): the Apply log
    gets the dispatch line; after sampling calls the line counts what ran, per path (the pack's own module
    instances: its config, its dispatch)."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models  # noqa: F401
    import test_apply as ta
    node = pack.nodes.apply.ApplyFusedInt8GEMM()
    mp = ta.tiny(comfy, "flux")
    cfg, disp = pack.kernel.config, pack.quant.dispatch
    # fusion off: fused Flux blocks always run INT8; dispatch is for the per-linear layers
    with caplog.at_level(logging.INFO, logger="int8_fused"), cfg.override(INT8_FUSED_FUSION=False):
        q = ta.apply(node, mp, "fused_triton")
    n = q.int8_report.quantized
    assert q.int8_report.dispatch == (f"dispatch auto: {n} fused_triton linears, no calls yet (each shape timed on "
                                      "its first call (GPU), cached)")
    assert any(q.int8_report.dispatch in r.getMessage() for r in caplog.records)
    with cfg.override(INT8_FUSED_DISPATCH="float"):
        yf = ta.run(comfy, q, "flux")
    line = disp.report_line(q.model)
    c = disp.counts(q.model)
    assert c["float_layers"] == c["layers"] == n and c["int8_calls"] == 0 and c["float_calls"] >= n
    assert line.startswith(f"dispatch auto: 0 linears ran int8, {n} on float (float faster, unless forced): ")
    assert line.count("(forced)") == len(c["float_shapes"]) >= 1
    with cfg.override(INT8_FUSED_DISPATCH="int8"):
        y8 = ta.run(comfy, q, "flux")
    c = disp.counts(q.model)
    assert c["int8_layers"] == n and c["int8_calls"] == c["float_calls"]
    ref = ta.run(comfy, mp, "flux")
    assert ((yf - ref).norm() / ref.norm()).item() < ((y8 - ref).norm() / ref.norm()).item() < 0.05
    # fusion on: every selected layer sits in a fused Flux block, which always runs INT8: nothing to dispatch
    fused = ta.apply(node, mp, "fused_triton")
    assert fused.int8_report.quantized == n and fused.int8_report.dispatch is None


def test_time_pair_with_a_fake_cuda_clock(monkeypatch):
    """time_call / time_pair logic (CUDA events faked by a host clock): the slower function is measured slower,
    each timed call is preceded by an L2 flush and a GPU stall that covers its issue, and the effective time is
    max(GPU, host)."""
    import time

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    flushes, order = [], []

    class Flush:
        def zero_(self):
            flushes.append(1)
            order.append("flush")

    class Recorded(Event):
        def record(self):
            order.append("event")
            super().record()

    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: order.append(("stall", cycles)))
    monkeypatch.setattr(torch.cuda, "Event", Recorded)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dispatch, "flush_buffer", lambda dev: Flush())
    slow, fast = dispatch.time_pair(lambda: time.sleep(0.004), lambda: time.sleep(0.001), rounds=2, reps=3)
    assert slow.eff > 3.0 and 0.9 < fast.eff < slow.eff and len(flushes) == 2 * 2 * 3
    assert slow.gpu > 3.0 and 0.9 < fast.gpu < slow.gpu  # the fake events bracket the call: GPU time = its time
    # per call: the flush, then the GPU held (>= 1 ms at 2 GHz) while the host issues it, then the events around it
    assert order == ["flush", ("stall", dispatch.STALL_CYCLES), "event", "event"] * (2 * 2 * 3)
    assert dispatch.STALL_CYCLES >= 2_000_000
    assert dispatch.effective_ms(0.01, 0.03) == 0.03 and dispatch.effective_ms(0.05, 0.03) == 0.05


def test_small_vectors_are_pinned_where_cuda_is(monkeypatch):
    """ComfyUI copies weight_scale / smooth to the GPU at every sample's load: where CUDA is present they live in
    pinned memory (quant/linear.py _pin), their values unchanged; weight and bias are left as they are."""
    import quant.linear as L
    pinned = []

    def fake_pin(t):
        pinned.append(t)
        return t.clone()  # a new tensor, as pin_memory() makes one
    monkeypatch.setattr(L, "_pin", lambda t: fake_pin(t) if t.device.type == "cpu" else t)
    w = torch.randint(-127, 128, (8, 16), dtype=torch.int8)
    s, sm = torch.rand(8) + 0.1, torch.rand(16) + 0.5
    layer = L.Int8Linear.from_quantized(w, s, torch.zeros(8), sm)
    assert [tuple(t.shape) for t in pinned] == [(8,), (16,)]  # weight_scale, then smooth: nothing else
    assert torch.equal(layer.weight_scale, s) and torch.equal(layer.smooth, sm)
    assert not isinstance(layer.weight_scale, torch.nn.Parameter) and layer.weight_scale.data_ptr() != s.data_ptr()
    assert layer.weight.data_ptr() == w.data_ptr()  # the int8 weight as given (no copy)


def test_pin_keeps_tensors_where_there_is_no_cuda():
    import quant.linear as L
    t = torch.rand(4)
    assert torch.cuda.is_available() or L._pin(t) is t


def test_pin_failure_falls_back_to_pageable_once(monkeypatch):
    """A machine with CUDA but no pinned memory to give (pin_memory raises): the vector stays as it is, and pinning
    is not tried again."""
    import quant.linear as L
    tries = []

    class NoPin(torch.Tensor):
        def pin_memory(self, *a, **kw):
            tries.append(1)
            raise RuntimeError("cudaHostAlloc failed")
    monkeypatch.setattr(L, "_PIN_OK", [True])
    t = torch.rand(4).as_subclass(NoPin)
    assert L._pin(t) is t and L._PIN_OK == [False]
    assert L._pin(t) is t and tries == [1]
