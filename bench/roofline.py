"""A roofline model of one sampling step: what the pack should give against bf16 and ``fp8_e4m3fn_fast`` on cards
that cannot be lent here (issue 36 item 4). A PREDICTION, checked only against the H200's measured rows.

    python3 bench/roofline.py [--out bench/results/roofline.json] [--no-fit] [--quiet]

Pure Python (no torch, no GPU). Per (card, model, path) the step costs

  gpu     = sum over linears of max(2*M*N*K / (rate_path * eff_path), weight bytes / (BW * EFF_STREAM))
          + attention 4*B*H*Lq*Lk*D / (bf16 rate * eff_attention(backend, head_dim))
          + non-GEMM memory-bound work: k_path * sum over blocks of 2*M*d bytes / (BW * EFF_ROW)
          + fp8_fast's own passes per linear call: the activation clamp + cast (7 bytes an input element: bf16 read,
            bf16 write, bf16 read, e4m3 write) and w_fp8 bytes a weight element (ComfyUI's per-call weight handling;
            on the H200 its steps ran no faster than bf16's although its GEMMs did); on cards without fp8 (Ampere)
            ComfyUI computes in bf16 from fp8 storage: each call upcasts its weight (3 bytes an element)
  offload = bytes of weights not resident / PCIe rate (DynamicVRAM streams them each step; resident = VRAM less
            RESERVE_GIB for activations, workspace and the CUDA context)
  host    = h_path * transformer blocks run in the step (the host's Python/launch floor)
  step    = max(gpu, offload, host)

Rates are dense datasheet figures (no sparsity) with the accumulate the path uses: bf16 and ``torch._scaled_mm``
fp8 accumulate in fp32, which GeForce Ampere/Ada/Blackwell run at half the fp16-accumulate rate; INT8 accumulates
in int32 at the full rate. Efficiencies (achieved fraction of the datasheet peak) are the H200's measured ones,
assumed to carry over to the other cards (the H200's figures already include its 700 W clock drop).

Fitted on the H200 (said in the JSON): k_bf16 (bf16 and fp8), k_pack (non-GEMM bytes per block in units of 2*M*d),
w_fp8, a_cudnn128 / a_flash128 (attention at head_dim 128 on sm_90; 256 is kernel-measured), h_bf16, h_fp8, h_pack
(host ms per block): eight global numbers for twelve measured rows; ``--no-fit`` uses FIT_DEFAULT instead. The
check reports each H200 row's and ratio's error and a leave-one-model-out error (refit without that model, predict
it); the model is trusted only if both stay within 15 %.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024 ** 3
TRUST = 0.15  # the model is trusted only if every H200 row is predicted within this

# ----------------------------------------------------------------------------- cards (data)
# rates in TFLOP/s (TOP/s for int8), dense; bw GB/s; vram GiB as sold; pcie GB/s achieved (~80 % of the link's
# theoretical 31.5 GB/s for 4.0 x16, 63 for 5.0 x16, 15.75 for 4.0 x8). fp8 None: no fp8 tensor cores.
# No network here: every figure is a well-known published number quoted from memory, not re-read.
CARDS = {
    "RTX 3060 12GB": dict(arch="sm_86", bf16=25.4, fp8=None, int8=101.6, bw=360, vram=12, pcie=25.0,
                          src="NVIDIA Ampere GA102 whitepaper rates scaled to GA106 (28 SMs, 1.78 GHz boost); "
                              "GeForce RTX 3060 spec page (360 GB/s, PCIe 4.0 x16); well-known, not re-read"),
    "RTX 4060 Ti 16GB": dict(arch="sm_89", bf16=44.1, fp8=88.3, int8=176.6, bw=288, vram=16, pcie=12.5,
                             src="NVIDIA Ada Lovelace whitepaper rates scaled to AD106 (34 SMs, 2.535 GHz; "
                                 "353 AI TOPS sparse); RTX 4060 Ti spec page (288 GB/s, PCIe 4.0 x8); well-known"),
    "RTX 4070 12GB": dict(arch="sm_89", bf16=58.3, fp8=116.6, int8=233.2, bw=504, vram=12, pcie=25.0,
                          src="NVIDIA Ada whitepaper rates scaled to AD104 4070 (46 SMs, 2.475 GHz; 466 AI TOPS "
                              "sparse); RTX 4070 spec page (504 GB/s, PCIe 4.0 x16); well-known"),
    "RTX 3090": dict(arch="sm_86", bf16=71.0, fp8=None, int8=284.0, bw=936, vram=24, pcie=25.0,
                     src="NVIDIA Ampere GA102 whitepaper, RTX 3090 column (FP16/BF16 w/ FP32 acc 71, INT8 284 "
                         "dense; 936 GB/s; PCIe 4.0 x16); well-known"),
    "RTX 4090": dict(arch="sm_89", bf16=165.2, fp8=330.3, int8=660.6, bw=1008, vram=24, pcie=25.0,
                     src="NVIDIA Ada Lovelace whitepaper, RTX 4090 column (BF16 w/ FP32 acc 165.2, FP8 w/ FP32 acc "
                         "330.3, INT8 660.6 dense; 1008 GB/s; PCIe 4.0 x16); well-known"),
    "RTX 5090": dict(arch="sm_120", bf16=209.5, fp8=419.0, int8=838.0, bw=1792, vram=32, pcie=50.0,
                     src="NVIDIA RTX Blackwell whitepaper, RTX 5090 column (FP16/BF16 w/ FP32 acc 209.5, FP8 w/ "
                         "FP32 acc 419, INT8 838 dense; 1792 GB/s; PCIe 5.0 x16); well-known, least certain row"),
    "A100 80GB SXM": dict(arch="sm_80", bf16=312.0, fp8=None, int8=624.0, bw=2039, vram=80, pcie=25.0,
                          src="NVIDIA A100 datasheet (BF16 312, INT8 624 dense; 2039 GB/s HBM2e; PCIe 4.0)"),
    "L40S": dict(arch="sm_89", bf16=362.0, fp8=733.0, int8=733.0, bw=864, vram=48, pcie=25.0,
                 src="NVIDIA L40S datasheet (BF16 733, FP8 1466, INT8 1466 with sparsity: halved; 864 GB/s; "
                     "PCIe 4.0 x16); datacenter Ada accumulates fp32 at full rate"),
    "H100 SXM": dict(arch="sm_90", bf16=989.0, fp8=1979.0, int8=1979.0, bw=3350, vram=80, pcie=50.0,
                     src="NVIDIA H100 datasheet, SXM (BF16 989, FP8 1979, INT8 1979 dense; 3.35 TB/s; PCIe 5.0)"),
    "H200": dict(arch="sm_90", bf16=989.0, fp8=1979.0, int8=1979.0, bw=4800, vram=139, pcie=50.0,
                 src="NVIDIA H200 datasheet, SXM (H100's tensor rates; 4.8 TB/s HBM3e; 141 GB, 139 GiB usable)"),
}

# ----------------------------------------------------------------------------- efficiencies (measured, H200)
EFF = {
    # pack INT8 GEMM core: >= 1250 TOP/s of 1979 (RESULTS.md "The GEMM against the hardware", 2ffc9f7/c2955c3)
    "int8": 1250 / 1979,
    # bf16 F.linear whole layer 670-783 TFLOP/s of 989 (RESULTS.md kernels, cf3f8de), midpoint
    "bf16": 726 / 989,
    # cuBLAS FP8 at Ideogram 4's block shapes: 1298-1428 TFLOP/s of 1979 (RESULTS.md gemm floor table), mean
    "fp8": 1345 / 1979,
    # attention, Ideogram 4 shape (h200-attention.json): SDPA cuDNN 632-693 of 989; SDPA flash (ComfyUI's default
    # on the H200: the bf16 row's top kernel is pytorch_flash) 295-329
    "attn_cudnn": 665 / 989, "attn_flash_sm90": 315 / 989,
    # off Hopper: FlashAttention-2 forward reaches ~0.6 of peak on A100 (FlashAttention-2 paper, well-known);
    # assumed for every path there (cuDNN's SDPA is not assumed off sm_90)
    "attn_other": 0.60,
    # SageAttention (the 1.x Triton kernels, what PyPI has; INT8 Q·Kᵀ, fp16 P·V with fp16 accumulation) over
    # FlashAttention-2 on an RTX 4090 at head_dim 64/128: "about 2.1x" (SageAttention paper, ICLR 2025; well-known,
    # not re-read). Carried to the RTX 3090 and 5090 because on all three GeForce generations both of its inputs'
    # rates (INT8, fp16 with fp16 accumulation) are twice the fp32-accumulate bf16 rate that FlashAttention-2 runs at
    "attn_sage_x": 2.1,
    # row kernels / elementwise passes: 40-65 % of HBM in the Ideogram 4 step (RESULTS.md row kernels)
    "row": 0.50,
    # weight streaming (M 1 linears): HBM reads 3.95 of 4.8 TB/s (RESULTS.md hardware limits)
    "stream": 3.95 / 4.8,
}
RESERVE_GIB = 2.5  # VRAM kept for activations, workspace, context (bf16 Flux on the H200: 23.7 GiB peak, 22.2 weights)
# H200 fit (see fit()); used with --no-fit and as the JSON's recorded values after a fit
FIT_DEFAULT = dict(k_bf16=12.0, k_pack=0.0, w_fp8=14.0, a_cudnn128=0.34, a_flash128=0.25, h_bf16=3.0, h_fp8=3.0,
                   h_pack=1.5)


# ----------------------------------------------------------------------------- models (data)
def _lin(m, n, k, count, quant=True):
    return dict(m=m, n=n, k=k, count=count, quant=quant)


def models() -> dict:
    """Per model: linears (per step), attention (H, Lq, Lk, D, count), blocks (M, d, count), params."""
    out = {}
    # Ideogram 4 DualModelGuider: two 34-layer backbones (hidden 4608, FFN 12288, 18 heads x 256); cond pass M 4608
    # (512 text + 4096 image), uncond image-only M 4096; llm_cond_proj 512 x 53248 -> 4608 on the cond pass
    lins, attn, blocks = [], [], []
    for m in (4608, 4096):
        lins += [_lin(m, 13824, 4608, 34), _lin(m, 4608, 4608, 34), _lin(m, 12288, 4608, 68), _lin(m, 4608, 12288, 34),
                 _lin(1, 18432, 512, 34, False), _lin(1, 512, 4608, 34, False)]
        attn.append((18, m, m, 256, 34))
        blocks.append((m, 4608, 34))
    lins.append(_lin(512, 4608, 53248, 1))
    per = 34 * (13824 + 4608 + 2 * 12288 + 12288) * 4608 + 53248 * 4608
    out["ideogram4"] = dict(lins=lins, attn=attn, blocks=blocks, quant_params=2 * per, params=2 * (per + 0.35e9),
                            what="Ideogram 4 1024², DualModelGuider (cond 512+4096 tokens, uncond 4096), 2 backbones")
    # Flux.1-dev: 19 double blocks (img M 4096, txt M 512), 38 single (M 4608), 24 heads x 128, joint L 4608
    lins = [_lin(m, n, k, 19) for m in (4096, 512) for n, k in ((9216, 3072), (3072, 3072), (12288, 3072),
                                                                  (3072, 12288))]
    lins += [_lin(4608, 21504, 3072, 38), _lin(4608, 3072, 15360, 38),
             _lin(1, 18432, 3072, 38, False), _lin(1, 9216, 3072, 38, False)]
    q = 19 * 2 * (9216 + 3072 + 12288 + 3072) * 3072 + 38 * (21504 + 15360) * 3072
    out["flux"] = dict(lins=lins, attn=[(24, 4608, 4608, 128, 57)], blocks=[(4608, 3072, 57)], quant_params=q,
                       params=11.90e9, what="Flux.1-dev 1024², 4096 image + 512 text tokens")
    # Z-Image: 30 layers dim 3840 FFN 10240, M 4352 (4096 image + 256 caption), 30 heads x 128; 2 noise-refiner
    # layers (M 4096) and 2 context-refiner layers (M 256)
    def zl(m, c):
        return [_lin(m, 11520, 3840, c), _lin(m, 3840, 3840, c), _lin(m, 10240, 3840, 2 * c), _lin(m, 3840, 10240, c)]
    lins = zl(4352, 30) + zl(4096, 2) + zl(256, 2) + [_lin(1, 15360, 256, 32, False)]
    out["zimage"] = dict(lins=lins, attn=[(30, 4352, 4352, 128, 30), (30, 4096, 4096, 128, 2), (30, 256, 256, 128, 2)],
                         blocks=[(4352, 3840, 30), (4096, 3840, 2), (256, 3840, 2)],
                         quant_params=34 * (11520 + 3840 + 20480 + 10240) * 3840, params=6.15e9,
                         what="Z-Image 1024², 4096 image + 256 caption tokens")
    # Wan 2.1 1.3B: 30 layers dim 1536 FFN 8960, 12 heads x 128; 14040 video tokens; cross-attention to 512 text
    lins = [_lin(14040, 1536, 1536, 30 * 6), _lin(14040, 8960, 1536, 30), _lin(14040, 1536, 8960, 30),
            _lin(512, 1536, 1536, 30 * 2)]
    out["wan13"] = dict(lins=lins, attn=[(12, 14040, 14040, 128, 30), (12, 14040, 512, 128, 30)],
                        blocks=[(14040, 1536, 30)], quant_params=30 * (8 * 1536 + 2 * 8960) * 1536, params=1.42e9,
                        what="Wan 2.1 T2V 1.3B 480x832, 33 frames (14040 tokens), umT5 512 (computes in fp16)")
    return out


MODELS = models()
PATHS = ("pack", "bf16", "fp8")


# ----------------------------------------------------------------------------- the model
def weight_bytes(model: dict, path: str) -> float:
    per = {"bf16": 2, "fp8": 1, "pack": 1}[path]  # the pack: INT8 weights + fp32 per-channel scales (negligible)
    return model["quant_params"] * per + (model["params"] - model["quant_params"]) * 2


SAGE_HEAD_DIMS = (64, 96, 128)   # what SageAttention 1.x runs; ComfyUI falls back to SDPA for others (head_dim 256)
GEFORCE = ("RTX 3090", "RTX 4090", "RTX 5090")   # the sage table's cards (issue 50)


def attention_eff(card: dict, backend: str, head_dim: int = 256, fit: dict | None = None) -> float:
    """Achieved fraction of the bf16 peak: off Hopper ``attn_other``, ``sage`` (GeForce only) that times
    ``attn_sage_x`` where SageAttention runs the head size; on sm_90 the kernel-measured figure at head_dim 256
    (Ideogram 4's shape) and the fitted ``a_cudnn128`` / ``a_flash128`` below it."""
    if backend == "sage":
        if card["int8"] < 3.9 * card["bf16"]:   # GeForce: fp32-accumulate bf16 at a quarter of the INT8 rate
            raise ValueError("the sage rate is predicted for GeForce cards only (attn_sage_x is an RTX figure)")
        return EFF["attn_other"] * (EFF["attn_sage_x"] if head_dim in SAGE_HEAD_DIMS else 1.0)
    if card["arch"] != "sm_90":
        return EFF["attn_other"]
    if head_dim < 256:
        key = "a_cudnn128" if backend == "cudnn" else "a_flash128"
        return (fit or FIT_DEFAULT).get(key, FIT_DEFAULT[key])
    return EFF["attn_cudnn"] if backend == "cudnn" else EFF["attn_flash_sm90"]


def predict(card: dict, model: dict, path: str, fit: dict, attention: str | None = None, eff: dict | None = None) \
        -> dict:
    """Seconds per step and its parts for one (card, model, path). ``attention``: 'cudnn' | 'comfy' (the SDPA
    ComfyUI picks; flash on the H200) | 'sage' (GeForce cards); default: the pack 'cudnn', the others 'comfy'."""
    e = dict(EFF, **(eff or {}))
    bw = card["bw"] * 1e9
    has_fp8 = card["fp8"] is not None
    gemm = mem = 0.0
    for ln in model["lins"]:
        flops = 2.0 * ln["m"] * ln["n"] * ln["k"]
        wel = ln["n"] * ln["k"]
        if path == "pack" and ln["quant"]:
            rate, wb = card["int8"] * 1e12 * e["int8"], wel
        elif path == "fp8" and ln["quant"] and has_fp8:
            rate, wb = card["fp8"] * 1e12 * e["fp8"], wel
            mem += ln["count"] * (7.0 * ln["m"] * ln["k"] + fit.get("w_fp8", 0.0) * wel)
        else:
            rate, wb = card["bf16"] * 1e12 * e["bf16"], 2 * wel
            if path == "fp8" and ln["quant"]:  # no fp8 tensor cores: upcast the fp8 weight each call
                mem += ln["count"] * 3.0 * wel
        gemm += ln["count"] * max(flops / rate, wb / (bw * e["stream"]))
    backend = attention or ("cudnn" if path == "pack" else "comfy")
    attn = sum(4.0 * h * lq * lk * d * c / (card["bf16"] * 1e12 * attention_eff(card, backend, d, fit))
               for h, lq, lk, d, c in model["attn"])
    k = fit["k_pack"] if path == "pack" else fit["k_bf16"]
    mem += k * sum(2.0 * m * d * c for m, d, c in model["blocks"])
    rows = mem / (bw * e["row"])
    gpu = gemm + attn + rows
    wbytes = weight_bytes(model, path)
    spill = max(0.0, wbytes - (card["vram"] - RESERVE_GIB) * GIB)
    offload = spill / (card["pcie"] * 1e9)
    nblocks = sum(c for _, _, c in model["blocks"])
    host = fit[{"pack": "h_pack", "bf16": "h_bf16", "fp8": "h_fp8"}[path]] * 1e-3 * nblocks
    step = max(gpu, offload, host)
    bound = "gpu" if step == gpu else ("offload" if step == offload else "host")
    return dict(s_per_step=step, gemm_s=gemm, attention_s=attn, rows_s=rows, gpu_s=gpu, offload_s=offload,
                host_s=host, bound=bound, weights_gib=wbytes / GIB, fits=spill == 0.0)


# ----------------------------------------------------------------------------- H200 measured rows
def h200_rows(models_json: Path, sampler_json: Path, commit: str = "489f27a") -> list[dict]:
    """The measured rows at ``commit``: per model, bf16 / pack (mean of its rows) / fp8 s/step, and the
    attention backend each ran with."""
    d = json.loads(models_json.read_text())
    mrows = [r for r in d["rows"] if r.get("commit") == commit and "s_per_step" in r and "check" not in r]
    d = json.loads(sampler_json.read_text())
    runs = {k for k, r in d.get("runs", {}).items() if str(r.get("commit", "")).startswith(commit)}
    srows = [r for r in d["rows"] if r.get("run") in runs and r.get("workflow") == "dual" and "s_per_step" in r]
    out, sources = [], [(m, mrows, models_json, "fp8_fast", "comfy") for m in ("flux", "zimage", "wan13")]
    for model, rows, src, fp8, fp8_att in sources + [("ideogram4", srows, sampler_json, "fp8_fast~cudnn", "cudnn")]:
        for path, key, att in (("bf16", "bf16", "comfy"), ("pack", "pack:fused_triton", "cudnn"),
                               ("fp8", fp8, fp8_att)):
            v = [r["s_per_step"] for r in rows if r.get("model", model) == model and r["path"] == key]
            if v:
                out.append(dict(model=model, path=path, s_per_step=sum(v) / len(v), n=len(v), attention=att,
                                source=f"{src.name}@{commit}"))
    return out


def check(rows: list[dict], predict_fn) -> dict:
    """Relative errors of predicted s/step and of the ratios (pack x bf16 = bf16/pack, pack x fp8 = fp8/pack) on
    measured rows. ``predict_fn(row) -> predicted s/step``. Error = predicted / measured - 1."""
    per = []
    for r in rows:
        p = predict_fn(r)
        per.append(dict(model=r["model"], path=r["path"], measured=r["s_per_step"], predicted=p,
                        err=p / r["s_per_step"] - 1.0))
    ratios = []
    by = {(x["model"], x["path"]): x for x in per}
    for model in dict.fromkeys(x["model"] for x in per):
        pk = by.get((model, "pack"))
        for other in ("bf16", "fp8"):
            o = by.get((model, other))
            if pk and o:
                meas, pred = o["measured"] / pk["measured"], o["predicted"] / pk["predicted"]
                ratios.append(dict(model=model, ratio=f"x {other}", measured=meas, predicted=pred,
                                   err=pred / meas - 1.0))
    worst = max([abs(x["err"]) for x in per + ratios], default=0.0)
    return dict(steps=per, ratios=ratios, worst_abs_err=worst, within=worst <= TRUST)


def _h200_predict(fit, eff=None):
    card = CARDS["H200"]
    return lambda r: predict(card, MODELS[r["model"]], r["path"], fit, r["attention"], eff)["s_per_step"]


def fit(rows: list[dict]) -> dict:
    """The eight global numbers: coordinate descent over a grid each (six rounds from FIT_DEFAULT), minimizing the
    check's worst relative error on ``rows`` (every s/step and every pack ratio)."""
    grids = dict(k_bf16=[i * 2.0 for i in range(31)], k_pack=[i * 2.0 for i in range(31)],
                 w_fp8=[i * 1.0 for i in range(31)], a_cudnn128=[i / 100 for i in range(15, 91)],
                 a_flash128=[i / 100 for i in range(15, 91)], h_bf16=[i / 10 for i in range(61)],
                 h_fp8=[i / 10 for i in range(61)], h_pack=[i / 10 for i in range(61)])
    best = dict(FIT_DEFAULT)
    for _ in range(6):
        for name, values in grids.items():
            best[name] = min(values, key=lambda v: (check(rows, _h200_predict(dict(best, **{name: v})))
                                                    ["worst_abs_err"], v))
    return best


def leave_one_out(rows: list[dict]) -> list[dict]:
    """Refit without each model's rows, predict that model's rows."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        f = fit([r for r in rows if r["model"] != model])
        c = check([r for r in rows if r["model"] == model], _h200_predict(f))
        out.append(dict(model=model, fit=f, steps=c["steps"], ratios=c["ratios"], worst_abs_err=c["worst_abs_err"]))
    return out


# ----------------------------------------------------------------------------- report
def table(fitv: dict) -> tuple[list[dict], str]:
    rows, lines = [], ["| card | model | pack s/step | bf16 s/step | fp8_fast s/step | pack × bf16 | pack × fp8 | "
                       "fits in VRAM? (pack / bf16 / fp8) | bound (pack) |", "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for cname, card in CARDS.items():
        for mname, model in MODELS.items():
            p = {path: predict(card, model, path, fitv) for path in PATHS}
            r = dict(card=cname, model=mname, **{f"{k}_s": v["s_per_step"] for k, v in p.items()},
                     x_bf16=p["bf16"]["s_per_step"] / p["pack"]["s_per_step"],
                     x_fp8=p["fp8"]["s_per_step"] / p["pack"]["s_per_step"],
                     fits={k: v["fits"] for k, v in p.items()}, parts=p,
                     fp8_note=None if card["fp8"] else "no fp8 tensor cores: bf16 compute from fp8 storage")
            rows.append(r)
            yn = " / ".join("yes" if p[k]["fits"] else f"no ({p[k]['weights_gib']:.0f} GiB)" for k in PATHS)
            lines.append(f"| {cname} | {mname} | {r['pack_s']:.3f} | {r['bf16_s']:.3f} | {r['fp8_s']:.3f} | "
                         f"{r['x_bf16']:.2f}× | {r['x_fp8']:.2f}× | {yn} | {p['pack']['bound']} |")
    return rows, "\n".join(lines)


def sage_table(fitv: dict) -> tuple[list[dict], str]:
    """Issue 50's SageAttention prediction on the GeForce cards: bf16 with SDPA (FlashAttention-2 rate), bf16 with
    ``--use-sage-attention``, and the pack with SageAttention (what Apply's ``auto`` keeps there when ComfyUI was
    started with it: no exact backend is predicted faster; its ``sage`` choice runs the same)."""
    rows, lines = [], ["| card | model | bf16 (SDPA) s/step | bf16 + sage | pack + sage | pack + sage × bf16 | "
                       "pack + sage × bf16 + sage | sage runs the heads? |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for cname in GEFORCE:
        card = CARDS[cname]
        for mname, model in MODELS.items():
            b = predict(card, model, "bf16", fitv)
            bs = predict(card, model, "bf16", fitv, attention="sage")
            ps = predict(card, model, "pack", fitv, attention="sage")
            runs = all(d in SAGE_HEAD_DIMS for _, _, _, d, _ in model["attn"])
            r = dict(card=cname, model=mname, bf16_s=b["s_per_step"], bf16_sage_s=bs["s_per_step"],
                     pack_sage_s=ps["s_per_step"], x_bf16=b["s_per_step"] / ps["s_per_step"],
                     x_bf16_sage=bs["s_per_step"] / ps["s_per_step"], sage_runs=runs,
                     attention_share_pack_sage=ps["attention_s"] / ps["gpu_s"], bound=ps["bound"])
            rows.append(r)
            lines.append(f"| {cname} | {mname} | {r['bf16_s']:.3f} | {r['bf16_sage_s']:.3f} | {r['pack_sage_s']:.3f} | "
                         f"{r['x_bf16']:.2f}× | {r['x_bf16_sage']:.2f}× | "
                         f"{'yes' if runs else 'no: head_dim 256, SDPA runs'} |")
    return rows, "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench/results/roofline.json"))
    ap.add_argument("--models-json", default=str(ROOT / "bench/results/h200-e2e-models.json"))
    ap.add_argument("--sampler-json", default=str(ROOT / "bench/results/h200-e2e-sampler.json"))
    ap.add_argument("--commit", default="489f27a", help="the H200 rows to check against (their commit)")
    ap.add_argument("--no-fit", action="store_true", help="use FIT_DEFAULT instead of fitting on the H200 rows")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    measured = h200_rows(Path(a.models_json), Path(a.sampler_json), a.commit)
    fitv = dict(FIT_DEFAULT) if a.no_fit or not measured else fit(measured)
    chk = check(measured, _h200_predict(fitv))
    loo = leave_one_out(measured) if measured and not a.no_fit else []
    rows, md = table(fitv)
    srows, smd = sage_table(fitv)
    doc = dict(what="PREDICTION (roofline model, bench/roofline.py), not a measurement", commit_checked=a.commit,
               efficiencies=EFF, reserve_gib=RESERVE_GIB, fit=fitv, fitted_on_h200=not a.no_fit,
               fit_note="k_bf16, k_pack: non-GEMM bytes per block in units of 2*M*d; w_fp8: fp8_fast's bytes a weight "
                        "element a call; a_*128: attention at head_dim 128 on sm_90; h_*: host ms per block; eight "
                        "global numbers fitted on the H200's measured rows (grid search, worst relative error)",
               cards=CARDS, h200_measured=measured, h200_check=chk, leave_one_model_out=loo,
               loo_worst_abs_err=max((x["worst_abs_err"] for x in loo), default=None),
               trusted=chk["within"] and all(x["worst_abs_err"] <= TRUST for x in loo), rows=rows, markdown=md,
               sage=dict(what="PREDICTION: SageAttention on GeForce cards (attn_sage_x over FlashAttention-2, from "
                              "the SageAttention paper's RTX 4090 figure; not measured here)", rows=srows,
                         markdown=smd))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    if not a.quiet:
        print("H200 check (predicted / measured s/step, error):")
        for s in chk["steps"]:
            print(f"  {s['model']:10s} {s['path']:5s} {s['predicted']:.4f} / {s['measured']:.4f}  {s['err']:+.1%}")
        for s in chk["ratios"]:
            print(f"  {s['model']:10s} pack {s['ratio']:6s} {s['predicted']:.2f} / {s['measured']:.2f}  {s['err']:+.1%}")
        print(f"worst |error| {chk['worst_abs_err']:.1%} (trusted if <= {TRUST:.0%}); fit {fitv}")
        for x in loo:
            print(f"  leave out {x['model']:10s}: worst |error| {x['worst_abs_err']:.1%}")
        print(f"trusted: {doc['trusted']}\n\nPrediction (roofline model; only the H200 is measured):\n\n{md}")
        print(f"\nPrediction with SageAttention (GeForce cards):\n\n{smd}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
