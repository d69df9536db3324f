"""Where a thread's wall time goes, by sampling its Python stack: a helper thread reads the target thread's frame
(``sys._current_frames``) every ``interval_s`` and counts the innermost line (its own time, including the C calls
it makes: ``torch.empty``, a kernel launch) and every function on the stack (cumulative time). Unlike cProfile
it does not slow each call down (one sample costs tens of microseconds, a few per cent of the thread's time at
1 ms), so the shares are those of the real run. A C call holding the GIL delays the sample until it returns:
long C calls are credited to the line that made them, short ones are sampled where they were made.

    with StackSampler(threading.get_ident()) as s:
        work()
    s.table(per=steps)  # {"own": [[where, ms], ...], "cum": [...], "samples": n, "wall_s": s}
"""
from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path


_FILES: dict = {}  # code object's file name -> its last two path parts (a sample must stay cheap)


def _where(code, line: int | None = None) -> str:
    f = _FILES.get(code.co_filename)
    if f is None:
        f = _FILES[code.co_filename] = "/".join(Path(code.co_filename).parts[-2:])
    return f"{f}:{code.co_firstlineno if line is None else line}({code.co_name})"


class StackSampler:
    """Samples thread ``ident``'s stack every ``interval_s`` while in the ``with`` block (see module doc)."""

    def __init__(self, ident: int, interval_s: float = 0.001, switch_s: float = 2e-4, set_apart: str = ""):
        """``set_apart``: a function name; a sample with it on the stack is only counted (``apart``), so that the
        tables show the rest (e.g. "apply_model": a sample's time outside its model calls)."""
        self.ident, self.interval, self.switch, self.set_apart = ident, interval_s, switch_s, set_apart
        self.apart = 0
        self.own: collections.Counter = collections.Counter()  # "file:line(function)" of the innermost frame
        self.cum: collections.Counter = collections.Counter()  # code objects on the stack
        self.samples, self.wall = 0, 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._old_switch = None

    def _run(self) -> None:
        frames, stop, ident = sys._current_frames, self._stop, self.ident
        while not stop.wait(self.interval):
            f = frames().get(ident)
            if f is None:
                continue
            self.samples += 1
            if self.set_apart:
                g = f
                while g is not None and g.f_code.co_name != self.set_apart:
                    g = g.f_back
                if g is not None:
                    self.apart += 1
                    continue
            self.own[_where(f.f_code, f.f_lineno)] += 1
            seen = set()
            while f is not None:
                c = f.f_code
                if c not in seen:  # a function counted once a sample (recursion)
                    seen.add(c)
                    self.cum[c] += 1
                f = f.f_back

    def __enter__(self) -> "StackSampler":
        self._old_switch = sys.getswitchinterval()
        sys.setswitchinterval(self.switch)  # a sample waits at most this long for the GIL
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.wall = time.perf_counter() - self._t0
        sys.setswitchinterval(self._old_switch)

    def table(self, per: float = 1.0, top: int = 30) -> dict:
        """The top ``top`` lines by own share and functions by cumulative share, as ms of wall time per ``per``
        (e.g. per step): a share of the samples times the wall time."""
        n = max(self.samples, 1)
        scale = self.wall * 1e3 / per / n

        def rows(c):
            return [[(w if isinstance(w, str) else _where(w))[-110:], round(k * scale, 2)]
                    for w, k in c.most_common(top)]
        return {"samples": self.samples, "wall_s": round(self.wall, 4), "own": rows(self.own), "cum": rows(self.cum),
                "apart_ms": round(self.apart * scale, 2), "rest_ms": round((self.samples - self.apart) * scale, 2)}
