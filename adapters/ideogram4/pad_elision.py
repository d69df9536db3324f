"""Pad-token elision for Ideogram 4's conditional pass (ComfyUI ``comfy/ldm/ideogram4/model.py``). Pure torch.

``_run_conditional`` packs ``[text tokens, image tokens]``. With the text conditioning's ``attention_mask``
[B, L_text] (0 = padding) it puts padded text tokens in segment -1 and every other token in segment 1 and attends
block-diagonally: image and real text tokens never attend to padded ones, and everything else the model does is per
token. Removing padded tokens therefore changes no output of the others, provided the kept text tokens keep their
RoPE positions (``arange(L_text)``; image positions are a fixed offset). Removing the padding at the *end* of the
text (positions padded in every batch row) keeps them; when nothing masked is left, the mask goes too and attention
runs unmasked (flash / cuDNN can take it) on fewer tokens. Padding elsewhere (left padding, rows padded to different
lengths) stays masked as before.

``strip_call`` applies this to a forward call's ``context`` / ``attention_mask`` arguments; the adapter's
DIFFUSION_MODEL wrapper (``__init__.py``) calls it. The nodes install that wrapper where ``INT8_FUSED_PAD_ELISION``
allows it (``adapters.base.pad_elision_enabled``).
"""
from __future__ import annotations

import collections

import torch

stats: collections.Counter = collections.Counter()  # "calls", "tokens_removed", "masks_dropped" (tests, bench)


def strip_trailing_padding(context: torch.Tensor | None, attention_mask: torch.Tensor | None):
    """(context, attention_mask, tokens removed): text positions at the end that are padding in every batch row
    removed; the mask becomes None when nothing in it is masked any more. Anything else comes back unchanged: no
    mask, a mask that is not [B, L_text] of ``context`` [B, L_text, C], or text that is all padding."""
    if context is None or attention_mask is None or context.ndim != 3 or attention_mask.ndim != 2 \
            or tuple(attention_mask.shape) != tuple(context.shape[:2]):
        return context, attention_mask, 0
    kept = (attention_mask != 0).any(dim=0).nonzero()
    if kept.numel() == 0:
        return context, attention_mask, 0
    n = int(kept[-1]) + 1
    mask = attention_mask[:, :n] if n < context.shape[1] else attention_mask
    if bool((mask != 0).all()):
        mask = None
    return (context[:, :n] if n < context.shape[1] else context), mask, context.shape[1] - n


def strip_call(args: tuple, kwargs: dict, context_at: int = 2, mask_at: int = 3) -> tuple[tuple, dict]:
    """(args, kwargs) of a ``forward(..., context, attention_mask, ...)`` call (positions ``context_at`` /
    ``mask_at``, or keywords ``context`` / ``attention_mask``) with the trailing padded text tokens removed; the
    same objects when nothing changes. Counts what it did in ``stats``."""
    ctx = args[context_at] if len(args) > context_at else kwargs.get("context")
    mask = args[mask_at] if len(args) > mask_at else kwargs.get("attention_mask")
    ctx2, mask2, removed = strip_trailing_padding(ctx, mask)
    if removed == 0 and mask2 is mask:
        return args, kwargs
    stats["calls"] += 1
    stats["tokens_removed"] += removed
    stats["masks_dropped"] += mask2 is None
    args, kwargs = list(args), dict(kwargs)
    for i, name, value in ((context_at, "context", ctx2), (mask_at, "attention_mask", mask2)):
        if len(args) > i:
            args[i] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs
