"""W8A8 linears on the GPU, every competitor side by side in one run (issue 3).

    python bench/kernels.py --out bench/results/h200-kernels.json [--commit HASH]

First checks the compiled kernels (quantizer bit-exact vs quant.quantize, int32 accumulator bit-exact vs
torch._int_mm / an int64 matmul, epilogue vs a float64 reference), then times each Ideogram 4 shape with
``triton.testing.do_bench`` medians on random data (inputs rotated when one set fits in L2).
Effective TOP/s = 2*M*N*K / t. Paths:
  bf16             F.linear in bf16
  production_int8  torch-op per-token quantize -> dequantize to bf16, weight dequantized to bf16, F.linear
  int_mm           torch-op quantize -> torch._int_mm(A_q, W_q.T) -> torch-op dequant (+bias) to bf16
  fp8_rowwise      torch-op row-wise e4m3 quantize -> torch._scaled_mm (row-wise scales) -> bf16
  fp8_fast         ComfyUI fp8_e4m3fn_fast: x clamped to +-448 and cast, scales 1, torch._scaled_mm
  ck_cuda/ck_triton  comfy_kitchen.int8_linear with that backend forced
  ours_gemm        kernel.int8_gemm on pre-quantized A (GEMM + epilogue only)
  ours_linear      kernel.int8_linear (per-token quantize kernel + GEMM)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))
import pack_import  # noqa: E402
pack_import.install()  # kernel, quant, adapters: the pack's subpackages, imported one way (tests/pack_import.py)
import kernel  # noqa: E402
from bench.lib import provenance  # noqa: E402
from quant.quantize import (dequant_epilogue_ref, int8_matmul_ref, quantize_per_token_ref,  # noqa: E402
                            quantize_weight_per_channel)

SHAPES = [  # (case, M, N, K, bias): Ideogram 4's block linears at M 4608 / 4096 / 2816, then two more
    *[(case, m, n, k, False) for m in (4608, 4096, 2816)
      for case, n, k in (("qkv", 13824, 4608), ("o", 4608, 4608), ("w1", 12288, 4608), ("w2", 4608, 12288))],
    ("llm_cond_proj", 512, 4608, 53248, True), ("adaln", 1, 18432, 512, True)]
PATHS = ["bf16", "production_int8", "int_mm", "fp8_rowwise", "fp8_fast", "ck_cuda", "ck_triton",
         "ours_gemm", "ours_linear"]
E4M3_MAX = 448.0


def torch_quant_int8(x):
    """Eager per-token int8 quantization (the torch-op baseline)."""
    s = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / 127.0
    return torch.round(x.float() / s).clamp_(-127, 127).to(torch.int8), s


def torch_quant_fp8(x):
    s = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / E4M3_MAX
    return (x.float() / s).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def check_correctness(log):
    """Compiled kernels vs the references (evaluated on the GPU); returns the number of failed checks."""
    dev = "cuda"
    failures = 0
    g = torch.Generator(device=dev).manual_seed(1)
    for (m, k, dt, smooth) in [(1, 4608, torch.bfloat16, False), (4608, 4608, torch.bfloat16, True),
                               (512, 53248, torch.bfloat16, True), (300, 1000, torch.float16, False),
                               (77, 12288, torch.float32, True)]:
        x = torch.randn(m, k, device=dev, dtype=dt, generator=g) * 3
        if m > 2:
            x[1] = 0
            x[2, 5] = float("nan")
        inv = (torch.rand(k, device=dev, generator=g) + 0.5) if smooth else None
        kernel.quantize_per_token(x, inv)
        q, s = kernel.quantize_per_token(x, inv)  # second call: the direct-launch path
        qr, sr = quantize_per_token_ref(x, inv)
        nq = (q != qr).sum().item()
        ns = (s.nan_to_num(-1) != sr.nan_to_num(-1)).sum().item()
        log(f"check quantize M={m} K={k} {dt} smooth={smooth}: "
            + ("bit-exact" if nq == ns == 0 else f"MISMATCH {nq} q, {ns} scales"))
        failures += nq + ns > 0
    for (m, n, k) in [(1, 18432, 512), (17, 4608, 4608), (300, 1000, 1000), (2816, 13824, 4608),
                      (4608, 4608, 12288), (512, 4608, 53248), (4608, 12288, 4608)]:
        a = torch.randint(-127, 128, (m, k), device=dev, dtype=torch.int8, generator=g)
        w = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8, generator=g)
        acc = kernel.int8_gemm(a, torch.ones(m, device=dev), w, torch.ones(n, device=dev), out_int32=True)
        acc2 = torch.full_like(acc, -1)  # second call: the direct-launch path (kernel/launch.py), poisoned output
        kernel.int8_gemm(a, torch.ones(m, device=dev), w, torch.ones(n, device=dev), out_int32=True, out=acc2)
        failures += not torch.equal(acc, acc2)
        if m > 16 and k % 8 == 0 and n % 8 == 0:
            ref, how = torch._int_mm(a, w.t()), "torch._int_mm"
        else:
            ref, how = int8_matmul_ref(a.cpu(), w.cpu()).to(dev), "int64 matmul"
        ok = torch.equal(acc, ref)
        log(f"check int32 acc M={m} N={n} K={k} vs {how}: {'bit-exact' if ok else 'MISMATCH'}")
        failures += not ok
        a_s = torch.rand(m, device=dev, generator=g) * 1e-2
        w_s = torch.rand(n, device=dev, generator=g) * 1e-2
        bias = torch.randn(n, device=dev, generator=g)
        kernel.int8_gemm(a, a_s, w, w_s, bias, out_dtype=torch.float32)
        y = torch.full((m, n), float("nan"), device=dev)
        kernel.int8_gemm(a, a_s, w, w_s, bias, out_dtype=torch.float32, out=y)
        r = dequant_epilogue_ref(ref, a_s, w_s, bias)
        bound = (ref.double().abs() * a_s.double()[:, None] * w_s.double()[None, :] + bias.double().abs())
        err = ((y.double() - r).abs() / bound).max().item()
        log(f"check epilogue fp32 M={m} N={n} K={k}: max err / (|acc*sa*sw|+|b|) = {err:.2e}")
        failures += not err < 1e-6
    log(f"checks: {'all passed' if failures == 0 else f'{failures} FAILED'}")
    return failures


def make_paths(case, m, n, k, has_bias, nrot):
    """{path: fn(i)} over nrot rotated input sets."""
    dev = "cuda"
    sets = []
    for _ in range(nrot):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        b = torch.randn(n, device=dev, dtype=torch.bfloat16) if has_bias else None
        wq, ws = quantize_weight_per_channel(w)
        w8s = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
        w8 = (w.float() / w8s).to(torch.float8_e4m3fn)
        aq, as_ = kernel.quantize_per_token(x)
        sets.append(dict(x=x, w=w, b=b, wq=wq, ws=ws, w8=w8, w8s=w8s.reshape(1, n), wfast=w.to(torch.float8_e4m3fn),
                         aq=aq, as_=as_))
    one = torch.ones((), device=dev)

    def bf16(d):
        return F.linear(d["x"], d["w"], d["b"])

    def production_int8(d):
        q, s = torch_quant_int8(d["x"])
        xd = q.to(torch.bfloat16) * s.to(torch.bfloat16)
        wd = d["wq"].to(torch.bfloat16) * d["ws"].to(torch.bfloat16)[:, None]
        return F.linear(xd, wd, d["b"])

    def int_mm(d):
        q, s = torch_quant_int8(d["x"])
        y = torch._int_mm(q, d["wq"].t()).float() * s * d["ws"][None, :]
        return (y + d["b"].float() if d["b"] is not None else y).to(torch.bfloat16)

    def fp8_rowwise(d):
        q, s = torch_quant_fp8(d["x"])
        return torch._scaled_mm(q, d["w8"].t(), scale_a=s, scale_b=d["w8s"], bias=d["b"], out_dtype=torch.bfloat16)

    def fp8_fast(d):
        q = d["x"].clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(q, d["wfast"].t(), scale_a=one, scale_b=one, bias=d["b"], out_dtype=torch.bfloat16)

    def ck(backend):
        import comfy_kitchen as ck_mod

        def run(d):
            with ck_mod.use_backend(backend):
                return ck_mod.int8_linear(d["x"], d["wq"], d["ws"], d["b"], out_dtype=torch.bfloat16)
        return run

    def ours_gemm(d):
        return kernel.int8_gemm(d["aq"], d["as_"], d["wq"], d["ws"], d["b"], out_dtype=torch.bfloat16)

    def ours_linear(d):
        return kernel.int8_linear(d["x"], d["wq"], d["ws"], d["b"])

    fns = dict(bf16=bf16, production_int8=production_int8, int_mm=int_mm, fp8_rowwise=fp8_rowwise,
               fp8_fast=fp8_fast, ck_cuda=ck("cuda"), ck_triton=ck("triton"), ours_gemm=ours_gemm,
               ours_linear=ours_linear)
    return fns, sets


def bench_fn(fn, sets):
    import triton.testing
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(sets)
        fn(sets[state["i"]])
    return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")


def accuracy(fn, sets):
    d = sets[0]
    y = fn(d).float()
    ref = F.linear(d["x"].double(), d["w"].double(), None if d["b"] is None else d["b"].double()).float()
    return ((y - ref).norm() / ref.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/h200-kernels.json")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    import triton
    props = torch.cuda.get_device_properties(0)
    driver = provenance.driver() or "?"
    commit = args.commit or provenance.commit()
    log(f"GPU {props.name}, driver {driver}, torch {torch.__version__}, triton {triton.__version__}, "
        f"L2 {props.L2_cache_size >> 20} MB, SMs {props.multi_processor_count}")
    try:
        import comfy_kitchen as ck_mod
        log(f"comfy_kitchen {getattr(ck_mod, '__version__', '?')}: "
            + "; ".join(f"{k}: {'ok' if v['available'] else v['unavailable_reason']}"
                        for k, v in ck_mod.list_backends().items()))
    except Exception as e:  # noqa: BLE001
        log(f"comfy_kitchen not importable: {e!r}")
    check_correctness(log)

    from kernel import autotune
    rows, extras = [], []
    for case, m, n, k, has_bias in SHAPES:
        set_bytes = m * k * 2 + n * k * 3
        nrot = 4 if set_bytes < 2 * props.L2_cache_size else 1
        fns, sets = make_paths(case, m, n, k, has_bias, nrot)
        res = {}
        for path in PATHS:
            try:
                fns[path](sets[0])
                torch.cuda.synchronize()
                ms = bench_fn(fns[path], sets)
                err = accuracy(fns[path], sets)
            except Exception as e:  # noqa: BLE001 - a path that cannot run this shape is reported, not fatal
                log(f"  {case} M={m} {path}: not run ({type(e).__name__}: {str(e)[:160]})")
                continue
            tops = 2 * m * n * k / (ms * 1e-3) / 1e12
            res[path] = (ms, tops)
            rows.append(dict(case=case, M=m, N=n, K=k, path=path, ms=round(ms, 5), tops=round(tops, 1),
                             rel_err=float(f"{err:.3e}")))
        qms = bench_fn(lambda d: kernel.quantize_per_token(d["x"]), sets)
        extras.append(dict(case=case, M=m, N=n, K=k, what="ours_quant_only", ms=round(qms, 5),
                           tbps=round(m * k * 3 / (qms * 1e-3) / 1e12, 2)))
        peers = {p: v for p, v in res.items() if not p.startswith("ours")}
        best_peer = max(peers, key=lambda p: peers[p][1]) if peers else None
        log(f"{case} M={m} N={n} K={k}  (quant alone {qms * 1e3:.1f} us)")
        for p, (ms, tops) in res.items():
            r_bf = tops / res["bf16"][1] if "bf16" in res else float("nan")
            r_pe = tops / peers[best_peer][1] if best_peer else float("nan")
            log(f"  {p:16s} {ms * 1e3:9.1f} us  {tops:7.1f} TOP/s  x{r_bf:5.2f} bf16  x{r_pe:5.2f} best peer ({best_peer})")
        del fns, sets
        torch.cuda.empty_cache()

    log("\nautotune timings (ms per candidate):")
    for key, lst in autotune.TIMINGS.items():
        log(f"  {key}: " + ", ".join(f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}/w{c['num_warps']}/s{c['num_stages']}"
                                     f"={ms:.4f}" for c, ms in sorted(lst, key=lambda t: t[1])))

    # summary table: TOP/s per path
    log("\n| case | M | N | K | " + " | ".join(PATHS) + " | ours_linear / bf16 | / best ck | / fp8_fast |")
    log("|---|---:|---:|---:|" + "---:|" * (len(PATHS) + 3))
    for case, m, n, k, _ in SHAPES:
        r = {x["path"]: x["tops"] for x in rows if x["case"] == case and x["M"] == m}
        ol = r.get("ours_linear")
        ckb = max([r[p] for p in ("ck_cuda", "ck_triton") if p in r], default=None)

        def ratio(d):
            return f"{ol / d:.2f}" if ol and d else "-"
        log(f"| {case} | {m} | {n} | {k} | " + " | ".join(f"{r[p]:.0f}" if p in r else "-" for p in PATHS)
            + f" | {ratio(r.get('bf16'))} | {ratio(ckb)} | {ratio(r.get('fp8_fast'))} |")

    out = dict(gpu=props.name, driver=driver, date=provenance.now(), torch=torch.__version__,
               triton=triton.__version__, commit=commit,
               command="python bench/kernels.py " + " ".join(sys.argv[1:]), rows=rows, extras=extras,
               autotune={k: [[c, ms] for c, ms in v] for k, v in autotune.TIMINGS.items()})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    Path(args.out).with_suffix(".log").write_text("\n".join(lines) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
