"""What a bench run records about itself: the commit it measured (``$BENCH_COMMIT`` when set: the device machine's
copy of the working tree keeps a stale git HEAD, so bench/h200.sh's callers pass the commit they sent; else this
checkout's git HEAD), the NVIDIA driver, the date and the command line. Where the pack is no git checkout of its own
(an unpacked copy), :func:`pack_version` names it by the version in its pyproject.toml, and says so."""
from __future__ import annotations

import datetime
import os
import re
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
    return head(ROOT, short) or "?"


def head(root: Path, short: bool = False) -> str | None:
    """git's HEAD of the checkout whose top folder is ``root``; None where ``root`` is no checkout of its own (a
    copy of the pack, also one inside another repository's tree, such as a ComfyUI clone's custom_nodes) or git
    cannot tell."""
    out = _run("git", "-C", str(root), "rev-parse", "--show-toplevel", *(["--short"] if short else []), "HEAD")
    lines = (out or "").splitlines()
    if len(lines) != 2 or Path(lines[0]).resolve() != Path(root).resolve():
        return None
    return lines[1]


def pack_version(root: Path = ROOT) -> str:
    """What names the pack in ``root``: its git HEAD, else the version in its pyproject.toml and where that came
    from ("0.1.0 (pyproject.toml; not a git checkout)"), else "?"."""
    sha = head(root)
    if sha:
        return sha
    try:
        text = (Path(root) / "pyproject.toml").read_text()
    except OSError:
        return "?"
    section, version = None, None
    for line in text.splitlines():
        if re.match(r"\s*\[", line):
            section = line.strip()
        elif section == "[project]" and (m := re.match(r'\s*version\s*=\s*["\']([^"\']+)["\']', line)):
            version = m.group(1)
    if version is None:
        return "?"
    why = "git could not name the commit" if (Path(root) / ".git").exists() else "not a git checkout"
    return f"{version} (pyproject.toml; {why})"


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
