"""The first call of a shape runs at once on a predicted config; the timing of its alternatives runs between samples
(kernel/deferred.py, kernel/retune.py, kernel/autotune.py ``choose`` / ``predicted``, quant/dispatch.py and
quant/attention.py ``predicted``). Fake clocks and stand-in launches on the CPU; the GPU figures are the bench's."""
import threading
import time
import types

import pytest
import torch

from kernel import autotune, config, deferred, gemm, retune, tailsplit
from quant import attention, dispatch

H200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                             shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472,
                             regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048)


# ------------------------------------------------------------------------------------------------ classes, guesses
@pytest.mark.parametrize("m,cls", [(1, "small"), (16, "small"), (17, "medium"), (256, "medium"), (257, "large"),
                                   (4608, "large"), (1 << 20, "large")])
def test_m_class_bounds(m, cls):
    assert autotune.m_class(m) == cls


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9), (9, 0), (12, 0)])
def test_predicted_configs_are_candidates_the_compile_targets_build_and_depend_on_the_class_only(cap):
    """Every guess is a candidate of its class on that target (tests/test_compile_targets.py builds each one for
    each target), and every M of a class gets the same first guess: a new resolution compiles nothing new."""
    targets = autotune.target_candidates(cap)
    for cls, ms in (("small", (1, 7, 16)), ("medium", (17, 77, 256)), ("large", (257, 2816, 4608, 14040, 65536))):
        firsts = set()
        for m in ms:
            for s8 in ((False, True) if cap == (9, 0) else (False,)):
                guesses = autotune.predicted(cap, None, m, s8=s8, persist=s8)
                assert guesses and all(g in targets[cls] or not s8 and g in autotune.candidates(cap, None, {
                    "small": 16, "medium": 256, "large": 16384}[cls]) for g in guesses)
                assert sorted(map(str, guesses)) == sorted(map(str, autotune.candidates(
                    cap, None, {"small": 16, "medium": 256, "large": 16384}[cls], s8=s8, persist=s8)))
                firsts.add((s8, str(guesses[0])))
        assert len(firsts) == (2 if cap == (9, 0) else 1), firsts   # one first guess per class (and s8 switch)


def test_predicted_large_tile_on_sm90_is_the_h200s_most_frequent_pick():
    g = autotune.predicted((9, 0), 232448, 4608, s8=True, persist=True)[0]
    assert g == {**autotune._cfg(128, 256, 128, 8, 3), "S8": True, "PERSIST": True}
    assert autotune.predicted((9, 0), 232448, 4608)[0] == autotune.hopper_configs()[0]
    assert autotune.predicted((8, 9), 101376, 4608)[0] == autotune.ampere_configs()[0]
    assert autotune.predicted((8, 9), 101376, 8)[0] == autotune.small_m_configs()[0]
    # the medium class shares the large class's tile until timed (one compile before the first sample)
    assert autotune.predicted((8, 6), 101376, 100)[0] == autotune.ampere_configs()[0]


@pytest.mark.parametrize("cap, smem", [((8, 0), 166912), ((8, 6), 101376), ((8, 9), 101376), ((9, 0), 232448),
                                       ((12, 0), 101376)])
def test_predicted_medium_tile_is_the_large_one_and_the_narrow_tiles_stay_candidates(cap, smem):
    for s8 in ((False, True) if cap == (9, 0) else (False,)):
        large = autotune.predicted(cap, smem, 4608, s8=s8, persist=s8)
        for m in (17, 77, 256):
            medium = autotune.predicted(cap, smem, m, s8=s8, persist=s8)
            assert medium[0] == large[0], (cap, s8, m)
            assert autotune.medium_m_configs()[0] in medium[1:]     # timed between samples


# ------------------------------------------------------------------------------------------------ choose
class _Cache(autotune.ConfigCache):
    """A real cache file with a seed table given as a dict."""

    def __init__(self, path, seed=None):
        super().__init__(path)
        self._seed_table = seed or {}

    def seed_get(self, key):
        return self._seed_table.get(key)

    def refuse_seed(self, key):
        self._seed_table.pop(key, None)


def _no_timing(c):
    raise AssertionError(f"timed {c} on the critical path")


