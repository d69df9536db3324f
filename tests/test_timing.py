"""Per-step timing (nodes/timing.py) on a real ComfyUI sampler in-process, with the tiny Flux on the CPU.

No wall-clock assertions: structure (one time per step, CFG branch tags, sums) is checked against
independent computations, and a fake clock checks that a step is the sum of its model calls.
"""
import itertools

import pytest
import torch


@pytest.fixture(scope="module")
def comfy(comfy_inprocess):
    import comfy.model_management
    import comfy.model_patcher
    import comfy.patcher_extension
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
    # No INT8 layer in this float model: what ran is the float control, whatever the node asked for.
    assert all(s["steps"] == 3 and s["node"] == "12" and s["backend"] == "bf16"
               and s["backend_requested"] == "fused_triton" and s["backends"] == {}
               and s["device"] == "cpu" and s["run"] == summary["run"] for s in steps)
    assert (summary["backend"], summary["backend_requested"], summary["error"]) == ("bf16", "fused_triton", None)
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
    """ComfyUI's cancel button raises InterruptProcessingException from the sampler's callback."""
    m = tiny_flux.clone()
    timing.instrument(m, node_id="9", backend="dequant_bf16")

    def cb(step, x0, x, total):
        if step == 1:
            raise comfy.model_management.InterruptProcessingException()

    with pytest.raises(comfy.model_management.InterruptProcessingException):
        _sample(comfy, m, steps=4, cfg=2.0, callback=cb)
    (summary,) = _events(sent, "int8_fused.summary")
    assert summary["status"] == "interrupted" and summary["steps"] == 2 and summary["error"] is None
    assert len(_events(sent, "int8_fused.step")) == 2


def test_sampling_that_fails_before_the_first_step_is_an_error_with_its_message(comfy, timing, tiny_flux, sent):
    """An exception while the model loads (here: a pre-run callback, where ComfyUI's OOMs surface) is
    recorded as an error with its type and text, not as an interruption; it still reaches ComfyUI."""
    m = tiny_flux.clone()
    timing.instrument(m, node_id="10", backend="dequant_bf16")

    def fail(patcher):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    m.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_PRE_RUN, "test.fail", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        _sample(comfy, m, steps=3, cfg=2.0)
    (summary,) = _events(sent, "int8_fused.summary")
    assert summary["status"] == "error"
    assert summary["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert summary["steps"] == 0 and summary["mean"] is None and summary["step_seconds"] == []
    assert timing.recent_runs()[-1]["error"] == summary["error"]


def test_sampling_that_fails_midway_keeps_its_steps_and_the_error(comfy, timing, tiny_flux, sent):
    m = tiny_flux.clone()
    timing.instrument(m, node_id="11", backend="dequant_bf16")

    def cb(step, x0, x, total):
        if step == 1:
            raise ValueError("latent has NaNs")

    with pytest.raises(ValueError):
        _sample(comfy, m, steps=4, cfg=2.0, callback=cb)
    (summary,) = _events(sent, "int8_fused.summary")
    assert (summary["status"], summary["error"], summary["steps"]) == ("error", "ValueError: latent has NaNs", 2)
    assert summary["mean"] == pytest.approx(sum(summary["step_seconds"]) / 2, rel=1e-12)


def _int8_patch(comfy, patcher, pack, layers):
    """Object patches that make ``patcher`` run the named linears as Int8Linear on the given backends."""
    dm = patcher.model.diffusion_model
    for name, backend in layers.items():
        lin = dm.get_submodule(name)
        q = pack.quant.linear.Int8Linear.from_float(lin.weight.detach(), lin.bias.detach(), backend=backend,
                                                    name=name)
        patcher.add_object_patch("diffusion_model." + name, q)


MIXED = {"double_blocks.0.img_attn.qkv": "torch_int_mm", "double_blocks.0.img_mlp.0": "torch_int_mm",
         "single_blocks.1.linear1": "torch_int_mm", "final_layer.linear": "dequant_bf16"}


def test_reports_the_backend_the_int8_layers_ran_not_the_requested_one(comfy, timing, pack, sent, caplog):
    """The node asked for fused_triton, but the layers (patched in after instrument(), so only the
    model that actually runs can tell) run 3 x torch_int_mm and 1 x dequant_bf16."""
    import comfy_harness
    m = comfy_harness.load_tiny("flux", seed=2)  # its own BaseModel: the patches never leak to tiny_flux
    timing.instrument(m, node_id="40", backend="fused_triton")
    _int8_patch(comfy, m, pack, MIXED)
    with caplog.at_level("INFO", logger="int8_fused"):
        _sample(comfy, m, steps=2, cfg=2.0)
    (summary,) = _events(sent, "int8_fused.summary")
    steps = _events(sent, "int8_fused.step")
    for d in [summary, *steps, timing.recent_runs()[-1]]:
        assert d["backend"] == "torch_int_mm" and d["backend_requested"] == "fused_triton"
        assert d["backends"] == {"torch_int_mm": 3, "dequant_bf16": 1}
    assert len(steps) == 2
    assert any("torch_int_mm (fallback from fused_triton; 1 of 4 layers on dequant_bf16)" in r.getMessage()
               and "40" in r.getMessage() for r in caplog.records)


def _sample_failing_before_the_model(comfy, m):
    """Sampling that raises in an ON_PRE_RUN callback: the run ends before any model call."""
    def fail(patcher):
        raise RuntimeError("no")

    m.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_PRE_RUN, "test.fail", fail)
    with pytest.raises(RuntimeError):
        _sample(comfy, m, steps=2, cfg=2.0)


