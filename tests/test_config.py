"""kernel/config.py: every environment switch read in one place, once; ``override`` for tests.

Run: TRITON_INTERPRET=1 python -m pytest tests/test_config.py -q
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import kernel
from kernel import autotune, config
from quant import backends
from quant import blocks as qf
from quant.linear import Int8Linear
import adapters

ROOT = Path(__file__).resolve().parents[1]

# Prints what each switch changed, in a fresh process with the environment the test gives it.
PROBE = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]; import pack_import; pack_import.install()
import torch
from torch import nn
import kernel, kernel.launch
from kernel import autotune, config
from quant import attention, backends
from quant.linear import Int8Linear
import adapters, dataclasses, functools
from adapters import lumina2
LUMINA = dataclasses.replace(lumina2.ADAPTER, fuse=functools.partial(lumina2.fuse, clamp_fp16=False))

class FeedForward(nn.Module):  # the structure of Lumina 2's SwiGLU FeedForward
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(32, 48, bias=False), nn.Linear(48, 32, bias=False), \\
            nn.Linear(32, 48, bias=False)

    def _forward_silu_gating(self, x1, x3):
        return x1 * x3

ff = FeedForward()
layers = {f"ff.{k}": Int8Linear.from_linear(getattr(ff, k), backend="fused_triton") for k in ("w1", "w2", "w3")}
print(json.dumps({
    "values": {n: config.get(n) for n in config.SWITCHES},
    "backend": backends.env_override(),
    "fused": sorted(adapters.object_patches(nn.ModuleDict({"ff": ff}), layers, LUMINA)),
    "attn_int8_auto": attention.int8_auto_allowed(),
    "fast_launch": kernel.launch._USE_FAST,
    "interpret": kernel.checks.INTERPRET_AT_IMPORT,
    "cache_dir": str(autotune.cache_dir()),
}))
"""


