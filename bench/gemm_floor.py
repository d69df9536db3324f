"""Issue 14 item 6: what bounds the pack's INT8 GEMM on this GPU: the L2 -> SM traffic of its tiles or the tensor cores.

Three probes (standalone Triton kernels; nothing here is used by the pack):
  l2_read   every SM reads a buffer that L2 holds (16 and 32 MiB), again and again: L2 read bandwidth
  hbm_read  the same over 2 GiB: HBM read bandwidth
  math      the pack's tile loop (128 x 128 x 128 int8 tiles, 8 warps, 2 CTAs an SM; also 1 CTA an SM, and the
            128 x 256 tile whose wgmma is n256) with its tiles loaded once before the loop: tensor-core throughput
            of ``tl.dot`` int8 -> int32 at that tile shape, no loads. Triton 3.6 issues int8 dots as wgmma n128 at
            most (its layout choice; Gluon's n256 int8 wgmma fails its NVGPU lowering: "WGMMA type or shape is not
            supported"), fp8 and bf16 as n256; ptxas accepts s8 n256 (``m64n256k32.s32.s8.s8``). So the probe
            also runs fp8 at 128 x 256 and, to time what the missing instruction shape would give, the fp8 build
            with its wgmma rewritten to s8 n256 in the PTX and assembled with Triton's ptxas ("int8 n256
            (patched)": the same operand layout, only the instruction's types change; its output is not checked)
Then per GEMM shape (bench/shapes.py's block shapes of Ideogram 4, Flux.1, Z-Image): the bytes a tile loop moves
from L2 to the SMs (every output tile reads its A rows and W rows once: tiles x K x (BLOCK_M + BLOCK_N)), the rate
at which the pack's GEMM moves them (run bv: 9.4-10.5 TB/s, above what the read probe reaches, so the probe measures its
own latency and the GEMMs' rate is the best L2 figure) and the int ops / tensor-core floor, beside the pack's GEMM
(kernel.gemm.launch_int8_gemm, its tuned config) and torch._scaled_mm FP8 (cuBLAS, ComfyUI's fp8_e4m3fn_fast) timed
here. Timing: triton.testing.do_bench medians (L2 flushed before each call for the GEMMs; not for l2_read, whose
point is a warm L2).

    python bench/gemm_floor.py [--out bench/results/h200-gemm-floor.json]
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
import triton.language as tl  # noqa: E402

from kernel import gemm  # noqa: E402

SHAPES = [  # (label, M, N, K)
    ("ideogram4 qkv M4608", 4608, 13824, 4608),
    ("ideogram4 o M4608", 4608, 4608, 4608),
    ("ideogram4 w1/w3 M4608", 4608, 24576, 4608),
    ("ideogram4 w2 M4608", 4608, 4608, 12288),
    ("ideogram4 qkv M4096", 4096, 13824, 4608),
    ("flux1 single linear1", 4608, 21504, 3072),
    ("z-image qkv", 4352, 11520, 3840),
]


@triton.jit
def _read_kernel(src, out, n_chunks, reps, CHUNK: tl.constexpr):
    """Each program XORs its share of ``src``'s CHUNK-element chunks ``reps`` times (int32 elements)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], dtype=tl.int32)
    for _ in range(reps):
        for c in range(pid, n_chunks, nprog):
            acc ^= tl.load(src + c * CHUNK + offs, cache_modifier=".cg")
    tl.store(out + pid * CHUNK + offs, acc)


