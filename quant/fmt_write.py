"""Writers for the INT8 checkpoint layouts read by ``quant.formats``; every write is atomic.

Files go through ``kernel.atomic.atomic_write`` (a temporary beside the target, renamed over it), so a crash
never leaves a half-written model under the real name, and a killed writer's temporary is removed by the next
save in that folder; an existing target is an error (``OutputExistsError``) unless ``overwrite=True``.

Layer tensors are passed in the normalized form ``quant.formats`` reads back: per quantized linear a dict
``{"qweight": int8 [N, K], "weight_scale": fp32 [N], "bias": [N] | None, "smooth": fp32 [K] | None}``
(``smooth`` a divisor: activations ``x / s``, ``qweight = Q(W * s)``), float tensors as they are.
"""
from __future__ import annotations

import errno
import json
import os

import torch

from ..kernel import atomic as _atomic
from .formats import ERROR_MODULE, FMT_PACK, PACK_FORMAT_VERSION, OutputExistsError
from .quantize import dequantize, quantize_weight_per_channel


def atomic_save(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None,
                overwrite: bool = False) -> str:
    """Write ``tensors`` as safetensors at ``path`` atomically (``kernel.atomic.atomic_write``); returns the path.

    Raises OutputExistsError when ``path`` exists (also when it appears while writing) and ``overwrite``
    is off, ValueError for a path holding NUL, NameTooLongError (a ValueError) for a name longer than the
    file system takes (checked before anything is serialized)."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    check_name_lengths(path)
    if os.path.exists(path) and not overwrite:  # early, before serializing anything
        raise OutputExistsError(f"{path} already exists; choose another name or turn overwrite on")
    try:
        return _atomic.atomic_write(path, lambda tmp: save_file(_unshared(tensors), tmp, metadata=metadata),
                                    overwrite)
    except FileExistsError as e:
        if e.filename != path:  # not atomic_write's "appeared while writing"
            raise
        raise OutputExistsError(f"{path} appeared while saving; not overwritten. Choose another name or "
                                "turn overwrite on") from None
    except OSError as e:
        if e.errno != errno.ENAMETOOLONG:
            raise
        raise NameTooLongError(f"cannot write {path}: the file system refuses the name as too long ({e.strerror}); "
                               "choose a shorter name") from None


class NameTooLongError(ValueError):
    """A file or folder name longer than its file system allows."""


NameTooLongError.__module__ = ERROR_MODULE


def check_name_lengths(path: str) -> None:
    """Raise NameTooLongError when a folder or file name of ``path`` that does not exist yet is longer, in bytes
    (UTF-8 on Linux), than the file system of its nearest existing folder takes (``NAME_MAX``, usually 255)."""
    path = os.path.abspath(os.fspath(path))
    base, new = path, []
    while not os.path.isdir(base):
        base, part = os.path.split(base)
        if not part:
            break
        new.append(part)
    limit = _atomic.name_max(base)
    for part in reversed(new):
        n = len(os.fsencode(part))
        if n > limit:
            shown = part if len(part) <= 48 else part[:40] + "..."
            raise NameTooLongError(f"the name {shown!r} is {n} bytes long (UTF-8); the file system of {base} "
                                   f"takes at most {limit} bytes per file or folder name: choose a shorter name")


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, copying any that share storage (safetensors refuses shared memory)."""
    out, seen = {}, set()
    for k, v in tensors.items():
        v = v.detach().contiguous().cpu()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen and v.numel() else v
        seen.add(ptr)
    return out


def _branch_key(branch: str, name: str) -> str:
    return f"{branch}.{name}" if branch else name


def write_pack(path: str, branches: dict[str, tuple[dict, dict]], *, protected=(), calibration=None,
               architecture: str = "", overwrite: bool = False, extra_meta: dict | None = None) -> str:
    """This pack's ``int8_fused`` format.

    ``branches``: {branch ("" for a single model, else "conditional"/"unconditional"): (quant layers
    {name: layer dict}, float tensors {name: tensor})}. ``protected``: names of linears deliberately kept
    in float; ``calibration``: JSON-able provenance (e.g. ``Calibration.meta``) or None.
    """
    if len(branches) > 1 and "" in branches:
        raise ValueError("a single-model branch '' cannot be mixed with named branches")
    tensors, layers = {}, {}
    for br, (quant, floats) in branches.items():
        for n, t in floats.items():
            tensors[_branch_key(br, n)] = t
        for n, L in quant.items():
            k = _branch_key(br, n)
            tensors[f"{k}.qweight"] = L["qweight"].to(torch.int8)
            tensors[f"{k}.weight_scale"] = L["weight_scale"].float().reshape(-1)
            if L.get("bias") is not None:
                tensors[f"{k}.bias"] = L["bias"]
            if L.get("smooth") is not None:
                tensors[f"{k}.smooth"] = L["smooth"].float().reshape(-1)
            layers[k] = {"smooth": L.get("smooth") is not None, "alpha": L.get("alpha")}
    meta = {
        "format": FMT_PACK,
        "format_version": str(PACK_FORMAT_VERSION),
        "branches": json.dumps(sorted(branches)),
        "architecture": architecture,
        "weight_quant": "int8 symmetric per output channel, scale = absmax/127",
        "activation_quant": "int8 symmetric per token, dynamic, after dividing by smooth",
        "smooth_convention": "divide_activation: y = Q(x / s) @ Q(W * s).T",
        "layers": json.dumps(layers),
        "protected": json.dumps(sorted(protected)),
        "calibration": json.dumps(calibration if calibration is not None else None, default=str),
    }
    meta.update(extra_meta or {})
    return atomic_save(tensors, path, meta, overwrite)


