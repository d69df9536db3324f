"""Fused Qwen-Image blocks: ``QwenImageTransformerBlock`` of ComfyUI's ``comfy/ldm/qwen_image/model.py`` on INT8
layers, the activation quantization folded into the kernels that produce each GEMM input:

* q, k, v of each stream (``attn.to_q/k/v``, ``attn.add_q/k/v_proj``) as ONE int8 GEMM over the stacked weight
  [3K, K] (``quant.blocks.merge_int8``: equal smoothing and bias presence), fed by ``LayerNorm(x) * (1 + scale) +
  shift`` + quantization (``layernorm_modulate_quantize``);
* per-head QK RMSNorm + RoPE + the txt / img concatenation in one kernel per stream (``qk_norm_rope``), then
  ComfyUI's ``optimized_attention_masked``;
* the attention residual ``x + gate * proj`` with ``norm2`` * (1 + scale) + shift + quantization for the MLP's first
  GEMM (``residual_add_layernorm_modulate_quantize``), GELU(tanh) + quantization for its second (``gelu_tanh_quantize``),
  the MLP residual ``addcmul(x, gate, mlp)`` (``residual_add``).

Roundings as ComfyUI's ops, but one: ComfyUI casts the RoPE rotations to the model dtype and rotates in it
(``apply_rope1``: ``f0 * x0`` rounded, then the addcmul rounded), the kernel takes them in fp32 (exact) and rounds
``f0 * x0 + f1 * x1`` once. The residuals round as the running ComfyUI does: 0.33.0 adds the image attention with
``addcmul`` (one rounding), 0.3.75 as ``x + gate * y`` (two); the text residual is two ops in both.

Calls the fused forward does not implement run ComfyUI's own forward on the twin (the per-linear path, q/k/v as row
views of the stacked weight, each with its rows of the stacked layer's LoRA branches): ``timestep_zero_index`` (edit
models' zero-timestep references), a text mask, ``attn1_patch``, a ``temb`` that is not [B, K], and every call while
a layer of the block carries LoRA branches (a LoRA loaded after Apply, ``quant.lora``). Pure torch + ``kernel``; the adapter hands in ComfyUI's functions.
"""
from __future__ import annotations

import dataclasses
import types
import weakref
from typing import Callable

import torch
from torch import nn

from ..base import Int8Linear, blocks as qb

STREAMS = {"img": ("to_q", "to_k", "to_v"), "txt": ("add_q_proj", "add_k_proj", "add_v_proj")}
NORMS = {"img": ("norm_q", "norm_k"), "txt": ("norm_added_q", "norm_added_k")}


@dataclasses.dataclass(frozen=True)
class QwenFunctions:
    """What the block calls from ComfyUI (the adapter imports them)."""
    block_forward: Callable   # QwenImageTransformerBlock.forward: the per-linear path
    attention: Callable       # comfy.ldm.modules.attention.optimized_attention_masked (as the model module binds it)
    apply_rope1: Callable     # the apply_rope1 the model module calls (torch fallback of the QK kernel)
    addcmul_img_gate: bool    # whether this ComfyUI adds the image attention with addcmul (0.33.0's _apply_gate)


def merge_qkv(layers: dict, prefix: str, stream: str):
    """The stacked q/k/v Int8Linear of ``stream`` of the block ``prefix`` (a ConvRotLinear where all three are
    ConvRot layers of one group: the LayerNorm kernel rotates their shared input), or a reason string why not."""
    names = [f"{prefix}.attn.{n}" for n in STREAMS[stream]]
    ls = [layers.get(n) for n in names]
    if not qb.stackable(ls):
        return f"{stream} q/k/v are not all INT8 on fused_triton (unrotated, or ConvRot of one group size)"
    try:
        return qb.merge_int8(qb.merge_int8(ls[0], ls[1], names[0]), ls[2], f"{prefix}.attn.{stream}_qkv")
    except ValueError as e:
        return f"{stream} q/k/v cannot share one GEMM ({e})"


_PE: dict = {}


def _pe32(pe: torch.Tensor) -> torch.Tensor:
    """``pe`` in fp32, converted once per tensor (every block of a step gets the same one)."""
    if pe.dtype == torch.float32:
        return pe
    hit = _PE.get("src")
    if hit is not None and hit[0]() is pe and hit[1] == pe._version:
        return _PE["f32"]
    out = pe.float()
    _PE.update(src=(weakref.ref(pe), pe._version), f32=out)
    return out


