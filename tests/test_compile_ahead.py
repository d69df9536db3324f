"""kernel/ahead.py: a model call's first run with new shapes follows a dry run in which the pack's launches start
their compiles in a thread pool instead of running (the GPU side is measured by the bench). Stand-in kernels on the
CPU: launches go through the real kernel.launch / kernel.plan / kernel.s8wgmma code."""
import logging

import pytest
import torch

from kernel import ahead, config, deferred, launch, plan, procs, s8wgmma

CUDA = torch.device("cuda", 0)


class FakeKernel:
    """A @triton.jit stand-in: ``warmup`` (what a dry run calls) is recorded; running it fails the test."""
    arg_names = ["x", "n", "BLOCK"]

    def __init__(self, name="k"):
        self.__name__ = name
        self.warmups = []

    def warmup(self, *args, grid, **kw):
        self.warmups.append((args, grid, kw))
        return None

    def __getitem__(self, grid):
        raise AssertionError(f"{self.__name__} ran during a dry run")


def _tune(mode, get=config.get):
    """``config.get`` with INT8_FUSED_TUNE set to ``mode``."""
    return lambda name: mode if name == "INT8_FUSED_TUNE" else get(name)


class FakeAsync:
    def __init__(self):
        self.raw_futures, self.entered = [], 0

    def __enter__(self):
        self.entered += 1
        return self

    def __exit__(self, *exc):
        return False


def test_launches_inside_a_dry_run_start_compiles_once_per_specialization_and_run_nothing():
    k = FakeKernel()
    x = torch.zeros(8)
    with ahead.compiling(workers=2, async_mode=FakeAsync()) as a:
        assert launch.dry_run()
        with launch.record() as rec:
            for n in (64, 64, 80):      # two calls of one specialization, one of another
                launch.launch(k, (4,), (x, n), {"BLOCK": 32}, 4, 2, CUDA)
    assert not launch.dry_run()
    assert rec == []                    # nothing recorded for a prepared call
    assert a.launches == 3 and len(a.seen) == 2 and len(k.warmups) == 2
    args, grid, kw = k.warmups[0]
    assert args == (x, 64) and grid == (4,) and kw == {"BLOCK": 32, "num_warps": 4, "num_stages": 2}


def test_no_prepared_call_is_built_or_refused_during_a_dry_run():
    calls = []

    def wrapper(t):
        calls.append(t.shape)
        return torch.empty_like(t)
    t = torch.zeros(4)
    with ahead.compiling(workers=1, async_mode=FakeAsync()):
        assert plan.build([object()], (t,), (), t, t.device) is None
        plan.call(wrapper, t, salt=("dry",))
    key_seen = [k for k in plan._CALLS if k[:2] == (wrapper, ("dry",))]
    assert key_seen == [] and calls == [(4,)]     # not memoised as "cannot be planned"


def test_s8_launch_in_a_dry_run_builds_in_the_pool_and_compiles_the_int8_reference(monkeypatch):
    """Outside background tuning (``first_call``) the s8 build runs in the dry run's pool."""
    monkeypatch.setattr(config, "get", _tune("first_call"))
    k = FakeKernel("gemm")
    built = []
    monkeypatch.setattr(s8wgmma, "usable", lambda dev: True)
    monkeypatch.setattr(s8wgmma, "_BUILT", {})
    monkeypatch.setattr(s8wgmma, "_build", lambda *a: built.append(a) or ("compiled", ()))
    x = torch.zeros(8, dtype=torch.int8)
    with ahead.compiling(workers=2, async_mode=FakeAsync()) as a:
        s8wgmma.launch_s8(k, (2,), (x, 16), {"BLOCK": 64}, 8, 3, CUDA, 0)
        s8wgmma.launch_s8(k, (2,), (x, 16), {"BLOCK": 64}, 8, 3, CUDA, 0)
    assert len(built) == 1 and len(s8wgmma._BUILT) == 1       # built once, in the pool, and kept
    assert len(k.warmups) == 1 and a.errors == []             # the int8 build the first real call checks against


def test_s8_builds_once_per_triton_specialization_in_a_dry_run(monkeypatch):
    """Shapes whose integers Triton specializes alike (here 4096 and 3072: both divisible by 16) share one s8 build in
    the pool; 40 (not divisible by 16) and 1 get their own. Every launch still gets its int8 reference compile."""
    monkeypatch.setattr(config, "get", _tune("first_call"))
    k = FakeKernel("gemm")
    built = []
    monkeypatch.setattr(s8wgmma, "usable", lambda dev: True)
    monkeypatch.setattr(s8wgmma, "_BUILT", {})
    monkeypatch.setattr(s8wgmma, "_build", lambda *a: built.append(a[2][1]) or ("compiled", ()))
    x = torch.zeros(8, dtype=torch.int8)
    with ahead.compiling(workers=2, async_mode=FakeAsync()):
        for n in (4096, 3072, 40, 1, 4096):
            s8wgmma.launch_s8(k, (2,), (x, n), {"BLOCK": 64}, 8, 3, CUDA, 0)
    assert sorted(built) == [1, 40, 4096]
    assert len(k.warmups) == 4  # the int8 builds: one per launch key (4096 twice is one key)


