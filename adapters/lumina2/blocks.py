"""Fused Lumina 2 / Z-Image blocks, pure torch + ``kernel``; ComfyUI's functions are handed in
(``Lumina2Functions``, built by the adapter, ``__init__.py``).

``FusedLumina2Block`` replaces a modulated ``comfy.ldm.lumina.model.JointTransformerBlock``:

    scale_msa, gate_msa, scale_mlp, gate_mlp = adaLN_modulation(adaln_input).chunk(4, dim=1)
    a  = quantize(attention_norm1(x) * (1 + scale_msa))        # one kernel (rmsnorm_modulate_quantize) -> qkv GEMM
    x  = x + tanh(gate_msa) * attention_norm2(clamp(attention(a)))   # QK norms, RoPE, optimized_attention_masked
    h  = quantize(ffn_norm1(x) * (1 + scale_mlp))              # one kernel with the line above -> w1+w3 GEMM
    x  = x + tanh(gate_mlp) * ffn_norm2(clamp(w2(swiglu+quantize(h))))   # FusedFeedForward; the tail one kernel

The two residual tails run as ``gated_residual_rmsnorm`` (``quant.blocks.gated_residual``: roundings as torch's
three ops; torch's ops where it does not apply), the first with ffn_norm1 * (1 + scale_mlp) +
quantization of its result from the same registers.

``modulate`` in ComfyUI (both supported versions) is ``x * (1 + scale.unsqueeze(1))``: ``1 + scale`` rounds to the
scale's dtype, the product to the promoted dtype, after ``F.rms_norm``'s one rounding to x's dtype: exactly the
definition ``rmsnorm_modulate_quantize`` implements (kernel/norm.py), so the int8 inputs of qkv and w1+w3 equal
what the per-linear Int8Linear quantizes (bit for bit in bf16 / fp16; fp32 up to the fp32 sum order of the norm).

QK norms + RoPE: with as many kv heads as heads (Z-Image), one
``kernel.rope.qk_norm_rope`` launch writes q and k in the [B, L, H, D] layout attention reads, and v stays the
qkv output's view (ComfyUI's ``repeat`` with n_rep 1 would copy k and v unchanged). Otherwise as ComfyUI runs them.

What stays as ComfyUI runs it: the adaLN ``nn.Sequential`` (called as a module), the QK norms and RoPE where the
kernel does not apply (0.3.75: ``q_norm`` / ``k_norm`` modules then ``comfy.ldm.flux.math.apply_rope``; 0.33.0
outside training: comfy_kitchen's ``rms_rope`` / ``rms_rope1`` with the norms' weights from
``comfy.ops.cast_bias_weight``), the GQA repeat,
``optimized_attention_masked`` with ``transformer_options`` (the pack's attention routing applies), the output
projection and 0.33.0's ``clamp_fp16`` of the attention / FeedForward outputs (before the tail kernels).

Calls the fused path does not implement run the running ComfyUI's own ``JointTransformerBlock.forward`` on this
block (its twin: the same norms, the attention with INT8 qkv / out, the FusedFeedForward as drop-in FeedForward):
``timestep_zero_index`` (0.33.0's omni / reference-latent mode, per-slice modulation), no ``adaln_input``, and
attention patches in ``transformer_options`` (``attn1_patch`` / ``attn1_output_patch``; ComfyUI's lumina blocks
apply none today, so that path is the one they would take). Each reason is logged once per process.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch
from torch import nn

from ..base import Int8Linear, blocks as qb

log = logging.getLogger("int8_fused")
_LOGGED: set = set()


@dataclasses.dataclass(frozen=True)
class Lumina2Functions:
    """What the fused block calls from ComfyUI (the adapter imports them; tests may pass stand-ins)."""
    block_forward: Callable        # comfy.ldm.lumina.model.JointTransformerBlock.forward: the fallback
    apply_rope: Callable           # comfy.ldm.flux.math.apply_rope(xq, xk, freqs_cis)
    attention: Callable            # comfy.ldm.modules.attention.optimized_attention_masked
    clamp_fp16: Callable | None    # comfy.ldm.lumina.model.clamp_fp16 (0.33.0), None (0.3.75: no clamp)
    takes_timestep_zero_index: bool  # the block forward has 0.33.0's timestep_zero_index argument
    # 0.33.0 JointAttention: outside training, QK norm + RoPE through comfy_kitchen (None on 0.3.75)
    in_training: Callable[[], bool] | None = None
    cast_bias_weight: Callable | None = None
    uncast_bias_weight: Callable | None = None
    rms_rope: Callable | None = None
    rms_rope1: Callable | None = None


def _log_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        log.info("INT8 fusion: Lumina 2 blocks run ComfyUI's own forward (INT8 linears, fused FeedForward) for "
                 "calls with %s", reason)


class FusedLumina2Block(qb.FetchedBlock):
    """A modulated JointTransformerBlock (named ``prefix``) with its norm * (1 + scale) + quantization fused into
    the qkv and w1+w3 inputs. Children: the block's own norms, ``attention`` (a twin of its JointAttention with
    the INT8 linears of ``layers``), ``adaLN_modulation`` (twin, INT8 where ``layers`` has it) and
    ``feed_forward`` (the FusedFeedForward ``ff``). Same forward signature and result as the original (within
    rounding); never holds the replaced float linears."""

    def __init__(self, block: nn.Module, prefix: str, layers: dict, ff: "qb.FusedFeedForward",
                 fn: Lumina2Functions):
        super().__init__()
        for k, v in block.__dict__.items():
            if not k.startswith("_"):
                self.__dict__[k] = v
        ffp = f"{prefix}.feed_forward"
        for k, m in block._modules.items():
            if k == "feed_forward":
                self._modules[k] = ff
            else:
                self._modules[k] = qb.with_layers(m, f"{prefix}.{k}", layers) if m is not None else None
        self.fn = fn
        self.covers = tuple([n for n in layers if n.startswith(f"{prefix}.") and not n.startswith(f"{ffp}.")]
                            + list(ff.covers))
        qb.kernels().register_ops()

    def int8_layers(self) -> dict[str, Int8Linear]:
        out = {n: m for n, m in self.named_modules()
               if isinstance(m, Int8Linear) and n.split(".")[0] != "feed_forward"}
        out.update({f"feed_forward.{n}": m for n, m in self.feed_forward.int8_layers().items()})
        return out

    def extra_repr(self) -> str:
        return f"covers={len(self.covers)} linears"

    # -------------------------------------------------------------------------------------------- forward
    def forward(self, x, x_mask, freqs_cis, adaln_input=None, timestep_zero_index=None, transformer_options={}):
        why = None
        if timestep_zero_index is not None:
            why = "timestep_zero_index (per-slice modulation)"
        elif adaln_input is None or not self.modulation:
            why = "no adaln_input"
        elif qb.attn_patches(transformer_options):
            why = "attention patches"
        elif qb.lora_active(self):
            why = "LoRA side branches (a LoRA loaded after Apply)"
        if why is not None:
            _log_once(why)
            kw = {"timestep_zero_index": timestep_zero_index} if self.fn.takes_timestep_zero_index else {}
            return self.fn.block_forward(self, x, x_mask, freqs_cis, adaln_input,
                                         transformer_options=transformer_options, **kw)
        fn = self.fn
        # modulate(): x * (1 + scale.unsqueeze(1)); the kernels take the (1 + scale) and tanh(gate) rows [B, K], all
        # four from two launches (the block's code: chunk(4, dim=1) of [B, 4 K], then four ops)
        s_msa, tanh_msa, s_mlp, tanh_mlp = qb.adaln_chunks(self.adaLN_modulation(adaln_input))
        b, l, k = x.shape
        attn = self.attention
        a_q, a_s = qb.norm_modulate_quantize(self.attention_norm1, x.reshape(-1, k), s_msa, l,
                                             qb.inv_smooth_of(attn.qkv, x.device), qb.rotation(attn.qkv))
        o = self._attention(a_q, a_s, b, l, torch.promote_types(x.dtype, s_msa.dtype), x_mask, freqs_cis,
                            transformer_options)
        if fn.clamp_fp16 is not None:
            o = fn.clamp_fp16(o)
        ff = self.feed_forward
        # x + tanh(gate) * attention_norm2(o), then ffn_norm1 * (1 + s) + quantize: one kernel (torch otherwise)
        x, a_q, a_s = qb.residual_then_quant(x, o, self.attention_norm2, tanh_msa, l, self.ffn_norm1, s_mlp, ff.w13)
        del o
        h = ff.forward_quantized(a_q, a_s, torch.promote_types(x.dtype, s_mlp.dtype)).view(b, l, -1)
        if fn.clamp_fp16 is not None:
            h = fn.clamp_fp16(h)
        tail = qb.gated_residual(x.reshape(-1, k), h.reshape(-1, k), self.ffn_norm2, tanh_mlp, l)
        if tail is not None:
            return tail[0].view(b, l, k)
        return x + tanh_mlp.unsqueeze(1) * qb.rms(self.ffn_norm2, h)

    def _attention(self, a_q, a_s, bsz, seqlen, dtype, x_mask, freqs_cis, transformer_options):
        """JointAttention.forward of the running ComfyUI from the int8 qkv input on."""
        attn, fn = self.attention, self.fn
        nh, nkv, hd = attn.n_local_heads, attn.n_local_kv_heads, attn.head_dim
        qkv = qb.gemm(a_q, a_s, attn.qkv, dtype).view(bsz, seqlen, -1)
        xq, xk, xv = torch.split(qkv, [nh * hd, nkv * hd, nkv * hd], dim=-1)
        xq = xq.view(bsz, seqlen, nh, hd)
        xk = xk.view(bsz, seqlen, nkv, hd)
        xv = xv.view(bsz, seqlen, nkv, hd)
        fused = self._fused_qk_rope(qkv, nh, nkv, hd, freqs_cis)
        if fused is not None:  # q, k [B, L, H, D]; nh == nkv, so ComfyUI's repeat would copy k / v unchanged
            xq, xk = fused
            out = fn.attention(xq.movedim(1, 2), xk.movedim(1, 2), xv.movedim(1, 2), nh, x_mask, skip_reshape=True,
                               transformer_options=transformer_options)
            return qb.linear(attn.out, out)
        if fn.rms_rope is not None and getattr(attn, "qk_norm", False) and not fn.in_training():
            q_scale, _, q_stream = fn.cast_bias_weight(attn.q_norm, xq, offloadable=True)
            k_scale, _, k_stream = fn.cast_bias_weight(attn.k_norm, xk, offloadable=True)
            eps = attn.q_norm.eps if attn.q_norm.eps is not None else torch.finfo(torch.float32).eps
            if nh == nkv:
                xq, xk = fn.rms_rope(xq, xk, freqs_cis, q_scale, k_scale, eps)
            else:
                xq = fn.rms_rope1(xq, freqs_cis, q_scale, eps)
                xk = fn.rms_rope1(xk, freqs_cis, k_scale, eps)
            fn.uncast_bias_weight(attn.q_norm, q_scale, None, q_stream)
            fn.uncast_bias_weight(attn.k_norm, k_scale, None, k_stream)
        else:
            xq = attn.q_norm(xq)
            xk = attn.k_norm(xk)
            xq, xk = fn.apply_rope(xq, xk, freqs_cis)
        n_rep = nh // nkv
        if n_rep >= 1:
            xk = xk.unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3)
            xv = xv.unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3)
        out = fn.attention(xq.movedim(1, 2), xk.movedim(1, 2), xv.movedim(1, 2), nh, x_mask, skip_reshape=True,
                           transformer_options=transformer_options)
        return qb.linear(attn.out, out)

    def _fused_qk_rope(self, qkv, nh, nkv, hd, freqs_cis):
        """(q, k) [B, L, H, D] from one ``qk_norm_rope`` launch (QK RMSNorm per head + interleaved-pair RoPE, in
        place of comfy_kitchen's ``rms_rope`` / the norm modules + ``apply_rope``), or None where it does not
        apply: torch.compile tracing, training, GQA (nh != nkv), QK norms that are not RMSNorms over head_dim with a
        weight (``qk_norm=False``: Identity) or carry weight functions, ``freqs_cis`` not ComfyUI's fp32
        [B | 1, L, 1, D/2, 2, 2] rotations, a head_dim that is not a power of 2."""
        attn, fn = self.attention, self.fn
        if (qb.compiling() or nh != nkv
                or (fn.in_training is not None and fn.in_training())):
            return None
        b, l, w = qkv.shape
        pe = qb.rope_rows(freqs_cis, b, l, hd, qkv.device)
        weights = qb.qk_norm_weights(attn.q_norm, attn.k_norm, qkv, hd)
        if pe is None or weights is None or w != 3 * nh * hd or qkv.stride(-1) != 1:
            return None
        wq, eq, wk, ek = weights
        if fn.rms_rope is not None:  # 0.33.0 hands q_norm's eps to both (rms_rope)
            ek = eq
        q, k = (torch.empty((b, l, nh, hd), dtype=qkv.dtype, device=qkv.device) for _ in range(2))
        qb.call(qb.kernels().rope.qk_norm_rope, qkv, nh, wq, wk, eq, ek, pe, q.transpose(1, 2), k.transpose(1, 2), None, 0)
        return q, k
