"""The sampler benches' CPU smoke paths (bench/e2e_models.py, bench/e2e_sampler.py, bench/lib/e2e_runs.py) through the
real ComfyUI 0.33.0 (COMFYUI_CURRENT): whole-sample figures and the per-sample tax, ``--cold`` (issue 48's cold suite:
fresh caches per path, a second resolution, a second process on the first's caches) and ``--vram-gib`` (one process
per path), core INT8 and the Wan 2.1 14B / Wan 2.2 5B / Qwen-Image layouts; OOM and dead children as row
statuses. No timing assertions: the figures are checked against how they are defined (a whole sample is its model
calls plus the rest; one model call a step at cfg 1.0, two with DualModelGuider's two backbones)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from bench.lib import e2e_runs  # noqa: E402  (no torch / ComfyUI at import)


def _bench(comfy_current, script: str, args: list[str], out: Path, timeout: float = 1500) -> tuple[dict, str]:
    """Runs ``bench/<script>`` on the CPU under the current ComfyUI; (its JSON document, its output)."""
    py = os.environ.get("COMFYUI_CURRENT_PYTHON") or sys.executable
    env = dict(os.environ, TRITON_INTERPRET="1", COMFYUI_CURRENT=str(comfy_current))
    cp = subprocess.run([py, str(ROOT / "bench" / script), "--device", "cpu", *args, "--out", str(out)], env=env,
                        capture_output=True, text=True, timeout=timeout)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    return json.loads(out.read_text()), cp.stdout


def _measured(doc: dict) -> list[dict]:
    return [r for r in doc["rows"] if "path" in r and "check" not in r]


def _whole_is_calls_plus_tax(r: dict, steps: int, calls_per_step: int) -> None:
    best = min(r["whole_sample_s"])
    assert len(r["whole_sample_s"]) == 2
    assert r["s_per_step_whole"] * steps == pytest.approx(best, abs=1e-4)  # the best whole sample / steps
    assert r["model_calls_per_sample"] == steps * calls_per_step
    assert 0 < r["model_calls_s"] <= best + 1e-4
    assert r["per_sample_tax_s"] == pytest.approx(best - r["model_calls_s"], abs=1e-4)
    assert r["first_sample_s"] > 0 and r["first_of_path"] is True


def test_models_cold_suite_one_process_each(comfy_current, tmp_path):
    """The cold suite (issue 48) on the CPU: per path a fresh process on new, empty cache folders (first sample,
    the second resolution's first and warm samples), then a second fresh process given those folders (its first
    sample). The pack runs as pack:torch_int_mm: under the Triton interpreter fused_triton writes no cache file
    either, and costs ~10x the time; the cache folders' hand-over is seen through the marker the first process
    leaves. With --vram-gib (not applicable on the CPU, but the rows are tagged)."""
    doc, out = _bench(comfy_current, "e2e_models.py", ["--tiny", "--models", "flux", "--paths",
                                                       "bf16,pack:torch_int_mm", "--steps", "2", "--cold",
                                                       "--vram-gib", "8"], tmp_path / "cold.json")
    assert doc["isolated"] and doc["cold"] and doc["second_process"] and doc["parent_imported_torch"] is False
    assert doc["gpu"] == "cpu (smoke run)" and doc["commit"] and "--cold" in doc["command"]  # provenance
    rows = _measured(doc)
    assert [r["path"] for r in rows] == ["bf16", "pack:torch_int_mm"]
    dirs, pids = set(), set()
    for r in rows:
        assert r["status"] == "ok" and r["isolated"] and r["cold"] and r["vram_gib"] == 8.0
        assert "not applicable" in r["vram_gib_note"] and r["held_gib"] is None
        _whole_is_calls_plus_tax(r, steps=2, calls_per_step=1)  # cfg 1.0: one forward a step
        # the child's pack and Triton read the fresh folders the parent made for it; removed afterwards
        caches = {"int8_fused": r["int8_fused_cache_dir"], "triton": r["triton_cache_dir"]}
        assert r["child_caches"] == caches
        assert not Path(r["int8_fused_cache_dir"]).parent.exists()
        dirs.add(r["int8_fused_cache_dir"])
        assert 0 < r["host_rss_peak_row_gib"] <= r["host_rss_peak_gib"]
        assert r["host_rss_before_load_gib"] <= r["host_rss_peak_row_gib"]
        assert r["s_per_step_whole"] > 0 and r["peak_gib"] >= 0  # the warm columns, as before
        # what attention ran: the pack's Router counts its calls (on the CPU, auto hands each to ComfyUI's own
        # function); bf16 has no Router
        if r["path"] == "bf16":
            assert "attention_calls" not in r
        else:
            assert set(r["attention_calls"]) == {"comfy_default"} and r["attention_calls"]["comfy_default"] > 0
        # the first process started on empty folders
        assert all(r["caches_at_start"][k] == {"dir": d, "files": 0, "bytes": 0, "left_by_pid": None}
                   for k, d in caches.items())
        # the second resolution (tiny: the latent's sides x 768 / 1024, rounded to even), the process warm
        assert r["second_res"] == "tiny" and r["second_res_latent"] == [1, 16, 6, 6]
        assert r["second_res_first_s"] > 0 and r["second_res_warm_s"] > 0
        assert r["second_res_warm_s"] == pytest.approx(min(r["second_res_whole_sample_s"]), abs=1e-4)
        assert r["second_res_warm_s"] == pytest.approx(r["second_res_s_per_step_whole"] * 2)
        # the second process: another pid, the same folders, holding what the first left there (its marker)
        second = r["second_process"]
        assert second["status"] == "ok" and r["second_process_first_s"] > 0
        assert r["second_process_pid"] == second["pid"] != r["pid"]
        for k, d in caches.items():
            seen = second["caches_at_start"][k]
            assert seen["dir"] == d and seen["left_by_pid"] == r["pid"] and seen["files"] >= 1
        pids |= {r["pid"], second["pid"]}
    assert len(dirs) == 2  # each path its own cold caches
    assert len(pids) == 4  # four processes: two per path
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.startswith("model "))
    assert header.split()[:5] == ["model", "path", "vram", "whole", "x"]  # the whole sample is the headline
    cold = lines[lines.index(next(ln for ln in lines if ln.startswith("cold (seconds"))) + 1:]
    assert cold[0].split()[:4] == ["model", "path", "res2", "first"]
    assert [ln.split()[:3] for ln in cold[1:3]] == [["flux", "bf16", "tiny"], ["flux", "pack:torch_int_mm", "tiny"]]


def test_models_wan14_wan22_qwen_core_int8(comfy_current, tmp_path):
    doc, _ = _bench(comfy_current, "e2e_models.py", ["--tiny", "--models", "wan14,wan22,qwen", "--paths",
                                                     "bf16,core_int8", "--steps", "1"], tmp_path / "models.json")
    rows = {(r["model"], r["path"]): r for r in _measured(doc)}
    assert rows[("wan14", "bf16")]["model_class"] == "WAN21_T2V"
    assert rows[("wan22", "bf16")]["model_class"] == "WAN22_T2V"  # out_dim 48: Wan 2.2 5B, model_base.WAN22
    assert rows[("qwen", "bf16")]["model_class"] == "QwenImage"
    # Wan 2.2 5B image to video: 48-channel latent, start frame kept by the denoise mask
    w22 = doc["models"]["wan22"]
    assert w22["latent"][:2] == [1, 48] and w22["denoise_mask"] is not None
    for r in rows.values():
        assert r["status"] == "ok" and r["finite"], r
        _whole_is_calls_plus_tax(r, steps=1, calls_per_step=1)
        # the collector's time is part of the timed sample's wall time
        assert 0 <= r["gc_s_per_step"] <= r["s_per_step_wall"] and r["gc_full_collections"] >= 0, r
    for m in ("wan14", "wan22", "qwen"):
        # core int8_tensorwise weights (per-channel absmax / 127): near bf16's output, yet not bf16's
        assert 0 < rows[(m, "core_int8")]["rel_l2_vs_bf16"] < 0.05
        assert rows[(m, "bf16")]["rel_l2_vs_bf16"] == 0.0


def test_full_size_wan14_wan22_qwen_layouts_detected(comfy_current):
    """The full-size layouts (built on the meta device) are what ComfyUI's detection maps back to the same model
    and config; their sizes are the published ones (Wan 2.1 14B, Wan 2.2 TI2V 5B, Qwen-Image 20B)."""
    from comfy_harness import run_in_current_comfy
    cp = run_in_current_comfy(f"""
