#!/usr/bin/env bash
# The pack's demo on a fresh machine: builds the pinned runtime (reused when there), writes a miniature
# DiT, starts ComfyUI with the pack (0.33.0 from ../shared/comfyui when there, else the pinned 0.3.75), queues example_workflows/int8_fused_miniature_demo.json with
# every backend this machine runs, saves the outputs under output/ and prints timing and error tables.
# Options go to scripts/demo.py (e.g. `bash scripts/demo.sh --arch flux --steps 4`).
# `--full-size --arch flux|zimage|wan|ideogram4` measures the full-size model on this machine's NVIDIA GPU instead
# (scripts/full_size.py). With `--comfy PATH`, $COMFYUI_CURRENT, or from a clone in ComfyUI/custom_nodes, it runs on
# that ComfyUI with $COMFYUI_PYTHON (else $COMFYUI_CURRENT_PYTHON, that ComfyUI's venv/ or .venv/ Python, python3)
# and builds no runtime; otherwise on the demo's runtime (ComfyUI 0.33.0 from ../shared/comfyui).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
full=0 comfy="" prev=""
for x in "$@"; do
  case "$x" in --full-size) full=1 ;; --comfy=*) comfy="${x#--comfy=}" ;; esac
  [ "$prev" = "--comfy" ] && comfy="$x"
  prev="$x"
done
if [ "$full" = 1 ]; then
  extra=() py="${COMFYUI_PYTHON:-}"
  if [ -z "$comfy" ] && [ -n "${COMFYUI_CURRENT:-}" ]; then
    comfy="$COMFYUI_CURRENT"; py="${py:-${COMFYUI_CURRENT_PYTHON:-}}"
  elif [ -z "$comfy" ] && [ "$(basename "$(dirname "$here")")" = custom_nodes ] \
      && [ -f "$(dirname "$(dirname "$here")")/main.py" ]; then  # by name: a linked clone's .. is its target's
    comfy="$(dirname "$(dirname "$here")")"; extra=(--comfy "$comfy")   # the ComfyUI this clone sits in
  fi
  if [ -n "$comfy" ]; then
    for c in "$comfy/venv/bin/python" "$comfy/.venv/bin/python"; do
      if [ -z "$py" ] && [ -x "$c" ]; then py="$c"; fi
    done
    # relative --comfy / --out paths: from the caller's folder
    exec "${py:-python3}" "$here/scripts/full_size.py" "$@" ${extra[@]+"${extra[@]}"}
  fi
fi
cd "$here"
bash scripts/setup_runtime.sh
rt="${INT8_RUNTIME_DIR:-$here/.runtime}"
export INT8_RUNTIME_DIR="$rt"
if [ -z "${COMFYUI_CURRENT:-}" ] && [ -f "$rt/ComfyUI-current/main.py" ]; then
  export COMFYUI_CURRENT="$rt/ComfyUI-current" COMFYUI_CURRENT_PYTHON="$rt/venv-current/bin/python"
fi
if [ "$full" = 1 ]; then
  exec "${COMFYUI_CURRENT_PYTHON:-$rt/venv/bin/python}" scripts/full_size.py "$@"
fi
exec "$rt/venv/bin/python" scripts/demo.py "$@"