def fold_smoothing(layer: dict) -> dict:
    """A layer without activation smoothing computing the same float product, for core ``int8_tensorwise``.

    Core quantizes the raw activation (no ``pre_quant_scale`` for this format), so the stored weight must
    be the unsmoothed W: ``W' = dequant(qweight) / s`` (per input column), re-quantized per output channel.
    Accuracy: the product is unchanged in exact arithmetic, but (1) the activation is quantized without
    the SmoothQuant division, so outlier channels cost activation precision again (the reason smoothing
    was used), and (2) the weight is rounded twice (once as ``W * s``, once as ``W'``), adding at most one
    more half-step of the per-channel weight grid. When the float weight is at hand, quantize it directly.
    """
    if layer.get("smooth") is None:
        return {**layer, "weight_scale": layer["weight_scale"].float().reshape(-1)}
    w = dequantize(layer["qweight"], layer["weight_scale"].float().reshape(-1)) / layer["smooth"].float()[None, :]
    q, s = quantize_weight_per_channel(w)
    return {"qweight": q, "weight_scale": s, "bias": layer.get("bias"), "smooth": None}


def write_core_int8(path: str, quant: dict[str, dict], floats: dict[str, torch.Tensor], *,
                    overwrite: bool = False) -> str:
    """ComfyUI core ``int8_tensorwise``: ``<p>.weight`` int8, ``<p>.weight_scale`` fp32 [N, 1], ``<p>.comfy_quant``
    JSON. Smoothed layers are folded (``fold_smoothing``).
    Loads in plain ComfyUI (with comfy-kitchen) without this pack. [N, 1] is the shape comfy-kitchen's own per-channel
    quantizer writes and what its dequantization (``q * scale``, used where it has no int8 kernel for an op, e.g. a
    linear without bias, and when ComfyUI patches weights) needs: an [N] scale scales the columns of a square weight
    and fails on others."""
    tensors = dict(floats)
    conf = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
    for n, L in quant.items():
        if L.get("convrot"):
            tensors.update(core_convrot_tensors(n, L))
            continue
        L = fold_smoothing(L)
        tensors[f"{n}.weight"] = L["qweight"].to(torch.int8)
        tensors[f"{n}.weight_scale"] = L["weight_scale"].float().reshape(-1, 1)
        tensors[f"{n}.comfy_quant"] = conf.clone()
        if L.get("bias") is not None:
            tensors[f"{n}.bias"] = L["bias"]
    return atomic_save(tensors, path, {"format": "pt"}, overwrite)


def core_convrot_tensors(name: str, layer: dict) -> dict[str, torch.Tensor]:
    """A ConvRot layer (weights rotated with group size ``layer["convrot"]``, never smoothed) in ComfyUI core's
    layout: ``int8_tensorwise`` with ``"convrot": true`` and ``"convrot_groupsize"`` in ``comfy_quant``, the
    per-channel scale as [N, 1] (the shape comfy-kitchen's own ConvRot quantizer writes)."""
    if layer.get("smooth") is not None:
        raise ValueError(f"{name}: a ConvRot layer cannot carry SmoothQuant smoothing")
    conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": int(layer["convrot"])}
    out = {f"{name}.weight": layer["qweight"].to(torch.int8),
           f"{name}.weight_scale": layer["weight_scale"].float().reshape(-1, 1),
           f"{name}.comfy_quant": torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)}
    if layer.get("bias") is not None:
        out[f"{name}.bias"] = layer["bias"]
    return out


def write_transformerlab(path: str, branches: dict[str, tuple[dict, dict]], *, overwrite: bool = False,
                         scale_shape: str = "vector", prefixes=("conditional.", "unconditional."),
                         metadata: dict | None = None) -> str:
    """The transformerlab W8A8 layout as this pack assumes it (``wq``/``ws``/``smooth``/``bias``, branch
    prefixes). Used to make test miniatures; ``scale_shape`` "vector" [N], "column" [N, 1]."""
    pre = dict(zip(("conditional", "unconditional"), prefixes))
    tensors = {}
    for br, (quant, floats) in branches.items():
        p = pre[br] if br else ""
        for n, t in floats.items():
            tensors[p + n] = t
        for n, L in quant.items():
            s = L["weight_scale"].float().reshape(-1)
            tensors[f"{p}{n}.wq"] = L["qweight"].to(torch.int8)
            tensors[f"{p}{n}.ws"] = s[:, None] if scale_shape == "column" else s
            if L.get("bias") is not None:
                tensors[f"{p}{n}.bias"] = L["bias"]
            if L.get("smooth") is not None:
                tensors[f"{p}{n}.smooth"] = L["smooth"].float()
    return atomic_save(tensors, path, metadata, overwrite)