import json, sys, torch
sys.path.append({str(ROOT)!r})
import comfy.model_detection as md
from bench import e2e_models
out = {{}}
for name in ("wan14", "wan22", "qwen"):
    cfg = e2e_models.unet_config(name, tiny=False)
    dm = md.model_config_from_unet_config(cfg).get_model({{}}, device=torch.device("meta")).diffusion_model
    sd = dict(dm.named_parameters())
    det = md.detect_unet_config(sd, "")
    q = "transformer_blocks.0.attn.to_q.weight" if name == "qwen" else "blocks.0.self_attn.q.weight"
    out[name] = {{"params": sum(p.numel() for p in sd.values()), "dim": sd[q].shape[0], "blocks": det["num_layers"],
                 "class": type(md.model_config_from_unet(sd, "")).__name__,
                 "same": all(det.get(k) == v for k, v in cfg.items())}}
    if name == "wan22":  # the Wan 2.2 VAE's 48 channels in (patch_embedding) and out (head: 48 x 1x2x2)
        out[name].update(in_ch=sd["patch_embedding.weight"].shape[1], head_out=sd["head.head.weight"].shape[0],
                         ffn=sd["blocks.0.ffn.0.weight"].shape[0], heads=dm.blocks[0].self_attn.num_heads)
print("RESULT " + json.dumps(out))
""", check=True)
    res = json.loads(cp.stdout.split("RESULT ", 1)[1])
    assert res["wan14"]["class"] == "WAN21_T2V" and res["wan14"]["same"]
    assert res["wan14"]["dim"] == 5120 and res["wan14"]["blocks"] == 40
    assert abs(res["wan14"]["params"] / 14e9 - 1) < 0.05
    w22 = res["wan22"]
    assert w22["class"] == "WAN22_T2V" and w22["same"]
    assert (w22["dim"], w22["blocks"], w22["ffn"], w22["heads"]) == (3072, 30, 14336, 24)
    assert (w22["in_ch"], w22["head_out"]) == (48, 48 * 4)
    assert abs(w22["params"] / 5e9 - 1) < 0.05
    assert res["qwen"]["class"] == "QwenImage" and res["qwen"]["same"]
    assert res["qwen"]["dim"] == 3072 and res["qwen"]["blocks"] == 60
    assert abs(res["qwen"]["params"] / 20e9 - 1) < 0.05


def test_sampler_dual_isolated_times_both_backbones(comfy_current, tmp_path):
    """Ideogram 4's DualModelGuider through an isolated run: the model-call timer sees the conditional and the
    unconditional backbone (two calls a step). No blocks (--layers 0) and narrow widths keep it small on the CPU."""
    doc, out = _bench(comfy_current, "e2e_sampler.py", ["--narrow", "--layers", "0", "--res", "32",
                                                        "--text-tokens", "4", "--steps", "1", "--workflows", "dual", "--paths", "bf16",
                                                        "--isolate", "--comfy-flag=--bf16-unet"],
                        tmp_path / "dual.json")
    assert doc["isolated"] and doc["cold"] is False and doc["parent_imported_torch"] is False
    (r,) = _measured(doc)
    assert r["status"] == "ok" and r["workflow"] == "dual" and r["isolated"] and r["vram_gib"] is None
    _whole_is_calls_plus_tax(r, steps=1, calls_per_step=2)
    assert any(ln.split()[:3] == ["dual", "32", "bf16"] for ln in out.splitlines())


# ----------------------------------------------------------------------------- bench/lib/e2e_runs.py alone
def test_child_argv_and_sizes():
    argv = ["--comfy", "c", "--cold", "--vram-gib", "24,16", "--paths=bf16", "--models", "flux", "--steps", "6",
            "--out", "x.json", "--isolate", "--child-timeout", "9"]
    assert e2e_runs.child_argv(argv) == ["--comfy", "c", "--steps", "6"]
    assert e2e_runs.vram_sizes("24,16,12") == [24.0, 16.0, 12.0] and e2e_runs.vram_sizes("") == [None]


def test_error_status():
    import torch
    assert e2e_runs.error_fields(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))[
        "status"] == "oom"
    assert e2e_runs.error_fields(RuntimeError("CUDA error: out of memory"))["status"] == "oom"
    e = e2e_runs.error_fields(ValueError("bad"), "build: ")
    assert e == {"status": "error", "error": "build: ValueError: bad"}


@pytest.mark.parametrize("body, status", [
    ("import time; print('loading'); time.sleep(60)", "timeout"),
    ("print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB'); raise SystemExit(1)", "oom"),
    ("import os; os.abort()", "crashed"),
])
def test_dead_child_is_a_row(tmp_path, body, status):
    script = tmp_path / "child.py"
    script.write_text(body)
    rows, meta = e2e_runs.run_child(script, [], {"models": "flux", "paths": "bf16,pack:fused_triton"}, cold=False,
                                    gib=12.0, held={"held_gib": 100.0, "free_gib": 12.0, "others_bytes": 1},
                                    cpu=False, timeout=3)
    assert meta == {}
    assert [(r["model"], r["path"], r["status"]) for r in rows] == [("flux", "bf16", status),
                                                                   ("flux", "pack:fused_triton", status)]
    assert all(r["vram_gib"] == 12.0 and r["held_gib"] == 100.0 and r["free_gib_at_start"] == 12.0 for r in rows)


def test_child_rows_are_tagged(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import json, os, sys\n"
                      "out = sys.argv[sys.argv.index('--out') + 1]\n"
                      "json.dump({'gpu': 'g', 'rows': [{'path': 'bf16', 'status': 'ok', 'argv': sys.argv[1:],\n"
                      "  'others': os.environ['" + e2e_runs.OTHERS_ENV + "'],\n"
                      "  'cache': os.environ['INT8_FUSED_CACHE_DIR']}]}, open(out, 'w'))\n")
    rows, meta = e2e_runs.run_child(script, ["--steps", "6"], {"paths": "bf16"}, cold=True, gib=16.0,
                                    held={"held_gib": 120.0, "free_gib": 16.0, "others_bytes": 123}, cpu=False,
                                    timeout=60)
    (r,) = rows
    assert meta == {"gpu": "g"}
    assert r["argv"][:2] == ["--steps", "6"] and r["argv"][-4:] == ["bf16", "--vram-gib", "16", "--cold"]
    assert "--child" in r["argv"] and r["others"] == "123" and r["cache"] == r["int8_fused_cache_dir"]
    assert r["cold"] and r["isolated"] and r["vram_gib"] == 16.0 and r["held_gib"] == 120.0


def test_cold_child_caches_kept_where_asked(tmp_path, monkeypatch):
    """With ``BENCH_KEEP_CACHES`` set, the JSON files a cold child wrote into its INT8_FUSED_CACHE_DIR are copied
    to ``<folder>/<unit>/`` (byte for byte) before its folders are removed; without it nothing is kept."""
    script = tmp_path / "child.py"
    script.write_text("import json, os, sys\n"
                      "d = os.environ['INT8_FUSED_CACHE_DIR']; os.makedirs(d, exist_ok=True)\n"
                      "open(os.path.join(d, 'gemm-g.json'), 'w').write('{\"k\": [1, 2]}')\n"
                      "open(os.path.join(d, 'lock'), 'w').write('')\n"
                      "out = sys.argv[sys.argv.index('--out') + 1]\n"
                      "json.dump({'rows': [{'model': 'm', 'path': 'bf16', 'status': 'ok'}]}, open(out, 'w'))\n")
    unit = {"models": "zimage", "paths": "pack:fused_triton"}
    (r,) = e2e_runs.run_child(script, [], unit, cold=True, gib=None, held={}, cpu=True, timeout=60)[0]
    assert "kept_caches" not in r and not (tmp_path / "kept").exists()
    monkeypatch.setenv(e2e_runs.KEEP_ENV, str(tmp_path / "kept"))
    (r,) = e2e_runs.run_child(script, [], unit, cold=True, gib=None, held={}, cpu=True, timeout=60)[0]
    kept = tmp_path / "kept" / "zimage-pack_fused_triton"
    assert r["kept_caches"] == str(kept) and sorted(p.name for p in kept.iterdir()) == ["gemm-g.json"]
    assert json.loads((kept / "gemm-g.json").read_text()) == {"k": [1, 2]}
    assert not Path(r["int8_fused_cache_dir"]).parent.exists()


def test_second_process_reuses_the_first_caches(tmp_path):
    """``run_child(..., cold=True, second=True)``: the second child gets the first's cache folders (with what it
    left there) and ``--second-process``; its first sample is folded into the first's row; the folders go after."""
    script = tmp_path / "child.py"
    script.write_text("import json, os, sys\n"
                      "sys.path.insert(0, " + repr(str(ROOT)) + ")\n"
                      "from bench.lib import e2e_runs\n"
                      "out = sys.argv[sys.argv.index('--out') + 1]\n"
                      "second = '--second-process' in sys.argv\n"
                      "seen = e2e_runs.cache_listing()\n"
                      "json.dump({'gpu': 'g', 'pid': os.getpid(), 'caches_at_start': seen, 'rows': [{'model': 'm',\n"
                      "  'path': 'bf16', 'status': 'ok', 'pid': os.getpid(), 'second': second,\n"
                      "  'first_sample_s': 2.0 if second else 9.0}]}, open(out, 'w'))\n"
                      "e2e_runs.leave_marker()\n")
    rows, meta = e2e_runs.run_child(script, [], {"models": "m", "paths": "bf16"}, cold=True, gib=None, held={},
                                    cpu=True, timeout=60, second=True)
    (r,) = rows
    assert r["second"] is False and r["first_sample_s"] == 9.0 and r["second_process_first_s"] == 2.0
    assert r["caches_at_start"]["int8_fused"]["files"] == 0 and r["caches_at_start"]["triton"]["left_by_pid"] is None
    sp = r["second_process"]
    assert sp["status"] == "ok" and r["second_process_pid"] == sp["pid"] != r["pid"]
    assert sp["caches_at_start"]["int8_fused"] == {"dir": r["int8_fused_cache_dir"], "files": 1,
                                                   "bytes": sp["caches_at_start"]["int8_fused"]["bytes"],
                                                   "left_by_pid": r["pid"]}
    assert sp["caches_at_start"]["triton"]["dir"] == r["triton_cache_dir"]
    assert not Path(r["int8_fused_cache_dir"]).parent.exists()
    # a first child that failed gets no second one
    script.write_text("raise SystemExit(1)\n")
    (r,) = e2e_runs.run_child(script, [], {"models": "m", "paths": "bf16"}, cold=True, gib=None, held={}, cpu=True,
                              timeout=60, second=True)[0]
    assert r["status"] == "crashed" and "second_process" not in r


