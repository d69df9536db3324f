"""The error floor of 8-bit Q·Kᵀ attention at head_dim 256, in float64 on the CPU (issue 14 item 3's error bar).

Issue 14 asks the pack's attention for a relative error ≤ 2× bf16 SDPA's against a float64 reference, on
``bench/attention.py``'s inputs (q, k, v standard normal, [1, H, L, 256], scale 1/16). This script computes what
any kernel that rounds Q and K to int8 can reach there, with everything else exact:

  int8_<g>      softmax(deq(Q̂) · deq(K̂)ᵀ · scale) · V in float64: only Q and K rounded (exact softmax, exact P·V)
  int8_<g>_bf16 the same with what a flash kernel rounds besides: P = exp(s − rowmax) in bf16 before P·V, the
                output in bf16 (kernel/attention8.py's numerics)

for the quantization granularities an INT8 attention can use (round half to even; K smoothed by its mean over L
first, as kernel/attention8.py does): ``block128`` one scale per 128 query rows / 128 key rows of a head (the
kernel's tiles), ``token`` one scale per query row and per key row (the finest an int32 dot product with a scale
epilogue allows). For comparison, bf16 kernels: ``bf16_output`` the exact result rounded to bf16 once (every
bf16 SDPA stores a bf16 output, so none is below it) and ``bf16_flash`` P and the output in bf16 (what a flash
kernel rounds; the model of bf16 SDPA's error). The inputs are bf16 (rounded once, as bench/attention.py has
them) and the reference is computed from them in float64; errors are ‖out − ref‖ / ‖ref‖ over ``--heads`` heads.

    python3 bench/attention_floor.py [--L 4608] [--heads 2] [--out bench/results/attention-floor.json]

CPU only, torch only; about a minute at L 4608 on two cores.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

HEAD_DIM = 256
SDPA_BF16_ERR_H200 = 2.26e-3   # bf16 SDPA (cuDNN) against float64 at L 4608, measured on the H200 (RESULTS.md)


def quantize(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x [L, D] float64 -> its int8 rounding, dequantized: scale = max|x| / 127 per group of ``group`` rows
    (None: per row), q = rint(x / scale) (torch.round: half to even)."""
    if group is None:
        amax = x.abs().amax(dim=1, keepdim=True)
    else:
        rows = x.shape[0]
        pad = (-rows) % group
        xp = torch.nn.functional.pad(x.abs(), (0, 0, 0, pad))
        amax = xp.view(-1, group * x.shape[1]).amax(dim=1).repeat_interleave(group)[:rows, None]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(x / scale).clamp(-127, 127) * scale


def attention(q, k, v, scale, bf16: bool = False):
    """float64 softmax(q kᵀ scale) v; ``bf16``: P = exp(s - rowmax) and the output rounded to bf16 (flash)."""
    s = (q @ k.T) * scale
    if not bf16:
        return torch.softmax(s, dim=-1) @ v
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    return ((p.to(torch.bfloat16).double() @ v) / p.sum(dim=-1, keepdim=True)).to(torch.bfloat16).double()


def rel(out, ref) -> float:
    return float((out - ref).norm() / ref.norm())


def floors(L: int, heads: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    scale = HEAD_DIM ** -0.5
    acc = {}
    for _ in range(heads):
        q, k, v = (torch.randn(L, HEAD_DIM, generator=g).to(torch.bfloat16).double() for _ in range(3))
        ref = attention(q, k, v, scale)
        ks = k - k.mean(dim=0, keepdim=True)   # K smoothing: softmax is unchanged in exact arithmetic
        outs = {"bf16_output": ref.to(torch.bfloat16).double(), "bf16_flash": attention(q, k, v, scale, bf16=True)}
        for gname, group in (("block128", 128), ("token", None)):
            qq, kq = quantize(q, group), quantize(ks, group)
            outs[f"int8_{gname}"] = attention(qq, kq, v, scale)
            outs[f"int8_{gname}_bf16"] = attention(qq, kq, v, scale, bf16=True)
        for name, out in outs.items():  # accumulate squared norms over heads
            e, r = acc.get(name, (0.0, 0.0))
            acc[name] = (e + float((out - ref).norm() ** 2), r + float(ref.norm() ** 2))
    return {name: (e / r) ** 0.5 for name, (e, r) in acc.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--L", type=int, nargs="+", default=[4608])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0 = time.time()
    rows = []
    for L in a.L:
        f = floors(L, a.heads)
        row = {"L": L, "heads": a.heads, "head_dim": HEAD_DIM, **{k: round(v, 6) for k, v in f.items()},
               "int8_token_x_bf16_flash": round(f["int8_token"] / f["bf16_flash"], 2),
               "int8_token_x_sdpa_bf16_h200": round(f["int8_token"] / SDPA_BF16_ERR_H200, 2)}
        rows.append(row)
        print(f"L {L}: bf16 output rounding {f['bf16_output']:.3e}, bf16 flash model {f['bf16_flash']:.3e} "
              f"(H200 SDPA {SDPA_BF16_ERR_H200:.2e}); int8 Q/K only: 128-row blocks {f['int8_block128']:.3e}, "
              f"per token {f['int8_token']:.3e}; with bf16 P + output: {f['int8_block128_bf16']:.3e} / "
              f"{f['int8_token_bf16']:.3e}. Per token = {row['int8_token_x_bf16_flash']}x the bf16 flash model, "
              f"{row['int8_token_x_sdpa_bf16_h200']}x H200 SDPA", flush=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import provenance
    commit = provenance.commit()
    res = {"rows": rows, "sdpa_bf16_err_h200": SDPA_BF16_ERR_H200, "seconds": round(time.time() - t0, 1),
           "provenance": {"torch": torch.__version__, "python": platform.python_version(),
                          "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "commit": commit, "argv": [sys.executable, *sys.argv],
                          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
