"""Torch-level INT8 quantization: quantizers, the INT8 linear module, backends, formats, calibration.

Nothing here imports ComfyUI; Triton is imported lazily by the backends that need it. The pack's kernels are
``..kernel`` (relative imports; tests import the pack the one way ``tests/pack_import.py`` sets up).
"""
