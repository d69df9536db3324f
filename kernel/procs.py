"""Compile worker processes for ``kernel.ahead``'s dry run.

Why: in a thread pool, Triton's compiles hold the GIL through most of their LLVM passes, so eight threads ran about
three compiles at once and a model's first call still waited several seconds for them (bench/RESULTS.md, issue 48).
Processes compile truly in parallel.

How: a launch of the dry run whose kernel this process has not compiled yet is *captured*: its ``warmup`` runs with
a ``jit_cache_hook`` that takes Triton's ``specialization_data`` (the JSON ``JITFunction.preload`` reads) and stops
before compiling. A worker process (``kernel/compile_worker.py``) compiles it for the same target into Triton's
on-disk cache; then this process' own compile of it, in the dry run's thread pool, is a cache hit. If a worker
fails, dies or compiled under another key, this process compiles the kernel itself, as without workers: results
never depend on the workers.

The workers start when Apply runs (``kernel.ahead.prestart``), so their imports overlap what runs before the first sample, and
exit after ``IDLE_S`` seconds without a request (``INT8_FUSED_COMPILE_PROCS``: how many; ``0``: threads only).
Each is a Python that imported torch and Triton and nothing of ComfyUI.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

from . import config

log = logging.getLogger("int8_fused")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_worker.py")
IDLE_S = 120.0
_LOCK = threading.Lock()
_POOL: list = [None]
_LOCAL = threading.local()
_HOOK_LOCK = threading.Lock()
_BAD = [False]
_PREV: list = [None]      # the jit_cache_hook ours replaced while a capture runs (other threads' compiles call it)


def count() -> int:
    """How many workers ``INT8_FUSED_COMPILE_PROCS`` asks for (0: none)."""
    v = str(config.get("INT8_FUSED_COMPILE_PROCS")).strip().lower()
    if v == "auto":
        return count_auto()
    try:
        return max(0, int(v))
    except ValueError:
        if not _BAD[0]:
            _BAD[0] = True
            log.warning("INT8_FUSED_COMPILE_PROCS=%r is neither `auto` nor a number: 0 used (the default: the "
                        "compiles run in threads)", v)
        return 0


def count_auto() -> int:
    return max(0, min(16, (os.cpu_count() or 1) - 1))


def _packages(module: str) -> list:
    """[(name, __path__)] of ``module``'s parent packages, outermost first (what the worker registers)."""
    parts = module.split(".")[:-1]
    out = []
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        m = sys.modules.get(name)
        if m is not None and getattr(m, "__path__", None) is not None:
            out.append([name, list(m.__path__)])
    return out


class Pool:
    """``n`` worker processes; ``compile(request)`` from any thread hands it to an idle one and waits."""

    def __init__(self, n: int, env: dict | None = None, cache_dir: str | None = None, target=None):
        import queue
        if cache_dir is None:
            import triton
            cache_dir = triton.knobs.cache.dir
        e = dict(os.environ if env is None else env)
        e.update(TRITON_CACHE_DIR=str(cache_dir), CUDA_VISIBLE_DEVICES="")
        e.pop("TRITON_INTERPRET", None)
        kernel_pkg = __name__.rsplit(".", 1)[0]
        mods = sorted(m for m in list(sys.modules) if m.startswith(kernel_pkg + ".") and sys.modules[m] is not None
                      and m.rsplit(".", 1)[-1] not in ("procs", "compile_worker"))
        setup = json.dumps({"packages": _packages(__name__), "modules": mods,
                            "target": [target.backend, target.arch, target.warp_size] if target else None}) + "\n"
        self.idle: queue.Queue = queue.Queue()
        self.procs: list = []
        self.last = time.monotonic()
        self.closed = False
        for _ in range(n):
            p = subprocess.Popen([sys.executable, "-u", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, env=e, text=True, bufsize=1)
            p.stdin.write(setup)
            p.stdin.flush()
            self.procs.append(p)
            self.idle.put(p)

    def compile(self, request: dict) -> dict:
        """The worker's reply (``hash`` or ``error``); ``{"error": ...}`` when no worker could answer."""
        self.last = time.monotonic()
        if self.closed:
            return {"error": "the compile workers were closed"}
        p = self.idle.get()
        try:
            p.stdin.write(json.dumps(request) + "\n")
            p.stdin.flush()
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"compile worker {p.pid} exited ({p.poll()})")
            reply = json.loads(line)
        except Exception as e:  # noqa: BLE001 - a dead worker: this process compiles the kernel itself
            p.kill()
            if all(q.poll() is not None for q in self.procs):
                self.closed = True
            return {"error": f"compile worker {p.pid}: {type(e).__name__}: {e}"}
        finally:
            self.last = time.monotonic()
        self.idle.put(p)
        return reply

    def alive(self) -> int:
        return sum(p.poll() is None for p in self.procs)

    def close(self) -> None:
        self.closed = True
        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()


def _reaper() -> None:
    while True:
        time.sleep(min(10.0, IDLE_S))
        with _LOCK:
            pool = _POOL[0]
            if pool is None:
                return
            if time.monotonic() - pool.last > IDLE_S:
                _POOL[0] = None
                pool.close()
                return


def pool(start: bool = True, target=None) -> Pool | None:
    """The running pool; started (when ``start`` and the switch asks for workers) if none runs. ``target``: the
    GPUTarget the workers warm their compiler up for."""
    with _LOCK:
        p = _POOL[0]
        if p is not None and not p.closed and p.alive():
            p.last = time.monotonic()
            return p
        n = count()
        if not start or n == 0 or config.get("TRITON_INTERPRET"):
            return None
        try:
            p = Pool(n, target=target)
        except Exception as e:  # noqa: BLE001 - threads do the compiles
            log.warning("INT8 compile-ahead: no compile workers (%s: %s); compiling in threads", type(e).__name__, e)
            return None
        _POOL[0] = p
        threading.Thread(target=_reaper, name="int8-fused-compile-reaper", daemon=True).start()
        return p


def shutdown() -> None:
    with _LOCK:
        p, _POOL[0] = _POOL[0], None
    if p is not None:
        p.close()


def _hook(**kw):
    cap = getattr(_LOCAL, "capture", None)
    if cap is None:
        return _PREV[0](**kw) if _PREV[0] is not None else None
    cap.append(kw)
    return True      # Triton compiles nothing


def capture(jit_fn, args: tuple, grid, constexprs: dict, num_warps: int, num_stages: int) -> dict | None:
    """The worker request for ``jit_fn``'s kernel at these arguments, or None when this process has it compiled
    already (or Triton called no hook: then it compiled it in this call). Runs ``warmup`` under a ``jit_cache_hook``
    that records Triton's ``specialization_data`` and skips the compile (module doc)."""
    import triton
    rt = triton.knobs.runtime
    got: list = []
    with _HOOK_LOCK:
        prev = _PREV[0] = rt.jit_cache_hook
        _LOCAL.capture = got
        rt.jit_cache_hook = _hook
        try:
            jit_fn.warmup(*args, grid=grid, **constexprs, num_warps=num_warps, num_stages=num_stages)
        finally:
            rt.jit_cache_hook = prev
            _LOCAL.capture = None
            _PREV[0] = None
    if not got:
        return None
    kw = got[0]
    info, comp = kw["fn"], kw["compile"]
    fn = info.jit_function
    target = fn.device_caches[comp["device"]][2]
    return {"module": info.module, "qualname": info.name, "spec": comp["specialization_data"],
            "target": [target.backend, target.arch, target.warp_size]}
