"""Tiles for the SwiGLU-epilogue GEMM (``kernel.fused.gemm_swiglu``), H200: every candidate tile of the int8 GEMM
autotune at Ideogram 4's and Z-Image's FFN shapes, and which one the merged w1+w3 GEMM's autotune picks in this
process (``plain_pick``: gemm_swiglu runs with it). Each tile's h is checked equal to the first call's; times are
``do_bench`` medians. (Runs bd and bg of bench/RESULTS.md: the 128 x 128 x 128 tiles with 4 or 8 warps within 2-10 %
of each other, which is faster changing between runs, so gemm_swiglu keeps the merged GEMM's pick.)

    python bench/swiglu_tiles.py [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import triton.testing

    import kernel
    import kernel.fused as kf
    from kernel import autotune
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    props = torch.cuda.get_device_properties(dev)
    rows = []
    for name, m, d, f in (("ideogram4 cond", 4608, 4608, 12288), ("ideogram4 uncond", 4096, 4608, 12288),
                          ("z-image", 4352, 3840, 10240)):
        x = torch.randn(m, d, device=dev, generator=g).to(torch.bfloat16)
        w13 = torch.randint(-127, 128, (2 * f, d), device=dev, dtype=torch.int8, generator=g)
        ws = torch.rand(2 * f, device=dev, generator=g) * 1e-3
        a_q, a_s = kernel.quantize_per_token(x)
        plain = kf.select_config(a_q, a_s, w13, ws, None, None, torch.bfloat16)
        ref = kf.gemm_swiglu(a_q, a_s, w13, ws)
        real = kf.select_config
        cands = autotune.candidates((props.major, props.minor), props.shared_memory_per_block_optin,
                                    autotune.m_bucket(m))
        for cfg in cands:
            kf.select_config = lambda *args, _c=cfg, **kw: _c
            try:
                h = kf.gemm_swiglu(a_q, a_s, w13, ws)
                us = triton.testing.do_bench(lambda: kf.gemm_swiglu(a_q, a_s, w13, ws), warmup=10, rep=60,
                                             return_mode="median") * 1e3
                row = {"shape": name, "M": m, "D": d, "F": f, "cfg": cfg, "plain_pick": cfg == plain, "us": us,
                       "tops": 2 * m * d * 2 * f / us / 1e6, "equal": bool(torch.equal(h, ref))}
            except Exception as e:  # noqa: BLE001 - a tile that does not build is reported
                row = {"shape": name, "cfg": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"}
            finally:
                kf.select_config = real
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": props.name, "torch": torch.__version__,
                                           "triton": triton.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
