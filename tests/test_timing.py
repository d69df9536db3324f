"""Per-step timing (nodes/timing.py) on a real ComfyUI sampler in-process, with the tiny Flux on the CPU.

No wall-clock assertions: structure (one time per step, CFG branch tags, sums) is checked against
independent computations, and a fake clock checks that a step is the sum of its model calls.
"""
import itertools

import pytest
import torch


@pytest.fixture(scope="module")
def comfy(comfy_inprocess):
    import comfy.model_patcher
    import comfy.sample
    import comfy.supported_models
    return comfy


@pytest.fixture(scope="module")
def timing(pack):
    return pack.nodes.timing


@pytest.fixture(scope="module")
def tiny_flux(comfy):
    import comfy_harness  # tests/ helper behind the tiny_model fixture (module scope here: built once)
    return comfy_harness.load_tiny("flux")


@pytest.fixture
def sent(timing, monkeypatch):
    out = []
    monkeypatch.setattr(timing, "_send", lambda event, data: out.append((event, data)))
    return out


def _sample(comfy, patcher, steps, cfg, sampler="euler", callback=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    cond = lambda: [[torch.randn(1, 4, 64, generator=g), {"pooled_output": torch.randn(1, 64, generator=g)}]]
    latent = torch.zeros(1, 16, 8, 8)
    noise = torch.randn(latent.shape, generator=g)
    return comfy.sample.sample(patcher, noise, steps, cfg, sampler, "simple", cond(), cond(), latent,
                               callback=callback, disable_pbar=True, seed=seed)


def _events(sent, name):
    return [d for e, d in sent if e == name]


def test_one_time_per_step_and_summary_matches_steps(comfy, timing, tiny_flux, sent):
    m = tiny_flux.clone()
    timing.instrument(m, node_id="12", backend="fused_triton")
    out = _sample(comfy, m, steps=3, cfg=2.5)
    assert torch.isfinite(out).all()
    steps = _events(sent, "int8_fused.step")
    (summary,) = _events(sent, "int8_fused.summary")
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(s["steps"] == 3 and s["node"] == "12" and s["backend"] == "fused_triton"
               and s["device"] == "cpu" and s["run"] == summary["run"] for s in steps)
    secs = [s["seconds"] for s in steps]
    assert all(x > 0 for x in secs)
    assert summary["step_seconds"] == secs
    assert summary["steps"] == 3 and summary["status"] == "ok" and summary["timer"] == "perf_counter"
    assert summary["total"] == pytest.approx(sum(secs), rel=1e-12)
    assert summary["mean"] == pytest.approx(sum(secs) / 3, rel=1e-12)
    assert summary["median"] == sorted(secs)[1]
    # CFG > 1: cond and uncond run batched in one call per step on this small model.
    assert [s["branches"] for s in steps] == [{"cond+uncond": x} for x in secs]
    assert summary["calls"] == 3 and summary["workload"] == "Flux 1x16x8x8"
    assert timing.recent_runs()[-1] == summary


def test_cfg_one_runs_only_the_cond_branch(comfy, timing, tiny_flux, sent):
    m = tiny_flux.clone()
    timing.instrument(m, node_id="3", backend="bf16")
    _sample(comfy, m, steps=2, cfg=1.0)
    (summary,) = _events(sent, "int8_fused.summary")
    assert list(summary["branches"]) == ["cond"] and summary["steps"] == 2


class _FakeTimer:
    """Deterministic 'durations': the n-th timer created lasts n + 1 seconds (unique per timer)."""
    created = itertools.count()

    def __init__(self, device=None):
        self.n = next(self.created)

    def stop(self):
        pass

    def ready(self):
        return True

    def result(self, block=False):
        return float(self.n + 1)


def test_step_is_sum_of_its_diffusion_model_calls(comfy, timing, tiny_flux, sent, monkeypatch):
    """Heun evaluates the model twice per step (once on the last) and calls back between the two: a
    step (callback to callback) sums its calls, and each call is timed around the diffusion model
    (DIFFUSION_MODEL wrapper), not by the APPLY_MODEL timer."""
    _FakeTimer.created = itertools.count()
    monkeypatch.setattr(timing, "_timer", _FakeTimer)
    m = tiny_flux.clone()
    inner_calls = []

    def count_inner(executor, *args, **kwargs):
        inner_calls.append(1)
        return executor(*args, **kwargs)

    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "test.count", count_inner)
    timing.instrument(m, node_id="5", backend="torch_int_mm")
    _sample(comfy, m, steps=3, cfg=2.0, sampler="heun")
    (summary,) = _events(sent, "int8_fused.summary")
    steps = _events(sent, "int8_fused.step")
    calls = [s["calls"] for s in steps]
    assert calls == [1, 2, 2] and sum(calls) == len(inner_calls) == summary["calls"]
    # The first call creates an APPLY_MODEL timer (n = 0, lasting 1 s) in case the architecture has no
    # DIFFUSION_MODEL wrapper; it has, so that timer is dropped and every call is a DIFFUSION_MODEL timer
    # (n = 1, 2, ...; no more APPLY_MODEL timers once the inner wrapper has been seen).
    durations = [k + 2.0 for k in range(sum(calls))]
    it = iter(durations)
    want = [sum(next(it) for _ in range(c)) for c in calls]
    assert summary["step_seconds"] == want


def test_interrupted_sampling_still_reports(comfy, timing, tiny_flux, sent):
    m = tiny_flux.clone()
    timing.instrument(m, node_id="9", backend="dequant_bf16")

    class Stop(Exception):
        pass

    def cb(step, x0, x, total):
        if step == 1:
            raise Stop()

    with pytest.raises(Stop):
        _sample(comfy, m, steps=4, cfg=2.0, callback=cb)
    (summary,) = _events(sent, "int8_fused.summary")
    assert summary["status"] == "interrupted" and summary["steps"] == 2
    assert len(_events(sent, "int8_fused.step")) == 2


def test_instrument_again_replaces_the_wrappers(comfy, timing, tiny_flux):
    m = tiny_flux.clone()
    timing.instrument(m, node_id="1", backend="bf16")
    timing.instrument(m, node_id="2", backend="fused_triton")
    pe = comfy.patcher_extension
    for kind in (pe.WrappersMP.OUTER_SAMPLE, pe.WrappersMP.APPLY_MODEL, pe.WrappersMP.DIFFUSION_MODEL):
        assert len(m.get_wrappers(kind, timing.WRAPPER_KEY)) == 1
    assert m.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, timing.WRAPPER_KEY)[0].__self__.node_id == "2"
    assert tiny_flux.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, timing.WRAPPER_KEY) == []


class _PendingTimer:
    """A GPU-like timer: not ready until the test says so; counts blocking reads."""
    blocking_reads = 0

    def __init__(self, seconds):
        self.seconds, self.done = seconds, False

    def stop(self):
        pass

    def ready(self):
        return self.done

    def result(self, block=False):
        if not self.done:
            assert block, "read a pending timer without blocking"
            type(self).blocking_reads += 1
        return self.seconds


def _run(timing):
    return timing.Run(node_id="4", backend="fused_triton", device=torch.device("cpu"), workload="w",
                      steps_planned=3, prompt_id=None)


def test_pending_gpu_timers_are_never_waited_on_during_sampling(timing, sent):
    run = _run(timing)
    t = [_PendingTimer(s) for s in (0.5, 0.25, 0.125, 0.0625)]
    run.add_call("cond", "s0", t[0]), run.add_call("uncond", "s0", t[1])
    run.callbacks_seen = True
    run.end_step()  # step 0 ends while its GPU work is still queued: nothing sent, nothing waited on
    run.add_call("cond+uncond", "s1", t[2])
    assert _events(sent, "int8_fused.step") == [] and _PendingTimer.blocking_reads == 0
    t[0].done = t[1].done = True
    run.end_step()  # step 0 is ready now, step 1 is not
    assert [(s["step"], s["seconds"], s["branches"]) for s in _events(sent, "int8_fused.step")] == [
        (0, 0.75, {"cond": 0.5, "uncond": 0.25})]
    run.add_call("cond+uncond", "s2", t[3])
    summary = run.finish("ok")  # sampling over: the summary may wait for the last events
    assert _PendingTimer.blocking_reads == 2
    assert summary["step_seconds"] == [0.75, 0.125, 0.0625]
    assert summary["branches"] == {"cond": 0.5, "uncond": 0.25, "cond+uncond": 0.1875}


