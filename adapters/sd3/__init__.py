"""SD3.x (``comfy.ldm.modules.diffusionmodules.mmdit.MMDiT``, ComfyUI's ``OpenAISignatureMMDITWrapper``).

Per-linear INT8: attention qkv/proj and MLP fc1/fc2 of the context and x halves of ``joint_blocks.N``; the
``adaLN_modulation.1`` GEMVs only with ``blocks+modulation``.
"""
from __future__ import annotations

from ..base import Adapter, select

ADAPTER = Adapter(
    name="sd3",
    model_classes=("comfy.ldm.modules.diffusionmodules.mmdit.MMDiT",),
    rules=select.block_rules(("joint_blocks",), r"adaLN_modulation"),
)
