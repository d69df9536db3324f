"""How an ``Int8Linear`` fetches its int8 weight and bias when ComfyUI manages them.

ComfyUI marks the layers whose weights it does not keep resident in the module itself with
``comfy_cast_weights`` (every such layer under DynamicVRAM's ``ModelPatcherDynamic``; the offloaded ones
of a legacy partial load) and expects their forward to fetch weights through ``comfy.ops.cast_bias_weight``
and hand them back with ``uncast_bias_weight``. That is what ComfyUI's own layers do, so the int8 weights
follow the same road as every other weight: DynamicVRAM's VRAM "vbar" (faulted in once from pinned memory,
resident across steps until ComfyUI evicts them) or, on the legacy patcher, ComfyUI's offload stream.

The fetch asks for the stored dtypes (int8 weight, fp32 bias), so ComfyUI moves bytes and never casts.
"""
from __future__ import annotations

import torch

from ..quant import linear


def cast(layer, device: torch.device):
    """(weight, bias, release) of ``layer`` on ``device``; call ``release()`` once the kernels using them
    are queued (DynamicVRAM unpins the vbar then; the legacy path waits for the offload stream)."""
    import comfy.ops
    bias_dtype = None if layer.bias is None else layer.bias.dtype
    w, b, stream = comfy.ops.cast_bias_weight(layer, None, dtype=layer.weight.dtype, device=device,
                                              bias_dtype=bias_dtype, offloadable=True)
    return w, b, (lambda: comfy.ops.uncast_bias_weight(layer, w, b, stream))


def install() -> None:
    """Called once when ComfyUI imports the nodes package."""
    linear.set_comfy_cast(cast)