def test_calls_after_the_last_callback_join_the_last_step(timing, sent):
    run = _run(timing)
    run.callbacks_seen = True
    t = [_PendingTimer(s) for s in (1.0, 2.0, 4.0)]
    for x in t:
        x.done = True
    run.add_call("cond", "s0", t[0])
    run.end_step()
    run.add_call("cond", "s1", t[1])
    run.end_step(last=True)
    run.add_call("cond", "s2", t[2])
    assert [s["step"] for s in _events(sent, "int8_fused.step")] == [0]
    summary = run.finish("ok")
    assert summary["step_seconds"] == [1.0, 6.0] and summary["calls"] == 3
    assert [s["seconds"] for s in _events(sent, "int8_fused.step")] == [1.0, 6.0]


def test_without_sampler_callbacks_steps_follow_the_sigma_tensor(timing, sent):
    run = _run(timing)
    sig = [object(), object(), object()]
    for i, s in enumerate([sig[0], sig[0], sig[1], sig[2], sig[2]]):
        run.add_call("cond", s, _PendingTimer(float(i + 1)))
        run.open[-1][1].done = True
    summary = run.finish("ok")
    assert summary["step_seconds"] == [3.0, 3.0, 9.0] and summary["calls"] == 5


def test_cuda_timer_reads_events_without_blocking(timing, monkeypatch):
    log = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing
            self.name = f"e{len(log)}"
            log.append(("new", self.name))

        def record(self, stream):
            log.append(("record", self.name, stream))

        def query(self):
            log.append(("query", self.name))
            return True

        def synchronize(self):
            log.append(("sync", self.name))

        def elapsed_time(self, end):
            return 250.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: "stream0")
    t = timing._timer(torch.device("cuda", 0))
    t.stop()
    assert t.ready() and t.result() == 0.25
    assert not any(e[0] == "sync" for e in log)
    assert ("record", "e0", "stream0") in log and ("record", "e1", "stream0") in log
    assert t.result(block=True) == 0.25 and log[-1] == ("sync", "e1")


def test_second_model_of_a_dual_model_guider_gets_its_own_run(comfy, timing, tiny_flux, sent):
    """DualModelGuider-style sampling: the guider drives model A and calls model B for the
    unconditional branch. B's calls are timed once, into B's own run, on A's step boundaries."""
    import comfy.samplers
    a, b = tiny_flux.clone(), tiny_flux.clone()
    timing.instrument(a, node_id="20", backend="fused_triton")
    timing.instrument(b, node_id="21", backend="fused_triton")
    g = torch.Generator().manual_seed(3)
    ctx, pooled = torch.randn(1, 4, 64, generator=g), torch.randn(1, 64, generator=g)

    class TwoModelGuider(comfy.samplers.CFGGuider):
        def predict_noise(self, x, timestep, model_options={}, seed=None):
            cond = comfy.samplers.calc_cond_batch(self.inner_model, [self.conds.get("positive")], x,
                                                  timestep, model_options)[0]
            opts = {"wrappers": b.wrappers, "cond_or_uncond": [1], "sigmas": timestep}
            uncond = b.model.apply_model(x, timestep, c_crossattn=ctx, y=pooled, transformer_options=opts)
            return uncond + (cond - uncond) * 2.0

    guider = TwoModelGuider(a)
    guider.set_conds([[ctx, {"pooled_output": pooled}]], [])
    sigmas = comfy.samplers.calculate_sigmas(a.get_model_object("model_sampling"), "simple", 3)
    latent = torch.zeros(1, 16, 8, 8)
    out = guider.sample(torch.randn(latent.shape, generator=g), latent,
                        comfy.samplers.sampler_object("euler"), sigmas, disable_pbar=True, seed=0)
    assert torch.isfinite(out).all()
    summaries = {s["node"]: s for s in _events(sent, "int8_fused.summary")}
    assert set(summaries) == {"20", "21"}
    sa, sb = summaries["20"], summaries["21"]
    assert sa["steps"] == sb["steps"] == 3 and sa["calls"] == sb["calls"] == 3
    assert list(sa["branches"]) == ["cond"] and list(sb["branches"]) == ["uncond"]
    assert sa["group"] == sb["group"] == sa["run"] != sb["run"]
    steps_b = [s for s in _events(sent, "int8_fused.step") if s["node"] == "21"]
    assert [s["seconds"] for s in steps_b] == sb["step_seconds"]
    assert {s["group"] for s in steps_b} == {sa["run"]}


