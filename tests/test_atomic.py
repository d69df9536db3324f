"""kernel/atomic.py: the one atomic-write helper (checkpoints, calibrations, the autotune cache).

Run: python -m pytest tests/test_atomic.py -q
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kernel import autotune
from kernel.atomic import atomic_write

ROOT = Path(__file__).resolve().parents[1]


def test_a_writer_killed_mid_write_leaves_the_target_untouched(tmp_path):
    target = tmp_path / "gemm-x.json"
    target.write_text('{"configs": {}}')
    script = ("import sys, time\nsys.path.insert(0, sys.argv[1])\nfrom kernel.atomic import atomic_write\n"
              "def hang(tmp):\n"
              "    open(tmp, 'w').write('{\"conf'); print('writing', flush=True); time.sleep(600)\n"
              "atomic_write(sys.argv[2], hang)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(ROOT), str(target)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert target.read_text() == '{"configs": {}}'  # the old file, whole
    stale = tmp_path / f".gemm-x.json.{proc.pid}.tmp"
    assert stale.read_text() == '{"conf'
    atomic_write(target, lambda tmp: Path(tmp).write_text("new"))  # the next write clears the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemm-x.json"] and target.read_text() == "new"


def test_a_failing_writer_or_an_existing_target_changes_nothing(tmp_path):
    target = tmp_path / "sub" / "c.safetensors"

    def fail(tmp):
        Path(tmp).write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, fail)
    assert list((tmp_path / "sub").iterdir()) == []  # folder made, no temporary left
    assert atomic_write(target, lambda tmp: Path(tmp).write_text("one")) == str(target)
    with pytest.raises(FileExistsError):
        atomic_write(target, lambda tmp: Path(tmp).write_text("two"), overwrite=False)
    atomic_write(target, lambda tmp: Path(tmp).write_text("three"))
    assert [p.name for p in target.parent.iterdir()] == ["c.safetensors"] and target.read_text() == "three"
    with pytest.raises(ValueError, match="NUL"):
        atomic_write(str(tmp_path / "a\x00b.json"), lambda tmp: None)


def test_autotune_cache_writes_through_the_helper(tmp_path, monkeypatch):
    path = tmp_path / "gemm-gpu.json"
    seen = []
    atomic = sys.modules["kernel.atomic"]  # the cache's file handling (kernel.jsoncache) writes through it
    real = atomic.atomic_write
    monkeypatch.setattr(atomic, "atomic_write", lambda p, w: seen.append(p) or real(p, w))
    cache = autotune.ConfigCache(path)
    cache.put("k", {"BLOCK_M": 64}, {"gpu": "x"})
    assert seen == [path] and json.loads(path.read_text()) == {"gpu": "x", "configs": {"k": {"BLOCK_M": 64}}}
    with pytest.raises(TypeError):  # a value JSON cannot hold: the file on disk stays as it was
        cache.put("k2", {"BLOCK_M": object()})
    assert json.loads(path.read_text())["configs"] == {"k": {"BLOCK_M": 64}}
    assert [p.name for p in tmp_path.iterdir()] == ["gemm-gpu.json"]
