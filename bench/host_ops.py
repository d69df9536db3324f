"""Host cost per call of the torch ops an Ideogram 4 block issues besides the pack's kernels, under one allocator.

Run cj found the pack's Ideogram 4 step paced by the host (165 ms a step against 143 ms of GPU work); run ck's
cProfile ranked ``torch.empty`` (1089 calls a step), ``F.linear`` (80), SDPA (68) and ``torch.tanh`` (136) among
the largest own times. This times each as a stream of calls on tiny operands (the GPU keeps up; the figure is the
host's), medians of interleaved rounds. ComfyUI runs torch's cudaMallocAsync allocator on NVIDIA: run the script
once with ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` and once without to compare.

    python bench/host_ops.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.host_int8 import per_call_us  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("host_ops: needs a CUDA GPU")
        return 2
    dev = torch.device("cuda")
    bf = torch.bfloat16
    x = torch.randn(1, 1, 512, device=dev, dtype=bf)
    w = torch.randn(18432, 512, device=dev, dtype=bf)
    b = torch.randn(18432, device=dev, dtype=bf)
    g = torch.randn(1, 1, 4608, device=dev, dtype=bf)
    q, k, v = (torch.randn(1, 18, 64, 256, device=dev, dtype=bf) for _ in range(3))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ops = {
        "torch.empty int8 4608x4608": lambda: torch.empty((4608, 4608), dtype=torch.int8, device=dev),
        "torch.empty fp32 4608": lambda: torch.empty((4608,), dtype=torch.float32, device=dev),
        "F.linear 1x512 -> 18432 (adaLN)": lambda: F.linear(x, w, b),
        "torch.tanh 1x4608": lambda: torch.tanh(g),
        "1.0 + t 1x4608": lambda: 1.0 + g,
        "reshape + view": lambda: g.reshape(-1, 4608).view(1, 1, 4608),
    }

    def sdpa(backend):
        def fn():
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v)
        return fn
    ops["SDPA cuDNN (sdpa_kernel context) L64 D256"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    ops["SDPA flash (sdpa_kernel context) L64 D256"] = sdpa(SDPBackend.FLASH_ATTENTION)
    for fn in ops.values():  # warm-up: cuBLAS / cuDNN handles and plans, the allocator's pool
        for _ in range(50):
            fn()
    times = {n: [] for n in ops}
    for _ in range(a.rounds):
        for n, fn in ops.items():
            times[n].append(per_call_us(fn, a.calls))
    res = {"allocator": torch.cuda.get_allocator_backend(), "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "us_per_call": {n: round(sorted(t)[len(t) // 2], 2) for n, t in times.items()}}
    print(json.dumps(res, indent=1), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
