"""Wan 2.x (``comfy.ldm.wan.model.WanModel`` and its subclasses: VACE, camera, HuMo, S2V, Animate, causal, ...).

INT8 layers: self- and cross-attention q/k/v/o (and the image k/v of I2V) and ``ffn.0`` / ``ffn.2`` of ``blocks.N``.
Wan's block modulation is a parameter, not a linear, so ``blocks+modulation`` adds nothing here.

Fused, on fused_triton (``fuse``): each ``blocks.N`` that is exactly ComfyUI's ``WanAttentionBlock`` (Wan 2.1 /
2.2 T2V and I2V, 2.2 TI2V 5B; also the main blocks of VACE and camera models, which call them as WanModel does)
becomes a ``blocks.FusedWanBlock``: norm1 LayerNorm * (1 + scale) + shift + quantization gives one int8 activation
for ``self_attn.q``, ``.k`` and ``.v``; the residual sum before norm2 and norm2's the same for ``ffn.0`` in one
kernel; GELU(tanh) + quantization feeds ``ffn.2``; the other residual tails (with norm3) and QK norm + RoPE one
kernel each. ConvRot q / k / v (one group: one activation) and ``ffn.0`` get their input rotated in the LayerNorm
kernel (``kernel.hadamard``).
Cross-attention stays per-linear (called as ComfyUI's module on the INT8 layers). A block is fused only with Wan
2.x's structure: ``WanSelfAttention``, norm1 / norm2 LayerNorms without affine over the width, the FFN
``[Linear, GELU(tanh), Linear]`` (0.3.75: ``nn.Sequential``; 0.33.0: ``WanFeedForward``, whose forward is
``linear_input_act(ffn[2], ffn[0](x), "gelu_tanh")``, the same arithmetic on these layers), a ``[1, 6, dim]``
modulation, and the ``forward`` arguments both supported ComfyUIs have. Other block classes (VACE's
``vace_blocks``, ``WanAttentionBlockAudio`` (S2V), causal, Animate 2, MultiTalk, ...) stay per-linear, with one log
line saying why. Wan 2.2 5B (the same block; ``e`` [B, T, 6, C], one modulation row per latent frame) is fused too:
the kernels read the per-token rows ``repeat_e`` materializes. At call time, ``attn1_patch`` / ``attn2_patch`` in
``transformer_options`` (current ComfyUI applies them; 0.3.75 ignores them) and unknown keyword arguments run
ComfyUI's own forward on the block's INT8 twin (the per-linear path).

ComfyUI functions, imported explicitly in :func:`comfy_functions` from the module the block itself runs in
(``comfy.ldm.wan.model``): ``optimized_attention`` (with ``transformer_options``: the pack's attention routing
applies), ``apply_rope1`` (``comfy.ldm.flux.math``), ``repeat_e``, ``WanAttentionBlock.forward`` (the fallback),
and ``comfy.model_management.cast_to``. 0.3.75 and 0.33.0 differ in the FFN class (above) and in the attention
patches (handled by falling back), not in what the fused path runs.
"""
from __future__ import annotations

import inspect
import logging

from torch import nn

from ..base import Adapter, fuse_blocks, select
from .blocks import FusedWanBlock, WanFunctions

log = logging.getLogger("int8_fused")

BLOCK_ARGS = ("self", "x", "e", "freqs", "context", "context_img_len", "transformer_options")
# the int8 layers whose input a fused kernel produces: a block without one of them on fused_triton gains nothing
KERNEL_FED = ("self_attn.q", "self_attn.k", "self_attn.v", "ffn.0", "ffn.2")
# those whose input the modulated-LayerNorm kernel gives: it rotates it too for a ConvRot layer
NORM_FED = ("self_attn.q", "self_attn.k", "self_attn.v", "ffn.0")


def comfy_functions():
    """(``comfy.ldm.wan.model``, ``WanFunctions``) from the running ComfyUI; ImportError / AttributeError naming
    what is missing."""
    import comfy.ldm.wan.model as wan
    import comfy.model_management as mm
    return wan, WanFunctions(cast_to=mm.cast_to, apply_rope1=wan.apply_rope1,
                             optimized_attention=wan.optimized_attention, repeat_e=wan.repeat_e,
                             block_forward=wan.WanAttentionBlock.forward)


def _plain_layer_norm(m, k: int) -> bool:
    return (isinstance(m, nn.LayerNorm) and m.weight is None and m.bias is None
            and tuple(m.normalized_shape) == (k,))


def why_not(blk: nn.Module, wan) -> str | None:
    """None when ``blk`` is a Wan 2.x ``WanAttentionBlock`` the fused block implements, else why not."""
    if type(blk) is not wan.WanAttentionBlock:
        return f"{type(blk).__name__} is not ComfyUI's WanAttentionBlock"
    if tuple(inspect.signature(wan.WanAttentionBlock.forward).parameters) != BLOCK_ARGS:
        return "this ComfyUI's WanAttentionBlock.forward takes other arguments"
    if type(blk.self_attn) is not wan.WanSelfAttention:
        return f"self_attn is {type(blk.self_attn).__name__}, not WanSelfAttention"
    k = blk.dim
    if not all(_plain_layer_norm(getattr(blk, n, None), k) for n in ("norm1", "norm2")):
        return "norm1 / norm2 are not LayerNorms without affine over the width"
    ffn = blk.ffn
    ffn_classes = (nn.Sequential,) + ((wan.WanFeedForward,) if hasattr(wan, "WanFeedForward") else ())
    if not (type(ffn) in ffn_classes and len(ffn) == 3 and type(ffn[1]) is nn.GELU and ffn[1].approximate == "tanh"):
        return "the FFN is not Linear, GELU(tanh), Linear"
    mod = getattr(blk, "modulation", None)
    if not isinstance(mod, nn.Parameter) or tuple(mod.shape) != (1, 6, k):
        return "the modulation is not a [1, 6, dim] parameter"
    a = blk.self_attn
    if (getattr(a.q, "in_features", k) != k or a.num_heads * a.head_dim != k
            or getattr(ffn[2], "in_features", None) != getattr(ffn[0], "out_features", None)):
        return "unexpected q/k/v / FFN widths"
    return None


def fuse(diffusion_model: nn.Module, int8_layers: dict, functions=None) -> dict:
    """{``blocks.N``: FusedWanBlock} for the Wan 2.x blocks with an INT8 layer on fused_triton that a kernel feeds.
    ``functions``: (``comfy.ldm.wan.model``, WanFunctions), default :func:`comfy_functions`."""
    try:
        wan, fn = functions if functions is not None else comfy_functions()
    except (ImportError, AttributeError) as e:
        log.info("INT8 fusion: Wan blocks stay on the per-linear path (this ComfyUI lacks what they call: %s)", e)
        return {}
    candidates = [(f"blocks.{i}", why_not(blk, wan), KERNEL_FED,
                   lambda blk=blk, name=f"blocks.{i}": FusedWanBlock(blk, name, int8_layers, fn))
                  for i, blk in enumerate(getattr(diffusion_model, "blocks", None) or ())]
    return fuse_blocks("Wan", candidates, int8_layers, log, NORM_FED)


ADAPTER = Adapter(
    name="wan",
    model_classes=("comfy.ldm.wan.model.WanModel",),
    rules=select.block_rules(("blocks",), r"modulation"),
    fuse=fuse,
)
