#!/usr/bin/env bash
# The H200 benchmark suites, one device call each (every suite finishes in under 10 minutes on one H200; `cold` is
# split by model, see there). They run on the H100 as well (the `cold` suite is meant for both).
#
#   usage (on the device machine, from the repository root):
#     BENCH_COMMIT=<commit> INT8_FUSED_CACHE_DIR=/tmp/<name> bash bench/h200.sh <suite> [<suite> ...]
#     BENCH_COMMIT=<commit> bash bench/h200.sh exec <command ...>   # any command, with the same setup
#   Results land in $OUT (default /tmp/h200-out): one JSON per bench plus its log, gpu.txt (GPU, driver, torch,
#   Triton, CUDA, commit), cache/ (the tuning caches the run wrote). BENCH_COMMIT names the tree sent (the device copy's git HEAD is stale); a fresh
#   INT8_FUSED_CACHE_DIR makes the run tune every kernel again (the first call of each shape then includes tuning).
#   Needs what bench/device_carry.sh builds here: .carry/comfy .carry/whl .carry/ck.zip (or .carry/ck).
#
# Suites:
#   kernels  bench/kernels.py: the quantizer and GEMM checked bit for bit on the GPU (against the torch reference
#            and torch._int_mm), then every W8A8 path at Ideogram 4's block shapes (bf16, dequantize-to-bf16,
#            torch._int_mm, FP8 row-wise, fp8_e4m3fn_fast, comfy-kitchen, the pack); bench/attention.py --check:
#            the pack's INT8 attention checked, then timed against SDPA flash / cuDNN / efficient.
#   shapes   bench/shapes.py: every linear shape of Ideogram 4, Flux.1, Z-Image, Wan 2.x and SD3.5 (55 shapes):
#            bf16, fp8_e4m3fn_fast, the pack's INT8 forced and as dispatched; host-bound shapes also as streams
#            of calls against an nn.Linear (15 rounds). All 55 took 207 s with a fresh autotune folder (fcad30a).
#   fused    bench/fused.py: each fused row kernel against the torch ops it replaces at M 4608 (time, bandwidth,
#            int8 code flips).
#   host     bench/host_int8.py: host time of each layer of the INT8 call stack on a problem too small for the
#            GPU to matter (M 64 x K 256 x N 256).
#   sampler  bench/e2e_sampler.py: Ideogram 4 (34 layers, random weights) at 1024², DualModelGuider, 6 euler steps
#            through ComfyUI 0.33.0's sampler under DynamicVRAM, in one process: bf16, the pack, fp8_e4m3fn_fast
#            with cuDNN attention, fp8_e4m3fn_fast with comfy-kitchen attention, the pack again (235 s of wall
#            time at 822c06c, with a short row-kernel sweep before it).
#   models   bench/e2e_models.py: Flux.1-dev 1024², Z-Image 1024², Wan 2.1 1.3B 480p 33 frames, one forward a
#            step: bf16, the pack, fp8_e4m3fn_fast, the pack again (249 s of wall time at 822c06c).
#   cold     [--models M[,M]] [--paths P[,P]]  issue 48's cold starts, bench/e2e_models.py --cold: each (model, path)
#            in a fresh process on new, empty INT8_FUSED_CACHE_DIR and TRITON_CACHE_DIR (first_sample_s), warm
#            samples at the main resolution (s/step, peak VRAM, host RAM), then the first and the warm sample at a
#            second resolution (768x768; Wan 384x672: second_res_first_s, second_res_warm_s), then a second fresh
#            process on the first's (now warm) cache folders (second_process_first_s). Paths bf16, fp8_fast
#            (fp8_e4m3fn_fast), core_int8, pack:fused_triton; models Flux.1, Z-Image, Ideogram 4 with DualModelGuider
#            (ideogram4_dual: two 34-layer backbones, cfg 4) and Wan 2.1 1.3B. Eight processes a model, each
#            building its full-size state dict: not timed yet as a whole, so run ONE MODEL A CALL
#            (cold --models flux; zimage; wan13; ideogram4_dual), and Ideogram 4 in two calls if one runs past the
#            limit (--paths bf16,pack:fused_triton, then --paths fp8_fast,core_int8). Writes
#            $OUT/<gpu>-cold-<models>[-<paths>].json (<gpu>: h100, h200, ... from nvidia-smi); copied to
#            bench/results/cold-runs/<gpu>-cold-<commit>-<models>[-<paths>].json, bench/lib/merge.py merges them into
#            bench/results/<gpu>-cold.json with issue 48's checks. Run it on nvidia-h100-x1 (no shipped picks) and
#            on nvidia-h200. BENCH_EXTRA: more flags for bench/e2e_models.py (e.g. "--tax-sample pack:fused_triton").
#   lora     bench/lora.py --profile (issue 50): Flux.1 with the LoRA inside the GEMM, Flux.1 with the branch pair
#            (INT8_FUSED_LORA_EPILOGUE=0), Wan 2.1 1.3B; 0 / 1 / 3 rank-32 LoRAs on every block linear, each row's top
#            GPU kernels and how its LoRAs ran. Writes $OUT/<gpu>-lora-{flux,flux-pair,wan13}.json (about 5 minutes).
#   multigpu (a two-GPU kind: nvidia-h100-x2 / nvidia-h200-x2; issue 51) Ideogram 4 DualModelGuider with the pack, one
#            GPU and then the unconditional backbone on cuda:1 (the pack's Dual Model Guider (two GPUs)); Flux.1 at
#            cfg 3.5, bf16 and the pack, one GPU and then through MultiGPU CFG Split (max_gpus 2). Writes
#            $OUT/<gpu>x2-multigpu-{dual,flux}-{1gpu,2gpu}.json (targets: 2 GPUs >= 1.8x one GPU's whole sample).
#   check    after a change that must not change outputs: Ideogram 4 dual (bf16, pack, pack) and Flux.1 (bf16,
#            pack, pack), then the pack rows' final-latent rel L2 against bf16 compared with the recorded values
#            (equal to the last digit = the same output bits; step times to compare with bench/RESULTS.md).
#   exec     the rest of the line as a command, after the same setup (a bench without a suite, a check:
#            exec python3 bench/checks/consumer_tiles.py --out $OUT/h200-consumer-tiles.json
#            exec python3 bench/checks/save_roundtrip.py --comfy .carry/comfy --out $OUT/h200-save-roundtrip.json).
set -uo pipefail
[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 INT8_FUSED_CACHE_DIR=${INT8_FUSED_CACHE_DIR:-$OUT/autotune}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl || exit 1
ck=$PWD/.carry/ck
if [ -f .carry/ck.zip ]; then
  [ -d /tmp/ck/comfy_kitchen ] || { mkdir -p /tmp/ck && python3 -m zipfile -e .carry/ck.zip /tmp/ck; }
  ck=/tmp/ck
fi
export PYTHONPATH=/tmp/site:$ck
{ nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  echo "commit: ${BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
} 2>&1 | tee "$OUT/gpu.txt"
# the caches the run wrote (GEMM tiles, int8-vs-float dispatch, attention backends) come back in $OUT/cache: the
# seeds of the shipped tuned tables (bench/checks/tuned_tables.py $OUT/cache)
keep_caches() { mkdir -p "$OUT/cache" && cp "$INT8_FUSED_CACHE_DIR"/*.json "$OUT/cache/" 2>/dev/null; true; }
trap keep_caches EXIT
if [ "$1" = exec ]; then shift; "$@"; exit $?; fi
sampler="python3 bench/e2e_sampler.py --comfy .carry/comfy --res 1024 --workflows dual --steps 6"
models="python3 bench/e2e_models.py --comfy .carry/comfy --steps 6"
# the GPU's short name for result files: "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H200" -> h200
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z' 'a-z' \
  | grep -oE '\b[a-z]?[0-9]{3,4}[a-z]?\b' | head -1)
gpu=${gpu:-gpu}
while [ $# -gt 0 ]; do
suite=$1; shift
case $suite in
  kernels)
    timeout 240 python3 bench/kernels.py --commit "${BENCH_COMMIT:-}" --out "$OUT/h200-kernels.json" 2>&1 \
      | tee "$OUT/kernels.log"
    timeout 260 python3 bench/attention.py --check --out "$OUT/h200-attention.json" 2>&1 | tee "$OUT/attention.log" ;;
  shapes)
    timeout 400 python3 bench/shapes.py --stream-rounds 15 --budget-s 300 --out "$OUT/h200-shapes.json" 2>&1 \
      | tee "$OUT/shapes.log" ;;
  fused)
    timeout 90 python3 bench/fused.py --out "$OUT/h200-fused.json" 2>&1 | tee "$OUT/fused.log" ;;
  host)
    timeout 120 python3 bench/host_int8.py --json "$OUT/h200-host-int8.json" 2>&1 | tee "$OUT/host-int8.log" ;;
  sampler)
    timeout 480 $sampler --paths "bf16,pack:fused_triton,fp8_fast~cudnn,fp8_fast~kitchen,pack:fused_triton" \
      --out "$OUT/h200-e2e-sampler.json" 2>&1 | tee "$OUT/sampler.log" ;;
  models)
    timeout 540 $models --models flux,zimage,wan13 --paths "bf16,pack:fused_triton,fp8_fast,pack:fused_triton" \
      --out "$OUT/h200-e2e-models.json" 2>&1 | tee "$OUT/models.log" ;;
  cold)
    cm=flux,zimage,ideogram4_dual,wan13 cp=bf16,fp8_fast,core_int8,pack:fused_triton ctag=
    while [ $# -gt 0 ]; do
      case $1 in
        --models) cm=$2; shift 2 ;;
        --paths) cp=$2; ctag=-${2//[:,]/-}; shift 2 ;;
        *) break ;;
      esac
    done
    name="$gpu-cold-${cm//,/-}$ctag"
    timeout 560 $models --cold --models "$cm" --paths "$cp" --child-timeout 300 ${BENCH_EXTRA:-} \
      --out "$OUT/$name.json" 2>&1 \
      | tee "$OUT/$name.log" ;;
  lora)
    # issue 50: LoRA after Apply (0 / 1 / 3 rank-32 LoRAs), inside the GEMM and as the branch pair, with each row's
    # GPU profile (top kernels) and how its LoRAs ran
    lora="python3 bench/lora.py --comfy .carry/comfy --profile"
    timeout 150 $lora --models flux --out "$OUT/$gpu-lora-flux.json" 2>&1 | tee "$OUT/lora.log"
    INT8_FUSED_LORA_EPILOGUE=0 timeout 150 $lora --models flux --out "$OUT/$gpu-lora-flux-pair.json" 2>&1 \
      | tee -a "$OUT/lora.log"
    timeout 120 $lora --models wan13 --out "$OUT/$gpu-lora-wan13.json" 2>&1 | tee -a "$OUT/lora.log" ;;
  multigpu)
    for n in 1 2; do
      dev=(); split=(); [ "$n" = 2 ] && dev=(--negative-device cuda:1) && split=(--multigpu 2)
      timeout 280 $models --models ideogram4_dual --paths pack:fused_triton "${dev[@]}" \
        --out "$OUT/${gpu}x2-multigpu-dual-${n}gpu.json" 2>&1 | tee "$OUT/multigpu-dual-${n}gpu.log"
      timeout 280 $models --models flux --cfg 3.5 --paths bf16,pack:fused_triton "${split[@]}" \
        --out "$OUT/${gpu}x2-multigpu-flux-${n}gpu.json" 2>&1 | tee "$OUT/multigpu-flux-${n}gpu.log"
    done ;;
  check)
    timeout 330 $sampler --paths "bf16,pack:fused_triton,pack:fused_triton" --out "$OUT/check-sampler.json" 2>&1 \
      | tee "$OUT/check-sampler.log"
    timeout 240 $models --models flux --paths "bf16,pack:fused_triton,pack:fused_triton" \
      --out "$OUT/check-models.json" 2>&1 | tee "$OUT/check-models.log"
    # The pack rows' rel L2 against bf16 as recorded at 822c06c (bench/results/*-runs/*-822c06c.json).
    python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
want = {("ideogram4", "pack:fused_triton"): 0.033619217574596405, ("flux", "pack:fused_triton"): 0.013207584619522095}
ok = True
for name, model in (("check-sampler.json", "ideogram4"), ("check-models.json", None)):
    f = Path(sys.argv[1]) / name
    rows = json.loads(f.read_text())["rows"] if f.exists() else []
    for r in rows:
        key = (r.get("model", model), r.get("path"))
        if key in want and "rel_l2_vs_bf16" in r:
            same = r["rel_l2_vs_bf16"] == want[key]
            ok &= same
            print(f"{key[0]} {key[1]}: rel L2 {r['rel_l2_vs_bf16']!r} (recorded {want[key]!r}) "
                  f"{'same bits' if same else 'DIFFERENT'}; {r.get('s_per_step', float('nan')):.4f} s/step")
    if not rows:
        ok = False
        print(f"{name}: no rows")
print("check:", "PASS" if ok else "FAIL")
EOF
    ;;
  *) echo "unknown suite $suite (kernels, shapes, fused, host, sampler, models, cold, check, exec)"; exit 2 ;;
esac
done