def _probe(env: dict) -> tuple[dict, str]:
    base = {k: v for k, v in os.environ.items() if k not in config.SWITCHES}
    r = subprocess.run([sys.executable, "-c", PROBE, str(ROOT)], env={**base, **env}, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_defaults_and_every_switch_from_the_environment():
    got, _ = _probe({})
    assert got["values"] == {n: s.default for n, s in config.SWITCHES.items()}
    assert got["backend"] is None and got["fused"] == ["ff"] and got["attn_int8_auto"] is False
    assert got["fast_launch"] is True and got["interpret"] is False
    assert got["cache_dir"] == str(Path.home() / ".cache" / "comfyui-int8-fused")

    got, _ = _probe({"INT8_FUSED_BACKEND": "torch_int_mm", "INT8_FUSED_FUSION": "0", "INT8_FUSED_ATTN_INT8_AUTO": "1",
                     "INT8_FUSED_CACHE_DIR": "/tmp/int8-cache", "TRITON_INTERPRET": "1",
                     "INT8_FUSED_PAD_ELISION": "0", "INT8_FUSED_S8_WGMMA": "0", "INT8_FUSED_DISPATCH": "float"})
    assert got["backend"] == "torch_int_mm"
    assert got["fused"] == ["ff.w1", "ff.w2", "ff.w3"]  # fusion off: the plain per-linear patches
    assert got["attn_int8_auto"] is True and got["fast_launch"] is False and got["interpret"] is True
    assert got["cache_dir"] == "/tmp/int8-cache" and got["values"]["INT8_FUSED_PAD_ELISION"] == "0"
    assert got["values"]["INT8_FUSED_S8_WGMMA"] is False and got["values"]["INT8_FUSED_DISPATCH"] == "float"


def test_a_value_that_is_no_boolean_warns_and_keeps_the_default():
    got, err = _probe({"INT8_FUSED_FUSION": "maybe", "INT8_FUSED_ATTN_INT8_AUTO": " ON "})
    assert got["values"]["INT8_FUSED_FUSION"] is True and got["fused"] == ["ff"]
    assert "INT8_FUSED_FUSION='maybe'" in err
    assert got["values"]["INT8_FUSED_ATTN_INT8_AUTO"] is True and got["attn_int8_auto"] is True


def test_read_once_override_and_reload(monkeypatch):
    assert backends.config is config and qf.config is config  # quant reads the same module as kernel
    before = config.get("INT8_FUSED_BACKEND")
    monkeypatch.setenv("INT8_FUSED_BACKEND", "dequant_bf16")
    assert config.get("INT8_FUSED_BACKEND") == before  # read once: a later environment changes nothing
    with config.override(INT8_FUSED_BACKEND="torch_int_mm"):
        assert backends.env_override() == "torch_int_mm"
        with config.override(INT8_FUSED_BACKEND=None):  # None: the default
            assert backends.env_override() is None
        assert backends.env_override() == "torch_int_mm"
    assert backends.env_override() == before
    config.reload()
    try:
        assert config.get("INT8_FUSED_BACKEND") == "dequant_bf16"
    finally:
        monkeypatch.delenv("INT8_FUSED_BACKEND")
        config.reload()
    assert config.get("INT8_FUSED_BACKEND") is None
    with pytest.raises(KeyError, match="INT8_FUSED_FUSION"):
        config.get("INT8_FUSED_FUSON")
    with pytest.raises(TypeError, match="bool"):
        with config.override(INT8_FUSED_FUSION="0"):
            pass


def test_override_changes_what_each_switch_read_at_use_says(tmp_path):
    layers = {"x": Int8Linear.from_linear(nn.Linear(32, 32))}
    with config.override(INT8_FUSED_FUSION=False):
        assert adapters.object_patches(None, layers) == layers  # never looks at the model
    with config.override(INT8_FUSED_CACHE_DIR=str(tmp_path)):
        assert autotune.cache_file("GPU", "3.6.0").parent == tmp_path
    with config.override(TRITON_INTERPRET=False):
        ok, why = kernel.triton_status(torch.device("cpu"))
        assert not ok
    with config.override(TRITON_INTERPRET=True):
        ok, why = kernel.triton_status(torch.device("cpu"))
        assert ok or "pip install triton" in why


def test_markdown_table_lists_every_switch():
    table = config.markdown_table().splitlines()
    assert table[0] == "| switch | default | what it does |" and len(table) == 2 + len(config.SWITCHES)
    for name, row in zip(config.SWITCHES, table[2:]):
        assert row.startswith(f"| `{name}` |") and "\n" not in row
    # the README's table between its markers is this table, word for word (a new, changed or removed switch shows
    # up as a failure here)
    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- switches -->\n", "\n<!-- /switches -->"
    assert readme.count(start) == 1 and readme.count(end) == 1
    assert readme[readme.index(start) + len(start):readme.index(end)] == config.markdown_table()


def test_generation_moves_with_every_change_and_gemm_switches_follow(monkeypatch):
    """config.generation() moves on entering and leaving an override and on reload; kernel.gemm_switches (cached per
    generation, read on every INT8 call) always says what config.get says."""
    import kernel
    g0 = config.generation()
    base = kernel.gemm_switches()
    assert base[:2] == (config.get("INT8_FUSED_S8_WGMMA"), None)
    with config.override(INT8_FUSED_S8_WGMMA=not base[0]):
        g1 = config.generation()
        assert g1 != g0
        assert kernel.gemm_switches() == (not base[0], None, base[2])
        with config.override(INT8_FUSED_S8_WGMMA=base[0]):
            assert kernel.gemm_switches() == base
        assert kernel.gemm_switches() == (not base[0], None, base[2])
    assert config.generation() not in (g0, g1) and kernel.gemm_switches() == base
    monkeypatch.setenv("INT8_FUSED_S8_WGMMA", "0" if base[0] else "1")
    g2 = config.generation()
    config.reload()
    try:
        assert config.generation() != g2 and kernel.gemm_switches()[0] is (not base[0])
    finally:
        monkeypatch.undo()
        config.reload()
    assert kernel.gemm_switches() == base
    config.retune()   # background timing changed a config: the switches' key moves, so prepared calls re-plan
    after = kernel.gemm_switches()
    assert after[:2] == base[:2] and after[2] == base[2] + 1
