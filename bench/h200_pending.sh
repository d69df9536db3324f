#!/usr/bin/env bash
# The H200 measurements issues 13 and 14 still need, in three device calls of under 10 minutes each
# (this script is the command: `bash bench/h200_pending.sh <stage>`; results land in $OUT).
#   kernels   bench/attention.py (own INT8 attention vs SDPA flash/cuDNN/efficient and comfy-kitchen, L 4608 /
#             4096 / 2816, head_dim 256, masked and not) and bench/shapes.py (every block linear of Ideogram 4,
#             Flux, Wan, SD3.5, Z-Image and the odd shapes: bf16, fp8_fast, INT8 forced, dispatched)
#   ideogram  bench/e2e_sampler.py, Ideogram 4 at 1024², DualModelGuider, the anchors of issue 14 in one run
#             (bf16 and fp8_fast with ComfyUI's attention, cuDNN first and comfy-kitchen attention; the pack with
#             its attention modes), then 100 padded text tokens, then VRAM pressure rows
#   pressure  the pack and core INT8 batched with 6 GiB of VRAM left free (eviction path)
#   models    bench/e2e_models.py: Flux.1, Z-Image, Wan 2.1 1.3B, Ideogram 4, bf16 / fp8_fast / pack
#   attn-models  bench/fused.py (with the residual-tail diagnosis), then Flux / Z-Image / Wan with cuDNN-first
#             attention (bf16~cudnn, fp8_fast~cudnn, the pack's auto routing, profiled)
#   gemm      bench/gemm_variants.py: persistent TMA INT8 GEMMs (with / without warp specialisation) vs the pack's
#             kernel, cuBLAS FP8 and bf16
#   defaults  the pack as it defaults now (attention auto, residual tail without FMA): Ideogram 4 dual and
#             Flux / Z-Image / Wan, each beside bf16, profiled (the next call to make: these defaults are not timed)
#   qkrope    Flux with INT8_FUSED_QK_ROPE=1 (QK norm + RoPE + attention layout in one kernel), profiled
#   sweep     bench/fused_sweep.py: tile plans of the row kernels, GELU + quantize (Flux, Wan) included
#   residual  Ideogram 4 with INT8_FUSED_RESIDUAL=1 (bf16 reference and the pack with auto attention)
#   alu       bench/fused_sweep.py --quick with INT8_FUSED_ALU_ROUND off and on (time, same output digests)
#   final     the committed defaults: Ideogram 4 dual (bf16, fp8_fast~cudnn, pack) and Flux / Z-Image / Wan (bf16, fp8_fast, pack)
#   layout    q / k / v in [B, L, H, D] memory: Ideogram 4 with INT8_FUSED_QK_ROPE=all, Flux, Ideogram 4 default
#   hostprof  cProfile of steady-state sampler steps: Flux with / without INT8_FUSED_QK_ROPE, Ideogram 4 dual
#   qkmodels  Z-Image and Wan 1.3B with their QK norm + RoPE kernel (the default) and without it
#             (`%INT8_FUSED_QK_ROPE=flux`, same process), beside bf16 and fp8_fast, the pack profiled
#   hostgap   Z-Image: the pack three times in one process (twice in a row, then after fp8_fast), host-profiled,
#             with the time in Python's GC; Wan 1.3B: the pack with dispatch auto and forced int8, profiled
#   tails     Wan 1.3B with its residual-tail kernels (bf16, pack profiled, fp8_fast, pack), Z-Image (bf16, pack
#             profiled), then Ideogram 4 dual (bf16, pack profiled)
#   ideohost  Ideogram 4 dual: the pack, bf16, the pack again in one process, the pack rows host-profiled
#   closing   the defaults, every anchor in one call: Flux / Z-Image / Wan (bf16, pack, fp8_fast, pack again), then
#             Ideogram 4 dual (bf16, pack, fp8_fast with cuDNN first); no profiles
#   gaps      where the GPU waits inside a step (idle gaps charged to the host frames that launch the next work,
#             synchronising calls): Ideogram 4 dual, the pack profiled; Flux.1 with INT8_FUSED_FLUX_TAILS off
#             and on (bf16, pack, pack%tails, pack again), the pack rows profiled
#   segments  the one-pass segmented SwiGLU and residual-tail kernels against the chunked / one-tile ones
#             (bench/fused_sweep.py), then Ideogram 4 dual (bf16, pack profiled and host-profiled) and Flux.1
#             (bf16, pack), each row with the GPU's lag behind the host at each step's end
#   conds     the run's conditioning on the GPU (INT8_FUSED_GPU_CONDS) against ComfyUI's per-call copy, same
#             process: Ideogram 4 dual (bf16, pack profiled, pack%=0, fp8_fast~cudnn), Flux.1 (bf16, pack, %=0, pack)
#   anchors   the defaults with every anchor: Ideogram 4 dual (bf16, pack GPU-traced, fp8_fast~cudnn, ~kitchen),
#             Flux / Z-Image / Wan (bf16, pack GPU-traced, fp8_fast); SM clock and power per timed row
#   zhost     Z-Image: bf16, the pack, the pack cProfiled (host time a step)
#   closing2  Flux / Z-Image / Wan: bf16, pack, fp8_fast, pack again (no polling, no profiles)
#   ideoanchors  Ideogram 4 dual: bf16, pack, fp8_fast~cudnn, fp8_fast~kitchen, pack again (no polling)
#   condscheck  Flux.1: pack, pack%INT8_FUSED_GPU_CONDS=0, pack again (the committed conditioning move)
#   fetch     one fetch of a fused block's weights a call (INT8_FUSED_BLOCK_FETCH) against a fetch per layer:
#             Flux / Z-Image / Wan (bf16, pack, pack%=0, pack again, fp8_fast), outputs compared bit for bit;
#             then the GELU kernels' tile plans with the one-pass segmented kernel (bench/fused_sweep.py --only gelu)
#   ideofetch Ideogram 4 dual: bf16, pack (block fetch A/B'd, --ab), fp8_fast~cudnn, fp8_fast~kitchen
#   fetchab   Flux / Z-Image / Wan: bf16, pack (block fetch A/B'd on the loaded model, --ab), fp8_fast
#   swiglu    bench/fused.py (the SwiGLU GEMM epilogue), then Ideogram 4 dual: bf16, pack (epilogue A/B'd), fp8~cudnn,
#             fp8~kitchen
#   zswiglu   Z-Image: bf16, pack (SwiGLU epilogue A/B'd), fp8_fast; Flux.1's pack with INT8_FUSED_FLUX_TAILS A/B'd
#   closing3  bench/shapes.py (every linear shape), then Ideogram 4 dual with the pack profiled
#   hostint8  bench/host_int8.py: host time of each layer of the INT8 call stack (tiny problem, GPU work hidden)
#   plans     the prepared launches (kernel/plan.py): bench/host_int8.py, then every linear shape (bench/shapes.py)
#   planmodels  Flux / Z-Image / Wan: bf16, pack (INT8_FUSED_PLANS=0 A/B'd on the loaded model), fp8_fast
#   planideo  Ideogram 4 dual: bf16, pack (INT8_FUSED_PLANS=0 A/B'd), fp8_fast~cudnn, fp8_fast~kitchen
#   floors    Flux / Z-Image / Wan: the pack's kernel sums a step (profiled) and its host time by function (cProfile)
#   lnqk      bench/plan_check.py, bench/host_int8.py, the LayerNorm / QK sweep rows, Flux and Wan 1.3B profiled
#   restails  the segmented residual + LayerNorm tails (sweep rows), Flux.1 with INT8_FUSED_FLUX_TAILS=1 A/B'd
#   ideo5     Ideogram 4 dual: bf16, pack (profiled), fp8_fast~cudnn, fp8_fast~kitchen in one process
#   rowloop   the row-looping quantizer's sweep rows (QUANT_ROW_LOOP programs an SM) against a program a row
#   closing5  issue 14's anchors (the pack profiled), then Flux / Z-Image / Wan 1.3B: bf16, pack profiled, fp8_fast
#   final5    Flux / Wan 1.3B (bf16, pack profiled), then bench/shapes.py with a 140 s budget
#   split     bench/gemm_split.py: the GEMM's tail split against the plain launch on every shape with M > 16
#   splitideo Ideogram 4 dual with the tail split on and off (INT8_FUSED_TAIL_SPLIT, rows interleaved) beside
#             issue 14's anchors (bf16, fp8_fast~cudnn, fp8_fast~kitchen)
#   splitmodels  Flux / Z-Image / Wan 1.3B: bf16, the pack with the tail split on, off, on
#   final6    the dispatch's GPU times without the host's share: bench/shapes.py (80 s budget), Wan 1.3B /
#             Z-Image (bf16, pack), Ideogram 4 dual (bf16, pack)
#   swsplit   bench/gemm_split.py --swiglu: the SwiGLU-epilogue GEMM's tail split against its plain launch
#   swideo    Ideogram 4 dual: the SwiGLU GEMM's tail split on (INT8_FUSED_TAIL_SPLIT=all) and off (=gemm),
#             interleaved, beside issue 14's anchors (bf16, fp8_fast~cudnn, fp8_fast~kitchen)
#   floor     bench/gemm_floor.py (L2 / HBM read bandwidth, the tile loop's tensor-core rate, the GEMM's floors per
#             shape beside the pack and cuBLAS FP8), then bench/gemm_split.py --swiglu with the pack's own pick,
#             then every linear shape (bench/shapes.py)
#   n256      bench/gemm_n256.py: the INT8 GEMM at 128 x 256 tiles as s8 wgmma n256 (an fp8 build's PTX rewritten)
#   s8        bench/s8_check.py: the pack's s8 wgmma n256 path (kernel/s8wgmma.py), exact, timed, its safety net
#   s8ideo    issue 14's anchors with that path on and off
#             against the pack's GEMM, Triton's own int8 / fp8 builds and cuBLAS FP8
#   persist   bench/gemm_persist.py: the s8 n256 GEMM as a persistent kernel (flattened / warp-specialised)
#   ps8       bench/s8_check.py with the persistent s8 GEMMs (plain and SwiGLU) beside the non-persistent tile
#   pideo     issue 14's anchors with the persistent s8 GEMMs on and off
#   pab       the persistent GEMMs A/B'd (prepared calls keyed by the switch), a pack row after comfy-kitchen's
#   shapesall bench/shapes.py over all 55 shapes (budget 330 s: a fresh process tunes every shape first)
#   cdgemm    HEAD's persistent GEMMs on the GPU: bench/s8_check.py, then every linear shape (bench/shapes.py,
#             host-bound rows also as streams of calls)
#   cdmodels  Flux / Z-Image / Wan 1.3B: bf16, pack, pack with INT8_FUSED_PERSISTENT=0, pack, fp8_fast
#   cddiag    Z-Image / Flux: bf16, pack, pack PERSISTENT=0, pack, the pack rows profiled (syncs, copies, gaps)
#   cdtma     bench/tma_encode.py, then Flux: pack, pack PERSISTENT=0, pack (cProfiled)
#   cdab      Flux / Z-Image / Wan 1.3B: the pack with INT8_FUSED_PERSISTENT A/B'd on the loaded model (--ab)
#   cdideo    issue 14's anchors at HEAD: Ideogram 4 dual, bf16, pack, fp8_fast~cudnn, fp8_fast~kitchen, pack
#   psplit    the persistent GEMM's tail split: bench/persist_split.py, then the Ideogram 4 / Flux.1 linear shapes
#   psideo    issue 14's anchors with it: Ideogram 4 dual, bf16, pack (INT8_FUSED_TAIL_SPLIT=0 A/B'd), fp8_fast~cudnn,
#             fp8_fast~kitchen, pack
#   pshost    Ideogram 4 dual, the pack: where its host time goes now that it paces the step (cProfile of 2 steps)
#   hostops   bench/host_ops.py under torch's cudaMallocAsync allocator (ComfyUI's on NVIDIA), then the native one
#   direct    bench/sdpa_direct.py; Ideogram 4 dual bf16, pack (INT8_FUSED_SDPA_DIRECT=0 A/B'd); Z-Image the same
#   direct2   bench/sdpa_direct.py alone (GPU times as interleaved rounds)
#   hsample   where the host-paced steps' host time goes, by stack sampling (no cProfile slowdown): Ideogram 4 dual,
#             Z-Image, Flux.1 (the pack); the host-bound linear shapes again, 15 stream rounds
#   rpre      bench/fused_sweep.py's residual-tail rows (at a71ba43 also x read before / after o's norm: that
#             RESIDUAL_PREFETCH was removed after run cs), then issue 14's anchors in one process: Ideogram 4 dual,
#             bf16, pack, fp8_fast~cudnn, fp8_fast~kitchen, pack
#   shapes15  every linear shape (bench/shapes.py), host-bound rows as 15-round streams
#   gaps2     the pack's steps traced on the GPU only (--gpu-gaps: busy time against span, idle gaps by size):
#             Ideogram 4 dual, Z-Image, Flux.1
# Carry (built by bench/device_carry.sh, ck zipped to fit): .carry/comfy .carry/whl .carry/stub .carry/ck.zip
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: bash bench/h200_pending.sh kernels|ideogram|pressure|models|attn-models|residual|gemm|defaults|qkrope|sweep|alu|hostprof|final|layout|qkmodels|hostgap|tails|ideohost|closing|gaps|segments|conds|anchors|zhost|closing2|ideoanchors|condscheck|fetch|ideofetch|fetchab|floors|swiglu|zswiglu|closing3|hostint8|plans|planmodels|planideo|rowseg|closing4|tailsmodels|lnqk|restails|ideo5|rowloop|closing5|final5|split|splitideo|splitmodels|final6|swsplit|shapesall|swideo|floor|n256|s8|s8ideo|s8all|persist|ps8|pideo|pab|cdgemm|cdmodels|cddiag|cdtma|cdab|cdideo|psplit|psideo|pshost|hostops|direct|direct2|hsample|rpre|gaps2|shapes15 ..."; exit 2; }
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 INT8_FUSED_CACHE_DIR=${INT8_FUSED_CACHE_DIR:-$OUT/autotune}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl || exit 1
if [ -f .carry/ck.zip ] && [ ! -d /tmp/ck/comfy_kitchen ]; then
  mkdir -p /tmp/ck && python3 -m zipfile -e .carry/ck.zip /tmp/ck
