"""Every linear shape of the DiTs the pack targets, bf16 vs fp8_fast vs the pack's INT8 path vs the dispatched path
(issue 14 item 5: no shape slower than bf16).

    python3 bench/shapes.py [--out bench/results/h200-shapes.json] [--only REGEX] [--budget-s 170]

Run from the repository root on a CUDA GPU with torch + triton importable (no ComfyUI needed). Per shape
(random bf16 data; weight quantized per channel by ``Int8Linear.from_float``):

  bf16        F.linear(x, W_bf16, b) (the ratios' reference)
  bf16_module the same through an nn.Linear module call (a model's per-call module overhead; the summary also
              compares the dispatched path with it: no module call issues faster than nn.Linear's)
  fp8_fast    ComfyUI's fp8_e4m3fn_fast: x clamped to +-448 and cast to e4m3, W cast to e4m3, torch._scaled_mm
              with scales 1 (as bench/kernels.py and the performance reference)
  int8        the pack's ``Int8Linear`` (backend fused_triton) with INT8_FUSED_DISPATCH=int8: the W8A8 path as a
              model calls it (module overhead included)
  int8_kernel kernel.int8_linear alone (quantize kernel + GEMM, no module): the module's share of host time
  dispatched  the same layer with INT8_FUSED_DISPATCH=auto: its first call times int8 vs float for the shape
              (quant/dispatch.py) and every later call runs the winner

Timing (quant.dispatch.time_call, the metric the dispatch itself decides on): per call, CUDA events around the call
with L2 flushed before it (weights come from HBM, as in a model where every layer has its own) and the GPU held
busy while the host issues it (so the GPU time does not include waiting for the host), and the host
time to issue it; the call's cost is max(GPU, host) ("eff"). Medians over 3 rounds x 7 calls, paths interleaved.
ratio = bf16 eff / path eff (> 1: faster than bf16). Rows where a path is host-bound are also timed as
streams of back-to-back calls (``stream_us``: bf16, bf16_module, dispatched) and the summary compares those.
Must finish in < 3 min on an H200: shapes are run in the order below until ``--budget-s`` is spent (the rest
are listed as skipped). The first pass of a process includes Triton compiles and the GEMM autotune (cached in
INT8_FUSED_CACHE_DIR for the next run).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))
import pack_import  # noqa: E402
pack_import.install()  # kernel, quant, adapters: the pack's subpackages, imported one way (tests/pack_import.py)
import kernel  # noqa: E402
from bench.lib import provenance as provenance_  # noqa: E402
from bench.host_int8 import per_call_us as stream_us  # noqa: E402
from kernel import autotune, config  # noqa: E402
from quant import dispatch  # noqa: E402
from quant.linear import Int8Linear  # noqa: E402

E4M3_MAX = 448.0
ROUNDS, REPS = 3, 7
STREAM_PATHS = ("bf16", "bf16_module", "dispatched")  # timed as streams of calls where a path is host-bound
STREAM_CALLS, STREAM_ROUNDS = 200, 5

# (model, layer, M, N, K, bias). N = out_features, K = in_features (nn.Linear weight [N, K]).
SHAPES = [
    # odd shapes first (the ones issue 14 names)
    ("odd", "M77 prompt", 77, 4608, 4608, False),
    ("odd", "ragged", 1000, 3000, 1000, False),
    # Ideogram 4 (hidden 4608, FFN 12288, adaLN 512); 1024² cond M 4608 (512 text + 4096), uncond 4096, 768² 2816
    *[("ideogram4", f"{name} M{m}", m, n, k, False)
      for m in (4608, 4096, 2816)
      for name, n, k in (("qkv", 13824, 4608), ("o", 4608, 4608), ("w1/w3", 12288, 4608), ("w2", 4608, 12288))],
    ("ideogram4", "llm_cond_proj", 512, 4608, 53248, True),
    ("ideogram4", "input_proj", 4608, 4608, 128, True),
    ("ideogram4", "final_layer.linear", 4608, 128, 4608, True),
    ("ideogram4", "t_embedding.mlp", 1, 4608, 4608, True),
    ("ideogram4", "adaln_proj", 1, 512, 4608, True),
    ("ideogram4", "adaln_modulation", 1, 18432, 512, True),
    ("ideogram4", "final adaln_modulation", 1, 4608, 512, True),
    # Flux.1 (hidden 3072): double blocks img M 4096 / txt M 512, single blocks M 4608, modulation M 1
    *[("flux1", f"{stream} {name}", m, n, k, True)
      for stream, m in (("img", 4096), ("txt", 512))
      for name, n, k in (("qkv", 9216, 3072), ("proj", 3072, 3072), ("mlp.0", 12288, 3072), ("mlp.2", 3072, 12288))],
    ("flux1", "single linear1", 4608, 21504, 3072, True),
    ("flux1", "single linear2", 4608, 3072, 15360, True),
    ("flux1", "double modulation", 1, 18432, 3072, True),
    ("flux1", "single modulation", 1, 9216, 3072, True),
    # Z-Image (hidden 3840, FFN 10240), M 4096 image + ~256 text
    *[("z-image", name, 4352, n, k, False)
      for name, n, k in (("qkv", 11520, 3840), ("o", 3840, 3840), ("w1/w3", 10240, 3840), ("w2", 3840, 10240))],
    ("z-image", "adaLN", 1, 15360, 256, True),
    # SD3.5 Large (hidden 2432, MLP 9728): image stream M 4096, context stream M 333 (77 CLIP + 256 T5)
    ("sd3.5-l", "x qkv", 4096, 7296, 2432, True),
    ("sd3.5-l", "x proj", 4096, 2432, 2432, True),
    ("sd3.5-l", "x mlp.fc1", 4096, 9728, 2432, True),
    ("sd3.5-l", "x mlp.fc2", 4096, 2432, 9728, True),
    ("sd3.5-l", "context qkv", 333, 7296, 2432, True),
    ("sd3.5-l", "context mlp.fc2", 333, 2432, 9728, True),
    ("sd3.5-l", "adaLN", 1, 14592, 2432, True),
    # Wan 2.1 1.3B (dim 1536, FFN 8960) and 14B (dim 5120, FFN 13824): 480x832, 33 frames -> 30*52*9 = 14040
    # tokens; cross-attention k/v over 512 text tokens; time projection M 1
    *[(f"wan2.1-{size}", name, m, n, k, True)
      for size, d, f in (("1.3b", 1536, 8960), ("14b", 5120, 13824))
      for name, m, n, k in (("self q/k/v/o", 14040, d, d), ("ffn.0", 14040, f, d), ("ffn.2", 14040, d, f),
                            ("cross k/v (text)", 512, d, d), ("time_projection", 1, 6 * d, d))],
]
PATHS = ["bf16", "bf16_module", "fp8_fast", "int8", "int8_kernel", "dispatched"]


def provenance() -> dict:
    import triton
    props = torch.cuda.get_device_properties(0)
    return dict(gpu=props.name, sms=props.multi_processor_count, l2_mb=props.L2_cache_size >> 20,
                driver=provenance_.driver() or "?", torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, commit=provenance_.commit(), dirty=provenance_.dirty(),
                date=provenance_.now(), argv=[sys.executable, *sys.argv], cache_dir=str(autotune.cache_dir()),
                dispatch_margin=dispatch.MARGIN, rounds=ROUNDS, reps=REPS)


def make_paths(m, n, k, has_bias):
    dev = "cuda"
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device=dev, dtype=torch.bfloat16) if has_bias else None
    layer = Int8Linear.from_float(w, b, backend="fused_triton", name=f"bench {m}x{n}x{k}")
    wfast = w.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)

    def fp8_fast():
        q = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(q, wfast.t(), scale_a=one, scale_b=one, bias=b, out_dtype=torch.bfloat16)

    lin = torch.nn.Linear(k, n, bias=has_bias, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
        if has_bias:
            lin.bias.copy_(b)
    fns = dict(bf16=lambda: F.linear(x, w, b), bf16_module=lambda: lin(x), fp8_fast=fp8_fast, int8=lambda: layer(x),
               int8_kernel=lambda: kernel.int8_linear(x, layer.weight, layer.weight_scale, layer.bias),
               dispatched=lambda: layer(x))
    modes = dict(int8="int8", dispatched="auto")  # INT8_FUSED_DISPATCH while the path runs
    return fns, modes, x, w, b, layer


def check_small_m(log) -> int:
    """The one-launch M <= 16 kernel against quantize_per_token + int8_gemm on this GPU: bit-identical expected."""
    failures = 0
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    for m, n, k, smooth, bias in [(1, 18432, 512, False, True), (7, 4608, 4608, True, True), (16, 3072, 3072, True, False),
                                  (3, 3000, 1000, False, False)]:
        x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16) * 3
        if m > 2:
            x[1] = 0
        w = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8, generator=g)
        ws = torch.rand(n, device=dev, generator=g) * 1e-3
        b = torch.randn(n, device=dev, generator=g) if bias else None
        inv = (torch.rand(k, device=dev, generator=g) + 0.5) if smooth else None
        y = kernel.int8_linear(x, w, ws, b, inv)
        y = kernel.int8_linear(x, w, ws, b, inv)  # second call: the direct-launch path
        a_q, a_s = kernel.quantize_per_token(x, inv)
        ref = kernel.int8_gemm(a_q, a_s, w, ws, b, out_dtype=torch.bfloat16)
        ok = torch.equal(y, ref)
        failures += not ok
        diff = "" if ok else f" (max |diff| {(y.float() - ref.float()).abs().max().item():.3e})"
        log(f"check one-launch small-M M={m} N={n} K={k} smooth={smooth} bias={bias}: "
            + ("bit-identical to quantize + GEMM" if ok else "MISMATCH" + diff))
    return failures


def stream_row(fns, modes, ok, calls: int = STREAM_CALLS, rounds: int = STREAM_ROUNDS) -> dict:
    """``stream_us`` (bench/host_int8.py's ``per_call_us``: the wall time a call of ``calls`` back-to-back calls
    ended by one synchronize, max(host, GPU) with L2 warm across them) of STREAM_PATHS, rounds interleaved, medians.
    For host-bound rows, where per-call host samples of ~20-60 µs scatter by several µs between paths that run the
    same Python."""
    t = {p: [] for p in STREAM_PATHS if ok.get(p)}
    for _ in range(rounds):
        for p in t:
            with config.override(INT8_FUSED_DISPATCH=modes.get(p, "auto")):
                t[p].append(stream_us(fns[p], calls))
    return {p: round(statistics.median(v), 2) for p, v in t.items()}


def rel_err(y, x, w, b) -> float:
    ref = x.float() @ w.float().t() + (b.float() if b is not None else 0)
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200-shapes.json")
    ap.add_argument("--only", default=None, help="regex on 'model layer' (e.g. 'odd|ideogram4')")
    ap.add_argument("--stream-rounds", type=int, default=STREAM_ROUNDS, help="interleaved rounds of each stream")
    ap.add_argument("--budget-s", type=float, default=170.0, help="start no new shape after this many seconds")
    args = ap.parse_args()
    t_start = time.perf_counter()
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    if not torch.cuda.is_available():
        sys.exit("bench/shapes.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    prov = provenance()
    log(f"GPU {prov['gpu']} ({prov['sms']} SMs, L2 {prov['l2_mb']} MB), driver {prov['driver']}, torch {prov['torch']}, "
        f"triton {prov['triton']}, commit {prov['commit'][:12]}{' (dirty)' if prov['dirty'] else ''}; "
        f"cache {prov['cache_dir']}")
    prov["small_m_check_failures"] = check_small_m(log)
    shapes = [s for s in SHAPES if args.only is None or re.search(args.only, f"{s[0]} {s[1]}")]
    flush = dispatch.flush_buffer(torch.device("cuda", 0))
    rows, skipped = [], []
    log(f"{'model':12s} {'layer':24s} {'M':>6s} {'N':>6s} {'K':>6s}  " + "  ".join(f"{p:>11s}" for p in PATHS)
        + "   (eff us, x bf16)  picked")
    for model, name, m, n, k, has_bias in shapes:
        if time.perf_counter() - t_start > args.budget_s:
            skipped.append(f"{model} {name}")
            continue
        t_shape = time.perf_counter()
        row = dict(model=model, layer=name, M=m, N=n, K=k, bias=has_bias, paths={})
        try:
            fns, modes, x, w, b, layer = make_paths(m, n, k, has_bias)
        except torch.cuda.OutOfMemoryError as e:
            log(f"{model} {name}: out of memory ({e})")
            continue
        ok = {}
        for p in PATHS:  # warm-up (compile, GEMM autotune; for "dispatched" the int8-vs-float decision)
            try:
                with config.override(INT8_FUSED_DISPATCH=modes.get(p, "auto")):
                    t0 = time.perf_counter()
                    y = fns[p]()
                    torch.cuda.synchronize()
                    first_s = time.perf_counter() - t0
                ok[p] = True
                row["paths"][p] = dict(first_call_s=round(first_s, 4), rel_err=float(f"{rel_err(y, x, w, b):.3e}"))
            except Exception as e:  # noqa: BLE001 - e.g. _scaled_mm refusing K % 16 != 0: reported, not fatal
                row["paths"][p] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
        picked = layer.derived.paths.get((m, torch.bfloat16, x.device))
        entry = dispatch._device_cache(x.device).get(dispatch.shape_key(m, n, k, has_bias, torch.bfloat16))
        row["dispatch"] = dict(picked=picked, decision=entry)
        samples = {p: [] for p in ok}
        for _ in range(ROUNDS):
            for p in ok:
                with config.override(INT8_FUSED_DISPATCH=modes.get(p, "auto")):
                    samples[p].append(dispatch.time_call(fns[p], REPS, flush))
        flops = 2.0 * m * n * k
        for p in ok:
            gpu = statistics.median(g for g, _ in samples[p])
            host = statistics.median(h for _, h in samples[p])
            eff = dispatch.effective_ms(gpu, host)
            row["paths"][p].update(gpu_us=round(gpu * 1e3, 2), host_us=round(host * 1e3, 2), eff_us=round(eff * 1e3, 2),
                                   tops=round(flops / (eff * 1e-3) / 1e12, 1))
        ref = row["paths"].get("bf16", {})
        for p in ok:
            if ref.get("eff_us"):
                row["paths"][p]["x_bf16"] = round(ref["eff_us"] / row["paths"][p]["eff_us"], 3)
                row["paths"][p]["x_bf16_gpu"] = round(ref["gpu_us"] / max(row["paths"][p]["gpu_us"], 1e-3), 3)
        if any(row["paths"].get(p, {}).get("host_us", 0) > row["paths"].get(p, {}).get("gpu_us", 1e9)
               for p in STREAM_PATHS):
            row["stream_us"] = stream_row(fns, modes, ok, rounds=args.stream_rounds)
        row["calls"] = dict(layer.dispatch_calls)
        row["seconds"] = round(time.perf_counter() - t_shape, 2)
        rows.append(row)

        def cell(p):
            d = row["paths"].get(p, {})
            return f"{d['eff_us']:7.1f} {d['x_bf16']:4.2f}x" if "x_bf16" in d else f"{'-':>12s}"
        log(f"{model:12s} {name:24s} {m:6d} {n:6d} {k:6d}  " + " ".join(cell(p) for p in PATHS) + f"  {picked}")
        del fns, x, w, b, layer
        torch.cuda.empty_cache()

    def below(p):
        return [f"{r['model']} {r['layer']} ({r['paths'][p]['x_bf16']:.2f}x)" for r in rows
                if r["paths"].get(p, {}).get("x_bf16", 9) < 1.0]
    log("")
    for p in ("int8", "dispatched"):
        b = below(p)
        log(f"{p}: {len(rows) - len(b)}/{len(rows)} shapes >= 1.0x bf16 (eff)" + (f"; below: {', '.join(b)}" if b else ""))
    gpu_below = [f"{r['model']} {r['layer']} ({r['paths']['dispatched']['x_bf16_gpu']:.2f}x)" for r in rows
                 if r["paths"].get("dispatched", {}).get("x_bf16_gpu", 9) < 1.0]
    log(f"dispatched, GPU time only: {len(rows) - len(gpu_below)}/{len(rows)} shapes >= 1.0x bf16"
        + (f"; below: {', '.join(gpu_below)}" if gpu_below else ""))
    # against bf16 through an nn.Linear module call: a model's layers are modules, and no module call is cheaper on
    # the host than nn.Linear's, so this is the bar a host-bound shape can reach (bare F.linear's is below any module)
    mod_below = [f"{r['model']} {r['layer']} ({x:.2f}x)" for r in rows
                 for x in [r["paths"].get("bf16_module", {}).get("eff_us", 0) / r["paths"]["dispatched"]["eff_us"]]
                 if r["paths"].get("dispatched", {}).get("eff_us") and x < 1.0]
    for r in rows:
        d, mod = r["paths"].get("dispatched", {}), r["paths"].get("bf16_module", {})
        if d.get("eff_us") and mod.get("eff_us"):
            d["x_bf16_module"] = round(mod["eff_us"] / d["eff_us"], 3)
    log(f"dispatched vs bf16 as an nn.Linear module call: {len(rows) - len(mod_below)}/{len(rows)} shapes >= 1.0x"
        + (f"; below: {', '.join(mod_below)}" if mod_below else ""))
    streamed = [r for r in rows if len(r.get("stream_us", {})) == len(STREAM_PATHS)]
    for r in streamed:
        st = r["stream_us"]
        st["x_bf16_module"] = round(st["bf16_module"] / st["dispatched"], 3)
        st["x_bf16"] = round(st["bf16"] / st["dispatched"], 3)
    st_below = [f"{r['model']} {r['layer']} ({r['stream_us']['x_bf16_module']:.2f}x)" for r in streamed
                if r["stream_us"]["x_bf16_module"] < 1.0]
    each = ", ".join(f"{r['model']} {r['layer']} {r['stream_us']['dispatched']:.1f} vs "
                     f"{r['stream_us']['bf16_module']:.1f} (bare F.linear {r['stream_us']['bf16']:.1f}) us"
                     for r in streamed)
    log(f"host-bound shapes as a stream of {STREAM_CALLS} calls (median of {args.stream_rounds}): dispatched vs an "
        f"nn.Linear module call {len(streamed) - len(st_below)}/{len(streamed)} >= 1.0x"
        + (f"; below: {', '.join(st_below)}" if st_below else "") + f"; {each}")
    picked = [r["dispatch"]["picked"] for r in rows]
    log(f"dispatch picked int8 for {picked.count('int8')} shapes, float for {picked.count('float')}: "
        + ", ".join(f"{r['model']} {r['layer']}" for r in rows if r["dispatch"]["picked"] == "float"))
    if skipped:
        log(f"skipped (time budget {args.budget_s:.0f} s): {', '.join(skipped)}")
    total = time.perf_counter() - t_start
    log(f"total {total:.1f} s")
    out = dict(provenance=prov, rows=rows, skipped=skipped, seconds=round(total, 1),
               autotune={key: [[c, ms] for c, ms in v] for key, v in autotune.TIMINGS.items()})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    Path(args.out).with_suffix(".log").write_text("\n".join(lines) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
