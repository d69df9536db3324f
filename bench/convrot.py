"""ConvRot (issue 39 item 1): what rotating the activations costs and what it buys.

Three parts, each its own mode:

``--device cuda`` (default): on one GPU,
  1. the rotate + quantize kernel (``kernel.hadamard``) at Flux.1's linear input widths (M = 4608 tokens: 4096
     image + 512 text; K 3072, 12288, 15360): its rotation against a float64 block Hadamard (max error / row max),
     its codes against ``quant.quantize.quantize_per_token_ref`` of its own rotated values (bit for bit), and its
     time against the plain per-token quantizer (``kernel.quantize_per_token``; CUDA events, median of 50);
  2. full-size Flux.1 (random weights, bench/e2e_models.py's model and method: ComfyUI 0.33.0's sampler, cfg 1.0,
     euler, ``--steps``) with the paths ``bf16``, ``pack:fused_triton`` and ``pack:fused_triton^convrot`` (the
     Apply node with ``rotation`` convrot): s/step (the per-step cost of the rotation is the difference of the two
     pack rows) and the final latent's relative L2 error against bf16 with and without rotation.
``--device cpu --tiny``: the same code paths as a smoke run (tiny Flux, Triton interpreter; no timing claims).
``--quality-cpu``: the outlier miniature of bench/checks/calibration_quality.py (tiny Lumina 2 with injected activation
  outlier channels, pinned ComfyUI of .runtime/) sampled with Apply's rotation none vs convrot (group 64: the
  miniature is 128 wide), relative L2 of the final latent against the float model, fp32 and bf16, held-out seeds.

Run: ``bash bench/h200.sh exec python bench/convrot.py`` (GPU, ComfyUI 0.33.0 from COMFYUI_CURRENT / --comfy);
``.runtime/venv/bin/python bench/convrot.py --quality-cpu`` (CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # bench.lib; appended, so the pack's root (its nodes/) never shadows ComfyUI's modules
from bench.lib.e2e_runs import logger  # noqa: E402

SHAPES = {"qkv / mlp_in / linear1 (K 3072)": 3072, "mlp_out (K 12288)": 12288, "linear2 (K 15360)": 15360}
PATHS = "bf16,pack:fused_triton,pack:fused_triton^convrot"
log = logger("convrot")


def kernel_rows(pack, dev, tiny: bool) -> list[dict]:
    """Part 1: the rotate + quantize kernel against float64 and the plain quantizer, per K."""
    import torch
    import importlib
    hd, kq, cv, qz, at = (importlib.import_module(f"{pack.__name__}.{m}")
                          for m in ("kernel.hadamard", "kernel", "quant.convrot", "quant.quantize", "quant.attention"))
    ref_q = qz.quantize_per_token_ref
    rows = []
    m = 40 if tiny else 4608
    for label, k in SHAPES.items():
        k = 512 if tiny else k
        g = torch.Generator(device="cpu").manual_seed(k)
        x = torch.randn(m, k, generator=g)
        x[:, :: 97] *= 30.0  # outlier channels
        x = x.to(dev, torch.bfloat16)
        row = {"shape": label, "M": m, "K": k, "group": 256}
        try:
            f = hd.hadamard_rotate(x, 256)
            ref = cv.rotate(x.double(), 256, torch.float64)
            row["rot_err_vs_f64"] = float(((f.double() - ref).abs().amax(1) / ref.abs().amax(1)).max())
            q, s = hd.hadamard_quantize(x, 256)
            q2, s2 = ref_q(f)
            row["codes_equal_ref"] = bool(torch.equal(q, q2) and torch.equal(s, s2))
            if dev.type == "cuda":
                row["hadamard_quant_us"] = at.cuda_time(lambda: hd.hadamard_quantize(x, 256), 50) * 1e3
                row["plain_quant_us"] = at.cuda_time(lambda: kq.quantize_per_token(x, None), 50) * 1e3
                row["x_plain"] = row["hadamard_quant_us"] / row["plain_quant_us"]
            if k >= 12288 or tiny:  # the GELU-fed inputs: mlp.2 (the GELU alone), linear2 (attention | GELU)
                a2 = None if k == 12288 or tiny else x[:, :3072].contiguous()
                h = x if a2 is None else x[:, 3072:].contiguous()
                qa, sa = hd.concat_gelu_hadamard_quantize(a2, h, 256)
                g = torch.nn.functional.gelu(h, approximate="tanh")
                qr, sr = hd.hadamard_quantize(g if a2 is None else torch.cat((a2, g), 1), 256)
                row["gelu_codes_max_diff"] = int((qa.int() - qr.int()).abs().max())
                row["gelu_codes_diff_frac"] = float((qa != qr).float().mean())
                if dev.type == "cuda":
                    row["gelu_hadamard_quant_us"] = at.cuda_time(
                        lambda: hd.concat_gelu_hadamard_quantize(a2, h, 256), 50) * 1e3
                    plain = (lambda: kq.gelu.gelu_tanh_quantize(h)) if a2 is None else (
                        lambda: kq.gelu.concat_gelu_quantize(a2, h))
                    row["gelu_plain_quant_us"] = at.cuda_time(plain, 50) * 1e3
            row["status"] = "ok"
        except Exception as e:  # non-fatal: the sampler part still runs
            import traceback
            traceback.print_exc()
            row.update(status="error", error=f"{type(e).__name__}: {e}")
        log(json.dumps(row))
        rows.append(row)
    return rows


def sampler_main(a) -> int:
    from bench.e2e_models import ModelsBench
    from bench.e2e_sampler import start
    dynamic = start(a)
    if dynamic is None:
        return 2
    from bench.lib import e2e

    class Bench(ModelsBench):
        """ModelsBench with the path suffix ``^convrot``: the Apply node's ``rotation`` input."""
        rotation = "none"

        def load_path(self, path, sd, core_sd=None, label=""):
            base, _, self.rotation = path.partition("^")
            self.rotation = self.rotation or "none"
            return super().load_path(base, sd, core_sd, label)

    class E2E:
        def __getattr__(self, name):
            return getattr(e2e, name)

        def pack_apply(self, pack, patcher, backend, **inputs):
            out = e2e.pack_apply(pack, patcher, backend, rotation=bench.rotation, **inputs)
            rot = getattr(getattr(out, "int8_report", None), "rotated", {})
            log(f"Apply rotation={bench.rotation}: {len(rot)} layers ConvRot-rotated")
            bench.n_rotated[bench.rotation] = len(rot)
            return out

    a.models, a.host_sample = "flux", ""
    a.ideogram_layers, a.child = 34, False
    bench = Bench(a, dynamic, E2E())
    bench.n_rotated = {}
    bench.doc_extra.update(bench="convrot", kernel=kernel_rows(bench.pack, bench.dev, a.tiny))
    bench.doc_extra["rotated_layers"] = bench.n_rotated
    return bench.run()


