"""Helpers shared by the fused-block tests (test_flux_fused, test_wan_fused, test_lumina2_fused): the model's INT8
layers as Apply selects them, a copy of a module with patches swapped in, relative L2 error and ulp distance; and the
sm_90 build checks of the kernel tests (test_fused, test_flux_fused, test_qk_norm_rope, test_wan_residual)."""
import contextlib
import copy

import torch


def int8_layers(pack, dm, backend="fused_triton") -> dict:
    """{name: Int8Linear} of ``dm``'s block linears (its adapter's presets), quantized on ``backend``."""
    A = pack.adapters
    pairs = pack.quant.select.select_linears(dm, "blocks", rules=A.block_rules(dm))
    return pack.quant.patch.build_int8_layers(pairs, backend)[0]


def swapped(module, patches: dict):
    """A deep copy of ``module`` with ``patches`` ({dotted name: module}) set in place; ``module`` is untouched."""
    import comfy.utils
    m = copy.deepcopy(module)
    for name, sub in patches.items():
        comfy.utils.set_attr(m, name, sub)
    return m


def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights for a tiny model in place: norm scales near 1, matrices ~ N(0, 1/fan_in), other vectors small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.dim() == 1 and "norm" in n:
                p.copy_(1 + 0.1 * r)
            elif p.dim() >= 2:
                p.copy_(r * p[0].numel() ** -0.5)
            else:
                p.copy_(0.05 * r)
    return module


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of a's dtype's ulp at b (0 where equal), float64."""
    eps = torch.finfo(a.dtype).eps
    return (a.double() - b.double()).abs() / (b.double().abs().clamp_min(torch.finfo(a.dtype).tiny) * eps)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def build_sm90(fn, types: dict, consts: dict, num_warps: int = 8) -> str | None:
    """Compiles the Triton kernel ``fn`` for sm_90 (Triton's bundled ptxas; no GPU needed): ``types`` the Triton
    types of its pointer / float parameters (the others i32), ``consts`` its constexprs. None when a cubin came out,
    else what is missing (call it in a process without TRITON_INTERPRET)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps})
    return None if "cubin" in k.asm else f"no cubin for {fn.fn.__name__} {consts}"


def hopper_check_in_subprocess(module: str, env: dict | None = None) -> None:
    """Asserts that ``tests/<module>.py``'s ``_hopper_check()`` returns "OK" (the compiled, non-interpreter branches
    of its kernels build for sm_90 with Triton's bundled ptxas; no GPU needed). In a subprocess without
    TRITON_INTERPRET (under which kernels are not compilable) and with ``env`` added (switches taken at import);
    skipped where sm_90 code cannot be built here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest
    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[1]
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **(env or {})}
    code = (f"import sys; sys.path[:0] = [{str(root)!r}, {str(root / 'tests')!r}]\n"
            f"import pack_import; pack_import.install()\n"
            f"import {module} as t\nprint('RESULT', t._hopper_check())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    out = r.stdout + r.stderr
    if "ptxas" in out and r.returncode != 0 and "RESULT" not in out:
        pytest.skip(f"cannot build sm_90 code here: {out[-500:]}")
    assert "RESULT OK" in r.stdout, out[-3000:]


@contextlib.contextmanager
def unplanned(plan):
    """Inside, a kernel wrapper called through ``plan.call`` (``plan``: the pack's ``kernel.plan`` module; the fused
    blocks' row kernels) runs itself each time, so a spy on it sees each call (a prepared call re-issues its launches
    without the wrapper)."""
    call = plan.call
    plan.call = lambda fn, *args, salt=(): fn(*args)
    try:
        yield
    finally:
        plan.call = call
