"""Issue 14 item 6: what Triton 3.6 allows for the INT8 GEMM on sm_90, measured beside the pack's kernel.

Variants (same epilogue: per-token x per-channel dequant + bias, bf16 out; int32 accumulation is exact, so every
variant must give bit-identical outputs to the pack's kernel, which is checked before timing):
  pack          kernel.int8_gemm: the non-persistent kernel, autotuned (what the pack runs)
  tma           persistent kernel, one program per SM looping over tiles, A / W tiles through TMA descriptors
                (host ``TensorDescriptor``), grouped tile order
  tma_ws        the same with Triton's warp specialisation of the K loop (``tl.range(warp_specialize=True)``),
                where this Triton supports it on this GPU
and, for the hardware's reach: ``torch._scaled_mm`` FP8 e4m3 rowwise (cuBLAS, the same 8-bit tensor-core rate as
INT8 on Hopper) and bf16 ``F.linear``.

    python bench/gemm_variants.py [--out bench/results/h200-gemm-variants.json]
    TRITON_INTERPRET=1 python bench/gemm_variants.py --cpu     # tiny shapes: bit-exactness only (smoke test)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from kernel.gemm import _store_out  # noqa: E402  (the pack's epilogue store: RNE bf16 under the interpreter too)
from kernel.quantize import INTERPRET  # noqa: E402

SHAPES = [  # (label, M, N, K): Ideogram 4's block GEMMs at 1024² (cond pass), the long-K text projection, Flux
    ("ideogram4 qkv", 4608, 13824, 4608),
    ("ideogram4 o", 4608, 4608, 4608),
    ("ideogram4 w1/w3", 4608, 24576, 4608),
    ("ideogram4 w2", 4608, 4608, 12288),
    ("ideogram4 llm_cond_proj", 512, 4608, 53248),
]


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    group = GROUP_M * num_pid_n
    first_m = (tile // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % group) % size_m, (tile % group) // size_m


@triton.jit
def _int8_gemm_tma_kernel(a_desc, w_desc, c_ptr, as_ptr, ws_ptr, bias_ptr, M, N, K, stride_cm,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                          WARP_SPECIALIZE: tl.constexpr, INTERPRET: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for kk in range(k_tiles):
            a = a_desc.load([off_m, kk * BLOCK_K])          # out-of-range rows / K read as zero
            w = w_desc.load([off_n, kk * BLOCK_K])
            acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        a_s = tl.load(as_ptr + offs_m, mask=offs_m < M, other=0.0)
        w_s = tl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)
        out = acc.to(tl.float32) * a_s[:, None] * w_s[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        _store_out(c_ptrs, out, (offs_m[:, None] < M) & (offs_n[None, :] < N), INTERPRET)


def int8_gemm_tma(a_q, a_scale, w_q, w_scale, bias, out_dtype, cfg, num_sms, warp_specialize=False):
    m, k = a_q.shape
    n = w_q.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    out = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    a_desc = TensorDescriptor.from_tensor(a_q, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w_q, [bn, bk])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = (min(num_sms, tiles),)
    _int8_gemm_tma_kernel[grid](a_desc, w_desc, out, a_scale, w_scale, bias if bias is not None else a_scale,
                                m, n, k, out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
                                NUM_SMS=num_sms, HAS_BIAS=bias is not None, WARP_SPECIALIZE=warp_specialize,
                                INTERPRET=INTERPRET,
                                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def tma_configs(cpu: bool) -> list[dict]:
    if cpu:
        return [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2)]
    out = []
    for bm, bn, bk, w, s in ((128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 64, 8, 4),
                             (128, 256, 128, 8, 3)):
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s))
    return out


def bench_us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny shapes under TRITON_INTERPRET=1, exactness only")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cuda = not a.cpu
    if cuda and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu with TRITON_INTERPRET=1)")
        return 2
    import kernel
    dev = "cuda" if cuda else "cpu"
    if cuda:
        # TMA descriptors built in the kernel need a scratch allocator; host descriptors do not, set it anyway
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 4
    shapes = SHAPES if cuda else [("tiny", 40, 48, 96), ("tiny tails", 33, 50, 64)]
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    t_start = time.perf_counter()
    for label, m, n, k in shapes:
        a_q = torch.randint(-127, 128, (m, k), generator=g, device=dev, dtype=torch.int8)
        w_q = torch.randint(-127, 128, (n, k), generator=g, device=dev, dtype=torch.int8)
        a_s = torch.rand(m, generator=g, device=dev) * 1e-3 + 1e-4
        w_s = torch.rand(n, generator=g, device=dev) * 1e-3 + 1e-4
        bias = torch.randn(n, generator=g, device=dev).to(torch.bfloat16)
        ref = kernel.int8_gemm(a_q, a_s, w_q, w_s, bias, out_dtype=torch.bfloat16)
        ops = 2 * m * n * k
        row = {"shape": label, "M": m, "N": n, "K": k}
        if cuda:
            row["pack_us"] = bench_us(lambda: kernel.int8_gemm(a_q, a_s, w_q, w_s, bias, out_dtype=torch.bfloat16))
            x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
            w = torch.randn(n, k, generator=g, device=dev).to(torch.bfloat16)
            row["bf16_us"] = bench_us(lambda: torch.nn.functional.linear(x, w, bias))
            try:
                x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
                sa, sw = a_s.view(-1, 1).contiguous(), w_s.view(1, -1).contiguous()
                row["fp8_scaled_mm_us"] = bench_us(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sa, scale_b=sw,
                                                                            bias=bias, out_dtype=torch.bfloat16))
            except Exception as e:  # noqa: BLE001  (reported, not hidden)
                row["fp8_scaled_mm"] = f"{type(e).__name__}: {e}"[:200]
        for ws in (False, True):
            name = "tma_ws" if ws else "tma"
            best = None
            for cfg in tma_configs(not cuda)[:2 if ws else None]:
                tag = f"M{cfg['BLOCK_M']}_N{cfg['BLOCK_N']}_K{cfg['BLOCK_K']}_w{cfg['num_warps']}_s{cfg['num_stages']}"
                try:
                    out = int8_gemm_tma(a_q, a_s, w_q, w_s, bias, torch.bfloat16, cfg, num_sms, ws)
                    exact = bool(torch.equal(out, ref))
                    us = bench_us(lambda: int8_gemm_tma(a_q, a_s, w_q, w_s, bias, torch.bfloat16, cfg, num_sms,
                                                        ws)) if cuda else None
                except Exception as e:  # noqa: BLE001  (a variant this Triton cannot build is a finding)
                    row.setdefault(f"{name}_errors", []).append(f"{tag}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                row.setdefault(f"{name}_all", {})[tag] = {"us": us, "bit_exact": exact}
                if not exact:
                    continue
                if best is None or (us is not None and us < best[1]):
                    best = (tag, us)
            if best:
                row[f"{name}_best"], row[f"{name}_us"] = best
        if cuda:
            for key in ("pack_us", "tma_us", "tma_ws_us", "fp8_scaled_mm_us", "bf16_us"):
                if row.get(key):
                    row[key.replace("_us", "_tops")] = ops / row[key] / 1e6
        rows.append(row)
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                          if cuda is False or not k.endswith("_all")}), flush=True)
        write(a.out, cuda, rows)  # after every shape: a run cut short keeps what it measured
    if cuda:
        print(f"\n{'shape':<26}{'pack':>16}{'tma':>16}{'tma_ws':>16}{'fp8 cuBLAS':>16}{'bf16':>16}  (us, TOP/s)")
        for r in rows:
            cells = []
            for key in ("pack", "tma", "tma_ws", "fp8_scaled_mm", "bf16"):
                us = r.get(f"{key}_us")
                cells.append(f"{us:7.1f} {r[key + '_tops']:6.0f}  " if us else f"{'-':>14}  ")
            print(f"{r['shape']:<26}" + "".join(cells))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


def write(out: str | None, cuda: bool, rows: list) -> None:
    if out:
        doc = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
               "triton": triton.__version__, "rows": rows}
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    if "--cpu" in sys.argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