def test_second_res_and_cold_targets():
    """The cold suite's second resolution per model kind, and issue 48's checks (H100: bf16's first + 3 s, H200:
    + 2 s; the new resolution within its warm sample + 1 s; a second process within bf16's first + 0.5 s)."""
    from bench import e2e_models as em
    auto = em.SECOND_RES_AUTO
    assert em.second_res_of(auto, "flux") == (768, 768) and em.second_res_of(auto, "wan13") == (384, 672)
    assert em.second_res_of("flux=512x640,image=768", "flux") == (512, 640)
    assert em.second_res_of("896", "zimage") == (896, 896) and em.second_res_of("", "flux") is None
    assert em.second_res_of("none", "flux") is None
    assert em.second_latent("flux", (1, 16, 128, 128), (768, 768), False) == (1, 16, 96, 96)
    assert em.second_latent("wan13", (1, 16, 9, 60, 104), (384, 672), False) == (1, 16, 9, 48, 84)
    assert em.second_latent("wan22", (1, 48, 9, 30, 52), (384, 672), False) == (1, 48, 9, 24, 42)
    assert em.second_latent("ideogram4_dual", (1, 128, 64, 64), (768, 768), False) == (1, 128, 48, 48)
    assert em.second_latent("flux", (1, 16, 8, 8), (768, 768), True) == (1, 16, 6, 6)
    with pytest.raises(ValueError):
        em.second_latent("flux", (1, 16, 128, 128), (770, 770), False)

    def row(path, first, **kw):
        return {"model": "m", "path": path, "cold": True, "vram_gib": None, "status": "ok", "first_sample_s": first,
                **kw}
    rows = [row("bf16", 6.0, second_process_first_s=5.0),
            row("pack:fused_triton", 8.5, second_res_first_s=2.5, second_res_warm_s=1.0, second_process_first_s=6.4)]
    (h100,) = e2e_runs.cold_targets(rows, "NVIDIA H100 80GB HBM3", em.KEYS)
    assert h100["checks"] == {"first<=bf16+3s": True, "second_res_first<=its_warm+1s": False,
                              "second_process_first<=bf16_first+0.5s": True} and h100["pass"] is False
    (h200,) = e2e_runs.cold_targets(rows, "NVIDIA H200", em.KEYS)
    assert h200["checks"]["first<=bf16+2s"] is False and h200["row"] == 1


