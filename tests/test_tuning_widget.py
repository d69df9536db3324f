"""The tuning half of the timing widget, server side (nodes/timing.py ``TuningRelay``, ``end_tuning``) and its texts
(web/int8_format.js, under node's test runner: tests/test_tuning_widget_format.mjs).

The relay runs on the real ``kernel.tuned.progress.Progress`` with a list as its send function, a hand-driven clock and
a timer that the test fires itself, so throttling is checked without waiting. A real sampling of the tiny Flux
in-process, with a model wrapper that tunes as the pack's GEMMs do on their first call, checks that the sampling's end
ends the tuning session (its summary sent at once, not after QUIET_S).
"""
import pathlib
import shutil
import subprocess

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def timing(pack):
    return pack.nodes.timing


@pytest.fixture
def progress(pack, monkeypatch):
    mod = pack.kernel.tuned.progress
    monkeypatch.setattr(mod, "QUIET_S", None)  # sessions end by finish() only: no timer thread in these tests
    return mod


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Timers:
    """Stands in for threading.Timer: records [due time, fn]; the test fires them (``fire``, ``fire_due``)."""

    def __init__(self, clock):
        self.clock, self.made = clock, []

    def __call__(self, delay, fn):
        self.made.append([self.clock() + delay, fn, False])
        return type("T", (), {"start": lambda s: None, "daemon": False})()

    def delays(self):
        return [due for due, _, _ in self.made]

    def fire(self, i):
        self.made[i][2] = True
        self.made[i][1]()

    def fire_due(self):
        for i, (due, _, fired) in enumerate(self.made):
            if not fired and due <= self.clock() + 1e-12:
                self.fire(i)


def _relay(timing, progress, interval=0.25):
    sent, got, clock = [], [], Clock()
    timers = Timers(clock)
    relay = timing.TuningRelay(send=lambda event, data: sent.append((event, data, clock.now)), interval=interval,
                               clock=clock, timer=timers)
    p = progress.Progress()
    p.listeners = [got.append, relay]
    return p, relay, sent, got, clock, timers


def _no_elapsed(snap):
    return {**snap, "current": {k: v for k, v in snap["current"].items() if k != "elapsed_s"} if snap["current"] else None}


def test_relay_sends_at_most_one_snapshot_per_interval_and_the_latest_after_it(timing, progress):
    p, relay, sent, got, clock, timers = _relay(timing, progress)
    p.expect(3)
    with p.task("GEMM", "N=3072 K=3072 M<=4096 s8p", "12 candidates", "/c/gemm.json"):  # t = 0: sent at once
        pass
    assert [e for e, _, _ in sent] == ["int8_fused.tuning"] and sent[0][1] is got[0]
    first = sent[0][1]
    assert first["active"] and first["shapes"] == 1 and first["total"] == 3
    assert _no_elapsed(first)["current"] == {"kind": "GEMM", "label": "N=3072 K=3072 M<=4096 s8p",
                                             "detail": "12 candidates", "shape": 1}
    # the task's end (t = 0 still) and a second task at t = 0.1: held back, one timer for what is left of 0.25 s
    clock.now = 0.1
    held = p.task("tail split", "N=3072 K=3072 M<=4096 s8p T8 split", "3 variants")
    held.__enter__()
    assert len(sent) == 1 and len(got) == 3
    assert timers.delays() == [pytest.approx(0.25)]  # due 0.25 s after the last send
    clock.now = 0.3  # the timer fires: the latest snapshot, its task's time brought up to now
    timers.fire(0)
    assert len(sent) == 2
    flushed = sent[1][1]
    assert _no_elapsed(flushed) == _no_elapsed(got[2]) and flushed["current"]["shape"] == 2
    assert flushed["current"]["elapsed_s"] == pytest.approx(got[2]["current"]["elapsed_s"] + 0.2)
    assert got[2]["current"]["elapsed_s"] < 0.2  # (the real clock of the snapshot is not the hand-driven one)
    # the second task ends at t = 0.35 (held: 0.05 s after the last send), then the session's end goes at once
    clock.now = 0.35
    held.__exit__(None, None, None)
    assert len(sent) == 2 and timers.delays()[1:] == [pytest.approx(0.55)]
    clock.now = 0.36
    line = p.finish()
    assert line.startswith("INT8 autotune: tuned 2 shapes in ") and "(1 GEMM, 1 tail split)" in line
    assert len(sent) == 3 and sent[2][1] is got[-1]
    assert sent[2][1]["last_summary"] == line and not sent[2][1]["active"] and sent[2][1]["shapes"] == 0
    clock.now = 0.6
    timers.fire(1)  # nothing held back any more: nothing sent
    assert len(sent) == 3


def test_relay_keeps_a_burst_of_tasks_to_one_event_per_interval(timing, progress):
    p, relay, sent, got, clock, timers = _relay(timing, progress)
    for i in range(200):  # 200 fast shapes within one interval: the first, then the latest when it has passed
        clock.now = i * 1e-3
        with p.task("dispatch", f"N={64 * (i + 1)} K=3072", "int8 vs float"):
            pass
    assert len(got) == 400 and len(sent) == 1 and len(timers.made) == 1
    clock.now = 0.25
    timers.fire_due()
    assert len(sent) == 2 and sent[1][1] is got[-1] and sent[1][1]["shapes"] == 200
    # then two seconds of shapes, one every 10 ms, timers fired when due: never two events within 0.25 s, the
    # shape count going on in every one, and the latest snapshot sent in the end
    for i in range(200):
        clock.now = 1.0 + i * 0.01
        timers.fire_due()
        with p.task("GEMM", f"N={i + 1} K=64 M<=64", "1 candidate"):
            pass
    clock.now = 4.0
    timers.fire_due()
    at = [t for _, _, t in sent]
    assert all(b - a >= 0.25 - 1e-9 for a, b in zip(at, at[1:])), at
    assert len(sent) >= 2 + 2 / 0.25 - 1  # and not just the first and the last
    shapes = [d["shapes"] for _, d, _ in sent]
    assert shapes == sorted(shapes) and sent[-1][1] is got[-1] and shapes[-1] == 400