@triton.jit
def _math_kernel(a_ptr, b_ptr, out, k_steps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 INT: tl.constexpr):
    """k_steps dots of one A tile and one W tile loaded before the loop (the GEMM's main loop without its loads);
    INT: int8 -> int32, else fp8 e4m3 -> fp32."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + (pid % 8) * BLOCK_M * BLOCK_K + rm[:, None] * BLOCK_K + rk[None, :])
    b = tl.load(b_ptr + rn[None, :] * BLOCK_K + rk[:, None])
    if INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for _ in range(k_steps):
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(k_steps):
            acc = tl.dot(a, b, acc)
    tl.store(out + pid * BLOCK_N + rn, tl.sum(acc, axis=0).to(tl.float32))


def patched_s8_n256(consts: dict, num_warps: int):
    """``_math_kernel`` built for fp8 (n256 wgmma) with each wgmma rewritten to s8 n256
    (``bench.gemm_n256.rewrite_s8``): a CompiledKernel whose launch takes every argument."""
    from triton.compiler import ASTSource

    from bench.gemm_n256 import rewrite_s8
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out": "*fp32", "k_steps": "i32",
           **{c: "constexpr" for c in consts}}
    k = triton.compile(ASTSource(fn=_math_kernel, signature=sig, constexprs=consts),
                       options={"num_warps": num_warps, "num_stages": 1})
    rewrite_s8(k)
    return k


def read_bandwidth(nbytes: int, reps: int, programs: int) -> float:
    """GB/s of ``_read_kernel`` over an nbytes buffer read ``reps`` times by ``programs`` programs (L2 not flushed)."""
    chunk = 4096  # int32 elements: 16 KiB a load step, 16 a thread at 8 warps
    n = nbytes // 4 // chunk * chunk
    src = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
    out = torch.empty(programs * chunk, dtype=torch.int32, device="cuda")
    fn = lambda: _read_kernel[(programs,)](src, out, n // chunk, reps, CHUNK=chunk, num_warps=8)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.Event(enable_timing=True)
    h = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        g.record()
        fn()
        h.record()
        h.synchronize()
        times.append(g.elapsed_time(h))
    ms = sorted(times)[len(times) // 2]
    return n * 4 * reps / (ms * 1e-3) / 1e9


def math_tops(cfg: dict, sms: int, per_sm: int = 2, k_steps: int = 2048, fp8: bool = False,
              patched: bool = False) -> float:
    """Tensor-core TOP/s of the tile loop with ``cfg``'s tile and warps, ``sms * per_sm`` programs (one wave);
    ``fp8``: e4m3 operands (Triton 3.6 issues them as n256 wgmma where the tile allows; int8 only up to n128)."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a = torch.randint(-127, 128, (8 * bm, bk), dtype=torch.int8, device="cuda")
    b = torch.randint(-127, 128, (bn, bk), dtype=torch.int8, device="cuda")
    if fp8:
        a, b = (t.float().div(64).to(torch.float8_e4m3fn) for t in (a, b))
    progs = sms * per_sm
    out = torch.empty(progs * bn, dtype=torch.float32, device="cuda")
    if patched:  # the fp8 build rewritten to s8 n256: int8 operands, read as the same bytes
        a, b = (t.view(torch.float8_e4m3fn) for t in (a, b))
        consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "INT": False}
        run = patched_s8_n256(consts, cfg["num_warps"])[(progs, 1, 1)]
        fn = lambda: run(a, b, out, k_steps, *consts.values())  # noqa: E731
    else:
        fn = lambda: _math_kernel[(progs,)](a, b, out, k_steps, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,  # noqa: E731
                                            INT=not fp8, num_warps=cfg["num_warps"], num_stages=1)
    ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    return 2.0 * bm * bn * bk * k_steps * progs / (ms * 1e-3) / 1e12


def int8_operands(m: int, n: int, k: int):
    """Seeded random int8 A [M, K] and W [N, K], fp32 scales, a bf16 [M, N] output buffer (on the GPU)."""
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
    a_s = torch.rand(m, device="cuda", generator=g) * 1e-3
    w_s = torch.rand(n, device="cuda", generator=g) * 1e-3
    return a, w, a_s, w_s, torch.empty((m, n), dtype=torch.bfloat16, device="cuda")


def fp8_cublas_us(m: int, n: int, k: int, bench) -> float:
    """``bench(fn)`` -> µs of torch._scaled_mm on e4m3 operands with scale 1 (ComfyUI's fp8_e4m3fn_fast GEMM)."""
    x8 = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    w8 = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    return bench(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))