fi
export PYTHONPATH=/tmp/site:/tmp/ck:$PWD/.carry/stub
{ nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  echo "commit: ${BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
} 2>&1 | tee "$OUT/gpu.txt"
sampler="python3 bench/e2e_sampler.py --comfy .carry/comfy --res 1024 --workflows dual --steps 6"  # word-split on use
for stage in "$@"; do
case $stage in
  kernels)
    timeout 260 python3 bench/attention.py --check --out "$OUT/h200-attention.json" 2>&1 | tee "$OUT/attention.log"
    timeout 200 python3 bench/shapes.py --out "$OUT/h200-shapes.json" 2>&1 | tee "$OUT/shapes.log" ;;
  ideogram)
    timeout 330 $sampler --profile none --out "$OUT/sampler-anchors.json" --paths \
      bf16,bf16~cudnn,fp8_fast,fp8_fast~cudnn,fp8_fast~kitchen,pack:fused_triton,pack:fused_triton~cudnn,pack:fused_triton~auto,pack:fused_triton~int8 \
      2>&1 | tee "$OUT/sampler-anchors.log"
    timeout 150 $sampler --profile none --text-pad 100 --out "$OUT/sampler-pad.json" \
      --paths bf16,fp8_fast~cudnn,pack:fused_triton~cudnn 2>&1 | tee "$OUT/sampler-pad.log" ;;
  pressure)
    timeout 220 $sampler --profile pack:fused_triton --paths bf16 --pressure 6 --workflows batched \
      --out "$OUT/sampler-pressure.json" 2>&1 | tee "$OUT/sampler-pressure.log" ;;
  models)
    timeout 330 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models "${MODELS:-flux,zimage,wan13,ideogram4}" --out "$OUT/h200-e2e-models.json" \
      2>&1 | tee "$OUT/models.log" ;;
  attn-models)  # the fused-row kernels with the residual diagnosis; Flux / Z-Image / Wan with cuDNN-first attention
    timeout 45 python3 bench/fused.py --out "$OUT/h200-fused.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 160 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths bf16~cudnn,fp8_fast~cudnn,pack:fused_triton~auto --profile pack:fused_triton~auto \
      --out "$OUT/h200-e2e-models-attn.json" 2>&1 | tee -a "$OUT/last.log" ;;
  residual)  # Ideogram 4 with the residual-tail fusion on (INT8_FUSED_RESIDUAL=1 is read at import)
    INT8_FUSED_RESIDUAL=1 timeout 125 $sampler --profile pack:fused_triton~auto --paths bf16,pack:fused_triton~auto \
      --out "$OUT/sampler-residual.json" 2>&1 | tee -a "$OUT/last.log" ;;
  gemm)  # issue 14 item 6: persistent TMA (and warp-specialised) INT8 GEMM variants vs the pack's kernel and cuBLAS FP8
    timeout 140 python3 bench/gemm_variants.py --out "$OUT/h200-gemm-variants.json" 2>&1 | tee -a "$OUT/last.log" ;;
  defaults)  # the pack as it now defaults (attention auto, residual tail built without FMA) on every model, profiled
    timeout 200 $sampler --profile pack:fused_triton --host-profile pack:fused_triton --paths bf16,pack:fused_triton \
      --out "$OUT/sampler-defaults.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 250 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths bf16,pack:fused_triton --profile pack:fused_triton --host-profile pack:fused_triton \
      --out "$OUT/h200-e2e-models-defaults.json" 2>&1 | tee -a "$OUT/last.log" ;;
  qkrope)  # Flux with INT8_FUSED_QK_ROPE=1 (one kernel for QK norm + RoPE + layout), against bf16, profiled
    INT8_FUSED_QK_ROPE=1 timeout 150 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux \
      --paths bf16,pack:fused_triton --profile pack:fused_triton --out "$OUT/h200-e2e-models-qkrope.json" \
      2>&1 | tee -a "$OUT/last.log" ;;
  sweep)  # tile plans of the row kernels, the GELU ones first (Flux / Wan profiles: 5-6x their memory floor)
    timeout 200 python3 bench/fused_sweep.py 2>&1 | tee -a "$OUT/last.log" ;;
  alu)  # INT8_FUSED_ALU_ROUND off / on (taken at import): each row kernel's default plan, output digests compared
    timeout 150 python3 bench/fused_sweep.py --quick 2>&1 | tee "$OUT/alu0.log"
    INT8_FUSED_ALU_ROUND=1 timeout 150 python3 bench/fused_sweep.py --quick 2>&1 | tee "$OUT/alu1.log"
    python3 - "$OUT/alu0.log" "$OUT/alu1.log" <<'PY'