def test_settle_sends_the_shipped_tables_counts_and_a_held_snapshot_only_when_new(timing, progress):
    p, relay, sent, got, clock, timers = _relay(timing, progress)
    relay.settle(p.snapshot())
    assert len(sent) == 1  # the first one: the page has had nothing from this relay
    relay.settle(p.snapshot())
    assert len(sent) == 1  # nothing new: no event for a sampling that neither tuned nor took a seed
    p.seed_hit("gemm"), p.seed_hit("gemm"), p.seed_hit("dispatch")
    relay.settle(p.snapshot())
    assert len(sent) == 2 and sent[1][1]["seeded"] == {"gemm": 2, "dispatch": 1}
    with p.task("GEMM", "N=64 K=64 M<=64"):  # held back (within the interval of the last send)
        pass
    assert len(sent) == 2
    relay.settle(p.snapshot())  # a held snapshot goes now
    assert len(sent) == 3 and sent[2][1]["shapes"] == 1


def test_the_pack_registers_one_relay_sending_through_the_server(timing, pack):
    relays = [fn for fn in pack.kernel.tuned.progress.PROGRESS.listeners if getattr(fn, "int8_fused_widget", False)]
    assert relays == [timing.TUNING_RELAY] and timing.TUNING_RELAY.send is None  # None: nodes.timing._send
    timing._register_tuning()  # again (a reloaded module): still one
    relays = [fn for fn in pack.kernel.tuned.progress.PROGRESS.listeners if getattr(fn, "int8_fused_widget", False)]
    assert relays == [timing.TUNING_RELAY]


@pytest.fixture
def tiny_flux(comfy_inprocess):
    import comfy_harness
    return comfy_harness.load_tiny("flux")


def _sample(patcher, steps=2):
    import comfy.sample
    g = torch.Generator().manual_seed(0)
    cond = lambda: [[torch.randn(1, 4, 64, generator=g), {"pooled_output": torch.randn(1, 64, generator=g)}]]
    latent = torch.zeros(1, 16, 8, 8)
    noise = torch.randn(latent.shape, generator=g)
    return comfy.sample.sample(patcher, noise, steps, 1.0, "euler", "simple", cond(), cond(), latent,
                               disable_pbar=True, seed=0)


def test_the_end_of_a_sampling_ends_its_tuning_session_and_the_widget_hears_it(timing, progress, tiny_flux,
                                                                               monkeypatch):
    """A model that tunes two shapes on its first call, as the pack's GEMMs do, sampled by ComfyUI's sampler: the
    events the widget gets are the tuning as it ran, then, when sampling ends (no quiet timer here), the summary."""
    import comfy.patcher_extension as pe
    sent = []
    monkeypatch.setattr(timing, "_send", lambda event, data: sent.append((event, data)))
    monkeypatch.setattr(timing.TUNING_RELAY, "interval", 0.0)  # every snapshot goes
    progress.finish()  # whatever an earlier test left open
    calls = []

    def tune_first(executor, *args, **kwargs):
        if not calls:
            progress.expect(2)
            with progress.task("GEMM", progress.gemm_label("N3072_K3072_M4096_s8p"), "12 candidates"):
                with progress.task("dispatch", "N=3072 K=3072 M<=4096", "int8 vs float"):
                    pass
        calls.append(1)
        return executor(*args, **kwargs)

    m = tiny_flux.clone()
    timing.instrument(m, node_id="7", backend="bf16")
    m.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, "test.tune", tune_first)
    out = _sample(m)
    assert torch.isfinite(out).all() and len(calls) == 2
    names = [e for e, _ in sent]
    tuning = [d for e, d in sent if e == "int8_fused.tuning"]
    # the summary follows the run's summary; before it the two tasks' starts and ends, nested as they ran
    assert names[-2:] == ["int8_fused.summary", "int8_fused.tuning"]
    assert [(d["active"], d["current"] and d["current"]["kind"], d["shapes"]) for d in tuning] == [
        (True, "GEMM", 1), (True, "dispatch", 2), (True, "GEMM", 2), (False, None, 2), (False, None, 0)]
    assert tuning[0]["current"]["label"] == "N=3072 K=3072 M<=4096 s8p" and tuning[0]["total"] == 2
    line = tuning[-1]["last_summary"]
    assert line.startswith("INT8 autotune: tuned 2 shapes in ") and "(1 dispatch, 1 GEMM)" in line  # nested first
    assert progress.snapshot()["last_summary"] == line
    # a second sampling tunes nothing: no tuning event
    sent.clear()
    _sample(m)
    assert [e for e, _ in sent if e == "int8_fused.tuning"] == []


def test_tuning_texts_in_the_widget_module():
    node = shutil.which("node")
    if node is None:
        pytest.fail("node (v18+) is needed to unit-test web/int8_format.js; install nodejs")
    proc = subprocess.run([node, "--test", str(ROOT / "tests" / "test_tuning_widget_format.mjs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout and "# pass 0" not in proc.stdout, proc.stdout[-2000:]