class FakeFp8:
    def __init__(self, h):
        self.hash = h


def _deferred_setup(monkeypatch, compile_kernel=None, rewritten=None):
    """Background tuning on a queue without a worker (drained by the test); captures and compiles stand-ins."""
    q = deferred.Queue(start_worker=False)
    monkeypatch.setattr(deferred, "QUEUE", q)
    monkeypatch.setattr(config, "get", _tune("background"))
    monkeypatch.setattr(s8wgmma, "usable", lambda dev: True)
    for name, v in (("_BUILT", {}), ("_BY_HASH", {}), ("_PENDING", set()), ("_OFF", None)):
        monkeypatch.setattr(s8wgmma, name, v)
    captured = []
    monkeypatch.setattr(procs, "capture", lambda fn, args, grid, consts, w, st: captured.append(args) or
                        {"qualname": fn.__name__, "spec": str(args[1])})
    import kernel.compile_worker as cw
    monkeypatch.setattr(cw, "compile_kernel", compile_kernel or (lambda req: FakeFp8("h" + req["spec"])))
    monkeypatch.setattr(s8wgmma, "rewritten", rewritten or (lambda k8: ("s8 of", k8.hash)))
    built = []
    monkeypatch.setattr(s8wgmma, "_build", lambda *a: built.append(a[2][1]) or None)
    ran = []
    real_launch = launch.launch

    def fake_launch(jit_fn, grid, args, consts, w, st, dev):
        if launch.dry_run():
            return real_launch(jit_fn, grid, args, consts, w, st, dev)
        ran.append(("int8 build", args[1]))
    monkeypatch.setattr(launch, "launch", fake_launch)
    return q, captured, built, ran


def test_background_tuning_defers_the_s8_build_and_calls_run_the_int8_build_until_it_is_there(monkeypatch):
    """Under INT8_FUSED_TUNE=background a dry run captures the fp8 build (its operands viewed as fp8), queues one job
    per Triton specialization and compiles only the int8 build; a call meanwhile runs the int8 build; once the job
    ran between samples, the rewritten kernel is kept under its fp8 build's hash, nothing is pending, prepared calls
    re-plan, and the next call builds (finding it)."""
    q, captured, built, ran = _deferred_setup(monkeypatch)
    k = FakeKernel("gemm")
    x = torch.zeros(8, dtype=torch.int8)
    with ahead.compiling(workers=2, async_mode=FakeAsync()) as a:
        for n in (4096, 3072, 40):
            s8wgmma.launch_s8(k, (2,), (x, n), {"BLOCK": 64}, 8, 3, CUDA, 0)
    assert built == [] and a.jobs == []                       # nothing of the s8 build in the dry run
    assert len(k.warmups) == 3                                # the int8 builds, one per launch key
    assert len(q.pending()) == 2 and len(s8wgmma._PENDING) == 2   # 4096 and 3072 specialize alike
    assert [c[0].dtype for c in captured] == [torch.float8_e4m3fn] * 2 and captured[0][0].data_ptr() == x.data_ptr()
    s8wgmma.launch_s8(k, (2,), (x, 4096), {"BLOCK": 64}, 8, 3, CUDA, 0)
    assert ran == [("int8 build", 4096)] and built == []
    gen = config.gemm_switches()
    assert q.drain() == 2
    assert s8wgmma._PENDING == set() and s8wgmma._BY_HASH == {"h4096": ("s8 of", "h4096"), "h40": ("s8 of", "h40")}
    assert config.gemm_switches() != gen                      # prepared calls plan again
    s8wgmma.launch_s8(k, (2,), (x, 4096), {"BLOCK": 64}, 8, 3, CUDA, 0)
    assert built == [4096]                                    # the call's own build (served from _BY_HASH for real)
    assert s8wgmma._OFF is None


def test_a_sample_stops_a_deferred_build_before_it_starts_and_it_stays_pending(monkeypatch):
    q, captured, built, ran = _deferred_setup(monkeypatch)
    k = FakeKernel("gemm")
    x = torch.zeros(8, dtype=torch.int8)
    with ahead.compiling(workers=1, async_mode=FakeAsync()):
        s8wgmma.launch_s8(k, (2,), (x, 64), {"BLOCK": 64}, 8, 3, CUDA, 0)

    def stop():
        raise deferred.Stopped()
    assert q.drain(stop) == 0 and len(q.pending()) == 1 and q.stopped
    assert len(s8wgmma._PENDING) == 1 and s8wgmma._BY_HASH == {}
    s8wgmma.launch_s8(k, (2,), (x, 64), {"BLOCK": 64}, 8, 3, CUDA, 0)
    assert ran == [("int8 build", 64)] and built == []
    assert q.drain() == 1 and s8wgmma._PENDING == set() and len(s8wgmma._BY_HASH) == 1


