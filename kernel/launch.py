"""A lean launcher for the two kernels: after the first call of a specialization, re-launch the compiled kernel
directly instead of going through ``JITFunction.run`` every time.

Why: measured on the H200 machine (bench/host_int8.py), the host side of one W8A8 linear (two Triton launches and
the wrapper's checks) cost 150-200 us, longer than the GEMM itself on o-projection shapes. ``JITFunction.run``
re-binds every argument, stringifies the options for its cache key and checks globals on each call.

Safety: the cache key holds everything Triton specializes on — every constexpr, num_warps/num_stages, tensor
dtypes and 16-byte pointer alignment, and integers by value (finer than what Triton specializes on: equal to 1,
divisible by 16, beyond int32; a Python int compares cheaper than those three tests) — so a kernel is
only reused for arguments it was compiled for. Anything unusual (a profiler's launch hook, the interpreter, a
Triton whose launcher call differs) takes the normal Triton path.

Launch hooks live in ``triton.knobs.runtime`` (Triton >= 3.4): ``None`` when unset in 3.4, an always-present
``HookChain`` whose ``calls`` list is empty when unset since 3.5 (through 3.9 at least); ``launch_hooked``
reads both forms. The re-launch repeats ``JITFunction.run``'s launcher call, the same in Triton 3.6 to 3.9;
``same_launcher_call`` reads the installed Triton's source once and, where that call differs, leaves every
launch to Triton.

Row counts stay out of Triton's specialization: each kernel names the arguments that follow the token count (``M``,
tile counts, tokens per batch, ``L``) in ``do_not_specialize``, so a resolution whose token count differs in
divisibility by 16 (Wan 2.1 at 480x832: 14040; at 384x672: 9072) reuses the compiled kernels instead of compiling
each again (the PTX's loads, stores and wgmma are the same either way; tests/test_compile_procs.py).

``record()`` collects the launches made inside it (what ran, with which arguments): ``kernel.plan`` turns the
launches of one checked call into a plan that later calls with the same operand signature re-issue directly.
"""
from __future__ import annotations

import contextlib
import logging
import weakref

import torch

from . import ahead, config

_COMPILED: dict[tuple, tuple] = {}
_MAX_ENTRIES = 4096
_USE_FAST = not config.get("TRITON_INTERPRET")


def arg_key(v):
    """What a compiled kernel depends on of a non-integer argument (a tensor: dtype and 16-byte alignment; a TMA
    descriptor: its tensor's dtype, block shape and padding)."""
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    if isinstance(v, int):
        return v == 1, v % 16 == 0, -(1 << 31) <= v < (1 << 31)
    if is_descriptor(v):
        return "desc", v.base.dtype, tuple(v.block_shape), v.padding
    return v


def is_descriptor(v) -> bool:
    """A host TMA descriptor (``triton.tools.tensor_descriptor.TensorDescriptor``)."""
    return type(v).__name__ == "TensorDescriptor" and hasattr(v, "base") and hasattr(v, "block_shape")


def base_of(v):
    """The tensor a TMA descriptor describes; any other argument itself."""
    return v.base if is_descriptor(v) else v


def on_base(v, t: torch.Tensor):
    """``v`` for the tensor ``t``: a TMA descriptor of ``v``'s shape, strides, block and padding over ``t``, else
    ``t``. ``t`` must have ``v``'s base's layout (dtype size, 16-byte alignment), as a prepared call's operands do."""
    if not is_descriptor(v):
        return t
    return descriptor_over(t, type(v), v.shape, v.strides, v.block_shape, v.padding)


def descriptor_over(t: torch.Tensor, desc_type, shape, strides, block_shape, padding):
    """A TMA descriptor over ``t`` with a layout already checked once (the recorded call's): made without the
    class's checks, a third of its construction time on the host path of every call."""
    d = object.__new__(desc_type)
    d.__dict__.update(base=t, shape=shape, strides=strides, block_shape=block_shape, padding=padding)
    return d


