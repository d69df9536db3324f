"""The demo's full-size mode (scripts/full_size.py, ``bash scripts/demo.sh --full-size``) on a machine without a GPU:
the refusal (exact message, exit code 3) before any model is built, from the clone, from ComfyUI/custom_nodes and
through scripts/demo.py; the requirements against numbers derived by hand from Flux.1's architecture; the
shortfall lines; the arguments; the report's ratios. The measuring itself is bench/e2e_models.py's (its CPU smoke
runs are in tests/test_bench_e2e.py); on a GPU the lead runs the mode."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import full_size as F  # noqa: E402

P_FLUX = 11_901_408_320
NO_GPU = ("[full-size] refused: the full-size mode needs an NVIDIA GPU (CUDA, compute capability 8.0 or newer), "
          "and torch finds none on this machine.\n"
          "[full-size] To see the pack run here, use the miniature demo: bash scripts/demo.sh")


def _flux_params_by_hand() -> int:
    """Flux.1-dev's parameters from its architecture: hidden 3072, MLP 12288, 19 double + 38 single blocks."""
    lin = lambda i, o: i * o + o  # noqa: E731  (weight + bias)
    h, mlp = 3072, 12288
    embed = lin(64, h) + 2 * (lin(256, h) + lin(h, h)) + lin(768, h) + lin(h, h) + lin(4096, h)  # img, time,
    # guidance, vector, txt
    # one side of a double block: modulation, qkv, QK norm scales, proj, MLP
    side = lin(h, 6 * h) + lin(h, 3 * h) + 2 * 128 + lin(h, h) + lin(h, mlp) + lin(mlp, h)
    single = lin(h, 3 * h + mlp) + lin(h + mlp, h) + 2 * 128 + lin(h, 3 * h)
    final = lin(h, 2 * 2 * 16) + lin(h, 2 * h)
    return embed + 19 * 2 * side + 38 * single + final


def test_parameter_counts():
    assert _flux_params_by_hand() == P_FLUX == F.ARCHS["flux"][2]
    from bench.lib import e2e  # Ideogram 4's layout (bench/lib/e2e.py), 34 layers
    assert sum(math.prod(s) for s, _ in e2e.ideogram4_shapes(34).values()) == F.ARCHS["ideogram4"][2]
    # the counts ComfyUI's layout gave on the H200 (bench/e2e_models.py records them)
    doc = json.loads((ROOT / "bench" / "results" / "models-runs" / "h200-e2e-models-822c06c.json").read_text())
    for arch in ("flux", "zimage", "wan"):
        assert doc["models"][F.ARCHS[arch][0]]["params"] == F.ARCHS[arch][2]


def test_requirements_flux_by_hand():
    assert F.tokens("flux") == 128 * 128 // 4 + 512 == 4608  # 1024x1024: 2x2 patches of a 128x128 latent + T5
    assert F.tokens("zimage") == 4096 + 256
    assert F.tokens("wan") == 9 * 30 * 52  # 33 frames at 480x832: 9 x 60 x 104 latent, 1x2x2 patches
    assert F.tokens("ideogram4") == 64 * 64 + 512
    r = F.requirements("flux", 6)
    assert r["params"] == P_FLUX
    assert r["bf16_gib"] == pytest.approx(22.1681, abs=1e-4)  # 2 bytes x 11.90 B / 2^30
    assert r["int8_gib"] == pytest.approx(11.0841, abs=1e-4)  # 1 byte a parameter
    assert r["vram_gib"] == pytest.approx(14.0841, abs=1e-4)  # int8 weights + 3 GiB working set
    assert r["vram_resident_gib"] == pytest.approx(25.1681, abs=1e-4)  # bf16 weights + 3 GiB
    assert r["ram_gib"] == pytest.approx(25.1681, abs=1e-4)  # at most ComfyUI's bf16 model (2 bytes) + 3 GiB
    assert r["files_gib"] == pytest.approx(33.2522, abs=1e-4)  # bf16 file (2 bytes) + core INT8 file (1 byte)
    assert r["disk_gib"] == pytest.approx(34.2522, abs=1e-4)  # the files + 1 GiB of kernel caches
    # per path 0.5 min + 23.8 GB read at 1 GB/s; 1 min tuning; 4 paths x 4 samples x 6 steps of
    # (2 x 11.90e9 x 4608 + 4 x 4608^2 x 3072 x 57) = 1.2456e14 FLOP at 30 TFLOPS = 4.152 s; 35.7 GB written once
    assert r["minutes"] == pytest.approx(4 * (0.5 + 23.8028 / 60) + 1 + 96 * 4.15186 / 60 + 35.7042 / 60, abs=1e-3)
    assert r["minutes"] == pytest.approx(11.83, abs=0.01)
    text = F.needs_text("flux", r)
    for part in ("VRAM   14.1 GiB free", "bf16 is resident from 25.2 GiB", "RAM    25.2 GiB available",
                 "disk   34.3 GiB free (the model files, 33.3 GiB", "about 12 min at most"):
        assert part in text