import re, sys
rows = [{m.group(1).strip(): (float(m.group(2)), m.group(3)) for m in
         re.finditer(r"^(.*?): +([0-9.]+) us .*sha1 (\w+)", open(f).read(), re.M)} for f in sys.argv[1:]]
for k, (us0, h0) in rows[0].items():
    us1, h1 = rows[1].get(k, (float("nan"), "?"))
    print(f"ALU A/B {k:60s} cvt {us0:7.1f} us  alu {us1:7.1f} us  same output: {h0 == h1}")
PY
    ;;
  hostprof)  # where the host time of a step goes (cProfile of steady-state steps): Flux with / without the
             # QK norm + RoPE kernel, Ideogram 4 dual
    timeout 120 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux --paths pack:fused_triton \
      --host-profile pack:fused_triton --out "$OUT/h200-e2e-models-host.json" 2>&1 | tee -a "$OUT/last.log"
    INT8_FUSED_QK_ROPE=1 timeout 120 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux \
      --paths pack:fused_triton --host-profile pack:fused_triton --out "$OUT/h200-e2e-models-host-qkrope.json" \
      2>&1 | tee -a "$OUT/last.log"
    timeout 150 $sampler --profile pack:fused_triton --host-profile pack:fused_triton --paths pack:fused_triton \
      --out "$OUT/sampler-host.json" 2>&1 | tee -a "$OUT/last.log" ;;
  final)  # the defaults as committed: Ideogram 4 dual (bf16, fp8_fast with cuDNN first, the pack), then Flux /
           # Z-Image / Wan beside bf16 and fp8_fast, the pack profiled
    timeout 210 $sampler --profile pack:fused_triton --paths bf16,fp8_fast~cudnn,pack:fused_triton \
      --out "$OUT/sampler-final.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 330 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths bf16,fp8_fast,pack:fused_triton --profile pack:fused_triton --out "$OUT/h200-e2e-models-final.json" \
      2>&1 | tee -a "$OUT/last.log" ;;
  layout)  # q / k / v in the [B, L, H, D] layout SDPA keeps: Ideogram 4 with INT8_FUSED_QK_ROPE=all (beside bf16,
            # profiled), Flux (bf16, pack, profiled), then Ideogram 4's default pack for comparison
    INT8_FUSED_QK_ROPE=all timeout 150 $sampler --profile pack:fused_triton --paths bf16,pack:fused_triton \
      --out "$OUT/sampler-layout-all.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 110 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux \
      --paths bf16,pack:fused_triton --profile pack:fused_triton --out "$OUT/h200-e2e-models-layout.json" \
      2>&1 | tee -a "$OUT/last.log"
    timeout 100 $sampler --profile none --paths pack:fused_triton \
      --out "$OUT/sampler-layout-default.json" 2>&1 | tee -a "$OUT/last.log" ;;
  qkmodels)
    timeout 420 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models zimage,wan13 \
      --paths "bf16,pack:fused_triton,pack:fused_triton%INT8_FUSED_QK_ROPE=flux,fp8_fast,pack:fused_triton" \
      --profile pack:fused_triton --out "$OUT/h200-e2e-models-qk.json" 2>&1 | tee -a "$OUT/last.log" ;;
  hostgap)
    timeout 300 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models zimage \
      --paths "bf16,pack:fused_triton,pack:fused_triton,fp8_fast,pack:fused_triton" \
      --host-profile pack:fused_triton --out "$OUT/h200-e2e-models-gap.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 200 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models wan13 \
      --paths "bf16,pack:fused_triton,pack:fused_triton%INT8_FUSED_DISPATCH=int8" \
      --profile "pack:fused_triton%INT8_FUSED_DISPATCH=int8" --out "$OUT/h200-e2e-models-wanint8.json" \
      2>&1 | tee -a "$OUT/last.log" ;;
  tails)
    timeout 260 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models wan13,zimage \
      --paths "bf16,pack:fused_triton,fp8_fast,pack:fused_triton" --profile pack:fused_triton \
      --out "$OUT/h200-e2e-models-tails.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 200 $sampler --profile pack:fused_triton --paths bf16,pack:fused_triton \
      --out "$OUT/sampler-tails.json" 2>&1 | tee -a "$OUT/last.log" ;;
  ideohost)
    timeout 330 $sampler --profile none --host-profile pack:fused_triton \
      --paths pack:fused_triton,bf16,pack:fused_triton --out "$OUT/sampler-ideohost.json" 2>&1 | tee -a "$OUT/last.log" ;;
  gaps)
    timeout 150 $sampler --profile pack:fused_triton --paths pack:fused_triton \
      --out "$OUT/sampler-gaps.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 330 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux \
      --paths "bf16,pack:fused_triton,pack:fused_triton%INT8_FUSED_FLUX_TAILS=1,pack:fused_triton" \
      --profile "pack:fused_triton,pack:fused_triton%INT8_FUSED_FLUX_TAILS=1" \
      --out "$OUT/h200-e2e-models-gaps.json" 2>&1 | tee -a "$OUT/last.log" ;;
  segments)
    timeout 150 python3 bench/fused_sweep.py --only swiglu,gated_residual,qk_norm 2>&1 | tee -a "$OUT/last.log"
    timeout 260 $sampler --profile pack:fused_triton --host-profile pack:fused_triton --paths bf16,pack:fused_triton \
      --out "$OUT/sampler-seg.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 150 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux \
      --paths "bf16,pack:fused_triton" --out "$OUT/h200-e2e-models-seg.json" 2>&1 | tee -a "$OUT/last.log" ;;
  closing)
    timeout 330 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths "bf16,pack:fused_triton,fp8_fast,pack:fused_triton" --out "$OUT/h200-e2e-models-closing.json" \
      2>&1 | tee -a "$OUT/last.log"
    timeout 200 $sampler --profile none --paths bf16,pack:fused_triton,fp8_fast~cudnn \
      --out "$OUT/sampler-closing.json" 2>&1 | tee -a "$OUT/last.log" ;;
  conds)  # the run's conditioning moved to the GPU once (INT8_FUSED_GPU_CONDS, the default) against ComfyUI's
          # per-call pageable copy (=0), same process: Ideogram 4 dual (52 MiB of text a step; the pack
          # profiled), then Flux.1 (bf16, pack, pack%=0, pack again)
    timeout 250 $sampler --profile pack:fused_triton \
      --paths "bf16,pack:fused_triton,pack:fused_triton%INT8_FUSED_GPU_CONDS=0,fp8_fast~cudnn" \
      --out "$OUT/sampler-conds.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 200 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux \
      --paths "bf16,pack:fused_triton,pack:fused_triton%INT8_FUSED_GPU_CONDS=0,pack:fused_triton" \
      --out "$OUT/h200-e2e-models-conds.json" 2>&1 | tee -a "$OUT/last.log" ;;
  anchors)  # the defaults, every anchor in one call: Ideogram 4 dual (bf16, the pack traced on the GPU only,
            # fp8_fast with cuDNN first, fp8_fast with comfy-kitchen attention), then Flux / Z-Image / Wan (bf16,
            # pack, fp8_fast; Flux's pack traced); every timed row samples nvidia-smi's SM clock and power
    timeout 250 $sampler --profile none --gpu-gaps pack:fused_triton --clocks \
      --paths "bf16,pack:fused_triton,fp8_fast~cudnn,fp8_fast~kitchen" \
      --out "$OUT/sampler-anchors2.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 290 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths "bf16,pack:fused_triton,fp8_fast" --gpu-gaps pack:fused_triton --clocks \
      --out "$OUT/h200-e2e-models-anchors.json" 2>&1 | tee -a "$OUT/last.log" ;;
  zhost)  # Z-Image's host time a step (host-bound in run ab): the pack twice, the second cProfiled
    timeout 200 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models zimage \
      --paths "bf16,pack:fused_triton,pack:fused_triton" --host-profile pack:fused_triton \
      --out "$OUT/h200-e2e-models-zhost.json" 2>&1 | tee -a "$OUT/last.log" ;;
  closing2)  # the defaults without nvidia-smi polling: Flux / Z-Image / Wan (bf16, pack, fp8_fast, pack again)
    timeout 340 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths "bf16,pack:fused_triton,fp8_fast,pack:fused_triton" --out "$OUT/h200-e2e-models-closing2.json" \
      2>&1 | tee -a "$OUT/last.log" ;;
  ideoanchors)  # issue 14's anchors in one process, no polling, no profile: Ideogram 4 dual (bf16, pack,
                # fp8_fast with cuDNN first, fp8_fast with comfy-kitchen attention, pack again)
    timeout 300 $sampler --profile none \
      --paths "bf16,pack:fused_triton,fp8_fast~cudnn,fp8_fast~kitchen,pack:fused_triton" \
      --out "$OUT/sampler-ideoanchors.json" 2>&1 | tee -a "$OUT/last.log" ;;
  condscheck)  # the conditioning move as committed last (originals restored after the run): Flux.1 pack,
               # pack%GPU_CONDS=0, pack again, outputs compared bit for bit
    timeout 150 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux \
      --paths "pack:fused_triton,pack:fused_triton%INT8_FUSED_GPU_CONDS=0,pack:fused_triton" \
      --out "$OUT/h200-e2e-models-condscheck.json" 2>&1 | tee -a "$OUT/last.log" ;;
  fetch)  # the fused blocks' one weight fetch a call against ComfyUI's fetch per layer (=0), same process
    timeout 500 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths "bf16,pack:fused_triton,pack:fused_triton%INT8_FUSED_BLOCK_FETCH=0,pack:fused_triton,fp8_fast" \
      --out "$OUT/h200-e2e-models-fetch.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 80 python3 bench/fused_sweep.py --only gelu 2>&1 | tee "$OUT/sweep-gelu.log" ;;
  ideofetch)  # Ideogram 4 dual with every anchor of issue 14; the pack row also A/B's the block fetch (4 + 4
              # interleaved timed runs of the loaded model)
    timeout 420 $sampler --profile none --ab INT8_FUSED_BLOCK_FETCH=0 \
      --paths "bf16,pack:fused_triton,fp8_fast~cudnn,fp8_fast~kitchen" \
      --out "$OUT/sampler-ideofetch.json" 2>&1 | tee -a "$OUT/last.log" ;;
  fetchab)  # Flux / Z-Image / Wan: bf16, pack (with the block fetch A/B'd on the loaded model), fp8_fast
    timeout 420 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths "bf16,pack:fused_triton,fp8_fast" --ab INT8_FUSED_BLOCK_FETCH=0 \
      --out "$OUT/h200-e2e-models-fetchab.json" 2>&1 | tee -a "$OUT/last.log" ;;
  floors)  # where the host-bound steps go: Flux / Z-Image / Wan, the pack profiled on the GPU (kernel sums a step)
           # and, in a second run, under cProfile (host time a step by function)
    timeout 300 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths "pack:fused_triton" --profile pack:fused_triton --host-profile pack:fused_triton \
      --out "$OUT/h200-e2e-models-floors.json" 2>&1 | tee -a "$OUT/last.log" ;;
  swiglu)  # SwiGLU in the w1+w3 GEMM's epilogue (INT8_FUSED_SWIGLU_EPILOGUE): bench/fused.py (kernel times, codes
           # compared on the GPU), then Ideogram 4 dual with every anchor of issue 14, the pack row A/B'd (--ab)
    timeout 150 python3 bench/fused.py --out "$OUT/h200-fused-swiglu.json" 2>&1 | tee "$OUT/fused-swiglu.log"
    timeout 420 $sampler --profile none --ab INT8_FUSED_SWIGLU_EPILOGUE=0 \
      --paths "bf16,pack:fused_triton,fp8_fast~cudnn,fp8_fast~kitchen" \
      --out "$OUT/sampler-swiglu.json" 2>&1 | tee -a "$OUT/last.log" ;;
  zswiglu)  # Z-Image: bf16, pack (the SwiGLU epilogue A/B'd), fp8_fast; then Flux.1 with its opt-in residual tails
            # A/B'd (INT8_FUSED_FLUX_TAILS=1 on the loaded model), now that its step is GPU-bound
    timeout 260 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models zimage \
      --paths "bf16,pack:fused_triton,fp8_fast" --ab INT8_FUSED_SWIGLU_EPILOGUE=0 \
      --out "$OUT/h200-e2e-models-zswiglu.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 260 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux \
      --paths "pack:fused_triton" --ab INT8_FUSED_FLUX_TAILS=1 \
      --out "$OUT/h200-e2e-models-fluxtails.json" 2>&1 | tee -a "$OUT/last.log" ;;
  closing3)  # every linear shape again (bench/shapes.py; its summary now also against an nn.Linear module call),
             # then Ideogram 4 dual, the pack profiled (kernel time a step with the SwiGLU epilogue)
    timeout 200 python3 bench/shapes.py --out "$OUT/h200-shapes.json" 2>&1 | tee "$OUT/shapes.log"
    timeout 300 $sampler --profile pack:fused_triton --paths "pack:fused_triton" \
      --out "$OUT/sampler-closing3.json" 2>&1 | tee -a "$OUT/last.log" ;;
  hostint8)  # host time a call of each layer of the INT8 stack, from a raw re-launch up to an Int8Linear call
    timeout 120 python3 bench/host_int8.py --json "$OUT/h200-host-int8.json" 2>&1 | tee "$OUT/host-int8.log" ;;
  plans)  # the prepared launches: host time a call of each layer, then every linear shape against bf16
    timeout 120 python3 bench/host_int8.py --json "$OUT/h200-host-int8.json" 2>&1 | tee "$OUT/host-int8.log"
    timeout 230 python3 bench/shapes.py --out "$OUT/h200-shapes.json" 2>&1 | tee "$OUT/shapes.log" ;;
  planmodels)  # Flux / Z-Image / Wan with the prepared launches A/B'd (INT8_FUSED_PLANS=0) on the loaded model
    timeout 420 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths "bf16,pack:fused_triton,fp8_fast" --ab INT8_FUSED_PLANS=0 \
      --out "$OUT/h200-e2e-models-plans.json" 2>&1 | tee -a "$OUT/last.log" ;;
  planideo)  # issue 14's anchors with the prepared launches A/B'd on the pack row
    timeout 420 $sampler --profile none --ab INT8_FUSED_PLANS=0 \
      --paths "bf16,pack:fused_triton,fp8_fast~cudnn,fp8_fast~kitchen" \
      --out "$OUT/sampler-plans.json" 2>&1 | tee -a "$OUT/last.log" ;;
  rowseg)  # the one-pass (segmented) RMSNorm·mod and per-token quantizers against their other tiles, then issue 14's
           # anchors in one process with the pack profiled (kernel time a step)
    timeout 150 python3 bench/fused_sweep.py --only rmsnorm_mod,quant_rows,gated_residual 2>&1 | tee "$OUT/sweep.log"
    timeout 420 $sampler --profile pack:fused_triton --paths "bf16,pack:fused_triton,fp8_fast~cudnn,fp8_fast~kitchen" \
      --out "$OUT/sampler-rowseg.json" 2>&1 | tee -a "$OUT/last.log" ;;
  closing4)  # gemm_swiglu's tiles (its own autotune's pick against every candidate), then issue 14's anchors in one
             # process with the pack profiled
    timeout 120 python3 bench/swiglu_tiles.py --out "$OUT/h200-swiglu-tiles.json" 2>&1 | tee "$OUT/swiglu-tiles.log"
    timeout 420 $sampler --profile pack:fused_triton --paths "bf16,pack:fused_triton,fp8_fast~cudnn,fp8_fast~kitchen" \
      --out "$OUT/sampler-closing4.json" 2>&1 | tee -a "$OUT/last.log" ;;
  tailsmodels)  # Flux.1 with its residual tails A/B'd (INT8_FUSED_FLUX_TAILS=1, prepared launches for them now), then
                # Z-Image and Wan 2.1 1.3B (bf16, pack, fp8_fast) with the one-pass quantizers and planned tails
    timeout 200 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux \
      --paths "bf16,pack:fused_triton,fp8_fast" --ab INT8_FUSED_FLUX_TAILS=1 \
      --out "$OUT/h200-e2e-models-fluxtails.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 300 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models zimage,wan13 \
      --paths "bf16,pack:fused_triton,fp8_fast" --out "$OUT/h200-e2e-models-zw.json" 2>&1 | tee -a "$OUT/last.log" ;;
  lnqk)  # the prepared in-place launches checked on the GPU (bench/plan_check.py), the float path's host time
         # (bench/host_int8.py), the one-pass LayerNorm·mod and the QK prefetch against their old forms
         # (bench/fused_sweep.py), then Flux.1 / Wan 1.3B (bf16, pack profiled: kernel sums a step)
    timeout 60 python3 bench/plan_check.py 2>&1 | tee "$OUT/plan-check.log"
    timeout 90 python3 bench/host_int8.py --json "$OUT/h200-host-int8.json" 2>&1 | tee "$OUT/host-int8.log"
    timeout 150 python3 bench/fused_sweep.py --only layernorm,qk_norm_rope 2>&1 | tee "$OUT/sweep.log"
    timeout 300 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,wan13 \
      --paths "bf16,pack:fused_triton" --profile pack:fused_triton \
      --out "$OUT/h200-e2e-models-lnqk.json" 2>&1 | tee -a "$OUT/last.log" ;;
  restails)  # the segmented residual + LayerNorm tails against the one-tile kernel (bench/fused_sweep.py), then Flux.1
             # (bf16, pack with INT8_FUSED_FLUX_TAILS=1 A/B'd on the loaded model, fp8_fast)
    timeout 120 python3 bench/fused_sweep.py --only residual+layernorm 2>&1 | tee "$OUT/sweep-restails.log"
    timeout 300 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux \
      --paths "bf16,pack:fused_triton,fp8_fast" --ab INT8_FUSED_FLUX_TAILS=1 \
      --out "$OUT/h200-e2e-models-restails.json" 2>&1 | tee -a "$OUT/last.log" ;;
  ideo5)  # issue 14's anchors in one process, the pack profiled (kernel time a step)
    timeout 450 $sampler --profile pack:fused_triton --paths "bf16,pack:fused_triton,fp8_fast~cudnn,fp8_fast~kitchen" \
      --out "$OUT/sampler-ideo5.json" 2>&1 | tee -a "$OUT/last.log" ;;
  rowloop)  # the row-looping quantizer (programs looping over rows, the next row's loads in flight) against the
            # one-row-a-program kernel (bench/fused_sweep.py)
    timeout 150 python3 bench/fused_sweep.py --only quant_rows 2>&1 | tee "$OUT/sweep-rowloop.log" ;;
  closing5)  # the session's defaults: issue 14's anchors in one process (the pack profiled), then Flux / Z-Image /
             # Wan 1.3B (bf16, pack profiled, fp8_fast)
    timeout 240 $sampler --profile pack:fused_triton --paths "bf16,pack:fused_triton,fp8_fast~cudnn,fp8_fast~kitchen" \
      --out "$OUT/sampler-closing5.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 330 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths "bf16,pack:fused_triton,fp8_fast" --profile pack:fused_triton \
      --out "$OUT/h200-e2e-models-closing5.json" 2>&1 | tee -a "$OUT/last.log" ;;
  final5)  # Flux / Wan 1.3B with the residual tails back on their one tile below 4097 (bf16, pack profiled), then
           # every linear shape (bench/shapes.py, a shorter budget)
    timeout 170 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,wan13 \
      --paths "bf16,pack:fused_triton" --profile pack:fused_triton \
      --out "$OUT/h200-e2e-models-final5.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 200 python3 bench/shapes.py --budget-s 140 --out "$OUT/h200-shapes.json" 2>&1 | tee "$OUT/shapes.log" ;;
  split)  # the GEMM's tail split (kernel.gemm.tail_layout) against the plain launch, every shape with M > 16
    timeout 450 python3 bench/gemm_split.py --out "$OUT/h200-gemm-split.json" 2>&1 | tee "$OUT/gemm-split.log" ;;
  splitideo)  # issue 14's anchors with the pack's tail split on and off (interleaved rows, one process)
    timeout 560 $sampler --paths "bf16,pack:fused_triton,pack:fused_triton%INT8_FUSED_TAIL_SPLIT=0,fp8_fast~cudnn,fp8_fast~kitchen,pack:fused_triton,pack:fused_triton%INT8_FUSED_TAIL_SPLIT=0" \
      --out "$OUT/sampler-splitideo.json" 2>&1 | tee -a "$OUT/last.log" ;;
  splitmodels)  # Flux / Z-Image / Wan 1.3B: bf16, the pack with the tail split on, off, on
    timeout 560 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths "bf16,pack:fused_triton,pack:fused_triton%INT8_FUSED_TAIL_SPLIT=0,pack:fused_triton" \
      --out "$OUT/h200-e2e-models-splitmodels.json" 2>&1 | tee -a "$OUT/last.log" ;;
  final6)  # the dispatch's host-free GPU times: every linear shape, Z-Image / Wan 1.3B, Ideogram 4 dual
    timeout 120 python3 bench/shapes.py --budget-s 80 --out "$OUT/h200-shapes.json" 2>&1 | tee "$OUT/shapes.log"
    timeout 160 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models wan13,zimage \
      --paths "bf16,pack:fused_triton" --out "$OUT/h200-e2e-models-final6.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 200 $sampler --paths "bf16,pack:fused_triton" --out "$OUT/sampler-final6.json" 2>&1 | tee -a "$OUT/last.log" ;;
  swsplit)  # the SwiGLU-epilogue GEMM's tail split against its plain launch (Ideogram 4 / Z-Image shapes)
    timeout 150 python3 bench/gemm_split.py --swiglu --out "$OUT/h200-gemm-split-swiglu.json" 2>&1 | tee "$OUT/gemm-split-swiglu.log" ;;
  swideo)  # issue 14's anchors with the SwiGLU GEMM's tail split on and off (interleaved rows, one process)
    timeout 570 $sampler --paths "bf16,pack:fused_triton%INT8_FUSED_TAIL_SPLIT=all,pack:fused_triton%INT8_FUSED_TAIL_SPLIT=gemm,fp8_fast~cudnn,fp8_fast~kitchen,pack:fused_triton%INT8_FUSED_TAIL_SPLIT=all,pack:fused_triton%INT8_FUSED_TAIL_SPLIT=gemm" \
      --out "$OUT/sampler-swideo.json" 2>&1 | tee -a "$OUT/last.log" ;;
  floor)  # what bounds the INT8 GEMM: L2 traffic of its tiles vs the tensor cores; the SwiGLU split's pick
    timeout 240 python3 bench/gemm_floor.py --out "$OUT/h200-gemm-floor.json" 2>&1 | tee "$OUT/gemm-floor.log"
    timeout 150 python3 bench/gemm_split.py --swiglu --out "$OUT/h200-gemm-split-swiglu.json" 2>&1 | tee "$OUT/gemm-split-swiglu.log"
    cp "$INT8_FUSED_CACHE_DIR"/*.json "$OUT/" 2>/dev/null
    timeout 300 python3 bench/shapes.py --budget-s 200 --out "$OUT/h200-shapes.json" 2>&1 | tee "$OUT/shapes.log" ;;
  n256)  # what s8 wgmma n256 (which Triton 3.6 cannot emit) is worth to the INT8 GEMM
    timeout 200 python3 bench/gemm_n256.py --only "qkv M4608|w2|linear1|w1/w3" --out "$OUT/h200-gemm-n256.json" 2>&1 | tee "$OUT/gemm-n256.log" ;;
  s8)  # the pack's s8 wgmma n256 path: exact against torch._int_mm / Triton's int8 build, timed, its safety net
    timeout 400 python3 bench/s8_check.py --out "$OUT/h200-s8-check.json" 2>&1 | tee "$OUT/s8-check.log"
    cp "$INT8_FUSED_CACHE_DIR"/*.json "$OUT/" 2>/dev/null ;;
  s8ideo)  # issue 14's anchors with the s8 wgmma n256 path on and off (interleaved rows, one process)
    timeout 580 $sampler --paths "bf16,pack:fused_triton,pack:fused_triton%INT8_FUSED_S8_WGMMA=0,fp8_fast~cudnn,fp8_fast~kitchen,pack:fused_triton,pack:fused_triton%INT8_FUSED_S8_WGMMA=0" \
      --out "$OUT/sampler-s8ideo.json" 2>&1 | tee -a "$OUT/last.log" ;;
  s8all)  # both in one call: the s8 check, then issue 14's anchors with the path on and off (one row each)
    timeout 150 python3 bench/s8_check.py --out "$OUT/h200-s8-check.json" 2>&1 | tee "$OUT/s8-check.log"
    cp "$INT8_FUSED_CACHE_DIR"/*.json "$OUT/" 2>/dev/null
    timeout 420 $sampler --paths "bf16,pack:fused_triton,pack:fused_triton%INT8_FUSED_S8_WGMMA=0,fp8_fast~cudnn,fp8_fast~kitchen" \
      --out "$OUT/sampler-s8all.json" 2>&1 | tee -a "$OUT/last.log" ;;
  persist)  # the s8 n256 GEMM as a persistent kernel (tile loop flattened or warp-specialised) against the pack's
    for v in flat flat_tma_st ws ws_s4 ws_k64_s6; do  # a process each: a kernel fault ends only its own
      timeout 100 python3 bench/gemm_persist.py --only "M4608|linear1" --variants "^$v\$" \
        --out "$OUT/h200-gemm-persist-$v.json" 2>&1 | tee -a "$OUT/gemm-persist.log"
    done ;;
  ps8)  # the pack's persistent s8 GEMMs (plain and SwiGLU): exact against the non-persistent s8 tile, timed, picked
    timeout 300 python3 bench/s8_check.py --out "$OUT/h200-s8-check.json" 2>&1 | tee "$OUT/s8-check.log"
    cp "$INT8_FUSED_CACHE_DIR"/*.json "$OUT/" 2>/dev/null ;;
  pideo)  # issue 14's anchors with the persistent s8 GEMMs on and off (INT8_FUSED_PERSISTENT), one process
    timeout 560 $sampler --paths "bf16,pack:fused_triton,pack:fused_triton%INT8_FUSED_PERSISTENT=0,fp8_fast~cudnn,\
fp8_fast~kitchen,pack:fused_triton" \
      --out "$OUT/sampler-pideo.json" 2>&1 | tee -a "$OUT/last.log" ;;
  pab)  # the persistent GEMMs A/B'd with every prepared call keyed by the switch, then a pack row after a
        # comfy-kitchen row (run cb: that one ran host-bound)
    timeout 560 $sampler --paths "pack:fused_triton%INT8_FUSED_PERSISTENT=0,pack:fused_triton,fp8_fast~kitchen,\
pack:fused_triton" --out "$OUT/sampler-pab.json" 2>&1 | tee -a "$OUT/last.log" ;;
  shapesall)  # every linear shape with the dispatch's host-free GPU times (run bs reached 12 of 55 in 80 s)
    timeout 400 python3 bench/shapes.py --budget-s 330 --out "$OUT/h200-shapes.json" 2>&1 | tee "$OUT/shapes.log" ;;
  cdgemm)  # HEAD's persistent GEMMs (runtime program count, descriptors remade without checks) exact on the GPU, then
           # every linear shape with them (host-bound rows also as streams of calls)
    timeout 220 python3 bench/s8_check.py --out "$OUT/h200-s8-check.json" 2>&1 | tee "$OUT/s8-check.log"
    cp "$INT8_FUSED_CACHE_DIR"/*.json "$OUT/" 2>/dev/null
    timeout 300 python3 bench/shapes.py --budget-s 250 --out "$OUT/h200-shapes.json" 2>&1 | tee "$OUT/shapes.log" ;;
  cdmodels)  # the persistent GEMMs on the host-bound models: Flux / Z-Image / Wan 1.3B, the switch between pack rows
    timeout 400 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths "bf16,pack:fused_triton,pack:fused_triton%INT8_FUSED_PERSISTENT=0,pack:fused_triton,fp8_fast" \
      --out "$OUT/h200-e2e-models-cdmodels.json" 2>&1 | tee -a "$OUT/last.log" ;;
  cddiag)  # why some pack rows of run ce ran host-paced (Z-Image's third at 2x the host time, GPU lag 0 at every
           # step end; Flux's persistent rows): Z-Image / Flux, bf16, pack, pack PERSISTENT=0, pack, the pack rows
           # profiled (syncs, copies, idle gaps by launcher)
    timeout 400 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models zimage,flux \
      --paths "bf16,pack:fused_triton,pack:fused_triton%INT8_FUSED_PERSISTENT=0,pack:fused_triton" \
      --profile "pack:fused_triton,pack:fused_triton%INT8_FUSED_PERSISTENT=0" \
      --out "$OUT/h200-e2e-models-cddiag.json" 2>&1 | tee -a "$OUT/last.log" ;;
  cdtma)  # the persistent launches' host cost: TMA encoding alone and a small persistent launch against the
          # non-persistent one, then Flux (run cf: host-paced persistent rows), cProfiled. Run cg ran this at cbb85e0,
          # with a kept-encoding switch (INT8_FUSED_TMA_MEMO, removed after: encoding costs 0.8 us) A/B'd too
    timeout 90 python3 bench/tma_encode.py 2>&1 | tee "$OUT/tma-encode.log"
    timeout 400 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux \
      --paths "pack:fused_triton,pack:fused_triton%INT8_FUSED_PERSISTENT=0,pack:fused_triton" \
      --host-profile "pack:fused_triton,pack:fused_triton%INT8_FUSED_PERSISTENT=0" \
      --out "$OUT/h200-e2e-models-cdtma.json" 2>&1 | tee -a "$OUT/last.log" ;;
  cdab)  # the persistent GEMMs A/B'd on each loaded model (4 timed runs with, 4 with INT8_FUSED_PERSISTENT=0,
         # interleaved: the host's speed drifts between rows): Flux / Z-Image / Wan 1.3B
    timeout 500 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models flux,zimage,wan13 \
      --paths "pack:fused_triton" --ab INT8_FUSED_PERSISTENT=0 \
      --out "$OUT/h200-e2e-models-cdab.json" 2>&1 | tee -a "$OUT/last.log" ;;
  cdideo)  # issue 14's anchors at HEAD, one process
    timeout 560 $sampler --paths "bf16,pack:fused_triton,fp8_fast~cudnn,fp8_fast~kitchen,pack:fused_triton" \
      --out "$OUT/sampler-cdideo.json" 2>&1 | tee -a "$OUT/last.log" ;;
  psplit)  # the persistent GEMM's tail split (K pieces for the tiles past the last whole wave): exact, timed, picked;
           # then the Ideogram 4 / Flux.1 linear shapes with it
    timeout 200 python3 bench/persist_split.py --out "$OUT/h200-persist-split.json" 2>&1 | tee "$OUT/persist-split.log"
    cp "$INT8_FUSED_CACHE_DIR"/*.json "$OUT/" 2>/dev/null
    timeout 240 python3 bench/shapes.py --only 'ideogram4|flux1' --budget-s 200 --out "$OUT/h200-shapes.json" 2>&1 \
      | tee "$OUT/shapes.log" ;;
  psideo)  # issue 14's anchors with the persistent tail split, the split A/B'd on the loaded pack (one process)
    timeout 560 $sampler --paths "bf16,pack:fused_triton,fp8_fast~cudnn,fp8_fast~kitchen,pack:fused_triton" \
      --ab INT8_FUSED_TAIL_SPLIT=0 --out "$OUT/sampler-psideo.json" 2>&1 | tee -a "$OUT/last.log" ;;
  pshost)  # run cj's pack step followed its host (host 165 ms a step, GPU busy 143): where that host time goes
    timeout 400 $sampler --paths "pack:fused_triton" --profile none --host-profile "pack:fused_triton" \
      --out "$OUT/sampler-pshost.json" 2>&1 | tee -a "$OUT/last.log" ;;
  hostops)  # host cost a call of the torch ops in an Ideogram 4 block, under both allocators
    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync timeout 120 python3 bench/host_ops.py \
      --json "$OUT/h200-host-ops-async.json" 2>&1 | tee "$OUT/host-ops.log"
    timeout 120 python3 bench/host_ops.py --json "$OUT/h200-host-ops-native.json" 2>&1 | tee -a "$OUT/host-ops.log" ;;
  direct)  # the Router's direct cuDNN call (bits, host) and the two-launch adaLN chunks on the host-paced steps
    timeout 120 python3 bench/sdpa_direct.py --out "$OUT/h200-sdpa-direct.json" 2>&1 | tee "$OUT/sdpa-direct.log"
    timeout 260 $sampler --paths "bf16,pack:fused_triton" --profile none --ab INT8_FUSED_SDPA_DIRECT=0 \
      --out "$OUT/sampler-direct.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 200 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models zimage --paths "bf16,pack:fused_triton" \
      --ab INT8_FUSED_SDPA_DIRECT=0 --out "$OUT/h200-e2e-models-direct.json" 2>&1 | tee -a "$OUT/last.log" ;;
  hsample)  # runs ck / cm: the pack's steps are host-paced; cProfile slows Python 1.5x, sampling does not
    timeout 90 python3 bench/shapes.py --only 'odd|final_layer|time_projection|adaln|t_embedding' --stream-rounds 15 \
      --out "$OUT/h200-shapes-hs.json" 2>&1 | tee "$OUT/shapes-hs.log"
    timeout 240 $sampler --paths "pack:fused_triton" --profile none --host-sample "pack:fused_triton" \
      --out "$OUT/sampler-hsample.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 200 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models zimage,flux --paths "pack:fused_triton" \
      --host-sample "pack:fused_triton" --out "$OUT/h200-e2e-models-hsample.json" 2>&1 | tee -a "$OUT/last.log" ;;
  rpre)
    timeout 120 python3 bench/fused_sweep.py --only gated_residual 2>&1 | tee "$OUT/fused-sweep-rpre.log"
    timeout 420 $sampler --profile none --paths "bf16,pack:fused_triton,fp8_fast~cudnn,fp8_fast~kitchen,pack:fused_triton" \
      --out "$OUT/sampler-rpre.json" 2>&1 | tee -a "$OUT/last.log" ;;
  gaps2)  # runs co / cp: the GPU lagged the host by up to a step; how busy is the GPU then
    timeout 260 $sampler --profile none --paths "pack:fused_triton" --gpu-gaps "pack:fused_triton" \
      --out "$OUT/sampler-gaps2.json" 2>&1 | tee -a "$OUT/last.log"
    timeout 240 python3 bench/e2e_models.py --comfy .carry/comfy --steps 6 --models zimage,flux --paths "pack:fused_triton" \
      --gpu-gaps "pack:fused_triton" --out "$OUT/h200-e2e-models-gaps2.json" 2>&1 | tee -a "$OUT/last.log" ;;
  shapes15)  # run co: 5 stream rounds (run cd) left host-bound rows within sampling noise; 15 settle them
    timeout 400 python3 bench/shapes.py --stream-rounds 15 --budget-s 300 --out "$OUT/h200-shapes.json" 2>&1 \
      | tee "$OUT/shapes.log" ;;
  direct2)  # run cm timed the direct call's GPU time after the context's, shape by shape: interleaved now
    timeout 200 python3 bench/sdpa_direct.py --out "$OUT/h200-sdpa-direct.json" 2>&1 | tee "$OUT/sdpa-direct.log" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
done
