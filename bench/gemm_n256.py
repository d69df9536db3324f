"""Issue 14 item 6, an experiment: the INT8 GEMM with 128 x 256 tiles issued as s8 wgmma n256, which Triton 3.6 cannot
emit (``tl.dot`` on int8 picks m64n128k32 at most; Gluon's int8 n256 ``warpgroup_mma`` fails Triton's NVGPU lowering
with "WGMMA type or shape is not supported"; ptxas accepts ``wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8``).

How: the kernel below is written once; built with fp8 (e4m3) operand types, Triton issues its dot as
``m64n256k32.f32.e4m3.e4m3`` with the same operand layout (8-bit, K-major in shared memory) that s8 wgmma uses. The
PTX's wgmma instructions are rewritten to ``.s32.s8.s8`` (integer wgmma has no operand-scale immediates), the PTX is
assembled with Triton's ptxas, and the int8 tensors are passed as the same bytes viewed as fp8. The accumulator
registers then hold int32 sums; the epilogue reads them back with a bitcast (a no-op in the PTX). Not part of the
pack: this measures what the missing instruction shape is worth before anyone builds on such a rewrite.

Per shape (Ideogram 4 / Flux.1 block GEMMs): the int32 sums of the rewritten kernel against ``torch._int_mm`` (bit
for bit), then do_bench medians (L2 flushed) of
  pack         kernel.gemm.launch_int8_gemm with its tuned config (128 x 128 tiles, n128, 2 CTAs an SM)
  n128_256     this kernel built for int8: 128 x 256 tiles as Triton issues them (n128)
  n256_s8      this kernel rewritten to s8 n256 (BLOCK_K 128 x 3 stages and 64 x 4)
  fp8_triton   this kernel on fp8 data as Triton builds it (n256; a reference, not int8)
  fp8_cublas   torch._scaled_mm (ComfyUI's fp8_e4m3fn_fast)

    python bench/gemm_n256.py [--out bench/results/h200-gemm-n256.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from bench import provenance  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.gemm_floor import SHAPES, finish_row, int8_operands  # noqa: E402  (Ideogram 4 / Flux.1 / Z-Image)
from kernel import s8wgmma  # noqa: E402

VARIANTS = [  # (name, BLOCK_K, stages)
    ("n256_s8 k128x3", 128, 3),
    ("n256_s8 k64x4", 64, 4),
]


@triton.jit
def _gemm(a_ptr, w_ptr, out_ptr, a_scale, w_scale, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, S8: tl.constexpr, OUT_INT: tl.constexpr):
    """out[M, N] = (a[M, K] . w[N, K]^T) * a_scale[:, None] * w_scale[None, :] in bf16 (OUT_INT: the int32 sums).
    S8: the accumulator holds int32 bits (the s8 rewrite of an fp8 build); else its float values (int8 or fp8
    builds as Triton makes them). M, N, K multiples of BLOCK_M, BLOCK_N, BLOCK_K."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * K + rk[None, :]  # int32 offsets: M * K, N * K, M * N < 2**31 (run_shape checks)
    w_ptrs = w_ptr + rn[None, :] * K + rk[:, None]
    if a_ptr.dtype.element_ty == tl.int8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs)  # M % BLOCK_M == N % BLOCK_N == 0 (run_shape checks)
        w = tl.load(w_ptrs)
        if a_ptr.dtype.element_ty == tl.int8:
            acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if S8:
        acc_i = acc.to(tl.int32, bitcast=True)
    else:
        acc_i = acc.to(tl.int32)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    o_ptrs = out_ptr + rm[:, None] * N + rn[None, :]
    if OUT_INT:
        tl.store(o_ptrs, acc_i, mask=mask)
    else:
        y = acc_i.to(tl.float32) * tl.load(a_scale + rm, mask=rm < M, other=0.0)[:, None]
        y = y * tl.load(w_scale + rn, mask=rn < N, other=0.0)[None, :]
        tl.store(o_ptrs, y.to(tl.bfloat16), mask=mask)


def build(bk: int, stages: int, s8: bool, out_int: bool, target=None, warps: int = 8):
    """A CompiledKernel of ``_gemm`` at 128 x 256 x bk: the fp8 build, its wgmma rewritten to s8 when ``s8``
    (returns (kernel, rewritten instruction count, wgmma shapes in the PTX))."""
    from triton.compiler import ASTSource
    ty = "*fp8e4nv"
    sig = {"a_ptr": ty, "w_ptr": ty, "out_ptr": "*i32" if out_int else "*bf16", "a_scale": "*fp32",
           "w_scale": "*fp32", "M": "i32", "N": "i32", "K": "i32"}
    consts = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": bk, "GROUP_M": 8, "S8": s8, "OUT_INT": out_int}
    sig.update({c: "constexpr" for c in consts})
    kw = {} if target is None else {"target": target}
    # pointers 16-byte aligned, M / N / K multiples of 16: what a JIT launch specializes on (without it the loads
    # are not pipelined through cp.async)
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(8)}
    k = triton.compile(ASTSource(fn=_gemm, signature=sig, constexprs=consts, attrs=attrs),
                       options={"num_warps": warps, "num_stages": stages}, **kw)
    shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+\.\w+\.\w+\.\w+)", k.asm["ptx"])))
    return k, rewrite_s8(k) if s8 else 0, shapes, consts


