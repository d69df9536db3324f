"""Which CUDA-graph capture pattern survives torch's cudaMallocAsync backend (the allocator ComfyUI selects on
NVIDIA), with a cuBLAS GEMM inside the captured region, as the fused blocks' float modulation linears have.

Each variant runs in its own process (a failure aborts the process) and captures three graphs in a row:
  side      torch.cuda.graph's default (a new side stream per capture), no warm-up on it
  shared    one capture stream for every capture, one eager warm-up of the region on that stream first
  shared_nc as shared, with cuBLAS kept out of the captured region (its GEMM eager, before the replay)
Prints one line per variant: exit code and the last line of its output.
``python bench/graph_probe.py`` on a GPU machine. H200, torch 2.11 (bench/results/graph-probe.log): side aborts at the
second capture (CUDA error: invalid argument in the allocator's free); shared and shared_nc capture and replay
bit-exactly. The fused blocks still aborted with one warmed capture stream (bench/RESULTS.md, runs z-z3), so the pack
has no CUDA-graph path; this probe stays as the record of what was measured.
"""
from __future__ import annotations

import os
import subprocess
import sys


def child(variant: str) -> None:
    import torch
    import torch.nn.functional as F
    dev = torch.device("cuda")
    w = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16)
    x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
    stream = torch.cuda.Stream() if variant != "side" else None

    def region(inp, h=None):
        y = F.linear(inp, w) if h is None else h
        return (y.float().relu() * 2).to(torch.bfloat16)

    if stream is not None:  # warm-up on the capture stream: its cuBLAS workspace is made outside any capture
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            region(x)
        torch.cuda.current_stream().wait_stream(stream)
    graphs, outs = [], []
    for i in range(3):
        g = torch.cuda.CUDAGraph()
        static = x.clone()
        h = F.linear(static, w) if variant == "shared_nc" else None
        with torch.cuda.graph(g, stream=stream):
            out = region(static, h)
        g.replay()
        graphs.append(g)
        outs.append(out.clone())
    torch.cuda.synchronize()
    ref = region(x)
    ok = all(torch.equal(o, ref) for o in outs)
    print(f"{variant}: captured {len(graphs)} graphs, outputs equal eager: {ok}", flush=True)


def main() -> int:
    if len(sys.argv) > 1:
        child(sys.argv[1])
        return 0
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    for v in ("side", "shared", "shared_nc"):
        r = subprocess.run([sys.executable, __file__, v], env=env, capture_output=True, text=True, timeout=120)
        last = (r.stdout.strip().splitlines() or r.stderr.strip().splitlines() or ["(no output)"])[-1]
        err = next((ln for ln in r.stderr.splitlines() if "error" in ln.lower() or "Warning" in ln), "")
        print(f"graph_probe {v:10s} exit {r.returncode}: {last[:160]}  {err[:160]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