def quality_main(a) -> int:
    """``--quality-cpu``: Apply rotation none vs convrot on the outlier miniature (module doc)."""
    import torch
    from bench.checks import calibration_quality as cq
    from bench.lib.e2e import rel_l2
    H = cq.H
    H.import_comfy(H.COMFY_DIR)
    apply = H.import_pack().nodes.apply.ApplyFusedInt8GEMM()
    seeds = [int(s) for s in a.seeds.split(",")]
    rows = []
    for dtype in (torch.float32, torch.bfloat16)[: 1 if a.fp32_only else 2]:
        model = cq.build(dtype, not a.no_outliers)
        refs = {s: cq.sample(model, s) for s in seeds}
        for backend in a.backends.split(","):
            for rotation in ("none", "convrot"):
                t0 = time.time()
                (q,) = apply.apply(model, backend, "blocks", "", "", "", rotation=rotation)
                errs = [rel_l2(cq.sample(q, s), refs[s]) for s in seeds]
                row = {"reference": str(dtype).replace("torch.", ""), "backend": backend, "rotation": rotation,
                       "rotated_layers": len(q.int8_report.rotated), "int8_layers": q.int8_report.quantized,
                       "rel_err_mean": sum(errs) / len(errs), "rel_err_per_seed": errs,
                       "outliers": not a.no_outliers, "seconds": round(time.time() - t0, 1)}
                rows.append(row)
                log(f"{row['reference']:>8} {backend:<13} rotation {rotation:<8} rel. error {row['rel_err_mean']:.3e} "
                    f"({row['rotated_layers']}/{row['int8_layers']} layers rotated)")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        import platform

        import triton
        from bench.lib import provenance
        prov = {"device": f"CPU ({platform.processor() or platform.machine()}, Triton interpreter)",
                "torch": torch.__version__, "triton": triton.__version__, "commit": provenance.commit(),
                "dirty": provenance.dirty(), "command": provenance.command()}
        Path(a.out).write_text(json.dumps({"bench": "convrot_quality_cpu", "steps": cq.STEPS, "cfg": cq.CFG,
                                           "held_out_seeds": seeds, **prov, "rows": rows}, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", default=os.environ.get("COMFYUI_CURRENT"), help="ComfyUI 0.33.0 tree")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny Flux (CPU smoke run)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--paths", default=PATHS)
    ap.add_argument("--quality-cpu", action="store_true", help="the outlier miniature, rotation none vs convrot")
    ap.add_argument("--seeds", default="7,8,9", help="--quality-cpu: held-out seeds")
    ap.add_argument("--backends", default="dequant_bf16", help="--quality-cpu: Apply backends")
    ap.add_argument("--fp32-only", action="store_true", help="--quality-cpu: the fp32 model only")
    ap.add_argument("--no-outliers", action="store_true", help="--quality-cpu: the plain miniature")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.quality_cpu:
        return quality_main(a)
    a.out = a.out or str(HERE / "results" / ("h200-convrot.json" if a.device == "cuda" else "convrot-smoke.json"))
    from bench.e2e_sampler import has_comfy
    return sampler_main(a) if has_comfy(a) else 2


if __name__ == "__main__":
    sys.exit(main())
