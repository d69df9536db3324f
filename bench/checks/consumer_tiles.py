"""The consumer GPUs' INT8 tile set run in silicon on the H200 (issue 36 item 2).

    python bench/checks/consumer_tiles.py [--capability 8.9] [--out bench/results/h200-consumer-tiles.json]
                                          [--only REGEX] [--wgmma] [--budget-s 420]
    TRITON_INTERPRET=1 python bench/checks/consumer_tiles.py --cpu-smoke --out /tmp/x.json
        (tests/test_consumer_tiles.py)

Ampere, Ada and consumer Blackwell (sm_80 / 86 / 89 / 120) get ``autotune.ampere_configs`` (with the small- and
medium-M tiles), filtered by their shared memory (``autotune.SMEM_OPTIN``: sm_86, sm_89 and sm_120 offer the same set),
and no s8 wgmma tiles; their row kernels run the same plans as the H200's (the plans are module data, the same on
every GPU). This bench makes the H200 choose and run exactly that: the GEMMs pick their tile under
``kernel.gemm.forced_generation(capability)`` (a bench hook, not a user switch: the autotune times that generation's
candidates here, in a fresh autotune folder), and with ``DISABLE_MMA_V3=1`` (Triton's switch, default here; ``--wgmma``
leaves it) every dot is built as mma.sync, the instruction those GPUs run, instead of Hopper's wgmma (a fresh Triton
cache: that switch is not part of Triton's cache key). The PTX of every GEMM built is read back and its instruction
recorded.

Per shape (every linear of the Ideogram 4, Flux.1, Z-Image, Wan 2.1 1.3B / 14B and Qwen-Image blocks, then ragged M
1 / 77 / 333 / 4097): the int32 accumulator of ``kernel.int8_gemm`` (the tile the pick chose) against
``torch._int_mm``, bit for bit; the bf16 output of ``kernel.int8_linear`` against the dequantized ``torch._int_mm``
in float64 (``bf16_max_err_ulps``: in bf16 ulps of the larger of product and bias; one rounding: at most 1); and
do_bench medians (L2 flushed) of bf16 ``F.linear``, the INT8 linear (quantize + GEMM) and the INT8 GEMM alone. Then
every tile of the set, run explicitly on the ragged shapes, int32 against ``torch._int_mm``. Rows are H200 timings
of the consumer tiles, not a consumer GPU's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))
import pack_import  # noqa: E402
pack_import.install()  # kernel, quant, adapters: the pack's subpackages, imported one way (tests/pack_import.py)

# (model, layer, M, N, K, bias): N = out_features, K = in_features
QWEN = [("qwen-image", f"{s} {name}", m, n, k, True)
        for s, m in (("img", 4096), ("txt", 256))
        for name, n, k in (("to_q / to_k / to_v", 3072, 3072), ("to_out", 3072, 3072), ("mlp.0", 12288, 3072),
                           ("mlp.2", 3072, 12288))] + [("qwen-image", "img_mod / txt_mod", 1, 18432, 3072, True)]
MODELS = ("ideogram4", "flux1", "z-image", "wan2.1-1.3b", "wan2.1-14b")
RAGGED = [("ragged", f"M{m} {n}x{k}", m, n, k, True) for m in (1, 77, 333, 4097)
          for n, k in ((4608, 4608), (3072, 12288))]
SMOKE = [("smoke", f"M{m}", m, 96, 80, True) for m in (1, 3, 33, 200)]


def block_shapes() -> list[tuple]:
    """Every linear shape of the models' blocks (bench/shapes.py's list, Qwen-Image's added), then ragged M."""
    from bench.shapes import SHAPES
    return [s for s in SHAPES if s[0] in MODELS] + QWEN + RAGGED


def int_mm(a_q, w_q):
    """``a_q @ w_q.T`` in int32: ``torch._int_mm`` on CUDA (rows padded to 32: it takes more than 16), int64 on CPU."""
    import torch
    m = a_q.shape[0]
    if a_q.is_cuda:
        pad = max(0, 32 - m)
        a = torch.nn.functional.pad(a_q, (0, 0, 0, pad)) if pad else a_q
        return torch._int_mm(a, w_q.t())[:m]
    return (a_q.long() @ w_q.long().t()).to(torch.int32)


