"""Lumina 2 / Z-Image (``comfy.ldm.lumina.model.NextDiT`` and its subclasses, e.g. Z-Image's pixel-space model).

Fused, on fused_triton (``fuse``): every modulated ``JointTransformerBlock`` (``layers.N``,
``noise_refiner.N``) becomes a ``blocks.FusedLumina2Block``: attention_norm1 * (1 + scale_msa) +
quantization feed the qkv GEMM and ffn_norm1 * (1 + scale_mlp) + quantization the merged w1+w3 GEMM, each from
one kernel (``rmsnorm_modulate_quantize``), the residual tails ``x + tanh(gate) * norm(o)`` (the first with the
next norm + quantization) one kernel each (``gated_residual_rmsnorm``); SwiGLU + quantization feed w2
(``FusedFeedForward``); QK norms + RoPE one kernel where there is no GQA (``qk_norm_rope``); otherwise QK norms, RoPE,
attention (``optimized_attention_masked`` with ``transformer_options``: the pack's routing applies), tanh gates,
post-norms and fp16 clamps as ComfyUI runs them. Blocks without modulation (``context_refiner.N``, 0.33.0's
``siglip_refiner.N``) and blocks the fused module does not implement keep the FeedForward-only fusion: w1+w3 as one
int8 GEMM, SwiGLU + quantization feeding w2 (the latter with one log line saying why). ConvRot qkv and w1 / w3
(``quant.convrot``; w1 / w3 of one group stacked as one ConvRot layer) get their input rotated in the norm kernel
(``kernel.hadamard.rmsnorm_modulate_hadamard_quantize``), the residual tail then without the next norm.

ComfyUI functions, imported explicitly in :func:`comfy_functions`: ``comfy.ldm.lumina.model.JointTransformerBlock.
forward`` (fallback), ``comfy.ldm.flux.math.apply_rope``, ``comfy.ldm.modules.attention.optimized_attention_masked``.
ComfyUI differences, handled explicitly: 0.33.0 clamps the SwiGLU product and the attention / FeedForward outputs
in fp16 (``clamp_fp16``), 0.3.75 does not; 0.33.0's block forward takes ``timestep_zero_index`` (omni mode: such
calls run ComfyUI's own forward) and its attention runs QK norm + RoPE through comfy_kitchen's ``rms_rope`` /
``rms_rope1`` outside training (``comfy.model_management.in_training``, ``comfy.ops.cast_bias_weight``,
``comfy.quant_ops.ck``); where that ComfyUI lacks one of those, no block is fused (FeedForwards still are).
"""
from __future__ import annotations

import inspect
import logging

from torch import nn

from ..base import Adapter, blocks as qb, fuse_feed_forwards, select
from .blocks import FusedLumina2Block, Lumina2Functions

log = logging.getLogger("int8_fused")

BLOCK_ARGS_0375 = ("self", "x", "x_mask", "freqs_cis", "adaln_input", "transformer_options")
BLOCK_ARGS_033 = ("self", "x", "x_mask", "freqs_cis", "adaln_input", "timestep_zero_index", "transformer_options")
ATTN_ARGS = ("self", "x", "x_mask", "freqs_cis", "transformer_options")


def is_swiglu_ffn(m: nn.Module) -> bool:
    """NextDiT's FeedForward (``w2(silu(w1 x) * w3 x)``): the only module of the model with w1, w2 and w3."""
    return all(isinstance(getattr(m, a, None), nn.Module) for a in ("w1", "w2", "w3"))


def clamps_fp16() -> bool:
    """Whether the running ComfyUI's lumina FeedForward clamps its fp16 SwiGLU product (0.33.0 yes, 0.3.75 no)."""
    import comfy.ldm.lumina.model as lumina
    return hasattr(lumina, "clamp_fp16")


