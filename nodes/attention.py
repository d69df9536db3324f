"""ComfyUI glue of the attention routing (``quant/attention.py``): the Apply node's ``attention`` input.

``install(model_patcher, mode)`` puts a :class:`~quant.attention.Router` into the clone's
``model_options["transformer_options"]["optimized_attention_override"]``, which ComfyUI's ``wrap_attn`` (0.3.75 and
0.33.0) hands every ``optimized_attention(_masked)`` call of the model to. ``comfy_default`` installs nothing.
"""
from __future__ import annotations

import logging

from ..quant import attention as routing

log = logging.getLogger("int8_fused")

KEY = "optimized_attention_override"
CHOICES = list(routing.MODES)
DEFAULT = routing.AUTO  # the node inputs' default: the fastest exact SDPA backend (comfy_default on a CPU)
check_mode = routing.check_mode  # an unknown mode -> ValueError naming the choices
TOOLTIP = ("How attention runs (default auto). comfy_default: as ComfyUI runs it (no change). cudnn / flash / efficient: torch "
           "SDPA with that backend first (torch takes the next one where it cannot run the call). math: torch's "
           "reference SDPA. auto: on an NVIDIA GPU the fastest of cudnn / flash / efficient per attention shape, "
           "timed once and cached; on a CPU auto is comfy_default (INT8_FUSED_ATTN_INT8_AUTO=1 lets auto also time and "
           "pick int8). int8: the pack's 8-bit attention kernel (INT8 Q·K, approximate) for unmasked bf16/fp16 "
           "calls with head_dim 64/128/256 on an NVIDIA GPU; other calls run as ComfyUI runs them. The timing "
           "widget shows what ran.")


def install(model_patcher, mode: str):
    """Route ``model_patcher``'s attention (a clone the caller owns) through a Router for ``mode``; returns it
    (None for comfy_default). Replaces an override set upstream (e.g. another attention node), with a log line."""
    routing.check_mode(mode)
    if mode == routing.COMFY:
        return None
    options = model_patcher.model_options.setdefault("transformer_options", {})
    prev = options.get(KEY)
    if prev is not None:
        log.info("INT8 Apply: attention %s replaces the attention override set upstream (%r)", mode, prev)
    router = routing.Router(mode)
    options[KEY] = router
    return router

