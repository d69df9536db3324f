"""Model adapters: what the pack knows about each diffusion-transformer architecture, one folder per family
(``adapters/<model>/``: the adapter in its ``__init__.py``, its fused blocks, its checkpoint layout and patches where
it has them), registered here and looked up by the ComfyUI class of the diffusion model.

    adapter = adapter_for(diffusion_model)            # an Adapter, or None: per-linear INT8 with generic presets
    patches = object_patches(diffusion_model, int8)   # {name relative to the diffusion model: module}

Adding a model is adding its folder and its line in the registry below. Each folder's docstring says which ComfyUI
classes it serves and what it fuses.

Lookup: the diffusion model's class and its bases (``__mro__``) against each adapter's classes. A class path that
imports (the running ComfyUI has it) matches by identity only. A path that does not import (no ComfyUI on the path,
e.g. plain pytest, or a ComfyUI without that module, e.g. 0.3.75 has no ``comfy.ldm.ideogram4``) matches by class
name instead, so a model built from another copy of that class is still recognised. Imports are tried at lookup,
never when this package is imported (ComfyUI has imported its model modules by then; nothing is compiled).
"""
from __future__ import annotations

from torch import nn

from .base import (Adapter, Int8Linear, blocks, config, pad_elision_enabled, PAD_ELISION_ENV,  # noqa: F401
                   select)
from . import flux, ideogram4, lumina2, qwen_image, sd3, wan
from .flux import external_mod as flux_external_mod

# The registry, in lookup order: one line per model.
_ADAPTERS: list[Adapter] = [
    ideogram4.ADAPTER,   # Ideogram 4: whole blocks, FeedForwards, an llm_cond_proj cache; pad-token elision
    lumina2.ADAPTER,     # Lumina 2, Z-Image: modulated blocks, the other blocks' FeedForwards
    flux_external_mod.ADAPTER,  # Flux.1 blocks; Flux.2, Chroma: the same with modulation passed in
    qwen_image.ADAPTER,  # Qwen-Image: joint blocks
    wan.ADAPTER,         # Wan 2.x: WanAttentionBlock
    sd3.ADAPTER,         # SD3.x: per-linear
]


def register(adapter: Adapter) -> Adapter:
    """Add ``adapter`` (a later registration of the same name replaces the earlier one)."""
    _ADAPTERS[:] = [a for a in _ADAPTERS if a.name != adapter.name] + [adapter]
    return adapter


def registered() -> list[Adapter]:
    """Every registered adapter, in lookup order."""
    return list(_ADAPTERS)


def adapter_for(diffusion_model: nn.Module | type | None) -> Adapter | None:
    """The adapter of ``diffusion_model`` (or of a class), None for an architecture without one (module doc)."""
    if diffusion_model is None:
        return None
    cls = diffusion_model if isinstance(diffusion_model, type) else type(diffusion_model)
    return next((a for a in _ADAPTERS if a.serves(cls)), None)


def block_rules(diffusion_model) -> "select.BlockRules":
    """The layer-preset rules of the model's architecture (``select.GENERIC`` without an adapter)."""
    a = adapter_for(diffusion_model)
    return a.rules if a is not None else select.GENERIC


def object_patches(diffusion_model: nn.Module, int8_layers: dict, adapter: Adapter | None = None) -> dict:
    """Every object patch for the model: its adapter's fused modules plus the plain Int8Linear of each layer no
    fused module covers. Keys are relative to the diffusion model (prefix them with ``diffusion_model.``).
    ``adapter``: default ``adapter_for(diffusion_model)``. Without an adapter, with no fuse, with no layer on
    fused_triton, or with ``INT8_FUSED_FUSION=0`` (``kernel.config``): the plain patches only."""
    if not config.get("INT8_FUSED_FUSION") or not any(blocks.norm_fusable(m) for m in int8_layers.values()):
        return dict(int8_layers)
    adapter = adapter or adapter_for(diffusion_model)
    if adapter is None or adapter.fuse is None:
        return dict(int8_layers)
    modules = adapter.fuse(diffusion_model, int8_layers)
    covered = {n for m in modules.values() for n in getattr(m, "covers", ())}
    plain = {n: m for n, m in int8_layers.items() if n not in covered}
    return {**plain, **modules}


def int8_layers_of(patches: dict) -> dict:
    """{name: Int8Linear} of object patches keyed by name (as ``object_patches`` returns them): plain Int8Linear
    patches as they are, fused modules through their ``int8_layers()`` (names joined to the patch's)."""
    out = {}
    for base, mod in patches.items():
        own = mod.int8_layers() if hasattr(mod, "int8_layers") else (
            {"": mod} if isinstance(mod, Int8Linear) else {})
        for sub, layer in own.items():
            out[".".join(p for p in (base, sub) if p)] = layer
    return out
