"""SwiGLU: ``silu(a) * b`` of the merged w1+w3 GEMM output, either in that GEMM's epilogue or quantized per token
for the w2 GEMM.

- ``gemm_swiglu(a_q, a_scale, w13 [2F, K], w_scale, bias, out_dtype, clamp_fp16)`` -> h [M, F]: the merged GEMM with
  SwiGLU in its epilogue, its [M, 2F] output never written (``kernel.gemm``'s main loop and tile choice).
- ``swiglu_quantize(h13 [M, 2F] | (a [M, F], b [M, F]), inv_smooth [F] | None, clamp_fp16)`` -> (int8 [M, F],
  fp32 [M]): ``silu(a) * b`` feeding w2, quantized per token.

With ``dt`` = the input dtype, fp32 arithmetic (``quant.blocks.swiglu_ref`` / ``swiglu_quantize_ref``)::

    s = dt(a / (1 + exp(-a)))     # F.silu
    y = dt(s * b)                 # (fp16 + clamp_fp16: nan -> 0, inf -> +-65504, ComfyUI's clamp_fp16)

exp is libdevice ``expf`` and the division IEEE, as torch's CUDA silu: rare +-1 code flips against the reference
where an ulp moves a dt rounding (tests/test_fused.py bounds them). Importing this module imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ahead, gemm
from .checks import check_2d, check_usable, gemm_operands, smooth_vector
from .gemm import acc_tile, acc_tile_tma, dequant, select_config, tile_ids
from .launch import launch, not_recorded  # launch: the compiled kernel re-launched directly (kernel/launch.py)
from .linear import int8_gemm
from .quantize import INTERPRET, SegmentPlan, finish_tile, quant_params, sm_count, store_q
from .tailsplit import program_slots
from .rowtile import (DT_CODE, FLOAT, TilePlan, round_to, row_major, row_ptrs, row_tiles, seg_keep, seg_store, smooth,
                      swiglu_math)

# Module data, read at each call (the tests set them). One pass (silu(a) * b
# computed once and kept in registers in the model dtype) for rows up to 16384 with up to 16 warps; None, or a longer
# row: SWIGLU_PLAN's tiles (F = 12288 there: 2048-wide chunks, two passes that compute silu(a) * b twice). Both forms
# give the same codes (the row's scale is a max reduction).
SWIGLU_PLAN = TilePlan(max_single=2048, chunk=2048, chunk_warps=8)
SWIGLU_ONE_PASS: SegmentPlan | None = SegmentPlan(max_row=16384, min_seg=256, warps=16)


@triton.jit
def _swiglu_vals(a_row, b_row, ks, mask, DT: tl.constexpr, CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """``dt(silu(a) * b)`` (clamped for fp16 when asked) as fp32, before the smoothing."""
    a = tl.load(a_row + ks, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_row + ks, mask=mask, other=0.0).to(tl.float32)
    return swiglu_math(a, b, DT, CLAMP_FP16, INTERPRET)


@triton.jit(do_not_specialize=["M"])
def _gemm_swiglu_kernel(a_ptr, w_ptr, h_ptr, as_ptr, ws_ptr, bias_ptr, M, F, K,
                        stride_am, stride_ak, stride_wn, stride_wk, stride_hm, stride_hn,
                        stride_as, stride_ws, stride_bias,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                        DT: tl.constexpr, CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    # The merged w1+w3 GEMM with SwiGLU in its epilogue: a tile's BLOCK_N weight rows are HALF rows of w1 and the
    # same HALF rows of w3 (W13 rows j and F + j), so the tile holds a and b of HALF output columns; both are
    # rounded to the model dtype as the GEMM would store them, and h = dt(dt(silu(a)) * b) is stored [M, F].
    HALF: tl.constexpr = BLOCK_N // 2
    pid_m, pid_n = tile_ids(tl.program_id(0), M, F, BLOCK_M, HALF, GROUP_M)
    offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_wn = _swiglu_w_rows(pid_n, F, BLOCK_N)
    acc = acc_tile(a_ptr, w_ptr, offs_am, offs_wn, K, stride_am, stride_ak, stride_wn, stride_wk,
                   BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    _swiglu_epilogue(acc, h_ptr, as_ptr, ws_ptr, bias_ptr, pid_m, pid_n, offs_wn, M, F, stride_hm, stride_hn,
                     stride_as, stride_ws, stride_bias, BLOCK_M, BLOCK_N, HAS_BIAS, DT, CLAMP_FP16, INTERPRET)


@triton.jit
def _swiglu_values(acc, as_ptr, ws_ptr, bias_ptr, offs_cm, offs_wn, M, stride_as, stride_ws, stride_bias,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, DT: tl.constexpr,
                   CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """h of a [BLOCK_M, BLOCK_N] int32 tile of a (w1 rows) and b (w3 rows), as fp32 values of dtype DT."""
    HALF: tl.constexpr = BLOCK_N // 2
    v = round_to(dequant(acc, as_ptr, ws_ptr, bias_ptr, offs_cm, offs_wn, M, stride_as, stride_ws, stride_bias,
                        HAS_BIAS), DT, INTERPRET)
    a, b = tl.split(tl.permute(tl.reshape(v, (BLOCK_M, 2, HALF)), (0, 2, 1)))
    return swiglu_math(a, b, DT, CLAMP_FP16, INTERPRET)


@triton.jit
def _swiglu_w_rows(pid_n, F, BLOCK_N: tl.constexpr):
    """The W13 rows of output column tile ``pid_n``: HALF rows of w1 (j) and the same of w3 (F + j), a column tail
    wrapped (its results are not stored)."""
    HALF: tl.constexpr = BLOCK_N // 2
    r = tl.arange(0, BLOCK_N)
    return (pid_n * HALF + r % HALF) % F + tl.where(r < HALF, 0, F)


@triton.jit(do_not_specialize=["M"])
def _gemm_swiglu_persistent_kernel(a_desc, w_desc, h_desc, as_ptr, ws_ptr, bias_ptr, M, F, K,
                                   stride_as, stride_ws, stride_bias, NUM_PROGS,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                   GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, DT: tl.constexpr,
                                   CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    # _gemm_swiglu_kernel (same sums, same epilogue: same bits) as the persistent TMA kernel of kernel/gemm.py:
    # w_desc views W13 as [2, F, K], so one load brings a tile's w1 and w3 rows (F tails read as zero).
    HALF: tl.constexpr = BLOCK_N // 2
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(F, HALF)
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGS, flatten=True):
        pid_m, pid_n = tile_ids(tile, M, F, BLOCK_M, HALF, GROUP_M)
        acc = acc_tile_tma(a_desc, w_desc, pid_m * BLOCK_M, pid_n * HALF, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, True)
        y = _swiglu_values(acc, as_ptr, ws_ptr, bias_ptr, pid_m * BLOCK_M + tl.arange(0, BLOCK_M),
                           _swiglu_w_rows(pid_n, F, BLOCK_N), M, stride_as, stride_ws, stride_bias, BLOCK_M, BLOCK_N,
                           HAS_BIAS, DT, CLAMP_FP16, INTERPRET)
        h_desc.store([pid_m * BLOCK_M, pid_n * HALF], y.to(h_desc.dtype))  # exact: y holds values of that dtype


@triton.jit
def _swiglu_epilogue(acc, h_ptr, as_ptr, ws_ptr, bias_ptr, pid_m, pid_n, offs_wn, M, F, stride_hm, stride_hn,
                     stride_as, stride_ws, stride_bias, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_BIAS: tl.constexpr, DT: tl.constexpr, CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    HALF: tl.constexpr = BLOCK_N // 2
    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    y = _swiglu_values(acc, as_ptr, ws_ptr, bias_ptr, offs_cm, offs_wn, M, stride_as, stride_ws, stride_bias,
                       BLOCK_M, BLOCK_N, HAS_BIAS, DT, CLAMP_FP16, INTERPRET)
    offs_hn = pid_n * HALF + tl.arange(0, HALF)
    h_ptrs = h_ptr + offs_cm[:, None].to(tl.int64) * stride_hm + offs_hn[None, :] * stride_hn
    tl.store(h_ptrs, y.to(h_ptr.dtype.element_ty), mask=(offs_cm[:, None] < M) & (offs_hn[None, :] < F))


@triton.jit
def _swiglu_tile(a_row, b_row, inv_ptr, ks, mask,
                 HAS_SMOOTH: tl.constexpr, DT: tl.constexpr, CLAMP_FP16: tl.constexpr,
                 INTERPRET: tl.constexpr):
    return smooth(_swiglu_vals(a_row, b_row, ks, mask, DT, CLAMP_FP16, INTERPRET), inv_ptr, ks, mask, HAS_SMOOTH)


@triton.jit
def _swiglu_seg(a_row, b_row, inv_ptr, F, OFF: tl.constexpr, SEG: tl.constexpr, amax, bad,
                HAS_SMOOTH: tl.constexpr, DT: tl.constexpr, CLAMP_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """One segment of the one-pass SwiGLU: its values in the model dtype (exact: they are rounded to it), with
    the row's running |max| and non-finite flag updated."""
    ks = OFF + tl.arange(0, SEG)
    mask = ks < F
    y = _swiglu_vals(a_row, b_row, ks, mask, DT, CLAMP_FP16, INTERPRET)
    return seg_keep(y, a_row, inv_ptr, ks, mask, amax, bad, HAS_SMOOTH)


