"""W8A8 INT8 kernels (Triton): per-token activation quantization and a fused dequant GEMM.

Public API (torch + triton only; importing this package imports neither triton nor CUDA — both load on the
first kernel call, so ComfyUI imports the pack instantly):

- ``triton_status(device)`` -> (usable, reason)
- ``quantize_per_token(x [M, K], inv_smooth [K] | None)`` -> (int8 [M, K], fp32 scale [M])
- ``int8_gemm(a_q [M, K], a_scale [M], w_q [N, K], w_scale [N], bias [N] | None)`` -> [M, N]
- ``int8_linear(x [..., K], w_q, w_scale, bias, inv_smooth)`` -> [..., N] (quantize, then GEMM; for M <= 16
  one launch that quantizes inside the GEMM, bit-identical)
- ``int8_gemm_lora(a_q, a_scale, w_q, w_scale, bias, lora_down [R, K], lora_up [N, R])`` -> [M, N]: the GEMM
  plus a LoRA read from the same int8 input, its up-projection added in the epilogue (``kernel.lora``)
- ``int8_linear_planned`` / ``int8_gemm_planned`` / ``int8_gemm_lora_planned``: the call and a
  ``kernel.plan.Plan`` that repeats it with less
  host work for operands of the same signature
- ``int8_linear_op(...)``: the same through the ``torch.ops.int8_fused.linear`` custom op (torch.compile)

Numerics follow ``quant/quantize.py`` bit for bit (quantizer, int32 accumulator); the epilogue is fp32.

This package only re-exports: the linear / GEMM entry points live in ``kernel/linear.py``, the custom ops in
``kernel/ops.py``, the checks in ``kernel/checks.py``; no module of the package imports a name from here.

Also the pack's base layer, since this package imports nothing else of the pack: ``kernel.config`` (every
environment switch) and ``kernel.atomic`` (atomic file writes).
"""
from __future__ import annotations

from . import config  # noqa: F401  (kernel.config)
from .checks import (FLOAT_IN, check_2d, check_usable, gemm_operands, small_m_operands,  # noqa: F401
                     smooth_vector, triton_status)
from .config import force_generation, gemm_switches  # noqa: F401  (kernel.gemm_switches)
from .linear import (SMALL_M_MAX_K, SMALL_M_ROWS, int8_gemm, int8_gemm_lora, int8_gemm_lora_planned,  # noqa: F401
                     int8_gemm_planned, int8_linear, int8_linear_planned, quantize_per_token)
from .ops import linear_op as int8_linear_op, register_ops  # noqa: F401  (torch only: registers nothing at import)

__all__ = ["triton_status", "quantize_per_token", "int8_gemm", "int8_linear", "int8_linear_planned",
           "int8_gemm_planned", "int8_gemm_lora", "int8_gemm_lora_planned", "int8_linear_op",
           "register_ops"]