def test_summary_ratios_and_vram_targets(capsys):
    """Ratios on the whole-sample figure, within one (model, card size); issue 36's checks per size."""
    from bench import e2e_models
    p = 10 * 2 ** 30  # 10 Gi parameters: bf16 20 GiB, int8 10 GiB
    rows = [
        {"model": "m", "path": "bf16", "vram_gib": 16.0, "status": "ok", "s_per_step_whole": 0.9, "s_per_step": 0.1},
        {"model": "m", "path": "fp8_fast", "vram_gib": 16.0, "status": "ok", "s_per_step_whole": 0.6},
        {"model": "m", "path": "core_int8", "vram_gib": 16.0, "status": "ok", "s_per_step_whole": 0.5,
         "host_rss_peak_row_gib": 30.0},
        {"model": "m", "path": "pack:fused_triton", "vram_gib": 16.0, "status": "ok", "s_per_step_whole": 0.4,
         "params": p, "host_rss_peak_row_gib": 29.0},
        {"model": "m", "path": "bf16", "vram_gib": 8.0, "status": "ok", "s_per_step_whole": 2.0},
        {"model": "m", "path": "fp8_fast", "vram_gib": 8.0, "status": "ok", "s_per_step_whole": 0.5},
        {"model": "m", "path": "core_int8", "vram_gib": 8.0, "status": "ok", "s_per_step_whole": 1.0,
         "host_rss_peak_row_gib": 30.0},
        {"model": "m", "path": "pack:fused_triton", "vram_gib": 8.0, "status": "oom", "error": "out of memory",
         "params": p},
    ]
    xb, xf = e2e_runs.speedups(rows, rows[3], e2e_models.KEYS)
    assert xb == pytest.approx(0.9 / 0.4) and xf == pytest.approx(0.6 / 0.4)
    checks = {(c["vram_gib"]): c for c in e2e_models.targets(rows)}
    assert checks[16.0]["checks"] == {"x_fp8_fast>=1.3": True, "x_bf16>=2 (int8 fits, bf16 not)": True,
                                      "no OOM where core samples": True, "host RAM <= core's": True}
    assert checks[16.0]["pass"] is True
    # at 8 GiB the int8 weights do not fit either: no 2x claim; the pack's OOM where core sampled fails
    assert checks[8.0]["checks"] == {"no OOM where core samples": False} and checks[8.0]["pass"] is False
    e2e_models.table(rows)
    lines = capsys.readouterr().out.splitlines()
    pack16 = next(ln for ln in lines if "pack:fused_triton" in ln and " 16 " in ln).split()
    assert pack16[2:6] == ["16", "0.4000", "2.25", "1.50"]
    assert any("pack:fused_triton" in ln and "oom" in ln for ln in lines)


