"""Flux blocks whose modulation comes from outside the block: Chroma (``comfy.ldm.chroma.model.Chroma`` and
ChromaRadiance: per-block slices of one approximator output) and Flux.2 (``Flux`` with ``global_modulation``: one
shared ``Modulation`` per stream kind, and SiLU-gated MLPs, ``mlp_silu_act``). Both use ComfyUI's own Flux
``DoubleStreamBlock`` / ``SingleStreamBlock`` with ``modulation=False``; ``vec`` is then ((img_mod1, img_mod2),
(txt_mod1, txt_mod2)) for a double block and one ``ModulationOut`` for a single block.

The fused blocks are Flux.1's (``blocks.FusedFluxDoubleBlock`` / ``FusedFluxSingleBlock``: the same kernels, roundings
and twin) with the modulation taken from ``vec``; for the SiLU-gated MLP, the double block's ``mlp.2`` input is
``silu(a) * b`` + quantization of the ``mlp.0`` output [a | b] (``swiglu_quantize``: torch's two roundings), and the
single block's ``linear2`` input ``cat(attn, silu(a) * b)`` is built by torch and quantized by ``linear2``. YakMLP
blocks and ``modulation_dims`` / attention-patch calls run ComfyUI's own forward on the twin (per-linear).

:data:`ADAPTER` is Flux.1's adapter (name ``flux``) with a ``fuse`` that also takes these blocks.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from ..base import blocks as qb, fuse_blocks
from . import (ADAPTER as FLUX1, DOUBLE_ARGS, KERNEL_FED, NORM_FED, SINGLE_ARGS, comfy_functions, why_not_double,
               why_not_single)
from .blocks import FusedFluxDoubleBlock, FusedFluxSingleBlock

log = logging.getLogger("int8_fused")


def _args(fn) -> tuple[str, ...]:
    import inspect
    return tuple(inspect.signature(fn).parameters)


def _plain_ln(m, k: int) -> bool:
    return isinstance(m, nn.LayerNorm) and m.weight is None and m.bias is None and tuple(m.normalized_shape) == (k,)


def mlp_kind(mlp, layers) -> str | None:
    """``gelu`` (Linear, GELU(tanh), Linear), ``swiglu`` (Linear [2F], SiLUActivation, Linear [F]) or None."""
    if not (type(mlp) is nn.Sequential and len(mlp) == 3):
        return None
    if type(mlp[1]) is nn.GELU and mlp[1].approximate == "tanh":
        return "gelu"
    if type(mlp[1]) is getattr(layers, "SiLUActivation", ()) and \
            getattr(mlp[0], "out_features", 0) == 2 * getattr(mlp[2], "in_features", -1):
        return "swiglu"
    return None


def why_not_external_double(blk: nn.Module, layers) -> str | None:
    """None when ``blk`` is a Flux DoubleStreamBlock with modulation passed in that the fused block implements."""
    if type(blk) is not layers.DoubleStreamBlock:
        return f"{type(blk).__name__} is not ComfyUI's DoubleStreamBlock"
    if _args(layers.DoubleStreamBlock.forward) != DOUBLE_ARGS:
        return "this ComfyUI's DoubleStreamBlock.forward takes other arguments"
    if blk.modulation is not False or getattr(blk, "flipped_img_txt", False):
        return "neither Flux.1's own modulation nor modulation passed in (flipped_img_txt)"
    k = blk.hidden_size
    for s in ("img", "txt"):
        if mlp_kind(getattr(blk, f"{s}_mlp"), layers) is None:
            return "the MLP is neither GELU(tanh) nor SiLU-gated (yak_mlp)"
        if not all(_plain_ln(getattr(blk, f"{s}_norm{i}"), k) for i in (1, 2)):
            return "a norm is not a LayerNorm without affine over the hidden size"
        if getattr(getattr(blk, f"{s}_attn").qkv, "out_features", None) != 3 * k:
            return "unexpected qkv width"
    return None


def why_not_external_single(blk: nn.Module, layers) -> str | None:
    """None when ``blk`` is a Flux SingleStreamBlock with modulation passed in that the fused block implements."""
    if type(blk) is not layers.SingleStreamBlock:
        return f"{type(blk).__name__} is not ComfyUI's SingleStreamBlock"
    if _args(layers.SingleStreamBlock.forward) != SINGLE_ARGS:
        return "this ComfyUI's SingleStreamBlock.forward takes other arguments"
    if blk.modulation is not None or getattr(blk, "yak_mlp", False):
        return "neither Flux.1's own modulation nor modulation passed in (yak_mlp)"
    gelu = type(blk.mlp_act) is nn.GELU and blk.mlp_act.approximate == "tanh"
    silu = type(blk.mlp_act) is getattr(layers, "SiLUActivation", ()) and blk.mlp_hidden_dim_first == 2 * blk.mlp_hidden_dim
    if not (gelu and blk.mlp_hidden_dim_first == blk.mlp_hidden_dim) and not silu:
        return "the MLP activation is neither GELU(tanh) nor SiLU-gated"
    k = blk.hidden_size
    if not _plain_ln(blk.pre_norm, k):
        return "pre_norm is not a LayerNorm without affine over the hidden size"
    if (getattr(blk.linear1, "out_features", None) != 3 * k + blk.mlp_hidden_dim_first
            or getattr(blk.linear2, "in_features", None) != k + blk.mlp_hidden_dim):
        return "unexpected linear1 / linear2 widths"
    return None


def _is_mod(m) -> bool:
    """Whether ``m`` is a ModulationOut of [B | 1, 1, K] tensors (what the fused kernels broadcast)."""
    try:
        ts = (m.shift, m.scale, m.gate)
    except AttributeError:
        return False
    for t in ts:
        if not (isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] == 1):
            return False
    return True


def _double_mods(vec):
    try:
        (a, b), (c, d) = vec
    except (TypeError, ValueError):
        return None
    return ((a, b), (c, d)) if _is_mod(a) and _is_mod(b) and _is_mod(c) and _is_mod(d) else None


class ExternalModDoubleBlock(FusedFluxDoubleBlock):
    """A Flux ``DoubleStreamBlock`` with ``modulation=False`` (Chroma, Flux.2): Flux.1's fused block, mods from vec."""

    def modulations(self, vec):
        return _double_mods(vec)

    @staticmethod
    def _gelu_linear(layer: nn.Module, act: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """``layer(act(h))``: Flux.1's GELU kernel, or for the SiLU-gated MLP ``silu(a) * b`` + quantization."""
        if type(act) is nn.GELU:
            return FusedFluxDoubleBlock._gelu_linear(layer, act, h)
        if not qb.act_fusable(layer):
            return layer(act(h))
        flat = h.dim() == 2
        a_q, a_s = qb.swiglu_quant(h if flat else h.reshape(-1, h.shape[-1]), qb.inv_smooth_of(layer, h.device),
                                   False, qb.rotation(layer))
        y = qb.gemm(a_q, a_s, layer, h.dtype)
        return y if flat else y.view(*h.shape[:-1], -1)


class ExternalModSingleBlock(FusedFluxSingleBlock):
    """A Flux ``SingleStreamBlock`` with ``modulation=False`` (Chroma, Flux.2): ``vec`` is its ModulationOut."""

    def modulation_of(self, vec):
        return vec if _is_mod(vec) else None


def fuse(diffusion_model: nn.Module, int8_layers: dict, functions=None) -> dict:
    """Flux.1's ``fuse`` extended: each double / single block is fused as Flux.1's when it has its own modulation,
    as :class:`ExternalModDoubleBlock` / :class:`ExternalModSingleBlock` when its modulation is passed in."""
    try:
        layers, fn = functions if functions is not None else comfy_functions()
    except (ImportError, AttributeError) as e:
        log.info("INT8 fusion: Flux blocks stay on the per-linear path (this ComfyUI lacks what they call: %s)", e)
        return {}
    kinds = (("double", why_not_double, why_not_external_double, FusedFluxDoubleBlock, ExternalModDoubleBlock),
             ("single", why_not_single, why_not_external_single, FusedFluxSingleBlock, ExternalModSingleBlock))
    candidates = []
    for kind, why1, why2, cls1, cls2 in kinds:
        for i, blk in enumerate(getattr(diffusion_model, f"{kind}_blocks", None) or ()):
            name = f"{kind}_blocks.{i}"
            reason, cls = why1(blk, layers), cls1
            if reason is not None and not getattr(blk, "modulation", True):
                reason, cls = why2(blk, layers), cls2
            candidates.append((name, reason, KERNEL_FED[kind],
                               lambda blk=blk, name=name, cls=cls: cls(blk, name, int8_layers, fn)))
    return fuse_blocks("Flux", candidates, int8_layers, log, NORM_FED)


ADAPTER = dataclasses.replace(FLUX1, fuse=fuse)