def test_a_deferred_compile_that_fails_leaves_the_build_to_the_next_call_and_a_bad_rewrite_turns_the_path_off(
        monkeypatch):
    def no_compile(req):
        raise RuntimeError("compiler crashed")
    q, captured, built, ran = _deferred_setup(monkeypatch, compile_kernel=no_compile)
    k = FakeKernel("gemm")
    x = torch.zeros(8, dtype=torch.int8)
    with ahead.compiling(workers=1, async_mode=FakeAsync()):
        s8wgmma.launch_s8(k, (2,), (x, 64), {"BLOCK": 64}, 8, 3, CUDA, 0)
    q.drain()
    assert s8wgmma._PENDING == set() and s8wgmma._OFF is None
    s8wgmma.launch_s8(k, (2,), (x, 64), {"BLOCK": 64}, 8, 3, CUDA, 0)
    assert built == [64]                                      # built by the call, as without deferring

    def bad_rewrite(k8):
        raise RuntimeError("no fp8 wgmma of the expected form")
    q, captured, built, ran = _deferred_setup(monkeypatch, rewritten=bad_rewrite)
    with ahead.compiling(workers=1, async_mode=FakeAsync()):
        s8wgmma.launch_s8(k, (2,), (x, 48), {"BLOCK": 64}, 8, 3, CUDA, 0)
    q.drain()
    assert s8wgmma._PENDING == set() and "between samples" in s8wgmma._OFF and s8wgmma._BY_HASH == {}


def test_no_deferring_where_triton_has_the_fp8_build_or_the_queue_refuses(monkeypatch):
    q, captured, built, ran = _deferred_setup(monkeypatch)
    monkeypatch.setattr(procs, "capture", lambda *a: None)    # compiled in this process already
    k = FakeKernel("gemm")
    x = torch.zeros(8, dtype=torch.int8)
    monkeypatch.setattr(s8wgmma, "_build", lambda *a: built.append(a[2][1]) or ("compiled", ()))
    with ahead.compiling(workers=1, async_mode=FakeAsync()):
        s8wgmma.launch_s8(k, (2,), (x, 64), {"BLOCK": 64}, 8, 3, CUDA, 0)
    assert built == [64] and q.pending() == [] and s8wgmma._PENDING == set()
    q, captured, built, ran = _deferred_setup(monkeypatch)   # INT8_FUSED_S8_DEFER=0: built in the dry run
    monkeypatch.setattr(s8wgmma, "_build", lambda *a: built.append(a[2][1]) or ("compiled", ()))
    with config.override(INT8_FUSED_S8_DEFER=False), ahead.compiling(workers=1, async_mode=FakeAsync()):
        s8wgmma.launch_s8(k, (2,), (x, 64), {"BLOCK": 64}, 8, 3, CUDA, 0)
    assert built == [64] and captured == [] and q.pending() == [] and s8wgmma._PENDING == set()


def test_specialization_ignores_the_divisibility_of_arguments_kept_out_of_triton_specialization():
    """``s8wgmma.specialization``: an integer of a ``do_not_specialize`` parameter (a row count) keys only on its
    width (i32 / i64), the others on equal-to-1 and divisible-by-16 as Triton specializes them."""
    class P:
        def __init__(self, name, dns=False, constexpr=False):
            self.name, self.do_not_specialize, self.is_constexpr = name, dns, constexpr

    class Fn:
        params = [P("a_ptr"), P("M", dns=True), P("K"), P("BLOCK", constexpr=True)]
    x = torch.zeros(8, dtype=torch.int8)

    def spec(m, k):
        return s8wgmma.specialization(launch.launch_key(Fn, (x, m, k), {"BLOCK": 64}, 8, 3, CUDA))
    assert spec(14040, 3072) == spec(9072, 3072) == spec(1, 3072) != spec(2 ** 33, 3072)
    assert spec(14040, 3072) != spec(14040, 40) and spec(14040, 40) != spec(14040, 1)


def test_first_call_runs_a_dry_run_then_the_real_one_once_per_key(monkeypatch):
    monkeypatch.setattr(ahead, "enabled", lambda dev: True)
    monkeypatch.setattr(ahead, "_DONE", set())
    monkeypatch.setattr(ahead, "Ahead", _FakeAhead)
    seen = []

    def fn():
        seen.append(launch.dry_run())
        return len(seen)
    assert ahead.first_call(("m", (1, 4)), CUDA, fn) == 2 and seen == [True, False]
    assert ahead.first_call(("m", (1, 4)), CUDA, fn) == 3 and seen == [True, False, False]
    assert ahead.first_call(("m", (1, 8)), CUDA, fn) == 5 and seen[3:] == [True, False]   # new shapes: again


