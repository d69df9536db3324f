"""LoRA after "Apply Fused INT8 GEMM": Flux.1 (full size, random weights) through ComfyUI 0.33.0's sampler with 0, 1 and 3
rank-32 LoRAs (random up / down on every linear of the blocks) loaded by ComfyUI's LoraLoaderModelOnly on the Apply
output: s/step per LoRA count (best of two timed samples, euler, cfg 1.0), and the wall time of changing one LoRA's
strength between two samples (a new LoraLoaderModelOnly output; target: no Apply re-run, well under 1 s), with the
number of weight quantizations during it (expected 0). Checks (non-fatal): the LoRA changes the output, the base model
after the LoRA runs gives its own first output again.

    BENCH_COMMIT=<sha> bash bench/h200.sh exec python bench/lora.py --comfy .carry/comfy
    python bench/lora.py --device cpu --tiny --backend torch_int_mm --steps 1   # CPU smoke (tests/test_bench_lora.py)
"""
from __future__ import annotations

import argparse
import atexit
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


def lora_file(folder: Path, name: str, sd: dict, rank: int, seed: int, device) -> None:
    """A rank-``rank`` LoRA in ComfyUI's key format for every 2-D block weight of ``sd``."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for k, w in sd.items():
        if w.dim() != 2 or not k.startswith(("double_blocks.", "single_blocks.")) or not k.endswith(".weight"):
            continue
        n, kk, p = w.shape[0], w.shape[1], f"diffusion_model.{k[:-len('.weight')]}"
        out[f"{p}.lora_down.weight"] = (torch.randn(rank, kk, generator=g, device=device) / kk ** 0.5).bfloat16().cpu()
        out[f"{p}.lora_up.weight"] = (torch.randn(n, rank, generator=g, device=device) * 0.02).bfloat16().cpu()
        out[f"{p}.alpha"] = torch.tensor(float(rank))
    save_file(out, str(folder / name))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", default=os.environ.get("COMFYUI_CURRENT"), help="ComfyUI 0.33.0 tree")
    ap.add_argument("--backend", default="fused_triton")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="shrunken Flux (smoke runs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(HERE / "results" / "h200-lora.json"))
    a = ap.parse_args()
    if not has_comfy(a):
        return 2
    dynamic = start(a)
    if dynamic is None:
        return 2
    import torch
    import comfy.sample
    import comfy.sd
    import folder_paths
    import nodes
    from bench import e2e_models
    from bench.lib import e2e
    from bench.lib import provenance
    pack = e2e.load_pack()
    dev = torch.device(a.device)
    cfg = e2e_models.unet_config("flux", a.tiny)
    sd, _ = e2e_models.random_state_dict("flux", cfg, dev if dev.type == "cuda" else torch.device("cpu"))
    folder = Path(tempfile.mkdtemp(prefix="int8_lora_"))
    atexit.register(shutil.rmtree, folder, True)
    folder_paths.add_model_folder_path("loras", str(folder))
    names = [f"r{i}.safetensors" for i in range(3)]
    for i, n in enumerate(names):
        lora_file(folder, n, sd, a.rank, 10 + i, dev if dev.type == "cuda" else torch.device("cpu"))
    model = comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": torch.bfloat16})
    del sd
    spec = e2e_models.MODELS["flux"][3](a.tiny)
    g = torch.Generator().manual_seed(7)
    pos = [[torch.randn(spec["text"], generator=g).bfloat16(),
            {"pooled_output": torch.randn(spec["pooled"], generator=g).bfloat16(), "guidance": spec["guidance"]}]]
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
    q = e2e.pack_apply(pack, model, a.backend)
    loader = nodes.LoraLoaderModelOnly()
    rows, outs, checks = [], {}, {}
    for count in (0, 1, 3):
        m = q
        for n in names[:count]:
            m = loader.load_lora_model_only(m, n, 1.0)[0]
        first, t_first = sample(m)
        times = [sample(m)[1] for _ in range(2)]
        outs[count] = first
        rows.append({"loras": count, "rank": a.rank, "first_sample_s": t_first, "samples_s": times,
                     "s_per_step": min(times) / a.steps})
        log(f"{count} LoRA: {min(times) / a.steps:.4f} s/step (first sample {t_first:.2f} s)")
    # strength change: a new loader output with another strength on the first LoRA, then a sample
    n_q = len(quantized)
    m1 = loader.load_lora_model_only(q, names[0], 1.0)[0]
    sample(m1)
    t0 = time.perf_counter()
    m2 = loader.load_lora_model_only(q, names[0], 0.5)[0]
    _, t_sample = sample(m2)
    wall = time.perf_counter() - t0
    same = min(next(r for r in rows if r["loras"] == 1)["samples_s"])
    change = {"wall_s": wall, "sample_s": t_sample, "overhead_s": wall - same, "quantizations": len(quantized) - n_q}
    log(f"strength change: {change['wall_s']:.3f} s wall for loader + sample ({change['overhead_s']:+.3f} s against "
        f"a sample of the unchanged LoRA), {change['quantizations']} quantizations")
    base, _ = sample(q)
    checks["lora_changes_output"] = bool((outs[1] - outs[0]).norm() > 1e-3 * outs[0].norm())
    checks["base_after_lora_same"] = bool(base.equal(outs[0]))
    checks["no_requantization"] = change["quantizations"] == 0
    log("checks:", checks)
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    doc = {"bench": "lora", "command": provenance.command(), "commit": provenance.commit(), "dirty": provenance.dirty(),
           "device": dev_name, "torch": torch.__version__, "dynamic_vram": dynamic, "backend": a.backend,
           "tiny": a.tiny, "steps": a.steps, "rows": rows, "strength_change": change, "checks": checks,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    log("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
