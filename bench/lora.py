"""LoRA after "Apply Fused INT8 GEMM" (issue 50): full-size models (random weights) through ComfyUI 0.33.0's sampler
with 0, 1 and 3 rank-32 LoRAs (random up / down on every 2-D weight of the repeated blocks, bench/e2e_models.py's
``BLOCKS``) loaded by ComfyUI's LoraLoaderModelOnly on the Apply output: s/step per LoRA count (best of two timed
whole samples / steps, euler, cfg 1.0) and its ratio to the step without a LoRA (targets on the H200: one LoRA
<= 1.10x, three <= 1.20x), the wall time of changing one LoRA's strength between two samples (no Apply re-run), with
the number of weight quantizations during it (expected 0). Checks (non-fatal): the LoRA changes the output, the base
model after the LoRA runs gives its own first output again, nothing quantized again.

    BENCH_COMMIT=<sha> bash bench/h200.sh exec python3 bench/lora.py --comfy .carry/comfy --models flux,wan13 \
        --out $OUT/h200-lora.json
    python bench/lora.py --device cpu --tiny --backend torch_int_mm --steps 1 --rank 4   # CPU smoke
"""
from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # bench.lib; appended, so the pack's root (its nodes/) never shadows ComfyUI's modules
from bench.e2e_sampler import has_comfy, start  # noqa: E402  (no torch / ComfyUI at import)
from bench.lib.e2e_runs import logger  # noqa: E402

log = logger("lora")
COUNTS = (0, 1, 3)
TARGETS = {1: 1.10, 3: 1.20}  # s/step with that many LoRAs over the step without (issue 50, H200)


