"""Torch-level INT8 quantization: quantizers, the INT8 linear module, backends, formats, calibration.

Nothing here imports ComfyUI; Triton is imported lazily by the backends that need it.
"""

import importlib


def kernel_module(sub: str = ""):
    """The pack's ``kernel`` package, or its submodule ``sub`` (``"config"``, ``"atomic"``), imported on first
    use (it imports Triton lazily in turn).

    ``quant`` is a top-level package in tests and ``<pack folder>.quant`` inside ComfyUI; the kernel
    package sits beside it in both cases.
    """
    parent = __name__.rpartition(".")[0]
    base = f"{parent}.kernel" if parent else "kernel"
    return importlib.import_module(f"{base}.{sub}" if sub else base)
