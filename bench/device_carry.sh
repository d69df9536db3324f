#!/usr/bin/env bash
# Builds .carry/ (ignored, never committed) for the H200 device machine, which has torch + triton but no
# ComfyUI, no comfy-aimdo / comfy-kitchen and no network:
#   .carry/comfy  ComfyUI 0.33.0 from ../shared/comfyui (minus openapi.yaml and comfy_api_nodes)
#   .carry/whl    cp312 wheels: comfy-aimdo 0.4.13 (0.33.0's pin), simpleeval, blake3, torchsde, trampoline;
#                 sageattention 1.0.6 (Triton kernels only: the `~user:sage` / `~sage` bench paths, issue 50)
#   .carry/ck     comfy-kitchen 0.2.31 unpacked, its HIP library dropped (64 MiB transfer limit)
# PyAV (35 MB wheel, too big to carry) is not carried: comfy_api imports its video types at import time, and the
# benches serve a stand-in `av` where it does not import (bench/lib/av_standin.py); nothing in them touches video.
# On the device: python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whl/*.whl
#                export PYTHONPATH=/tmp/site:$PWD/.carry/ck
set -euo pipefail
cd "$(dirname "$0")/.."
c=.carry; mkdir -p $c/whl
rm -rf $c/comfy && cp -r ../shared/comfyui $c/comfy && chmod -R u+w $c/comfy && rm -rf $c/comfy/openapi.yaml $c/comfy/comfy_api_nodes
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$1" "$2" 2>&1 | { grep -v "is ignored" || true; }; }
for p in comfy-aimdo==0.4.13 simpleeval blake3 torchsde trampoline sageattention==1.0.6; do dl $c/whl $p; done
if [ ! -d $c/ck/comfy_kitchen ]; then
  tmp=$(mktemp -d); dl "$tmp" comfy-kitchen==0.2.31
  mkdir -p $c/ck && (cd $c/ck && python3 -m zipfile -e "$tmp"/comfy_kitchen-*.whl .) && rm -rf "$tmp"
  rm -f $c/ck/comfy_kitchen/backends/hip/_C.abi3.so
fi
echo "[carry] $(du -sh $c | cut -f1) in $c"