@triton.jit
def _swiglu_quant_kernel(a_ptr, b_ptr, inv_ptr, q_ptr, qs_ptr,
                         F, stride_am, stride_bm, stride_qm,
                         HAS_SMOOTH: tl.constexpr, DT: tl.constexpr, CLAMP_FP16: tl.constexpr,
                         SCALE_RECIP: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
                         S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, INTERPRET: tl.constexpr):
    # S0 > 0: one pass over a row split into up to three power-of-2 segments (F = 12288: 8192 + 4096, no masked
    # lanes): silu(a) * b is computed once and kept in registers in the model dtype until the row's scale is known.
    # Else one BLOCK-wide tile (SINGLE) or BLOCK-wide chunks, silu(a) * b computed in both passes (its exp and IEEE
    # division bound that form, not DRAM).
    if S0 > 0:
        row = tl.program_id(0)
        a_row, b_row, q_row = row_ptrs(a_ptr, b_ptr, q_ptr, stride_am, stride_bm, stride_qm)
        amax = tl.zeros([], dtype=tl.float32)
        bad = tl.zeros([], dtype=tl.int32)
        y0, amax, bad = _swiglu_seg(a_row, b_row, inv_ptr, F, 0, S0, amax, bad, HAS_SMOOTH, DT, CLAMP_FP16, INTERPRET)
        if S1 > 0:
            y1, amax, bad = _swiglu_seg(a_row, b_row, inv_ptr, F, S0, S1, amax, bad, HAS_SMOOTH, DT, CLAMP_FP16,
                                        INTERPRET)
        if S2 > 0:
            y2, amax, bad = _swiglu_seg(a_row, b_row, inv_ptr, F, S0 + S1, S2, amax, bad, HAS_SMOOTH, DT, CLAMP_FP16,
                                        INTERPRET)
        scale, mult, usable = quant_params(amax, bad > 0, SCALE_RECIP)
        tl.store(qs_ptr + row, scale)
        seg_store(q_row, y0, inv_ptr, F, 0, S0, mult, usable, HAS_SMOOTH, INTERPRET)
        if S1 > 0:
            seg_store(q_row, y1, inv_ptr, F, S0, S1, mult, usable, HAS_SMOOTH, INTERPRET)
        if S2 > 0:
            seg_store(q_row, y2, inv_ptr, F, S0 + S1, S2, mult, usable, HAS_SMOOTH, INTERPRET)
    else:
        row = tl.program_id(0)
        a_row, b_row, q_row = row_ptrs(a_ptr, b_ptr, q_ptr, stride_am, stride_bm, stride_qm)
        cols = tl.arange(0, BLOCK)
        if SINGLE:
            mask = cols < F
            y = _swiglu_tile(a_row, b_row, inv_ptr, cols, mask, HAS_SMOOTH, DT, CLAMP_FP16, INTERPRET)
            finish_tile(q_row + cols, qs_ptr, row, y, mask, 0.0, 0, SCALE_RECIP, INTERPRET)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            bad = tl.zeros([BLOCK], dtype=tl.int32)
            for f0 in range(0, F, BLOCK):
                ks = f0 + cols
                ay = tl.abs(_swiglu_tile(a_row, b_row, inv_ptr, ks, ks < F, HAS_SMOOTH, DT, CLAMP_FP16, INTERPRET))
                bad = tl.maximum(bad, tl.where(ay < float("inf"), 0, 1))
                amax = tl.maximum(amax, ay)
            scale, mult, usable = quant_params(tl.max(amax, axis=0), tl.max(bad, axis=0) > 0, SCALE_RECIP)
            tl.store(qs_ptr + row, scale)
            for f0 in range(0, F, BLOCK):
                ks = f0 + cols
                mask = ks < F
                y = _swiglu_tile(a_row, b_row, inv_ptr, ks, mask, HAS_SMOOTH, DT, CLAMP_FP16, INTERPRET)
                store_q(q_row + ks, y, mult, usable, mask, INTERPRET)


