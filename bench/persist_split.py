"""The persistent GEMM's tail split on a GPU: exact, how fast, and what ``select_config`` picks.

A persistent launch runs one program an SM over the tiles; where the tile count is not a multiple of the SMs
(Ideogram 4's o / w2 at M 4096: 576 tiles of 128 x 256 on 132 SMs), the slowest programs run one tile more than the
rest. With ``SPLIT`` the tiles past the last whole wave run as K pieces, a program each (``kernel.gemm.tail_layout``).
Per shape:
  exact  the split's bf16 output (with a bias) == the whole-tile persistent kernel's, bit for bit, twice; the
         whole-tile output's int32 sums (the plain kernel, int32 out) == ``torch._int_mm``
  us     do_bench medians (L2 flushed) as interleaved rounds: whole tiles, then each split that lays out
  pick   what ``gemm.select_config`` chooses for this M (fresh autotune folder), and its time

    python bench/persist_split.py [--out bench/results/h200-persist-split.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("INT8_FUSED_CACHE_DIR", tempfile.mkdtemp(prefix="persist-split-"))  # a fresh autotune

import torch  # noqa: E402
import triton  # noqa: E402

from bench import provenance  # noqa: E402
from bench.gemm_floor import int8_operands  # noqa: E402
from kernel import autotune, gemm, s8wgmma  # noqa: E402

SHAPES = [  # (label, M, N, K): tiles of 128 x 256 -> whole waves on 132 SMs + tail
    ("ideogram4 o M4096", 4096, 4608, 4608),          # 576 = 4 x 132 + 48
    ("ideogram4 w2 M4096", 4096, 4608, 12288),        # 576 = 4 x 132 + 48
    ("ideogram4 qkv M4096", 4096, 13824, 4608),       # 1728 = 13 x 132 + 12
    ("flux1 single linear2", 4608, 3072, 15360),      # 432 = 3 x 132 + 36
    ("ideogram4 o M4608", 4608, 4608, 4608),          # 648 = 4 x 132 + 120: no room, whole tiles
]
CFG = autotune.s8_configs()[1]  # the s8 128 x 256 tile as the persistent TMA kernel


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median") * 1e3


def row(label, m, n, k, rounds=5):
    a, w, a_s, w_s, _ = int8_operands(m, n, k)
    bias = torch.randn(n, device="cuda")
    tiles = -(-m // CFG["BLOCK_M"]) * -(-n // CFG["BLOCK_N"])
    progs = gemm.persistent_programs(tiles, a.device)
    kb = -(-k // CFG["BLOCK_K"])
    layouts = {}
    for s in gemm.TAIL_SPLITS:
        lay = gemm.tail_layout(tiles, progs, s, kb)
        if lay[1] > 1 and lay not in layouts.values():
            layouts[s] = lay
    r = {"shape": label, "M": m, "N": n, "K": k, "tiles": tiles, "programs": progs,
         "layouts": {str(s): list(v) for s, v in layouts.items()}, "exact": {}, "us": {}}
    i32 = gemm.launch_int8_gemm(a, a_s, w, w_s, None, torch.empty((m, n), dtype=torch.int32, device="cuda"),
                                {**CFG, "PERSIST": False})
    r["exact"]["int32 == _int_mm"] = bool(torch.equal(i32, torch._int_mm(a, w.t())))
    outs = {s: torch.empty((m, n), dtype=torch.bfloat16, device="cuda") for s in (1, *layouts)}
    whole = gemm.launch_int8_gemm(a, a_s, w, w_s, bias, outs[1], CFG).clone()
    for s in layouts:
        same = True
        for _ in range(2):
            outs[s].fill_(float("nan"))
            gemm.launch_int8_gemm(a, a_s, w, w_s, bias, outs[s], {**CFG, "SPLIT": s})
            torch.cuda.synchronize()
            same = same and s8wgmma.same_bits(outs[s], whole)
        r["exact"][f"split {s} == whole"] = same
    times = {s: [] for s in outs}
    for _ in range(rounds):
        for s in outs:
            c = CFG if s == 1 else {**CFG, "SPLIT": s}
            times[s].append(bench(lambda: gemm.launch_int8_gemm(a, a_s, w, w_s, bias, outs[s], c)))
    for s, t in times.items():
        r["us"]["whole" if s == 1 else f"split {s}"] = round(sorted(t)[len(t) // 2], 2)
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    t0 = time.perf_counter()
    pick = gemm.select_config(a, a_s, w, w_s, bias, out)
    r["pick"] = {"config": pick, "tuning_s": round(time.perf_counter() - t0, 1),
                 "us": round(bench(lambda: gemm.launch_int8_gemm(a, a_s, w, w_s, bias, out, pick)), 2)}
    best = min(r["us"].values())
    r["gain_vs_whole"] = round(r["us"]["whole"] / best, 3)
    print(json.dumps(r), flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h200-persist-split.json"))
    args = ap.parse_args()
    if not s8wgmma.usable(torch.device("cuda")):
        raise SystemExit(f"the s8 path is off here: {s8wgmma.state()}")
    rows = [row(*s) for s in SHAPES]
    doc = {"provenance": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "triton": triton.__version__, "commit": provenance.commit(), "dirty": provenance.dirty()},
           "rows": rows, "s8_state": s8wgmma.state()}  # run ci wrote it as "s8_off"
    Path(args.out).write_text(json.dumps(doc, indent=1))
    bad = [r["shape"] for r in rows if not all(r["exact"].values())]
    print("NOT EXACT: " + ", ".join(bad) if bad else "all exact", flush=True)


if __name__ == "__main__":
    main()
