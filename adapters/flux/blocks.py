"""Fused Flux.1 blocks: ``DoubleStreamBlock`` and ``SingleStreamBlock`` of ComfyUI's
``comfy/ldm/flux/layers.py`` on INT8 layers, with the activation quantization folded into the kernels that produce
each GEMM input (``kernel/{norm,gelu,residual,rope}.py``):

* ``LayerNorm(x) * (1 + scale) + shift`` + quantization (``layernorm_modulate_quantize``) feeds ``img_attn.qkv`` /
  ``txt_attn.qkv``, ``img_mlp.0`` / ``txt_mlp.0`` and the single block's ``linear1``;
* ``gelu_tanh`` + quantization (``gelu_tanh_quantize``) feeds ``img_mlp.2`` / ``txt_mlp.2``;
* ``cat(attn, gelu_tanh(mlp))`` + quantization (``concat_gelu_quantize``, one absmax over both parts, the
  concatenation never written) feeds the single block's ``linear2``;
* QK RMSNorm + RoPE + the txt / img concatenation (``qk_norm_rope``);
* the residual tails ``x += y * gate`` (in place, the product rounded first as torch's two ops) in ``residual_add``,
  and the double block's first one together with ``img_norm2`` / ``txt_norm2`` · modulation + quantization for
  ``mlp.0`` (``residual_add_layernorm_modulate_quantize``); torch's ops where the kernels do not apply.

Pure torch + ``kernel``; no ComfyUI import and no architecture recognition: the adapter (``__init__.py``) decides
which blocks are Flux.1 blocks and hands in what the forwards call from ComfyUI (:class:`FluxFunctions`: Flux's
``attention``, which applies RoPE and calls ``optimized_attention`` with ``transformer_options``, and the blocks'
own ``forward`` functions).

A fused block is a structural twin of the original: the same child names (``img_mod``, ``img_norm1``,
``img_attn.qkv`` ...) and plain attributes, its containers rebuilt (``quant.blocks.with_layers``) around the INT8 layers
and sharing every other module (norms, QKNorm, GELU) with the original, which stays untouched. The fused forward
runs when a call is what it implements (Flux.1: the block's own modulation, no ``modulation_dims``, no
``attn1_patch`` / ``attn1_output_patch``); any other call runs the running ComfyUI's own ``forward`` on the twin,
i.e. the per-linear INT8 path exactly. A layer that is not INT8 on fused_triton (kept float, another backend) takes
its input from torch. Numerics equal the per-linear INT8 path within rounding (see kernel/rowtile.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from ..base import Int8Linear, blocks as qb


@dataclasses.dataclass(frozen=True)
class FluxFunctions:
    """What the blocks call from ComfyUI (the adapter imports them; tests may pass stand-ins)."""
    attention: Callable       # comfy.ldm.flux.math.attention(q, k, v, pe, mask=None, transformer_options={})
    double_forward: Callable  # comfy.ldm.flux.layers.DoubleStreamBlock.forward: the per-linear path
    single_forward: Callable  # comfy.ldm.flux.layers.SingleStreamBlock.forward
    # the optimized_attention that ``attention`` calls after RoPE (q, k, v, heads, skip_reshape=, mask=,
    # transformer_options=), and whether ComfyUI is training (then its RoPE is torch's, not comfy-kitchen's):
    # for the fused QK norm + RoPE (``qk_norm_rope``), which applies them itself
    optimized_attention: Callable | None = None
    in_training: Callable[[], bool] | None = None


class _FusedFluxBlock(qb.FetchedBlock):
    """The twin of ``block`` (named ``prefix``) on ``layers`` ({name relative to the diffusion model:
    Int8Linear}); ``covers``: the names of ``layers`` under the block."""

    def __init__(self, block: nn.Module, prefix: str, layers: dict, fn: FluxFunctions):
        super().__init__()
        for k, v in block.__dict__.items():
            if not k.startswith("_"):
                self.__dict__[k] = v
        for k, m in block._modules.items():
            self._modules[k] = qb.with_layers(m, f"{prefix}.{k}", layers) if m is not None else None
        self.fn = fn
        self.covers = tuple(n for n in layers if n.startswith(f"{prefix}."))
        qb.kernels().register_ops()

    def int8_layers(self) -> dict[str, Int8Linear]:
        return {n: m for n, m in self.named_modules() if isinstance(m, Int8Linear)}

    def extra_repr(self) -> str:
        return f"covers={len(self.covers)} linears"

    def _mod_linear(self, layer: nn.Module, norm: nn.Module, x: torch.Tensor, mod, rows: bool = False):
        """``layer(apply_mod(norm(x), 1 + mod.scale, mod.shift))`` (x [B, L, K]): one kernel feeding the int8 GEMM
        when ``layer`` is INT8 on fused_triton, else torch as ComfyUI runs it. ``rows``: the int8 path's output
        as the GEMM gives it, [B * L, N]."""
        if not qb.norm_fusable(layer):
            return layer(torch.addcmul(mod.shift, norm(x), 1 + mod.scale))
        b, l, k = x.shape
        a_q, a_s = qb.ln_mod_quant(x.reshape(-1, k), mod.scale, mod.shift, l, qb.inv_smooth_of(layer, x.device),
                                 float(norm.eps), qb.rotation(layer))
        y = qb.gemm(a_q, a_s, layer, qb.promote(x, mod.scale, mod.shift))
        return y if rows else y.view(b, l, -1)

    def _attention(self, streams, pe, attn_mask, transformer_options) -> torch.Tensor:
        """Attention over the streams' tokens, in order (txt first): ``streams`` = [(QKNorm, qkv [B, L, 3 * H * D])].
        One kernel per stream applies the QK norm and RoPE and writes q / k / v straight into the concatenated layout,
        then ComfyUI's ``optimized_attention``; for a call that kernel does not cover, ComfyUI's ops: split,
        ``QKNorm``, ``torch.cat``, Flux's ``attention`` (RoPE inside)."""
        qkv = self._fused_qk_rope(streams, pe)
        if qkv is not None:
            q, k, v = qkv
            return self.fn.optimized_attention(q, k, v, q.shape[1], skip_reshape=True, mask=attn_mask,
                                               transformer_options=transformer_options)
        qs, ks, vs = [], [], []
        for norm, x in streams:
            q, k, v = x.view(x.shape[0], x.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
            q, k = norm(q, k, v)
            qs.append(q)
            ks.append(k)
            vs.append(v)
        if len(streams) == 1:
            q, k, v = qs[0], ks[0], vs[0]
        else:
            q, k, v = torch.cat(qs, dim=2), torch.cat(ks, dim=2), torch.cat(vs, dim=2)
        del qs, ks, vs
        return self.fn.attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)

    def _fused_qk_rope(self, streams, pe):
        """(q, k, v) [B, H, L_all, D] from one ``qk_norm_rope`` launch per stream, or None where it does not apply:
        torch.compile tracing, training, ``pe`` not Flux's fp32 [B | 1, 1, L_all, D / 2, 2, 2], norms with weight
        functions (lowvram LoRA)."""
        if (self.fn.optimized_attention is None or qb.compiling()
                or (self.fn.in_training is not None and self.fn.in_training())):
            return None
        x0 = streams[0][1]
        b, h = x0.shape[0], self.num_heads
        d = x0.shape[-1] // (3 * h)
        total = sum(x.shape[1] for _, x in streams)
        if (not isinstance(pe, torch.Tensor) or pe.dim() != 6 or pe.dtype != torch.float32 or pe.shape[1] != 1
                or pe.shape[0] not in (1, b) or pe.shape[2] != total or tuple(pe.shape[3:]) != (d // 2, 2, 2)
                or d < 2 or d & (d - 1) or pe.device != x0.device):
            return None
        ws = []
        for norm, x in streams:
            if x.shape[0] != b or x.shape[-1] != 3 * h * d or x.dtype != x0.dtype:
                return None
            (wq, eq), (wk, ek) = qb.rms_weight(norm.query_norm, x), qb.rms_weight(norm.key_norm, x)
            if wq is None or wk is None:
                return None
            ws.append((wq, wk, eq, ek))
        # [B, L_all, H, D] buffers seen as [B, H, L_all, D]: SDPA (cuDNN, flash) then keeps that layout and the
        # attention output's transpose(1, 2).reshape in ComfyUI is a view, not a copy
        q, k, v = (torch.empty((b, total, h, d), dtype=x0.dtype, device=x0.device).transpose(1, 2) for _ in range(3))
        row = 0
        for (norm, x), (wq, wk, eq, ek) in zip(streams, ws):
            qb.call(qb.kernels().rope.qk_norm_rope, x, h, wq, wk, eq, ek, pe, q, k, v, row)
            row += x.shape[1]
        return q, k, v

    @staticmethod
    def _gelu_linear(layer: nn.Module, act: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """``layer(act(h))`` with act the tanh GELU: one kernel feeding the int8 GEMM, or torch. An [M, F] ``h``
        gives [M, N] (no reshapes)."""
        if not qb.act_fusable(layer):
            return layer(act(h))
        flat = h.dim() == 2
        a_q, a_s = qb.cat_gelu_quant(None, h if flat else h.reshape(-1, h.shape[-1]), qb.inv_smooth_of(layer, h.device),
                                     qb.rotation(layer))
        y = qb.gemm(a_q, a_s, layer, h.dtype)
        return y if flat else y.view(*h.shape[:-1], -1)


class FusedFluxDoubleBlock(_FusedFluxBlock):
    """Flux.1's ``DoubleStreamBlock`` (its own img_mod / txt_mod, GELU MLPs, txt tokens first in attention)."""

    def modulations(self, vec):
        """((img_mod1, img_mod2), (txt_mod1, txt_mod2)) of ``vec``, or None for ComfyUI's own forward: Flux.1's
        img_mod / txt_mod of the vector (subclasses take modulation passed in)."""
        return (self.img_mod(vec), self.txt_mod(vec)) if isinstance(vec, torch.Tensor) else None

    def forward(self, img, txt, vec, pe, attn_mask=None, modulation_dims_img=None, modulation_dims_txt=None,
                transformer_options={}):
        mods = self.modulations(vec)
        if (mods is None or modulation_dims_img is not None or modulation_dims_txt is not None
                or qb.attn_patches(transformer_options)):
            return self.fn.double_forward(self, img, txt, vec, pe, attn_mask=attn_mask,
                                          modulation_dims_img=modulation_dims_img,
                                          modulation_dims_txt=modulation_dims_txt,
                                          transformer_options=transformer_options)
        (img_mod1, img_mod2), (txt_mod1, txt_mod2) = mods
        img = img.contiguous()   # the tails write img in place (Chroma Radiance's img_in is a transposed conv)
        img_qkv = self._mod_linear(self.img_attn.qkv, self.img_norm1, img, img_mod1)
        txt_qkv = self._mod_linear(self.txt_attn.qkv, self.txt_norm1, txt, txt_mod1)
        attn = self._attention([(self.txt_attn.norm, txt_qkv), (self.img_attn.norm, img_qkv)], pe, attn_mask,
                               transformer_options)
        del img_qkv, txt_qkv
        # each stream's rows: with a batch > 1 not one stride apart, so the copy the projection's input needs is made
        # here, and the projection runs its prepared launches (a strided input would take the checked path each call)
        txt_attn, img_attn = attn[:, :txt.shape[1]].contiguous(), attn[:, txt.shape[1]:].contiguous()
        del attn

        img = self._tails(img, qb.linear(self.img_attn.proj, img_attn), img_mod1, self.img_mlp, self.img_norm2,
                          img_mod2)
        del img_attn
        txt = self._tails(txt, qb.linear(self.txt_attn.proj, txt_attn), txt_mod1, self.txt_mlp, self.txt_norm2,
                          txt_mod2)
        del txt_attn

        if txt.dtype == torch.float16:
            txt = torch.nan_to_num(txt, nan=0.0, posinf=65504, neginf=-65504)
        return img, txt

    def _tails(self, x, proj, mod1, mlp: nn.Sequential, norm: nn.Module, mod2) -> torch.Tensor:
        """``x += proj * mod1.gate; x += mlp(apply_mod(norm(x), mod2)) * mod2.gate`` (in place, as ComfyUI). The
        first sum and mlp.0's int8 input come from one kernel and the second sum from another where
        :func:`_residual_fusable`; else torch's ops. The MLP's hidden and output stay [B * L, *] between the
        kernels."""
        lin0, act, lin2 = mlp
        if not (qb.fusable(lin0) and getattr(norm, "weight", None) is None and proj.shape == x.shape
                and _residual_fusable(x, proj, mod1.gate, mod2.scale, mod2.shift)):
            x += proj * mod1.gate
            x += self._gelu_linear(lin2, act, self._mod_linear(lin0, norm, x, mod2)) * mod2.gate
            return x
        l, k = x.shape[1:]
        x2 = x.view(-1, k)
        _, a_q, a_s = qb.call(  # round_product, out=x2 (in place)
            qb.kernels().residual.residual_add_layernorm_modulate_quantize, x2, proj.reshape(-1, k), mod1.gate, l,
            float(norm.eps), mod2.scale, mod2.shift, qb.inv_smooth_of(lin0, x.device), True, x2)
        h = qb.gemm(a_q, a_s, lin0, qb.promote(x, mod2.scale, mod2.shift))
        return residual_add(x, self._gelu_linear(lin2, act, h), mod2.gate, x2)


def _residual_fusable(x, *ts) -> bool:
    """Whether Flux's residual tails run in the residual kernels on these operands: x contiguous (written in
    place), ``qb.residual_operands``."""
    return x.is_contiguous() and qb.residual_operands(x, *ts)


def residual_add(x, y, gate, x2=None):
    """``x += y * gate`` (x [B, L, K] in place, two roundings as torch's two ops): one kernel where it applies.
    ``y``: x's shape, or [B * L, K] rows (a GEMM's output); ``x2``: ``x.view(-1, K)`` when the caller has it."""
    b, l, k = x.shape
    if y.dim() == 2:  # what qb.residual_operands asks of an operand of x's shape, asked of its rows
        rows = (y.shape[0] == b * l and y.shape[1] == k and y.dtype == x.dtype and y.device == x.device
                and _residual_fusable(x, gate))
        if not rows:
            x += y.view(x.shape) * gate
            return x
    elif y.shape != x.shape or not _residual_fusable(x, y, gate):
        x += y * gate
        return x
    else:
        y = y.reshape(-1, k)
    if x2 is None:
        x2 = x.view(-1, k)
    qb.call(qb.kernels().residual.residual_add, x2, y, gate, l, True, x2)  # round_product, out=x2 (in place)
    return x


class FusedFluxSingleBlock(_FusedFluxBlock):
    """Flux.1's ``SingleStreamBlock`` (its own modulation, GELU MLP): linear1 from the LayerNorm kernel, linear2
    from the concatenation kernel."""

    def modulation_of(self, vec):
        """The block's ModulationOut of ``vec``, or None for ComfyUI's own forward (subclasses take it passed in)."""
        return self.modulation(vec)[0] if isinstance(vec, torch.Tensor) else None

    def forward(self, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}):
        mod = self.modulation_of(vec)
        if mod is None or modulation_dims is not None or qb.attn_patches(transformer_options):
            return self.fn.single_forward(self, x, vec, pe, attn_mask=attn_mask, modulation_dims=modulation_dims,
                                          transformer_options=transformer_options)
        h = self._mod_linear(self.linear1, self.pre_norm, x, mod, rows=True)  # [B * L, 3K + F] (or [B, L, *])
        qkv, mlp = torch.split(h, [3 * self.hidden_size, self.mlp_hidden_dim_first], dim=-1)
        attn = self._attention([(self.norm, qkv.view(*x.shape[:2], -1) if qkv.dim() == 2 else qkv)], pe, attn_mask,
                               transformer_options)
        del qkv
        if (type(self.mlp_act) is nn.GELU and qb.act_fusable(self.linear2, attn.shape[-1])
                and attn.dtype == mlp.dtype):
            a_q, a_s = qb.cat_gelu_quant(attn.reshape(-1, attn.shape[-1]),
                                         mlp if mlp.dim() == 2 else mlp.reshape(-1, mlp.shape[-1]),
                                         qb.inv_smooth_of(self.linear2, x.device), qb.rotation(self.linear2))
            output = qb.gemm(a_q, a_s, self.linear2, attn.dtype)  # [B * L, K]: residual_add takes the rows
        else:  # Flux.2's SiLU-gated MLP: ``cat(attn, silu(a) * b)`` by torch, quantized by linear2
            mlp = mlp.view(*attn.shape[:2], -1) if mlp.dim() == 2 else mlp
            output = qb.linear(self.linear2, torch.cat((attn, self.mlp_act(mlp)), 2))
        x = residual_add(x, output, mod.gate)
        if x.dtype == torch.float16:
            x = torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
        return x
