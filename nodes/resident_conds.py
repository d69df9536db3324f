"""The run's conditioning on the GPU for the whole sampling run.

ComfyUI keeps text-encoder outputs on the CPU. In every model call it concatenates the batch's conditioning
there (``CONDRegular.concat``, a new tensor each call) and copies it to the GPU from pageable memory
(``cast_to_device`` in ``BaseModel._apply_model``). A pageable copy cannot start before the GPU has finished
the work queued before it, so each such call drains the GPU queue: Ideogram 4's 512 × 53248 text features are
52 MiB a step. The GPU then idles through the copy and until the host has queued the next kernels.

This SAMPLER_SAMPLE wrapper moves the tensors of the run's processed conditioning to the model's device once,
before the first step. ComfyUI's per-call concat then runs on the GPU, and its cast is a no-op when the dtype
already matches, or a GPU-side conversion otherwise (the same round-to-nearest as the conversion during a copy).
Only the run's own copies change: ``process_conds`` builds new ``model_conds`` dicts for every run, and the
wrapper replaces their entries with new objects (and puts the originals back when the run ends), so the user's
CONDITIONING stays as it was, on the CPU, and no GPU copy outlives the run.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("int8_fused")

stats = {"runs": 0, "moved_bytes": 0}  # sampling runs the wrapper saw, bytes it moved (tests, bench)


def _on(t, device: torch.device):
    """``t`` (a tensor, or a list of tensors) on ``device``; None when nothing moved."""
    if torch.is_tensor(t):
        new = t.to(device)
        return None if new is t else new
    if isinstance(t, list) and t and all(torch.is_tensor(x) for x in t):
        new = [x.to(device) for x in t]
        return None if all(a is b for a, b in zip(new, t)) else new
    return None


def move_conds(guider, device: torch.device):
    """Replace the tensors of ``guider``'s processed conditioning (``guider.conds``, and the uncond conds of
    ComfyUI's ``Guider_DualModel``) by copies on ``device``. Constants (``CONDConstant``: numbers, flags,
    Python-side values) are left where they are. Returns (bytes moved, ``undo``): ``undo()`` puts the original
    objects back, so no copy outlives the run (ComfyUI keeps a guider's conds after an interrupted run, and
    Guider_DualModel its uncond conds after every run)."""
    import comfy.conds
    lists = list((getattr(guider, "conds", None) or {}).values())
    uncond = getattr(guider, "_uncond_conds", None)
    if isinstance(uncond, list):
        lists.append(uncond)
    moved, replaced = 0, []
    for conds in lists:
        for c in conds or ():
            mc = c.get("model_conds") if isinstance(c, dict) else None
            for k, obj in list((mc or {}).items()):
                if not isinstance(obj, comfy.conds.CONDRegular) or isinstance(obj, comfy.conds.CONDConstant):
                    continue
                new = _on(obj.cond, device)
                if new is None:
                    continue
                mc[k] = obj._copy_with(new)
                replaced.append((mc, k, obj))
                moved += sum(x.numel() * x.element_size() for x in (new if isinstance(new, list) else [new]))

    def undo():
        for mc, k, obj in replaced:
            mc[k] = obj
        replaced.clear()
    return moved, undo


def sampler_sample_wrapper(executor, guider, *args, **kwargs):
    """ComfyUI SAMPLER_SAMPLE wrapper (runs after ``process_conds``, before the first step; the CPU originals are
    put back when the run ends, however it ends)."""
    stats["runs"] += 1
    device = getattr(getattr(guider, "model_patcher", None), "load_device", None)
    if device is None or torch.device(device).type == "cpu":
        return executor(guider, *args, **kwargs)
    n, undo = move_conds(guider, torch.device(device))
    stats["moved_bytes"] += n
    if n:
        log.debug("INT8: %.1f MiB of conditioning moved to %s for the sampling run", n / 2 ** 20, device)
    try:
        return executor(guider, *args, **kwargs)
    finally:
        undo()
