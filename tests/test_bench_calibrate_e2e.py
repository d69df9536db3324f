"""bench/calibrate_e2e.py (issue 35 item 2: INT8 Calibrate on full-size Ideogram 4 and Flux.1 on the H200) in its CPU
smoke mode, with the real ComfyUI 0.33.0 (COMFYUI_CURRENT): every stage the H200 run has apart from the CUDA set-up
(1-layer Ideogram 4 at full width on torch_int_mm with DualModelGuider and two Calibrate nodes, a shrunken Flux.1 on
fused_triton in the Triton interpreter). The JSON is checked against what the test derives itself:

* the errors against bf16 of the pack without / with the calibration and of core INT8, recomputed in float64 from
  the final latents the run saved; the calibrated and uncalibrated latents differ (Apply used the calibration);
* each calibration file, read with safetensors directly: the layers of the blocks preset (hand-listed), the tokens
  each layer saw (hand-counted from the latent, text and cfg: the unconditional Ideogram 4 backbone saw image tokens
  only), SwiGLU's w1 and w3 with one smoothing vector (so fused_triton can still fuse them), the widgets given;
* the parameters of the 1-layer Ideogram 4 (hand-counted from its widths), the weight size ComfyUI reports for them,
  wall times and memory fields consistent with each other, the recalibration after the calibrated pack ran equal to
  the first, the random-weights note, provenance.

Run: bash scripts/test.sh tests/test_bench_calibrate_e2e.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS, CAL_STEPS, ROWS = 1, 2, 16
GIB = 2 ** 30
IDEO = [f"layers.0.{n}" for n in ("attention.qkv", "attention.o", "feed_forward.w1", "feed_forward.w2",
                                  "feed_forward.w3")]
FLUX = [f"double_blocks.0.{s}_{n}" for s in ("img", "txt") for n in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")] + \
    ["single_blocks.0.linear1", "single_blocks.0.linear2"]


@pytest.fixture(scope="module")
def smoke(comfy_current, tmp_path_factory):
    out = tmp_path_factory.mktemp("calibrate_e2e")
    py = os.environ.get("COMFYUI_CURRENT_PYTHON") or sys.executable
    cmd = [py, str(ROOT / "bench" / "calibrate_e2e.py"), "--comfy", str(comfy_current), "--device", "cpu", "--tiny",
           "--steps", str(STEPS), "--calib-set", f"steps={CAL_STEPS}", "--calib-set", f"rows_per_layer={ROWS}",
           "--save", str(out), "--out", str(out / "result.json")]
    env = dict(os.environ, TRITON_INTERPRET="1", INT8_FUSED_CACHE_DIR=str(out / "cache"))
    cp = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    assert cp.returncode == 0, f"exit {cp.returncode}\n{cp.stdout[-4000:]}\n{cp.stderr[-6000:]}"
    return json.loads((out / "result.json").read_text()), out


def rows(doc, model):
    return {r["stage"]: r for r in doc["rows"] if r.get("model") == model and "stage" in r}


def calibration_file(path):
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        md = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return json.loads(md["meta"]), json.loads(md["layers"]), tensors


def test_runs_every_stage_with_provenance_and_note(smoke):
    doc, _ = smoke
    assert doc["gpu"] == "cpu (smoke run)" and doc["comfyui"] == "0.33.0" and doc["dynamic_vram"] is False
    assert doc["torch"] and doc["commit"] and "calibrate_e2e.py" in doc["command"] and "--tiny" in doc["command"]
    assert "random weights" in doc["note"] and "outlier" in doc["note"]
    assert not [r for r in doc["rows"] if "error" in r], [r for r in doc["rows"] if "error" in r]
    for model in ("ideogram4", "flux"):
        assert set(rows(doc, model)) == {"calibrate", "bf16", "pack", "pack+cal", "recheck", "core_int8"}
        assert doc["summary"][model]["errors"] == {}
        assert doc["summary"][model]["calibrate_widgets"] == {"steps": CAL_STEPS, "rows_per_layer": ROWS}
    checks = {(c["model"], c["check"]): c["pass"] for c in doc["checks"]}
    assert len(checks) == 8 and all(checks.values()), doc["checks"]
    assert [doc["summary"][m]["backend"] for m in ("ideogram4", "flux")] == ["torch_int_mm", "fused_triton"]


@pytest.mark.parametrize("model", ["ideogram4", "flux"])
def test_errors_against_bf16_recomputed_from_the_latents(smoke, model):
    from safetensors.torch import load_file
    doc, out = smoke
    lat = {k: v.double() for k, v in load_file(str(out / f"{model}-latents.safetensors")).items()}
    assert set(lat) == {"bf16", "pack", "pack_cal", "core_int8"}
    ref = lat["bf16"]
    want = {k: float((lat[k.replace("+", "_")] - ref).norm() / ref.norm()) for k in ("pack", "pack+cal", "core_int8")}
    got = doc["summary"][model]["rel_l2_vs_bf16"]
    r = rows(doc, model)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=0) == r[k]["rel_l2_vs_bf16"]
        assert 1e-4 < v < 0.05, (k, v)  # W8A8 of a random model: small but not zero
    assert not torch.equal(lat["pack"], lat["pack_cal"])  # Apply used the calibration
    assert r["pack"]["smoothed"] == [0] * len(r["pack"]["smoothed"])
    names, backbones = (IDEO, 2) if model == "ideogram4" else (FLUX, 1)
    assert r["pack+cal"]["smoothed"] == [len(names)] * backbones
    assert r["pack"]["modules"] == r["pack+cal"]["modules"]
    if model == "flux":  # fused_triton in the interpreter: the fused blocks stay with the calibration
        assert r["pack+cal"]["modules"] == {"FusedFluxDoubleBlock": 1, "FusedFluxSingleBlock": 1}


def test_calibration_files(smoke):
    _, out = smoke
    cond, uncond, flux = (calibration_file(out / f"{n}.safetensors") for n in ("ideogram4-cond", "ideogram4-uncond",
                                                                                "flux-cond"))
    img, text = 4 * 4, 8  # Ideogram 4's tiny latent [1, 128, 4, 4] (one token a latent pixel), 8 text tokens
    for (meta, layers, t), only_image in ((cond, False), (uncond, True)):
        assert list(layers) == IDEO and meta["steps"] == CAL_STEPS and meta["row_cap"] == ROWS
        assert meta["image_tokens_only"] is only_image and meta["cfg"] == (1.0 if only_image else 4.0)
        # cond: [text, image] for the positive and the zeroed negative (cfg 4, batched) each step; uncond: image only
        want = CAL_STEPS * img if only_image else CAL_STEPS * 2 * (img + text)
        assert {n: meta["tokens"][n]["tokens"] for n in IDEO} == {n: want for n in IDEO}
        w1, w3 = t["layers.0.feed_forward.w1.smooth"], t["layers.0.feed_forward.w3.smooth"]
        assert torch.equal(w1, w3) and not torch.equal(w1, t["layers.0.attention.qkv.smooth"])
        assert meta["shared_smoothing"] == [["layers.0.feed_forward.w1", "layers.0.feed_forward.w3"]]
        assert all(bool(torch.isfinite(v).all() and (v > 0).all()) for v in t.values()) and len(t) == len(IDEO)
        assert meta["seconds"]["sampling"] > 0 and meta["seconds"]["layers"] > 0
    assert not torch.equal(cond[2]["layers.0.attention.qkv.smooth"], uncond[2]["layers.0.attention.qkv.smooth"])
    meta, layers, _ = flux
    assert list(layers) == FLUX and meta["shared_smoothing"] == []  # Flux.1 has no two linears on one input
    img, text = (8 // 2) * (8 // 2), 16  # latent [1, 16, 8, 8] in 2x2 patches, 16 text tokens; cfg 4 batched
    want = {n: CAL_STEPS * 2 * (img + text if n.startswith("single") else img) for n in FLUX}
    assert {n: meta["tokens"][n]["tokens"] for n in FLUX} == want


def test_sizes_times_and_memory_fields(smoke):
    doc, _ = smoke
    H, T, A, C, F = 4608, 53248, 512, 128, 12288
    top = (C * H + H) + T + (T * H + H) + 2 * (H * H + H) + (H * A + A) + 2 * H + (H * C + C) + (A * H + H)
    layer = 3 * H * H + H * H + 2 * 256 + 3 * H * F + 4 * H + (A * 4 * H + 4 * H)
    s = doc["summary"]
    assert s["ideogram4"]["params_per_backbone"] == top + layer
    for model, n in (("ideogram4", 2), ("flux", 1)):
        sm, r = s[model], rows(doc, model)
        assert sm["dtype"] == "float32" and sm["patcher"] == "ModelPatcher"  # ComfyUI's CPU choices
        assert sm["weights_gib"] == pytest.approx(n * sm["params_per_backbone"] * 4 / GIB, rel=0.01)
        assert r["calibrate"]["weights_gib"] == pytest.approx(sm["weights_gib"])
        per = sm["calibration_s_per_backbone"]
        assert len(per) == n and all(p > 0 for p in per) and sm["calibration_s"] == pytest.approx(sum(per))
        for p, node in zip(per, sm["calibration_node_seconds"]):
            assert 0 < node["sampling"] + node["layers"] <= p + 0.002  # the node's own split, rounded to ms
        assert [b["image_tokens_only"] for b in r["calibrate"]["backbones"]] == [False, True][:n]
        assert sm["vram_used_peak_gib"] is None and sm["fits_24gib"] is None  # no CUDA: no VRAM claims
        assert 0 < sm["host_rss_before_gib"] <= sm["host_rss_peak_gib"] <= sm["host_vmhwm_process_gib"] + 1e-6
        for k in ("pack", "pack+cal"):
            assert r[k]["s_per_step_wall"] > 0 and sm["s_per_step_wall"][k] == r[k]["s_per_step_wall"]
        assert sm["cal_step_ratio"] == pytest.approx(r["pack+cal"]["s_per_step_wall"] / r["pack"]["s_per_step_wall"])
        rc = r["recheck"]
        assert rc["same_layers"] and rc["max_err_diff"] == 0.0 and rc["max_smooth_rel_diff"] == 0.0
        assert r["core_int8"]["layers_int8"] == len(IDEO if model == "ideogram4" else FLUX)
