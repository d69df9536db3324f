#!/usr/bin/env bash
# Sets up the pinned runtime (scripts/setup_runtime.sh; reused when already built) and runs the whole
# test suite against it on the CPU. Extra arguments go to pytest (e.g. `bash scripts/test.sh -k apply`).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
bash scripts/setup_runtime.sh
rt="${INT8_RUNTIME_DIR:-$here/.runtime}"
export TRITON_INTERPRET=1          # Triton kernels run in the interpreter (no GPU here)
export PYTHONDONTWRITEBYTECODE=1
export INT8_RUNTIME_DIR="$rt"
# ComfyUI 0.33.0 (from ../shared/comfyui, set up by setup_runtime.sh): the tests that need a current
# ComfyUI run there; without it they skip, naming COMFYUI_CURRENT.
if [ -z "${COMFYUI_CURRENT:-}" ] && [ -f "$rt/ComfyUI-current/main.py" ]; then
  export COMFYUI_CURRENT="$rt/ComfyUI-current" COMFYUI_CURRENT_PYTHON="$rt/venv-current/bin/python"
fi
echo "[test] current ComfyUI: ${COMFYUI_CURRENT:-none (tests needing it skip)}"
t0=$SECONDS
rc=0
"$rt/venv/bin/python" -m pytest -q -rfEs --timeout=1200 --durations=15 "$@" || rc=$?
echo "[test] pytest finished in $((SECONDS - t0)) s (exit $rc)"
if [ "$rc" -eq 5 ]; then
  echo "[test] ERROR: pytest collected no tests"; exit 1
fi
exit "$rc"