class FusedQwenImageBlock(qb.FetchedBlock):
    """The twin of ``block`` (named ``prefix``) on ``layers`` with the stacked ``qkv`` {stream: Int8Linear}."""

    def __init__(self, block: nn.Module, prefix: str, layers: dict, qkv: dict, fn: QwenFunctions):
        super().__init__()
        for k, v in block.__dict__.items():
            if not k.startswith("_"):
                self.__dict__[k] = v
        for k, m in block._modules.items():
            self._modules[k] = qb.with_layers(m, f"{prefix}.{k}", layers) if m is not None else None
        if self.attn is block.attn:  # no INT8 layer under attn besides q/k/v: a twin all the same
            self._modules["attn"] = qb.rebind(block.attn, {})
        for names in STREAMS.values():  # held stacked only; row views during a fallback call
            for n in names:
                self.attn._modules[n] = None
        for k, f in vars(type(block)).items():  # _modulate, _apply_gate: what ComfyUI's forward calls (fallback)
            if k.startswith("_") and not k.startswith("__") and callable(f):
                self.__dict__[k] = types.MethodType(f, self)
        self.qkv_img, self.qkv_txt = qkv["img"], qkv["txt"]
        self.fn = fn
        self.covers = tuple(n for n in layers if n.startswith(f"{prefix}."))
        qb.kernels().register_ops()

    def _views(self) -> dict:
        """{to_q, ...: row view of the stacked layer}, each with its rows of the stacked layer's LoRA branches."""
        out = {}
        for s, names in STREAMS.items():
            m, k = getattr(self, f"qkv_{s}"), self.dim
            out.update({n: m.rows(i * k, (i + 1) * k, n) for i, n in enumerate(names)})
            br = m.derived.lora
            if br is not None:
                for i, n in enumerate(names):
                    out[n].set_lora(br.rows(i * k, (i + 1) * k))
        return out

    def int8_layers(self) -> dict[str, Int8Linear]:
        own = {n: m for n, m in self.named_modules() if isinstance(m, Int8Linear) and not n.startswith("qkv_")}
        return {**own, **{f"attn.{n}": m for n, m in self._views().items()}}

    def extra_repr(self) -> str:
        return f"covers={len(self.covers)} linears"

    def _fallback(self, *args, **kwargs):
        views = self._views()
        self.attn._modules.update(views)
        try:
            return self.fn.block_forward(self, *args, **kwargs)
        finally:
            self.attn._modules.update({n: None for n in views})

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask=None, temb=None,
                image_rotary_emb=None, timestep_zero_index=None, transformer_options={}):
        if (timestep_zero_index is not None or encoder_hidden_states_mask is not None
                or qb.attn_patches(transformer_options) or not isinstance(temb, torch.Tensor) or temb.dim() != 2
                or qb.lora_active(self)):  # LoRA branches (quant.lora): each layer's module call adds its own
            extra = {} if timestep_zero_index is None else {"timestep_zero_index": timestep_zero_index}
            return self._fallback(hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                                  image_rotary_emb, transformer_options=transformer_options, **extra)
        img, txt = hidden_states, encoder_hidden_states
        im = [t.unsqueeze(1) for t in self.img_mod(temb).chunk(6, dim=-1)]  # shift, scale, gate (x2)
        tm = [t.unsqueeze(1) for t in self.txt_mod(temb).chunk(6, dim=-1)]
        img_qkv = _mod_linear(self.qkv_img, self.img_norm1, img, im[0], im[1])
        txt_qkv = _mod_linear(self.qkv_txt, self.txt_norm1, txt, tm[0], tm[1])
        attn = self._attention([("txt", txt_qkv), ("img", img_qkv)], image_rotary_emb, transformer_options)
        del img_qkv, txt_qkv
        lt = txt.shape[1]
        img_o = qb.linear(self.attn.to_out[0], attn[:, lt:])
        txt_o = qb.linear(self.attn.to_add_out, attn[:, :lt])
        del attn
        img = _mlp_tails(img, img_o, im, self.img_norm2, self.img_mlp, not self.fn.addcmul_img_gate)
        txt = _mlp_tails(txt, txt_o, tm, self.txt_norm2, self.txt_mlp, True)
        return txt, img

    def _attention(self, streams, pe, transformer_options):
        """Joint attention over the streams' tokens (txt first): [B, L_all, H * D]."""
        h = self.num_attention_heads
        qkv = self._fused_qk_rope(streams, pe)
        if qkv is None:
            qs, ks, vs = [], [], []
            for s, x in streams:
                q, k, v = x.view(x.shape[0], x.shape[1], 3, h, -1).permute(2, 0, 3, 1, 4)
                nq, nk = (getattr(self.attn, n) for n in NORMS[s])
                qs.append(nq(q))
                ks.append(nk(k))
                vs.append(v)
            q, k, v = (torch.cat(t, dim=2) for t in (qs, ks, vs))
            q, k = self.fn.apply_rope1(q, pe), self.fn.apply_rope1(k, pe)
        else:
            q, k, v = qkv
        return self.fn.attention(q, k, v, h, None, transformer_options=transformer_options, skip_reshape=True)

    def _fused_qk_rope(self, streams, pe):
        """(q, k, v) [B, H, L_all, D] from one ``qk_norm_rope`` launch per stream, or None where it does not apply
        (torch.compile tracing, ``pe`` not [B | 1, 1, L_all, D / 2, 2, 2], norms with weight functions)."""
        x0 = streams[0][1]
        b, h = x0.shape[0], self.num_attention_heads
        d = x0.shape[-1] // (3 * h)
        total = sum(x.shape[1] for _, x in streams)
        if (qb.compiling() or not isinstance(pe, torch.Tensor) or pe.dim() != 6 or pe.shape[1] != 1
                or pe.shape[0] not in (1, b) or pe.shape[2] != total or tuple(pe.shape[3:]) != (d // 2, 2, 2)
                or d < 2 or d & (d - 1) or pe.device != x0.device or not pe.is_floating_point()):
            return None
        ws = []
        for s, x in streams:
            w = qb.qk_norm_weights(*(getattr(self.attn, n) for n in NORMS[s]), x, d)
            if w is None or x.dtype != x0.dtype:
                return None
            ws.append(w)
        pe = _pe32(pe)
        q, k, v = (torch.empty((b, total, h, d), dtype=x0.dtype, device=x0.device).transpose(1, 2) for _ in range(3))
        row = 0
        for (_, x), (wq, eq, wk, ek) in zip(streams, ws):
            qb.call(qb.kernels().rope.qk_norm_rope, x, h, wq, wk, eq, ek, pe, q, k, v, row)
            row += x.shape[1]
        return q, k, v


def _mod_linear(layer, norm, x, shift, scale) -> torch.Tensor:
    """``layer(addcmul(shift, norm(x), 1 + scale))`` (x [B, L, K]; ``layer`` INT8 on fused_triton, a ConvRot one
    rotated in the same kernel): one kernel feeding the int8 GEMM."""
    b, l, k = x.shape
    a_q, a_s = qb.ln_mod_quant(x.reshape(-1, k), scale, shift, l, qb.inv_smooth_of(layer, x.device),
                               float(norm.eps), qb.rotation(layer))
    return qb.gemm(a_q, a_s, layer, qb.promote(x, scale, shift)).view(b, l, -1)


def _tail_kernels(x, *ts) -> bool:
    return x.is_contiguous() and qb.residual_operands(x, *ts)


def _mlp_tails(x, proj, mod, norm, mlp, round_product: bool) -> torch.Tensor:
    """``x = x + gate1 * proj`` (``round_product``: two roundings, else addcmul's one), then
    ``x = addcmul(x, gate2, mlp(addcmul(shift2, norm(x), 1 + scale2)))``; out of place, as ComfyUI."""
    _, _, g1, sh2, sc2, g2 = mod
    fc1, fc2 = mlp.net[0].proj, mlp.net[2]
    b, l, k = x.shape
    if qb.fusable(fc1) and getattr(norm, "weight", None) is None and proj.shape == x.shape and _tail_kernels(
            x, proj, g1, sc2, sh2):
        x, a_q, a_s = qb.call(qb.kernels().residual.residual_add_layernorm_modulate_quantize, x.view(-1, k),
                              proj.reshape(-1, k), g1, l, float(norm.eps), sc2, sh2, qb.inv_smooth_of(fc1, x.device),
                              round_product)
        x = x.view(b, l, k)
        h = qb.gemm(a_q, a_s, fc1, qb.promote(x, sc2, sh2)).view(b, l, -1)
    else:
        x = x + g1 * proj if round_product else torch.addcmul(x, g1, proj)
        if qb.norm_fusable(fc1) and not qb.fusable(fc1) and getattr(norm, "weight", None) is None:  # ConvRot fc1
            h = _mod_linear(fc1, norm, x, sh2, sc2)
        else:
            h = qb.linear(fc1, torch.addcmul(sh2, norm(x), 1 + sc2))
        if not qb.norm_fusable(fc1):
            h = torch.nn.functional.gelu(h, approximate=mlp.net[0].approximate)
            return torch.addcmul(x, g2, qb.linear(fc2, h))
    if qb.act_fusable(fc2):
        a_q, a_s = qb.cat_gelu_quant(None, h.reshape(-1, h.shape[-1]), qb.inv_smooth_of(fc2, h.device),
                                     qb.rotation(fc2))
        y = qb.gemm(a_q, a_s, fc2, h.dtype).view(b, l, -1)
    else:
        y = fc2(torch.nn.functional.gelu(h, approximate=mlp.net[0].approximate))
    if y.shape == x.shape and _tail_kernels(x, y, g2):
        return qb.call(qb.kernels().residual.residual_add, x.view(-1, k), y.reshape(-1, k), g2, l).view(b, l, k)
    return torch.addcmul(x, g2, y)
