"""Issue 14 item 6: the GEMM's tail split (``kernel.gemm.tail_layout``) against the plain launch, every shape.

A GEMM of T output tiles on a GPU that runs S programs at once ends with a partial wave of T % S tiles; the tail
split cuts those tiles along K into pieces that run side by side, and the last piece of each tile sums the exact
int32 partials (bit-identical outputs, checked here before timing, twice per variant so the counters' reset is
exercised). Per shape with M > 16 from ``bench/shapes.py``: the autotuned plain config, then that config with
SPLIT 2 / 3 / 4 / 8, each with the GPU's programs at once counted as 1 and as 2 CTAs an SM (the smem / register
bound ``kernel.gemm._slots`` computes is reported); ``triton.testing.do_bench`` medians (L2 flushed per call).

    python bench/gemm_split.py [--out bench/results/h200-gemm-split.json] [--only REGEX]
    python bench/gemm_split.py --swiglu [--out ...]       # the SwiGLU-epilogue GEMM (kernel.fused.gemm_swiglu)
    TRITON_INTERPRET=1 python bench/gemm_split.py --cpu      # tiny shapes: bit-exactness only (smoke test)
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from bench import provenance  # noqa: E402

from bench.shapes import SHAPES  # noqa: E402
from kernel import autotune, gemm  # noqa: E402

SPLITS = (2, 3, 4, 8)


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=20, rep=80, return_mode="median") * 1e3  # us


def _variants(cfg: dict, tiles: int, k: int, run, ref, cuda: bool, per_sm_values) -> tuple[float | None, list]:
    """``run(config)`` -> output: (plain µs, the split variants) for each count of CTAs an SM in ``per_sm_values``
    (None: the one ``kernel.gemm._slots`` computes) and SPLIT in ``SPLITS``, each distinct layout once, its output
    compared with ``ref`` twice (the counters' reset) and, on a GPU, timed."""
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 4
    computed = gemm._slots(cfg, dev)
    key = (dev.index, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg["num_stages"])
    plain = _bench(lambda: run(cfg)) if cuda else None
    seen, out = set(), []
    try:
        for per_sm in per_sm_values:
            slots = computed if per_sm is None else sms * per_sm
            gemm._SLOTS[key] = slots
            for s in SPLITS:
                layout = gemm.tail_layout(tiles, slots, s, -(-k // cfg["BLOCK_K"]))
                if layout[1] == 1 or layout in seen:
                    continue
                seen.add(layout)
                c = {**cfg, "SPLIT": s}
                v = {"per_sm": slots // sms, "split": s, "layout": list(layout),
                     "equal": all(torch.equal(run(c), ref) for _ in range(2))}
                if cuda:
                    v["us"] = _bench(lambda: run(c))
                    v["x_plain"] = round(plain / v["us"], 3)
                out.append(v)
    finally:
        gemm._SLOTS[key] = computed
    return plain, out


def run_shape(m: int, n: int, k: int, bias: bool, cuda: bool) -> dict:
    """The INT8 GEMM (``kernel.gemm.launch_int8_gemm``) with its tuned config, counting 1 and 2 CTAs an SM."""
    dev = "cuda" if cuda else "cpu"
    g = torch.Generator(device=dev).manual_seed(m * 7 + n * 3 + k)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=dev, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev, generator=g)
    a_s = torch.rand(m, device=dev, generator=g) * 1e-3
    w_s = torch.rand(n, device=dev, generator=g) * 1e-3
    b = torch.randn(n, device=dev, generator=g).to(torch.bfloat16) if bias else None
    out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
    cfg = gemm.select_config(a, a_s, w, w_s, b, out) if cuda else autotune.interpreter_configs()[0]
    run = lambda c: gemm.launch_int8_gemm(a, a_s, w, w_s, b, out, c)  # noqa: E731
    ref = run(cfg).clone()
    tiles = -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
    plain, variants = _variants(cfg, tiles, k, run, ref, cuda, (1, 2))
    return {"M": m, "N": n, "K": k, "cfg": {x: cfg[x] for x in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M",
                                                                "num_warps", "num_stages")},
            "tiles": tiles, "slots_computed": gemm._slots(cfg, a.device), "plain_us": plain, "variants": variants}


SWIGLU_SHAPES = [  # (label, M, F, K): the merged w1+w3 GEMM with SwiGLU in its epilogue (kernel.fused.gemm_swiglu)
    ("ideogram4 w1/w3 swiglu M4608", 4608, 12288, 4608),
    ("ideogram4 w1/w3 swiglu M4096", 4096, 12288, 4608),
    ("z-image w1/w3 swiglu", 4352, 10240, 3840),
]


def run_swiglu(m: int, f: int, k: int) -> dict:
    """The SwiGLU-epilogue GEMM (``kernel.fused``) with its tuned config, as the pack counts its CTAs an SM; h
    compared bit for bit (NaN-free operands)."""
    from kernel import fused as kf
    g = torch.Generator(device="cuda").manual_seed(m + f + k)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
    w = torch.randint(-127, 128, (2 * f, k), dtype=torch.int8, device="cuda", generator=g)
    a_s = torch.rand(m, device="cuda", generator=g) * 1e-3
    w_s = torch.rand(2 * f, device="cuda", generator=g) * 1e-3
    h = torch.empty((m, f), dtype=torch.bfloat16, device="cuda")
    cfg = gemm.select_config(a, a_s, w, w_s, None, None, torch.bfloat16, tail_split=False)
    run = lambda c: kf._launch_gemm_swiglu(a, a_s, w, w_s, None, h, False, c)  # noqa: E731
    ref = run(cfg).clone()
    tiles = -(-m // cfg["BLOCK_M"]) * -(-f // (cfg["BLOCK_N"] // 2))
    plain, variants = _variants(cfg, tiles, k, run, ref, True, (None,))
    # what the pack itself picks with the switch on (kernel.fused._swiglu_split: choose_split timing these operands)
    from kernel import config
    with config.override(INT8_FUSED_TAIL_SPLIT="all"):
        call = lambda: kf.gemm_swiglu(a, a_s, w, w_s, None, torch.bfloat16)  # noqa: E731
        pack_equal = torch.equal(call(), ref)
        picked = [c.get("SPLIT", 1) for key, c in kf._SW_SPLIT.items() if key[1:4] == (f, k, m)]
        pack = {"split": picked[-1] if picked else None, "equal": pack_equal, "us": _bench(call)}
    return {"M": m, "F": f, "K": k, "tiles": tiles, "slots_computed": gemm._slots(cfg, a.device),
            "plain_us": plain, "variants": variants, "pack": pack}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None)
    ap.add_argument("--cpu", action="store_true", help="TRITON_INTERPRET=1 smoke test on tiny shapes")
    ap.add_argument("--swiglu", action="store_true", help="the SwiGLU-epilogue GEMM's shapes only (GPU)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda and args.swiglu:
        jobs = [(label, (m, f, k), lambda m=m, f=f, k=k: run_swiglu(m, f, k)) for label, m, f, k in SWIGLU_SHAPES]
    else:
        shapes = ([(f"{s[0]} {s[1]}", *s[2:]) for s in SHAPES if s[2] > 16] if cuda else
                  [("tiny", 150, 30, 300, True), ("tiny even K", 150, 30, 256, False), ("tiny 2x3", 33, 70, 300, True)])
        jobs = [(label, (m, n, k), lambda m=m, n=n, k=k, b=b: run_shape(m, n, k, b, cuda))
                for label, m, n, k, b in shapes]
    if args.only:
        jobs = [j for j in jobs if re.search(args.only, j[0])]
    t0, rows, bad = time.time(), [], 0
    for label, dims, job in jobs:
        row = {"shape": label, **job()}
        rows.append(row)
        bad += sum(not v["equal"] for v in row["variants"])
        best = max(row["variants"], key=lambda v: v.get("x_plain", 0), default=None)
        print(f"{label:34s} {'x'.join(map(str, dims))} tiles {row['tiles']:5d} slots {row['slots_computed']:4d} "
              f"plain {row['plain_us'] or 0:8.1f} us  " +
              "  ".join(f"s{v['split']}/{v['per_sm']}:{v.get('us', 0):.1f}{'' if v['equal'] else ' DIFF'}"
                        for v in row["variants"]) +
              (f"  best x{best.get('x_plain', 0):.3f}" if best else "") +
              (f"  pack: split {row['pack']['split']} {row['pack']['us']:.1f} us"
               f"{'' if row['pack']['equal'] else ' DIFF'}" if "pack" in row else ""), flush=True)
    bad += sum(not r["pack"]["equal"] for r in rows if "pack" in r)
    print(f"{len(rows)} shapes, {bad} variant(s) not bit-identical, {time.time() - t0:.0f} s")
    if args.out:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                "triton": triton.__version__, "commit": provenance.commit()}
        Path(args.out).write_text(json.dumps({"provenance": meta, "rows": rows}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
