"""A fork server for the tests' ComfyUI 0.33.0 subprocesses (``comfy_harness.run_in_current_comfy``).

Each of those subprocesses used to start a fresh Python that imported torch, ComfyUI and its nodes (6-10 s on the
2-core machine, dozens of them a suite) before running its script. Here one server per test process does that
import once (the same prelude, the same interpreter, cwd and environment), then forks a child per script: the child
has the imports already, runs the script as ``python -c`` would (module ``__main__``, file ``<string>``), writes its
stdout and stderr to files and ends through the interpreter's normal shutdown (atexit handlers, ``__del__`` at
exit: what tests/test_patcher_teardown.py checks). The caller gets a ``subprocess.CompletedProcess`` as before.

What runs where is not changed by it: a script that needs other ComfyUI flags (``cli``) or another environment
than the server was started with runs in a fresh process, as before; so does everything when the server cannot
serve (``INT8_TEST_FORK=0``, a server whose prelude left a thread running or touched CUDA, a server that died).
Forking is safe there because the server has run no torch operation (no thread pools yet) and holds no threads.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import tempfile
import threading
import time
from pathlib import Path

# keys a test run changes on its own per test (pytest's current-test marker) and that nothing reads at import
VOLATILE = ("PYTEST_CURRENT_TEST",)

_SERVE = """
def _int8_fork_serve():
    import json, os, sys, threading
    reason = None
    if threading.active_count() != 1:
        reason = f"{threading.active_count()} threads after the prelude"
    elif "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        reason = "CUDA initialized by the prelude"
    proto_in, proto_out = _INT8_FORK_IO
    import gc
    gc.freeze()  # the prelude's objects: not traversed by a child's collections while its script runs
    proto_out.write(("READY" if reason is None else "NOFORK " + reason) + "\\n")
    proto_out.flush()
    if reason is not None:
        sys.exit(0)
    for line in proto_in:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: the request's files as stdout / stderr, its environment, then its code
            proto_in.close()
            proto_out.close()
            for fd, path in ((1, req["out"]), (2, req["err"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(f, fd)
                os.close(f)
            os.environ.clear()
            os.environ.update(req["env"])
            # the first atexit handler runs last: the shutdown then collects what a fresh process's would (cycles
            # through the prelude's objects included, with their __del__)
            import atexit
            atexit.register(gc.unfreeze)
            return req["code"]
        proto_out.write(f"PID {pid}\\n")
        proto_out.flush()
        _, status = os.waitpid(pid, 0)
        proto_out.write(f"RC {os.waitstatus_to_exitcode(status)}\\n")
        proto_out.flush()
    sys.exit(0)  # the test process closed the pipe


_int8_fork_code = _int8_fork_serve()
del _int8_fork_serve, _INT8_FORK_IO
exec(compile(_int8_fork_code, "<string>", "exec"))
"""

# before the prelude: the protocol keeps the pipes it was started with; the prelude's own output goes to the log
_HEAD = """\
import os as _os, sys as _sys
_INT8_FORK_IO = (_os.fdopen(_os.dup(0), "r"), _os.fdopen(_os.dup(1), "w"))
_nul = _os.open(_os.devnull, _os.O_RDONLY)
_os.dup2(_nul, 0)
_os.close(_nul)
_os.dup2(2, 1)
del _nul
"""


class ForkServer:
    """One server process (see the module doc); ``run`` returns a CompletedProcess or None when it cannot serve."""

    def __init__(self, python: str, prelude: str, cwd: Path, env: dict):
        self.env, self.python = dict(env), python
        self.log = tempfile.NamedTemporaryFile(prefix="int8_fork_", suffix=".log", delete=False)
        self.proc = subprocess.Popen([python, "-c", _HEAD + prelude + _SERVE], cwd=cwd, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, bufsize=0)
        self._buf = b""
        first = self._line(timeout=600)
        self.ok = first == "READY"
        self.why = None if self.ok else (first or f"no answer; log {self.log.name}")
        self.lock = threading.Lock()

    def _line(self, timeout: float | None) -> str | None:
        """The server's next protocol line, None at end of file; TimeoutError past ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = None if end is None else max(0.0, end - time.monotonic())
            if left == 0.0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def died(self) -> bool:
        """Whether a server that was serving has ended (killed for memory, say)."""
        return self.why is not None and self.why.startswith("server") or (self.ok and self.proc.poll() is not None)

    def serves(self, env: dict) -> bool:
        strip = lambda e: {k: v for k, v in e.items() if k not in VOLATILE}  # noqa: E731
        return self.ok and self.proc.poll() is None and strip(env) == strip(self.env)

    def run(self, code: str, env: dict, timeout: float) -> subprocess.CompletedProcess | None:
        with self.lock, tempfile.TemporaryDirectory(prefix="int8_fork_run_") as d:
            out, err = Path(d, "stdout"), Path(d, "stderr")
            req = json.dumps({"code": code, "out": str(out), "err": str(err), "env": env}) + "\n"
            try:
                self.proc.stdin.write(req.encode())
                first = self._line(timeout=60)
            except (BrokenPipeError, TimeoutError):
                first = None
            if not first or not first.startswith("PID "):
                self.ok, self.why = False, f"server stopped answering (log {self.log.name})"
                return None
            pid = int(first.split()[1])
            try:
                last = self._line(timeout=timeout)
            except TimeoutError:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
                self._line(timeout=60)  # the server reaps it and reports
                raise subprocess.TimeoutExpired([self.python, "-c", "<script>"], timeout,
                                                output=_read(out), stderr=_read(err))
            if not last or not last.startswith("RC "):
                self.ok, self.why = False, f"server ended (log {self.log.name})"
                return None
            return subprocess.CompletedProcess([self.python, "-c", "<script>"], int(last.split()[1]),
                                               _read(out), _read(err))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        Path(self.log.name).unlink(missing_ok=True)


def _read(p: Path) -> str:
    return p.read_bytes().decode("utf-8", errors="replace") if p.exists() else ""


_servers: dict = {}  # key -> ForkServer, least recently used first
_starts: dict = {}
_guard = threading.Lock()
MAX_SERVERS = 2  # a test that sets its own environment gets a server of its own; the oldest beyond this is closed


def run(python: str, prelude: str, cwd: Path, env: dict, code: str,
        timeout: float) -> subprocess.CompletedProcess | None:
    """``code`` run after ``prelude`` by this process's server for (python, prelude, cwd, environment), started on
    first use; None where it cannot serve (the caller then starts a fresh process)."""
    if os.environ.get("INT8_TEST_FORK", "1") == "0":
        return None
    key = (python, prelude, str(cwd), frozenset((k, v) for k, v in env.items() if k not in VOLATILE))
    with _guard:
        srv = _servers.pop(key, None)
        if srv is None or (srv.died() and _starts.get(key, 0) < 3):  # a server that died is started again
            _starts[key] = _starts.get(key, 0) + 1
            while len(_servers) >= MAX_SERVERS:
                _servers.pop(next(iter(_servers))).close()
            srv = ForkServer(python, prelude, cwd, env)
        _servers[key] = srv  # now the most recently used
    if not srv.serves(env):
        return None
    return srv.run(code, env, timeout)


@atexit.register
def _close_all() -> None:
    for srv in _servers.values():
        srv.close()
