"""Shipped tuned tables (kernel/tuned, issue 38 item 1): a GPU's seed file stands in for every timing a new user's
first sample would run (GEMM tiles and tail splits, int8-vs-float dispatch, attention backends); the user's own
cache wins; a seed of another GPU, or a disabled one, is ignored; a seed config that fails to build is tuned, with
one log line; bench/checks/tuned_tables.py builds the seed from cache files the real classes wrote; tuning logs its
progress and a summary.

Run: bash scripts/test.sh tests/test_tuned_tables.py
"""
import json
import logging
import math
import types

import pytest
import torch

import kernel.tuned
from kernel import autotune, config
from kernel.tuned import progress
from quant import attention, dispatch
from launch_standins import int8_layer

H200 = "NVIDIA H200"
CANDS = autotune.hopper_configs()[:4]
KEY = autotune.ConfigCache.key(3072, 3072, 4096)
SEED_CFG = CANDS[2]


@pytest.fixture
def seeds(tmp_path, monkeypatch):
    """Seeds on, read from an empty folder of this test; an empty cache folder; no in-process decisions."""
    folder = tmp_path / "tuned"
    folder.mkdir()
    monkeypatch.setattr(kernel.tuned, "ENABLED", True)
    monkeypatch.setattr(kernel.tuned, "SEED_DIR", folder)
    monkeypatch.setattr(progress, "QUIET_S", None)  # summaries only from finish()
    progress.finish()
    dispatch.forget()
    attention._DISK_CACHES.clear()
    with config.override(INT8_FUSED_CACHE_DIR=str(tmp_path / "cache")):
        (tmp_path / "cache").mkdir()
        yield folder
    dispatch.forget()
    attention._DISK_CACHES.clear()
    progress.finish()


def _write_seed(folder, gpu=H200, name=None, **sections):
    doc = {"format": 1, "gpu": gpu, "measured_with": {
        "gemm": {"triton": "3.4.0"}, "dispatch": {"decisions": dispatch.DECISIONS_VERSION, "torch": "2.8.0"},
        "attention": {"torch": "2.8.0"}}}
    doc.update({s: {} for s in kernel.tuned.SECTIONS}, **sections)
    path = folder / f"{name or kernel.tuned.slug(gpu)}.json"
    path.write_text(json.dumps(doc))
    return path


class Clock:
    """A fake ``time_fn`` (ms by tile, CANDS[0] fastest) and ``check`` that count their calls."""

    def __init__(self, fail=()):
        self.timed, self.checked, self.fail = [], [], list(fail)

    def time_fn(self, cfg):
        self.timed.append(cfg)
        return 1.0 + CANDS.index(cfg) if cfg in CANDS else 9.0

    def check(self, cfg):
        self.checked.append(cfg)
        if cfg in self.fail:
            raise RuntimeError("out of resources: shared memory, Required: 999999")


# ---------------------------------------------------------------- GEMM configs
def test_gemm_seed_is_used_without_timing_and_not_written(seeds):
    _write_seed(seeds, gemm={KEY: SEED_CFG})
    path = autotune.cache_file(H200, "3.6.0")
    clock = Clock()
    got = autotune.pick_config(autotune.ConfigCache(path, gpu=H200), KEY, CANDS, clock.time_fn, check=clock.check)
    assert got == SEED_CFG and clock.timed == [] and clock.checked == [SEED_CFG]
    assert not path.exists()  # the seed stays the pack's: the user's file holds only what this GPU timed
    assert progress.snapshot()["seeded"].get("gemm", 0) >= 1
    # a key the seed lacks is tuned as before, and only that key is written
    other = autotune.ConfigCache.key(3072, 12288, 4096)
    assert autotune.pick_config(autotune.ConfigCache(path, gpu=H200), other, CANDS, clock.time_fn) == CANDS[0]
    assert clock.timed[:len(CANDS)] == CANDS
    assert list(json.loads(path.read_text())["configs"]) == [other]