def _hook_set(hook) -> bool:
    """Whether a launch-hook knob holds a hook: None and an empty chain do not; a bare callable does."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)  # triton.knobs.HookChain (3.5+)
    if calls is not None:
        return len(calls) > 0
    if hasattr(hook, "__len__"):          # a chain that only reports its length
        return len(hook) > 0
    return True                           # a plain callable (3.4's Optional[LaunchHook]) or unknown: a hook


# How JITFunction.run hands a compiled kernel to its launcher, which launch() repeats (whitespace-normalized):
# the same in Triton 3.6.0, 3.7.0, 3.8.0 and 3.9.0 (read from their wheels, 2026-12-01).
_TRITON_CALL = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, "
                "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())")
_SAME_CALL: bool | None = None   # decided on the first launch on a GPU, then kept


def same_launcher_call() -> bool:
    """Whether this Triton's ``JITFunction.run`` launches a compiled kernel the way ``launch`` re-launches it.
    Where it does not (a Triton that changed that call), every launch takes Triton's own path, logged once:
    slower on the host, never wrong."""
    global _SAME_CALL
    if _SAME_CALL is None:
        try:
            import inspect

            from triton.runtime.jit import JITFunction
            _SAME_CALL = " ".join(_TRITON_CALL.split()) in " ".join(inspect.getsource(JITFunction.run).split())
        except Exception:  # noqa: BLE001  (no source to read: do not guess)
            _SAME_CALL = False
        if not _SAME_CALL:
            import triton
            logging.getLogger("int8_fused").info(
                "Triton %s launches kernels differently from what kernel/launch.py expects: every kernel launch "
                "goes through Triton's own path (more host time per call, same results)", triton.__version__)
    return _SAME_CALL


def fast_launch_ok() -> bool:
    """Whether compiled kernels may be re-launched directly here (not the interpreter, the installed Triton's
    launcher call as ``launch`` repeats it)."""
    return _USE_FAST and bool(_SAME_CALL or same_launcher_call())


def launch_hooked(runtime_knobs) -> bool:
    """Whether anything (a profiler) hooks kernel launches: then every launch must go through Triton."""
    return _hook_set(runtime_knobs.launch_enter_hook) or _hook_set(runtime_knobs.launch_exit_hook)


_RECORD: list | None = None  # the launches of the current record() (None: not recording)


def dry_run() -> bool:
    """Whether a dry run of ``kernel.ahead`` is in progress: launches compile instead of running; callers record
    no prepared call and count nothing."""
    return ahead.active() is not None
_KEPT: dict[int, weakref.ref] = {}  # id -> tensor a launcher keeps across its calls (``keep``)


def keep(t: torch.Tensor) -> torch.Tensor:
    """Marks ``t`` as a buffer its launcher reuses across calls (the GEMM's tail-split scratch, which every launch
    leaves as it found it): a plan (``kernel.plan``) that records a launch reading it keeps that very tensor."""
    i = id(t)

    def forget(r, i=i):
        if _KEPT.get(i) is r:
            del _KEPT[i]
    _KEPT[i] = weakref.ref(t, forget)
    return t


def kept(t: torch.Tensor) -> bool:
    r = _KEPT.get(id(t))
    return r is not None and r() is t


@contextlib.contextmanager
def record():
    """Collects every ``launch`` made inside, in order, as :class:`Launch` entries (not thread-safe: one
    recording at a time, as the pack's callers make them). Nested: the inner one takes the launches."""
    global _RECORD
    outer, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = outer


def note(entry: "Launch") -> None:
    """Adds a launch made outside ``launch`` (``kernel.s8wgmma``) to the current ``record()``, if any."""
    if _RECORD is not None:
        _RECORD.append(entry)


@contextlib.contextmanager
def not_recorded():
    """Launches inside are not recorded (an autotuner timing candidate configs inside a recorded call)."""
    global _RECORD
    outer, _RECORD = _RECORD, None
    try:
        yield
    finally:
        _RECORD = outer


class Launch:
    """One recorded launch: ``jit_fn[grid](*args, **constexprs, num_warps=, num_stages=)``; ``compiled`` and
    ``tail`` (the constexpr values in signature order) when the direct re-launch may repeat it, else None."""
    __slots__ = ("jit_fn", "grid", "args", "constexprs", "num_warps", "num_stages", "compiled", "tail")

    def __init__(self, jit_fn, grid, args, constexprs, num_warps, num_stages, compiled=None, tail=None):
        self.jit_fn, self.grid, self.args, self.constexprs = jit_fn, grid, args, constexprs
        self.num_warps, self.num_stages, self.compiled, self.tail = num_warps, num_stages, compiled, tail


def launch(jit_fn, grid: tuple, args: tuple, constexprs: dict, num_warps: int, num_stages: int,
           device: torch.device) -> None:
    """``jit_fn[grid](*args, **constexprs, num_warps=, num_stages=)``, with the compiled kernel reused.
    ``args`` are the runtime arguments in signature order; ``constexprs`` the remaining parameters. Inside a dry run
    of ``kernel.ahead`` it starts the kernel's compile instead (nothing runs, nothing is recorded)."""
    a = ahead.active()
    if a is not None and device.type == "cuda":
        a.compile(launch_key(jit_fn, args, constexprs, num_warps, num_stages, device), jit_fn, grid, args, constexprs,
                  num_warps, num_stages, device)
        return
    if not _USE_FAST or device.type != "cuda" or not (_SAME_CALL or same_launcher_call()):
        jit_fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        if _RECORD is not None:
            _RECORD.append(Launch(jit_fn, grid, args, constexprs, num_warps, num_stages))
        return
    import triton
    key = launch_key(jit_fn, args, constexprs, num_warps, num_stages, device)
    hit = _COMPILED.get(key)
    if hit is None or launch_hooked(triton.knobs.runtime):
        compiled = jit_fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        if compiled is not None and hasattr(compiled, "run") and hasattr(compiled, "function"):
            tail = tuple(constexprs[name] for name in jit_fn.arg_names[len(args):])
            if len(_COMPILED) >= _MAX_ENTRIES:  # integers are keyed by value: bound the entries (many M values)
                _COMPILED.clear()
            _COMPILED[key] = (compiled, tail)
            if _RECORD is not None:
                _RECORD.append(Launch(jit_fn, grid, args, constexprs, num_warps, num_stages, compiled, tail))
        elif _RECORD is not None:
            _RECORD.append(Launch(jit_fn, grid, args, constexprs, num_warps, num_stages))
        return
    compiled, tail = hit
    run_compiled(compiled, tail, grid, args, device)
    if _RECORD is not None:
        _RECORD.append(Launch(jit_fn, grid, args, constexprs, num_warps, num_stages, compiled, tail))


def launch_key(jit_fn, args: tuple, constexprs: dict, num_warps: int, num_stages: int, device: torch.device):
    """What a compiled kernel of ``jit_fn`` is reused for: everything Triton specializes on (module docstring)."""
    return (jit_fn, device.index, tuple(constexprs.values()), num_warps, num_stages,
            tuple([a if type(a) is int else arg_key(a) for a in args]))  # an int by value: finer, cheaper


def run_compiled(compiled, tail: tuple, grid: tuple, args: tuple, device: torch.device) -> None:
    """Launches the CompiledKernel ``compiled`` directly on the current stream (no launch hooks)."""
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    n = len(grid)
    compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *tail)
