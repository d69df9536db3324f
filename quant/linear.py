"""``Int8Linear``: the W8A8 replacement for ``nn.Linear``.

Holds an int8 weight [N, K] quantized per output channel with fp32 scales [N], an optional fp32
SmoothQuant vector ``smooth`` [K] and an optional bias [N]. The forward flattens leading dimensions,
quantizes the activation per token (dividing by ``smooth`` first) and runs the selected backend:

    y = (Q(x / s) @ Q(W * s).T) * a_scale[m] * w_scale[n] + bias        [..., K] -> [..., N]

Everything is a buffer, so ``.to()``, ComfyUI's offloading and ``state_dict()`` round trips carry it.
The int8 tensor is called ``qweight`` (not ``weight``) on purpose: code that patches float weights
(LoRA, weight casting) must never reach it by its usual name; ``.weight`` reads as None.

ComfyUI's ModelPatcher only moves and counts modules that own parameters or carry a
``comfy_cast_weights`` attribute (``model_patcher.ModelPatcher._load_list``). This module has buffers
only, so it carries that attribute (plus empty ``weight_function``/``bias_function`` lists, which
lowvram loading resets): full loads move it with ``.to()``, partial (lowvram) loads may leave it on the
offload device, and then the forward copies its tensors to the activation's device for the call —
the same contract as ``comfy.ops`` casting layers.
"""
from __future__ import annotations

import torch
from torch import nn

from . import backends
from .quantize import dequantize, quantize_weight_per_channel


class Int8Linear(nn.Module):
    """W8A8 linear layer; see the module docstring. ``backend`` names an entry of ``backends.BACKENDS``."""

    comfy_cast_weights = False  # ComfyUI's lowvram loader may set True: tensors then stay offloaded

    def __init__(self, in_features: int, out_features: int, bias: bool = True, smooth: bool = False,
                 backend: str = "dequant_bf16", name: str = "", device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.name = name
        self.backend = backend
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32, device=device) if bias else None)
        self.register_buffer("smooth", torch.ones(in_features, dtype=torch.float32, device=device) if smooth else None)
        self.register_buffer("inv_smooth", None, persistent=False)
        self.weight_function: list = []  # ComfyUI lowvram bookkeeping; never holds anything for us
        self.bias_function: list = []
        self._refresh_inv_smooth()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   smooth: torch.Tensor | None = None, backend: str = "dequant_bf16",
                   name: str = "") -> "Int8Linear":
        """Quantize a float weight [N, K] (and keep ``bias``) on the weight's device.

        With ``smooth`` (s, [K], positive), the stored weight is ``Q(W * s)`` and activations are
        divided by ``s`` before quantization, so the product is unchanged in exact arithmetic.
        """
        N, K = weight.shape
        w = weight.detach().float()
        if smooth is not None:
            smooth = _check_smooth(smooth, K, name)
            w = w * smooth.to(w.device)[None, :]
        qw, ws = quantize_weight_per_channel(w)
        m = cls(K, N, bias=bias is not None, smooth=smooth is not None, backend=backend, name=name,
                device="meta")
        m.qweight, m.weight_scale = qw, ws
        m.bias = None if bias is None else bias.detach().float().to(qw.device)
        m.smooth = None if smooth is None else smooth.to(qw.device)
        m._refresh_inv_smooth()
        return m

    @classmethod
    def from_linear(cls, linear: nn.Module, **kw) -> "Int8Linear":
        return cls.from_float(linear.weight, getattr(linear, "bias", None), **kw)

    def _refresh_inv_smooth(self) -> None:
        self.inv_smooth = None if self.smooth is None else (1.0 / self.smooth.float())

    def _load_from_state_dict(self, state_dict, prefix, *args, **kw):
        super()._load_from_state_dict(state_dict, prefix, *args, **kw)
        self._refresh_inv_smooth()

    # ------------------------------------------------------------------ use
    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K] weight this layer effectively applies to the unsmoothed input."""
        w = dequantize(self.qweight, self.weight_scale)
        return w if self.inv_smooth is None else w * self.inv_smooth[None, :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"INT8 layer {self.name or '?'} expects inputs [..., {self.in_features}], "
                             f"got {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        layer = self if self.qweight.device == x.device else _OnDevice(self, x.device)
        y = backends.get(self.backend).linear(x2, layer)
        return y.reshape(*lead, self.out_features)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "weight":
                # No float weight here. Current ComfyUI probes `<module>.weight` of every module that
                # carries `comfy_cast_weights` while planning a load (ModelPatcher._load_list) and treats
                # None as "nothing to count", so None, not an error. LoRA patches never reach this layer:
                # ComfyUI maps LoRA keys through the model's state dict, which holds `qweight`.
                return None
            raise

    def nbytes(self) -> int:
        """Bytes of the persistent tensors (what ComfyUI counts for this module)."""
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, smooth={self.smooth is not None}, backend={self.backend}")


class _OnDevice:
    """The layer's tensors copied to ``device`` for one call (lowvram: the module stays offloaded)."""

    def __init__(self, layer: Int8Linear, device: torch.device):
        nb = device.type == "cuda"
        self.name, self.backend = layer.name, layer.backend
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.qweight = layer.qweight.to(device, non_blocking=nb)
        self.weight_scale = layer.weight_scale.to(device, non_blocking=nb)
        self.bias = None if layer.bias is None else layer.bias.to(device, non_blocking=nb)
        self.inv_smooth = None if layer.inv_smooth is None else layer.inv_smooth.to(device, non_blocking=nb)


def _check_smooth(smooth: torch.Tensor, K: int, name: str) -> torch.Tensor:
    s = smooth.detach().float().flatten()
    if s.numel() != K:
        raise ValueError(f"smoothing vector for {name or 'layer'} has {s.numel()} entries, the layer has K={K}")
    if not (torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError(f"smoothing vector for {name or 'layer'} must be finite and positive")
    return s
