"""Issue 8 fusions at Ideogram 4 shapes: each fused kernel against the unfused torch sequence it replaces
(time, effective bandwidth, int8 code flips), and the FeedForward fused vs per-linear. H200 (CUDA); with
``--cpu`` (TRITON_INTERPRET=1) it runs tiny shapes once as a smoke test of the script itself.

    python bench/fused.py [--m 4608] [--out bench/results/h200-fused.json]

Columns: us (median, triton.testing.do_bench), GB/s = bytes the op must move / time, vs the 4.3 TB/s copy
bandwidth; ``flips`` = fraction of int8 codes differing from the unfused path (max |diff| in brackets).
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
sys.path.append(str(ROOT / "tests"))
import pack_import  # noqa: E402
pack_import.install()  # kernel, quant, adapters: the pack's subpackages, imported one way (tests/pack_import.py)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def bench(fn, cuda: bool) -> float:
    """Median microseconds of fn()."""
    if cuda:
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def flips(q, ref) -> str:
    d = (q.int() - ref.int()).abs()
    return f"{(d > 0).float().mean().item():.1e} ({d.max().item()})"


def residual_diagnosis(kf, x, o, w1, gate, m, yy) -> dict:
    """Where the residual tail's y departs from torch's ``x + gate * F.rms_norm(o)``: the share of y elements that
    differ for the kernel as built and built without FMA contraction (``enable_fp_fusion=False``), and which
    rounding F.rms_norm itself follows here (one rounding of o*rstd*w, or o*rstd rounded before the weight)."""
    d = x.shape[1]
    f32 = o.float()
    rstd = torch.rsqrt(f32.pow(2).mean(-1, keepdim=True) + 1e-5)
    n_torch = F.rms_norm(o, (d,), w1, 1e-5)
    n_single = (f32 * rstd * w1.float()).to(o.dtype)
    n_double = ((f32 * rstd).to(o.dtype) * w1)
    out = {"norm_eq_single_rounding": (n_torch == n_single).float().mean().item(),
           "norm_eq_double_rounding": (n_torch == n_double).float().mean().item()}
    y_single = x + gate * n_single
    for label, extra in (("as_built", {}), ("no_fp_fusion", {"enable_fp_fusion": False})):
        saved = kf.residual.launch
        if extra:
            kf.residual.launch = lambda fn, grid, args, cx, w, st, dev: fn[grid](*args, **{**cx, **extra}, num_warps=w,
                                                                       num_stages=st)
        try:
            y, _, _ = kf.residual.gated_residual_rmsnorm(x, o, w1, 1e-5, gate, m)
        finally:
            kf.residual.launch = saved
        out[f"y_differs_{label}"] = (y != yy).float().mean().item()
        out[f"y_differs_from_single_rounding_{label}"] = (y != y_single).float().mean().item()
    print("  residual diagnosis:", json.dumps({k: float(f"{v:.3g}") for k, v in out.items()}))
    return out


def swiglu_epilogue_rows(cuda: bool, dev: str, g) -> list[dict]:
    """SwiGLU in the merged w1+w3 GEMM's epilogue (``gemm_swiglu`` + ``quantize_per_token``) against the GEMM
    writing [a | b] + ``swiglu_quantize`` (the path under torch.compile), at Ideogram 4's and Z-Image's FFN shapes:
    both times, bit-equality of the int8 codes / scales, and the whole FusedFeedForward's time."""
    import kernel
    import kernel.ops
    kernel.ops.row_modules()
    kf = kernel
    from quant import blocks as qf
    from quant.linear import Int8Linear
    shapes = [("ideogram4 cond", 4608, 4608, 12288), ("ideogram4 uncond", 4096, 4608, 12288),
              ("z-image", 4352, 3840, 10240)] if cuda else [("tiny", 8, 64, 96)]
    out = []
    for name, m, d, f in shapes:
        x = torch.randn(m, d, device=dev, dtype=torch.bfloat16, generator=g)
        lin = [torch.randn(n, k, device=dev, generator=g) * k ** -0.5 for n, k in ((f, d), (d, f), (f, d))]
        L1, L2, L3 = [Int8Linear.from_float(w, backend="fused_triton", name=n) for w, n in zip(lin, ("w1", "w2", "w3"))]
        w13 = qf.merge_int8(L1, L3, "w1+w3")
        ff = qf.FusedFeedForward(w13, L2)
        a_q, a_s = kernel.quantize_per_token(x)

        def epi():
            return kernel.quantize_per_token(kf.swiglu.gemm_swiglu(a_q, a_s, w13.qweight, w13.weight_scale, None,
                                                            torch.bfloat16))

        def sep():
            return kf.swiglu.swiglu_quantize(kernel.int8_gemm(a_q, a_s, w13.qweight, w13.weight_scale, None,
                                                       out_dtype=torch.bfloat16))
        (q1, s1), (q0, s0) = epi(), sep()
        equal = torch.equal(q1, q0) and torch.equal(s1, s0)
        t_epi, t_sep = bench(epi, cuda), bench(sep, cuda)
        t_ff = bench(lambda: ff(x), cuda)
        r = {"shape": name, "M": m, "D": d, "F": f, "epilogue_us": t_epi, "separate_us": t_sep,
             "codes_equal": equal, "ffn_us": t_ff}
        out.append(r)
        print(f"SwiGLU epilogue {name:<17} M {m} D {d} F {f}: gemm_swiglu + quantize {t_epi:8.1f} us, GEMM + "
              f"swiglu_quantize {t_sep:8.1f} us (codes equal: {equal}); FeedForward {t_ff:8.1f} us", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=4608, help="token rows (cond pass at 1024²: 4608)")
    ap.add_argument("--cpu", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 (smoke test)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cuda = not a.cpu
    if cuda and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu with TRITON_INTERPRET=1)")
        return 2
    import kernel
    import kernel.ops
    kernel.ops.row_modules()
    kf = kernel
    from quant import blocks as qf
    from quant.linear import Int8Linear
    dev = "cuda" if cuda else "cpu"
    m, d, f = (a.m, 4608, 12288) if cuda else (8, 64, 96)
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(m, d, device=dev, dtype=bf, generator=g)
    o = torch.randn(m, d, device=dev, dtype=bf, generator=g) * 3
    w1, w2 = [(1 + 0.1 * torch.randn(d, device=dev, generator=g)).to(bf) for _ in range(2)]
    s = (1 + 0.3 * torch.randn(1, d, device=dev, generator=g)).to(bf)
    gate = torch.tanh(torch.randn(1, d, device=dev, generator=g)).to(bf)
    h13 = torch.randn(m, 2 * f, device=dev, dtype=bf, generator=g) * 2
    r = d * 2
    rows = []

    def row(name, fused_fn, plain_fn, fused_bytes, plain_bytes, fl=""):
        tf, tp = bench(fused_fn, cuda), bench(plain_fn, cuda)
        rows.append({"op": name, "fused_us": tf, "plain_us": tp, "fused_GBps": fused_bytes / tf / 1e3,
                     "floor_us": fused_bytes / 4.3e6, "plain_floor_us": plain_bytes / 4.3e6, "flips": fl})
        print(f"{name:<34} fused {tf:9.1f} us ({fused_bytes / tf / 1e3:7.0f} GB/s, floor {fused_bytes / 4.3e6:6.1f})"
              f"   plain {tp:9.1f} us (floor {plain_bytes / 4.3e6:6.1f})   flips {fl}")

    # norm * (1 + s) + quantize
    q, _ = kf.norm.rmsnorm_modulate_quantize(x, w1, 1e-5, s, m)
    uq, _ = kernel.quantize_per_token(F.rms_norm(x, (d,), w1, 1e-5) * s)
    row("rmsnorm*(1+s)+quantize", lambda: kf.norm.rmsnorm_modulate_quantize(x, w1, 1e-5, s, m),
        lambda: kernel.quantize_per_token(F.rms_norm(x, (d,), w1, 1e-5) * s), 1.5 * m * r, 5.5 * m * r, flips(q, uq))
    # SwiGLU + quantize
    a1, a3 = h13.chunk(2, 1)
    q, _ = kf.swiglu.swiglu_quantize(h13)
    uq, _ = kernel.quantize_per_token(F.silu(a1) * a3)
    fr = f / d
    row("silu(a)*b+quantize (F)", lambda: kf.swiglu.swiglu_quantize(h13),
        lambda: kernel.quantize_per_token(F.silu(a1) * a3), (2 * fr + fr / 2) * m * r, 6.5 * fr * m * r,
        flips(q, uq))
    # residual tail + next norm * (1 + s) + quantize
    y, q, _ = kf.residual.gated_residual_rmsnorm(x, o, w1, 1e-5, gate, m, w2, 1e-5, s)

    def plain_tail():
        yy = x + gate * F.rms_norm(o, (d,), w1, 1e-5)
        return yy, kernel.quantize_per_token(F.rms_norm(yy, (d,), w2, 1e-5) * s)

    yy, (uq, _) = plain_tail()
    row("x+g*norm(o) -> norm*(1+s)+quant", lambda: kf.residual.gated_residual_rmsnorm(x, o, w1, 1e-5, gate, m, w2, 1e-5, s),
        plain_tail, 3.5 * m * r, 12.5 * m * r, flips(q, uq) + f"; y equal: {torch.equal(y, yy)}")
    rows[-1]["diagnosis"] = residual_diagnosis(kf, x, o, w1, gate, m, yy)
    # FeedForward: fused (w1+w3 one GEMM, SwiGLU+quant) vs per-linear fused_triton Int8Linear
    lin = [torch.randn(n, k, device=dev, generator=g) * k ** -0.5 for n, k in ((f, d), (d, f), (f, d))]
    L1, L2, L3 = [Int8Linear.from_float(w, backend="fused_triton", name=n) for w, n in zip(lin, ("w1", "w2", "w3"))]
    ff = qf.FusedFeedForward(qf.merge_int8(L1, L3, "w1+w3"), L2)
    yf, yp = ff(x), L2(F.silu(L1(x)) * L3(x))
    err = ((yf.float() - yp.float()).norm() / yp.float().norm()).item()
    row("FeedForward (3 GEMMs incl.)", lambda: ff(x), lambda: L2(F.silu(L1(x)) * L3(x)), 0, 0, f"rel {err:.1e}")
    epilogue = swiglu_epilogue_rows(cuda, dev, g)
    if a.out:
        import triton
        doc = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
               "triton": triton.__version__, "m": m, "rows": rows, "swiglu_epilogue": epilogue}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    if "--cpu" in sys.argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