def gemm_swiglu(a_q: torch.Tensor, a_scale: torch.Tensor, w13: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                clamp_fp16: bool = False) -> torch.Tensor:
    """SwiGLU of the merged w1+w3 GEMM without writing its [M, 2F] output: ``h = silu(a) * b`` [M, F] in
    ``out_dtype``, where ``[a | b] = int8_gemm(a_q, a_scale, w13, w_scale, bias, out_dtype)`` (w13 int8 [2F, K],
    the w1 rows first). Equal to ``swiglu_ref(a, b, clamp_fp16)`` of that output element for element: a and b
    are rounded to ``out_dtype`` as the GEMM stores them, then silu and the product round as torch's ops do.
    Runs with the merged GEMM's tile config (the same main loop: a tile's weight rows are half w1, half w3)."""
    a_scale, w_scale, bias = gemm_operands(a_q, a_scale, w13, w_scale, bias, out_dtype)
    m, k = a_q.shape
    n2 = w13.shape[0]
    if n2 % 2:
        raise ValueError(f"w13 has {n2} rows; it must be [2F, K] (w1 rows, then w3 rows)")
    f = n2 // 2
    h = torch.empty((m, f), dtype=out_dtype, device=a_q.device)
    if m == 0 or f == 0:
        return h
    if k == 0:  # an empty sum (int8_gemm's own K = 0 path), then torch's ops
        a, b = int8_gemm(a_q, a_scale, w13, w_scale, bias, out_dtype=out_dtype).chunk(2, dim=1)
        y = torch.nn.functional.silu(a) * b
        if clamp_fp16 and out_dtype == torch.float16:
            y = torch.nan_to_num(y, nan=0.0, posinf=65504.0, neginf=-65504.0)
        return h.copy_(y)
    check_usable(a_q, "gemm_swiglu")
    cfg = select_config(a_q, a_scale, w13, w_scale, bias, None, out_dtype, tail_split=False)
    if a_q.is_cuda:
        cfg = _swiglu_config(cfg, a_q, a_scale, w13, w_scale, bias, h, clamp_fp16)
    return _launch_gemm_swiglu(a_q, a_scale, w13, w_scale, bias, h, clamp_fp16, cfg)


