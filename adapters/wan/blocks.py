"""Fused Wan 2.x attention blocks: ``WanAttentionBlock`` of ComfyUI's ``comfy/ldm/wan/model.py`` on INT8
layers, with the activation quantization folded into the kernels that produce each GEMM input (the LayerNorm and
GELU kernels, the QK norm + RoPE and residual-tail kernels of ``kernel/{norm,gelu,rope,residual}.py``):

* ``LayerNorm(x) * (1 + e[1]) + e[0]`` + quantization (``layernorm_modulate_quantize``) gives ONE int8 activation
  that ``self_attn.q``, ``.k`` and ``.v`` all read (three GEMMs from the same int8 input; layers whose SmoothQuant
  vectors differ get one kernel per distinct vector);
* ``LayerNorm(x) * (1 + e[4]) + e[3]`` + quantization feeds ``ffn.0``, ``gelu_tanh`` + quantization
  (``gelu_tanh_quantize``) feeds ``ffn.2``;
* ``norm_q`` / ``norm_k`` (RMSNorm over the width) and RoPE of q and k in one kernel (``qk_rmsnorm_rope_rows``),
  writing the [B, L, H, D] layout attention reads; where it does not apply, the norm modules and ComfyUI's
  ``apply_rope1``;
* the residual tails (operands of one dtype): ``x = addcmul(x, y, e[2])``
  with ``norm3(x)`` (a LayerNorm with its affine, or Identity) from one kernel (``residual_add_layernorm``); ``x = x
  + cross_attn(...)`` with norm2 * (1 + e[4]) + e[3] + quantization for ``ffn.0``
  (``residual_add_layernorm_modulate_quantize``); the last ``addcmul(x, y, e[5])`` (``residual_add``).

Everything else runs as ComfyUI's block forward runs it: the modulation sum ``cast_to(modulation, x.dtype) + e``
(fp32 when ``e`` is, as ComfyUI computes it: then the tails run as torch ops), attention through ComfyUI's
``optimized_attention`` with ``transformer_options`` (the pack's attention routing applies), the output projection
``self_attn.o`` and the cross-attention (``cross_attn`` called as a module: per-linear INT8).

Pure torch + ``kernel``; no ComfyUI import and no architecture recognition: the adapter (``__init__.py``) decides
which blocks are Wan 2.x ``WanAttentionBlock`` s and hands in what the forward calls from ComfyUI
(:class:`WanFunctions`).

The fused block is a structural twin of the original (``quant.blocks.with_layers``: same child names, INT8 layers
in place, every other module shared). ``e`` is [B, 6, C] (VACE, camera models) or [B, 1, 6, C] (WanModel): one
modulation row per sample, broadcast over the tokens by the kernels; or Wan 2.2 5B's per-token modulation [B, T, 6,
C] (one row per latent frame): ComfyUI's ``repeat_e`` makes each chunk [B, L, C] and the kernels read one row per
token (``tokens_per_batch`` 1). Calls it does not implement run the running ComfyUI's own
``WanAttentionBlock.forward`` on the twin, i.e. the per-linear INT8 path exactly: ``attn1_patch`` / ``attn2_patch``
in ``transformer_options`` (applied by current ComfyUI, ignored by 0.3.75: its own forward decides), a per-token
``e`` whose batch is not x's, and extra keyword arguments. A layer that is not INT8 on fused_triton (kept float,
another backend) takes its input from torch. Numerics equal the per-linear INT8 path within rounding.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from ..base import Int8Linear, blocks as qb

QKV = ("q", "k", "v")


@dataclasses.dataclass(frozen=True)
class WanFunctions:
    """What the block calls from ComfyUI (the adapter imports them; tests may pass stand-ins)."""
    cast_to: Callable              # comfy.model_management.cast_to(weight, dtype=, device=)
    apply_rope1: Callable          # comfy.ldm.flux.math.apply_rope1(x, freqs) (the one comfy.ldm.wan.model uses)
    optimized_attention: Callable  # the one comfy.ldm.wan.model calls (q, k, v, heads=, transformer_options=)
    repeat_e: Callable             # comfy.ldm.wan.model.repeat_e
    block_forward: Callable        # comfy.ldm.wan.model.WanAttentionBlock.forward: the per-linear path


def _patched(transformer_options) -> bool:
    """Whether the call carries attention patches the block forward handles itself (current ComfyUI applies
    ``attn1_patch`` in self-attention and ``attn2_patch`` after cross-attention; 0.3.75 ignores both)."""
    p = transformer_options.get("patches") if isinstance(transformer_options, dict) else None
    return bool(p) and ("attn1_patch" in p or "attn2_patch" in p)


def _tokens_per_row(t: torch.Tensor, l: int) -> int:
    """Tokens each modulation row of ``t`` serves: ``l`` for one row per sample ([B | 1, 1, K]), 1 for Wan 2.2 5B's
    per-token rows ([B, L, K], as ``repeat_e`` materializes them)."""
    return l if t.shape[1] == 1 else 1


def _same_smooth(a: Int8Linear, b: Int8Linear) -> bool:
    sa, sb = a.smooth, b.smooth
    return (sa is None and sb is None) or (sa is not None and sb is not None and sa.shape == sb.shape
                                           and torch.equal(sa.detach().cpu(), sb.detach().cpu()))


def _same_input(a, b) -> bool:
    """Whether q/k/v layers ``a`` and ``b`` read the same int8 activation (``qb.stackable``; unrotated: with equal
    smoothing)."""
    return qb.stackable((a, b)) and (qb.rotation(a) > 0 or _same_smooth(a, b))


class FusedWanBlock(qb.FetchedBlock):
    """The twin of ComfyUI's ``WanAttentionBlock`` ``block`` (named ``prefix``) on ``layers`` ({name relative to
    the diffusion model: Int8Linear}); ``covers``: the names of ``layers`` under the block."""

    def __init__(self, block: nn.Module, prefix: str, layers: dict, fn: WanFunctions):
        super().__init__()
        for k, v in block.__dict__.items():
            if not k.startswith("_"):
                self.__dict__[k] = v
        for k, p in block._parameters.items():   # ``modulation`` (shared tensor: ComfyUI's patching reaches it)
            self._parameters[k] = p
        for k, b in block._buffers.items():
            self._buffers[k] = b
        for k, m in block._modules.items():
            self._modules[k] = qb.with_layers(m, f"{prefix}.{k}", layers) if m is not None else None
        self.fn = fn
        self.covers = tuple(n for n in layers if n.startswith(f"{prefix}."))
        # q/k/v: which of them read the same int8 activation (equal smoothing): index of the first equal one
        src = []
        for i, n in enumerate(QKV):
            li = getattr(self.self_attn, n)
            src.append(next((j for j in range(i) if _same_input(getattr(self.self_attn, QKV[j]), li)), i))
        self._qkv_src = tuple(src)
        qb.kernels().register_ops()

    def int8_layers(self) -> dict[str, Int8Linear]:
        return {n: m for n, m in self.named_modules() if isinstance(m, Int8Linear)}

    def extra_repr(self) -> str:
        return f"covers={len(self.covers)} linears, qkv_sources={self._qkv_src}"

    # -------------------------------------------------------------------------------- pieces
    def _mod_linears(self, layers, norm: nn.Module, x: torch.Tensor, shift, scale, src=None) -> list:
        """``[layer(addcmul(shift, norm(x), 1 + scale)) for layer in layers]`` (x [B, L, K], shift / scale
        [B, 1, K]): the int8 input of each INT8-on-fused_triton layer from one kernel per distinct smoothing
        (``src[i]``: the index of the layer whose activation layer i reuses), the others from torch as ComfyUI
        computes it."""
        b, l, k = x.shape
        src = src or tuple(range(len(layers)))
        dt = qb.promote(x, scale, shift)
        acts, outs, y = {}, [], None
        for i, layer in enumerate(layers):
            if not qb.norm_fusable(layer):
                if y is None:
                    y = torch.addcmul(shift, norm(x), 1 + scale)
                outs.append(layer(y))
                continue
            j = src[i]
            if j not in acts:
                acts[j] = qb.ln_mod_quant(x.reshape(-1, k), scale, shift, _tokens_per_row(scale, l),
                                          qb.inv_smooth_of(layer, x.device), float(norm.eps), qb.rotation(layer))
            a_q, a_s = acts[j]
            outs.append(qb.gemm(a_q, a_s, layer, dt).view(b, l, -1))
        return outs

    def _self_attention(self, x, e0, e1, freqs, transformer_options):
        """ComfyUI's ``WanSelfAttention.forward`` on ``addcmul(e0, norm1(x), 1 + e1)``, q/k/v from one int8 input."""
        attn = self.self_attn
        b, s, n, d = x.shape[0], x.shape[1], attn.num_heads, attn.head_dim
        q, k, v = self._mod_linears([attn.q, attn.k, attn.v], self.norm1, x, e0, e1, self._qkv_src)
        qk = self._fused_qk_rope(q, k, freqs)
        if qk is not None:
            q, k = qk
        else:
            q = self.fn.apply_rope1(attn.norm_q(q).view(b, s, n, d), freqs)
            k = self.fn.apply_rope1(attn.norm_k(k).view(b, s, n, d), freqs)
        out = self.fn.optimized_attention(q.view(b, s, n * d), k.view(b, s, n * d), v.view(b, s, n * d),
                                          heads=attn.num_heads, transformer_options=transformer_options)
        del q, k, v
        return qb.linear(attn.o, out)

    def _fused_qk_rope(self, q, k, freqs):
        """(q, k) [B, L, H, D] from one ``qk_rmsnorm_rope_rows`` launch (norm_q / norm_k over the row + RoPE,
        instead of two RMSNorm modules and two ``apply_rope1`` calls), or None where it does not apply:
        torch.compile tracing, norms that are not RMSNorms with a weight over the width (``qk_norm=False``) or
        carry weight functions, ``freqs`` not ComfyUI's fp32 [B | 1, L, 1, D/2, 2, 2] rotations, a head_dim that is
        not a power of 2, q / k of different layouts."""
        if qb.compiling():
            return None
        attn = self.self_attn
        b, s, w = q.shape
        n, d = attn.num_heads, attn.head_dim
        pe = qb.rope_rows(freqs, b, s, d, q.device)
        weights = qb.qk_norm_weights(attn.norm_q, attn.norm_k, q, w)
        if (pe is None or weights is None or n * d != w or k.shape != q.shape or k.stride() != q.stride()
                or q.stride(-1) != 1):
            return None
        wq, eq, wk, ek = weights
        oq, ok = (torch.empty((b, s, n, d), dtype=q.dtype, device=q.device) for _ in range(2))
        qb.call(qb.kernels().rope.qk_rmsnorm_rope_rows, q, k, n, wq, wk, eq, ek, pe, oq.transpose(1, 2), ok.transpose(1, 2))
        return oq, ok

    # ---------------------------------------------------------------- residual tails (one kernel each)
    @staticmethod
    def _tail_fusable(x, *ts) -> bool:
        """Whether the residual-tail kernels run: ``qb.residual_operands`` (else torch, e.g. for a mixed dtype torch
        would promote)."""
        return qb.residual_operands(x, *ts)

    def _add(self, x, y, gate):
        """``torch.addcmul(x, y, gate)``: one kernel where :meth:`_tail_fusable`, else torch."""
        if not self._tail_fusable(x, y, gate):
            return torch.addcmul(x, y, gate)
        b, l, k = x.shape
        return qb.call(qb.kernels().residual.residual_add, x.reshape(-1, k), y.reshape(-1, k), gate,
                       _tokens_per_row(gate, l)).view(b, l, k)

    def _add_norm3(self, x, y, gate):
        """(x', norm3(x')) with x' = addcmul(x, y, gate): one kernel for both when norm3 is a LayerNorm over the
        width (its affine from cached device copies) or Identity; else torch."""
        norm = self.norm3
        if isinstance(norm, nn.Identity):
            x = self._add(x, y, gate)
            return x, x
        w = qb.norm_weight(norm, x) if isinstance(norm, nn.LayerNorm) else None
        if (w is None or tuple(norm.normalized_shape) != (x.shape[-1],) or not self._tail_fusable(x, y, gate)):
            x = torch.addcmul(x, y, gate)
            return x, norm(x)
        b, l, k = x.shape
        r, n = qb.call(qb.kernels().residual.residual_add_layernorm, x.reshape(-1, k), y.reshape(-1, k), gate,
                        _tokens_per_row(gate, l), float(norm.eps), w if norm.weight is not None else None,
                        qb.norm_bias(norm, x))
        return r.view(b, l, k), n.view(b, l, k)

    def _add_ffn(self, x, c, e3, e4):
        """(x', ffn(addcmul(e3, norm2(x'), 1 + e4))) with x' = x + c; x' and ffn.0's int8 input from one kernel
        where it applies (else torch for the sum, then :meth:`_ffn`)."""
        ffn0 = self.ffn[0]
        if not (qb.fusable(ffn0) and self._tail_fusable(x, c, e3, e4)):
            x = x + c
            return x, self._ffn(x, e3, e4)
        b, l, k = x.shape
        r, a_q, a_s = qb.call(qb.kernels().residual.residual_add_layernorm_modulate_quantize, x.reshape(-1, k), c.reshape(-1, k),
                               None, _tokens_per_row(e4, l), float(self.norm2.eps), e4, e3,
                               qb.inv_smooth_of(ffn0, x.device))
        h = qb.gemm(a_q, a_s, ffn0, qb.promote(x, e4, e3)).view(b, l, -1)
        return r.view(b, l, k), self._ffn_hidden(h)

    def _ffn(self, x, e3, e4):
        """``ffn[2](gelu_tanh(ffn[0](addcmul(e3, norm2(x), 1 + e4))))``: two kernels feeding the int8 GEMMs."""
        (h,) = self._mod_linears([self.ffn[0]], self.norm2, x, e3, e4)
        return self._ffn_hidden(h)

    def _ffn_hidden(self, h):
        """``ffn[2](gelu_tanh(h))``: the GELU + quantization kernel feeding ffn.2's int8 GEMM, or torch."""
        ffn = self.ffn
        if not qb.act_fusable(ffn[2]):
            return ffn[2](ffn[1](h))
        a_q, a_s = qb.cat_gelu_quant(None, h.reshape(-1, h.shape[-1]), qb.inv_smooth_of(ffn[2], h.device),
                                     qb.rotation(ffn[2]))
        return qb.gemm(a_q, a_s, ffn[2], h.dtype).view(*h.shape[:-1], -1)

    # -------------------------------------------------------------------------------- forward
    def forward(self, x, e, freqs, context, context_img_len=257, transformer_options={}, **kwargs):
        if (kwargs or _patched(transformer_options) or not isinstance(e, torch.Tensor)
                or not (e.ndim == 3 or (e.ndim == 4 and (e.shape[1] == 1 or e.shape[0] == x.shape[0])))):
            return self.fn.block_forward(self, x, e, freqs, context, context_img_len=context_img_len,
                                         transformer_options=transformer_options, **kwargs)
        # as ComfyUI: the block's modulation cast to x's dtype + e (fp32 when e is); chunks [B, 1, C], or [B, T, C]
        # per-token (Wan 2.2 5B: one row per frame, repeat_e makes them [B, L, C])
        mod = self.fn.cast_to(self.modulation, dtype=x.dtype, device=x.device)
        if e.ndim < 4:   # [B, 6, C] (VACE, camera, ... models)
            e = (mod + e).chunk(6, dim=1)
        else:            # [B, 1 | T, 6, C] (WanModel)
            e = (mod.unsqueeze(0) + e).unbind(2)
        x = x.contiguous()
        re = self.fn.repeat_e
        y = self._self_attention(x, re(e[0], x), re(e[1], x), freqs, transformer_options)
        x, n3 = self._add_norm3(x, y, re(e[2], x))   # x = addcmul(x, y, e[2]); norm3(x)
        del y
        c = self.cross_attn(n3, context, context_img_len=context_img_len, transformer_options=transformer_options)
        del n3
        x, y = self._add_ffn(x, c, re(e[3], x), re(e[4], x))   # x = x + c; the FFN on norm2(x) * (1 + e4) + e3
        del c
        return self._add(x, y, re(e[5], x))   # addcmul(x, y, e[5])
