"""What a model adapter declares (:class:`Adapter`), the pack's pure-torch modules it builds on, and the helpers
and switches every adapter shares.

An adapter is data plus one function: which ComfyUI model classes it serves, which linears its blocks have
(``quant.select.BlockRules``), how its blocks are fused (``fuse``), which checkpoint key layout the pack reads for
it, and which patches it adds to a model (``pad_elision_wrapper``). Each model's folder (``adapters/<model>/``)
holds its adapter (``__init__.py``), its fused blocks (``blocks.py``, built from ``quant.blocks``) and whatever else
only that model has. ComfyUI is imported by the adapter modules themselves, explicitly and only inside ``fuse`` (or
the helpers it calls): importing ``adapters`` imports no ComfyUI module, so the pack imports in a blink and the
adapters also import in plain pytest.

The pure-torch modules come by relative imports (``..quant``, ``..kernel``): the very modules the nodes use (one
``Int8Linear`` class, not two); tests and benches import the pack the same way (``tests/pack_import.py``).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from torch import nn

from ..kernel import config
from ..quant import backends, blocks, select
from ..quant.linear import Int8Linear

# fuse(diffusion_model, int8_layers) -> {module name relative to the diffusion model: fused module}
FuseFn = Callable[[nn.Module, dict], dict]


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One architecture family.

    ``model_classes``: dotted paths of the ComfyUI diffusion-model classes it serves (subclasses included), e.g.
    ``"comfy.ldm.flux.model.Flux"``; resolved when a model is looked up (see ``adapters.adapter_for``).
    ``rules``: its blocks' containers and modulation linears, for the layer presets. ``fuse``: fused replacements
    (each with ``covers``, the int8 layer names it consumed, and ``int8_layers()``), or None: per-linear INT8 only.
    ``checkpoint_layout``: the pack module describing its checkpoint key layout, if the pack reads one.
    ``pad_elision_wrapper``: a ComfyUI DIFFUSION_MODEL wrapper dropping trailing padded text tokens, for
    architectures where that changes no output (installed where :func:`pad_elision_enabled` allows it)."""
    name: str
    model_classes: tuple[str, ...]
    rules: "select.BlockRules"
    fuse: FuseFn | None = None
    checkpoint_layout: str | None = None
    pad_elision_wrapper: Callable | None = None

    def serves(self, cls: type) -> bool:
        """Whether ``cls`` or one of its bases is one of ``model_classes``: by identity where the class path
        imports here, by class name where it does not (no ComfyUI on the path, or a ComfyUI without it)."""
        keys = [_resolve(p) for p in self.model_classes]
        return any(c is k or (isinstance(k, str) and c.__name__ == k) for c in cls.__mro__ for k in keys)


def _resolve(path: str) -> type | str:
    """The class at dotted ``path``, or its bare name when it cannot be imported here."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return name


def fuse_feed_forwards(root: nn.Module, int8_layers: dict, is_ffn: Callable[[nn.Module], bool],
                       clamp_fp16: bool = False) -> dict:
    """{name: FusedFeedForward} for each module of ``root`` that ``is_ffn`` accepts and whose w1/w3 are INT8 on
    fused_triton (``FusedFeedForward.build``)."""
    out = {}
    for name, m in root.named_modules():
        if is_ffn(m):
            ff = blocks.FusedFeedForward.build(name, m, int8_layers, clamp_fp16)
            if ff is not None:
                out[name] = ff
    return out


def fuse_blocks(family: str, candidates, int8_layers: dict, log, norm_fed=()) -> dict:
    """{name: build()} for each candidate ``(name, reason, fed, build)`` whose ``reason`` is None (the block's
    structure is supported) and whose layers named ``fed`` (relative to the block) include one on fused_triton,
    or, among those named in ``norm_fed``, a ConvRot layer that the block's norm kernel rotates for
    (``blocks.norm_fusable``); the others stay per-linear, with one log line grouping them by reason (``family``
    names them, e.g. "Flux")."""
    out, skipped = {}, {}
    for name, reason, fed, build in candidates:
        if reason is None and not any(blocks.fusable(int8_layers.get(f"{name}.{n}")) or (
                n in norm_fed and blocks.norm_fusable(int8_layers.get(f"{name}.{n}"))) for n in fed):
            reason = "no INT8 layer on fused_triton that a fused kernel feeds"
        if reason is None:
            out[name] = build()
        else:
            skipped.setdefault(reason, []).append(name)
    if skipped:
        n = sum(len(v) for v in skipped.values())
        log.info("INT8 fusion: %d %s blocks stay on the per-linear path (%s)", n, family,
                 "; ".join(f"{len(v)} because {r}, e.g. {v[0]}" for r, v in skipped.items()))
    return out


PAD_ELISION_ENV = "INT8_FUSED_PAD_ELISION"


def pad_elision_enabled(backend: str, value: str | None = None) -> bool:
    """``INT8_FUSED_PAD_ELISION`` (or ``value``, read as the switch), for an adapter's ``pad_elision_wrapper``: unset /
    ``auto`` = on for fused_triton only; 0 = off; 1 = on for every backend (also the bf16 control, for like-for-like
    comparisons). ``kernel/config.py`` validates the value (an unknown one warns and means unset)."""
    v = config.get(PAD_ELISION_ENV) if value is None else config.parse(PAD_ELISION_ENV, value)
    if v in (None, "auto"):
        return backends.capabilities(backend).pad_elision_by_default
    return v == "1"