def shape_row(shape, capability, dev, timed: bool) -> dict:
    import torch
    import torch.nn.functional as F

    import kernel
    from kernel import gemm
    from quant.quantize import quantize_weight_per_channel
    model, layer, m, n, k, has_bias = shape
    g = torch.Generator(device="cpu").manual_seed(m * 7 + n * 3 + k)
    x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dev, torch.bfloat16)
    b = torch.randn(n, generator=g).to(dev, torch.bfloat16) if has_bias else None
    w_q, w_s = quantize_weight_per_channel(w)
    row = {"model": model, "layer": layer, "M": m, "N": n, "K": k}
    with gemm.forced_generation(capability):
        a_q, a_s = kernel.quantize_per_token(x)
        acc = kernel.int8_gemm(a_q, a_s, w_q, w_s, out_int32=True)
        y = kernel.int8_linear(x, w_q, w_s, b)
        row["gemm_tile"] = _tile_text(gemm.select_config(a_q, a_s, w_q, w_s, b, y))
        ref = int_mm(a_q, w_q)
        row["int32_exact"] = bool(torch.equal(acc, ref))
        prod = ref.double() * a_s.double()[:, None] * w_s.double().reshape(-1)[None, :]
        bias = b.double()[None, :] if b is not None else torch.zeros_like(prod)
        # the epilogue rounds once to bf16 (and fp32 on the way): within a bf16 step of its larger summand
        scale = torch.maximum(prod.abs(), bias.abs()).clamp_min(2 ** -126) * 2 ** -7
        row["bf16_max_err_ulps"] = round(float(((y.double() - (prod + bias)).abs() / scale).max()), 3)
        if timed:
            import triton
            ms = {}
            for name, fn in (("bf16", lambda: F.linear(x, w, b)),
                             ("int8_linear", lambda: kernel.int8_linear(x, w_q, w_s, b)),
                             ("int8_gemm", lambda: kernel.int8_gemm(a_q, a_s, w_q, w_s, b))):
                ms[name] = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
            row["us"] = {p: round(v * 1e3, 2) for p, v in ms.items()}
            row["x_bf16"] = {p: round(ms["bf16"] / v, 3) for p, v in ms.items() if p != "bf16"}
    return row


def _tile_text(cfg: dict) -> str:
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']} "
            f"g{cfg['GROUP_M']}" + (f" split{cfg['SPLIT']}" if cfg.get("SPLIT", 1) > 1 else ""))


def tile_rows(shapes, capability, dev) -> list[dict]:
    """Every tile of the generation's set (``autotune.candidates`` for the shape's row bucket) run explicitly on
    ``shapes``: int32 against ``int_mm``."""
    import torch

    from kernel import autotune, gemm
    rows = []
    for model, layer, m, n, k, _ in shapes:
        g = torch.Generator(device="cpu").manual_seed(m + n + k)
        a_q = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8).to(dev)
        w_q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(dev)
        one_m, one_n = torch.ones(m, device=dev), torch.ones(n, device=dev)
        ref = int_mm(a_q, w_q)
        for cfg in autotune.candidates(capability, None, autotune.m_bucket(m)):
            out = torch.empty((m, n), dtype=torch.int32, device=dev)
            gemm.launch_int8_gemm(a_q, one_m, w_q, one_n, None, out, cfg)
            rows.append({"shape": f"{model} {layer}", "M": m, "N": n, "K": k, "tile": _tile_text(cfg),
                         "int32_exact": bool(torch.equal(out, ref))})
    return rows