def test_user_cache_entry_overrides_the_seed(seeds):
    _write_seed(seeds, gemm={KEY: SEED_CFG, KEY + "_T32_split": {"SPLIT": 3}})
    path = autotune.cache_file(H200, "3.6.0")
    autotune.ConfigCache(path).put(KEY, CANDS[1], {"gpu": H200})
    autotune.ConfigCache(path).put(KEY + "_T32_split", {"SPLIT": 1}, {"gpu": H200})
    cache, clock = autotune.ConfigCache(path, gpu=H200), Clock()
    assert autotune.pick_config(cache, KEY, CANDS, clock.time_fn, check=clock.check) == CANDS[1]
    assert cache.get(KEY + "_T32_split") == {"SPLIT": 1}
    assert clock.timed == [] and clock.checked == []


def test_seed_of_another_gpu_or_disabled_is_ignored(seeds, monkeypatch):
    _write_seed(seeds, gemm={KEY: SEED_CFG})
    # the same slug, another exact name: not this GPU's table
    _write_seed(seeds, gpu="NVIDIA  H100", name=kernel.tuned.slug("NVIDIA H100"), gemm={KEY: SEED_CFG})
    for gpu in ("NVIDIA H100 80GB HBM3", "NVIDIA H100", "NVIDIA H200 as sm_89"):
        clock = Clock()
        cache = autotune.ConfigCache(autotune.cache_file(gpu, "3.6.0"), gpu=gpu)
        assert autotune.pick_config(cache, KEY, CANDS, clock.time_fn, check=clock.check) == CANDS[0], gpu
        assert clock.timed[:len(CANDS)] == CANDS and clock.checked == [], gpu
    monkeypatch.setattr(kernel.tuned, "ENABLED", False)  # how a bench of cold tuning turns the tables off
    clock = Clock()
    cache = autotune.ConfigCache(autotune.cache_file(H200, "3.6.0"), gpu=H200)
    assert autotune.pick_config(cache, KEY, CANDS, clock.time_fn, check=clock.check) == CANDS[0]
    assert clock.timed[:len(CANDS)] == CANDS


def test_seed_config_that_fails_to_build_is_tuned_with_one_log_line(seeds, caplog):
    key2 = autotune.ConfigCache.key(3072, 12288, 4096)
    s8 = {**autotune.s8_configs(False)[0]}
    key3 = autotune.ConfigCache.key(3072, 15360, 4096, s8=True)
    _write_seed(seeds, gemm={KEY: SEED_CFG, key2: CANDS[3], key3: s8})
    path = autotune.cache_file(H200, "3.6.0")
    cache, clock = autotune.ConfigCache(path, gpu=H200), Clock(fail=[SEED_CFG, CANDS[3]])
    with caplog.at_level(logging.DEBUG, logger="int8_fused"):
        assert autotune.pick_config(cache, KEY, CANDS, clock.time_fn, check=clock.check) == CANDS[0]
        assert autotune.pick_config(cache, key2, CANDS, clock.time_fn, check=clock.check) == CANDS[0]
        # an s8 seed where the candidates offer no s8 tile (the switch off, or a Triton without the s8 path)
        assert autotune.pick_config(cache, key3, CANDS, clock.time_fn, check=clock.check) == CANDS[0]
    assert clock.checked == [SEED_CFG, CANDS[3]]  # the s8 seed is not even built
    assert clock.timed.count(CANDS[1]) == 3  # every key tuned: each candidate timed once a key
    warns = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warns) == 1 and KEY in warns[0] and "out of resources" in warns[0] and "tuning it" in warns[0]
    assert set(json.loads(path.read_text())["configs"]) == {KEY, key2, key3}  # the tuned winners are the user's
    assert cache.get(KEY) == CANDS[0]  # the failed seed is not served again


