"""What a bench run records about itself: the commit it measured (``$BENCH_COMMIT`` when set: the device machine's
copy of the working tree keeps a stale git HEAD, so bench/h200.sh's callers pass the commit they sent; else this
checkout's git HEAD), the NVIDIA driver, the date and the command line."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*cmd: str) -> str | None:
    """``cmd``'s stdout, stripped; None when it cannot run or fails."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _git(*args: str) -> str | None:
    return _run("git", "-C", str(ROOT), *args)


def commit(short: bool = False) -> str:
    """``$BENCH_COMMIT``, else git's HEAD (abbreviated with ``short``), else "?"."""
    env = os.environ.get("BENCH_COMMIT", "").strip()
    if env:
        return env
    return _git("rev-parse", *(["--short"] if short else []), "HEAD") or "?"


def dirty() -> bool | None:
    """Whether tracked files differ from git's HEAD; None when ``$BENCH_COMMIT`` names the commit (the local git
    state says nothing then) or git cannot tell."""
    if os.environ.get("BENCH_COMMIT", "").strip():
        return None
    out = _git("status", "--porcelain", "--untracked-files=no")
    return None if out is None else bool(out)


def driver(query: str = "driver_version") -> str | None:
    """``nvidia-smi --query-gpu=<query>`` of the first GPU (e.g. its driver version); None without nvidia-smi."""
    out = _run("nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader")
    return out.splitlines()[0] if out else None


def now() -> str:
    """The time in UTC, to the second (ISO 8601)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command() -> str:
    """This process's command line, as ``python3 <script> <args>``."""
    return " ".join(["python3", *map(str, sys.orig_argv[1:])])
