"""bench/checks/save_roundtrip.py's CPU smoke path (issue 35, item 1) through the real ComfyUI 0.33.0 (COMFYUI_CURRENT):
a 1-layer Ideogram 4 at narrow widths (``--narrow``: ComfyUI's Ideogram 4 config narrowed with it), Apply (torch_int_mm: fused_triton's kernels would run in the Triton
interpreter) -> Save (both formats) -> the pack file through Load Ideogram 4.0 INT8 and the core file through plain
ComfyUI, sampled. The fused_triton wrapping itself is checked on the CPU by tests/test_save_fused_current.py; the
H200 run of this bench checks it on full-size Ideogram 4."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def safetensors_keys(path) -> set[str]:
    with open(path, "rb") as f:
        return set(json.loads(f.read(int.from_bytes(f.read(8), "little")))) - {"__metadata__"}


def test_save_roundtrip_smoke(comfy_current, tmp_path):
    out = tmp_path / "roundtrip.json"
    py = os.environ.get("COMFYUI_CURRENT_PYTHON") or sys.executable
    env = dict(os.environ, TRITON_INTERPRET="1")
    cp = subprocess.run([py, str(ROOT / "bench" / "checks" / "save_roundtrip.py"), "--comfy", str(comfy_current),
                         "--device", "cpu", "--layers", "1", "--res", "small", "--steps", "1", "--text-tokens", "8", "--narrow",
                         "--workdir", str(tmp_path / "models"), "--out", str(out)],
                        env=env, capture_output=True, text=True, timeout=1500)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["pass"] is True and all(doc["checks"].values()), doc["checks"]
    assert doc["gpu"] == "cpu (smoke run)" and doc["commit"] and doc["comfyui"] == "0.33.0"
    assert "save_roundtrip.py" in doc["command"] and doc["backend"] == "torch_int_mm"
    assert doc["missing"] == {"int8_fused": [], "comfy_int8_tensorwise": []}
    st = doc["stages"]
    assert [k for k in st] == ["bf16", "apply", "apply_sample", "save_int8_fused", "save_comfy_int8_tensorwise",
                               "pack_file", "core_file"]
    assert all(s["status"] == "ok" for s in st.values())
    w = doc["narrow_widths"]
    assert w["hidden"] == 512 and w["text"] == 256, w  # bench/lib/e2e.py NARROW: 2 heads of 256, text 256
    assert st["core_file"]["llm_cond_proj_weight"] == [w["hidden"], w["text"]]
    for fmt in ("int8_fused", "comfy_int8_tensorwise"):
        assert Path(st[f"save_{fmt}"]["path"]).stat().st_size == st[f"save_{fmt}"]["bytes"] > 0
    # every key of the float model, read here from the files' safetensors headers (a pack int8 layer by its qweight)
    from bench.lib.e2e import ideogram4_shapes
    expected = set(ideogram4_shapes(1))  # the keys (the widths do not change them)
    keys = {fmt: safetensors_keys(st[f"save_{fmt}"]["path"]) for fmt in ("int8_fused", "comfy_int8_tensorwise")}
    assert expected <= keys["comfy_int8_tensorwise"]
    assert all(k in keys["int8_fused"] or f"{k.rpartition('.')[0]}.qweight" in keys["int8_fused"] for k in expected)
    r = doc["rel_l2"]
    assert r["pack_file_vs_apply"] == 0.0  # the same int8 weights on the same backend: the same bits
    assert r["core_file_vs_apply"] <= 1e-3  # core's INT8 on the same weights
    assert 0 < r["apply_vs_bf16"] < 0.05  # INT8, near bf16 (the W8A8 bound of test_ideogram4_current.py)