def test_select_config_on_a_stand_in_h200_takes_tile_and_split_from_the_seed(seeds, monkeypatch, first_call_tuning):
    """``kernel.gemm.select_config``'s GPU path (H200 properties, launches recorded, do_bench failing the test):
    tile and tail split come from the seed, each run once (the check), nothing timed; without the seed the same
    call times every candidate."""
    import triton
    from kernel import gemm, s8wgmma, tailsplit
    props = types.SimpleNamespace(name=H200, major=9, minor=0, multi_processor_count=132,
                                  shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472,
                                  regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: H200)
    for memo in ("_TUNED", "_CACHES"):
        monkeypatch.setattr(gemm, memo, {})
    monkeypatch.setattr(tailsplit, "_SLOTS", {})
    launched, timed = [], []
    monkeypatch.setattr(gemm, "launch_int8_gemm", lambda a, asc, w, ws, b, out, cfg: launched.append(cfg))

    def do_bench(fn, **kw):
        fn()
        timed.append(launched[-1])
        return 1.0
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    cuda = torch.device("cuda", 0)
    a_q = types.SimpleNamespace(shape=(4096, 12288), device=cuda)
    w_q = types.SimpleNamespace(shape=(4608, 12288))
    key = autotune.ConfigCache.key(4608, 12288, 4096, s8wgmma.usable(cuda))
    tile = autotune.hopper_configs()[4]
    _write_seed(seeds, gemm={key: tile, key + "_T32_split": {"SPLIT": 2}})
    cfg = gemm.select_config(a_q, None, w_q, None, None, object())
    assert cfg == {**tile, "SPLIT": 2} and timed == [] and launched == [tile, {**tile, "SPLIT": 2}]
    monkeypatch.setattr(kernel.tuned, "ENABLED", False)
    for memo in ("_TUNED", "_CACHES"):
        monkeypatch.setattr(gemm, memo, {})
    gemm.select_config(a_q, None, w_q, None, None, object())
    assert len(timed) >= len(autotune.candidates((9, 0), 232448, 4096))


# ---------------------------------------------------------------- dispatch decisions
def test_dispatch_takes_the_seeds_decision_without_timing(seeds, monkeypatch):
    """An Int8Linear under INT8_FUSED_DISPATCH=auto as on a GPU (CPU tensors, timing allowed, ``measure`` failing
    the test): the seed sends M <= 16 to float and M <= 128 to int8; the user's file wins for M <= 64; the output is
    the float64 reference of the path chosen."""
    from quant.quantize import quantize_per_token_ref
    _write_seed(seeds, dispatch={"M16_N40_K72_bias_float32": {"path": "float", "int8_ms": 0.03, "float_ms": 0.01},
                                 "M64_N40_K72_bias_float32": {"path": "float"},
                                 "M128_N40_K72_bias_float32": {"path": "int8"}})
    path = dispatch.cache_path(H200, "t", "3.6.0")
    dispatch.DecisionCache(path).put("M64_N40_K72_bias_float32", {"path": "int8"}, {"gpu": H200})
    monkeypatch.setattr(dispatch, "_can_time", lambda dev: True)
    monkeypatch.setattr(dispatch, "_device_cache", lambda dev: dispatch.DecisionCache(path, gpu=H200))
    monkeypatch.setattr(dispatch, "measure", lambda layer, x: pytest.fail("timed a shape the seed holds"))
    layer = int8_layer(40, 72, True, True, 3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100, 72, generator=g)
    w = layer.qweight.double() * layer.weight_scale.double()[:, None] / layer.smooth.double()[None, :]
    y = layer(x[:5])
    ref = x[:5].double() @ w.t() + layer.bias.double()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5  # weight-only: the float path ran
    y = layer(x)
    a_q, a_s = quantize_per_token_ref(x, layer.inv_smooth)
    ref = (a_q.double() @ layer.qweight.double().t()) * a_s.double()[:, None] * layer.weight_scale.double() \
        + layer.bias.double()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5  # W8A8: the int8 path ran
    layer(x[:40])
    assert dict(layer.dispatch_calls) == {"float": 1, "int8": 2}  # M 40: the user's int8 over the seed's float
    assert set(json.loads(path.read_text())["decisions"]) == {"M64_N40_K72_bias_float32"}


def test_dispatch_seed_of_another_decisions_version_is_ignored(seeds, monkeypatch):
    doc = _write_seed(seeds, dispatch={"M16_N40_K72_bias_float32": {"path": "float"}})
    data = json.loads(doc.read_text())
    data["measured_with"]["dispatch"]["decisions"] = "v2"
    doc.write_text(json.dumps(data))
    cache = dispatch.DecisionCache(dispatch.cache_path(H200, "t", "3.6.0"), gpu=H200)
    assert cache.get("M16_N40_K72_bias_float32") is None