def test_backends_used_given_to_instrument_names_a_run_that_never_reached_the_model(comfy, timing, tiny_flux, sent):
    m = tiny_flux.clone()
    timing.instrument(m, node_id="41", backend="fused_triton", backends_used={"torch_int_mm": 5})
    _sample_failing_before_the_model(comfy, m)
    (summary,) = _events(sent, "int8_fused.summary")
    assert (summary["backend"], summary["backend_requested"], summary["backends"]) == (
        "torch_int_mm", "fused_triton", {"torch_int_mm": 5})


def test_instrument_reads_the_int8_layers_of_the_patcher(comfy, timing, pack, sent):
    """Without backends_used, instrument() counts the patcher's Int8Linear object patches (what Apply
    adds) and the Int8Linear modules of its model (what the loader builds); a run that never reaches
    the model reports those."""
    import comfy_harness
    m = comfy_harness.load_tiny("flux", seed=4)
    _int8_patch(comfy, m, pack, {"txt_in": "dequant_bf16", "img_in": "dequant_bf16"})
    dm = m.model.diffusion_model
    lin = dm.single_blocks[0].linear2
    dm.single_blocks[0].linear2 = pack.quant.linear.Int8Linear.from_float(
        lin.weight.detach(), lin.bias.detach(), backend="torch_int_mm")
    timing.instrument(m, node_id="42", backend="fused_triton")
    _sample_failing_before_the_model(comfy, m)
    (summary,) = _events(sent, "int8_fused.summary")
    assert (summary["backend"], summary["backend_requested"], summary["backends"]) == (
        "dequant_bf16", "fused_triton", {"dequant_bf16": 2, "torch_int_mm": 1})


def test_the_apply_node_falling_back_reports_the_fallback(comfy, timing, pack, sent, monkeypatch):
    """End to end through "Apply Fused INT8 GEMM" (nodes/apply.py, unchanged): fused_triton cannot run
    here, so every quantized layer falls back to torch_int_mm (the tiny Flux's N and K are multiples of 8)."""
    import dataclasses
    import comfy_harness
    b = pack.quant.backends
    monkeypatch.setitem(b.BACKENDS, "fused_triton", dataclasses.replace(
        b.BACKENDS["fused_triton"], device_reason=lambda device: "no GPU in this test"))
    m = comfy_harness.load_tiny("flux", seed=3)
    q = pack.nodes.apply.ApplyFusedInt8GEMM().apply(m, "fused_triton", unique_id="44")[0]
    n = q.int8_report.quantized
    assert n > 0
    _sample(comfy, q, steps=2, cfg=2.0)
    (summary,) = _events(sent, "int8_fused.summary")
    assert (summary["backend"], summary["backend_requested"], summary["backends"]) == (
        "torch_int_mm", "fused_triton", {"torch_int_mm": n})


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


