"""What a ComfyUI MODEL's layers hold, as the nodes read it: the float weights ComfyUI would compute with
(decoded, LoRA merged) and the module tree without the object patches of other clones. Shared by Apply,
Calibrate and Save."""
from __future__ import annotations

import contextlib
import logging
import threading

import torch

from .. import adapters

PREFIX = "diffusion_model."  # object patch and weight patch keys are relative to the BaseModel


@contextlib.contextmanager
def original_tree(model):
    """The diffusion-model tree with its original modules for the duration: while another clone of the
    same model is loaded, that clone's object patches sit in the (shared) tree."""
    import comfy.utils
    backup = dict(model.object_patches_backup)
    current = {k: comfy.utils.get_attr(model.model, k) for k in backup}
    for k, orig in backup.items():
        comfy.utils.set_attr(model.model, k, orig)
    try:
        yield model.model.diffusion_model
    finally:
        for k, cur in current.items():
            comfy.utils.set_attr(model.model, k, cur)


def original_modules(model):
    """(name, module) pairs over the diffusion model as ``named_modules()`` gives them for the unpatched tree. While a
    clone of the same model is loaded, its object patches sit in the shared tree and ComfyUI keeps the modules they
    replaced in ``object_patches_backup`` (shared by every clone); the walk takes the original at each patched name
    and goes on into the original's children, never into the patch's (a fused block's children are not the
    block's linears). Reads only: the tree is not changed."""
    backup, seen = model.object_patches_backup, set()

    def walk(name, module):
        if id(module) in seen:
            return
        seen.add(id(module))
        yield name, module
        for child_name, child in module.named_children():
            path = f"{name}.{child_name}" if name else child_name
            yield from walk(path, backup.get(PREFIX + path, child))

    yield from walk("", backup.get(PREFIX.rstrip("."), model.model.diffusion_model))


def float_tensor(model, name: str, module, attr: str, device: torch.device,
                 merged: dict | None = None) -> torch.Tensor | None:
    """The layer's weight/bias in fp32 on ``device`` (a copy of its own), decoded the way ComfyUI decodes it, with
    the MODEL's weight patches (LoRA) merged by ``comfy.lora.calculate_weight``. ``merged``: gets {patch key: how
    many of its patches ComfyUI merged} (:func:`merge_patches`)."""
    import comfy.model_management as mm
    t = getattr(module, attr, None)
    if t is None:
        return None
    key = f"{PREFIX}{name}.{attr}"
    bk = model.backup.get(key)
    if bk is not None:  # the model is loaded with patches merged in place: start from the original
        t = bk.weight
    if hasattr(t, "dequantize") and type(t).__name__ == "QuantizedTensor":
        out = t.to(device).dequantize().float()
    else:
        out = mm.cast_to_device(t, device, torch.float32, copy=True)
        convert = getattr(module, f"convert_{attr}", None)
        if convert is not None:  # scaled fp8 / mixed precision layers decode here
            out = convert(out, inplace=True).float()
    if key in model.patches:
        out, n = merge_patches(model.patches[key], out, key)
        if merged is not None:
            merged[key] = n
    return out.float()


class _Skips(logging.Handler):
    """Counts the warnings and errors ComfyUI logs (root logger) from this thread while it is attached."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.thread, self.count = threading.get_ident(), 0

    def emit(self, record):
        self.count += record.thread == self.thread and record.name == "root"


def merge_patches(patches, weight: torch.Tensor, key: str) -> tuple[torch.Tensor, int]:
    """(``weight`` with ``patches`` merged by ``comfy.lora.calculate_weight``, how many of them it merged).
    ComfyUI skips a patch it cannot merge (a LoRA of the wrong shape, an unknown patch type) with a warning or an
    error in its log and goes on with the weight unchanged: one patch at a time (what it does with the list), a
    patch during whose merge it logged one counts as skipped."""
    import comfy.lora
    skips, root, n = _Skips(), logging.getLogger(), 0
    root.addHandler(skips)
    try:
        for p in patches:
            before = skips.count
            weight = comfy.lora.calculate_weight([p], weight, key, intermediate_dtype=torch.float32)
            n += skips.count == before
    finally:
        root.removeHandler(skips)
    return weight, n


def int8_layers(model) -> dict:
    """{name relative to the diffusion model: Int8Linear} of every INT8 layer among ``model``'s object patches,
    fused or not (fused modules say which through ``int8_layers()``: a merged w1+w3 GEMM comes back as two row
    views named w1 and w3, a cached layer by its own name). Built on demand, so nothing is held twice."""
    return adapters.int8_layers_of({k[len(PREFIX):]: m for k, m in model.object_patches.items()
                                    if k.startswith(PREFIX)})