# ---------------------------------------------------------------- attention backends
def test_attention_auto_takes_the_seeds_backend_without_probing(seeds, first_call_tuning):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g) for n in (5, 7, 7))
    text = attention.key_text(attention.shape_key(q, k, None))
    _write_seed(seeds, attention={text: {"backend": "efficient", "ms": {"efficient": 0.1}}})
    router = attention.Router("auto", time_fn=lambda n, r: pytest.fail("probed a shape the seed holds"),
                              cache=attention.disk_cache(q.device, gpu=H200), probe_devices=("cpu",))
    out = router(lambda *a, **kw: pytest.fail("ComfyUI's function ran"), q, k, v, 4, skip_reshape=True,
                 skip_output_reshape=True)
    s = q.double() @ k.double().transpose(-1, -2) * 8 ** -0.5
    assert torch.allclose(out.double(), torch.softmax(s, -1) @ v.double(), atol=1e-5)
    assert router.winners == {attention.shape_key(q, k, None): "efficient"}
    # another GPU's cache: probed as before
    probed = []
    other = attention.Router("auto", time_fn=lambda n, r: probed.append(n) or 1.0,
                             cache=attention.disk_cache(q.device, gpu="NVIDIA A100-SXM4-80GB"), probe_devices=("cpu",))
    other(None, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert sorted(probed) == sorted(attention.PROBED)


def test_attention_seed_keys_drop_the_device_index():
    base = "B1_H24_Hkv24_Lq4608_Lk4608_D128_bfloat16_mask-none_"
    assert kernel.tuned.attention_key(base + "cuda:1") == base + "cuda"
    assert kernel.tuned.attention_key(base + "cuda:0_int8ok") == base + "cuda_int8ok"
    assert kernel.tuned.attention_key(base + "cpu") == base + "cpu"


# ---------------------------------------------------------------- the bench tool
def test_bench_tool_builds_a_seed_from_cache_files_the_real_classes_wrote(seeds, tmp_path, capsys):
    from bench.checks import tuned_tables
    run = tmp_path / "run" / "autotune"
    run.mkdir(parents=True)
    split = KEY + "_T32_split"
    with config.override(INT8_FUSED_CACHE_DIR=str(run)):
        gemm_file = autotune.ConfigCache(autotune.cache_file(H200, "3.4.0"))
        autotune.pick_config(gemm_file, KEY, CANDS, Clock().time_fn, {"gpu": H200, "triton": "3.4.0"})
        gemm_file.put(split, {"SPLIT": 2}, {"gpu": H200, "triton": "3.4.0"})
        autotune.ConfigCache(autotune.cache_file(H200 + " as sm_89", "3.4.0")).put(
            KEY, CANDS[3], {"gpu": H200 + " as sm_89", "triton": "3.4.0"})  # a forced generation: not a seed
        decisions = dispatch.DecisionCache(dispatch.cache_path(H200, "2.8.0+cu128", "3.4.0"))
        decisions.put("M16_N40_K72_bias_bfloat16", {"path": "float", "int8_ms": 0.03, "float_ms": 0.01, "m": 5},
                      {"gpu": H200, "torch": "2.8.0+cu128"})
        (run / "dispatch-v2-NVIDIA-H200-torch-2.8.0-cu128-triton-3.4.0.json").write_text(
            json.dumps({"gpu": H200, "decisions": {"M32_N40_K72_bias_bfloat16": {"path": "float"}}}))
        att = attention.disk_cache(torch.device("cpu"), gpu=H200)
        text = "B1_H24_Hkv24_Lq4608_Lk4608_D128_bfloat16_mask-none_cuda"
        att.put(text + ":0", {"backend": "cudnn", "ms": {"cudnn": 0.5, "flash": 0.7}},
                {"gpu": H200, "torch": torch.__version__})
        att.put(text + ":1", {"backend": "flash", "ms": {}}, {"gpu": H200, "torch": torch.__version__})
        att.put("B9_bogus", {"backend": "nonsense"})
    out = tmp_path / "seeds"
    assert tuned_tables.main([str(run), "--out", str(out)]) == 0
    doc = json.loads((out / "NVIDIA-H200.json").read_text())
    assert [p.name for p in out.iterdir()] == ["NVIDIA-H200.json"]
    assert doc["gpu"] == H200 and doc["format"] == 1
    assert doc["gemm"] == {KEY: CANDS[0], split: {"SPLIT": 2}}
    assert doc["dispatch"] == {"M16_N40_K72_bias_bfloat16": {"path": "float", "int8_ms": 0.03, "float_ms": 0.01,
                                                             "m": 5}}
    assert doc["attention"] == {text: {"backend": "cudnn", "ms": {"cudnn": 0.5, "flash": 0.7}}}
    assert doc["measured_with"] == {"gemm": {"triton": "3.4.0"},
                                    "dispatch": {"decisions": dispatch.DECISIONS_VERSION, "torch": "2.8.0+cu128",
                                                 "triton": "3.4.0"},
                                    "attention": {"torch": torch.__version__}}
    printed = capsys.readouterr().out
    assert "decisions v2" in printed and "forced tile generation" in printed
    # the seed as the pack reads it: a fresh cache on that GPU times nothing
    kernel.tuned.SEED_DIR = out
    clock = Clock()
    fresh = autotune.ConfigCache(tmp_path / "user" / "gemm.json", gpu=H200)
    assert autotune.pick_config(fresh, KEY, CANDS, clock.time_fn, check=clock.check) == CANDS[0]
    assert fresh.get(split) == {"SPLIT": 2} and clock.timed == []
    assert attention.disk_cache(torch.device("cpu"), gpu=H200).get(text + ":3")["backend"] == "cudnn"
    # a second run merges: same versions keep the old keys and take the new values
    second = tmp_path / "run2"
    second.mkdir()
    with config.override(INT8_FUSED_CACHE_DIR=str(second)):
        again = autotune.ConfigCache(autotune.cache_file(H200, "3.4.0"))
        again.put(split, {"SPLIT": 3}, {"gpu": H200, "triton": "3.4.0"})
        again.put("N64_K64_M16", CANDS[1], {"gpu": H200, "triton": "3.4.0"})
    assert tuned_tables.main([str(second), "--out", str(out)]) == 0
    doc = json.loads((out / "NVIDIA-H200.json").read_text())
    assert doc["gemm"] == {KEY: CANDS[0], split: {"SPLIT": 3}, "N64_K64_M16": CANDS[1]}
    assert doc["dispatch"] and doc["attention"]  # sections the second run lacks are kept
    assert tuned_tables.main(["--show", str(out / "NVIDIA-H200.json")]) == 0
    assert "NVIDIA H200: 3 gemm, 1 dispatch, 1 attention" in capsys.readouterr().out


# ---------------------------------------------------------------- progress while tuning
def test_tuning_logs_progress_and_a_summary_and_the_hook_sees_it(seeds, caplog, monkeypatch):
    path = autotune.cache_file(H200, "3.6.0")
    cache, seen, told = autotune.ConfigCache(path, gpu=H200), [], []

    def time_fn(cfg):
        seen.append(progress.snapshot())
        return 1.0 + CANDS.index(cfg)
    monkeypatch.setattr(progress.PROGRESS, "listeners", [lambda snap: told.append((snap["active"], snap["shapes"]))])
    with caplog.at_level(logging.INFO, logger="int8_fused"):
        autotune.pick_config(cache, KEY, CANDS, time_fn)
        autotune.pick_config(cache, autotune.ConfigCache.key(3072, 12288, 64), CANDS[:2], time_fn)
        line = progress.finish()
    assert told == [(True, 1), (False, 1), (True, 2), (False, 2), (False, 0)]  # start, end, start, end, summary
    now = seen[0]
    assert now["active"] and now["current"]["kind"] == "GEMM" and now["shapes"] == 1
    assert now["current"]["label"] == "N=3072 K=3072 M<=4096" and now["current"]["detail"] == "4 candidates"
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert "INT8 autotune: shape 1 GEMM N=3072 K=3072 M<=4096: 4 candidates" in msgs
    assert "INT8 autotune: shape 2 GEMM N=3072 K=12288 M<=64: 2 candidates" in msgs
    assert line in msgs and line.startswith("INT8 autotune: tuned 2 shapes in ") and f"cached in {path}" in line
    after = progress.snapshot()
    assert not after["active"] and after["shapes"] == 0 and after["last_summary"] == line
    assert progress.finish() is None  # nothing tuned since


def test_expected_total_shows_in_the_progress_line(seeds, caplog):
    progress.expect(12)
    with caplog.at_level(logging.INFO, logger="int8_fused"):
        autotune.pick_config(autotune.ConfigCache(autotune.cache_file(H200, "3.6.0")), KEY, CANDS[:1], lambda c: 1.0)
    assert any(r.getMessage() == "INT8 autotune: shape 1/12 GEMM N=3072 K=3072 M<=4096: 1 candidate"
               for r in caplog.records)
    assert math.isfinite(progress.snapshot()["seconds"])