def test_shortfalls_say_what_and_how_much():
    r = F.requirements("flux", 6)
    have = {"gpu": "NVIDIA GeForce RTX 3060", "vram_gib": 11.5, "ram_gib": 32.0, "disk_gib": 100.0,
            "disk_path": "/home/u"}
    assert F.shortfalls(r, dict(have, ram_gib=16.0)) == [
        "VRAM: needs 14.1 GiB free, NVIDIA GeForce RTX 3060 has 11.5 GiB free: 2.6 GiB short",
        "host RAM: needs 25.2 GiB free, this machine has 16.0 GiB free: 9.2 GiB short"]
    assert F.shortfalls(r, dict(have, disk_gib=30.25, vram_gib=22.5)) == [
        "disk: needs 34.3 GiB free, /home/u has 30.2 GiB free: 4.0 GiB short"]
    assert F.shortfalls(r, dict(have, vram_gib=22.5)) == []  # a 4090 in a 32 GB desktop: bf16 streams


def test_arguments(capsys):
    a = F.parse_args(["--full-size", "--arch", "wan"])
    assert (a.arch, a.steps, a.comfy, a.out, a.full_size) == ("wan", 6, None, None, True)
    assert F.ARCHS[a.arch][0] == "wan13"  # Wan 2.1 T2V 1.3B in the bench
    a = F.parse_args(["--arch", "ideogram4", "--steps", "4", "--comfy", "/opt/ComfyUI", "--out", "x.json"])
    assert (a.arch, a.steps, a.comfy, a.out) == ("ideogram4", 4, "/opt/ComfyUI", "x.json")
    for bad, says in ((["--arch", "sd15"], "invalid choice: 'sd15'"), (["--steps", "4"], "--arch"),
                      (["--arch", "flux", "--steps", "1"], "--steps must be at least 2")):
        with pytest.raises(SystemExit) as e:
            F.parse_args(bad)
        assert e.value.code == 2
        assert says in capsys.readouterr().err


def _no_gpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the refusal is for machines without one")


