"""Attention at Ideogram 4's shape on one GPU: torch SDPA (flash, cuDNN, efficient), comfy-kitchen's INT8 attention
(when importable) and the pack's 8-bit Triton attention (kernel/attention8.py, tile autotuned here).

Standalone: needs torch and triton only (comfy_kitchen optional); run from the repository root::

    python3 bench/attention.py [--check] [--out bench/results/h200-attention.json]

Per shape (B 1, H 18, D 256, L 4608 / 4096 / 2816, and L 4608 with a block-diagonal mask isolating 100 padded
tokens for the backends that take a mask): median time (triton.testing.do_bench), effective TFLOP/s =
4·B·H·L²·D / t (the masked row uses the same formula), and relative error ‖out − ref‖ / ‖ref‖ against a float64
reference computed on the GPU for the first 2 heads; bf16 SDPA's own error (cuDNN, else flash/efficient) is
recorded beside it with the ratio int8 / SDPA ("≤ 2x" is the bar under discussion). The masked shape also gets
the pack's kernel on the 4508 unpadded tokens: what pad elision runs instead of the mask.

--check: first the correctness of attention_int8 at a few ragged shapes (D 64/128/256, bf16/fp16, GQA, strided)
against the float64 reference; exits 1 when one fails. A missing optional piece (a backend that cannot run,
comfy_kitchen absent, no git/nvidia-smi) is recorded as skipped with the reason.
The whole run keeps to a time budget (--budget seconds, default 200): what is left when it runs out is skipped.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))
import pack_import  # noqa: E402
pack_import.install()  # kernel, quant, adapters: the pack's subpackages, imported one way (tests/pack_import.py)

import torch  # noqa: E402

T0 = time.time()


def provenance(argv):
    info = {"argv": list(argv), "python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        info["triton"] = f"not importable: {e}"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    from bench.lib import provenance
    info["driver"] = provenance.driver("driver_version,power.limit,clocks.max.sm")
    info["git_commit"] = provenance.commit()
    info["git_dirty"] = provenance.dirty()
    try:
        import comfy_kitchen
        info["comfy_kitchen"] = getattr(comfy_kitchen, "__version__", "importable")
    except Exception as e:  # noqa: BLE001
        info["comfy_kitchen"] = f"not importable: {type(e).__name__}: {e}"
    return info


def reference(q, k, v, mask=None, heads=2, scale=None):
    """float64 softmax(q kᵀ scale [+ mask]) v for the first ``heads`` heads (on the GPU)."""
    q, k, v = (t[:, :heads].double() for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    return torch.softmax(s, -1) @ v


def rel_err(out, ref, heads=2):
    o = out[:, :heads].double()
    return float((o - ref).norm() / ref.norm())


def sdpa_fn(name, q, k, v, mask):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]

    def run():
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return run


class Runner:
    def __init__(self, budget):
        self.budget = budget

    def left(self):
        return self.budget - (time.time() - T0)

    def measure(self, name, make_fn, fl, ref, heads=2):
        """{"ms", "tflops", "rel_err"} or {"skipped": reason}; never raises."""
        if self.left() < 5:
            return {"skipped": "time budget exhausted"}
        try:
            fn = make_fn()
            out = fn()
            torch.cuda.synchronize()
            err = rel_err(out, ref, heads) if ref is not None else None
            import triton.testing
            ms = float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
            res = {"ms": ms, "tflops": fl / (ms * 1e-3) / 1e12, "rel_err": err}
            print(f"  {name:<28} {ms:8.3f} ms  {res['tflops']:7.1f} TFLOP/s  rel err "
                  f"{err if err is None else f'{err:.2e}'}", flush=True)
            return res
        except Exception as e:  # noqa: BLE001 - a backend that cannot run this call
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            print(f"  {name:<28} skipped: {msg}", flush=True)
            return {"skipped": msg}
        finally:
            torch.cuda.empty_cache()


def run_bench(args, out):
    try:
        from kernel import attention8 as A
        a_reason = None
    except Exception as e:  # noqa: BLE001 - the SDPA rows still run
        A, a_reason = None, f"kernel.attention8 not importable: {type(e).__name__}: {e}"
    runner = Runner(args.budget)
    b, h, d = 1, 18, 256
    lengths = [4608, 4096, 2816]
    dtype = torch.bfloat16
    try:
        import comfy_kitchen
        ck = comfy_kitchen.int8_attention
        ck_reason = None
    except Exception as e:  # noqa: BLE001
        ck, ck_reason = None, f"comfy_kitchen not importable: {type(e).__name__}: {e}"
    if A is not None:
        cands = A.configs(d) + [dict(A.default_config(d), RESCALE_TAU=0.0)]  # eager rescaling, for comparison
    rows = out.setdefault("shapes", [])
    for L in lengths + ["masked"]:
        masked = L == "masked"
        lq = 4608 if masked else L
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, lq, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
        mask = None
        if masked:
            seg = torch.arange(lq, device="cuda") >= lq - 100
            mask = (seg[:, None] == seg[None, :])[None, None]
        ref = reference(q, k, v, mask)
        fl = 4.0 * b * h * lq * lq * d  # FLOPs of the two matmuls
        row = {"B": b, "H": h, "L": lq, "D": d, "dtype": str(dtype).replace("torch.", ""),
               "mask": "block-diagonal, 100 padded tokens" if masked else None, "results": {}}
        rows.append(row)
        print(f"B{b} H{h} L{lq} D{d}{' masked' if masked else ''}", flush=True)
        res = row["results"]
        for name in ("flash", "cudnn", "efficient"):
            res[f"sdpa_{name}"] = runner.measure(f"sdpa {name}", lambda: sdpa_fn(name, q, k, v, mask), fl, ref)
        if ck is None:
            res["comfy_kitchen_int8"] = {"skipped": ck_reason}
        else:
            res["comfy_kitchen_int8"] = runner.measure(
                "comfy-kitchen int8", lambda: (lambda: ck(q, k, v, attn_mask=mask)), fl, ref)
        if A is None:
            res["pack_int8"] = {"skipped": a_reason}
        elif masked:
            res["pack_int8"] = {"skipped": "attention_int8 takes no mask (the Router falls back for masked calls)"}
            n = lq - 100  # pad elision: the image/text tokens alone, unmasked
            qe, ke, ve = q[:, :, :n], k[:, :, :n], v[:, :, :n]
            ref_e = reference(qe, ke, ve)
            res["pack_int8_pad_elided_4508"] = runner.measure(
                "pack int8 (4508 tok, elided)", lambda: (lambda: A.attention_int8(qe, ke, ve)), fl, ref_e)
            res["sdpa_cudnn_pad_elided_4508"] = runner.measure(
                "sdpa cudnn (4508 tok)", lambda: sdpa_fn("cudnn", qe, ke, ve, None), fl, ref_e)
        else:
            tune = {}
            if runner.left() > 30:
                try:
                    t = time.time()
                    best = A.autotune(q, k, v, candidates=cands, reps=10)
                    tune = {"best": A.config_text(best), "seconds": round(time.time() - t, 1),
                            "ms": A.tune_log[A._shape_key(q, k)]}
                    print(f"  tuned in {tune['seconds']} s: {tune['best']}", flush=True)
                except Exception as e:  # noqa: BLE001
                    tune = {"error": f"{type(e).__name__}: {e}"}
            else:
                tune = {"skipped": "time budget: default config"}
            row["pack_int8_tune"] = tune
            res["pack_int8"] = runner.measure("pack int8 (tuned)", lambda: (lambda: A.attention_int8(q, k, v)),
                                              fl, ref)
            cfg = A.tuned.get(A._shape_key(q, k), A.default_config(d))
            res["pack_int8_q_prequant"] = runner.measure(
                "pack int8, Q pre-pass", lambda: (lambda: A.attention_int8(q, k, v, config=cfg, q_prequant=True)),
                fl, ref)
        # the error bar: bf16 SDPA's own error on the same heads
        sd = next((res[f"sdpa_{n}"] for n in ("cudnn", "flash", "efficient") if "rel_err" in res[f"sdpa_{n}"]),
                  None)
        if sd is not None:
            row["sdpa_bf16_rel_err"] = sd["rel_err"]
            for key in ("pack_int8", "pack_int8_q_prequant", "comfy_kitchen_int8"):
                r = res.get(key, {})
                if r.get("rel_err") is not None:
                    r["err_over_sdpa"] = r["rel_err"] / sd["rel_err"]
                    r["within_2x_sdpa_err"] = r["rel_err"] <= 2 * sd["rel_err"]
        q = k = v = ref = None
        torch.cuda.empty_cache()


def run_check(out):
    """attention_int8 against the float64 reference on ragged shapes; returns True when all pass."""
    from kernel import attention8 as A
    cases = [  # (B, H, Hkv, Lq, Lk, D, dtype, strided)
        (1, 3, 3, 1000, 777, 64, torch.bfloat16, False),
        (2, 4, 2, 333, 1024, 128, torch.float16, False),
        (1, 2, 2, 1025, 130, 256, torch.bfloat16, True),
        (1, 18, 18, 4608, 4608, 256, torch.bfloat16, False),
        (1, 2, 2, 63, 65, 256, torch.float16, False),
    ]
    results, ok_all = [], True
    for (b, h, hk, lq, lk, d, dtype, strided) in cases:
        g = torch.Generator(device="cuda").manual_seed(lq + lk)
        q = torch.randn(b, h, lq, d, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(b, hk, lk, d, device="cuda", dtype=dtype, generator=g) + 0.5
        v = torch.randn(b, hk, lk, d, device="cuda", dtype=dtype, generator=g)
        if strided:
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        entry = {"B": b, "H": h, "Hkv": hk, "Lq": lq, "Lk": lk, "D": d, "dtype": str(dtype), "strided": strided}
        try:
            kr, vr = (t.repeat_interleave(h // hk, 1) for t in (k, v))
            ref = reference(q, kr, vr)
            for label, kw in (("default", {"tune": False}), ("tuned", {})):
                o = A.attention_int8(q, k, v, **kw)
                torch.cuda.synchronize()
                entry[label] = {"rel_err": rel_err(o, ref), "finite": bool(torch.isfinite(o).all()),
                                "same_layout": o.stride() == q.stride()}
            sd = torch.nn.functional.scaled_dot_product_attention(q, kr, vr)
            entry["sdpa_rel_err"] = rel_err(sd, ref)
            entry["ok"] = all(entry[x]["rel_err"] < 3e-2 and entry[x]["finite"] for x in ("default", "tuned"))
        except Exception as e:  # noqa: BLE001
            entry["ok"], entry["error"] = False, f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(f"check {entry}", flush=True)
        ok_all &= entry["ok"]
        results.append(entry)
        torch.cuda.empty_cache()
    try:  # NaN in K makes the head NaN, never a finite result
        q = torch.randn(1, 2, 200, 128, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        k[0, 0, 7, 3] = float("nan")
        o = A.attention_int8(q, k, v, tune=False)
        nan_ok = bool(o[0, 0].isnan().all()) and not bool(o[0, 1].isnan().any())
    except Exception as e:  # noqa: BLE001
        nan_ok = f"{type(e).__name__}: {e}"
    results.append({"nan_in_k_makes_head_nan": nan_ok})
    ok_all &= nan_ok is True
    out["check"] = {"passed": ok_all, "cases": results}
    return ok_all


def main(argv=None):
    argv = sys.argv if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results/h200-attention.json"))
    ap.add_argument("--check", action="store_true", help="correctness of attention_int8 at a few shapes, then the "
                                                        "benchmark")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for the whole run")
    args = ap.parse_args(argv[1:])
    out = {"provenance": provenance(argv), "skipped": None}
    ok = True
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if not torch.cuda.is_available():
            out["skipped"] = "no CUDA GPU (torch.cuda.is_available() is False)"
        else:
            try:
                __import__("triton")
                __import__("kernel.attention8")
            except Exception as e:  # noqa: BLE001
                out["pack_int8_import_error"] = f"{type(e).__name__}: {e}"
            if args.check:
                ok = run_check(out)
            run_bench(args, out)
    except Exception as e:  # noqa: BLE001 - write what there is
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
        traceback.print_exc()
    out["seconds"] = round(time.time() - T0, 1)
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {path} ({out['seconds']} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
