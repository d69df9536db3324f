#!/usr/bin/env bash
# The pack's demo on a fresh machine: builds the pinned runtime (reused when there), writes a miniature
# DiT, starts ComfyUI 0.3.75 with the pack, queues example_workflows/int8_fused_miniature_demo.json with
# every backend this machine runs, saves the outputs under output/ and prints timing and error tables.
# Options go to scripts/demo.py (e.g. `bash scripts/demo.sh --arch flux --steps 4`).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
bash scripts/setup_runtime.sh
rt="${INT8_RUNTIME_DIR:-$here/.runtime}"
export INT8_RUNTIME_DIR="$rt"
exec "$rt/venv/bin/python" scripts/demo.py "$@"