@pytest.mark.parametrize("how", ["demo.sh", "runtime", "custom_nodes", "demo.py"])
def test_no_gpu_refusal_builds_nothing(comfy_current, tmp_path, how):
    _no_gpu()
    py = os.environ.get("COMFYUI_CURRENT_PYTHON") or sys.executable
    env = {k: v for k, v in os.environ.items()
           if k not in ("COMFYUI_CURRENT", "COMFYUI_CURRENT_PYTHON", "COMFYUI_PYTHON")}
    out = tmp_path / "run" / "flux.json"
    args = ["--full-size", "--arch", "flux", "--out", str(out)]
    if how == "demo.sh":  # the demo's runtime: COMFYUI_CURRENT as scripts/demo.sh sets it
        env.update(COMFYUI_CURRENT=str(comfy_current), COMFYUI_CURRENT_PYTHON=py)
        cmd, want = ["bash", str(ROOT / "scripts" / "demo.sh"), *args], comfy_current
    elif how == "runtime":  # no ComfyUI named: demo.sh builds (here: reuses) the runtime and takes its 0.33.0
        rt = Path(os.environ.get("INT8_RUNTIME_DIR") or ROOT / ".runtime")
        recipe = re.search(r"^RECIPE=(\d+)$", (ROOT / "scripts" / "setup_runtime.sh").read_text(), re.M).group(1)
        if not (rt / f".current-ready-v{recipe}").exists() or rt / "ComfyUI-current" != comfy_current:
            pytest.skip("the demo's runtime with ComfyUI 0.33.0 is not built here")
        cmd, want = ["bash", str(ROOT / "scripts" / "demo.sh"), *args], rt / "ComfyUI-current"
    elif how == "custom_nodes":  # a clone in ComfyUI/custom_nodes, called from there, no COMFYUI_CURRENT
        clone = comfy_current / "custom_nodes" / "comfyui-int8-fused"
        if not (clone / "scripts" / "full_size.py").exists():
            pytest.skip(f"{clone} is not this pack")
        env["COMFYUI_PYTHON"] = py
        cmd, want = ["bash", "custom_nodes/comfyui-int8-fused/scripts/demo.sh", *args], comfy_current
    else:
        cmd, want = [py, str(ROOT / "scripts" / "demo.py"), *args, "--comfy", str(comfy_current)], comfy_current
    cp = subprocess.run(cmd, env=env, cwd=comfy_current if how == "custom_nodes" else tmp_path,
                        capture_output=True, text=True, timeout=300)
    assert cp.returncode == 3, cp.stdout + cp.stderr
    assert cp.stdout.endswith(NO_GPU + " --arch flux\n"), cp.stdout
    assert "VRAM   14.1 GiB free" in cp.stdout and "RAM    25.2 GiB available" in cp.stdout  # stated first
    assert f"[full-size] ComfyUI: {want} (0.33.0); Python {py}" in cp.stdout
    # a named ComfyUI runs with its Python and builds no runtime; without one the demo's runtime is set up (reused)
    assert ("[setup]" in cp.stdout) == (how == "runtime")
    # nothing was built: the bench never started (no log line of it, no JSON, no output folder)
    assert "[models" not in cp.stdout + cp.stderr and "[isolated" not in cp.stdout + cp.stderr
    assert not out.parent.exists()


def test_report_ratios_and_paste_block():
    rows = [{"model": "flux", "path": "bf16", "status": "ok", "s_per_step_whole": 0.2, "peak_gib": 23.7,
             "host_rss_peak_row_gib": 46.0, "compute_dtype": "bfloat16"},
            {"model": "flux", "path": "fp8_fast", "status": "ok", "s_per_step_whole": 0.26, "peak_gib": 12.9,
             "compute_dtype": "bfloat16"},
            {"model": "flux", "path": "core_int8", "status": "oom", "error": "CUDA out of memory"},
            {"model": "flux", "path": "pack:fused_triton", "status": "ok", "s_per_step_whole": 0.08,
             "s_per_step": 0.07, "peak_gib": 16.2, "compute_dtype": "bfloat16"},
            {"check": "issue13", "model": "flux", "path": "pack:fused_triton"}]
    doc = {"gpu": "NVIDIA H200", "driver": "580.159.04", "torch": "2.11.0+cu130", "triton": "3.6.0",
           "comfyui": "0.33.0", "commit": "abc1234", "rows": rows,
           "models": {"flux": {"inputs": "1024x1024, T5 512 tokens + pooled 768, guidance 3.5"}}}
    table, block = F.report(doc, "flux", 6, 252.0, {"vram_total_gib": 139.8})
    lines = table.splitlines()
    assert lines[2].split()[:3] == ["bf16", "0.2000", "2.50x"]  # 0.2 / 0.08
    assert lines[3].split()[:3] == ["fp8_e4m3fn_fast", "0.2600", "3.25x"]
    assert lines[4].split()[:4] == ["core", "INT8", "-", "-"] and "oom: CUDA out of memory" in lines[4]
    assert lines[5].split()[:3] == ["pack", "0.0800", "16.2"]  # the whole sample's figure, not the median step's
    assert "compute dtype bfloat16" in lines[0]
    assert block.splitlines()[1:] == [
        "comfyui-int8-fused full-size demo: --arch flux (Flux.1-dev, 11.90 B params, random weights), 6 steps",
        "GPU: NVIDIA H200 (139.8 GiB), driver 580.159.04, torch 2.11.0+cu130, Triton 3.6.0, ComfyUI 0.33.0, "
        "pack abc1234",
        "s/step (whole sample): bf16 0.2000 | fp8_e4m3fn_fast 0.2600 | core INT8 - | pack 0.0800",
        "pack speed-up: 2.50x bf16 | 3.25x fp8_e4m3fn_fast",
        "peak VRAM GiB: bf16 23.7 | fp8_e4m3fn_fast 12.9 | core INT8 - | pack 16.2",
        "whole run: 4.2 min",
        "```"]
