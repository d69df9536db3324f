"""ComfyUI glue of Ideogram 4's pad-token elision (``quant/pad_elision.py``) for the Apply node."""
from __future__ import annotations

import logging

from ..quant import pad_elision

log = logging.getLogger("int8_fused")

KEY = "int8_fused.pad_elision"


def install(model_patcher, backend: str) -> bool:
    """On an Ideogram 4 MODEL (a clone the caller owns), when ``INT8_FUSED_PAD_ELISION`` allows it for ``backend``,
    add the DIFFUSION_MODEL wrapper that drops trailing padded text tokens. Returns whether it did."""
    from comfy.patcher_extension import WrappersMP
    if not pad_elision.enabled(backend) or not pad_elision.is_ideogram4(model_patcher.model.diffusion_model):
        return False
    model_patcher.remove_wrappers_with_key(WrappersMP.DIFFUSION_MODEL, KEY)
    model_patcher.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, KEY, pad_elision.diffusion_model_wrapper)
    log.info("INT8 Apply: Ideogram 4 padded text tokens are dropped instead of masked (%s=0 turns this off)",
             pad_elision.ENV)
    return True
