"""Compiling a model call's kernels in parallel before the call runs.

Why: a first sample on a new machine compiled each kernel of the pack (GEMM tiles and epilogues, the s8 wgmma
builds, the fused row kernels) when the forward first reached it, one after another: 8-10 s on top of bf16's first
sample on an H200 even with every tile known in advance (bench/RESULTS.md, issue 48).

``first_call(key, fn)``: the first time a ``key`` (a model and its call's input shapes) is seen, ``fn`` runs twice.
The first run is dry: inside ``compiling()`` every launch of the pack (``kernel.launch.launch``, the s8 builds of
``kernel.s8wgmma``) hands its compile to a pool of ``WORKERS`` threads (Triton's ``AsyncCompileMode``: compiles
run in the pool, the kernels land in Triton's in-memory and on-disk caches) instead of running; no prepared call
(``kernel.plan``) is recorded and nothing is counted. Torch's own operations run as usual on whatever the skipped
kernels left in their outputs (the result is thrown away). Then every compile is waited for and ``fn`` runs for
real, finding its kernels built. The dry run costs one forward of the model's non-pack GPU work and host time.

A compile that fails in the pool is not kept (Triton compiles it again when the real run reaches it and raises
there, as without this module); the pack's chosen configs are then forgotten (``on_failure``), so that the real run
chooses again with its checks. A dry run that raises leaves the real run to compile as it goes (logged once).
``INT8_FUSED_COMPILE_AHEAD=0`` turns it off. Nothing happens under the interpreter, torch.compile tracing or CUDA
graph capture. The tests: tests/test_compile_ahead.py.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time

from . import config

log = logging.getLogger("int8_fused")

WORKERS = max(1, min(8, os.cpu_count() or 1))
_ACTIVE: list = [None]     # the running ``Ahead`` (one at a time: the sampling thread's)
_DONE: set = set()         # keys whose first call ran
_WARNED = [False]
on_failure: list = []      # callables run when a compile in the pool failed (forget the configs chosen meanwhile)
HISTORY: list = []         # one dict a dry run: kernels compiled, launches seen, seconds, failures (logs, the bench)


def active():
    """The running :class:`Ahead`, or None (launches run)."""
    return _ACTIVE[0]


def done(key) -> bool:
    """Whether ``key``'s first call has run (``first_call``)."""
    return key in _DONE


class Ahead:
    """One dry run: the compiles it started, and what became of them."""

    def __init__(self, workers: int = WORKERS, async_mode=None, procs=None):
        import concurrent.futures
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="int8-fused-compile")
        self.procs = procs          # a ``kernel.procs.Pool``: compiles run in its worker processes
        self.t0 = time.perf_counter()
        if async_mode is None:
            from triton.runtime._async_compile import AsyncCompileMode
            async_mode = AsyncCompileMode(self.pool, ignore_errors=True)
        self.mode = async_mode
        self.jobs: list = []        # futures of whole jobs (s8 builds)
        self.seen: set = set()
        self.launches = 0           # launches skipped
        self.errors: list[str] = []
        self.job_s: list = []       # (name, seconds) of each whole job (``submit``) that finished
        self.remote: list = []      # one dict a compile sent to a worker: name, worker seconds, hit, error

    def compile(self, key, jit_fn, grid, args, constexprs: dict, num_warps: int, num_stages: int,
                device=None) -> None:
        """Starts the compile of ``jit_fn[grid](*args, **constexprs, ...)`` (once per ``key``) without running it:
        in a worker process where there are workers (``kernel.procs``), else in the thread pool."""
        self.launches += 1
        if key in self.seen:
            return
        self.seen.add(key)
        if self.procs is not None:
            from . import procs
            req = procs.capture(jit_fn, args, grid, constexprs, num_warps, num_stages)
            if req is not None:
                self.jobs.append(self.pool.submit(self._remote, req, jit_fn, args, grid, constexprs, num_warps,
                                                  num_stages, device))
            return
        jit_fn.warmup(*args, grid=grid, **constexprs, num_warps=num_warps, num_stages=num_stages)

    def _remote(self, req, jit_fn, args, grid, constexprs, num_warps, num_stages, device):
        """A worker compiles the kernel into Triton's cache; then this process' own compile of it (a cache hit, or
        the whole compile where the worker failed) puts it in the JIT function's in-memory cache."""
        sent = time.perf_counter() - self.t0
        reply = self.procs.compile(req)
        got = time.perf_counter() - self.t0
        k = None
        try:
            with _on(device):
                k = jit_fn.warmup(*args, grid=grid, **constexprs, num_warps=num_warps, num_stages=num_stages)
        finally:
            self.remote.append({"name": req["qualname"], "s": reply.get("s"), "error": reply.get("error"),
                                "hit": reply.get("hash") is not None and getattr(k, "hash", None) == reply.get("hash"),
                                # seconds after the dry run's start: sent, the worker's reply, loaded here
                                "at": [round(sent, 3), round(got, 3), round(time.perf_counter() - self.t0, 3)]})
        return k

    def precompile(self, jit_fn, args, grid, constexprs: dict, num_warps: int, num_stages: int, device) -> None:
        """In a pool thread (an s8 build): the kernel compiled by a worker first, where there are workers, so that
        the build's own compile of it is a cache hit."""
        if self.procs is None:
            return
        from . import procs
        with _on(device):
            req = procs.capture(jit_fn, args, grid, constexprs, num_warps, num_stages)
        if req is not None:
            reply = self.procs.compile(req)
            self.remote.append({"name": req["qualname"], "s": reply.get("s"), "error": reply.get("error"),
                                "hit": None})

    def submit(self, key, fn) -> None:
        """Runs ``fn()`` (a whole build: compile, rewrite, assemble) in the pool, once per ``key``."""
        self.launches += 1
        if key in self.seen:
            return
        self.seen.add(key)
        inner = key[1] if isinstance(key, tuple) and len(key) > 1 and isinstance(key[1], tuple) else ()
        name = (f"{getattr(inner[0], '__name__', inner[0])}{list(inner[2])}" if len(inner) > 2 else str(key))[:160]

        def timed():
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                self.job_s.append((name, round(time.perf_counter() - t0, 3)))
        self.jobs.append(self.pool.submit(timed))

    def finish(self) -> int:
        """Waits for every compile; returns how many were started. Failures are collected in ``errors``."""
        import concurrent.futures
        futures = list(getattr(self.mode, "raw_futures", ())) + self.jobs
        concurrent.futures.wait(futures)
        for f in futures:
            e = f.exception()
            if e is not None:
                self.errors.append(f"{type(e).__name__}: {str(e)[:200]}")
        self.pool.shutdown(wait=True)
        return len(futures)


def _on(device):
    """The CUDA ``device`` made current in this thread (Triton compiles for the current device), where CUDA exists."""
    import torch
    if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@contextlib.contextmanager
def compiling(workers: int = WORKERS, async_mode=None, procs=None):
    """Inside, the pack's launches start compiles instead of running (module doc); on leaving, every compile is
    waited for. ``procs``: a ``kernel.procs.Pool`` whose processes do the compiles. Yields the :class:`Ahead`."""
    if _ACTIVE[0] is not None:
        raise RuntimeError("a dry run is already in progress")
    a = Ahead(workers, async_mode, procs)
    _ACTIVE[0] = a
    try:
        with a.mode:
            yield a
    finally:
        a.body_s = round(time.perf_counter() - a.t0, 3)   # the dry forward itself, before the compiles are waited for
        _ACTIVE[0] = None
        a.finish()


def enabled(device) -> bool:
    if not config.get("INT8_FUSED_COMPILE_AHEAD") or config.get("TRITON_INTERPRET"):
        return False
    if getattr(device, "type", None) != "cuda":
        return False
    import torch
    return not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing()


def prestart(device) -> None:
    """Starts the compile worker processes (``kernel.procs``; Apply calls it) where a dry run will use them: a CUDA
    device, compile-ahead on."""
    from . import procs
    if enabled(device) and procs.count() > 0:   # no driver query where no worker will start (the default)
        import triton
        try:
            with _on(device):
                target = triton.runtime.driver.active.get_current_target()
        except Exception:  # noqa: BLE001 - the workers start without warming up
            target = None
        procs.pool(target=target)


def first_call(key, device, fn):
    """``fn()``; the first time for ``key`` on ``device`` (a CUDA device) after a dry run of ``fn`` that compiles its
    kernels in parallel (module doc)."""
    if key in _DONE or _ACTIVE[0] is not None or not enabled(device):
        return fn()
    _DONE.add(key)
    t0 = time.perf_counter()
    a = None
    try:
        from . import procs
        with compiling(procs=procs.pool()) as a:
            fn()
    except Exception as e:  # noqa: BLE001 - the real run compiles as it goes
        if not _WARNED[0]:
            _WARNED[0] = True
            log.warning("INT8 compile-ahead: the dry run stopped (%s: %s); the first call compiles its kernels as it "
                        "runs", type(e).__name__, str(e)[:300])
    if a is not None:
        if a.errors:
            for forget in on_failure:
                forget()
            log.info("INT8 compile-ahead: %d of %d compiles failed (%s); the first call chooses again",
                     len(a.errors), len(a.seen), a.errors[0])
        dt = time.perf_counter() - t0
        HISTORY.append({"kernels": len(a.seen), "launches": a.launches, "s": round(dt, 3), "failed": len(a.errors),
                        "jobs": sorted(a.job_s, key=lambda j: -j[1]),
                        "procs": len(a.procs.procs) if a.procs is not None else 0, "remote": list(a.remote),
                        "body_s": getattr(a, "body_s", None)})
        log.info("INT8 compile-ahead: %d kernels compiled in parallel (%s) in %.1f s before the first call",
                 len(a.seen), f"{len(a.procs.procs)} processes" if a.procs is not None else
                 f"{a.pool._max_workers} threads", dt)
    return fn()