def rewrite_s8(k) -> int:
    """Rewrite the fp8 wgmma instructions of the CompiledKernel ``k``'s PTX to s8 and make the result, assembled
    with Triton's ptxas, ``k``'s binary (before its first launch): ``kernel.s8wgmma``'s rewrite, which the pack
    uses. Returns how many instructions were rewritten."""
    ptx, n = s8wgmma.rewrite_ptx(k.asm["ptx"])
    k.kernel = s8wgmma.assemble(ptx, k.metadata.target.arch)
    return n


def run_shape(label, m, n, k):
    from kernel import gemm
    a, w, a_s, w_s, out = int8_operands(m, n, k)
    assert m % 128 == 0 and n % 256 == 0 and max(m * k, n * k, m * n) < 2**31, "whole tiles, int32 offsets"
    ref = torch._int_mm(a, w.t())
    grid = (triton.cdiv(m, 128) * triton.cdiv(n, 256), 1, 1)
    a8, w8 = a.view(torch.float8_e4m3fn), w.view(torch.float8_e4m3fn)
    row = {"shape": label, "M": m, "N": n, "K": k, "us": {}, "exact": {}}
    bench = lambda f: triton.testing.do_bench(f, warmup=20, rep=100, return_mode="median") * 1e3  # noqa: E731
    cfg = gemm.select_config(a, a_s, w, w_s, None, out, tail_split=False)
    row["us"]["pack"] = bench(lambda: gemm.launch_int8_gemm(a, a_s, w, w_s, None, out, cfg))
    y_pack = out.clone()
    for name, bk, stages in VARIANTS:
        if k % bk:
            continue
        try:
            kc, _, _, consts = build(bk, stages, True, True)
            o32 = torch.empty((m, n), dtype=torch.int32, device="cuda")
            kc[grid](a8, w8, o32, a_s, w_s, m, n, k, *consts.values())
            row["exact"][name] = bool(torch.equal(o32, ref))
            kb, nrew, shapes, consts = build(bk, stages, True, False)
            run = kb[grid]
            row["us"][name] = bench(lambda: run(a8, w8, out, a_s, w_s, m, n, k, *consts.values()))
            row.setdefault("rewritten", {})[name] = {"wgmma": nrew, "from": shapes, "regs": kb.n_regs,
                                                     "spills": kb.n_spills}
            # the epilogue rounds as the pack's does (fp32 product of the int32 sum and the two scales, then bf16)
            row["exact"][name + " vs pack (bf16 out)"] = bool(torch.equal(out, y_pack))
        except Exception as e:  # noqa: BLE001 - reported: the rewrite depends on the PTX's form and on ptxas
            row["us"][name] = f"{type(e).__name__}: {str(e)[:300]}"
    # Triton's own builds of the same kernel: int8 (n128 at this tile) and fp8 (n256)
    for name, a_, w_ in (("n128_256 (int8, Triton)", a, w), ("fp8_triton (n256)", a8, w8)):
        try:
            f = _gemm[(grid[0],)]
            bk = 128
            args = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=bk, GROUP_M=8, S8=False, OUT_INT=False, num_warps=8,
                        num_stages=3)
            row["us"][name] = bench(lambda: f(a_, w_, out, a_s, w_s, m, n, k, **args))
        except Exception as e:  # noqa: BLE001
            row["us"][name] = f"{type(e).__name__}: {str(e)[:300]}"
    return finish_row(row, m, n, k, bench)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="regex on the shape label")
    ap.add_argument("--check-build", action="store_true", help="build and rewrite for sm_90 only (no GPU needed)")
    args = ap.parse_args()
    if args.check_build:
        from triton.backends.compiler import GPUTarget
        for _, bk, stages in VARIANTS:
            for out_int in (True, False):
                kc, nrew, shapes, _ = build(bk, stages, True, out_int, target=GPUTarget("cuda", 90, 32))
                print(f"BLOCK_K {bk} x {stages} stages, out {'int32' if out_int else 'bf16'}: {nrew} wgmma {shapes} "
                      f"-> s8; cubin {len(kc.kernel)} bytes")
        return 0
    if not torch.cuda.is_available():
        sys.exit("bench/gemm_n256.py needs a CUDA GPU (or --check-build)")
    res = {"provenance": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "triton": triton.__version__, "commit": provenance.commit()}, "rows": []}
    for label, m, n, k in SHAPES:
        if args.only and not re.search(args.only, label):
            continue
        r = run_shape(label, m, n, k)
        res["rows"].append(r)
        cells = "  ".join(f"{p} {u:.1f}" if isinstance(u, float) else f"{p} {u}" for p, u in r["us"].items())
        print(f"{label:24s} {m}x{n}x{k}  us: {cells}  exact: {r['exact']}", flush=True)
        print(f"{'':24s} TOP/s: " + "  ".join(f"{p} {t}" for p, t in r["tops"].items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
