"""Host time of one call of a ``fused_triton`` Int8Linear on its float path (``INT8_FUSED_DISPATCH=float``) against
an ``nn.Linear`` module call and a bare ``F.linear`` on the same dequantized weight: the per-call Python cost of the module path (dispatch, the
derived-weight cache check, the call record), which is what a small linear (M <= 512, 15-40 us of GPU work) pays
on top of bf16. Runs on the CPU with a 1 x 64 x 64 problem, so the matmul itself costs almost nothing.

    python bench/host_overhead.py [--calls 20000] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    from kernel import config
    from quant import dispatch
    from quant.linear import Int8Linear
    torch.set_num_threads(1)
    lin = Int8Linear.from_float(torch.randn(64, 64), backend="fused_triton", name="probe")
    x = torch.randn(1, 64)
    w = dispatch.float_weight(lin, x.dtype)
    nn_lin = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        nn_lin.weight.copy_(w)
    module, bare, nn_mod = [], [], []
    with config.override(INT8_FUSED_DISPATCH="float"):
        for _ in range(200):
            lin(x)
        for _ in range(a.repeats):  # interleaved, so drift of the machine hits all alike
            module.append(per_call_us(lambda: lin(x), a.calls))
            bare.append(per_call_us(lambda: F.linear(x, w), a.calls))
            nn_mod.append(per_call_us(lambda: nn_lin(x), a.calls))
    m, b, n = statistics.median(module), statistics.median(bare), statistics.median(nn_mod)
    print(f"Int8Linear float path {m:.1f} us/call, nn.Linear {n:.1f} us/call, F.linear {b:.1f} us/call: "
          f"{m - b:.1f} us of module path a call ({m - n:+.1f} us against nn.Linear's) (median of {a.repeats} x "
          f"{a.calls} calls; torch {torch.__version__}, {torch.get_num_threads()} thread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
