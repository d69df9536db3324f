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

DynamicVRAM (``ModelPatcherDynamic.load``) also force-loads some tensors and records their originals in
``patcher.backup`` / ``backup_buffers`` (shared by every clone), keyed by their path in the tree *as patched*: every
parameter of a cast layer other than weight and bias, the weight and bias of cast layers of 16 KiB or less, every
parameter of other layers (the norms a fused block holds), every buffer. (An ``Int8Linear``'s ``weight_scale`` and
``smooth`` are not Parameters, so they are neither backed up nor copied at each sample: ``quant.linear``'s module
doc.) Its ``unpatch_model`` undoes the object patches first and gives those originals back afterwards, through the
unpatched tree: a key under a fused module that the float model lacks (``feed_forward.w13``) raises AttributeError,
and one that exists there (``attention.qkv``) adds the INT8 module's tensor to ComfyUI's float one.
:func:`restore_patched_backups`, the eject step of :func:`injection` (which the Apply node and the Ideogram 4 loader
put on their MODEL), gives those back while the object patches are still applied: ComfyUI ejects a patcher before it
undoes its object patches (``unpatch_model``, ``detach``, ``partially_load``, and when a clone of it is loaded).
"""
from __future__ import annotations

import weakref

import torch

from ..quant import linear

#: blocks and modules fetched by :func:`fetch_block` in this process (benchmarks report them per step)
stats = {"blocks": 0, "modules": 0}
_MANAGED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_COMFY: tuple | None = None  # (comfy.model_management, cast_modules_with_vbar, cleanup_prefetched_modules) or ()
# comfy.utils, bound by injection() (at Apply): its eject, restore_patched_backups, runs from ModelPatcher.__del__
# (detach -> eject_model), also at interpreter shutdown, where an import raises ImportError (sys.meta_path is None).
_UTILS = None


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
    ComfyUI without ``cast_modules_with_vbar``, or already fetched)."""
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


def _owner(model, path: str, swaps: dict):
    """The object at dotted ``path`` under ``model``, with each prefix found in ``swaps`` replaced by its value
    (``swaps`` = ``object_patches_backup``: the unpatched tree); None where the path does not exist."""
    obj, prefix = model, ""
    for name in path.split(".") if path else ():
        prefix = f"{prefix}.{name}" if prefix else name
        obj = swaps[prefix] if prefix in swaps else getattr(obj, name, None)
    return obj


def restore_patched_backups(patcher) -> int:
    """Give back now, under the applied object patches, every DynamicVRAM backup (module doc) whose module is not
    the same object in the unpatched tree, and drop it from the backups; returns the bytes ComfyUI had counted as
    loaded for them. The others (the float model's own layers, the norms a fused block shares) stay for ComfyUI.
    Only ``ModelPatcherDynamic`` backs such tensors up: a legacy patcher's backups (LoRA patches) are left alone."""
    if not getattr(patcher, "is_dynamic", lambda: False)() or not patcher.object_patches_backup:
        return 0
    utils = _UTILS  # no import here (see _UTILS)
    if utils is None:
        raise RuntimeError("restore_patched_backups runs as the eject of comfy_cast.injection(), which binds "
                           "comfy.utils")
    model, swaps = patcher.model, patcher.object_patches_backup
    seen: dict = {}  # module path -> moved (a module's tensors share it: weight, weight_scale, bias)

    def moved(key):
        path = key.rpartition(".")[0]
        hit = seen.get(path)
        if hit is None:
            parts = path.split(".")
            # only a path through a swapped prefix can lead to another object
            hit = seen[path] = any(".".join(parts[:i]) in swaps for i in range(1, len(parts) + 1)) and \
                _owner(model, path, {}) is not _owner(model, path, swaps)
        return hit
    freed = 0
    for key in [k for k in patcher.backup if moved(k)]:
        freed += utils.get_attr(model, key).nbytes
        bk = patcher.backup.pop(key)
        if bk.inplace_update:
            utils.copy_to_param(model, key, bk.weight)
        else:
            utils.set_attr_param(model, key, bk.weight)
    for key in [k for k in patcher.backup_buffers if moved(k)]:
        freed += utils.get_attr(model, key).nbytes
        utils.set_attr_buffer(model, key, patcher.backup_buffers.pop(key))
    if freed:
        model.model_loaded_weight_memory = max(0, model.model_loaded_weight_memory - freed)
    return freed


def injection():
    """The ``PatcherInjection`` whose eject runs :func:`restore_patched_backups` (its inject does nothing)."""
    global _UTILS
    import comfy.utils
    from comfy.patcher_extension import PatcherInjection
    _UTILS = comfy.utils
    return PatcherInjection(inject=lambda patcher: None, eject=restore_patched_backups)


def install() -> None:
    """Called once when ComfyUI imports the nodes package."""
    linear.set_comfy_cast(cast)
    linear.set_block_fetch(fetch_block)
