"""The commit a bench run measured: ``$BENCH_COMMIT`` when set (the device machine's copy of the working tree keeps
a stale git HEAD, so bench/h200.sh's callers pass the commit they sent), else this checkout's git HEAD."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


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
