"""Timing off the critical path: jobs that time a shape's alternatives run between samples, never inside one.

Why: a first call that times every candidate tile of its shape (each one compiled) cost a new user 20-35 s before
the first image on a GPU without shipped picks (issue 48). Now the first call runs at once on a predicted config
(``kernel.autotune.choose``) and submits a job here that times the alternatives later.

``INT8_FUSED_TUNE`` (``kernel.config``):
  ``background`` (default)  jobs run on one daemon thread while no sample runs (``busy()`` brackets a sample:
                            nodes/timing.py's OUTER_SAMPLE wrapper) and none has for ``IDLE_S`` seconds;
  ``first_call``            no jobs: the first call of a shape times its candidates then and there (the old way);
  ``off``                   no jobs and no timing: predicted configs, the user's cache and the shipped tables only.

A job is ``fn(stop)``: it times in small pieces and, before each piece, calls ``stop()``; once a sample has
started, ``stop()`` raises :class:`Stopped` (a ``BaseException``, so the tuners' ``except Exception`` of a config
that fails to build does not swallow it), the job ends without writing anything, and it is queued again at the
front for the next idle period. So a sample that starts while a job runs waits for at most the piece in flight
(one candidate's compile and timing), and the steps that follow run beside nothing. A job that raises anything
else is dropped (logged once at debug level): the predicted config stays.

``drain(stop)`` runs the queued jobs on the calling thread (benches and tests). No torch or Triton here.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import threading
import time

from . import config

log = logging.getLogger("int8_fused")

IDLE_S = 1.0    # a job starts only this long after the last sample ended
POLL_S = 0.25   # how often the idle worker looks again while a sample runs


class Stopped(BaseException):
    """Raised by a job's ``stop()`` once a sample has started (or the process is ending)."""


def mode() -> str:
    return config.get("INT8_FUSED_TUNE")


class Queue:
    """Pending timing jobs by key (a key queued twice keeps its first job), the samples in flight, one worker.

    ``clock``: a monotonic clock (tests pass a fake one); ``start_worker``: False keeps jobs queued until
    ``drain`` (tests)."""

    def __init__(self, clock=time.monotonic, start_worker: bool = True):
        self._clock = clock
        self._jobs: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Condition()
        self._busy = 0
        self._last_busy = None      # clock() when the last sample ended (None: none has run yet)
        self._worker: threading.Thread | None = None
        self._start_worker = start_worker
        self._closing = False
        self.running: str | None = None  # the key of the job running now
        self.done: list[str] = []       # keys whose job finished
        self.stopped: list[str] = []    # keys whose job was stopped by a sample (and queued again)
        self.failed: list[str] = []     # keys whose job raised (dropped)

    # ------------------------------------------------------------------ samples
    @contextlib.contextmanager
    def busy(self):
        """Brackets a sample: no job starts inside, and a running one stops at its next piece."""
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._last_busy = self._clock()
                self._lock.notify_all()

    def sampling(self) -> bool:
        return self._busy > 0

    def idle(self) -> bool:
        """No sample runs, and none ended within ``IDLE_S``."""
        return self._busy == 0 and (self._last_busy is None or self._clock() - self._last_busy >= IDLE_S)

    # ------------------------------------------------------------------ jobs
    def submit(self, key: str, fn) -> bool:
        """Queues ``fn(stop)`` under ``key`` unless that key is queued already; True if queued."""
        with self._lock:
            if key in self._jobs or self._closing:
                return False
            self._jobs[key] = fn
            self._lock.notify_all()
        if self._start_worker:
            self._ensure_worker()
        return True

    def pending(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    def _take(self):
        with self._lock:
            if not self._jobs:
                return None
            item = self._jobs.popitem(last=False)
            self.running = item[0]
            return item

    def _requeue_front(self, key: str, fn) -> None:
        with self._lock:
            if key not in self._jobs:
                self._jobs[key] = fn
                self._jobs.move_to_end(key, last=False)

    def run_one(self, stop) -> str | None:
        """Runs the first queued job with ``stop``; returns its key (None: nothing queued)."""
        item = self._take()
        if item is None:
            return None
        key, fn = item
        try:
            fn(stop)
        except Stopped:
            self._requeue_front(key, fn)
            self.stopped.append(key)
            return key
        except Exception as e:  # noqa: BLE001 - a job that fails leaves the predicted config in place
            self.failed.append(key)
            log.debug("INT8 background tuning of %s failed (%s: %s); the predicted config stays", key,
                      type(e).__name__, str(e)[:300])
            return key
        finally:
            self.running = None
        self.done.append(key)
        return key

    def settled(self) -> bool:
        """Nothing queued and nothing running."""
        with self._lock:
            return not self._jobs and self.running is None

    def wait_settled(self, timeout: float) -> bool:
        """Waits (polling) until ``settled()`` or ``timeout`` seconds passed; returns ``settled()`` (benches: the
        idle time a user leaves between samples, in which the queued timing runs)."""
        end = time.monotonic() + timeout
        while not self.settled() and time.monotonic() < end:
            time.sleep(0.05)
        return self.settled()

    def drain(self, stop=None) -> int:
        """Runs every queued job now on this thread (``stop``: a job's stop check; default never stops). Returns
        how many ran to the end."""
        stop = stop or (lambda: None)
        n = 0
        while True:
            before = len(self.done)
            key = self.run_one(stop)
            if key is None:
                return n
            if len(self.done) > before:
                n += 1
            elif self.stopped and self.stopped[-1] == key:
                return n    # stopped: leave the rest for later

    def stop_check(self) -> None:
        """A background job's ``stop``: raises :class:`Stopped` while a sample runs or the process ends."""
        if self._busy or self._closing:
            raise Stopped()

    # ------------------------------------------------------------------ the worker
    def _ensure_worker(self) -> None:
        with self._lock:
            if self._worker is not None and self._worker.is_alive():
                return
            self._worker = threading.Thread(target=self._loop, name="int8-fused-tuning", daemon=True)
            self._worker.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closing and (not self._jobs or not self.idle()):
                    self._lock.wait(POLL_S)
                if self._closing:
                    return
            self.run_one(self.stop_check)
            self._summary()

    def _summary(self) -> None:
        """One INFO line each time the queue has run empty: what the idle worker did since the last one."""
        with self._lock:
            if self._jobs or self.running is not None:
                return
            done, stopped, failed = len(self.done), len(self.stopped), len(self.failed)
            last = getattr(self, "_reported", (0, 0, 0))
            self._reported = (done, stopped, failed)
        if (done, stopped, failed) != last:
            log.info("INT8 background tuning: %d timing job(s) finished between samples (%d stopped by a sample and "
                     "run again, %d dropped); later calls use what they found", done - last[0],
                     stopped - last[1], failed - last[2])

    def close(self, timeout: float = 5.0) -> None:
        """Stops the worker at its next piece (the process is ending); queued jobs are dropped."""
        with self._lock:
            self._closing = True
            self._jobs.clear()
            self._lock.notify_all()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)


QUEUE = Queue()
atexit.register(QUEUE.close)


def submit(key: str, fn) -> bool:
    """Queues a timing job where ``INT8_FUSED_TUNE`` is ``background``; False (nothing queued) otherwise."""
    if mode() != "background":
        return False
    return QUEUE.submit(key, fn)


def busy():
    """The context manager that brackets one sample (nodes/timing.py)."""
    return QUEUE.busy()
