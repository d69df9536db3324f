"""Fused Ideogram 4 blocks: ``Ideogram4TransformerBlock`` and its ``Ideogram4Attention`` of ComfyUI's
``comfy/ldm/ideogram4/model.py`` on INT8 layers, pure torch + ``kernel``; ComfyUI's functions are handed in
(:class:`ComfyFunctions`, built by the adapter, ``__init__.py``).

``FusedIdeogram4Block``: adaLN-modulated RMSNorm + quantization feed the qkv GEMM and the merged w1+w3 GEMM straight
from one kernel (``quant.blocks.norm_modulate_quantize``), SwiGLU + quantization feed w2 (``FusedFeedForward``); the
residual tails fuse too, with the next norm + quantization (``quant.blocks.gated_residual``; torch's ops where it
does not apply).

``Ideogram4Attention.forward`` takes the normalised activation and calls ``self.qkv`` itself, so
:class:`FusedIdeogram4Attention` re-states its 15-line body starting from the int8 input, calling the ComfyUI
functions that body calls (:class:`ComfyFunctions`). The QK RMSNorm and the split-half RoPE of q / k come from one
``qk_norm_rope`` launch instead of comfy_kitchen's op.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from ..base import Int8Linear, blocks as qb


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


class FusedIdeogram4Attention(nn.Module):
    """Ideogram4Attention fed by an already-quantized input (qkv GEMM straight from the fused norm kernel)."""

    def __init__(self, attn: nn.Module, qkv: Int8Linear, o: nn.Module, fn: ComfyFunctions):
        super().__init__()
        self.qkv, self.o = qkv, o
        self.norm_q, self.norm_k = attn.norm_q, attn.norm_k
        self.num_heads, self.head_dim, self.hidden_size = attn.num_heads, attn.head_dim, attn.hidden_size
        self.fn = fn

    def forward(self, x, attn_mask, freqs_cis, transformer_options={}):
        """Drop-in for Ideogram4Attention.forward (normalised x [B, L, dim]). A qkv with LoRA branches this run
        (``quant.lora``) runs as its module call, so that the branch sees the float input."""
        b, l, k = x.shape
        if not qb.norm_fusable(self.qkv):
            return self._attend(self.qkv(x), b, l, attn_mask, freqs_cis, transformer_options)
        a_q, a_s = qb.input_quant(self.qkv, x.reshape(-1, k))
        return self.forward_quantized(a_q, a_s, b, l, x.dtype, attn_mask, freqs_cis, transformer_options)

    def forward_quantized(self, a_q, a_s, b, l, dtype, attn_mask, freqs_cis, transformer_options={}):
        return self._attend(qb.gemm(a_q, a_s, self.qkv, dtype), b, l, attn_mask, freqs_cis, transformer_options)

    def _attend(self, qkv, b, l, attn_mask, freqs_cis, transformer_options):
        """The body after the qkv GEMM (``qkv`` [B * L | B, L, 3 * dim])."""
        fn = self.fn
        qkv = qkv.view(b, l, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(dim=2)
        if fn.in_training():
            q, k = fn.rope(self.norm_q(q), freqs_cis), fn.rope(self.norm_k(k), freqs_cis)
        else:
            q_scale, k_scale = qb.norm_weight(self.norm_q, q), qb.norm_weight(self.norm_k, k)
            fused = self._fused_qk_rope(qkv, q_scale, k_scale, freqs_cis)
            if fused is not None:  # q, k, v [B, H, L, D] views of [B, L, H, D] memory
                out = fn.attention(*fused, self.num_heads, attn_mask, skip_reshape=True,
                                   transformer_options=transformer_options)
                return qb.linear(self.o, out)
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
        return qb.linear(self.o, out)

    def _fused_qk_rope(self, qkv, q_scale, k_scale, freqs_cis):
        """(q, k, v) [B, H, L, D] views: q / k from one ``qk_norm_rope(split_half=True)`` launch (QK RMSNorm +
        split-half RoPE, instead of comfy_kitchen's ``rms_rope_split_half``), v the qkv output's view, or None where
        it does not apply: torch.compile tracing, norms with weight functions
        (None scales), ``freqs_cis`` not ComfyUI's fp32 [1 | B, L, 1, D/2, 2, 2] matrices, a head_dim that is not a
        power of 2."""
        if q_scale is None or k_scale is None or qb.compiling():
            return None
        b, l, _, h, d = qkv.shape
        pe = qb.rope_rows(freqs_cis, b, l, d, qkv.device, at_least=True)
        if pe is None or not qkv.is_contiguous():
            return None
        # q, k: [B, L, H, D] buffers seen as [B, H, L, D] (the layout ComfyUI's own path hands SDPA, so its output
        # needs no copy); v: the qkv output's view, as ComfyUI passes it (not copied)
        q, k = (torch.empty((b, l, h, d), dtype=qkv.dtype, device=qkv.device).transpose(1, 2) for _ in range(2))
        eps = qb.norm_eps(self.norm_q, qkv)  # ComfyUI hands norm_q's eps to both (rms_rope_split_half)
        qb.call(qb.kernels().rope.qk_norm_rope, qkv.view(b, l, 3 * h * d), h, q_scale, k_scale, eps, eps, pe, q, k, None, 0,
                 True)  # split_half
        return q, k, qkv[:, :, 2].transpose(1, 2)

    def int8_layers(self) -> dict[str, Int8Linear]:
        return {n: m for n, m in (("qkv", self.qkv), ("o", self.o)) if isinstance(m, Int8Linear)}


class FusedIdeogram4Block(qb.FetchedBlock):
    """Ideogram4TransformerBlock with the norm * (1 + s) + quantization fused into the qkv and w1+w3 inputs.

    Same forward signature and result as the original (within rounding). Holds the original norms and adaLN
    linear (shared objects) and the INT8 linears; never the replaced float linears."""

    def __init__(self, block: nn.Module, attention: FusedIdeogram4Attention, feed_forward: "qb.FusedFeedForward",
                 adaln_modulation: nn.Module, covers=()):
        super().__init__()
        self.attention, self.feed_forward = attention, feed_forward
        self.attention_norm1, self.attention_norm2 = block.attention_norm1, block.attention_norm2
        self.ffn_norm1, self.ffn_norm2 = block.ffn_norm1, block.ffn_norm2
        self.adaln_modulation = adaln_modulation
        self.covers = tuple(covers)

    def forward(self, x, attn_mask, freqs_cis, adaln_input, transformer_options={}):
        mod = qb.linear(self.adaln_modulation, adaln_input)
        scale_msa, gate_msa, scale_mlp, gate_mlp = qb.adaln_chunks(mod)  # 1 + s, tanh(g): two launches, not four
        b, l, k = x.shape
        attn, ff = self.attention, self.feed_forward
        # a GEMM the norm kernel cannot feed (kept float, another backend, a ConvRot layer with LoRA branches this
        # run) takes the float input through its module call: that part runs as ComfyUI's ops, the rest stays fused
        if not qb.norm_fusable(attn.qkv):
            attn_out = attn(qb.rms(self.attention_norm1, x) * scale_msa, attn_mask, freqs_cis, transformer_options)
        else:  # a ConvRot qkv: the norm kernel rotates too
            a_q, a_s = qb.norm_modulate_quantize(self.attention_norm1, x.reshape(-1, k), scale_msa, l,
                                                 qb.inv_smooth_of(attn.qkv, x.device), qb.rotation(attn.qkv))
            attn_out = attn.forward_quantized(a_q, a_s, b, l, x.dtype, attn_mask, freqs_cis, transformer_options)
        if not qb.norm_fusable(ff.w13):
            x = x + gate_msa * qb.rms(self.attention_norm2, attn_out)
            ff_out = ff(qb.rms(self.ffn_norm1, x) * scale_mlp).reshape(-1, k)
            return self._ffn_tail(x, ff_out, gate_mlp)
        # residual tail + ffn_norm1 * (1 + s) + quantize in one kernel (torch when it cannot run)
        x, a_q, a_s = qb.residual_then_quant(x, attn_out, self.attention_norm2, gate_msa, l, self.ffn_norm1, scale_mlp,
                                             ff.w13)
        return self._ffn_tail(x, ff.forward_quantized(a_q, a_s, x.dtype), gate_mlp)

    def _ffn_tail(self, x, ff_out, gate_mlp):
        """``x + gate_mlp * ffn_norm2(ff_out)`` (ff_out [B * L, dim]): one kernel, torch where it does not apply."""
        b, l, k = x.shape
        tail = qb.gated_residual(x.reshape(-1, k), ff_out, self.ffn_norm2, gate_mlp, l)
        if tail is not None:
            return tail[0].view(b, l, k)
        return x + gate_mlp * qb.rms(self.ffn_norm2, ff_out.view(b, l, -1))

    def int8_layers(self) -> dict[str, Int8Linear]:
        out = {f"attention.{n}": m for n, m in self.attention.int8_layers().items()}
        out.update({f"feed_forward.{n}": m for n, m in self.feed_forward.int8_layers().items()})
        if isinstance(self.adaln_modulation, Int8Linear):
            out["adaln_modulation"] = self.adaln_modulation
        return out

    def extra_repr(self) -> str:
        return f"covers={len(self.covers)} linears"
