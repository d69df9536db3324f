"""The pack's s8 wgmma n256 path (kernel/s8wgmma.py) on a GPU: exact, how fast, and its safety net.

Per shape (block shapes of Ideogram 4 / Flux.1 / Z-Image, then ragged ones: row, column and K tails, M 77):
  exact  ``gemm.launch_int8_gemm`` with the s8 tile: int32 sums == ``torch._int_mm``; bf16 output with a bias ==
         Triton's int8 build of the same 128 x 256 tile, and == the pack's 128 x 128 tile (same epilogue math)
  us     do_bench medians (L2 flushed): the 128 x 128 tile (the pack's pick on these shapes before), the 128 x 256
         tile as Triton builds it (n128), the s8 tile, the s8 tile as the persistent TMA kernel (bits compared with
         the s8 tile's), and ``select_config``'s pick with the s8 tiles among its candidates (timed here, in a
         fresh autotune folder)
SwiGLU (the w1/w3 shapes): the SwiGLU-epilogue GEMM at the 128 x 128 tile, the s8 tile and its persistent form (bits
compared, timed),
and the tile ``fused._swiglu_config`` picks.
Safety net, last: a rewrite made wrong on purpose (A read as u8) must be caught on its first call: that call returns
Triton's int8 build's sums and the path turns off (``s8wgmma.state()``).

    python bench/s8_check.py [--out bench/results/h200-s8-check.json] [--only REGEX]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("INT8_FUSED_CACHE_DIR", tempfile.mkdtemp(prefix="s8-check-"))  # a fresh autotune

import torch  # noqa: E402
import triton  # noqa: E402

from bench import provenance  # noqa: E402
from bench.gemm_floor import SHAPES, int8_operands  # noqa: E402
from kernel import autotune, fused, gemm, s8wgmma  # noqa: E402

RAGGED = [  # (label, M, N, K): tails of every kind the launch handles
    ("rows 4097", 4097, 4608, 4608),
    ("cols 4000", 4608, 4000, 4608),
    ("K 4000 (K tail)", 4608, 4608, 4000),
    ("M 77 text", 77, 4608, 4608),
    ("1000x3000x1000", 1000, 3000, 1000),
]
C128 = autotune.hopper_configs()[0]
C256 = next(c for c in autotune.hopper_configs() if (c["BLOCK_N"], c["BLOCK_K"]) == (256, 128))
CS8 = autotune.s8_configs()[0]
CS8P = autotune.s8_configs()[1]  # the same tile as the persistent TMA kernel


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median") * 1e3


def gemm_row(label, m, n, k):
    a, w, a_s, w_s, _ = int8_operands(m, n, k)
    bias = torch.randn(n, device="cuda")
    row = {"shape": label, "M": m, "N": n, "K": k, "exact": {}, "us": {}}
    o32 = torch.empty((m, n), dtype=torch.int32, device="cuda")
    gemm.launch_int8_gemm(a, a_s, w, w_s, None, o32, CS8)
    row["exact"]["int32 == torch._int_mm"] = bool(torch.equal(o32, torch._int_mm(a, w.t())))
    ys = {}
    for name, cfg in (("128x128", C128), ("128x256 n128", C256), ("s8 n256", CS8), ("s8 persistent", CS8P)):
        y = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        gemm.launch_int8_gemm(a, a_s, w, w_s, bias, y, cfg)
        ys[name] = y
        row["us"][name] = bench(lambda: gemm.launch_int8_gemm(a, a_s, w, w_s, bias, y, cfg))
    row["exact"]["bf16 == 128x256 n128"] = s8wgmma.same_bits(ys["s8 n256"], ys["128x256 n128"])
    row["exact"]["bf16 == 128x128"] = s8wgmma.same_bits(ys["s8 n256"], ys["128x128"])
    row["exact"]["persistent bf16 == s8 n256"] = s8wgmma.same_bits(ys["s8 persistent"], ys["s8 n256"])
    row["persistent runs"] = gemm.persistent_ok(a, w, ys["s8 persistent"])  # else its config ran the plain kernel
    y = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    pick = gemm.select_config(a, a_s, w, w_s, bias, y)
    row["pick"] = {k_: v for k_, v in pick.items()}
    row["us"]["pick"] = bench(lambda: gemm.launch_int8_gemm(a, a_s, w, w_s, bias, y, pick))
    row["tops"] = {p: round(2.0 * m * n * k / u / 1e6, 1) for p, u in row["us"].items()}
    return row


def swiglu_row(label, m, n2, k):
    a, w13, a_s, w_s, _ = int8_operands(m, n2, k)
    f = n2 // 2
    row = {"shape": label + " SwiGLU", "M": m, "F": f, "K": k, "exact": {}, "us": {}}
    hs = {}
    for name, cfg in (("128x128", C128), ("s8 n256", CS8), ("s8 persistent", CS8P)):
        h = torch.empty((m, f), dtype=torch.bfloat16, device="cuda")
        fused._launch_gemm_swiglu(a, a_s, w13, w_s, None, h, False, cfg)
        hs[name] = h
        row["us"][name] = bench(lambda: fused._launch_gemm_swiglu(a, a_s, w13, w_s, None, h, False, cfg))
    row["exact"]["h == 128x128"] = s8wgmma.same_bits(hs["s8 n256"], hs["128x128"])
    row["exact"]["persistent h == s8 n256"] = s8wgmma.same_bits(hs["s8 persistent"], hs["s8 n256"])
    h = torch.empty((m, f), dtype=torch.bfloat16, device="cuda")
    shared = gemm.select_config(a, a_s, w13, w_s, None, None, torch.bfloat16, tail_split=False)
    pick = fused._swiglu_config(shared, a, a_s, w13, w_s, None, h, False)
    row["pick"] = dict(pick)
    row["exact"]["gemm_swiglu == 128x128"] = s8wgmma.same_bits(fused.gemm_swiglu(a, a_s, w13, w_s), hs["128x128"])
    return row


def safety_net() -> dict:
    """A wrong rewrite (A as u8: negative values read as large positive ones) on a fresh build must be caught."""
    real = s8wgmma.rewrite_ptx

    def wrong(ptx):
        out, n = real(ptx)
        return out.replace(".s32.s8.s8", ".s32.u8.s8"), n
    s8wgmma.rewrite_ptx = wrong
    s8wgmma._BUILT.clear()
    s8wgmma._BY_HASH.clear()
    try:
        m, n, k = 1024, 1024, 1024
        a, w, a_s, w_s, _ = int8_operands(m, n, k)
        o32 = torch.empty((m, n), dtype=torch.int32, device="cuda")
        gemm.launch_int8_gemm(a, a_s, w, w_s, None, o32, CS8)
        return {"result == torch._int_mm": bool(torch.equal(o32, torch._int_mm(a, w.t()))),
                "state": s8wgmma.state(), "usable after": s8wgmma.usable(a.device)}
    finally:
        s8wgmma.rewrite_ptx = real


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="regex on the shape label")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/s8_check.py needs a CUDA GPU")
    dev = torch.device("cuda")
    res = {"provenance": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "triton": triton.__version__, "commit": provenance.commit(), "dirty": provenance.dirty()},
           "usable": s8wgmma.usable(dev), "rows": []}
    print(f"s8 path usable here: {res['usable']}", flush=True)
    for label, m, n, k in SHAPES + RAGGED:
        if args.only and not re.search(args.only, label):
            continue
        rows = [gemm_row(label, m, n, k)]
        if "w1/w3" in label:
            rows.append(swiglu_row(label, m, n, k))
        for r in rows:
            res["rows"].append(r)
            cells = "  ".join(f"{p} {u:.1f}" for p, u in r["us"].items())
            pick = ("s8 persistent" if r["pick"].get("PERSIST") else "s8") if r["pick"].get("S8") else \
                f"{r['pick']['BLOCK_M']}x{r['pick']['BLOCK_N']}"
            print(f"{r['shape']:24s} {m}x{n}x{k}  us: {cells}  pick {pick}  exact: {r['exact']}", flush=True)
        if args.out:  # as it goes: a run cut short keeps its rows
            Path(args.out).write_text(json.dumps(res, indent=1))
    res["state"] = s8wgmma.state()
    res["kernels"] = [{"name": kk.name, "regs": kk.n_regs, "spills": kk.n_spills} for kk in s8wgmma._BY_HASH.values()
                      if kk.module is not None]
    print(f"state: {res['state']}; kernels: {res['kernels']}", flush=True)
    res["safety_net"] = safety_net()
    print(f"safety net: {res['safety_net']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