def test_choose_in_background_times_nothing_and_queues_the_tuning(tmp_path):
    cache = _Cache(tmp_path / "c.json")
    guesses = autotune.predicted((8, 9), 101376, 4608)
    checked, later = [], []
    cfg = autotune.choose(cache, "N64_K64_M8192", [], guesses, "background", _no_timing,
                          check=checked.append, later=lambda what, e: later.append((what, e)))
    assert cfg == guesses[0] and checked == [guesses[0]] and later == [("tune", None)]
    assert cache.get("N64_K64_M8192", seed=False) is None          # nothing written before it is timed


def test_choose_takes_the_users_entry_then_the_seed_without_timing(tmp_path):
    cache = _Cache(tmp_path / "c.json", seed={"N64_K64_M4096": autotune.ampere_configs()[2]})
    own = autotune.ampere_configs()[1]
    cache.put("N64_K64_M8192", own)
    later = []
    guesses = autotune.predicted((8, 9), 101376, 4608)
    assert autotune.choose(cache, "N64_K64_M8192", [], guesses, "background", _no_timing, check=_no_timing,
                           later=lambda *a: later.append(a)) == own
    checked = []
    assert autotune.choose(cache, "N64_K64_M4096", [], guesses, "background", _no_timing, check=checked.append,
                           later=lambda *a: later.append(a)) == autotune.ampere_configs()[2]
    assert checked == [autotune.ampere_configs()[2]] and later == []   # a shipped tile is run once, not timed


def test_choose_keeps_the_class_config_in_use_and_queues_the_other(tmp_path):
    """A new bucket of a class that already runs (a new resolution): the compiled config now, never a build; the
    bucket's own entry is adopted later, and a bucket without one is timed later."""
    cache = _Cache(tmp_path / "c.json", seed={"N64_K64_M2048": autotune.ampere_configs()[3]})
    in_use = autotune.ampere_configs()[0]
    later = []
    for key, want in (("N64_K64_M2048", ("adopt", autotune.ampere_configs()[3])), ("N64_K64_M1024", ("tune", None))):
        later.clear()
        got = autotune.choose(cache, key, [in_use], autotune.predicted((8, 9), 101376, 2000), "background", _no_timing,
                              check=_no_timing, later=lambda what, e: later.append((what, e)))
        assert got == in_use and later == [want]
    cache.put("N64_K64_M512", in_use)   # the bucket's entry is the config in use: nothing to do later
    later.clear()
    assert autotune.choose(cache, "N64_K64_M512", [in_use], [], "background", _no_timing,
                           later=lambda *a: later.append(a)) == in_use and later == []
    # once a job has built the bucket's own entry, the bucket runs it
    other = autotune.ampere_configs()[3]
    assert autotune.choose(cache, "N64_K64_M2048", [in_use, other], [], "background", _no_timing,
                           later=lambda *a: later.append(a)) == other and later == []


def test_choose_skips_a_guess_that_does_not_build_and_names_the_key_when_none_does(tmp_path):
    cache = _Cache(tmp_path / "c.json")
    guesses = autotune.predicted((8, 9), 101376, 4608)

    def check(c):
        if c == guesses[0]:
            raise RuntimeError("out of resources")
    assert autotune.choose(cache, "N8_K8_M4096", [], guesses, "off", _no_timing, check=check) == guesses[1]

    def never(c):
        raise RuntimeError("out of resources")
    with pytest.raises(RuntimeError, match="N8_K8_M4096: no candidate config builds here"):
        autotune.choose(cache, "N8_K8_M4096", [], guesses, "off", _no_timing, check=never)


def test_choose_first_call_times_every_candidate_now(tmp_path):
    cache = _Cache(tmp_path / "c.json")
    cands = autotune.candidates((8, 9), 101376, 4096)
    times = {str(c): 1.0 + i for i, c in enumerate(cands)}
    times[str(cands[3])] = 0.5
    timed = []

    def time_fn(c):
        timed.append(c)
        return times[str(c)]
    assert autotune.choose(cache, "N8_K8_M4096", [], cands, "first_call", time_fn) == cands[3]
    assert len(timed) == len(cands) and cache.get("N8_K8_M4096", seed=False) == cands[3]


