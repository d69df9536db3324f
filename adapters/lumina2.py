"""Lumina 2 / Z-Image (``comfy.ldm.lumina.model.NextDiT`` and its subclasses, e.g. Z-Image's pixel-space model).

Fused, on fused_triton (``fuse``): every SwiGLU ``FeedForward`` (``layers.N``, ``noise_refiner.N``,
``context_refiner.N``) becomes a ``FusedFeedForward``: w1+w3 as one int8 GEMM, SwiGLU + quantization feeding w2.
Attention and the adaLN-modulated norms run as ComfyUI runs them, with INT8 linears.

ComfyUI difference, handled explicitly: 0.33.0 clamps the SwiGLU product in fp16 (``clamp_fp16`` in
comfy/ldm/lumina/model.py), 0.3.75 does not; the fused FeedForward does what the running ComfyUI does.
"""
from __future__ import annotations

from torch import nn

from .base import Adapter, fuse_feed_forwards, select


def is_swiglu_ffn(m: nn.Module) -> bool:
    """NextDiT's FeedForward (``w2(silu(w1 x) * w3 x)``): the only module of the model with w1, w2 and w3."""
    return all(isinstance(getattr(m, a, None), nn.Module) for a in ("w1", "w2", "w3"))


def clamps_fp16() -> bool:
    """Whether the running ComfyUI's lumina FeedForward clamps its fp16 SwiGLU product (0.33.0 yes, 0.3.75 no)."""
    import comfy.ldm.lumina.model as lumina
    return hasattr(lumina, "clamp_fp16")


def fuse(diffusion_model: nn.Module, int8_layers: dict, clamp_fp16: bool | None = None) -> dict:
    """{name: FusedFeedForward} for the FeedForwards whose w1/w3 are INT8 on fused_triton. ``clamp_fp16``: default
    what the running ComfyUI does (:func:`clamps_fp16`)."""
    return fuse_feed_forwards(diffusion_model, int8_layers, is_swiglu_ffn,
                              clamps_fp16() if clamp_fp16 is None else clamp_fp16)


ADAPTER = Adapter(
    name="lumina2",
    model_classes=("comfy.ldm.lumina.model.NextDiT",),
    rules=select.block_rules(("layers", "noise_refiner", "context_refiner"), r"adaLN_modulation"),
    fuse=fuse,
)
