"""Qwen-Image (``comfy.ldm.qwen_image.model.QwenImageTransformer2DModel``).

INT8 layers: the attention and MLP linears of ``transformer_blocks.N``; the modulation GEMVs ``img_mod.1`` /
``txt_mod.1`` only with ``blocks+modulation``.

Fused, on fused_triton (``fuse``): each ``transformer_blocks.N`` that is ComfyUI's ``QwenImageTransformerBlock``
with its structure (LayerNorms without affine, the tanh-GELU FeedForward, per-head RMSNorm QK norms, the ``forward``
arguments of 0.3.75 or 0.33.0) and whose q/k/v of each stream are INT8 on fused_triton with equal smoothing (or
ConvRot layers of one group size: stacked as one ConvRot layer, rotated in the LayerNorm kernel) becomes a
``blocks.FusedQwenImageBlock`` (q/k/v stacked into one GEMM per stream, norm · modulation + quantize, QK norm + RoPE,
GELU + quantize, residual tails: see blocks.py). Other blocks stay per-linear, with one log line saying why.

ComfyUI functions, imported explicitly in :func:`comfy_functions` from ``comfy.ldm.qwen_image.model``:
``QwenImageTransformerBlock.forward`` (the fallback), ``optimized_attention_masked`` and ``apply_rope1`` as that
module binds them.
"""
from __future__ import annotations

import inspect
import logging

from torch import nn

from ..base import Adapter, fuse_blocks, select
from .blocks import FusedQwenImageBlock, QwenFunctions, merge_qkv

log = logging.getLogger("int8_fused")

BLOCK_ARGS = {("self", "hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb",
               "image_rotary_emb", "transformer_options"),                                      # 0.3.75
              ("self", "hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb",
               "image_rotary_emb", "timestep_zero_index", "transformer_options")}               # 0.33.0
KERNEL_FED = ("attn.to_q", "attn.add_q_proj", "img_mlp.net.0.proj", "txt_mlp.net.0.proj", "img_mlp.net.2",
              "txt_mlp.net.2")
# those whose input the modulated-LayerNorm kernel gives: it rotates it too for ConvRot layers
NORM_FED = ("attn.to_q", "attn.add_q_proj", "img_mlp.net.0.proj", "txt_mlp.net.0.proj")


def comfy_functions():
    """(``comfy.ldm.qwen_image.model``, ``QwenFunctions``) from the running ComfyUI."""
    import comfy.ldm.qwen_image.model as qm
    blk = qm.QwenImageTransformerBlock
    return qm, QwenFunctions(block_forward=blk.forward, attention=qm.optimized_attention_masked,
                             apply_rope1=qm.apply_rope1, addcmul_img_gate=hasattr(blk, "_apply_gate"))


def _plain_layer_norm(m, k: int) -> bool:
    return (isinstance(m, nn.LayerNorm) and m.weight is None and m.bias is None
            and tuple(m.normalized_shape) == (k,))


def why_not(blk: nn.Module, qm) -> str | None:
    """None when ``blk`` is a ``QwenImageTransformerBlock`` the fused block implements, else why not."""
    if type(blk) is not qm.QwenImageTransformerBlock:
        return f"{type(blk).__name__} is not ComfyUI's QwenImageTransformerBlock"
    if tuple(inspect.signature(qm.QwenImageTransformerBlock.forward).parameters) not in BLOCK_ARGS:
        return "this ComfyUI's QwenImageTransformerBlock.forward takes other arguments"
    k, a = blk.dim, blk.attn
    if type(a) is not qm.Attention or a.heads * a.dim_head != k or a.inner_dim != k:
        return "the attention is not Qwen-Image's joint Attention over the width"
    for s in ("img", "txt"):
        mlp, mod = getattr(blk, f"{s}_mlp"), getattr(blk, f"{s}_mod")
        if not all(_plain_layer_norm(getattr(blk, f"{s}_norm{i}"), k) for i in (1, 2)):
            return "a norm is not a LayerNorm without affine over the width"
        if not (type(mlp) is qm.FeedForward and len(mlp.net) == 3 and type(mlp.net[0]) is qm.GELU
                and mlp.net[0].approximate == "tanh" and getattr(mlp.net[1], "p", 0.0) == 0.0):
            return "the MLP is not Linear, GELU(tanh), Linear"
        if not (type(mod) is nn.Sequential and len(mod) == 2 and type(mod[0]) is nn.SiLU):
            return "the modulation is not SiLU, Linear"
    return None


def fuse(diffusion_model: nn.Module, int8_layers: dict, functions=None) -> dict:
    """{``transformer_blocks.N``: FusedQwenImageBlock} for the blocks with their q/k/v INT8 on fused_triton.
    ``functions``: (``comfy.ldm.qwen_image.model``, QwenFunctions), default :func:`comfy_functions`."""
    try:
        qm, fn = functions if functions is not None else comfy_functions()
    except (ImportError, AttributeError) as e:
        log.info("INT8 fusion: Qwen-Image blocks stay on the per-linear path (this ComfyUI lacks what they call: %s)",
                 e)
        return {}
    candidates = []
    for i, blk in enumerate(getattr(diffusion_model, "transformer_blocks", None) or ()):
        name = f"transformer_blocks.{i}"
        reason, qkv = why_not(blk, qm), {}
        if reason is None:
            qkv = {s: merge_qkv(int8_layers, name, s) for s in ("img", "txt")}
            reason = next((r for r in qkv.values() if isinstance(r, str)), None)
        candidates.append((name, reason, KERNEL_FED,
                           lambda blk=blk, name=name, qkv=qkv: FusedQwenImageBlock(blk, name, int8_layers, qkv, fn)))
    return fuse_blocks("Qwen-Image", candidates, int8_layers, log, NORM_FED)


ADAPTER = Adapter(
    name="qwen_image",
    model_classes=("comfy.ldm.qwen_image.model.QwenImageTransformer2DModel",),
    rules=select.block_rules(("transformer_blocks",), r"_mod\."),
    fuse=fuse,
)
