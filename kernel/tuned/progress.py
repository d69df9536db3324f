"""Tuning on the critical path, as the log and the widget see it.

Whatever times on a user's call (GEMM tiles in ``kernel.autotune.pick_config``, tail splits, the int8-vs-float
dispatch, attention probes) runs inside ``task(kind, label, detail, file)``. Each task logs one INFO line as it
starts, e.g. ``INT8 autotune: shape 3 GEMM N=3072 K=3072 M<=4096 s8p: 12 candidates`` (``shape 3/12`` once a caller
set ``expect(12)``). A session is the tasks until ``finish()`` or until nothing has been tuned for ``QUIET_S``
seconds; it ends with ``INT8 autotune: tuned 12 shapes in 14.2 s (9 GEMM, 3 dispatch); cached in <files>``.

``snapshot()`` is the hook for nodes/timing.py and the widget (a dict, see its docstring; lock-protected, so a
server thread may poll it while the sampling thread tunes); ``listeners`` (callables taking that dict) are called as
each task starts and ends and when a session ends, on the thread that tunes. No torch here.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import re
import threading
import time

log = logging.getLogger("int8_fused")

QUIET_S = 2.0   # a session ends (its summary logged) this long after its last task


def gemm_label(key: str) -> str:
    """``N3072_K3072_M4096_s8p`` -> ``N=3072 K=3072 M<=4096 s8p`` (other keys as given)."""
    m = re.match(r"^(?:([A-Z]+)_)?N(\d+)_K(\d+)_M(\d+)_?(.*)$", key)
    if m is None:
        return key
    pre, n, k, mb, rest = m.groups()
    return " ".join(x for x in (pre, f"N={n} K={k} M<={mb}", rest.replace("_", " ")) if x)


class Progress:
    """The session's tuning: counts, the task running now, the files written (``snapshot``)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._timer: threading.Timer | None = None
        self._stack: list[dict] = []
        self.total: int | None = None
        self.last_summary: str | None = None
        self.listeners: list = []
        self.seeded: collections.Counter = collections.Counter()   # this process's, across sessions
        self._new_session()

    def _new_session(self):
        self.shapes, self.seconds = 0, 0.0
        self.kinds: collections.Counter = collections.Counter()
        self.files: list[str] = []

    def expect(self, total: int | None) -> None:
        """How many shapes the session will tune, where a caller knows (shown as ``shape 3/12``)."""
        self.total = total

    def seed_hit(self, kind: str) -> None:
        """An entry of a shipped table used instead of timing (``kind``: the seed's section)."""
        with self._lock:
            self.seeded[kind] += 1

    @contextlib.contextmanager
    def task(self, kind: str, label: str, detail: str = "", file=None):
        """One shape timed on the caller's thread; nested tasks (a dispatch timing that tunes the GEMM it runs)
        count as shapes, their time once."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.shapes += 1
            n = f"{self.shapes}/{self.total}" if self.total and self.total >= self.shapes else str(self.shapes)
            cur = {"kind": kind, "label": label, "detail": detail, "shape": self.shapes,
                   "started": time.perf_counter()}
            self._stack.append(cur)
        log.info("INT8 autotune: shape %s %s %s%s", n, kind, label, f": {detail}" if detail else "")
        self._tell()
        try:
            yield
        finally:
            with self._lock:
                self._stack.remove(cur)
                self.kinds[kind] += 1
                if file is not None and str(file) not in self.files:
                    self.files.append(str(file))
                if not self._stack:
                    self.seconds += time.perf_counter() - cur["started"]
                    if QUIET_S is not None:
                        self._timer = threading.Timer(QUIET_S, self._quiet, args=(self.shapes,))
                        self._timer.daemon = True
                        self._timer.start()
            self._tell()

    def _quiet(self, shapes: int) -> None:
        with self._lock:
            if not self._stack and self.shapes == shapes:
                self.finish()

    def finish(self) -> str | None:
        """Ends the session: logs and returns its summary (None when nothing was tuned)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._stack or not self.shapes:
                return None
            kinds = ", ".join(f"{n} {k}" for k, n in self.kinds.most_common())
            line = (f"INT8 autotune: tuned {self.shapes} shape{'s' if self.shapes != 1 else ''} in {self.seconds:.1f} s"
                    f" ({kinds})" + (f"; cached in {', '.join(self.files)}" if self.files else ""))
            if self.seeded:
                line += "; taken from the shipped tables so far: " + ", ".join(
                    f"{n} {k}" for k, n in sorted(self.seeded.items()))
            self.last_summary, self.total = line, None
            self._new_session()
        log.info("%s", line)
        self._tell()
        return line

    def _tell(self) -> None:
        if not self.listeners:
            return
        snap = self.snapshot()
        for fn in list(self.listeners):
            try:
                fn(snap)
            except Exception as e:  # noqa: BLE001 - a widget's failure must not stop the tuning
                log.debug("INT8 autotune: progress listener %r failed: %s", fn, e)

    def snapshot(self) -> dict:
        """{"active": tuning now, "current": {"kind", "label", "detail", "shape", "elapsed_s"} or None, "shapes":
        shapes tuned this session, "total": expected or None, "seconds": time tuning this session (finished tasks),
        "kinds": {kind: shapes}, "files": cache files written, "seeded": {section: entries this process took from
        the shipped tables}, "last_summary": the last session's summary line or None}."""
        with self._lock:
            cur = None
            if self._stack:
                top = self._stack[-1]
                cur = {k: v for k, v in top.items() if k != "started"}
                cur["elapsed_s"] = time.perf_counter() - self._stack[0]["started"]
            return {"active": bool(self._stack), "current": cur, "shapes": self.shapes, "total": self.total,
                    "seconds": self.seconds, "kinds": dict(self.kinds), "files": list(self.files),
                    "seeded": dict(self.seeded), "last_summary": self.last_summary}


PROGRESS = Progress()
task, snapshot, finish, expect, seed_hit = (PROGRESS.task, PROGRESS.snapshot, PROGRESS.finish, PROGRESS.expect,
                                            PROGRESS.seed_hit)
