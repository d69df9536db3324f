"""Flux, Flux.2 and Chroma (``comfy.ldm.flux.model.Flux``, which Flux.2 also uses; ``comfy.ldm.chroma.model.Chroma``
and its subclass ChromaRadiance).

INT8 layers: the linears of ``double_blocks.N`` (img/txt qkv, proj, mlp) and ``single_blocks.N`` (linear1,
linear2); the modulation GEMVs (``img_mod.lin``, ``txt_mod.lin``, ``modulation.lin``) only with
``blocks+modulation``. Flux.2's and Chroma's modulation sits outside the blocks.

Fused, on fused_triton (``fuse`` here: Flux.1's blocks; the registered adapter is ``external_mod.ADAPTER``, whose
``fuse`` also takes the blocks of Flux.2, Chroma and Chroma Radiance, see ``external_mod.py``): each Flux.1
``DoubleStreamBlock`` / ``SingleStreamBlock`` becomes a ``blocks.FusedFluxDoubleBlock`` / ``FusedFluxSingleBlock``:
LayerNorm * (1 + scale) + shift + quantization feed qkv, mlp.0 and linear1 from one kernel, GELU + quantization
feeds mlp.2, and the single block's ``cat(attn, gelu(mlp))`` is quantized for linear2 without being built. A
block is fused here only when it is ComfyUI's own class with Flux.1's structure: its own ``Modulation``
(``modulation=True``), the tanh-GELU MLP (``nn.Sequential(Linear, GELU, Linear)`` / ``mlp_act``; not
``mlp_silu_act`` nor ``yak_mlp``), LayerNorms without affine, txt before img (0.3.75's ``flipped_img_txt``
False), and the ``forward`` arguments both supported ComfyUIs have. Blocks with modulation passed in (Chroma,
Flux.2: ``modulation=False``, SiLU-gated MLPs) are ``external_mod.py``'s; anything else (``yak_mlp``,
``flipped_img_txt``, other classes) stays per-linear, with one log line saying why. At call time,
``modulation_dims`` (current ComfyUI's ``timestep_zero_index``) or ``attn1_patch`` / ``attn1_output_patch`` in
``transformer_options`` run ComfyUI's own forward on the block's INT8 twin (the per-linear path). fp16: the fused
forwards clamp as ComfyUI's do (``nan_to_num`` of txt / x). ConvRot layers (``quant.convrot``) get their rotated
input from the LayerNorm kernel where it feeds them (qkv, mlp.0, linear1; a block of ConvRot layers only is fused
for that), the others rotate their float input themselves.

ComfyUI functions, imported explicitly in :func:`comfy_functions`: ``comfy.ldm.flux.math.attention`` (RoPE, then
``optimized_attention`` with ``transformer_options``: the pack's attention routing applies), that
``optimized_attention`` itself (called after the fused blocks' own QK norm + RoPE kernel), and
``comfy.ldm.flux.layers.DoubleStreamBlock.forward`` / ``SingleStreamBlock.forward`` (the fallback); the blocks' own
``Modulation`` and ``QKNorm`` modules are called as modules. 0.3.75 and 0.33.0 differ inside those (0.33.0:
comfy_kitchen RoPE, attention patches, ``yak_mlp``, ``modulation_dims`` slicing), not in what the fused path runs.
"""
from __future__ import annotations

import inspect
import logging

from torch import nn

from ..base import Adapter, fuse_blocks, select
from .blocks import FluxFunctions, FusedFluxDoubleBlock, FusedFluxSingleBlock

log = logging.getLogger("int8_fused")

DOUBLE_ARGS = ("self", "img", "txt", "vec", "pe", "attn_mask", "modulation_dims_img", "modulation_dims_txt",
               "transformer_options")
SINGLE_ARGS = ("self", "x", "vec", "pe", "attn_mask", "modulation_dims", "transformer_options")


def comfy_functions():
    """(``comfy.ldm.flux.layers``, ``FluxFunctions``) from the running ComfyUI; ImportError / AttributeError
    naming what is missing."""
    import comfy.ldm.flux.layers as layers
    import comfy.ldm.flux.math as flux_math
    import comfy.model_management as mm
    return layers, FluxFunctions(attention=flux_math.attention, double_forward=layers.DoubleStreamBlock.forward,
                                 single_forward=layers.SingleStreamBlock.forward,
                                 optimized_attention=flux_math.optimized_attention,
                                 in_training=lambda: bool(getattr(mm, "in_training", False)))


