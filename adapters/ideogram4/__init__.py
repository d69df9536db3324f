"""Ideogram 4 (``comfy.ldm.ideogram4.model.Ideogram4Transformer2DModel``, ComfyUI 0.33.0 or newer; absent from
0.3.75).

Fused, on fused_triton (``fuse``): each ``layers.N`` block becomes a ``blocks.FusedIdeogram4Block`` (modulated
RMSNorm + quantization into qkv and w1+w3, SwiGLU + quantization into w2, residual tails with the next norm, QK norm +
RoPE in one kernel; ConvRot qkv and w1 / w3 rotated in the norm kernel, as Lumina 2's). A block whose qkv is not INT8
on fused_triton keeps its own forward (its FeedForward alone may still be fused). ``llm_cond_proj`` (input constant within a run) gets a per-run ``quant.cached_linear.CachedLinear``.
Checkpoint key layout: ``layout.py`` (the Ideogram 4 loader's). Padded text: the conditional pass drops trailing
padded text tokens (``diffusion_model_wrapper``, ``pad_elision.py``).

ComfyUI functions, imported explicitly in :func:`comfy_functions`: ``comfy.model_management.in_training`` (read per
call), ``comfy.ops.cast_bias_weight`` / ``uncast_bias_weight``, ``comfy.quant_ops.ck.rms_rope_split_half``
(comfy_kitchen), ``comfy.ldm.modules.attention.optimized_attention_masked`` (so the pack's attention routing,
``transformer_options``' override, applies) and the module's ``_apply_rope_split_half1``. Where one of them is missing
(ComfyUI 0.3.75 has neither the module, ``in_training`` nor ``quant_ops.ck``; a ComfyUI without comfy_kitchen has no
``ck``) no block is fused: one log line, the per-linear path (FeedForwards still fused).
"""
from __future__ import annotations

import logging

from torch import nn

from ...quant.cached_linear import CachedLinear
from ..base import Adapter, Int8Linear, blocks as qb, select
from . import layout, pad_elision  # noqa: F401  (layout: ADAPTER.checkpoint_layout, the loader's)
from .blocks import ComfyFunctions, FusedIdeogram4Attention, FusedIdeogram4Block

log = logging.getLogger("int8_fused")


def comfy_functions() -> ComfyFunctions:
    """The functions from the running ComfyUI; ImportError / AttributeError naming what is missing."""
    import comfy.ldm.ideogram4.model as ideogram4
    import comfy.ldm.lumina.model as lumina
    import comfy.ldm.modules.attention as attention
    import comfy.model_management as mm
    import comfy.ops
    import comfy.quant_ops
    if not hasattr(mm, "in_training"):
        raise AttributeError("comfy.model_management has no in_training")
    ck = getattr(comfy.quant_ops, "ck", None)
    if ck is None:
        raise AttributeError("comfy.quant_ops has no comfy_kitchen (ck)")
    return ComfyFunctions(in_training=lambda: mm.in_training, cast_bias_weight=comfy.ops.cast_bias_weight,
                          uncast_bias_weight=comfy.ops.uncast_bias_weight,
                          rms_rope_split_half=ck.rms_rope_split_half,
                          attention=attention.optimized_attention_masked, rope=ideogram4._apply_rope_split_half1,
                          clamp_fp16=hasattr(lumina, "clamp_fp16"))


def _block(name: str, blk: nn.Module, layers: dict, fn: ComfyFunctions) -> FusedIdeogram4Block | None:
    p = f"{name}."
    qkv = layers.get(p + "attention.qkv")
    ff = qb.FusedFeedForward.build(p + "feed_forward", blk.feed_forward, layers, fn.clamp_fp16)
    if not qb.norm_fusable(qkv) or ff is None:
        return None
    o = layers.get(p + "attention.o", blk.attention.o)
    ada = layers.get(p + "adaln_modulation", blk.adaln_modulation)
    covers = [p + "attention.qkv", *ff.covers]
    covers += [n for n, mod in ((p + "attention.o", o), (p + "adaln_modulation", ada)) if isinstance(mod, Int8Linear)]
    return FusedIdeogram4Block(blk, FusedIdeogram4Attention(blk.attention, qkv, o, fn), ff, ada, covers)


def fuse(diffusion_model: nn.Module, int8_layers: dict, functions: ComfyFunctions | None = None) -> dict:
    """{name: fused module}: ``layers.N`` blocks (or their FeedForwards alone) and the ``llm_cond_proj`` cache.
    ``functions``: the ComfyUI functions (default: :func:`comfy_functions`)."""
    fn, why = functions, None
    if fn is None:
        try:
            fn = comfy_functions()
        except (ImportError, AttributeError) as e:
            why = f"this ComfyUI lacks what Ideogram4Attention calls ({e})"
    out, skipped = {}, []
    for i, blk in enumerate(diffusion_model.layers):
        name = f"layers.{i}"
        fused_blk = _block(name, blk, int8_layers, fn) if fn is not None else None
        if fused_blk is not None:
            out[name] = fused_blk
            continue
        skipped.append(name)
        ff = qb.FusedFeedForward.build(f"{name}.feed_forward", blk.feed_forward, int8_layers,
                                       fn.clamp_fp16 if fn is not None else False)
        if ff is not None:
            out[f"{name}.feed_forward"] = ff
    if skipped:
        log.info("INT8 fusion: %d Ideogram 4 blocks stay on the per-linear path (%s), e.g. %s", len(skipped),
                 why or "qkv, w1 and w3 not all on fused_triton with equal w1/w3 smoothing", skipped[0])
    proj = getattr(diffusion_model, "llm_cond_proj", None)
    if proj is not None:
        inner = int8_layers.get("llm_cond_proj", proj)
        out["llm_cond_proj"] = CachedLinear(inner, name="llm_cond_proj")
        out["llm_cond_proj"].covers = ("llm_cond_proj",) if isinstance(inner, Int8Linear) else ()
    return out


def diffusion_model_wrapper(executor, *args, **kwargs):
    """ComfyUI DIFFUSION_MODEL wrapper: ``Ideogram4Transformer2DModel.forward(x, timesteps, context, attention_mask,
    ...)`` with the trailing padded text tokens removed (``pad_elision.py``); other models pass through."""
    obj = getattr(executor, "class_obj", None)
    if obj is None or not ADAPTER.serves(type(obj)):
        return executor(*args, **kwargs)
    args, kwargs = pad_elision.strip_call(args, kwargs, context_at=2, mask_at=3)
    return executor(*args, **kwargs)


ADAPTER = Adapter(
    name="ideogram4",
    model_classes=("comfy.ldm.ideogram4.model.Ideogram4Transformer2DModel",),
    rules=select.block_rules(("layers",), r"adaln_modulation"),
    fuse=fuse,
    checkpoint_layout="adapters.ideogram4.layout",
    pad_elision_wrapper=diffusion_model_wrapper,
)
