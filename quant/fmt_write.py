"""Writers for the INT8 checkpoint layouts read by ``quant.formats``; every write is atomic.

A file is written to ``<dir>/.<name>.<pid>.tmp`` and renamed over the target with ``os.replace`` (atomic
on one filesystem), so a crash never leaves a half-written model under the real name; an existing target
is an error (``OutputExistsError``) unless ``overwrite=True``. A process killed while writing leaves its
temporary behind: every save removes the stale temporaries of this naming in its folder (``clean_stale``).

Layer tensors are passed in the normalized form ``quant.formats`` reads back: per quantized linear a dict
``{"qweight": int8 [N, K], "weight_scale": fp32 [N], "bias": [N] | None, "smooth": fp32 [K] | None}``
(``smooth`` a divisor: activations ``x / s``, ``qweight = Q(W * s)``), float tensors as they are.
"""
from __future__ import annotations

import json
import os
import re
import time

import torch

from .formats import FMT_PACK, PACK_FORMAT_VERSION, OutputExistsError
from .quantize import dequantize, quantize_weight_per_channel

# Temporaries of atomic_save (".<name>.<pid>.tmp") and of the calibration writer of earlier versions
# (tempfile ".tmp-XXXXXXXX.safetensors").
_TMP = re.compile(r"^\.(?:.+\.safetensors\.(\d+)\.tmp|tmp-[a-z0-9_]{8}\.safetensors)$")
STALE_AGE_S = 24 * 3600


def _pid_alive(pid: int) -> bool | None:
    """Whether process ``pid`` runs (POSIX); None when that cannot be told (Windows)."""
    if pid == os.getpid():
        return True
    if os.name != "posix":
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def clean_stale(folder: str) -> list[str]:
    """Remove leftover temporaries of this module's naming in ``folder`` (not recursive): those whose
    writer process is gone, and any older than ``STALE_AGE_S``. Returns the removed paths."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    now = time.time()
    for n in names:
        m = _TMP.match(n)
        if m is None:
            continue
        p = os.path.join(folder, n)
        try:
            old = now - os.path.getmtime(p) > STALE_AGE_S
            if old or (m.group(1) is not None and _pid_alive(int(m.group(1))) is False):
                os.remove(p)
                removed.append(p)
        except OSError:
            continue
    return removed


def _invalid_name(path: str) -> str | None:
    if "\x00" in os.fspath(path):
        return "it contains a NUL character"
    return None


def atomic_save(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None,
                overwrite: bool = False) -> str:
    """Write ``tensors`` as safetensors at ``path`` atomically; returns the path.

    Raises OutputExistsError when ``path`` exists (also when it appears while writing) and ``overwrite``
    is off, ValueError for a path holding NUL."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    why = _invalid_name(path)
    if why:
        raise ValueError(f"invalid file name {path!r}: {why}")
    if os.path.exists(path) and not overwrite:
        raise OutputExistsError(f"{path} already exists; choose another name or turn overwrite on")
    d, base = os.path.split(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    clean_stale(d)
    tmp = os.path.join(d, f".{base}.{os.getpid()}.tmp")
    try:
        save_file(_unshared(tensors), tmp, metadata=metadata)
        if not overwrite and os.path.exists(path):
            raise OutputExistsError(f"{path} appeared while saving; not overwritten. Choose another name or "
                                    "turn overwrite on")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


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
                    overwrite: bool = False, scale_shape: str = "vector") -> str:
    """ComfyUI core ``int8_tensorwise``: ``<p>.weight`` int8, ``<p>.weight_scale`` fp32 [N] (or [N, 1] with
    ``scale_shape="column"``), ``<p>.comfy_quant`` JSON. Smoothed layers are folded (``fold_smoothing``).
    Loads in plain ComfyUI (with comfy-kitchen) without this pack."""
    tensors = dict(floats)
    conf = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
    for n, L in quant.items():
        L = fold_smoothing(L)
        s = L["weight_scale"].float().reshape(-1)
        tensors[f"{n}.weight"] = L["qweight"].to(torch.int8)
        tensors[f"{n}.weight_scale"] = s[:, None] if scale_shape == "column" else s
        tensors[f"{n}.comfy_quant"] = conf.clone()
        if L.get("bias") is not None:
            tensors[f"{n}.bias"] = L["bias"]
    return atomic_save(tensors, path, {"format": "pt"}, overwrite)


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