def _args(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def _plain_layer_norm(m, k: int) -> bool:
    return (isinstance(m, nn.LayerNorm) and m.weight is None and m.bias is None
            and tuple(m.normalized_shape) == (k,))


def _gelu_tanh(m) -> bool:
    return type(m) is nn.GELU and m.approximate == "tanh"


def _features(m, attr: str):
    return getattr(m, attr, None)


def why_not_double(blk: nn.Module, layers) -> str | None:
    """None when ``blk`` is a Flux.1 DoubleStreamBlock the fused block implements, else why not."""
    if type(blk) is not layers.DoubleStreamBlock:
        return f"{type(blk).__name__} is not ComfyUI's DoubleStreamBlock"
    if _args(layers.DoubleStreamBlock.forward) != DOUBLE_ARGS:
        return "this ComfyUI's DoubleStreamBlock.forward takes other arguments"
    if blk.modulation is not True:
        return "modulation passed in from outside the block (Chroma, Flux.2)"
    if getattr(blk, "flipped_img_txt", False):
        return "flipped_img_txt"
    k = blk.hidden_size
    for s in ("img", "txt"):
        mod, mlp, attn = getattr(blk, f"{s}_mod"), getattr(blk, f"{s}_mlp"), getattr(blk, f"{s}_attn")
        if type(mod) is not layers.Modulation or not mod.is_double:
            return f"{s}_mod is not a double Modulation"
        if not (type(mlp) is nn.Sequential and len(mlp) == 3 and _gelu_tanh(mlp[1])):
            return "the MLP is not Linear, GELU(tanh), Linear (mlp_silu_act / yak_mlp: Flux.2)"
        if not all(_plain_layer_norm(getattr(blk, f"{s}_norm{i}"), k) for i in (1, 2)):
            return "a norm is not a LayerNorm without affine over the hidden size"
        if _features(attn.qkv, "out_features") != 3 * k or _features(mlp[2], "in_features") != \
                _features(mlp[0], "out_features"):
            return "unexpected qkv / MLP widths"
    return None


def why_not_single(blk: nn.Module, layers) -> str | None:
    """None when ``blk`` is a Flux.1 SingleStreamBlock the fused block implements, else why not."""
    if type(blk) is not layers.SingleStreamBlock:
        return f"{type(blk).__name__} is not ComfyUI's SingleStreamBlock"
    if _args(layers.SingleStreamBlock.forward) != SINGLE_ARGS:
        return "this ComfyUI's SingleStreamBlock.forward takes other arguments"
    if type(blk.modulation) is not layers.Modulation or blk.modulation.is_double:
        return "modulation passed in from outside the block (Chroma, Flux.2)"
    if getattr(blk, "yak_mlp", False) or not _gelu_tanh(blk.mlp_act) or blk.mlp_hidden_dim_first != blk.mlp_hidden_dim:
        return "the MLP activation is not GELU(tanh) (mlp_silu_act / yak_mlp: Flux.2)"
    k = blk.hidden_size
    if not _plain_layer_norm(blk.pre_norm, k):
        return "pre_norm is not a LayerNorm without affine over the hidden size"
    if (_features(blk.linear1, "out_features") != 3 * k + blk.mlp_hidden_dim
            or _features(blk.linear2, "in_features") != k + blk.mlp_hidden_dim):
        return "unexpected linear1 / linear2 widths"
    return None


# the int8 layers whose input a fused kernel produces: a block without one of them on fused_triton gains nothing
KERNEL_FED = {"double": ("img_attn.qkv", "txt_attn.qkv", "img_mlp.0", "txt_mlp.0", "img_mlp.2", "txt_mlp.2"),
              "single": ("linear1", "linear2")}
# those whose input the modulated-LayerNorm kernel gives: it rotates it too for a ConvRot layer
NORM_FED = ("img_attn.qkv", "txt_attn.qkv", "img_mlp.0", "txt_mlp.0", "linear1")


def fuse(diffusion_model: nn.Module, int8_layers: dict, functions=None) -> dict:
    """{``double_blocks.N`` / ``single_blocks.N``: fused block} for the Flux.1 blocks with an INT8 layer on
    fused_triton that a kernel feeds. ``functions``: (flux layers module, FluxFunctions), default
    :func:`comfy_functions`."""
    try:
        layers, fn = functions if functions is not None else comfy_functions()
    except (ImportError, AttributeError) as e:
        log.info("INT8 fusion: Flux blocks stay on the per-linear path (this ComfyUI lacks what they call: %s)", e)
        return {}
    candidates = []
    for kind, why, cls in (("double", why_not_double, FusedFluxDoubleBlock),
                           ("single", why_not_single, FusedFluxSingleBlock)):
        for i, blk in enumerate(getattr(diffusion_model, f"{kind}_blocks", None) or ()):
            name = f"{kind}_blocks.{i}"
            candidates.append((name, why(blk, layers), KERNEL_FED[kind],
                               lambda blk=blk, name=name, cls=cls: cls(blk, name, int8_layers, fn)))
    return fuse_blocks("Flux", candidates, int8_layers, log, NORM_FED)


ADAPTER = Adapter(
    name="flux",
    model_classes=("comfy.ldm.flux.model.Flux", "comfy.ldm.chroma.model.Chroma"),
    rules=select.block_rules(("double_blocks", "single_blocks"), r"(_mod\.|(^|\.)modulation\.)"),
    fuse=fuse,
)
