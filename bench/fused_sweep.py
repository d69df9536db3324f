"""Tile sweep for the fused row kernels (kernel/norm.py ... rope.py; H200): Ideogram 4's RMSNorm and SwiGLU kernels at its
shapes, and the GELU kernels where the Flux / Wan profiles found them far off their memory floor (2026-12-01:
Flux's single-block concat + GELU + quantize 282 us a call, Wan 1.3B's FFN GELU + quantize 400 us). Each (BLOCK,
one register-resident pass or chunked passes, num_warps) plan, and the one-pass segmented kernels (``seg``; the
per-token quantizer's too: its BLOCK_K kernel is the row labelled with its own tile),
timed with do_bench, output checked bit-equal to the default plan's; the GELU kernels also with ``GELU_FAST``
(h * sigmoid(2u) instead of tanhf), each compared with torch's unfused ``quantize_per_token_ref(F.gelu(...))`` (codes that differ, largest difference, scales
that differ). ``python bench/fused_sweep.py [--m 4608]``; prints one line a plan."""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=4608)
    ap.add_argument("--quick", action="store_true", help="each kernel's default plan only (A/B runs of a switch)")
    ap.add_argument("--only", default="", help="comma-separated substrings: the cases whose names contain one")
    ap.add_argument("--warm-s", type=float, default=3.0, help="seconds of bf16 matmuls before the first timing (on a GPU just started "
                    "the first readings drifted down by 10 %% over a few seconds)")
    a = ap.parse_args()
    import torch.nn.functional as F
    import triton
    import triton.testing
    import kernel as kf
    import kernel.ops
    kernel.ops.row_modules()
    from quant.blocks import swiglu_quantize_ref
    from quant.quantize import quantize_per_token_ref
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    m, k, f = a.m, 4608, 12288
    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(torch.bfloat16)
    s = (1 + 0.1 * torch.randn(1, k, device=dev, generator=g)).to(torch.bfloat16)
    h13 = (2 * torch.randn(m, 2 * f, device=dev, generator=g)).to(torch.bfloat16)
    wide = [("seg", 8), ("seg", 16), ("seg", 32), (16384, True, 16), (16384, True, 32), (8192, False, 8),
            (8192, False, 16), (4096, False, 4), (4096, False, 8), (2048, False, 4), (2048, False, 8), (1024, False, 4)]
    fa = (torch.randn(4608, 3072, device=dev, generator=g)).to(torch.bfloat16)  # Flux single block, 1024²
    fh = (2 * torch.randn(4608, 12288, device=dev, generator=g)).to(torch.bfloat16)
    wh = (2 * torch.randn(14040, 8960, device=dev, generator=g)).to(torch.float16)  # Wan 1.3B, 480p 33 frames
    lx = torch.randn(4608, 3072, device=dev, generator=g).to(torch.bfloat16)
    ls = (0.1 * torch.randn(1, 3072, device=dev, generator=g)).to(torch.bfloat16)
    default_plan, gelu_fast, one_pass, res_pass = kf.rowtile.plan_tiles, kf.gelu.GELU_FAST, kf.swiglu.SWIGLU_ONE_PASS, kf.residual.RESIDUAL_ONE_PASS
    gelu_pass, rms_pass, ln_pass, qk_prefetch = kf.gelu.GELU_ONE_PASS, kf.norm.RMS_ONE_PASS, kf.norm.LN_ONE_PASS, kf.rope.QK_PREFETCH
    res_ln_pass = kf.residual.RESIDUAL_LN_ONE_PASS
    import kernel.quantize
    quant_pass, quant_loop = kernel.quantize.QUANT_ONE_PASS, kernel.quantize.QUANT_ROW_LOOP
    print(f"INT8_FUSED_ALU_ROUND: {bool(kernel.quantize.ALU_ROUND)}", flush=True)
    torch_ref = {  # the unfused torch sequence the GELU kernels replace
        "flux concat+gelu+quant": lambda: quantize_per_token_ref(torch.cat((fa, F.gelu(fh, approximate="tanh")), -1)),
        "wan gelu+quant F=8960": lambda: quantize_per_token_ref(F.gelu(wh, approximate="tanh")),
        "swiglu_quant F=12288": lambda: swiglu_quantize_ref(*h13.chunk(2, dim=1)),
    }
    cases = {
        "rmsnorm_mod_quant K=4608": (lambda: kf.norm.rmsnorm_modulate_quantize(x, w, 1e-5, s, m), 2 * m * k + m * k,
                                     [("seg", 4), ("seg", 8), ("seg", 16), (8192, True, 16), (8192, True, 8), (8192, True, 32), (4096, False, 4),
                                      (4096, False, 8), (2048, False, 4), (2048, False, 8), (1024, False, 4)]),
        "swiglu_quant F=12288": (lambda: kf.swiglu.swiglu_quantize(h13), 2 * m * 2 * f + m * f,
                                 [("seg", 8), ("seg", 16), ("seg", 32), (16384, True, 16), (8192, False, 8),
                                  (4096, False, 4), (2048, False, 4), (2048, False, 8), (1024, False, 4)]),
        "flux concat+gelu+quant": (lambda: kf.gelu.concat_gelu_quantize(fa, fh), 2 * 4608 * (3072 + 12288) * 3 // 2,
                                   wide),
        "wan gelu+quant F=8960": (lambda: kf.gelu.gelu_tanh_quantize(wh), 14040 * 8960 * 3, wide),
        "flux layernorm_mod_quant": (lambda: kf.norm.layernorm_modulate_quantize(lx, ls, ls, 4608),
                                     4608 * 3072 * 3,
                                     [("seg", 4), ("seg", 8), (4096, True, 8), (4096, True, 16), (2048, False, 4),
                                      (1024, False, 4), (1024, False, 8)]),
    }
    # the residual + LayerNorm·mod + quantize tails: Flux's (x += y * gate, then img_norm2) and Wan's (x + y)
    fy = torch.randn(4608, 3072, device=dev, generator=g).to(torch.bfloat16)
    fg = (0.3 * torch.randn(1, 3072, device=dev, generator=g)).to(torch.bfloat16)
    cases["flux residual+layernorm_mod_quant K=3072"] = (
        lambda: kf.residual.residual_add_layernorm_modulate_quantize(lx, fy, fg, 4608, 1e-6, ls, ls, None,
                                                            round_product=True)[1:], 4608 * 3072 * 7,
        [("seg", 4), ("seg", 8), (4096, True, 8), (4096, True, 16)])
    for kw in (1536, 5120):  # Wan 2.1 1.3B / 14B, 480x832 33 frames: M 14040
        wx = torch.randn(14040, kw, device=dev, generator=g).to(torch.bfloat16)
        ws = (0.1 * torch.randn(1, kw, device=dev, generator=g)).to(torch.bfloat16)
        cases[f"wan layernorm_mod_quant K={kw}"] = (
            lambda wx=wx, ws=ws: kf.norm.layernorm_modulate_quantize(wx, ws, ws, 14040), 14040 * kw * 3,
            [("seg", 4), ("seg", 8), ("seg", 16), (triton.next_power_of_2(kw), True, 4),
             (triton.next_power_of_2(kw), True, 8), (triton.next_power_of_2(kw), True, 16)])
        cases[f"wan residual+layernorm_mod_quant K={kw}"] = (
            lambda wx=wx, ws=ws: kf.residual.residual_add_layernorm_modulate_quantize(wx, wx, None, 14040, 1e-6, ws, ws)[1:],
            14040 * kw * 7, [("seg", 4), ("seg", 8), (triton.next_power_of_2(kw), True, 4),
                             (triton.next_power_of_2(kw), True, 8), (triton.next_power_of_2(kw), True, 16)])
    ro = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)  # Ideogram 4's residual tail, K 4608
    rg = torch.tanh(torch.randn(1, k, device=dev, generator=g)).to(torch.bfloat16)
    cases["gated_residual+next K=4608"] = (
        lambda: kf.residual.gated_residual_rmsnorm(x, ro, w, 1e-5, rg, m, w, 1e-6, s)[1:], 2 * m * k * 2 + m * k * 3,
        [("seg", 4), ("seg", 8), ("seg", 16), (8192, True, 16), (8192, True, 8)])
    # QK RMSNorm + RoPE into [B, L, H, D] buffers: Ideogram 4 (18 heads of 256, split-half pairs), Flux (24 of 128)
    for label, hh, dd, split in (("ideogram4", 18, 256, True), ("flux", 24, 128, False)):
        qkv = torch.randn(1, m, 3 * hh * dd, device=dev, generator=g).to(torch.bfloat16)
        pe = torch.randn(1, 1, m, dd // 2, 2, 2, device=dev, generator=g)
        wqk = (1 + 0.1 * torch.randn(dd, device=dev, generator=g)).to(torch.bfloat16)
        qo, ko = (torch.empty(1, m, hh, dd, device=dev, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))

        def run(qkv=qkv, pe=pe, wqk=wqk, qo=qo, ko=ko, hh=hh, split=split):
            kf.rope.qk_norm_rope(qkv, hh, wqk, wqk, 1e-6, 1e-6, pe, qo, ko, None, 0, split_half=split)
            return qo, ko
        # None: QK_PREFETCH as committed; ("prefetch", False / True): the rotations as scalar loads and the parts
        # one after the other, or vectors and every load up front
        cases[f"qk_norm_rope {label} H={hh} D={dd}"] = (run, 2 * m * hh * dd * 2 * 2 + m * dd * 8,
                                                        [None, ("prefetch", False), ("prefetch", True)])
    from kernel import quantize_per_token
    xq = torch.randn(4608, 12288, device=dev, generator=g).to(torch.bfloat16)
    # the BLOCK_K kernel's own tiles (kernel/quantize.py _block_k) label its rows; one-pass segments otherwise
    # ("loop", programs an SM, warps): the row-looping kernel with the next row's loads in flight
    qseg = [("seg", 4), ("seg", 8), ("seg", 16), ("loop", 2, 4), ("loop", 4, 4), ("loop", 8, 4), ("loop", 2, 8),
            ("loop", 4, 8)]
    cases["quant_rows K=4608"] = (lambda: quantize_per_token(x), 3 * m * k, qseg + [(8192, True, 16)])
    cases["quant_rows K=12288"] = (lambda: quantize_per_token(xq), 3 * 4608 * 12288, qseg + [(4096, False, 8)])
    only = [w for w in a.only.split(",") if w]
    _warm(dev, a.warm_s)
    for name, (fn, nbytes, plans) in cases.items():
        if only and not any(w in name for w in only):
            continue
        kf.rowtile.plan_tiles, kf.swiglu.SWIGLU_ONE_PASS, kf.residual.RESIDUAL_ONE_PASS = default_plan, one_pass, res_pass
        kf.gelu.GELU_ONE_PASS, kf.norm.RMS_ONE_PASS, kernel.quantize.QUANT_ONE_PASS = gelu_pass, rms_pass, quant_pass
        kf.norm.LN_ONE_PASS, kf.rope.QK_PREFETCH, kf.residual.RESIDUAL_LN_ONE_PASS = ln_pass, qk_prefetch, res_ln_pass
        kernel.quantize.QUANT_ROW_LOOP = quant_loop
        ref_q, ref_s = (t.clone() for t in fn())  # (qk_norm_rope's run returns its output buffers)
        tq, ts = torch_ref[name]() if name in torch_ref else (None, None)
        for fast in ((False, True) if "gelu" in name and not a.quick else (gelu_fast,)):
            kf.gelu.GELU_FAST = fast
            for plan in ([None] if a.quick else plans):
                # the one-pass segmented kernels with plan[1] warps (per_warp 128: the warps asked for, not capped
                # at one per 512 elements as the defaults are)
                loop = plan is not None and plan[0] == "loop"
                kernel.quantize.QUANT_ROW_LOOP = plan[1] if loop else quant_loop if plan is None else 0
                seg = plan is not None and plan[0] == "seg"
                if loop:
                    plan, seg = ("seg", plan[2]), True  # the segment plan of that many warps, looped
                if plan is not None and plan[0] == "prefetch":
                    kf.rope.QK_PREFETCH = plan[1]
                kf.swiglu.SWIGLU_ONE_PASS = (kf.quantize.SegmentPlan(16384, 256, plan[1], 128) if seg else
                                      one_pass if plan is None else None)
                kf.residual.RESIDUAL_ONE_PASS = (kf.quantize.SegmentPlan(8192, 256, plan[1], 128) if seg else
                                        res_pass if plan is None else None)
                kf.gelu.GELU_ONE_PASS = (kf.quantize.SegmentPlan(16384, 256, plan[1], 128) if seg else
                                    gelu_pass if plan is None else None)
                kf.norm.RMS_ONE_PASS = (kf.quantize.SegmentPlan(8192, 256, plan[1], 128) if seg else
                                   rms_pass if plan is None else None)
                kernel.quantize.QUANT_ONE_PASS = (kf.quantize.SegmentPlan(16384, 256, plan[1], 128) if seg else
                                                  quant_pass if plan is None else None)
                kf.norm.LN_ONE_PASS = (kf.quantize.SegmentPlan(8192, 256, plan[1], 128) if seg else
                                  ln_pass if plan is None else None)
                kf.residual.RESIDUAL_LN_ONE_PASS = (kf.quantize.SegmentPlan(8192, 256, plan[1], 128) if seg else
                                           res_ln_pass if plan is None else None)
                kf.rowtile.plan_tiles = (default_plan if plan is None or seg or plan[0] == "prefetch" else
                            (lambda n, *args, _p=plan, **kw: _p))
                try:
                    q, sc = fn()
                    same = torch.equal(q, ref_q) and torch.equal(sc, ref_s)
                    vs_torch = ""
                    if tq is not None:
                        d = (q.int() - tq.int()).abs()
                        vs_torch = (f"  vs torch: codes differ {(d > 0).float().mean().item():.2e} max {d.max().item()}"
                                    f" scales differ {(sc != ts).float().mean().item():.2e}")
                    digest = hashlib.sha1(_bytes(q) + _bytes(sc)).hexdigest()[:10]
                    us = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3
                    print(f"{name:26s} fast={fast!s:5s} " + ("own plan: " if plan is None else
                          f"one pass, segments, warps={plan[1]:2d}, {kernel.quantize.QUANT_ROW_LOOP} programs an SM "
                          "looping over rows: " if loop else
                          f"one pass, segments, warps={plan[1]:2d}: " if seg else
                          f"QK_PREFETCH={plan[1]!s:5s}: " if plan[0] == "prefetch" else
                          f"BLOCK={plan[0]:5d} single={plan[1]!s:5s} warps={plan[2]:2d}: ") +
                          f"{us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s  equal={same} sha1 {digest}{vs_torch}",
                          flush=True)
                except Exception as e:  # a plan that does not compile (registers) is reported, not fatal
                    print(f"{name:26s} {plan}: {type(e).__name__}: {str(e)[:100]}", flush=True)
        kf.gelu.GELU_FAST = gelu_fast
    kf.rowtile.plan_tiles, kf.swiglu.SWIGLU_ONE_PASS, kf.residual.RESIDUAL_ONE_PASS = default_plan, one_pass, res_pass
    kf.gelu.GELU_ONE_PASS, kf.norm.RMS_ONE_PASS, kernel.quantize.QUANT_ONE_PASS = gelu_pass, rms_pass, quant_pass
    kf.norm.LN_ONE_PASS, kf.rope.QK_PREFETCH, kf.residual.RESIDUAL_LN_ONE_PASS = ln_pass, qk_prefetch, res_ln_pass
    kernel.quantize.QUANT_ROW_LOOP = quant_loop
    return 0


def _warm(dev: torch.device, seconds: float) -> None:
    """Keeps the GPU busy for ``seconds`` (bf16 matmuls), so the timings that follow start at a settled clock."""
    if seconds <= 0:
        return
    import time
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize(dev)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()  # any dtype (numpy has no bf16)


if __name__ == "__main__":
    sys.exit(main())
