#!/usr/bin/env bash
# One call on the H200 device machine: the fused-kernel bench and the end-to-end Ideogram 4 bench.
#
# The device machine has torch + triton but no ComfyUI and no network, so the call carries (ignored
# folders, never committed): .carry/comfy = a current ComfyUI tree (comfy/, comfy_extras/, comfy_api/,
# comfy_execution/, comfy_config/, utils/, app/, middleware/, top-level .py) exported from a public
# snapshot; .carry/whl = wheels of comfy-aimdo, simpleeval, blake3, torchsde, trampoline (cp312);
# .whl/site = comfy-kitchen unpacked (its HIP library dropped to fit the 64 MiB transfer limit).
#   usage (device): BENCH_COMMIT=<sha> bash bench/h200_run.sh [e2e paths]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/site
export INT8_FUSED_CACHE_DIR=$OUT/autotune
{ nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/gpu.txt"
timeout 90 python3 bench/fused.py --out "$OUT/h200-fused.json" 2>&1 | tee "$OUT/fused.log" | tail -25
paths=${1:-bf16,pack:fused_triton,nofuse:fused_triton,fp8_fast,core_int8,pack:torch_int_mm,pack:fp8_rowwise,pack:dequant_bf16,compile:fused_triton}
timeout ${E2E_TIMEOUT:-450} python3 bench/e2e.py --comfy .carry/comfy --paths "$paths" --warmup 2 --iters 8 \
  --profile pack:fused_triton,bf16 --out "$OUT/h200-e2e.json" 2>&1 | grep -v -i warn | tee "$OUT/e2e.log"