class _FakeAhead(ahead.Ahead):
    def __init__(self, workers=1, async_mode=None, procs=None):
        assert procs is None            # the interpreter runs here: no compile workers
        super().__init__(workers, FakeAsync())


def test_a_dry_run_that_raises_leaves_the_real_call_to_compile_as_it_goes(monkeypatch, caplog):
    monkeypatch.setattr(ahead, "enabled", lambda dev: True)
    monkeypatch.setattr(ahead, "_DONE", set())
    monkeypatch.setattr(ahead, "_WARNED", [False])
    monkeypatch.setattr(ahead, "Ahead", _FakeAhead)
    seen = []

    def fn():
        seen.append(launch.dry_run())
        if launch.dry_run():
            raise RuntimeError("garbage in a skipped kernel's output")
        return "real"
    with caplog.at_level(logging.WARNING, logger="int8_fused"):
        assert ahead.first_call("k", CUDA, fn) == "real"
    assert seen == [True, False] and "the dry run stopped (RuntimeError: garbage" in caplog.text


def test_a_failed_compile_makes_the_real_call_choose_its_configs_again(monkeypatch):
    monkeypatch.setattr(ahead, "enabled", lambda dev: True)
    monkeypatch.setattr(ahead, "_DONE", set())
    monkeypatch.setattr(ahead, "Ahead", _FakeAhead)
    forgot = []
    monkeypatch.setattr(ahead, "on_failure", [lambda: forgot.append(1)])

    def fn():
        if launch.dry_run():
            ahead.active().submit("s8", lambda: 1 / 0)
    ahead.first_call("k2", CUDA, fn)
    assert forgot == [1]


def test_the_real_hooks_forget_the_chosen_configs():
    from kernel import gemm, retune, swiglu
    assert gemm._forget_chosen in ahead.on_failure and swiglu._SW_TILE.clear in ahead.on_failure
    gemm._TUNED[("x",)] = {}
    retune.COMPILED[("x",)] = [{}]
    gemm._forget_chosen()
    assert ("x",) not in gemm._TUNED and ("x",) not in retune.COMPILED


def test_off_under_the_interpreter_the_switch_and_on_the_cpu():
    from kernel import config
    assert not ahead.enabled(torch.device("cpu"))
    with config.override(INT8_FUSED_COMPILE_AHEAD=False):
        assert not ahead.enabled(CUDA)
    calls = []
    assert ahead.first_call("cpu-key", torch.device("cpu"), lambda: calls.append(launch.dry_run()) or 7) == 7
    assert calls == [False]


def test_the_comfyui_wrapper_keys_by_shapes_and_gives_the_dry_run_its_own_options(pack, monkeypatch):
    """nodes/compile_ahead.py's APPLY_MODEL wrapper: a dry run then the real call for each new (model, input shapes),
    the dry run on a copy of transformer_options; later calls of those shapes run once."""
    import importlib
    wrapper = importlib.import_module(pack.__name__ + ".nodes.compile_ahead")
    monkeypatch.setattr(ahead, "enabled", lambda dev: True)
    monkeypatch.setattr(ahead, "_DONE", set())
    monkeypatch.setattr(ahead, "Ahead", _FakeAhead)
    calls = []

    class Executor:
        class_obj = object()

        def __call__(self, x, t, c_concat, c_crossattn, control, transformer_options, **kw):
            calls.append((launch.dry_run(), transformer_options, tuple(x.shape)))
            return x * 2
    ex, opts = Executor(), {"cond_or_uncond": [0]}
    ctx = torch.zeros(1, 7, 16)
    x = torch.ones(1, 4, 8, 8)
    assert torch.equal(wrapper.apply_model(ex, x, torch.ones(1), c_crossattn=ctx, transformer_options=opts), x * 2)
    (dry, o1, _), (real, o2, _) = calls
    assert dry and not real and o2 is opts and o1 is not opts and o1 == opts
    wrapper.apply_model(ex, x, torch.ones(1), c_crossattn=ctx, transformer_options=opts)
    assert len(calls) == 3 and calls[2][0] is False                     # same shapes: the real call alone
    wrapper.apply_model(ex, torch.ones(1, 4, 6, 6), torch.ones(1), c_crossattn=ctx, transformer_options=opts)
    assert [c[0] for c in calls[3:]] == [True, False]                    # a new resolution: its own dry run
    wrapper.apply_model(ex, x, torch.ones(1), c_crossattn=torch.zeros(1, 9, 16), transformer_options=opts)
    assert [c[0] for c in calls[5:]] == [True, False]                    # a new prompt length too
