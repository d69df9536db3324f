"""bench/lora.py's CPU smoke path under the real ComfyUI 0.33.0 (COMFYUI_CURRENT): LoRA counts 0 / 1 / 3 through the
sampler on the tiny Flux and Wan 2.1, a strength change without re-quantization, the base model unchanged. No timing
assertions."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_lora_bench_smoke(comfy_current, tmp_path):
    out = tmp_path / "lora.json"
    py = os.environ.get("COMFYUI_CURRENT_PYTHON") or sys.executable
    env = dict(os.environ, TRITON_INTERPRET="1", COMFYUI_CURRENT=str(comfy_current))
    cp = subprocess.run([py, str(ROOT / "bench" / "lora.py"), "--device", "cpu", "--tiny", "--backend", "torch_int_mm",
                         "--models", "flux,wan13", "--steps", "1", "--rank", "4", "--out", str(out)], env=env,
                        capture_output=True, text=True, timeout=900)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [m["model"] for m in doc["models"]] == ["flux", "wan13"]
    for m in doc["models"]:
        assert [r["loras"] for r in m["rows"]] == [0, 1, 3] and all(len(r["samples_s"]) == 2 for r in m["rows"])
        assert m["rows"][1]["layers"] > 0 and "x_no_lora" in m["rows"][1]
        assert m["strength_change"]["quantizations"] == 0
        assert m["checks"] == {"lora_changes_output": True, "base_after_lora_same": True, "no_requantization": True}
    assert doc["commit"] and doc["command"]