def lora_file(folder: Path, name: str, sd: dict, prefixes: tuple, rank: int, seed: int, device) -> int:
    """A rank-``rank`` LoRA in ComfyUI's key format for every 2-D weight of ``sd`` under ``prefixes``; the number
    of layers it covers."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for k, w in sd.items():
        if w.dim() != 2 or not k.startswith(prefixes) or not k.endswith(".weight"):
            continue
        n, kk, p = w.shape[0], w.shape[1], f"diffusion_model.{k[:-len('.weight')]}"
        out[f"{p}.lora_down.weight"] = (torch.randn(rank, kk, generator=g, device=device) / kk ** 0.5).bfloat16().cpu()
        out[f"{p}.lora_up.weight"] = (torch.randn(n, rank, generator=g, device=device) * 0.02).bfloat16().cpu()
        out[f"{p}.alpha"] = torch.tensor(float(rank))
    save_file(out, str(folder / name))
    return len(out) // 3


@contextlib.contextmanager
def lora_paths(pack):
    """Counts, inside, how the INT8 layers' LoRAs ran: ``epilogue`` (``Int8Linear.gemm_lora_call``: in the GEMM),
    ``pair_codes`` (``Branches.add_quantized``: the GEMM pair on the int8 input), ``pair_float`` (``Branches.add``:
    a module call's pair on the float input)."""
    counts = collections.Counter()
    br, lin = pack.quant.lora.Branches, pack.quant.linear.Int8Linear
    saved = [(br, "add_quantized", "pair_codes"), (br, "add", "pair_float"), (lin, "gemm_lora_call", "epilogue")]
    originals = [getattr(c, n) for c, n, _ in saved]
    for (cls, name, label), f in zip(saved, originals):
        setattr(cls, name, lambda self, *x, _f=f, _l=label: counts.update([_l]) or _f(self, *x))
    try:
        yield counts
    finally:
        for (cls, name, _), f in zip(saved, originals):
            setattr(cls, name, f)


def profiled(run, steps: int, top: int = 15) -> dict:
    """One ``run()`` (a whole sample) under torch.profiler: GPU kernel time a step and the ``top`` kernels by
    total time ({name, ms_per_step, calls_per_step})."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in rows) / 1e3 / steps
    rows.sort(key=lambda e: -e.self_device_time_total)
    return {"gpu_ms_per_step": total,
            "top": [{"name": e.key[:90], "ms_per_step": e.self_device_time_total / 1e3 / steps,
                     "calls_per_step": e.count / steps} for e in rows[:top]]}


def run_model(a, name: str, pack, dev, folder: Path) -> dict:
    import torch
    import comfy.sample
    import comfy.sd
    import nodes
    from bench import e2e_models
    from bench.lib import e2e
    cfg = e2e_models.unet_config(name, a.tiny)
    gen = dev if dev.type == "cuda" else torch.device("cpu")
    sd, _ = e2e_models.random_state_dict(name, cfg, gen)
    names = [f"{name}-r{i}.safetensors" for i in range(max(COUNTS))]
    layers = [lora_file(folder, n, sd, e2e_models.BLOCKS[name], a.rank, 10 + i, gen) for i, n in enumerate(names)]
    model = comfy.sd.load_diffusion_model_state_dict(sd, {})
    del sd
    spec = dict(e2e_models.MODELS[name][3](a.tiny))
    g = torch.Generator().manual_seed(7)
    extra = {}
    ctx = torch.randn(spec["text"], generator=g).bfloat16()
    if "pooled" in spec:
        extra["pooled_output"] = torch.randn(spec["pooled"], generator=g).bfloat16()
    if "guidance" in spec:
        extra["guidance"] = spec["guidance"]
    pos = [[ctx, extra]]
    latent = torch.zeros(spec["latent"])
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(3))

    def sample(m):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = comfy.sample.sample(m, noise, a.steps, 1.0, "euler", "simple", pos, pos, latent, seed=0,
                                  disable_pbar=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return out.float(), time.perf_counter() - t0

    quantized = []
    real = pack.quant.linear.quantize_weight_per_channel
    pack.quant.linear.quantize_weight_per_channel = lambda *x, **k: quantized.append(1) or real(*x, **k)
    try:
        q = e2e.pack_apply(pack, model, a.backend)
        loader = nodes.LoraLoaderModelOnly()
        rows, outs, checks = [], {}, {}
        for count in COUNTS:
            m = q
            for n in names[:count]:
                m = loader.load_lora_model_only(m, n, 1.0)[0]
            first, t_first = sample(m)
            times = [sample(m)[1] for _ in range(2)]
            outs[count] = first
            rows.append({"loras": count, "rank": a.rank, "layers": layers[0] if count else 0,
                         "first_sample_s": t_first, "samples_s": times, "s_per_step": min(times) / a.steps})
            with lora_paths(pack) as paths:
                sample(m)
            rows[-1]["lora_paths_per_sample"] = dict(paths)
            if a.profile and dev.type == "cuda":
                rows[-1]["gpu_kernels"] = profiled(lambda: sample(m), a.steps)
            if dev.type == "cuda":
                rows[-1]["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2 ** 30
            log(f"{name} {count} LoRA: {min(times) / a.steps:.4f} s/step (first sample {t_first:.2f} s)")
        base_step = rows[0]["s_per_step"]
        for r in rows[1:]:
            r["x_no_lora"] = r["s_per_step"] / base_step
            r["target_x_no_lora"] = TARGETS.get(r["loras"])
            r["meets_target"] = r["target_x_no_lora"] is None or r["x_no_lora"] <= r["target_x_no_lora"]
        # strength change: a new loader output with another strength on the first LoRA, then a sample
        n_q = len(quantized)
        m1 = loader.load_lora_model_only(q, names[0], 1.0)[0]
        sample(m1)
        t0 = time.perf_counter()
        m2 = loader.load_lora_model_only(q, names[0], 0.5)[0]
        _, t_sample = sample(m2)
        wall = time.perf_counter() - t0
        same = min(next(r for r in rows if r["loras"] == 1)["samples_s"])
        change = {"wall_s": wall, "sample_s": t_sample, "overhead_s": wall - same,
                  "quantizations": len(quantized) - n_q}
        log(f"{name} strength change: {change['wall_s']:.3f} s wall for loader + sample ({change['overhead_s']:+.3f} s "
            f"against a sample of the unchanged LoRA), {change['quantizations']} quantizations")
        base, _ = sample(q)
        checks["lora_changes_output"] = bool((outs[1] - outs[0]).norm() > 1e-3 * outs[0].norm())
        checks["base_after_lora_same"] = bool(base.equal(outs[0]))
        checks["no_requantization"] = change["quantizations"] == 0
        log(f"{name} checks:", checks)
    finally:
        pack.quant.linear.quantize_weight_per_channel = real
    import comfy.model_management as mm
    mm.unload_all_models()
    mm.soft_empty_cache()
    return {"model": name, "compute_dtype": str(model.model.get_dtype_inference()).replace("torch.", ""),
            "rows": rows, "strength_change": change, "checks": checks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", default=os.environ.get("COMFYUI_CURRENT"), help="ComfyUI 0.33.0 tree")
    ap.add_argument("--models", default="flux", help="comma-separated bench/e2e_models.py models (default flux)")
    ap.add_argument("--backend", default="fused_triton")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="shrunken models (smoke runs)")
    ap.add_argument("--lora-step", type=int, default=0,
                    help="the widest rank step of the GEMM epilogue's LoRA (kernel.gemm.LORA_STEP_MAX; 0: its default)")
    ap.add_argument("--down-rows", type=int, default=0,
                    help="rows a program of the LoRA down-projection (kernel.lora.LORA_DOWN_BM; 0: its default)")
    ap.add_argument("--profile", action="store_true",
                    help="also one sample of each row under torch.profiler: GPU time a step, its top kernels")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(HERE / "results" / "h200-lora.json"))
    a = ap.parse_args()
    if not has_comfy(a):
        return 2
    dynamic = start(a)
    if dynamic is None:
        return 2
    import torch
    import folder_paths
    from bench.lib import e2e
    from bench.lib import provenance
    pack = e2e.load_pack()
    import importlib
    kg, kl = (importlib.import_module(f"{pack.kernel.__name__}.{m}") for m in ("gemm", "lora"))
    if a.lora_step:
        kg.LORA_STEP_MAX = a.lora_step
    if a.down_rows:
        kl.LORA_DOWN_BM = a.down_rows
    dev = torch.device(a.device)
    folder = Path(tempfile.mkdtemp(prefix="int8_lora_"))
    atexit.register(shutil.rmtree, folder, True)
    folder_paths.add_model_folder_path("loras", str(folder))
    models = [run_model(a, m, pack, dev, folder) for m in a.models.split(",")]
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    doc = {"bench": "lora", "command": provenance.command(), "commit": provenance.commit(), "dirty": provenance.dirty(),
           "device": dev_name, "torch": torch.__version__, "dynamic_vram": dynamic, "backend": a.backend,
           "tiny": a.tiny, "steps": a.steps, "lora_step_max": kg.LORA_STEP_MAX, "lora_down_rows": kl.LORA_DOWN_BM,
           "models": models, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    log("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
