"""Fused Flux.1 blocks (issue 13): ``DoubleStreamBlock`` and ``SingleStreamBlock`` of ComfyUI's
``comfy/ldm/flux/layers.py`` on INT8 layers, with the activation quantization folded into the kernels that produce
each GEMM input (``kernel/fused.py``):

* ``LayerNorm(x) * (1 + scale) + shift`` + quantization (``layernorm_modulate_quantize``) feeds ``img_attn.qkv`` /
  ``txt_attn.qkv``, ``img_mlp.0`` / ``txt_mlp.0`` and the single block's ``linear1``;
* ``gelu_tanh`` + quantization (``gelu_tanh_quantize``) feeds ``img_mlp.2`` / ``txt_mlp.2``;
* ``cat(attn, gelu_tanh(mlp))`` + quantization (``concat_gelu_quantize``, one absmax over both parts, the
  concatenation never written) feeds the single block's ``linear2``;
* QK RMSNorm + RoPE + the txt / img concatenation (``qk_norm_rope``, ``INT8_FUSED_QK_ROPE``, on by default);
* the residual tails ``x += y * gate`` (in place, the product rounded first as torch's two ops) in ``residual_add``,
  and the double block's first one together with ``img_norm2`` / ``txt_norm2`` · modulation + quantization for
  ``mlp.0`` (``residual_add_layernorm_modulate_quantize``); ``INT8_FUSED_FLUX_TAILS=0``: torch's ops.

Pure torch + ``kernel``; no ComfyUI import and no architecture recognition: ``adapters/flux.py`` decides which
blocks are Flux.1 blocks and hands in what the forwards call from ComfyUI (:class:`FluxFunctions`: Flux's
``attention``, which applies RoPE and calls ``optimized_attention`` with ``transformer_options``, and the blocks'
own ``forward`` functions).

A fused block is a structural twin of the original: the same child names (``img_mod``, ``img_norm1``,
``img_attn.qkv`` ...) and plain attributes, its containers rebuilt (:func:`with_layers`) around the INT8 layers
and sharing every other module (norms, QKNorm, GELU) with the original, which stays untouched. The fused forward
runs when a call is what it implements (Flux.1: the block's own modulation, no ``modulation_dims``, no
``attn1_patch`` / ``attn1_output_patch``); any other call runs the running ComfyUI's own ``forward`` on the twin,
i.e. the per-linear INT8 path exactly. A layer that is not INT8 on fused_triton (kept float, another backend) takes
its input from torch. Numerics equal the per-linear INT8 path within rounding (see kernel/fused.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from . import fused as qf
from .linear import Int8Linear


@dataclasses.dataclass(frozen=True)
class FluxFunctions:
    """What the blocks call from ComfyUI (the adapter imports them; tests may pass stand-ins)."""
    attention: Callable       # comfy.ldm.flux.math.attention(q, k, v, pe, mask=None, transformer_options={})
    double_forward: Callable  # comfy.ldm.flux.layers.DoubleStreamBlock.forward: the per-linear path
    single_forward: Callable  # comfy.ldm.flux.layers.SingleStreamBlock.forward
    # the optimized_attention that ``attention`` calls after RoPE (q, k, v, heads, skip_reshape=, mask=,
    # transformer_options=), and whether ComfyUI is training (then its RoPE is torch's, not comfy-kitchen's):
    # for INT8_FUSED_QK_ROPE, which applies the QK norm and RoPE itself
    optimized_attention: Callable | None = None
    in_training: Callable[[], bool] | None = None


# ------------------------------------------------------------------------------------ kernels (eager / compile)
def _ln_mod_quant(x2, scale, shift, tokens, inv_smooth, eps):
    if qf._compiling():
        return torch.ops.int8_fused.ln_mod_quant(x2, scale, shift, tokens, inv_smooth, eps)
    return qf._call(qf._kf().layernorm_modulate_quantize, x2, scale, shift, tokens, inv_smooth, eps)


def _cat_gelu_quant(a2, h2, inv_smooth):
    """(int8, fp32) of ``cat(a2, gelu_tanh(h2))`` (``a2`` None: ``gelu_tanh(h2)`` alone)."""
    if qf._compiling():
        return torch.ops.int8_fused.cat_gelu_quant(a2, h2, inv_smooth)
    if a2 is None:
        return qf._call(qf._kf().gelu_tanh_quantize, h2, inv_smooth)
    return qf._call(qf._kf().concat_gelu_quantize, a2, h2, inv_smooth)


def _promote(*ts: torch.Tensor) -> torch.dtype:
    dt = ts[0].dtype
    for t in ts[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return dt


def _rms_weight(norm: nn.Module, x: torch.Tensor):
    """(weight in x's dtype on x's device, eps) of a QKNorm's RMSNorm as its forward applies them: ComfyUI's
    ``ops.RMSNorm`` (0.33.0: ``weight``, ``eps``) or 0.3.75's Flux ``RMSNorm`` (``scale``, eps 1e-6 in its
    forward); (None, None) for anything else (weight functions included): the caller runs the module."""
    if "weight" in norm._parameters:
        return qf.norm_weight(norm, x), qf._norm_eps(norm, x)
    s = norm._parameters.get("scale")
    if s is None or getattr(norm, "weight_function", None):
        return None, None
    return (s if s.device == x.device and s.dtype == x.dtype else s.detach().to(x.device, x.dtype)), 1e-6


def _qk_norm_weights(norm_q: nn.Module, norm_k: nn.Module, x: torch.Tensor, width: int):
    """(wq, eps_q, wk, eps_k) of two RMSNorms with a weight over ``width`` (ComfyUI's ``ops.RMSNorm``), as their
    forwards apply them; None when either is something else (Identity: no QK norm) or carries weight functions."""
    for nm in (norm_q, norm_k):
        if "weight" not in nm._parameters or tuple(getattr(nm, "normalized_shape", ())) != (width,):
            return None
    (wq, eq), (wk, ek) = _rms_weight(norm_q, x), _rms_weight(norm_k, x)
    return None if wq is None or wk is None else (wq, eq, wk, ek)


def _attn_patches(transformer_options) -> bool:
    """Whether the call carries attention patches (applied by current ComfyUI's block forwards, ignored by
    0.3.75's): such calls run the block's own forward."""
    p = transformer_options.get("patches") if isinstance(transformer_options, dict) else None
    return bool(p) and ("attn1_patch" in p or "attn1_output_patch" in p)


# ------------------------------------------------------------------------------------ structural twins
def rebind(module: nn.Module, children: dict[str, nn.Module]) -> nn.Module:
    """A new instance of ``module``'s class with its plain attributes, parameters and buffers (shared tensors) and
    its child modules, the ones named in ``children`` replaced. ``module`` itself is not modified."""
    new = type(module).__new__(type(module))
    nn.Module.__init__(new)
    for k, v in module.__dict__.items():
        if not k.startswith("_"):
            new.__dict__[k] = v
    for k, p in module._parameters.items():
        new._parameters[k] = p
    for k, b in module._buffers.items():
        new._buffers[k] = b
    new._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    for k, m in module._modules.items():
        new._modules[k] = children.get(k, m)
    return new


def with_layers(module: nn.Module, prefix: str, layers: dict) -> nn.Module:
    """``module`` (named ``prefix``) with each descendant named in ``layers`` replaced by that layer; ``module``
    itself when ``layers`` names none of them, else a :func:`rebind` copy (recursively)."""
    if prefix in layers:
        return layers[prefix]
    p = f"{prefix}."
    if not any(n.startswith(p) for n in layers):
        return module
    return rebind(module, {k: with_layers(m, p + k, layers) for k, m in module._modules.items() if m is not None})


class _FusedFluxBlock(qf.FetchedBlock):
    """The twin of ``block`` (named ``prefix``) on ``layers`` ({name relative to the diffusion model:
    Int8Linear}); ``covers``: the names of ``layers`` under the block."""

    def __init__(self, block: nn.Module, prefix: str, layers: dict, fn: FluxFunctions):
        super().__init__()
        for k, v in block.__dict__.items():
            if not k.startswith("_"):
                self.__dict__[k] = v
        for k, m in block._modules.items():
            self._modules[k] = with_layers(m, f"{prefix}.{k}", layers) if m is not None else None
        self.fn = fn
        self.covers = tuple(n for n in layers if n.startswith(f"{prefix}."))
        qf._kf().register_ops()

    def int8_layers(self) -> dict[str, Int8Linear]:
        return {n: m for n, m in self.named_modules() if isinstance(m, Int8Linear)}

    def extra_repr(self) -> str:
        return f"covers={len(self.covers)} linears"

    def _mod_linear(self, layer: nn.Module, norm: nn.Module, x: torch.Tensor, mod) -> torch.Tensor:
        """``layer(apply_mod(norm(x), 1 + mod.scale, mod.shift))`` (x [B, L, K]): one kernel feeding the int8 GEMM
        when ``layer`` is INT8 on fused_triton, else torch as ComfyUI runs it."""
        if not qf.fusable(layer):
            return layer(torch.addcmul(mod.shift, norm(x), 1 + mod.scale))
        b, l, k = x.shape
        a_q, a_s = _ln_mod_quant(x.reshape(-1, k), mod.scale, mod.shift, l, qf.inv_smooth_of(layer, x.device),
                                 float(norm.eps))
        return qf.gemm(a_q, a_s, layer, _promote(x, mod.scale, mod.shift)).view(b, l, -1)

    def _attention(self, streams, pe, attn_mask, transformer_options) -> torch.Tensor:
        """Attention over the streams' tokens, in order (txt first): ``streams`` = [(QKNorm, qkv [B, L, 3 * H * D])].
        With INT8_FUSED_QK_ROPE (default ``all``) one kernel per stream applies the QK norm and RoPE and writes q / k / v straight
        into the concatenated layout, then ComfyUI's ``optimized_attention``; otherwise (or for a call that kernel
        does not cover) ComfyUI's ops: split, ``QKNorm``, ``torch.cat``, Flux's ``attention`` (RoPE inside)."""
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
        switch off, torch.compile tracing, training, ``pe`` not Flux's fp32 [B | 1, 1, L_all, D / 2, 2, 2],
        norms with weight functions (lowvram LoRA)."""
        if (not qf.qk_rope_on("flux") or self.fn.optimized_attention is None or qf._compiling()
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
            (wq, eq), (wk, ek) = _rms_weight(norm.query_norm, x), _rms_weight(norm.key_norm, x)
            if wq is None or wk is None:
                return None
            ws.append((wq, wk, eq, ek))
        # [B, L_all, H, D] buffers seen as [B, H, L_all, D]: SDPA (cuDNN, flash) then keeps that layout and the
        # attention output's transpose(1, 2).reshape in ComfyUI is a view, not a copy
        q, k, v = (torch.empty((b, total, h, d), dtype=x0.dtype, device=x0.device).transpose(1, 2) for _ in range(3))
        row = 0
        for (norm, x), (wq, wk, eq, ek) in zip(streams, ws):
            qf._call(qf._kf().qk_norm_rope, x, h, wq, wk, eq, ek, pe, q, k, v, row)
            row += x.shape[1]
        return q, k, v

    @staticmethod
    def _gelu_linear(layer: nn.Module, act: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """``layer(act(h))`` with act the tanh GELU: one kernel feeding the int8 GEMM, or torch."""
        if not qf.fusable(layer):
            return layer(act(h))
        a_q, a_s = _cat_gelu_quant(None, h.reshape(-1, h.shape[-1]), qf.inv_smooth_of(layer, h.device))
        return qf.gemm(a_q, a_s, layer, h.dtype).view(*h.shape[:-1], -1)


class FusedFluxDoubleBlock(_FusedFluxBlock):
    """Flux.1's ``DoubleStreamBlock`` (its own img_mod / txt_mod, GELU MLPs, txt tokens first in attention)."""

    def forward(self, img, txt, vec, pe, attn_mask=None, modulation_dims_img=None, modulation_dims_txt=None,
                transformer_options={}):
        if (modulation_dims_img is not None or modulation_dims_txt is not None or _attn_patches(transformer_options)
                or not isinstance(vec, torch.Tensor)):
            return self.fn.double_forward(self, img, txt, vec, pe, attn_mask=attn_mask,
                                          modulation_dims_img=modulation_dims_img,
                                          modulation_dims_txt=modulation_dims_txt,
                                          transformer_options=transformer_options)
        img_mod1, img_mod2 = self.img_mod(vec)
        txt_mod1, txt_mod2 = self.txt_mod(vec)
        img_qkv = self._mod_linear(self.img_attn.qkv, self.img_norm1, img, img_mod1)
        txt_qkv = self._mod_linear(self.txt_attn.qkv, self.txt_norm1, txt, txt_mod1)
        attn = self._attention([(self.txt_attn.norm, txt_qkv), (self.img_attn.norm, img_qkv)], pe, attn_mask,
                               transformer_options)
        del img_qkv, txt_qkv
        txt_attn, img_attn = attn[:, :txt.shape[1]], attn[:, txt.shape[1]:]

        img = self._tails(img, qf.linear(self.img_attn.proj, img_attn), img_mod1, self.img_mlp, self.img_norm2,
                          img_mod2)
        del img_attn
        txt = self._tails(txt, qf.linear(self.txt_attn.proj, txt_attn), txt_mod1, self.txt_mlp, self.txt_norm2,
                          txt_mod2)
        del txt_attn

        if txt.dtype == torch.float16:
            txt = torch.nan_to_num(txt, nan=0.0, posinf=65504, neginf=-65504)
        return img, txt

    def _mlp(self, mlp: nn.Sequential, norm: nn.Module, x: torch.Tensor, mod) -> torch.Tensor:
        return self._gelu_linear(mlp[2], mlp[1], self._mod_linear(mlp[0], norm, x, mod))

    def _tails(self, x, proj, mod1, mlp: nn.Sequential, norm: nn.Module, mod2) -> torch.Tensor:
        """``x += proj * mod1.gate; x += mlp(apply_mod(norm(x), mod2)) * mod2.gate`` (in place, as ComfyUI). With
        INT8_FUSED_FLUX_TAILS the first sum and mlp.0's int8 input come from one kernel and the second sum from
        another (:func:`_residual_fusable`); else torch's ops."""
        if not (qf.fusable(mlp[0]) and getattr(norm, "weight", None) is None and proj.shape == x.shape
                and _residual_fusable(x, proj, mod1.gate, mod2.scale, mod2.shift)):
            x += proj * mod1.gate
            x += self._mlp(mlp, norm, x, mod2) * mod2.gate
            return x
        b, l, k = x.shape
        x2 = x.view(-1, k)
        _, a_q, a_s = qf._call(  # round_product, out=x2 (in place)
            qf._kf().residual_add_layernorm_modulate_quantize, x2, proj.reshape(-1, k), mod1.gate, l, float(norm.eps),
            mod2.scale, mod2.shift, qf.inv_smooth_of(mlp[0], x.device), True, x2)
        h = qf.gemm(a_q, a_s, mlp[0], _promote(x, mod2.scale, mod2.shift)).view(b, l, -1)
        return _residual_add(x, self._gelu_linear(mlp[2], mlp[1], h), mod2.gate)


def _residual_fusable(x, *ts) -> bool:
    """Whether INT8_FUSED_FLUX_TAILS runs Flux's residual tails in the residual kernels on these operands: the
    switch on, x contiguous (written in place), ``qf.residual_operands``."""
    return bool(qf.config.get("INT8_FUSED_FLUX_TAILS")) and x.is_contiguous() and qf.residual_operands(x, *ts)


def _residual_add(x, y, gate):
    """``x += y * gate`` (in place, two roundings as torch's two ops): one kernel where it applies."""
    if y.shape != x.shape or not _residual_fusable(x, y, gate):
        x += y * gate
        return x
    b, l, k = x.shape
    x2 = x.view(-1, k)
    qf._call(qf._kf().residual_add, x2, y.reshape(-1, k), gate, l, True, x2)  # round_product, out=x2 (in place)
    return x


class FusedFluxSingleBlock(_FusedFluxBlock):
    """Flux.1's ``SingleStreamBlock`` (its own modulation, GELU MLP): linear1 from the LayerNorm kernel, linear2
    from the concatenation kernel."""

    def forward(self, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}):
        if modulation_dims is not None or _attn_patches(transformer_options) or not isinstance(vec, torch.Tensor):
            return self.fn.single_forward(self, x, vec, pe, attn_mask=attn_mask, modulation_dims=modulation_dims,
                                          transformer_options=transformer_options)
        mod, _ = self.modulation(vec)
        h = self._mod_linear(self.linear1, self.pre_norm, x, mod)
        qkv, mlp = torch.split(h, [3 * self.hidden_size, self.mlp_hidden_dim_first], dim=-1)
        attn = self._attention([(self.norm, qkv)], pe, attn_mask, transformer_options)
        del qkv
        if qf.fusable(self.linear2) and attn.dtype == mlp.dtype:
            a_q, a_s = _cat_gelu_quant(attn.reshape(-1, attn.shape[-1]), mlp.reshape(-1, mlp.shape[-1]),
                                       qf.inv_smooth_of(self.linear2, x.device))
            output = qf.gemm(a_q, a_s, self.linear2, attn.dtype).view(*attn.shape[:-1], -1)
        else:
            output = self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2))
        x = _residual_add(x, output, mod.gate)
        if x.dtype == torch.float16:
            x = torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
        return x