def test_merge_keeps_oom_rows_and_checks_each_run(tmp_path):
    """bench/lib/merge.py: OOM rows are results, bench errors kept apart, run names with dashes kept whole,
    issue 36's checks computed within each run."""
    results = tmp_path / "results"
    for d in ("models-runs", "vram-runs"):
        (results / d).mkdir(parents=True)

    def row(path, s, run_status="ok", **kw):
        return {"model": "m", "path": path, "vram_gib": 16.0, "status": run_status, "s_per_step_whole": s, **kw}
    a = [row("bf16", 1.0), row("fp8_fast", 0.6), row("pack:fused_triton", 0.5),
         {"check": "issue36", "row": 2, "checks": {}}]
    b = [row("bf16", 1.0), row("fp8_fast", 0.3), row("pack:fused_triton", None, "oom", error="CUDA out of memory"),
         {"model": "m", "path": "core_int8", "status": "error", "error": "build: KeyError: 'x'"}]
    for name, rows in (("h200-vram-limited-abc1234-a", a), ("h200-vram-limited-abc1234-b", b)):
        (results / "vram-runs" / f"{name}.json").write_text(json.dumps({"commit": "abc1234", "rows": rows}))
    cp = subprocess.run([sys.executable, str(ROOT / "bench" / "lib" / "merge.py"), "--results", str(results)],
                        capture_output=True, text=True)
    assert cp.returncode == 0, cp.stderr
    doc = json.loads((results / "h200-vram-limited.json").read_text())
    assert sorted(doc["runs"]) == ["abc1234-a", "abc1234-b"]
    assert [(r["run"], r["path"]) for r in doc["bench_errors"]] == [("abc1234-b", "core_int8")]
    oom = next(r for r in doc["rows"] if r.get("status") == "oom")
    assert oom["run"] == "abc1234-b" and oom["commit"] == "abc1234"
    # the runs' own check rows are dropped, then computed again within each run: a's pack against a's fp8_fast
    checks = [(c["run"], c["x_fp8_fast"], c["checks"]) for c in doc["rows"] if c.get("check") == "issue36"]
    assert checks == [("abc1234-a", pytest.approx(0.6 / 0.5), {"x_fp8_fast>=1.3": False}), ("abc1234-b", None, {})]


