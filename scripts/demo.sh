#!/usr/bin/env bash
# The pack's demo on a fresh machine: builds the pinned runtime (reused when there), writes a miniature
# DiT, starts ComfyUI with the pack (0.33.0 from ../shared/comfyui when there, else the pinned 0.3.75), queues example_workflows/int8_fused_miniature_demo.json with
# every backend this machine runs, saves the outputs under output/ and prints timing and error tables.
# Options go to scripts/demo.py (e.g. `bash scripts/demo.sh --arch flux --steps 4`).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
bash scripts/setup_runtime.sh
rt="${INT8_RUNTIME_DIR:-$here/.runtime}"
export INT8_RUNTIME_DIR="$rt"
if [ -z "${COMFYUI_CURRENT:-}" ] && [ -f "$rt/ComfyUI-current/main.py" ]; then
  export COMFYUI_CURRENT="$rt/ComfyUI-current" COMFYUI_CURRENT_PYTHON="$rt/venv-current/bin/python"
fi
exec "$rt/venv/bin/python" scripts/demo.py "$@"
