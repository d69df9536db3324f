"""ComfyUI glue of the attention routing (``quant/attention.py``): the Apply node's ``attention`` input.

``install(model_patcher, mode)`` puts a :class:`~quant.attention.Router` into the clone's
``model_options["transformer_options"]["optimized_attention_override"]``, which ComfyUI's ``wrap_attn`` (0.3.75 and
0.33.0) hands every ``optimized_attention(_masked)`` call of the model to. ``comfy_default`` installs nothing. An
override set upstream (an attention node before Apply) is kept inside the Router: the calls the Router does not take
go to it, and ``auto`` keeps it unless an exact backend is faster (the pack's own earlier Router is replaced, its
upstream kept). ``sage`` is offered only where the ``sageattention`` package can be imported; it runs ComfyUI's own
SageAttention function.
"""
from __future__ import annotations

import importlib.util
import logging

from ..quant import attention as routing

log = logging.getLogger("int8_fused")

KEY = "optimized_attention_override"


def sage_importable() -> bool:
    """Whether the ``sageattention`` package is installed (looked up, not imported: importing it loads Triton)."""
    try:
        return importlib.util.find_spec("sageattention") is not None
    except (ImportError, ValueError):
        return False


CHOICES = [m for m in routing.MODES if m != routing.SAGE] + ([routing.SAGE] if sage_importable() else [])
DEFAULT = routing.AUTO  # the node inputs' default: the fastest exact SDPA backend (comfy_default on a CPU)
TOOLTIP = ("How attention runs (default auto). comfy_default: as ComfyUI runs it (no change). cudnn / flash / efficient: torch "
           "SDPA with that backend first (torch takes the next one where it cannot run the call). math: torch's "
           "reference SDPA. auto: on an NVIDIA GPU the fastest of cudnn / flash / efficient per attention shape, "
           "timed once and cached; the attention you chose yourself (ComfyUI started with --use-sage-attention, "
           "--use-flash-attention, xformers, or an attention node before this one) is kept unless one of those is "
           "at least 5 % faster on that shape; on a CPU auto is comfy_default (INT8_FUSED_ATTN_INT8_AUTO=1 lets auto "
           "also time and pick int8). int8: the pack's 8-bit attention kernel (INT8 Q·K, approximate) for "
           "unmasked bf16/fp16 calls with head_dim 64/128/256 on an NVIDIA GPU; other calls run as ComfyUI runs "
           "them. sage (listed when the sageattention package is installed): SageAttention for the calls it takes "
           "(head_dim 64/96/128, no mask), the rest on an exact backend. The timing widget shows what ran.")


def check_mode(mode: str) -> str:
    """``mode`` if this ComfyUI can run it; a ValueError naming the choices (or what ``sage`` needs) else."""
    routing.check_mode(mode)
    if mode == routing.SAGE and sage_function() is None:
        raise ValueError("attention sage needs the sageattention package (pip install sageattention, into the Python "
                         "that runs ComfyUI, then restart) and a ComfyUI with SageAttention support; choose auto or "
                         "an SDPA backend meanwhile")
    return mode


def sage_function():
    """ComfyUI's SageAttention function (``comfy.ldm.modules.attention``: registered as ``sage``, else
    ``attention_sage`` where its import of sageattention succeeded); None where there is none."""
    if not sage_importable():
        return None
    import comfy.ldm.modules.attention as comfy_attention
    get = getattr(comfy_attention, "get_attention_function", None)
    fn = None
    if get is not None:
        try:
            fn = get("sage", None)
        except (KeyError, ValueError):
            fn = None
    if fn is None and getattr(comfy_attention, "SAGE_ATTENTION_IS_AVAILABLE", False):
        fn = getattr(comfy_attention, "attention_sage", None)
    return fn


def install(model_patcher, mode: str):
    """Route ``model_patcher``'s attention (a clone the caller owns) through a Router for ``mode``; returns it
    (None for comfy_default, which leaves any upstream override in place). An override set upstream stays inside
    the Router (module doc), with one log line saying what happens to it."""
    check_mode(mode)
    if mode == routing.COMFY:
        return None
    options = model_patcher.model_options.setdefault("transformer_options", {})
    prev = options.get(KEY)
    upstream = prev.upstream if isinstance(prev, routing.Router) else prev
    if upstream is not None:
        name = routing.upstream_name(upstream)
        if mode == routing.AUTO:
            log.info("INT8 Apply: attention auto keeps the attention override set upstream (%s) unless an exact SDPA "
                     "backend is at least %d %% faster on a shape", name, round(routing.USER_MARGIN * 100))
        else:
            log.info("INT8 Apply: attention %s runs in place of the override set upstream (%s); the calls %s does not "
                     "take go to it", mode, name, mode)
    router = routing.Router(mode, upstream=upstream,
                            sage_fn=sage_function() if mode == routing.SAGE else None)
    options[KEY] = router
    return router