def test_gpu_busy_is_the_union_of_gpu_spans_without_the_first_step():
    """bench/e2e_sampler.py ``gpu_busy_s`` on a hand-made trace of 3 steps (µs): overlapping spans count once, gaps not
    at all, host events not at all, and the first third of the GPU events (the first step) is left out."""
    from bench import e2e_sampler

    def k(ts, dur, cat="kernel"):
        return {"cat": cat, "ts": ts, "dur": dur}
    ev = [k(0, 50), k(60, 40),                           # step 0: left out
          k(1000, 100), k(1050, 100, "gpu_memcpy"),     # step 1: [1000, 1150] -> 150
          k(2000, 30), k(2100, 20, "gpu_memset"),       # step 2: 30 + 20 -> 50
          {"cat": "cpu_op", "ts": 1000, "dur": 5000}]   # host work: not GPU time
    # six GPU events, 3 steps: the first 2 left out; (150 + 50) µs over 2 steps
    assert e2e_sampler.gpu_busy_s(ev, 3) == pytest.approx(100e-6)
    assert e2e_sampler.gpu_busy_s(ev[:2], 3) is None  # fewer GPU events than steps: nothing to tell


def test_models_two_gpu_options_on_one_device(comfy_current, tmp_path):
    """Issue 51's bench options, as far as one CPU takes them: ``--cfg 2`` (cond and uncond a step), ``--multigpu 2``
    (MultiGPU CFG Split after each path's MODEL: the CPU is the only device, so no extra clone and one device listed)
    and ``--negative-device cpu`` (the pack's two-device guider for Ideogram 4's DualModelGuider workflow, here on the
    model's own device: DualModelGuider unchanged). The rows say what ran."""
    doc, _ = _bench(comfy_current, "e2e_models.py", ["--tiny", "--models", "flux,ideogram4_dual", "--paths",
                                                     "bf16,pack:torch_int_mm", "--steps", "1", "--cfg", "2",
                                                     "--multigpu", "2", "--negative-device", "cpu"],
                    tmp_path / "two.json")
    rows = {(r["model"], r["path"]): r for r in _measured(doc)}
    for (model, path), r in rows.items():
        assert r["status"] == "ok" and r["finite"], r
        assert r["multigpu"] == 2 and r["multigpu_devices"] == ["cpu"], r
        # cfg 2: ComfyUI batches cond and uncond in one call; DualModelGuider: one call per backbone
        _whole_is_calls_plus_tax(r, steps=1, calls_per_step=2 if model == "ideogram4_dual" else 1)
    assert rows[("flux", "bf16")]["guider"] == "CFGGuider cfg 2"
    assert rows[("ideogram4_dual", "bf16")]["guider"] == "DualModelGuider cfg 4, negative on cpu"
    assert 0 < rows[("flux", "pack:torch_int_mm")]["rel_l2_vs_bf16"] < 0.05