# ------------------------------------------------------------------------------------------------ the queue
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_queue_runs_jobs_once_each_and_drops_a_failing_one():
    q = deferred.Queue(clock=_Clock(), start_worker=False)
    ran = []
    assert q.submit("a", lambda stop: ran.append("a")) and not q.submit("a", lambda stop: ran.append("a2"))
    q.submit("bad", lambda stop: 1 / 0)
    q.submit("b", lambda stop: ran.append("b"))
    assert q.pending() == ["a", "bad", "b"] and not q.settled()
    assert q.drain() == 2 and ran == ["a", "b"] and q.failed == ["bad"] and q.settled()


def test_queue_idles_after_a_sample_and_a_stopped_job_goes_back_to_the_front():
    clock = _Clock()
    q = deferred.Queue(clock=clock, start_worker=False)
    assert q.idle()
    with q.busy():
        assert q.sampling() and not q.idle()
        with pytest.raises(deferred.Stopped):
            q.stop_check()
    assert not q.idle()              # a sample just ended
    clock.t += deferred.IDLE_S
    assert q.idle()
    pieces = []

    def job(stop):
        for i in range(3):
            stop()
            pieces.append(i)
    q.submit("j", job)
    q.submit("k", lambda stop: pieces.append("k"))
    calls = [0]

    def stop_at_second_piece():
        calls[0] += 1
        if calls[0] == 2:
            raise deferred.Stopped()
    assert q.drain(stop_at_second_piece) == 0 and q.stopped == ["j"] and q.pending() == ["j", "k"]
    assert pieces == [0]
    assert q.drain() == 2 and pieces == [0, 0, 1, 2, "k"]


def test_a_sample_that_starts_while_a_job_times_stops_it_at_its_next_piece(monkeypatch, caplog):
    """The worker thread: it starts a job only once no sample has run for IDLE_S; a sample that starts meanwhile
    (``busy``) enters at once, the job stops at its next piece (no result written) and is queued again; once the
    sample has ended and the idle time passed, the job runs to its end."""
    monkeypatch.setattr(deferred, "IDLE_S", 0.05)
    monkeypatch.setattr(deferred, "POLL_S", 0.01)
    caplog.set_level("INFO", logger="int8_fused")
    q = deferred.Queue()
    started, results, piece_s = threading.Event(), [], 0.02

    def job(stop):
        started.set()
        for _ in range(25):     # 25 pieces of 20 ms
            stop()
            time.sleep(piece_s)
        results.append("timed")
    try:
        with q.busy():
            q.submit("gemm N64_K64_M4096", job)
            time.sleep(0.15)
            assert not started.is_set()          # never while a sample runs
        assert started.wait(2.0)
        t0 = time.monotonic()
        with q.busy():                           # a sample starts while the job times
            entered = time.monotonic() - t0
            time.sleep(0.2)
            assert results == [] and q.stopped == ["gemm N64_K64_M4096"]
            assert q.pending() == ["gemm N64_K64_M4096"]
        assert entered < 0.01                    # the sample never waits for the job
        assert q.wait_settled(5.0) and results == ["timed"] and q.done == ["gemm N64_K64_M4096"]
        deadline = time.monotonic() + 2.0
        while "1 timing job(s) finished" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "INT8 background tuning: 1 timing job(s) finished between samples (1 stopped" in caplog.text
    finally:
        q.close()


def test_submit_queues_only_in_background_mode(monkeypatch):
    q = deferred.Queue(start_worker=False)
    monkeypatch.setattr(deferred, "QUEUE", q)
    for mode, queued in (("off", False), ("first_call", False), ("background", True)):
        with config.override(INT8_FUSED_TUNE=mode):
            assert deferred.submit(f"k-{mode}", lambda stop: None) is queued
    assert q.pending() == ["k-background"]


