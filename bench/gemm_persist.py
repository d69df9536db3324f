"""Issue 14, an experiment: the s8 wgmma n256 GEMM (``kernel.s8wgmma``'s rewrite) as a persistent kernel.

Why: at 128 x 256 tiles one CTA fills an SM, so each tile's epilogue and the next CTA's pipeline fill leave the
tensor cores idle (the pack's s8 kernel: ~30 us a tile of w1/w3 at 1272 TOP/s, against ~25 us at the 700 W
clock's ~1.6 POP/s). A persistent kernel whose tile loop is flattened into the K loop (``tl.range(flatten=True)``)
lets the loads of the next tile start during the epilogue; Triton's Hopper warp specialisation
(``warp_specialize=True``: a TMA producer warp group, MMA consumers) is the other form Triton 3.6 offers. Built for
the operands viewed as fp8 and rewritten to s8 as the pack does; the int32 sums are checked against
``torch._int_mm`` and the bf16 output against the pack's, bit for bit, before timing.

Variants (128 x 256 x 128, 8 warps, 3 stages unless named):
  pack          kernel.gemm with its own pick (the non-persistent s8 tile where it wins)
  flat          persistent, A / W tiles through host TMA descriptors, tile loop flattened, pointer-store epilogue
  flat_tma_st   the same with a TMA store of the bf16 tile in two 128 x 128 halves
  ws            persistent, TMA loads, warp-specialised tile loop (a TMA producer group + two 64-row MMA
                consumer groups; 12 warps), pointer-store epilogue; ws_s4: 4 stages; ws_k64_s6: BLOCK_K 64 x 6
                (Triton 3.6 fails to build the warp-specialised loop with the split TMA store)

    python bench/gemm_persist.py [--out F] [--only REGEX]
    python bench/gemm_persist.py --check-build      # build + rewrite for sm_90 here (no GPU): regs, spills, wgmma
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
import triton.language as tl  # noqa: E402

from bench import provenance  # noqa: E402
from bench.gemm_floor import SHAPES, finish_row, int8_operands  # noqa: E402
from kernel import s8wgmma  # noqa: E402

BM, BN = 128, 256
VARIANTS = {  # name -> (WS, TMA_STORE, stages, warps (with WS a partition's), BLOCK_K)
    "flat": (False, False, 3, 8, 128),
    "flat_tma_st": (False, True, 3, 8, 128),
    "ws": (True, False, 3, 4, 128),
    "ws_s4": (True, False, 4, 4, 128),
    "ws_k64_s6": (True, False, 6, 4, 64),
}


@triton.jit
def _persist(a_desc, w_desc, o_desc, out_ptr, a_scale, w_scale, M, N, K, NUM_SMS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
             WS: tl.constexpr, TMA_STORE: tl.constexpr, OUT_INT: tl.constexpr):
    """out = (a . w^T) * a_scale[:, None] * w_scale[None, :] in bf16 (OUT_INT: the int32 sums), one program an SM
    looping over tiles in grouped order. The accumulator holds int32 bits (the s8 rewrite of this fp8 build)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=not WS, warp_specialize=WS):
        group = GROUP_M * num_n
        first_m = (tile // group) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        off_m = (first_m + (tile % group) % size_m) * BLOCK_M
        off_n = ((tile % group) // size_m) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            a = a_desc.load([off_m, kk * BLOCK_K])
            w = w_desc.load([off_n, kk * BLOCK_K])
            acc = tl.dot(a, w.T, acc)
        acc_i = acc.to(tl.int32, bitcast=True)
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        if OUT_INT:
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc_i, mask=(rm[:, None] < M) & (rn[None, :] < N))
        else:
            y = acc_i.to(tl.float32) * tl.load(a_scale + rm, mask=rm < M, other=0.0)[:, None]
            y = (y * tl.load(w_scale + rn, mask=rn < N, other=0.0)[None, :]).to(tl.bfloat16)
            if TMA_STORE:
                y0, y1 = tl.split(tl.permute(tl.reshape(y, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
                o_desc.store([off_m, off_n], y0)
                o_desc.store([off_m, off_n + BLOCK_N // 2], y1)
            else:
                tl.store(out_ptr + rm[:, None] * N + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


def build(name: str, out_int: bool, sms: int, target=None):
    """The CompiledKernel of variant ``name``, fp8 build rewritten to s8; returns (kernel, rewritten count,
    wgmma shapes, constexprs)."""
    from triton.compiler import ASTSource
    ws, tma_st, stages, warps, bk = VARIANTS[name]
    sig = {"a_desc": f"tensordesc<fp8e4nv[{BM}, {bk}]>", "w_desc": f"tensordesc<fp8e4nv[{BN}, {bk}]>",
           "o_desc": f"tensordesc<bf16[{BM}, {BN // 2}]>", "out_ptr": "*i32" if out_int else "*bf16",
           "a_scale": "*fp32", "w_scale": "*fp32", "M": "i32", "N": "i32", "K": "i32"}
    consts = {"NUM_SMS": sms, "BLOCK_M": BM, "BLOCK_N": BN, "BLOCK_K": bk, "GROUP_M": 8, "WS": ws,
              "TMA_STORE": tma_st and not out_int, "OUT_INT": out_int}
    sig.update({c: "constexpr" for c in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in (3, 4, 5, 6, 7, 8)}
    kw = {} if target is None else {"target": target}
    # the int32 build (the exactness check's) converts its 128 x 256 int32 tile through 128 KiB of shared memory:
    # two stages keep it under the 227 KiB an SM has (its sums do not depend on the stage count)
    k = triton.compile(ASTSource(fn=_persist, signature=sig, constexprs=consts, attrs=attrs),
                       options={"num_warps": warps, "num_stages": 2 if out_int else stages}, **kw)
    shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+\.\w+\.\w+\.\w+)", k.asm["ptx"])))
    ptx, n = s8wgmma.rewrite_ptx(k.asm["ptx"])
    k.kernel = s8wgmma.assemble(ptx, k.metadata.target.arch)
    return k, n, shapes, consts


def run_shape(label, m, n, k, sms, only_variants=None):
    from triton.tools.tensor_descriptor import TensorDescriptor
    from kernel import gemm
    a, w, a_s, w_s, out = int8_operands(m, n, k)
    ref = torch._int_mm(a, w.t())
    a8, w8 = a.view(torch.float8_e4m3fn), w.view(torch.float8_e4m3fn)
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median") * 1e3  # noqa: E731
    row = {"shape": label, "M": m, "N": n, "K": k, "us": {}, "exact": {}, "build": {}}
    cfg = gemm.select_config(a, a_s, w, w_s, None, out, tail_split=False)
    row["pack_cfg"] = str(cfg)
    row["us"]["pack"] = bench(lambda: gemm.launch_int8_gemm(a, a_s, w, w_s, None, out, cfg))
    y_pack = out.clone()
    tiles = triton.cdiv(m, BM) * triton.cdiv(n, BN)
    grid = (min(sms, tiles), 1, 1)
    for name, (_, _, _, _, bk) in VARIANTS.items():
        if only_variants and not re.search(only_variants, name):
            continue
        try:
            da = TensorDescriptor.from_tensor(a8, [BM, bk])
            dw = TensorDescriptor.from_tensor(w8, [BN, bk])
            o32 = torch.empty((m, n), dtype=torch.int32, device="cuda")
            do32 = TensorDescriptor.from_tensor(out, [BM, BN // 2])  # unused when OUT_INT
            kc, _, _, ci = build(name, True, sms)
            kc[grid](da, dw, do32, o32, a_s, w_s, m, n, k, *ci.values())  # a compiled launch takes constexprs too
            row["exact"][name + " int32 == _int_mm"] = bool(torch.equal(o32, ref))
            del o32
            out.zero_()
            do = TensorDescriptor.from_tensor(out, [BM, BN // 2])
            kb, nrew, shapes, cb = build(name, False, sms)
            run = kb[grid]
            cv = list(cb.values())
            run(da, dw, do, out, a_s, w_s, m, n, k, *cv)
            row["exact"][name + " bf16 == pack"] = bool(torch.equal(out, y_pack))
            row["us"][name] = bench(lambda: run(da, dw, do, out, a_s, w_s, m, n, k, *cv))
            row["build"][name] = {"wgmma": nrew, "from": shapes, "regs": kb.n_regs, "spills": kb.n_spills}
        except Exception as e:  # noqa: BLE001 - reported: what Triton builds here is the question
            row["us"][name] = f"{type(e).__name__}: {str(e)[:300]}"
    return finish_row(row, m, n, k, bench)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="regex on the shape label")
    ap.add_argument("--variants", default=None, help="regex on the variant names")
    ap.add_argument("--check-build", action="store_true", help="build and rewrite for sm_90 only (no GPU needed)")
    args = ap.parse_args()
    if args.check_build:
        from triton.backends.compiler import GPUTarget
        for name in VARIANTS:
            for out_int in (True, False):
                try:
                    kc, nrew, shapes, _ = build(name, out_int, 132, target=GPUTarget("cuda", 90, 32))
                    print(f"{name:12s} out {'int32' if out_int else 'bf16 '}: {nrew} wgmma {shapes} -> s8; "
                          f"cubin {len(kc.kernel)} bytes", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"{name:12s} out {'int32' if out_int else 'bf16 '}: {type(e).__name__}: {str(e)[:400]}")
        return 0
    if not torch.cuda.is_available():
        sys.exit("bench/gemm_persist.py needs a CUDA GPU (or --check-build)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"provenance": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "triton": triton.__version__, "commit": provenance.commit(), "sms": sms}, "rows": []}
    for label, m, n, k in SHAPES:
        if args.only and not re.search(args.only, label):
            continue
        r = run_shape(label, m, n, k, sms, args.variants)
        res["rows"].append(r)
        cells = "  ".join(f"{p} {u:.1f}" if isinstance(u, float) else f"{p} {u}" for p, u in r["us"].items())
        print(f"{label:24s} {m}x{n}x{k}  us: {cells}\n{'':24s} exact: {r['exact']}\n{'':24s} build: {r['build']}",
              flush=True)
        print(f"{'':24s} TOP/s: " + "  ".join(f"{p} {t}" for p, t in r["tops"].items()), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
