"""Host cost of the persistent GEMMs' TMA descriptors on a GPU: Triton's ``fill_tma_descriptor`` (one
``cuTensorMapEncodeTiled`` a descriptor, three a persistent launch) alone, and one persistent INT8 GEMM launch on a
small problem (a few µs of GPU work, so a loop of launches runs at the host's rate) beside the non-persistent kernel
of the same tile (both through the checked launch path). µs a call (a loop of calls ended by one synchronize,
``bench/host_int8.py``'s ``per_call_us``), medians of interleaved rounds. (Run cg ran an earlier form at cbb85e0:
it also A/B'd a kept-encoding switch, since removed, and timed the loop without its final synchronize.)

    python bench/tma_encode.py [--calls 2000] [--rounds 7]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.host_int8 import per_call_us  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/tma_encode.py needs a CUDA GPU")
    import triton
    from kernel import gemm
    dev = torch.device("cuda")
    m, n, k = 256, 512, 256
    a_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=dev)
    w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev)
    a_s = torch.rand(m, device=dev) * 1e-2
    w_s = torch.rand(n, device=dev) * 1e-2
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    cfg = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, S8=1, PERSIST=1)
    tiles = -(-m // 128) * -(-n // 256)

    def persistent():
        gemm._launch_persistent(a_q, a_s, w_q, w_s, None, out, cfg, tiles)

    persistent()  # builds and checks the s8 binary
    ref = out.clone()
    plain_cfg = {k_: v for k_, v in cfg.items() if k_ != "PERSIST"}
    gemm.launch_int8_gemm(a_q, a_s, w_q, w_s, None, out, plain_cfg)
    torch.cuda.synchronize()
    same = torch.equal(out, ref)
    raw_fill = triton.runtime.driver.active.utils.fill_tma_descriptor
    print(f"persistent == plain tile: {same}")

    def encode():
        raw_fill(a_q.data_ptr(), 3, 1, 0, [128, 128], [m, k], [k, 1], 0)

    rows = {"fill_tma_descriptor": [], "persistent launch": [], "non-persistent launch": []}
    for _ in range(a.rounds):
        rows["fill_tma_descriptor"].append(per_call_us(encode, a.calls))
        rows["persistent launch"].append(per_call_us(persistent, a.calls))
        rows["non-persistent launch"].append(
            per_call_us(lambda: gemm.launch_int8_gemm(a_q, a_s, w_q, w_s, None, out, plain_cfg), a.calls))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"M {m} N {n} K {k}; µs a call, median of {a.rounds} x {a.calls}")
    for name, v in rows.items():
        print(f"  {name:24s} {statistics.median(v):8.2f}  (min {min(v):.2f}, max {max(v):.2f})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
