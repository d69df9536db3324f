"""bench/lib/provenance.py: the commit a bench run records (``$BENCH_COMMIT`` on the device machine, whose copy of the
tree keeps a stale git HEAD; else this checkout's HEAD, checked against git itself)."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench.lib import provenance  # noqa: E402


def test_bench_commit_env_wins_and_git_state_is_not_claimed(monkeypatch):
    monkeypatch.setenv("BENCH_COMMIT", "1c3b5ae")
    assert provenance.commit() == "1c3b5ae" and provenance.commit(short=True) == "1c3b5ae"
    assert provenance.dirty() is None


def test_bench_commit_from_git(monkeypatch):
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        assert provenance.commit() == "?"
        return
    assert provenance.commit() == head.stdout.strip()
    assert head.stdout.strip().startswith(provenance.commit(short=True))
    status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True).stdout
    assert provenance.dirty() is bool(status.strip())