# ------------------------------------------------------------------------------------------------ select_config
@pytest.fixture
def stand_in_h200(monkeypatch, tmp_path):
    """``select_config`` as on an H200 without its shipped table (the s8 path off), on stand-in operands:
    launches recorded, ``do_bench`` a fake clock, a queue drained by the test."""
    import triton
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: H200)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    for memo in ("_TUNED", "_CACHES"):
        monkeypatch.setattr(gemm, memo, {})
    monkeypatch.setattr(tailsplit, "_SLOTS", {})
    monkeypatch.setattr(retune, "COMPILED", {})
    q = deferred.Queue(start_worker=False)
    monkeypatch.setattr(deferred, "QUEUE", q)
    monkeypatch.setattr(retune, "spec", lambda t: t)                    # the stand-ins are their own specs
    monkeypatch.setattr(retune, "fresh", lambda s: s)
    monkeypatch.setattr(retune, "run_on", lambda dev, fn, specs=(): fn())
    winner = autotune.hopper_configs()[1]
    st = types.SimpleNamespace(launched=[], timed=[], queue=q, winner=winner)

    def launch(a_q, a_scale, w_q, w_scale, bias, out, cfg):
        st.launched.append(cfg)

    def do_bench(fn, **kw):
        fn()
        c = st.launched[-1]
        st.timed.append(c)
        tile = {x: c[x] for x in winner}
        return (1.0 if tile == winner else 1.5) * (0.95 if c.get("SPLIT") == 2 else 1.0)
    monkeypatch.setattr(gemm, "launch_int8_gemm", launch)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    with config.override(INT8_FUSED_CACHE_DIR=str(tmp_path), INT8_FUSED_TUNE="background"):
        yield st


def _ops(m, n=4608, k=12288):
    cuda = torch.device("cuda", 0)
    return (types.SimpleNamespace(shape=(m, k), device=cuda), None, types.SimpleNamespace(shape=(n, k)), None, None,
            types.SimpleNamespace(shape=(m, n), dtype=torch.bfloat16))


def test_first_call_runs_the_guess_at_once_and_a_new_resolution_builds_nothing(stand_in_h200):
    """Flux.1 at 1024² (M 4608) then 768² (M 2816, another M bucket, the same class)."""
    st = stand_in_h200
    guess = autotune.predicted((9, 0), 232448, 4608)[0]
    cfg = gemm.select_config(*_ops(4608))
    assert cfg == guess and st.launched == [guess] and st.timed == []    # one check launch, no timing
    assert st.queue.pending() == ["gemm N4608_K12288_M8192 M4608"]
    assert gemm.select_config(*_ops(4608)) is cfg and len(st.launched) == 1
    # the new resolution takes the config already built, launching nothing
    assert gemm.select_config(*_ops(2816)) == guess and len(st.launched) == 1 and st.timed == []
    assert st.queue.pending() == ["gemm N4608_K12288_M8192 M4608", "gemm N4608_K12288_M4096 M2816"]
    switches = config.gemm_switches()
    # between samples: every candidate timed, the winner (with its tail split where it won) stored and adopted
    assert st.queue.drain() == 2
    n_cands = len(autotune.candidates((9, 0), 232448, 8192))
    assert len(st.timed) >= 2 * n_cands
    assert config.gemm_switches() != switches                            # prepared calls re-plan
    cache = gemm.device_cache(torch.device("cuda", 0))
    for m, bucket in ((4608, 8192), (2816, 4096)):
        after = gemm.select_config(*_ops(m))
        assert {x: after[x] for x in st.winner} == st.winner
        assert cache.get(f"N4608_K12288_M{bucket}", seed=False) == st.winner


def test_a_stopped_job_writes_nothing_and_the_guess_stays(stand_in_h200):
    st = stand_in_h200
    guess = gemm.select_config(*_ops(4608))
    calls = [0]

    def stop():
        calls[0] += 1
        if calls[0] > 3:
            raise deferred.Stopped()
    assert st.queue.drain(stop) == 0 and st.queue.pending() == ["gemm N4608_K12288_M8192 M4608"]
    assert gemm.device_cache(torch.device("cuda", 0)).get("N4608_K12288_M8192", seed=False) is None
    assert gemm.select_config(*_ops(4608)) == guess


def test_off_mode_queues_nothing(stand_in_h200):
    st = stand_in_h200
    with config.override(INT8_FUSED_TUNE="off"):
        assert gemm.select_config(*_ops(4096)) == autotune.predicted((9, 0), 232448, 4096)[0]
    assert st.queue.pending() == [] and st.timed == []


# ------------------------------------------------------------------------------------------------ dispatch, attention
@pytest.mark.parametrize("shape", [(14040, 1536, 1536), (3510, 3072, 3072), (256, 11520, 3840), (256, 3840, 3840),
                                   (512, 1536, 1536), (512, 3072, 3072)])