def instructions(cache_dir: str) -> dict:
    """{kernel name: sorted instructions} of the GEMM PTX Triton built into ``cache_dir``: mma.sync or wgmma."""
    found: dict[str, set] = {}
    for p in Path(cache_dir).rglob("*.ptx"):
        text = p.read_text(errors="replace")
        kinds = {i for i in ("wgmma", "mma.sync") if i in text}
        if kinds:
            found.setdefault(p.stem, set()).update(kinds)
    return {k: sorted(v) for k, v in sorted(found.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--capability", default="8.9", help="the generation whose tiles run: 8.0, 8.6, 8.9 or 12.0")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h200-consumer-tiles.json"))
    ap.add_argument("--only", default=None, help="regex on 'model layer'")
    ap.add_argument("--wgmma", action="store_true", help="leave Triton's wgmma on (the consumer tiles as Hopper builds "
                                                         "them); default: DISABLE_MMA_V3=1, mma.sync as on those GPUs")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop adding shapes after this many seconds")
    ap.add_argument("--cpu-smoke", action="store_true", help="TRITON_INTERPRET=1 on CPU: tiny shapes, no timing")
    args = ap.parse_args(argv)
    cap = tuple(int(v) for v in args.capability.split("."))
    if args.cpu_smoke and not os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("--cpu-smoke needs TRITON_INTERPRET=1 (set before Python starts)")
    cache = None
    if not args.cpu_smoke:
        if not args.wgmma:
            os.environ["DISABLE_MMA_V3"] = "1"
        cache = os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="consumer-tiles-triton-")
        os.environ["INT8_FUSED_CACHE_DIR"] = tempfile.mkdtemp(prefix="consumer-tiles-autotune-")
    import torch

    from bench.lib import provenance
    from kernel import autotune, gelu, norm, quantize, residual, swiglu
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --cpu-smoke under TRITON_INTERPRET=1 for the CPU check")
    shapes = SMOKE if args.cpu_smoke else block_shapes()
    if args.only:
        shapes = [s for s in shapes if re.search(args.only, f"{s[0]} {s[1]}")]
    t0 = time.time()
    rows, skipped = [], []
    for s in shapes:
        if time.time() - t0 > args.budget_s:
            skipped.append(f"{s[0]} {s[1]}")
            continue
        rows.append(shape_row(s, cap, dev, timed=not args.cpu_smoke))
        print(json.dumps(rows[-1]), flush=True)
    tiles = tile_rows(SMOKE if args.cpu_smoke else [s for s in RAGGED if s[3] == 4608], cap, dev)
    props = None if args.cpu_smoke else torch.cuda.get_device_properties(0)
    import triton
    result = {
        "what": f"H200 timings of the sm_{cap[0]}{cap[1]} tile set (not a consumer GPU's)" if props else "CPU smoke",
        "capability": list(cap),
        "instruction": "mma.sync (DISABLE_MMA_V3=1)" if cache and not args.wgmma else "as the GPU builds it",
        "candidates": {b: [_tile_text(c) for c in cs] for b, cs in autotune.target_candidates(cap, s8=False).items()},
        "same_set_on": [f"sm_{a}{b}" for a, b in autotune.SMEM_OPTIN
                        if autotune.target_candidates((a, b), s8=False) == autotune.target_candidates(cap, s8=False)],
        "row_plans": {f"{m.__name__}.{name}": repr(getattr(m, name)) for m, names in (
            (norm, ("RMS_ONE_PASS", "RMS_PLAN", "LN_ONE_PASS", "LN_PLAN")), (swiglu, ("SWIGLU_ONE_PASS", "SWIGLU_PLAN")),
            (residual, ("RESIDUAL_ONE_PASS", "RESIDUAL_LN_ONE_PASS")), (gelu, ("GELU_ONE_PASS", "GELU_PLAN")),
            (quantize, ("QUANT_ONE_PASS", "QUANT_ROW_LOOP"))) for name in names},
        "rows": rows, "tiles": tiles, "skipped": skipped,
        "all_int32_exact": all(r["int32_exact"] for r in rows + tiles),
        "ptx_instructions": instructions(cache) if cache else None,
        "provenance": dict(gpu=props.name if props else "cpu", torch=torch.__version__, triton=triton.__version__,
                           driver=(provenance.driver() or "?") if props else None, commit=provenance.commit(),
                           dirty=provenance.dirty(), date=provenance.now(),
                           command=[sys.executable, *sys.argv], seconds=round(time.time() - t0, 1)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    bad = [f"{r.get('model', r.get('shape'))} {r.get('layer', r['tile'])}" for r in rows + tiles
           if not r["int32_exact"]]
    print(f"{len(rows)} shapes, {len(tiles)} tile runs, {len(skipped)} skipped; int32 not exact: {bad or 'none'}")
    print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
