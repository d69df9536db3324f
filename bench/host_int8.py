"""Host time of each layer of the INT8 call stack on a CUDA GPU, on a problem so small (M 64 x K 256 x N 256) that
the GPU work (a few us a kernel) hides under the host's: a loop of calls then runs at the host's rate, so wall time
a call is host time a call. From the bottom up: one ``torch.empty``, a bare ``F.linear`` and an ``nn.Linear`` (the
bf16 bars), one raw re-launch of the compiled GEMM (the floor of any launch from Python), the pack's ``launch``,
``int8_gemm`` (checks, output, config), ``quantize_per_token``, ``int8_linear`` (both), the fused blocks' entry
``quant.blocks.linear`` / ``gemm`` / ``act_quant``, a row kernel (Flux's LayerNorm · modulation + quantize) and an
``Int8Linear`` module call forced onto int8, each through its prepared launches (kernel/plan.py); last an ``Int8Linear`` call on the float path (its hot ``F.linear``, against ``nn.Linear``'s). What a linear's
host time is spent on. First it checks that the planned calls give the checked path's outputs bit for bit.

    python bench/host_int8.py [--calls 2000] [--repeats 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
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


def per_call_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("host_int8: needs a CUDA GPU (it times real kernel launches)")
        return 2
    import kernel
    from kernel import config, gemm, launch
    from quant import blocks as qf
    from quant.linear import Int8Linear
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(a.m, a.k, device=dev, dtype=torch.bfloat16)
    x4 = x[:4].contiguous()
    lin = Int8Linear.from_float(torch.randn(a.n, a.k, device=dev), torch.randn(a.n, device=dev),
                                backend="fused_triton", name="probe")
    nn_lin = torch.nn.Linear(a.k, a.n, device=dev, dtype=torch.bfloat16)
    w_bf, b_bf = nn_lin.weight.detach(), nn_lin.bias.detach()
    w_q, w_s, bias = lin.weight, lin.weight_scale, lin.bias
    a_q, a_s = kernel.quantize_per_token(x)
    out = torch.empty(a.m, a.n, device=dev, dtype=torch.bfloat16)
    cfg = gemm.select_config(a_q, a_s, w_q, w_s, bias, out)
    gemm.launch_int8_gemm(a_q, a_s, w_q, w_s, bias, out, cfg)  # compiles, and fills launch's cache
    entry = [v for k, v in launch._COMPILED.items() if k[0] is gemm._int8_gemm_kernel]
    grid = (-(-a.m // cfg["BLOCK_M"]) * -(-a.n // cfg["BLOCK_N"]),)
    # the plain launch (no tail split): a_scale stands in for the unused partials / counters, every tile whole
    raw_args = (a_q, w_q, out, a_s, w_s, bias, a_s, a_s, a.m, a.n, a.k, grid[0], 0, a_q.stride(0), a_q.stride(1),
                w_q.stride(0), w_q.stride(1), out.stride(0), out.stride(1), a_s.stride(0), w_s.stride(0),
                bias.stride(0))

    qmod = kernel._mod("quantize")
    qentry = [v for k, v in launch._COMPILED.items() if k[0] is qmod._quant_rows_kernel]

    def raw():
        compiled, tail = entry[0]
        compiled.run(grid[0], 1, 1, torch._C._cuda_getCurrentRawStream(dev.index or 0), compiled.function,
                     compiled.packed_metadata, None, None, None, *raw_args, *tail)

    def lean():  # the floor of a W8A8 linear from Python: three allocations and two raw launches
        q = torch.empty((a.m, a.k), dtype=torch.int8, device=dev)
        s = torch.empty((a.m,), dtype=torch.float32, device=dev)
        o = torch.empty((a.m, a.n), dtype=torch.bfloat16, device=dev)
        stream = torch._C._cuda_getCurrentRawStream(dev.index or 0)
        (cq, tq), (cg, tg) = qentry[0], entry[0]
        cq.run(a.m, 1, 1, stream, cq.function, cq.packed_metadata, None, None, None,
               x, s, q, s, a.m, a.k, x.stride(0), x.stride(1), q.stride(0), *tq)
        cg.run(grid[0], 1, 1, stream, cg.function, cg.packed_metadata, None, None, None,
               q, w_q, o, s, w_s, bias, s, s, a.m, a.n, a.k, grid[0], 0, q.stride(0), q.stride(1), w_q.stride(0),
               w_q.stride(1), o.stride(0), o.stride(1), s.stride(0), w_s.stride(0), bias.stride(0), *tg)

    mod_s = torch.randn(2, 1, a.k, device=dev, dtype=torch.bfloat16)  # Flux's [B, 1, K] modulation rows
    mod_sh = torch.randn(2, 1, a.k, device=dev, dtype=torch.bfloat16)
    y_plan, plan_obj = kernel.int8_linear_planned(x, w_q, w_s, bias)
    checks = {}  # the planned calls give the checked path's bits (same kernels, configs, arguments)
    with torch.no_grad(), config.override(INT8_FUSED_DISPATCH="int8"):
        for xx in (x, x4):
            want = kernel.int8_linear(xx, w_q, w_s, bias)
            for _ in range(3):
                checks.setdefault(f"Int8Linear M{xx.shape[0]}", []).append(torch.equal(lin(xx), want))
                checks.setdefault(f"quant.blocks.linear M{xx.shape[0]}", []).append(
                    torch.equal(qf.linear(lin, xx), want))
        want = kernel.int8_gemm(a_q, a_s, w_q, w_s, bias, out_dtype=x.dtype)
        for _ in range(3):
            checks.setdefault("quant.blocks.gemm", []).append(torch.equal(qf.gemm(a_q, a_s, lin, x.dtype), want))
        for name, f in (("act_quant", lambda: qf.act_quant(x, None)),
                        ("LayerNorm·mod+quantize", lambda: qf.ln_mod_quant(x, mod_s, mod_sh, a.m // 2, None, 1e-6))):
            want = f()  # the first call of this key: the checked wrapper, recording the plan the next ones re-issue
            checks[name] = [all(torch.equal(u, v) for u, v in zip(f(), want)) for _ in range(3)]
        checks["plan(x)"] = [plan_obj is not None and torch.equal(plan_obj(x, w_q, w_s, bias, None),
                                                                  kernel.int8_linear(x, w_q, w_s, bias))]
    checks = {k: all(v) for k, v in checks.items()}
    print("planned == checked, bit for bit:", checks)
    cases = {
        "torch.empty": lambda: torch.empty((a.m, a.k), dtype=torch.int8, device=dev),
        "F.linear bf16": lambda: F.linear(x, w_bf, b_bf),
        "nn.Linear bf16": lambda: nn_lin(x),
        "raw compiled.run (GEMM)": raw if entry else None,
        "lean W8A8 floor (3 empty, 2 raw)": lean if entry and qentry else None,
        "launch_int8_gemm": lambda: gemm.launch_int8_gemm(a_q, a_s, w_q, w_s, bias, out, cfg),
        "int8_gemm": lambda: kernel.int8_gemm(a_q, a_s, w_q, w_s, bias),
        "quantize_per_token": lambda: kernel.quantize_per_token(x),
        "int8_linear": lambda: kernel.int8_linear(x, w_q, w_s, bias),
        "int8_linear M4 (one launch)": lambda: kernel.int8_linear(x4, w_q, w_s, bias),
        "int8_linear plan": (lambda: plan_obj(x, w_q, w_s, bias, None)) if plan_obj is not None else None,
        "quant.blocks.gemm": lambda: qf.gemm(a_q, a_s, lin, x.dtype),
        "quant.blocks.linear": lambda: qf.linear(lin, x),
        "quant.blocks.act_quant": lambda: qf.act_quant(x, None),
        "LayerNorm·mod+quantize": lambda: qf.ln_mod_quant(x, mod_s, mod_sh, a.m // 2, None, 1e-6),
        "Int8Linear int8": lambda: lin(x),
        "Int8Linear int8 M4": lambda: lin(x4),
        "Int8Linear float path": lambda: lin(x),  # INT8_FUSED_DISPATCH=float: the hot F.linear of forward
    }
    cases = {k: v for k, v in cases.items() if v is not None}
    res: dict[str, list] = {k: [] for k in cases}
    with torch.no_grad(), config.override(INT8_FUSED_DISPATCH="int8"):
        def switches(k):  # "float path": dispatch forced to the float path
            return config.override(INT8_FUSED_DISPATCH="float" if k.endswith("float path") else "int8")
        for k, f in cases.items():
            with switches(k):
                for _ in range(50):
                    f()
        for _ in range(a.repeats):  # interleaved: drift of the host hits every case alike
            for k, f in cases.items():
                with switches(k):
                    res[k].append(per_call_us(f, a.calls))
    import triton
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"host us a call, median of {a.repeats} x {a.calls} (M {a.m} K {a.k} N {a.n}; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__})")
    for k, v in med.items():
        print(f"  {k:30s} {v:7.1f}  (min {min(res[k]):.1f}, max {max(res[k]):.1f})")
    if a.json:
        Path(a.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                            "triton": triton.__version__, "m": a.m, "k": a.k, "n": a.n,
                                            "calls": a.calls, "repeats": a.repeats, "median_us": med,
                                            "planned_equals_checked": checks,
                                            "all_us": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
