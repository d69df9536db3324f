"""Wan 2.x (``comfy.ldm.wan.model.WanModel`` and its subclasses: VACE, camera, HuMo, S2V, Animate, causal, ...).

Per-linear INT8: self- and cross-attention q/k/v/o (and the image k/v of I2V) and ``ffn.0`` / ``ffn.2`` of
``blocks.N``. Wan's block modulation is a parameter, not a linear, so ``blocks+modulation`` adds nothing here.
"""
from __future__ import annotations

from .base import Adapter, select

ADAPTER = Adapter(
    name="wan",
    model_classes=("comfy.ldm.wan.model.WanModel",),
    rules=select.block_rules(("blocks",), r"modulation"),
)