def test_architectures_without_the_diffusion_model_hook_are_timed_at_apply_model(
        comfy, timing, tiny_flux, sent, monkeypatch):
    _FakeTimer.created = itertools.count()
    monkeypatch.setattr(timing, "_timer", _FakeTimer)
    m = tiny_flux.clone()
    timing.instrument(m, node_id="6", backend="bf16")
    m.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, timing.WRAPPER_KEY)
    _sample(comfy, m, steps=3, cfg=2.0)
    (summary,) = _events(sent, "int8_fused.summary")
    assert summary["step_seconds"] == [1.0, 2.0, 3.0] and summary["calls"] == 3


def test_dual_model_guider_negative_model_run_under_the_first_models_wrappers(comfy, timing, tiny_flux, sent):
    """ComfyUI's DualModelGuider runs the negative model with the positive model's model_options, so
    only the first model's wrappers fire; the call's model tells the negative model's run apart."""
    import comfy.samplers
    import comfy_harness
    a, b = tiny_flux.clone(), comfy_harness.load_tiny("flux", seed=1)  # two backbones
    timing.instrument(a, node_id="30:conditional", backend="torch_int_mm")
    timing.instrument(b, node_id="30:unconditional", backend="torch_int_mm")
    g = torch.Generator().manual_seed(4)
    ctx, pooled = torch.randn(1, 4, 64, generator=g), torch.randn(1, 64, generator=g)

    class LikeDualModelGuider(comfy.samplers.CFGGuider):
        def predict_noise(self, x, timestep, model_options={}, seed=None):
            cond = comfy.samplers.calc_cond_batch(self.inner_model, [self.conds.get("positive")], x,
                                                  timestep, model_options)[0]
            opts = {**model_options["transformer_options"], "cond_or_uncond": [0], "sigmas": timestep}
            uncond = b.model.apply_model(x, timestep, c_crossattn=ctx, y=pooled, transformer_options=opts)
            return uncond + (cond - uncond) * 2.0

    guider = LikeDualModelGuider(a)
    guider.set_conds([[ctx, {"pooled_output": pooled}]], [])
    sigmas = comfy.samplers.calculate_sigmas(a.get_model_object("model_sampling"), "simple", 2)
    latent = torch.zeros(1, 16, 8, 8)
    guider.sample(torch.randn(latent.shape, generator=g), latent, comfy.samplers.sampler_object("euler"),
                  sigmas, disable_pbar=True, seed=0)
    summaries = {s["node"]: s for s in _events(sent, "int8_fused.summary")}
    assert set(summaries) == {"30:conditional", "30:unconditional"}
    sa, sb = summaries["30:conditional"], summaries["30:unconditional"]
    assert sa["calls"] == sb["calls"] == 2 and sa["steps"] == sb["steps"] == 2
    assert sb["group"] == sa["run"]
