"""The ComfyUI side of ``kernel.ahead``: an APPLY_MODEL wrapper (inside the timing wrapper of nodes/timing.py, which
installs it) that runs a model call's first run for new input shapes after a dry run compiling its INT8 kernels in
parallel. The key: the model, and the shapes and dtypes of the call's tensors (``x``, the conditioning and any
tensor among the keyword arguments), so a new resolution or prompt length gets its own dry run, which compiles only
what is new. The dry run gets its own copy of ``transformer_options`` (the real call gets the caller's)."""
from __future__ import annotations

import torch

from ..kernel import ahead

WRAPPER_KEY = "int8_fused_compile_ahead"


def _shapes(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype)
    if isinstance(v, (list, tuple)):
        return tuple(_shapes(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((str(k), _shapes(x)) for k, x in v.items() if not str(k).startswith("transformer")))
    return None


def apply_model(executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):
    model = getattr(executor, "class_obj", None)
    key = (id(model), _shapes(x), _shapes(c_concat), _shapes(c_crossattn), _shapes(kwargs))

    def dry_then_real():
        return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)

    if ahead.done(key) or not ahead.enabled(x.device):
        return dry_then_real()
    opts = dict(transformer_options)
    first = [True]

    def call():
        if first[0]:   # the dry run: its own options dict
            first[0] = False
            return executor(x, t, c_concat, c_crossattn, control, opts, **kwargs)
        return dry_then_real()
    return ahead.first_call(key, x.device, call)


def install(model_patcher, start_workers: bool = False) -> None:
    """Adds the wrapper to a ModelPatcher (replacing this pack's earlier one); ``start_workers``: the compile worker
    processes start now (``kernel.procs.prestart``: where the dry run will use them)."""
    import comfy.patcher_extension as pe
    model_patcher.remove_wrappers_with_key(pe.WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    model_patcher.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, WRAPPER_KEY, apply_model)
    if start_workers:
        prestart(model_patcher)


def prestart(model_patcher) -> None:
    """Starts the compile worker processes (``kernel.procs``) for a model about to run the pack's kernels, where a
    dry run will use them; their start then overlaps the work before the first sample."""
    ahead.prestart(getattr(model_patcher, "load_device", None))
