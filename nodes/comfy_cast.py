"""How an ``Int8Linear`` and the fused blocks fetch the weights ComfyUI manages.

ComfyUI marks the layers whose weights it does not keep resident in the module itself with
``comfy_cast_weights`` (every such layer under DynamicVRAM's ``ModelPatcherDynamic``; the offloaded ones
of a legacy partial load) and expects their forward to fetch weights through ``comfy.ops.cast_bias_weight``
and hand them back with ``uncast_bias_weight``. That is what ComfyUI's own layers do, so the int8 weights
follow the same road as every other weight: DynamicVRAM's VRAM "vbar" (faulted in once from pinned memory,
resident across steps until ComfyUI evicts them) or, on the legacy patcher, ComfyUI's offload stream.

The fetch asks for the stored dtypes (int8 weight, fp32 bias), so ComfyUI moves bytes and never casts.

Per layer, that fetch costs host time even when the weight is resident (the offload stream synchronised with the
compute stream twice, a vbar fault and signature check, the unpin). :func:`fetch_block` does what ComfyUI's own
prefetching models do (``comfy.model_prefetch``): one ``comfy.ops.cast_modules_with_vbar`` over every managed
module of a fused block before it runs, after which each layer's ``cast_bias_weight`` takes the fetched
weights; ``comfy.model_prefetch.cleanup_prefetched_modules`` releases them once the block's kernels are queued.
"""
from __future__ import annotations

import weakref

import torch

from ..kernel import config
from ..quant import linear

#: blocks and modules fetched by :func:`fetch_block` in this process (benchmarks report them per step)
stats = {"blocks": 0, "modules": 0}
_MANAGED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_COMFY: tuple | None = None  # (comfy.model_management, cast_modules_with_vbar, cleanup_prefetched_modules) or ()


def cast(layer, device: torch.device):
    """(weight, bias, release) of ``layer`` on ``device``; call ``release()`` once the kernels using them
    are queued (DynamicVRAM unpins the vbar then; the legacy path waits for the offload stream)."""
    import comfy.ops
    bias_dtype = None if layer.bias is None else layer.bias.dtype
    w, b, stream = comfy.ops.cast_bias_weight(layer, None, dtype=layer.weight.dtype, device=device,
                                              bias_dtype=bias_dtype, offloadable=True)
    return w, b, (lambda: comfy.ops.uncast_bias_weight(layer, w, b, stream))


def fetch_block(block: torch.nn.Module, device: torch.device):
    """Fetch every DynamicVRAM-managed weight under ``block`` onto ``device`` in one ComfyUI call; returns the
    release to call after the block's forward, or None when there is nothing to fetch (no DynamicVRAM, a
    ComfyUI without ``cast_modules_with_vbar``, INT8_FUSED_BLOCK_FETCH=0, or already fetched)."""
    if not config.get("INT8_FUSED_BLOCK_FETCH"):
        return None
    mods = _MANAGED.get(block)
    if mods is None:
        mods = _MANAGED[block] = tuple(m for m in block.modules() if hasattr(m, "comfy_cast_weights"))
    todo = [m for m in mods if hasattr(m, "_v") and not hasattr(m, "_prefetch")]
    if not todo or not _comfy_functions():
        return None
    mm, cast_all, cleanup = _COMFY
    if mm.is_device_cpu(device):
        return None
    try:
        stream = cast_all(todo, None, device, None, mm.device_supports_non_blocking(device))
    except BaseException:
        cleanup(block, todo)
        raise
    mm.sync_stream(device, stream)
    stats["blocks"] += 1
    stats["modules"] += len(todo)

    def release():
        if stream is not None:  # the offload stream may reuse its buffers only after the block's kernels
            stream.wait_stream(mm.current_stream(device))
        cleanup(block, todo)
    return release


def _comfy_functions() -> tuple:
    """ComfyUI's multi-module vbar fetch and its cleanup, looked up on the first block call (an empty tuple for a
    ComfyUI without them, e.g. 0.3.75: then every layer fetches its own weights)."""
    global _COMFY
    if _COMFY is None:
        import comfy.model_management as mm
        import comfy.ops
        try:
            import comfy.model_prefetch as mp
        except ImportError:
            mp = None
        cast_all = getattr(comfy.ops, "cast_modules_with_vbar", None)
        cleanup = getattr(mp, "cleanup_prefetched_modules", None)
        _COMFY = (mm, cast_all, cleanup) if cast_all is not None and cleanup is not None else ()
    return _COMFY


def install() -> None:
    """Called once when ComfyUI imports the nodes package."""
    linear.set_comfy_cast(cast)
    linear.set_block_fetch(fetch_block)