def finish_row(row: dict, m: int, n: int, k: int, bench) -> dict:
    """``row`` with cuBLAS FP8's time beside its ``us`` (µs a variant, or the error a variant raised) and ``tops``
    (TOP/s of each timed one)."""
    row["us"]["fp8_cublas"] = fp8_cublas_us(m, n, k, bench)
    ops = 2.0 * m * n * k
    row["tops"] = {p: round(ops / u / 1e6, 1) for p, u in row["us"].items() if isinstance(u, float)}
    return row


def gemm_row(label: str, m: int, n: int, k: int, math: float) -> dict:
    a, w, a_s, w_s, out = int8_operands(m, n, k)
    cfg = gemm.select_config(a, a_s, w, w_s, None, out)
    pack_us = gemm.timed_ms(lambda: gemm.launch_int8_gemm(a, a_s, w, w_s, None, out, cfg)) * 1e3
    fp8_us = fp8_cublas_us(m, n, k, lambda f: gemm.timed_ms(f) * 1e3)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tiles = -(-m // bm) * -(-n // bn)
    l2_bytes = tiles * k * (bm + bn) + m * n * 2  # tile loads + the bf16 output
    ops = 2.0 * m * n * k
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
    return {"shape": label, "M": m, "N": n, "K": k, "cfg": {x: cfg[x] for x in keys},
            "tiles": tiles, "l2_mib": round(l2_bytes / 2**20, 1), "pack_us": round(pack_us, 1),
            "fp8_cublas_us": round(fp8_us, 1), "pack_tops": round(ops / pack_us / 1e6, 1),
            "fp8_tflops": round(ops / fp8_us / 1e6, 1),
            "tile_reads_tbs": round(l2_bytes / (pack_us * 1e-6) / 1e12, 2),
            "math_floor_us": round(ops / (math * 1e12) * 1e6, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gemm_floor.py needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    res = {"provenance": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "gpu": props.name, "sms": sms, "torch": torch.__version__, "triton": triton.__version__,
                          "commit": provenance.commit()}}
    bw = {}
    for label, nbytes, reps, per_sm in (("l2_read 16 MiB", 16 << 20, 64, 8), ("l2_read 32 MiB", 32 << 20, 32, 8),
                                        ("l2_read 16 MiB, 4 programs an SM", 16 << 20, 64, 4),
                                        ("hbm_read 2 GiB", 2 << 30, 1, 8)):
        bw[label] = round(read_bandwidth(nbytes, reps, sms * per_sm), 1)
        print(f"{label:34s} {bw[label] / 1e3:7.2f} TB/s", flush=True)
    res["read_gbs"] = bw
    res["math_tops"] = {}
    for kind, bn, per_sm in (("int8", 128, 2), ("int8", 128, 1), ("int8", 256, 1), ("fp8", 128, 2), ("fp8", 256, 1),
                             ("int8 n256 (patched)", 256, 1)):
        cfg = {"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": 128, "num_warps": 8}
        key = f"{kind} 128x{bn}x128, 8 warps, {per_sm} CTA an SM"
        try:
            res["math_tops"][key] = round(math_tops(cfg, sms, per_sm, fp8=kind == "fp8", patched="patched" in kind), 1)
        except Exception as e:  # noqa: BLE001 - the patched probe depends on ptxas and the PTX's form: reported
            res["math_tops"][key] = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"math {key:40s} {res['math_tops'][key]} TOP/s", flush=True)
    math = res["math_tops"]["int8 128x128x128, 8 warps, 2 CTA an SM"]  # the pack's tile as it runs
    res["rows"] = []
    for label, m, n, k in SHAPES:
        r = gemm_row(label, m, n, k, math)
        res["rows"].append(r)
        print(f"{label:24s} {m}x{n}x{k}  L2 {r['l2_mib']:7.1f} MiB  pack {r['pack_us']:7.1f} us "
              f"({r['pack_tops']:6.1f} TOP/s, tiles read {r['tile_reads_tbs']:5.2f} TB/s)  fp8 cuBLAS "
              f"{r['fp8_cublas_us']:7.1f} us  math floor {r['math_floor_us']:6.1f} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