def _launch_gemm_swiglu(a_q, a_scale, w13, w_scale, bias, h, clamp_fp16, cfg: dict) -> torch.Tensor:
    m, k = a_q.shape
    f = h.shape[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    half = bn // 2
    if cfg.get("PERSIST") and gemm.persistent_ok(a_q, w13, h):
        _launch_gemm_swiglu_persistent(a_q, a_scale, w13, w_scale, bias, h, clamp_fp16, cfg)
        return h
    # Registers capped so that as many CTAs an SM run as the plain GEMM gets (two at 128 x 128 tiles): one CTA's
    # epilogue then overlaps the other's main loop. Uncapped, the SwiGLU epilogue's register count leaves one CTA an
    # SM, which was much slower on the H200. Tiles whose shared memory allows one CTA an SM (128 x 256) are not
    # capped.
    opts = {}
    if a_q.is_cuda:
        ctas = max(1, program_slots(cfg, a_q.device) // sm_count(a_q.device))
        regs = 65536 // (ctas * 32 * cfg["num_warps"]) // 8 * 8
        opts = {"maxnreg": regs} if regs < 255 else {}
    gemm.run_launch(cfg, _gemm_swiglu_kernel, (-(-m // bm) * -(-f // half),),
                    (a_q, w13, h, a_scale, w_scale, bias if bias is not None else a_scale, m, f, k,
                     a_q.stride(0), a_q.stride(1), w13.stride(0), w13.stride(1), h.stride(0), h.stride(1),
                     a_scale.stride(0), w_scale.stride(0), bias.stride(0) if bias is not None else 0),
                    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], HAS_BIAS=bias is not None,
                         EVEN_K=k % bk == 0, DT=DT_CODE[h.dtype],
                         CLAMP_FP16=bool(clamp_fp16) and h.dtype == torch.float16, INTERPRET=INTERPRET, **opts),
                    a_q.device)
    return h


def _launch_gemm_swiglu_persistent(a_q, a_scale, w13, w_scale, bias, h, clamp_fp16, cfg: dict) -> None:
    """The persistent TMA form of the same tile (``_gemm_swiglu_persistent_kernel``): same bits."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    m, k = a_q.shape
    f = h.shape[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    half = bn // 2
    progs = gemm.persistent_programs(-(-m // bm) * -(-f // half), a_q.device)
    gemm.run_launch(cfg, _gemm_swiglu_persistent_kernel, (progs,),
                    (TensorDescriptor(a_q, [m, k], [a_q.stride(0), 1], [bm, bk]),
                     TensorDescriptor(w13, [2, f, k], [f * w13.stride(0), w13.stride(0), 1], [2, half, bk]),
                     TensorDescriptor(h, [m, f], [h.stride(0), 1], [bm, half]),
                     a_scale, w_scale, bias if bias is not None else a_scale, m, f, k,
                     a_scale.stride(0), w_scale.stride(0), bias.stride(0) if bias is not None else 0, progs),
                    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
                         HAS_BIAS=bias is not None, DT=DT_CODE[h.dtype],
                         CLAMP_FP16=bool(clamp_fp16) and h.dtype == torch.float16, INTERPRET=INTERPRET),
                    a_q.device)


_SW_TILE: dict[tuple, dict] = {}    # (device, F, K, M bucket, the merged GEMM's config) -> the SwiGLU GEMM's config
ahead.on_failure.append(_SW_TILE.clear)   # chosen in a dry run whose compile failed: choose again


def _swiglu_config(cfg, a_q, a_scale, w13, w_scale, bias, h, clamp_fp16) -> dict:
    """The tile config of the SwiGLU-epilogue GEMM: where the s8 wgmma n256 tiles may run (``kernel.s8wgmma``),
    whichever of the merged w1+w3 GEMM's config, the s8 128 x 256 tile, its persistent TMA form and the first
    Hopper tile this kernel timed fastest (medians of interleaved rounds; kept in the autotune file under
    ``SW_..._tilep``). Its epilogue is heavier than the plain GEMM's, and a 128 x 256 tile runs one CTA an SM: the
    plain GEMM's pick need not be its own. Elsewhere ``cfg``."""
    from . import autotune, deferred, retune, s8wgmma
    if not s8wgmma.usable(a_q.device):
        return cfg
    m, k = a_q.shape
    bucket = autotune.m_bucket(m)
    memo = (a_q.device, h.shape[1], k, bucket, tuple(sorted(cfg.items())))
    hit = _SW_TILE.get(memo)
    if hit is None:
        cache = gemm.device_cache(a_q.device)
        key = f"SW_{autotune.ConfigCache.key(w13.shape[0], k, bucket)}_tilep"
        # the merged GEMM's config first: it wins ties, and its failure is raised
        cands = [cfg, *(c for c in (*autotune.s8_configs(), autotune.hopper_configs()[0]) if c != cfg)]

        def run(c):  # one launch: how a shipped config is checked before it is trusted
            return _launch_gemm_swiglu(a_q, a_scale, w13, w_scale, bias, h, clamp_fp16, c)

        def time_fn(c):
            return gemm.timed_ms(lambda: run(c))

        def best_of(time_fn):
            med = autotune.interleaved_medians(dict(enumerate(cands)), time_fn)
            return cands[min(med, key=lambda i: (med[i], i))]

        tune = deferred.mode()
        f = h.shape[1]
        ckey = retune.class_key(a_q.device, "swiglu", f, k, autotune.m_class(m), True, gemm.gemm_switches()[1])
        with not_recorded():  # the check launch of a shipped tile is not part of the call a plan records
            if tune == "first_call":
                hit = cache.get(key, seed=False) or autotune.seed_entry(cache, key, check=run, configs=cands)
                if hit is None:
                    hit = best_of(time_fn)
                    cache.put(key, hit, gemm.tuning_meta(a_q.device))
            else:
                dev = a_q.device

                def later(what, entry):
                    specs = [retune.spec(t) for t in (a_q, a_scale, w13, w_scale, bias, h)]

                    def job(stop):
                        def work():
                            ops = [retune.fresh(s_) for s_ in specs]

                            def timed(c):
                                stop()
                                return gemm.timed_ms(lambda: _launch_gemm_swiglu(*ops, clamp_fp16, c))
                            if what == "adopt":
                                stop()
                                _launch_gemm_swiglu(*ops, clamp_fp16, entry)
                                best = entry
                            else:
                                best = best_of(timed)
                                cache.put(key, best, gemm.tuning_meta(dev))
                            retune.built(ckey, best)
                        retune.run_on(dev, work, specs)
                        retune.forget([_SW_TILE], dev, f, k)
                    retune.submit(f"{what} {key}", job)
                hit = autotune.choose(cache, key, retune.built_for(ckey), cands, tune, time_fn, check=run, later=later)
            retune.built(ckey, hit)
        hit = _SW_TILE[memo] = {k_: v for k_, v in hit.items() if k_ != "SPLIT"}
    return hit


def swiglu_operands(h13) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) [M, F] of ``h13``: [M, 2F] (the w1 half first) or a pair; checked."""
    if isinstance(h13, (tuple, list)):
        a, b = h13
        check_2d(a, "a (the w1 output)", FLOAT, "pass silu's input as [tokens, F]")
        check_2d(b, "b (the w3 output)", FLOAT, "pass the gate as [tokens, F]")
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            raise ValueError(f"a and b must match: a {tuple(a.shape)} {a.dtype} on {a.device}, "
                             f"b {tuple(b.shape)} {b.dtype} on {b.device}")
        return a, b
    check_2d(h13, "h13", FLOAT, "pass the merged w1+w3 output as [tokens, 2F]")
    if h13.shape[1] % 2:
        raise ValueError(f"h13 has {h13.shape[1]} columns; it must be [M, 2F] (w1 half, then w3 half)")
    return h13.chunk(2, dim=1)


def swiglu_quantize(h13, inv_smooth: torch.Tensor | None = None, clamp_fp16: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``h13`` = [M, 2F] (the w1 half first, as the merged w1+w3 GEMM writes it) or a pair (a [M, F],
    b [M, F]) -> (int8 [M, F], fp32 scale [M]) of ``silu(a) * b * inv_smooth`` with the roundings of the
    module docstring. ``clamp_fp16``: apply ComfyUI's ``clamp_fp16`` (fp16 inputs only; current ComfyUI's
    FeedForward does, 0.3.75 does not)."""
    a, b = swiglu_operands(h13)
    m, f = a.shape
    inv = smooth_vector(inv_smooth, f, a.device)
    q = torch.empty((m, f), dtype=torch.int8, device=a.device)
    qs = torch.empty((m,), dtype=torch.float32, device=a.device)
    if m == 0 or f == 0:
        return q, qs.zero_()
    check_usable(a, "swiglu_quantize")
    a, b = row_major(a, "a"), row_major(b, "b")
    tiles, warps = row_tiles(f, SWIGLU_ONE_PASS, SWIGLU_PLAN)
    launch(_swiglu_quant_kernel, (m,),
           (a, b, inv if inv is not None else qs, q, qs, f, a.stride(0), b.stride(0), q.stride(0)),
           dict(HAS_SMOOTH=inv is not None, DT=DT_CODE[a.dtype],
                CLAMP_FP16=bool(clamp_fp16) and a.dtype == torch.float16, SCALE_RECIP=a.is_cuda,
                INTERPRET=INTERPRET, **tiles), warps, 1, a.device)
    return q, qs
