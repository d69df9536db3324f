"""The pack's INT8 modules under ComfyUI 0.33.0's MultiGPU CFG Split (issue 51).

"MultiGPU CFG Split" (``comfy.multigpu.create_multigpu_deepclones``) gives each extra GPU a deep clone of the
MODEL: ``ModelPatcher.deepclone_multigpu`` loads a pristine model from the loader's ``cached_patcher_init`` factory
and clones the patcher onto it, so the clone's object patches are the original's: the same ``Int8Linear`` and fused
block objects, built on the original's tree. Loaded on another device, they would be moved there under the
original's feet, and the fused blocks would run the original tree's norms.

The clone gets its own copies instead (``on_deepclone``, a ``ON_DEEPCLONE_MULTIGPU`` callback Apply registers):
every INT8 module of the original deep-copied once, its int8 weights, scales, smoothing and LoRA branches its own,
and everything it shares with the original's tree (a fused block's norms and other float submodules, their
parameters) taken from the clone's own tree at the same name. Nothing is quantized again: the clone runs the same
int8 codes, fused blocks, backend and calibration. Attention routing, pad elision and the timing wrappers live in
``model_options``, which the clone copies.

When the main model is cloned after the split (a later node), ComfyUI matches its multigpu clones again
(``match_multigpu_clones``: a clone of the main patcher on each extra clone's model); ``on_match`` then puts that
extra clone's own copies back in place of the main model's modules, and copies any INT8 module added since (a
second Apply).
"""
from __future__ import annotations

import copy
import functools
import logging
import weakref

from .weights import PREFIX, original_modules
from ..quant.linear import Derived, Int8Linear

log = logging.getLogger("int8_fused")
_SOURCE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # a clone's copy -> weakref to what it copies


def is_pack_module(module) -> bool:
    """An INT8 module of the pack: an ``Int8Linear`` or a fused module (it lists its INT8 layers)."""
    return isinstance(module, Int8Linear) or callable(getattr(module, "int8_layers", None))


def pack_patches(patcher) -> dict:
    """{object patch key: module} of ``patcher``'s INT8 modules."""
    return {k: m for k, m in patcher.object_patches.items() if k.startswith(PREFIX) and is_pack_module(m)}


def _int8_layers(module) -> list:
    return [m for m in module.modules() if isinstance(m, Int8Linear)]


def _twins(src, dst) -> dict:
    """deepcopy memo: each module, parameter and buffer of ``src``'s original tree -> ``dst``'s at the same name."""
    theirs = dict(original_modules(dst))
    memo = {}
    for name, mod in original_modules(src):
        twin = theirs.get(name)
        if twin is None or type(twin) is not type(mod):
            continue
        memo[id(mod)] = twin
        for attr in ("_parameters", "_buffers"):
            for key, t in getattr(mod, attr).items():
                other = getattr(twin, attr).get(key)
                if t is not None and other is not None and other.shape == t.shape:
                    memo[id(t)] = other
    return memo


def copies_for(src, dst, keys) -> dict:
    """Deep copies of ``src``'s INT8 modules at ``keys`` for ``dst`` (module doc), in one pass so that what they
    share among themselves stays shared."""
    mods = {k: src.object_patches[k] for k in keys}
    # the copies start without the original's derived state (device copies, prepared launches of its device,
    # dispatch decisions, LoRA branches of its runs): each layer holds an empty one while it is copied
    kept = [(layer, layer.derived) for m in mods.values() for layer in _int8_layers(m)]
    memo = _twins(src, dst)
    try:
        for layer, _ in kept:
            layer.derived = Derived()
        out = copy.deepcopy(mods, memo)
    finally:
        for layer, derived in kept:
            layer.derived = derived
    for k, c in out.items():
        _SOURCE[c] = weakref.ref(mods[k])
    return out


def _source(module):
    ref = _SOURCE.get(module)
    return None if ref is None else ref()


def on_deepclone(src, clone) -> None:
    """``ON_DEEPCLONE_MULTIGPU``: ``clone`` (a freshly loaded model for another device) gets its own INT8 modules."""
    mine = pack_patches(src)
    if not mine:
        return
    clone.object_patches.update(copies_for(src, clone, mine))
    log.info("INT8 MultiGPU: %d INT8 modules copied for the clone on %s (the same int8 codes, fused blocks and "
             "backend)", len(mine), clone.load_device)


def on_match(src, clone, install_lora=None) -> None:
    """``ON_MATCH_MULTIGPU_CLONES`` (each sampling run, after the run-start wrappers): ``clone`` (``src`` cloned onto
    an extra clone's model) runs that extra clone's own copies; INT8 modules ``src`` has that it has not (added
    after the split) are copied for it. ``install_lora(clone)``: a LoRA after Apply runs on the clone's own layers
    as on ``src``'s (the run-start wrapper gave ``src``'s layers their branches; the clone carries the same LoRA
    patches in its attachment)."""
    mine = pack_patches(src)
    if not mine:
        return
    extra = next((m for m in src.get_additional_models_with_key("multigpu") if m.model is clone.model), None)
    theirs = pack_patches(extra) if extra is not None else {}
    reuse = {k: theirs[k] for k, m in mine.items() if k in theirs and _source(theirs[k]) is m}
    clone.object_patches.update(reuse)
    fresh = [k for k in mine if k not in reuse]
    if fresh:
        clone.object_patches.update(copies_for(src, clone, fresh))
        log.info("INT8 MultiGPU: %d INT8 modules copied for the clone on %s", len(fresh), clone.load_device)
    if install_lora is not None:
        install_lora(clone)


def register(patcher, key: str, install_lora=None) -> None:
    """Both callbacks on ``patcher`` (Apply's output, the Ideogram 4 loader's MODELs) under ``key``;
    ``install_lora``: nodes.apply.install_lora (LoRA after Apply on the clones, ``on_match``)."""
    from comfy.patcher_extension import CallbacksMP
    deep = getattr(CallbacksMP, "ON_DEEPCLONE_MULTIGPU", None)
    match = getattr(CallbacksMP, "ON_MATCH_MULTIGPU_CLONES", None)
    if deep is None or match is None:  # a ComfyUI without MultiGPU CFG Split
        return
    patcher.remove_callbacks_with_key(deep, key)
    patcher.remove_callbacks_with_key(match, key)
    patcher.add_callback_with_key(deep, key, on_deepclone)
    patcher.add_callback_with_key(match, key, functools.partial(on_match, install_lora=install_lora))