def test_cuda_timers_run_eagerly_under_torch_compile_and_an_unstopped_one_reads_zero(timing, monkeypatch):
    """ComfyUI's TorchCompileModel compiles the diffusion model with the pack's wrappers around it: each call must
    still make and record its own events at run time (on an H100, traced timers left the step's end event
    unrecorded and the sample failed in the step callback). A timer whose call raised before its end was recorded
    reads 0 s instead of raising torch's "Both events must be recorded"."""
    log = []

    class Event:
        def __init__(self, enable_timing):
            self.name, self.recorded = f"e{len(log)}", False
            log.append(("new", self.name))

        def record(self, stream):
            self.recorded = True
            log.append(("record", self.name))

        def query(self):
            return True

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            if not (self.recorded and end.recorded):
                raise ValueError("Both events must be recorded before calculating elapsed time.")
            return 125.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: "stream0")
    timers = []

    def step(x):
        t = timing._timer(torch.device("cuda", 0))
        y = torch.sin(x) * 2
        timing._stop(t)
        timers.append(t)
        return y

    torch._dynamo.reset()
    fn = torch.compile(step, backend="eager")
    for _ in range(2):
        assert torch.allclose(fn(torch.ones(3)), torch.sin(torch.ones(3)) * 2)
    assert len(timers) == 2 and timers[0] is not timers[1]
    assert [e[0] for e in log] == ["new", "new", "record", "record"] * 2  # per call: start and end, both recorded
    assert all(t.ready() and t.result() == 0.125 for t in timers)
    unstopped = timing._timer(torch.device("cuda", 0))  # its call raised: stop never ran
    assert unstopped.ready() and unstopped.result() == 0.0 and unstopped.result(block=True) == 0.0
    torch._dynamo.reset()


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


def test_backend_labels_and_error_text(timing):
    """The log line's texts, written out by hand (the widget's are checked in tests/test_web_format.mjs)."""
    label, ran = timing.backend_label, timing.ran_backend
    assert label("fused_triton", "fused_triton", {"fused_triton": 12}) == "fused_triton"
    assert label("torch_int_mm", "fused_triton", {"torch_int_mm": 12}) == "torch_int_mm (fallback from fused_triton)"
    assert label("fused_triton", "fused_triton", {"torch_int_mm": 4, "fused_triton": 120}) == (
        "fused_triton (4 of 124 layers on torch_int_mm)")
    assert label("fused_triton", "bf16", {"fused_triton": 7}) == "fused_triton (requested bf16)"
    assert label("bf16", "bf16", {}) == "bf16"
    assert ran({"torch_int_mm": 2, "dequant_bf16": 2}) == "dequant_bf16" and ran({}) == "bf16"
    long = timing._error_text(RuntimeError("x" * 1000))
    assert long == "RuntimeError: " + "x" * 485 + "\u2026" and len(long) == timing.ERROR_CHARS
    assert timing._error_text(KeyError()) == "KeyError"


def test_calls_on_other_devices_and_threads_are_kept_apart(timing):
    """MultiGPU CFG Split and the two-GPU guider run model calls on other devices' worker threads at the same time:
    a recorder's call in progress is per thread, and a call on another device than the run's is named with it in
    the step's breakdown."""
    import threading
    cpu, c0, c1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert timing.branch_on("uncond", cpu, cpu) == "uncond"
    assert timing.branch_on("uncond", c1, c0) == "uncond@cuda:1"
    assert timing.branch_on("cond+uncond", c0, "cuda:0") == "cond+uncond"
    rec = timing._Recorder("n", "fused_triton")
    rec.in_call, rec.inner_timed = ("run", "cond", None, c0), True
    seen = []
    t = threading.Thread(target=lambda: seen.append((rec.in_call, rec.inner_timed)))
    t.start()
    t.join()
    assert seen == [(None, False)]  # another thread sees no call of this one's in progress
    assert (rec.in_call, rec.inner_timed) == (("run", "cond", None, c0), True)
