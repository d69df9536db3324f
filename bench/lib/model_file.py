"""Random-weight models as files on disk, loaded the way ComfyUI loads a checkpoint (issue 50: host RAM as users see it).

``write(path, layout, tensors)`` writes a safetensors file one tensor at a time: ``layout`` ([(key, shape, dtype)])
gives the header up front, ``tensors`` yields (key, CPU tensor) in the same order, so the process never holds more
than one tensor of the model (a 24 GB Flux.1 file is written from a machine with little RAM). The file is written
under a temporary name and renamed when complete: a file that exists is whole. ``core_int8(src, dst, pick, device)``
writes ComfyUI core's ``int8_tensorwise`` file of ``src`` the same way (the linears ``pick(prefix, shape)`` selects
quantized on ``device`` per output channel by ``bench/lib/e2e.py``'s ``core_int8_entries``, as its
``core_int8_state_dict`` does in memory).
The benches then load either with ``comfy.sd.load_diffusion_model`` (UNETLoader's call).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "int8": "I8", "uint8": "U8"}


def _name(dtype) -> str:
    return DTYPES[str(dtype).replace("torch.", "")]


def _size(shape, dtype) -> int:
    import torch
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def write(path, layout, tensors, metadata: dict | None = None) -> int:
    """Writes ``tensors`` (an iterable of (key, tensor) in ``layout``'s order) to the safetensors file ``path``;
    returns its size in bytes. Raises ValueError when a tensor does not match its layout entry."""
    import torch
    path = Path(path)
    header, off = {}, 0
    for key, shape, dtype in layout:
        n = _size(shape, dtype)
        header[key] = {"dtype": _name(dtype), "shape": [int(d) for d in shape], "data_offsets": [off, off + n]}
        off += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + f".part{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            it = iter(tensors)
            for key, shape, dtype in layout:
                k, t = next(it)
                if k != key or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise ValueError(f"{path.name}: tensor {k} {tuple(t.shape)} {t.dtype} where the layout has "
                                     f"{key} {tuple(shape)} {dtype}")
                f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path.stat().st_size


def core_int8(src, dst, pick, device) -> int:
    """ComfyUI core's ``int8_tensorwise`` file ``dst`` of the float safetensors file ``src``: each 2-D ``.weight``
    that ``pick(prefix, shape)`` selects as int8 codes with a per-output-channel ``weight_scale`` [N, 1] (absmax /
    127) and its ``comfy_quant`` entry; everything else as stored. Read and written one tensor at a time."""
    import torch
    from safetensors import safe_open
    from bench.lib.e2e import CORE_CONF, core_int8_entries
    with safe_open(str(src), framework="pt", device="cpu") as f:
        keys = list(f.keys())
        layout, plan = [], []
        for k in keys:
            sl = f.get_slice(k)
            shape, p = tuple(sl.get_shape()), k[: -len(".weight")]
            if k.endswith(".weight") and len(shape) == 2 and pick(p, shape):
                layout += [(k, shape, torch.int8), (f"{p}.weight_scale", (shape[0], 1), torch.float32),
                           (f"{p}.comfy_quant", (len(CORE_CONF),), torch.uint8)]
                plan.append((k, True))
            else:
                dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[sl.get_dtype()]
                layout.append((k, shape, dt))
                plan.append((k, False))

        def tensors():
            for k, quantize in plan:
                v = f.get_tensor(k)
                if quantize:
                    yield from core_int8_entries(k[: -len(".weight")], v, device).items()
                else:
                    yield k, v
        return write(dst, layout, tensors())


def params(path) -> int:
    """The number of elements in the safetensors file ``path`` (its header only)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    total = 0
    for k, v in header.items():
        if k != "__metadata__":
            c = 1
            for d in v["shape"]:
                c *= d
            total += c
    return total
