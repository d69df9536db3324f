"""Ideogram 4 (``comfy.ldm.ideogram4``, ComfyUI 0.33.0 or newer; absent from 0.3.75).

Fused, on fused_triton (``fuse``): each ``layers.N`` block becomes a :class:`FusedIdeogram4Block`: adaLN-modulated
RMSNorm + quantization feed the qkv GEMM and the merged w1+w3 GEMM straight from one kernel
(``quant.fused.norm_modulate_quantize``), SwiGLU + quantization feed w2 (``FusedFeedForward``); the residual tails
fuse too, with the next norm + quantization (``INT8_FUSED_RESIDUAL=0`` leaves them to torch). A block whose qkv is not INT8 on fused_triton keeps its own forward
(its FeedForward alone may still be fused). ``llm_cond_proj`` (input constant within a run) gets a per-run
``CachedLinear``. Checkpoint key layout: ``quant/fmt_ideogram4.py`` (the Ideogram 4 loader's). Padded text: the
conditional pass drops trailing padded text tokens (``diffusion_model_wrapper``, ``quant/pad_elision.py``).

``Ideogram4Attention.forward`` takes the normalised activation and calls ``self.qkv`` itself, so
:class:`FusedIdeogram4Attention` re-states its 15-line body starting from the int8 input. It calls the ComfyUI
functions that body calls, imported explicitly in :func:`comfy_functions`:
``comfy.model_management.in_training`` (read per call), ``comfy.ops.cast_bias_weight`` / ``uncast_bias_weight``,
``comfy.quant_ops.ck.rms_rope_split_half`` (comfy_kitchen), ``comfy.ldm.modules.attention.
optimized_attention_masked`` (so the pack's attention routing, ``transformer_options``' override, applies) and
the module's ``_apply_rope_split_half1``. With ``INT8_FUSED_QK_ROPE`` at its default (``all``) the QK RMSNorm and the
split-half RoPE of q / k come from one ``kernel.fused.qk_norm_rope`` launch instead of comfy_kitchen's op (H200:
0.2048 vs 0.2084 s/step, bench/RESULTS.md run q). Where one of them is missing (ComfyUI 0.3.75 has neither the module,
``in_training`` nor ``quant_ops.ck``; a ComfyUI without comfy_kitchen has no ``ck``) no block is fused: one log
line, the per-linear path (FeedForwards still fused).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch
from torch import nn

from .base import Adapter, Int8Linear, fused as qf, pack_module, select

pad_elision = pack_module("quant.pad_elision")

log = logging.getLogger("int8_fused")


@dataclasses.dataclass(frozen=True)
class ComfyFunctions:
    """What ``Ideogram4Attention.forward`` calls (module doc); tests pass stand-ins."""
    in_training: Callable[[], bool]
    cast_bias_weight: Callable
    uncast_bias_weight: Callable
    rms_rope_split_half: Callable
    attention: Callable
    rope: Callable
    clamp_fp16: bool  # the FeedForward clamps its SwiGLU product in fp16 (lumina's clamp_fp16, ComfyUI 0.33.0)


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


class FusedIdeogram4Attention(nn.Module):
    """Ideogram4Attention fed by an already-quantized input (qkv GEMM straight from the fused norm kernel)."""

    def __init__(self, attn: nn.Module, qkv: Int8Linear, o: nn.Module, fn: ComfyFunctions):
        super().__init__()
        self.qkv, self.o = qkv, o
        self.norm_q, self.norm_k = attn.norm_q, attn.norm_k
        self.num_heads, self.head_dim, self.hidden_size = attn.num_heads, attn.head_dim, attn.hidden_size
        self.fn = fn

    def forward(self, x, attn_mask, freqs_cis, transformer_options={}):
        """Drop-in for Ideogram4Attention.forward (normalised x [B, L, dim])."""
        b, l, k = x.shape
        a_q, a_s = qf.act_quant(x.reshape(-1, k), qf.inv_smooth_of(self.qkv, x.device))
        return self.forward_quantized(a_q, a_s, b, l, x.dtype, attn_mask, freqs_cis, transformer_options)

    def forward_quantized(self, a_q, a_s, b, l, dtype, attn_mask, freqs_cis, transformer_options={}):
        fn = self.fn
        qkv = qf.gemm(a_q, a_s, self.qkv, dtype).view(b, l, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(dim=2)
        if fn.in_training():
            q, k = fn.rope(self.norm_q(q), freqs_cis), fn.rope(self.norm_k(k), freqs_cis)
        else:
            q_scale, k_scale = qf.norm_weight(self.norm_q, q), qf.norm_weight(self.norm_k, k)
            fused = self._fused_qk_rope(qkv, q_scale, k_scale, freqs_cis)
            if fused is not None:  # q, k, v [B, H, L, D] views of [B, L, H, D] memory
                out = fn.attention(*fused, self.num_heads, attn_mask, skip_reshape=True,
                                   transformer_options=transformer_options)
                return qf.linear(self.o, out)
            streams = None
            if q_scale is None or k_scale is None:  # weight functions: ComfyUI's cast runs them
                q_scale, _, qs = fn.cast_bias_weight(self.norm_q, q, offloadable=True)
                k_scale, _, ks = fn.cast_bias_weight(self.norm_k, k, offloadable=True)
                streams = (qs, ks)
            q, k = fn.rms_rope_split_half(q, k, freqs_cis, q_scale, k_scale, self.norm_q.eps)
            if streams is not None:
                fn.uncast_bias_weight(self.norm_q, q_scale, None, streams[0])
                fn.uncast_bias_weight(self.norm_k, k_scale, None, streams[1])
        out = fn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.num_heads, attn_mask,
                           skip_reshape=True, transformer_options=transformer_options)
        return qf.linear(self.o, out)

    def _fused_qk_rope(self, qkv, q_scale, k_scale, freqs_cis):
        """(q, k, v) [B, H, L, D] views: q / k from one ``qk_norm_rope(split_half=True)`` launch (QK RMSNorm +
        split-half RoPE, instead of comfy_kitchen's ``rms_rope_split_half``), v the qkv output's view, or None where
        it does not apply: INT8_FUSED_QK_ROPE ``flux`` or ``0``, torch.compile tracing, norms with weight functions (None scales),
        ``freqs_cis`` not ComfyUI's fp32 [1 | B, L, 1, D/2, 2, 2] matrices, a head_dim that is not a power of 2."""
        if q_scale is None or k_scale is None or not qf.qk_rope_on("ideogram4") or qf._compiling():
            return None
        b, l, _, h, d = qkv.shape
        pe = qf.rope_rows(freqs_cis, b, l, d, qkv.device, at_least=True)
        if pe is None or not qkv.is_contiguous():
            return None
        # q, k: [B, L, H, D] buffers seen as [B, H, L, D] (the layout ComfyUI's own path hands SDPA, so its output
        # needs no copy); v: the qkv output's view, as ComfyUI passes it (not copied)
        q, k = (torch.empty((b, l, h, d), dtype=qkv.dtype, device=qkv.device).transpose(1, 2) for _ in range(2))
        eps = qf._norm_eps(self.norm_q, qkv)  # ComfyUI hands norm_q's eps to both (rms_rope_split_half)
        qf._call(qf._kf().qk_norm_rope, qkv.view(b, l, 3 * h * d), h, q_scale, k_scale, eps, eps, pe, q, k, None, 0,
                 True)  # split_half
        return q, k, qkv[:, :, 2].transpose(1, 2)

    def int8_layers(self) -> dict[str, Int8Linear]:
        return {n: m for n, m in (("qkv", self.qkv), ("o", self.o)) if isinstance(m, Int8Linear)}


class FusedIdeogram4Block(qf.FetchedBlock):
    """Ideogram4TransformerBlock with the norm * (1 + s) + quantization fused into the qkv and w1+w3 inputs.

    Same forward signature and result as the original (within rounding). Holds the original norms and adaLN
    linear (shared objects) and the INT8 linears; never the replaced float linears."""

    def __init__(self, block: nn.Module, attention: FusedIdeogram4Attention, feed_forward: "qf.FusedFeedForward",
                 adaln_modulation: nn.Module, covers=()):
        super().__init__()
        self.attention, self.feed_forward = attention, feed_forward
        self.attention_norm1, self.attention_norm2 = block.attention_norm1, block.attention_norm2
        self.ffn_norm1, self.ffn_norm2 = block.ffn_norm1, block.ffn_norm2
        self.adaln_modulation = adaln_modulation
        self.covers = tuple(covers)

    def forward(self, x, attn_mask, freqs_cis, adaln_input, transformer_options={}):
        mod = qf.linear(self.adaln_modulation, adaln_input)
        scale_msa, gate_msa, scale_mlp, gate_mlp = qf.adaln_chunks(mod)  # 1 + s, tanh(g): two launches, not four
        b, l, k = x.shape
        attn, ff = self.attention, self.feed_forward
        a_q, a_s = qf.norm_modulate_quantize(self.attention_norm1, x.reshape(-1, k), scale_msa, l,
                                             qf.inv_smooth_of(attn.qkv, x.device))
        attn_out = attn.forward_quantized(a_q, a_s, b, l, x.dtype, attn_mask, freqs_cis, transformer_options)
        inv13 = qf.inv_smooth_of(ff.w13, x.device)
        # residual tail + ffn_norm1 * (1 + s) + quantize in one kernel (torch when it cannot run)
        tail = qf.gated_residual(x.reshape(-1, k), attn_out.reshape(-1, k), self.attention_norm2, gate_msa, l,
                                 self.ffn_norm1, scale_mlp, inv13)
        if tail is not None:
            x2, a_q, a_s = tail
            x = x2.view(b, l, k)
        else:
            x = x + gate_msa * qf.rms(self.attention_norm2, attn_out)
            a_q, a_s = qf.norm_modulate_quantize(self.ffn_norm1, x.reshape(-1, k), scale_mlp, l, inv13)
        ff_out = ff.forward_quantized(a_q, a_s, x.dtype)
        tail = qf.gated_residual(x.reshape(-1, k), ff_out, self.ffn_norm2, gate_mlp, l)
        if tail is not None:
            return tail[0].view(b, l, k)
        return x + gate_mlp * qf.rms(self.ffn_norm2, ff_out.view(b, l, -1))

    def int8_layers(self) -> dict[str, Int8Linear]:
        out = {f"attention.{n}": m for n, m in self.attention.int8_layers().items()}
        out.update({f"feed_forward.{n}": m for n, m in self.feed_forward.int8_layers().items()})
        if isinstance(self.adaln_modulation, Int8Linear):
            out["adaln_modulation"] = self.adaln_modulation
        return out

    def extra_repr(self) -> str:
        return f"covers={len(self.covers)} linears"


def _block(name: str, blk: nn.Module, layers: dict, fn: ComfyFunctions) -> FusedIdeogram4Block | None:
    p = f"{name}."
    qkv = layers.get(p + "attention.qkv")
    ff = qf.FusedFeedForward.build(p + "feed_forward", blk.feed_forward, layers, fn.clamp_fp16)
    if not qf.fusable(qkv) or ff is None:
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
        ff = qf.FusedFeedForward.build(f"{name}.feed_forward", blk.feed_forward, int8_layers,
                                       fn.clamp_fp16 if fn is not None else False)
        if ff is not None:
            out[f"{name}.feed_forward"] = ff
    if skipped:
        log.info("INT8 fusion: %d Ideogram 4 blocks stay on the per-linear path (%s), e.g. %s", len(skipped),
                 why or "qkv, w1 and w3 not all on fused_triton with equal w1/w3 smoothing", skipped[0])
    proj = getattr(diffusion_model, "llm_cond_proj", None)
    if proj is not None:
        inner = int8_layers.get("llm_cond_proj", proj)
        out["llm_cond_proj"] = qf.CachedLinear(inner, name="llm_cond_proj")
        out["llm_cond_proj"].covers = ("llm_cond_proj",) if isinstance(inner, Int8Linear) else ()
    return out


def diffusion_model_wrapper(executor, *args, **kwargs):
    """ComfyUI DIFFUSION_MODEL wrapper: ``Ideogram4Transformer2DModel.forward(x, timesteps, context, attention_mask,
    ...)`` with the trailing padded text tokens removed (``quant.pad_elision``); other models pass through."""
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
    checkpoint_layout="quant.fmt_ideogram4",
    pad_elision_wrapper=diffusion_model_wrapper,
)
