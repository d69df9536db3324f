"""Runs the unit tests of the widget's formatting module (web/int8_format.js) under node's test runner."""
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_web_format_module():
    node = shutil.which("node")
    if node is None:
        pytest.fail("node (v18+) is needed to unit-test web/int8_format.js; install nodejs")
    proc = subprocess.run([node, "--test", str(ROOT / "tests" / "test_web_format.mjs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout and "# pass 0" not in proc.stdout, proc.stdout[-2000:]
