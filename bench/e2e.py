"""End-to-end Ideogram 4 denoising step through a current ComfyUI (issues 4 and 8).

Builds the full-size Ideogram 4 backbone (34 layers, hidden 4608, random weights) through
``comfy.sd.load_diffusion_model_state_dict`` — the same path a UNETLoader takes — once per path, and
times one step = one conditional pass ([text, image] tokens) + one image-only unconditional pass, the
reference CFG of ``DualModelGuider`` with ``negative`` unconnected. Paths:

  bf16          the float model
  fp8_fast      UNETLoader weight_dtype ``fp8_e4m3fn_fast`` (fp8 weights, ``torch._scaled_mm``)
  core_int8     ComfyUI core ``int8_tensorwise`` checkpoint layout (comfy-kitchen ``int8_linear``)
  pack:<name>   the bf16 model patched by this pack's "Apply Fused INT8 GEMM" node with backend <name>
  nofuse:<name> the same with the block fusions off (INT8_FUSED_FUSION=0): the plain per-linear path
  compile:<name> pack:<name> under torch.compile (default mode)

Output: a table, and JSON rows {resolution, path, s_per_step, peak_gib, max_abs_diff_vs_bf16} written
to --out. Needs a CUDA GPU and a ComfyUI checkout with ``comfy/ldm/ideogram4`` (--comfy or
$COMFYUI_CURRENT). Run: ``python bench/e2e.py --comfy /path/to/ComfyUI --out e2e.json``.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HIDDEN, FFN, HEADS, ADALN, TEXT_DIM, IN_CH = 4608, 12288, 18, 512, 53248, 128
BLOCK_LINEARS = ["attention.qkv", "attention.o", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]


def log(*a):
    print(f"[e2e {time.strftime('%H:%M:%S')}]", *a, flush=True)


# ----------------------------------------------------------------------------- model construction
def ideogram4_shapes(layers: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Key -> (shape, is_linear_weight) of one Ideogram 4 backbone (ComfyUI key names)."""
    s: dict[str, tuple[tuple[int, ...], bool]] = {}

    def lin(p, i, o, bias=True):
        s[f"{p}.weight"] = ((o, i), True)
        if bias:
            s[f"{p}.bias"] = ((o,), False)

    lin("input_proj", IN_CH, HIDDEN)
    s["llm_cond_norm.weight"] = ((TEXT_DIM,), False)
    lin("llm_cond_proj", TEXT_DIM, HIDDEN)
    lin("t_embedding.mlp_in", HIDDEN, HIDDEN)
    lin("t_embedding.mlp_out", HIDDEN, HIDDEN)
    lin("adaln_proj", HIDDEN, ADALN)
    s["embed_image_indicator.weight"] = ((2, HIDDEN), False)
    for i in range(layers):
        p = f"layers.{i}"
        lin(f"{p}.attention.qkv", HIDDEN, 3 * HIDDEN, bias=False)
        lin(f"{p}.attention.o", HIDDEN, HIDDEN, bias=False)
        s[f"{p}.attention.norm_q.weight"] = ((HIDDEN // HEADS,), False)
        s[f"{p}.attention.norm_k.weight"] = ((HIDDEN // HEADS,), False)
        lin(f"{p}.feed_forward.w1", HIDDEN, FFN, bias=False)
        lin(f"{p}.feed_forward.w3", HIDDEN, FFN, bias=False)
        lin(f"{p}.feed_forward.w2", FFN, HIDDEN, bias=False)
        for n in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
            s[f"{p}.{n}.weight"] = ((HIDDEN,), False)
        lin(f"{p}.adaln_modulation", ADALN, 4 * HIDDEN)
    lin("final_layer.linear", HIDDEN, IN_CH)
    lin("final_layer.adaln_modulation", ADALN, HIDDEN)
    return s


def random_state_dict(layers: int, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random bf16 weights: N(0, 1/in) linears (unit-gain), norms near 1, small biases."""
    g = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for k, (shape, is_w) in ideogram4_shapes(layers).items():
        if is_w:
            t = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16) * (shape[1] ** -0.5)
        elif k.endswith("norm_q.weight") or k.endswith("norm_k.weight") or "norm" in k:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        else:
            t = 0.02 * torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        sd[k] = t.to("cpu")
    return sd


def core_int8_state_dict(sd: dict[str, torch.Tensor], device, linear=None) -> dict[str, torch.Tensor]:
    """``sd`` with the linears ``linear(name, weight)`` picks (default: Ideogram 4's block linears) in ComfyUI core's
    ``int8_tensorwise`` layout (int8 weight, per-output-channel ``weight_scale`` = absmax / 127, ``comfy_quant``),
    quantized on ``device`` and returned on the CPU."""
    if linear is None:
        linear = lambda p, w: any(p.endswith(n) for n in BLOCK_LINEARS)  # noqa: E731
    conf = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
    out = {}
    for k, v in sd.items():
        p = k[: -len(".weight")]
        if k.endswith(".weight") and linear(p, v):
            w = v.to(device).float()
            scale = w.abs().amax(1).clamp(min=1e-12) / 127.0
            out[k] = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8).cpu()
            out[f"{p}.weight_scale"] = scale.cpu()
            out[f"{p}.comfy_quant"] = conf.clone()
        else:
            out[k] = v
    return out


def load_pack():
    """Import this repository as the ComfyUI custom-node package ``comfyui_int8_fused``."""
    spec = importlib.util.spec_from_file_location("comfyui_int8_fused", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def pack_apply(pack, patcher, backend: str, **inputs):
    """Run the pack's "Apply Fused INT8 GEMM" node on ``patcher`` with its default settings (``inputs``
    override named inputs, e.g. ``attention="cudnn"``)."""
    cls = pack.NODE_CLASS_MAPPINGS["ApplyFusedInt8GEMM"]
    spec = cls.INPUT_TYPES()
    kw = {}
    for name, (typ, *opt) in spec["required"].items():
        if name == "model":
            continue
        if isinstance(typ, list):
            kw[name] = (opt[0] if opt else {}).get("default", typ[0])
        else:
            kw[name] = (opt[0] if opt else {}).get("default")
    kw["backend"] = backend
    kw.update(inputs)
    hidden = {k: "e2e" for k in spec.get("hidden", {})}
    out = getattr(cls(), cls.FUNCTION)(model=patcher, **kw, **hidden)
    return out[0] if isinstance(out, tuple) else out["result"][0]


# ----------------------------------------------------------------------------- timing
def step_inputs(res: int, text_tokens: int, device, dtype=torch.bfloat16, seed: int = 1):
    g = torch.Generator(device=device).manual_seed(seed)
    gh = gw = res // 16
    x = torch.randn(1, IN_CH, gh, gw, generator=g, device=device).to(dtype)
    ctx = torch.randn(1, text_tokens, TEXT_DIM, generator=g, device=device).to(dtype)
    t = torch.full((1,), 0.6, device=device)
    return x, ctx, t


class _Clock:
    """CUDA events on a GPU (no sync inside the timed region), perf_counter on the CPU (smoke runs)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self, a, b):
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def time_step(dm, inputs, warmup: int, iters: int):
    """Median seconds of cond pass, uncond pass and their sum; plus the cond output."""
    x, ctx, t = inputs
    clock = _Clock(x.device)
    with torch.inference_mode():
        for _ in range(warmup):
            dm(x, t, context=ctx)
            dm(x, t, context=None)
        clock.sync()
        conds, unconds, steps = [], [], []
        for _ in range(iters):
            e0 = clock.mark()
            dm(x, t, context=ctx)
            e1 = clock.mark()
            dm(x, t, context=None)
            e2 = clock.mark()
            clock.sync()
            conds.append(clock.seconds(e0, e1))
            unconds.append(clock.seconds(e1, e2))
            steps.append(clock.seconds(e0, e2))
        out = dm(x, t, context=ctx).float()
        clock.sync()
    return statistics.median(conds), statistics.median(unconds), statistics.median(steps), out


def profile_step(dm, inputs, name: str) -> list[dict]:
    """One profiled step; prints the top device kernels and returns them as rows (ms per step)."""
    from torch.profiler import ProfilerActivity, profile
    x, ctx, t = inputs
    with torch.inference_mode():
        dm(x, t, context=ctx)
        dm(x, t, context=None)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dm(x, t, context=ctx)
            dm(x, t, context=None)
            torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dev_us > 0:
            rows.append({"kernel": ev.key[:120], "ms": dev_us / 1e3, "calls": ev.count})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    print(f"\nprofile of one step, {name}: {total:.1f} ms of device time")
    for r in rows[:30]:
        print(f"  {r['ms']:8.2f} ms {100 * r['ms'] / total:5.1f}% x{r['calls']:<5} {r['kernel']}")
    return rows


def print_table(rows: list[dict]) -> None:
    ref_s = {r["resolution"]: r["s_per_step"] for r in rows if r["path"] == "bf16" and "s_per_step" in r}
    print(f"\n{'res':>5} {'path':<28} {'s/step':>8} {'x bf16':>7} {'peak GiB':>9} {'max|d|':>9} {'rel l2':>8}")
    for r in rows:
        if "s_per_step" not in r:
            print(f"{r['resolution']:>5} {r['path']:<28} {r['error']}")
            continue
        sp = ref_s.get(r["resolution"], float("nan")) / r["s_per_step"]
        d = r["max_abs_diff_vs_bf16"]
        print(f"{r['resolution']:>5} {r['path']:<28} {r['s_per_step']:8.4f} {sp:7.2f} {r['peak_gib']:9.1f} "
              f"{d if d is None else round(d, 4)!s:>9} {r['rel_l2_vs_bf16'] or 0:8.4f}")


def provenance(dev) -> dict:
    """GPU, driver, date, torch / Triton versions and commit ($BENCH_COMMIT, else git) of a bench run."""
    # by file: bench/ may not be importable as a package here, and the pack's root must not shadow ComfyUI's modules
    spec = importlib.util.spec_from_file_location("bench_provenance", HERE / "provenance.py")
    prov = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prov)
    commit = prov.commit(short=True)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    driver = None
    if dev.type == "cuda":
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke run)", "driver": driver,
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton_version,
            "commit": commit}


def write_results(a, dev, rows: list[dict], profiles: dict) -> None:
    """Write the JSON document (called after every path, so a cut-short run keeps what it measured)."""
    doc = dict(provenance(dev), command=" ".join([Path(sys.executable).name] + sys.argv), rows=rows)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    if profiles:
        Path(a.out).with_name(Path(a.out).stem + "-profile.json").write_text(json.dumps(profiles, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", default=os.environ.get("COMFYUI_CURRENT"), help="ComfyUI checkout with Ideogram 4")
    ap.add_argument("--layers", type=int, default=34)
    ap.add_argument("--res", default="1024,768", help="comma-separated square resolutions")
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--paths", default="bf16,fp8_fast,core_int8,pack:fused_triton,pack:torch_int_mm,"
                                        "pack:dequant_bf16,pack:fp8_rowwise")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", default="", help="comma-separated paths to profile at the first --res")
    ap.add_argument("--device", default="cuda", help="cuda (benchmark) or cpu (smoke run, tiny --res)")
    ap.add_argument("--out", default=str(HERE / "results" / "h200-e2e.json"))
    a = ap.parse_args()
    if not a.comfy or not (Path(a.comfy) / "comfy" / "ldm" / "ideogram4").is_dir():
        print("bench/e2e.py needs a ComfyUI checkout with comfy/ldm/ideogram4: pass --comfy or set COMFYUI_CURRENT")
        return 2
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench/e2e.py needs a CUDA GPU (or --device cpu for a smoke run of the code path)")
        return 2
    sys.path.insert(0, a.comfy)
    import comfy.cli_args
    if dev.type == "cpu":
        comfy.cli_args.args.cpu = True
    import comfy.model_management as mm
    import comfy.sd
    pack = load_pack()
    pack_cache = importlib.import_module(pack.__name__ + ".quant.cached_linear")
    resolutions = [int(r) for r in a.res.split(",")]
    paths = a.paths.split(",")
    rows, ref_out, profiles = [], {}, {}
    base_sd = random_state_dict(a.layers, dev)  # on the CPU, so it is not counted in GPU peaks
    base = None  # the bf16 ModelPatcher, shared by the bf16 path and every pack: path (they clone it)
    for path in paths:
        log(f"building {path}")
        if path == "core_int8":
            patcher = comfy.sd.load_diffusion_model_state_dict(core_int8_state_dict(base_sd, dev),
                                                               disable_dynamic=True)
        elif path == "fp8_fast":
            patcher = comfy.sd.load_diffusion_model_state_dict(
                dict(base_sd), model_options={"dtype": torch.float8_e4m3fn, "fp8_optimizations": True},
                disable_dynamic=True)
        else:
            if base is None:
                base = comfy.sd.load_diffusion_model_state_dict(dict(base_sd), disable_dynamic=True)
            patcher = base
        kind, _, backend = path.partition(":")
        if kind in ("pack", "compile", "nofuse"):
            t0 = time.perf_counter()
            cfg = importlib.import_module(pack.__name__ + ".kernel.config")  # switches are read once
            with cfg.override(INT8_FUSED_FUSION=kind != "nofuse"):
                patcher = pack_apply(pack, base, backend)
            log(f"{path}: Apply node took {time.perf_counter() - t0:.1f} s")
        mm.load_models_gpu([patcher], force_full_load=True)
        dm = patcher.model.diffusion_model
        variants = [(path, torch.compile(dm) if kind == "compile" else dm)]
        for name, fn in variants:
            for res in resolutions:
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                inputs = step_inputs(res, a.text_tokens, dev, patcher.model.get_dtype_inference())
                try:
                    # the fused llm_cond_proj cache is keyed per prompt (ComfyUI's cond uuids when sampling)
                    with pack_cache.bind_caches(dm, f"bench-{res}"):
                        c, u, s, out = time_step(fn, inputs, a.warmup, a.iters)
                except Exception as e:  # a path that cannot run here is reported, not hidden
                    log(f"{name} @ {res}: FAILED {type(e).__name__}: {e}")
                    rows.append({"resolution": res, "path": name, "error": f"{type(e).__name__}: {e}"})
                    continue
                peak = torch.cuda.max_memory_allocated() / 2 ** 30 if dev.type == "cuda" else 0.0
                if name == "bf16":
                    ref_out[res] = out
                diff = float((out - ref_out[res]).abs().max()) if res in ref_out else None
                rel = float((out - ref_out[res]).norm() / ref_out[res].norm()) if res in ref_out else None
                if name in a.profile.split(",") and res == resolutions[0] and dev.type == "cuda":
                    profiles[name] = profile_step(fn, inputs, name)
                rows.append({"resolution": res, "path": name, "s_per_step": s, "cond_s": c, "uncond_s": u,
                             "peak_gib": peak, "max_abs_diff_vs_bf16": diff, "rel_l2_vs_bf16": rel})
                log(f"{name} @ {res}: step {s*1e3:.1f} ms (cond {c*1e3:.1f} + uncond {u*1e3:.1f}), "
                    f"peak {peak:.1f} GiB, max|diff| {diff}, rel {rel}")
        mm.unload_all_models()
        del patcher, dm, variants, fn
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        write_results(a, dev, rows, profiles)
    write_results(a, dev, rows, profiles)
    print_table(rows)
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
