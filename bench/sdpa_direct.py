"""The attention Router's direct cuDNN call on a GPU: the same bits as torch's SDPA under the priority context, and
the host time it saves.

Per shape (Ideogram 4's attention at L 4608 / 4096 / 2816, head_dim 256, and Flux.1's at 4608, head_dim 128; q / k
as the pack's QK-norm + RoPE kernel leaves them, [B, H, L, D] views of [B, L, H, D] memory, v a view of the qkv
output), ``quant.attention.Router("cudnn")`` with ``INT8_FUSED_SDPA_DIRECT`` on and off: outputs bit for bit, the
backend torch reports, GPU µs (do_bench). Host µs a call: a stream of calls at L 64 (the GPU keeps up), on / off
interleaved, medians.

    python bench/sdpa_direct.py [--out bench/results/h200-sdpa-direct.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from bench import provenance  # noqa: E402
from bench.host_int8 import per_call_us  # noqa: E402
from kernel import config  # noqa: E402
from quant import attention as qa  # noqa: E402

SHAPES = [("ideogram4 cond", 1, 18, 4608, 256), ("ideogram4 uncond", 1, 18, 4096, 256),
          ("ideogram4 768²", 1, 18, 2816, 256), ("flux1", 1, 24, 4608, 128)]


def operands(b, h, l, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(b, l, 3, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k = (torch.randn(b, l, h, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
            for _ in range(2))
    return q, k, qkv[:, :, 2].transpose(1, 2)


def call(router, q, k, v, h):
    return router(lambda *a, **kw: None, q, k, v, h, skip_reshape=True, skip_output_reshape=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h200-sdpa-direct.json"))
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    router = qa.Router("cudnn")
    rows = []
    with torch.inference_mode():
        for label, b, h, l, d in SHAPES:
            q, k, v = operands(b, h, l, d)
            r = {"shape": label, "B": b, "H": h, "L": l, "D": d}
            with config.override(INT8_FUSED_SDPA_DIRECT=False):
                ctx = call(router, q, k, v, h)
            direct = call(router, q, k, v, h)
            gpu = {"ctx": [], "direct": []}
            for i in range(2 * args.rounds):  # interleaved, each way first in turn: the GPU's clock drifts
                way = ("ctx", "direct")[(i + i // 2) % 2]
                with config.override(INT8_FUSED_SDPA_DIRECT=way == "direct"):
                    gpu[way].append(triton.testing.do_bench(lambda: call(router, q, k, v, h)) * 1e3)
            for way, t in gpu.items():
                r[f"{way}_us"] = round(sorted(t)[len(t) // 2], 1)
            r["same_bits"] = bool(torch.equal(ctx.view(torch.int16), direct.view(torch.int16)))
            r["torch_ran"] = router._which(q, k, v, None, {}, qa.order("cudnn"))
            rows.append(r)
            print(json.dumps(r), flush=True)
        q, k, v = operands(1, 18, 64, 256)
        host = {"on": [], "off": []}
        for _ in range(args.rounds):
            host["on"].append(per_call_us(lambda: call(router, q, k, v, 18), args.calls))
            with config.override(INT8_FUSED_SDPA_DIRECT=False):
                host["off"].append(per_call_us(lambda: call(router, q, k, v, 18), args.calls))
    med = {n: round(sorted(t)[len(t) // 2], 2) for n, t in host.items()}
    print(f"host us a call through the Router (L 64): direct {med['on']}, priority context {med['off']}", flush=True)
    doc = {"provenance": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "triton": triton.__version__, "commit": provenance.commit(), "dirty": provenance.dirty()},
           "rows": rows, "host_us_per_call": med, "counts": dict(router.counts)}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print("all same bits" if all(r["same_bits"] for r in rows) else "BITS DIFFER", flush=True)


if __name__ == "__main__":
    main()
