"""ComfyUI glue of pad-token elision (an adapter's ``pad_elision_wrapper``) for the Apply node and the loader."""
from __future__ import annotations

import logging

from .. import adapters

log = logging.getLogger("int8_fused")

KEY = "int8_fused.pad_elision"


def install(model_patcher, backend: str) -> bool:
    """On a MODEL (a clone the caller owns) whose adapter drops padded text tokens, when
    ``INT8_FUSED_PAD_ELISION`` allows it for ``backend``, add the adapter's DIFFUSION_MODEL wrapper that drops trailing
    padded text tokens. Returns whether it did."""
    from comfy.patcher_extension import WrappersMP
    if not adapters.pad_elision_enabled(backend):
        return False
    adapter = adapters.adapter_for(model_patcher.model.diffusion_model)
    if adapter is None or adapter.pad_elision_wrapper is None:
        return False
    model_patcher.remove_wrappers_with_key(WrappersMP.DIFFUSION_MODEL, KEY)
    model_patcher.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, KEY, adapter.pad_elision_wrapper)
    log.info("INT8 Apply: %s padded text tokens are dropped instead of masked (%s=0 turns this off)", adapter.name,
             adapters.PAD_ELISION_ENV)
    return True