def _args(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def comfy_functions():
    """(``comfy.ldm.lumina.model``, ``Lumina2Functions``) from the running ComfyUI; ImportError / AttributeError
    naming what is missing or unknown."""
    import comfy.ldm.flux.math as flux_math
    import comfy.ldm.lumina.model as lumina
    import comfy.ldm.modules.attention as attention
    args = _args(lumina.JointTransformerBlock.forward)
    if args not in (BLOCK_ARGS_0375, BLOCK_ARGS_033):
        raise AttributeError(f"JointTransformerBlock.forward takes unknown arguments {args}")
    if _args(lumina.JointAttention.forward) != ATTN_ARGS:
        raise AttributeError("JointAttention.forward takes unknown arguments")
    common = dict(block_forward=lumina.JointTransformerBlock.forward, apply_rope=flux_math.apply_rope,
                  attention=attention.optimized_attention_masked,
                  clamp_fp16=getattr(lumina, "clamp_fp16", None), takes_timestep_zero_index=args == BLOCK_ARGS_033)
    if args == BLOCK_ARGS_0375:  # 0.3.75: q_norm / k_norm modules, then apply_rope
        return lumina, Lumina2Functions(**common)
    import comfy.model_management as mm  # 0.33.0: comfy_kitchen rms_rope outside training
    import comfy.ops
    import comfy.quant_ops
    if not hasattr(mm, "in_training"):
        raise AttributeError("comfy.model_management has no in_training")
    ck = getattr(comfy.quant_ops, "ck", None)
    if ck is None or not hasattr(ck, "rms_rope") or not hasattr(ck, "rms_rope1"):
        raise AttributeError("comfy.quant_ops has no comfy_kitchen rms_rope / rms_rope1")
    return lumina, Lumina2Functions(**common, in_training=lambda: mm.in_training,
                                    cast_bias_weight=comfy.ops.cast_bias_weight,
                                    uncast_bias_weight=comfy.ops.uncast_bias_weight,
                                    rms_rope=ck.rms_rope, rms_rope1=ck.rms_rope1)


def why_not_block(blk: nn.Module, lumina) -> str | None:
    """None when ``blk`` is a modulated JointTransformerBlock the fused block implements, else why not."""
    if type(blk) is not lumina.JointTransformerBlock:
        return f"{type(blk).__name__} is not ComfyUI's JointTransformerBlock"
    if blk.modulation is not True:
        return "no modulation"
    if type(blk.attention) is not lumina.JointAttention:
        return "its attention is not ComfyUI's JointAttention"
    if not is_swiglu_ffn(blk.feed_forward):
        return "its FeedForward is not the SwiGLU one"
    if not isinstance(blk.adaLN_modulation, nn.Sequential):
        return "adaLN_modulation is not an nn.Sequential"
    return None


def fuse(diffusion_model: nn.Module, int8_layers: dict, clamp_fp16: bool | None = None, functions=None) -> dict:
    """{name: FusedLumina2Block | FusedFeedForward}: modulated blocks whose qkv, w1 and w3 are INT8 on
    fused_triton (w1/w3 with equal smoothing) become fused blocks; the FeedForwards of the other blocks are fused
    alone. ``clamp_fp16``: default what the running ComfyUI does (:func:`clamps_fp16`); ``functions``: a
    (lumina module, ``Lumina2Functions``) pair (default :func:`comfy_functions`)."""
    clamp = clamps_fp16() if clamp_fp16 is None else clamp_fp16
    lumina = fn = why_all = None
    out, skipped, reasons = {}, [], {}
    for name, m in diffusion_model.named_modules():
        if not name or not hasattr(m, "attention_norm1") or not getattr(m, "modulation", False):
            continue  # only modulated blocks; context_refiner etc.: FeedForward fusion below
        if any(name.startswith(f"{b}.") for b in out):
            continue
        if fn is None and why_all is None:  # ComfyUI imported at the first modulated block
            try:
                lumina, fn = functions if functions is not None else comfy_functions()
            except (ImportError, AttributeError) as e:
                why_all = f"this ComfyUI's lumina blocks are not the supported ones ({e})"
        why = why_all or why_not_block(m, lumina)
        if why is None:
            qkv = int8_layers.get(f"{name}.attention.qkv")
            ff = qb.FusedFeedForward.build(f"{name}.feed_forward", m.feed_forward, int8_layers, clamp)
            if qb.norm_fusable(qkv) and ff is not None:
                out[name] = FusedLumina2Block(m, name, int8_layers, ff, fn)
                continue
            why = "qkv, w1 and w3 not all on fused_triton with equal w1/w3 smoothing"
        skipped.append(name)
        reasons.setdefault(why, name)
    if skipped:
        for why, first in reasons.items():
            log.info("INT8 fusion: Lumina 2 blocks stay unfused apart from their FeedForwards (%s), e.g. %s", why,
                     first)
    ffs = fuse_feed_forwards(diffusion_model, int8_layers, is_swiglu_ffn, clamp)
    out.update({n: f for n, f in ffs.items() if not any(n.startswith(f"{b}.") for b in out)})
    return out


ADAPTER = Adapter(
    name="lumina2",
    model_classes=("comfy.ldm.lumina.model.NextDiT",),
    rules=select.block_rules(("layers", "noise_refiner", "context_refiner"), r"adaLN_modulation"),
    fuse=fuse,
)
