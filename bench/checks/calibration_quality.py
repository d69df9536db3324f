"""Calibration quality on a miniature DiT with injected outlier channels (CPU, pinned ComfyUI, issue 6).

Model: the tiny Lumina 2 miniature (scripts/miniature.py, width 128, 1+1 refiners + 2 layers) with
activation outliers injected WITHOUT changing the float function: RMSNorm gains feeding
``attention.qkv`` and ``feed_forward.w1/w3`` are multiplied by 25..120 on 4 channels and the weight
columns divided by the same; ``w3`` rows x30..90 on 3 FFN channels and the matching ``w2`` columns
divided (SwiGLU is linear in w3). ``--no-outliers`` runs the plain miniature.

Calibration: "INT8 Calibrate" node code, 3 euler steps (scheduler simple, cfg 2) at 16x16 latent,
seed 1. Evaluation on held-out seeds 7, 8, 9 (other noise, other conditioning): the INT8 model is
built by the "Apply Fused INT8 GEMM" node code (backend dequant_bf16, preset blocks = 20 linears)
and sampled with the same settings; the metric is the relative L2 error of the final latent
against the float model, ``||z_int8 - z_float|| / ||z_float||``, averaged over the seeds.
References: the fp32 model (INT8 layers compute in fp32) and the bf16 model (INT8 layers compute in
bf16, calibrated on the bf16 model).

Run: ``.runtime/venv/bin/python bench/checks/calibration_quality.py [--out bench/results/calibration_quality_cpu.json]``
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import comfy_harness as H  # noqa: E402

OUT_CH, OUT_GAIN = [5, 40, 77, 101], [25.0, 50.0, 80.0, 120.0]
FFN_CH, FFN_GAIN = [3, 200, 333], [30.0, 60.0, 90.0]
STEPS, CFG, SAMPLER, SCHED = 3, 2.0, "euler", "simple"
LATENT = torch.zeros(1, 16, 16, 16)


def inject_outliers(sd: dict) -> dict:
    sd = {k: v.clone() for k, v in sd.items()}
    g, g2 = torch.tensor(OUT_GAIN), torch.tensor(FFN_GAIN)
    for p in {k.rsplit(".attention.qkv.weight", 1)[0] for k in sd if k.endswith("attention.qkv.weight")}:
        for norm, ws in (("attention_norm1", ["attention.qkv"]), ("ffn_norm1", ["feed_forward.w1", "feed_forward.w3"])):
            sd[f"{p}.{norm}.weight"][OUT_CH] *= g
            for w in ws:
                sd[f"{p}.{w}.weight"][:, OUT_CH] /= g
        sd[f"{p}.feed_forward.w3.weight"][FFN_CH] *= g2[:, None]
        sd[f"{p}.feed_forward.w2.weight"][:, FFN_CH] /= g2
    return sd


def build(dtype, outliers: bool):
    import comfy.model_detection
    import comfy.model_patcher
    mini = H.miniature()
    sd = mini.tiny_state_dict("lumina2", 0)
    if outliers:
        sd = inject_outliers(sd)
    mc = comfy.model_detection.model_config_from_unet_config(dict(mini.TINY_UNET_CONFIG["lumina2"]), sd)
    mc.set_inference_dtype(dtype, None)
    cpu = torch.device("cpu")
    model = mc.get_model(sd, "", device=cpu)
    model.diffusion_model.load_state_dict(sd, strict=True)
    model.diffusion_model.to(dtype)
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def cond(seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, 8, 64, generator=g), {}]]


def sample(model, seed):
    import comfy.sample
    noise = comfy.sample.prepare_noise(LATENT, seed)
    return comfy.sample.sample(model, noise, STEPS, CFG, SAMPLER, SCHED, cond(seed), cond(seed + 100), LATENT,
                               seed=seed, disable_pbar=True).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--no-outliers", action="store_true")
    ap.add_argument("--protect", type=int, default=3, help="protect_top_k of the protected row")
    a = ap.parse_args()
    H.import_comfy(H.COMFY_DIR)
    pack = H.import_pack()
    calib, apply = pack.nodes.calibrate, pack.nodes.apply.ApplyFusedInt8GEMM()
    held_out = [7, 8, 9]
    configs = [("uncalibrated", None), ("smoothquant a=0.5", dict(alpha=0.5)),
               ("smoothquant a-search", dict(alpha_search=True)),
               (f"a=0.5 + protect top-{a.protect}", dict(alpha=0.5, protect_top_k=a.protect)),
               (f"a-search + protect top-{a.protect}", dict(alpha_search=True, protect_top_k=a.protect))]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model = build(dtype, not a.no_outliers)
        refs = {s: sample(model, s) for s in held_out}
        for label, kw in configs:
            t0 = time.time()
            cal = None
            if kw is not None:
                cal = calib.run_calibration(model, cond(1), cond(101), {"samples": LATENT}, 1, STEPS, CFG,
                                            SAMPLER, SCHED, **kw)
            (q,) = apply.apply(model, "dequant_bf16", "blocks", "", "", "", calibration=cal)
            errs = [float((sample(q, s) - refs[s]).norm() / refs[s].norm()) for s in held_out]
            row = {"reference": str(dtype).replace("torch.", ""), "config": label,
                   "rel_err_mean": sum(errs) / len(errs), "rel_err_per_seed": errs,
                   "protected": [] if cal is None else cal.protected_names(),
                   "seconds": round(time.time() - t0, 1), "outliers": not a.no_outliers}
            if cal is not None:
                row["layer_err_geomean"] = cal.summary_text().splitlines()[1]
            rows.append(row)
            print(f"{row['reference']:>8}  {label:<28} rel. error {row['rel_err_mean']:.3e}  "
                  f"(seeds {', '.join(f'{e:.2e}' for e in errs)})"
                  + (f"  float: {', '.join(row['protected'])}" if row["protected"] else ""), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"bench": "calibration_quality", "steps": STEPS, "cfg": CFG,
                                           "held_out_seeds": held_out, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
