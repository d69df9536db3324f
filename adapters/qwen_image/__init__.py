"""Qwen-Image (``comfy.ldm.qwen_image.model.QwenImageTransformer2DModel``).

Per-linear INT8: the attention and MLP linears of ``transformer_blocks.N``; the modulation GEMVs ``img_mod.1`` /
``txt_mod.1`` only with ``blocks+modulation``.
"""
from __future__ import annotations

from ..base import Adapter, select

ADAPTER = Adapter(
    name="qwen_image",
    model_classes=("comfy.ldm.qwen_image.model.QwenImageTransformer2DModel",),
    rules=select.block_rules(("transformer_blocks",), r"_mod\."),
)