def test_dispatch_prediction_sends_the_h200s_float_shapes_to_float(shape):
    """The six shapes the H200's shipped table sends to float (kernel/tuned/NVIDIA-H200.json, timed there)."""
    assert dispatch.predicted(*shape, (9, 0)) == dispatch.FLOAT


def test_dispatch_prediction_keeps_gemvs_and_large_gemms_on_int8():
    assert dispatch.predicted(1, 3072, 3072, (9, 0)) == dispatch.INT8
    assert dispatch.predicted(4608, 3072, 12288, (9, 0)) == dispatch.INT8       # a Flux.1 MLP: 1.7e11
    assert dispatch.predicted(3510, 3072, 3072, (8, 9)) == dispatch.INT8        # a GeForce's bf16 is ~6x slower


def test_attention_prediction_by_generation(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert attention.predicted(torch.device("cuda", 0)) == "cudnn"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 9))
    assert attention.predicted(torch.device("cuda", 0)) == "flash"
    assert attention.predicted(torch.device("cpu")) == "flash"


def test_a_job_leaves_the_gpu_its_room(monkeypatch):
    """Between samples ComfyUI may decode or load another model: a job runs only with twice its operands free plus
    a margin, else it is dropped (the config in use stays)."""
    specs = [((4608, 12288), (12288, 1), torch.int8, torch.device("cuda", 0)),
             ((4608,), (0,), torch.float32, torch.device("cuda", 0)),
             ((3072, 12288), (12288, 1), torch.int8, torch.device("cuda", 0)), None]
    need = 4608 * 12288 + 4 + 3072 * 12288
    assert retune.nbytes(specs) == need
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (2 * need + retune.MEMORY_MARGIN - 1, 1 << 40))
    with pytest.raises(retune.NoRoom):
        retune.run_on(torch.device("cuda", 0), lambda: pytest.fail("ran without room"), specs)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (2 * need + retune.MEMORY_MARGIN, 1 << 40))
    assert retune.run_on(torch.device("cuda", 0), lambda: "ran", specs) == "ran"


def test_dispatch_in_background_runs_the_prediction_and_times_for_the_next_process(monkeypatch, tmp_path):
    """A shape without a decision runs the predicted path at once; the queued job times both paths (fake clock) and
    writes the decision to the cache file; this process keeps the path it ran (same outputs sample after sample);
    a new process (forget) takes the timed one from the file."""
    from launch_standins import int8_layer
    q = deferred.Queue(start_worker=False)
    monkeypatch.setattr(deferred, "QUEUE", q)
    timed = []

    def fake_measure(layer, x2d):
        timed.append(x2d.shape[0])
        return dispatch.Cost(0.010, 0.010), dispatch.Cost(0.030, 0.030), dispatch.dequantized(layer, x2d.dtype)
    monkeypatch.setattr(dispatch, "_can_time", lambda dev: True)
    monkeypatch.setattr(dispatch, "_device_cache", lambda dev: dispatch.DecisionCache(
        dispatch.cache_path("Fake GPU", "t", "3.6.0")))
    monkeypatch.setattr(dispatch, "_meta", lambda dev: {"gpu": "Fake GPU"})
    monkeypatch.setattr(dispatch, "measure", fake_measure)
    dispatch.forget()
    try:
        with config.override(INT8_FUSED_CACHE_DIR=str(tmp_path), INT8_FUSED_TUNE="background"):
            layer = int8_layer(40, 72, True, True, 0)
            x = torch.randn(100, 72)
            layer(x)
            # predicted: M 100 x N 40 x K 72 is far below the int8 bound -> float; nothing timed on the call
            assert dict(layer.dispatch_calls) == {"float": 1} and timed == []
            assert q.pending() == ["dispatch M128_N40_K72_bias_float32"]
            assert q.drain() == 1 and timed == [100]
            data = dispatch.DecisionCache(dispatch.cache_path("Fake GPU", "t", "3.6.0"))
            assert data.get("M128_N40_K72_bias_float32")["path"] == "int8"
            layer(x)
            assert dict(layer.dispatch_calls) == {"float": 2}          # this process keeps its path
            dispatch.forget()
            fresh = int8_layer(40, 72, True, True, 1)
            fresh(x)
            assert dict(fresh.dispatch_calls) == {"int8": 1} and timed == [100] and q.pending() == []
    finally:
        dispatch.forget()
