"""Every kernel the pack can launch, compiled for the GPU generations users have, without a GPU (issue 36 item 1).

    python tests/compile_targets.py [--targets 80,86,89,90,120] [--kinds gemm,row,quant,attn] [--workers 2]
        [--out bench/results/compile-targets.json] [--other-triton .runtime/triton-3.4.0 ...]

How: Triton's own target compilation, ``triton.compile(ASTSource(kernel, signature, constexprs, attrs),
target=GPUTarget("cuda", arch, 32))``, with the signature and specialization Triton's own binder derives from the
arguments a launch passes (CPU tensors of the launch's dtypes stand in for the GPU's: only dtypes, 16-byte alignment
and integer values matter) and the ptxas Triton ships. sm_90's s8 tiles are built as the pack builds them: the fp8
build, its PTX rewritten to s8 wgmma and assembled again (``kernel.s8wgmma.rewritten``). Per kernel, read from the
cubin with Triton's cuobjdump: registers a thread, spills (Triton's ``n_spills``: local memory bytes / 4) and shared
memory (``metadata.shared``, what Triton's loader checks against the device's opt-in limit, and the static part).

What each target gets: every GEMM tile ``autotune.target_candidates`` offers that generation, as the plain GEMM (bf16
out, bias), as the SwiGLU-epilogue GEMM (under the ``maxnreg`` its launcher sets) and, for the large-M tiles, with the
tail split (SPLIT 2, its launcher's ``maxnreg`` at that tile's occupancy on the target); the one-launch small-M W8A8
kernel at the small tiles; the fused row kernels and the quantizers at the plans their launchers choose for the model
widths (``MODELS``), and ConvRot's rotate + quantize kernels (plain, after a LayerNorm, after an RMSNorm) at groups 64
and 256; the attention kernel at every tile ``attention8.configs`` keeps within the target's shared memory and at
``default_config`` for that limit (labelled "(default)"), with its block quantizer. Checks
(tests/test_compile_targets.py): each compiles, fits the target's shared memory (``autotune.SMEM_OPTIN``), a GEMM
within ``autotune.smem_bytes``, and spills at most ``SPILL_BOUND`` bytes. ``--other-triton DIR``: the sm_90 GEMMs
(s8 rewrite included) again with the Triton installed in DIR (scripts/setup_runtime.sh puts 3.4.0 and 3.9.0 under
.runtime/), in a subprocess.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))
import pack_import  # noqa: E402
pack_import.install()  # kernel, quant, adapters: the pack's subpackages, imported one way (tests/pack_import.py)

TARGETS = {80: (8, 0), 86: (8, 6), 89: (8, 9), 90: (9, 0), 120: (12, 0)}
# per target: (shared memory an SM, threads an SM), what the launchers' occupancy estimate (``tailsplit.ctas_per_sm``) reads
SM_RESOURCES = {80: (167936, 2048), 86: (102400, 1536), 89: (102400, 1536), 90: (233472, 2048), 120: (102400, 1536)}
SPILL_BOUND = 0       # bytes of local memory (register spills) any compiled kernel may use
KINDS = ("gemm", "row", "quant", "attn")
# hidden width, FFN width, heads, head_dim of the block shapes the pack's adapters run
MODELS = {
    "ideogram4": (4608, 12288, 18, 256),
    "flux1": (3072, 12288, 24, 128),
    "z-image": (3840, 10240, 30, 128),
    "wan2.1-1.3b": (1536, 8960, 12, 128),
    "wan2.1-14b": (5120, 13824, 40, 128),
    "qwen-image": (3072, 12288, 24, 128),
}
QUANT_WIDTHS = (128, 512, 53248)  # unfused GEMM inputs besides the model widths (input_proj, adaLN, Ideogram's LLM)
ATTN_HEAD_DIMS = (128, 256)       # the models' head dims


class P:
    """A pointer argument of ``dtype`` (a 16-byte aligned CPU tensor stands in)."""

    def __init__(self, dtype):
        self.dtype = dtype


class D:
    """A TMA descriptor argument: ``dtype`` elements, ``shape`` / ``strides`` / ``block`` as its launcher builds it."""

    def __init__(self, dtype, shape, strides, block):
        self.dtype, self.shape, self.strides, self.block = dtype, list(shape), list(strides), list(block)


def job(kind, module, kernel, label, args, consts, warps, stages, opts=None, s8=False, cfg=None):
    """One compile: ``module.kernel`` with ``args`` (every runtime parameter by name), ``consts`` (constexprs),
    ``opts`` (compile options: maxnreg, enable_fp_fusion); ``s8``: built from fp8 operands, then rewritten."""
    return dict(kind=kind, module=module, kernel=kernel, label=label, args=args, consts=consts, warps=warps,
                stages=stages, opts=opts or {}, s8=s8, cfg=cfg)


# ---------------------------------------------------------------------------------------------------------- GEMMs
def gemm_jobs(arch: int) -> list[dict]:
    import torch

    from kernel import autotune, tailsplit
    cap = TARGETS[arch]
    smem_sm, threads = SM_RESOURCES[arch]
    bf, f32, i8, i32 = torch.bfloat16, torch.float32, torch.int8, torch.int32
    out, buckets = [], {}
    for bucket, cfgs in autotune.target_candidates(cap).items():
        for cfg in cfgs:
            buckets.setdefault(tuple(sorted(cfg.items())), (cfg, []))[1].append(bucket)
    n = k = 4608
    for cfg, bs in buckets.values():
        bucket = bs[0]
        m = {"small": 2, "medium": 77, "large": 4608}[bucket]
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        s8, persist = bool(cfg.get("S8")), bool(cfg.get("PERSIST"))
        a_t = torch.float8_e4m3fn if s8 else i8
        tile = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"])
        name = "x".join(map(str, (bm, bn, bk))) + f" w{cfg['num_warps']} s{cfg['num_stages']} g{cfg['GROUP_M']}" \
            + (" s8" if s8 else "") + (" persistent" if persist else "")
        ctas = tailsplit.ctas_per_sm(cfg, smem_sm, 65536, threads)
        common = dict(as_ptr=P(f32), ws_ptr=P(f32), bias_ptr=P(bf), part_ptr=P(i32), cnt_ptr=P(i32),
                      stride_as=1, stride_ws=1, stride_bias=1, lh_ptr=P(f32), lu_ptr=P(f32), stride_lh=0,
                      stride_lu=0)  # no LoRA: the scale vector stands in for its pointers (kernel.gemm)
        if persist:
            tiles = -(-m // bm) * -(-n // bn)
            out.append(job("gemm", "kernel.gemm", "_int8_gemm_persistent_kernel", name, dict(
                common, a_desc=D(a_t, [m, k], [k, 1], [bm, bk]), w_desc=D(a_t, [n, k], [k, 1], [bn, bk]),
                c_desc=D(bf, [m, n], [n, 1], [bm, bn // 2]), M=m, N=n, K=k, DP_TILES=tiles, K_PIECE=0,
                NUM_PROGS=132), dict(tile, HAS_BIAS=True, SPLIT=1, INTERPRET=False, LORA_R=0, LORA_STEP=0),
                cfg["num_warps"], cfg["num_stages"], s8=s8, cfg=cfg))
            f = n
            half = bn // 2
            out.append(job("gemm", "kernel.swiglu", "_gemm_swiglu_persistent_kernel", name + " swiglu", dict(
                as_ptr=P(f32), ws_ptr=P(f32), bias_ptr=P(bf), stride_as=1, stride_ws=1, stride_bias=1,
                a_desc=D(a_t, [m, k], [k, 1], [bm, bk]), w_desc=D(a_t, [2, f, k], [f * k, k, 1], [2, half, bk]),
                h_desc=D(bf, [m, f], [f, 1], [bm, half]), M=m, F=f, K=k, NUM_PROGS=132),
                dict(tile, HAS_BIAS=True, DT=1, CLAMP_FP16=False, INTERPRET=False),
                cfg["num_warps"], cfg["num_stages"], s8=s8, cfg=cfg))
            continue
        plain = dict(common, a_ptr=P(a_t), w_ptr=P(a_t), c_ptr=P(bf), M=m, N=n, K=k, DP_TILES=1296, K_PIECE=0,
                     stride_am=k, stride_ak=1, stride_wn=k, stride_wk=1, stride_cm=n, stride_cn=1)
        consts = dict(tile, HAS_BIAS=True, OUT_INT32=False, EVEN_K=True, SPLIT=1, INTERPRET=False, LORA_R=0,
                      LORA_STEP=0)
        out.append(job("gemm", "kernel.gemm", "_int8_gemm_kernel", name, plain, consts, cfg["num_warps"],
                       cfg["num_stages"], s8=s8, cfg=cfg))
        if bucket == "small":
            out.append(job("gemm", "kernel.gemm", "_w8a8_small_m_kernel", name + " small-M W8A8", dict(
                x_ptr=P(bf), inv_ptr=P(f32), w_ptr=P(i8), c_ptr=P(bf), ws_ptr=P(f32), bias_ptr=P(bf), M=m, N=n,
                K=k, stride_xm=k, stride_xk=1, stride_wn=k, stride_wk=1, stride_cm=n, stride_cn=1, stride_ws=1,
                stride_bias=1), dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_SMOOTH=True, HAS_BIAS=True,
                                     SCALE_RECIP=True, INTERPRET=False),
                cfg["num_warps"], cfg["num_stages"], cfg=cfg))
            continue
        regs = tailsplit.split_maxnreg(ctas, cfg["num_warps"])
        sw_opts = {"maxnreg": regs} if regs else {}
        f = n
        out.append(job("gemm", "kernel.swiglu", "_gemm_swiglu_kernel", name + " swiglu", dict(
            as_ptr=P(f32), ws_ptr=P(f32), bias_ptr=P(bf), stride_as=1, stride_ws=1, stride_bias=1,
            a_ptr=P(a_t), w_ptr=P(a_t), h_ptr=P(bf), M=m, F=f, K=k,
            stride_am=k, stride_ak=1, stride_wn=k, stride_wk=1, stride_hm=f, stride_hn=1),
            dict(tile, HAS_BIAS=True, EVEN_K=True, DT=1, CLAMP_FP16=False, INTERPRET=False),
            cfg["num_warps"], cfg["num_stages"], sw_opts, s8=s8, cfg=cfg))
        if "large" in bs:  # the tail split is timed where tiles outnumber a wave
            out.append(job("gemm", "kernel.gemm", "_int8_gemm_kernel", name + " tail split 2",
                           dict(plain, M=4608, DP_TILES=1188, K_PIECE=2304), dict(consts, SPLIT=2),
                           cfg["num_warps"], cfg["num_stages"], sw_opts, s8=s8, cfg=cfg))
    return out


# ------------------------------------------------------------------------------------------------------ row kernels
def row_jobs(arch: int) -> list[dict]:
    """The fused row kernels at the plans their launchers choose (``kernel.rowtile.row_tiles``) for ``MODELS``."""
    import torch

    from kernel import gelu, norm, residual, rope, rowtile, swiglu
    from kernel.quantize import seg_warps, segments
    bf, f32, i8 = torch.bfloat16, torch.float32, torch.int8
    out = []

    def add(module, kernel, label, args, consts, warps, opts=None):
        out.append(job("row", f"kernel.{module}", kernel, label, args, dict(consts, INTERPRET=False), warps, 1, opts))

    dims = sorted({v[0] for v in MODELS.values()})
    ffns = sorted({v[1] for v in MODELS.values()})
    for k in dims:
        tiles, warps = rowtile.row_tiles(k, norm.RMS_ONE_PASS, norm.RMS_PLAN)
        add("norm", "_rmsnorm_modulate_quant_kernel", f"rmsnorm_modulate_quantize K{k}", dict(
            x_ptr=P(bf), w_ptr=P(bf), s_ptr=P(bf), inv_ptr=P(f32), q_ptr=P(i8), qs_ptr=P(f32), K=k,
            tokens_per_batch=4096, eps=1e-6, stride_xm=k, stride_sb=k, stride_qm=k),
            dict(HAS_SMOOTH=True, NORM_DT=1, PROD_DT=1, SCALE_RECIP=True, **tiles), warps)
        tiles, warps = rowtile.row_tiles(k, norm.LN_ONE_PASS, norm.LN_PLAN)
        add("norm", "_layernorm_modulate_quant_kernel", f"layernorm_modulate_quantize K{k}", dict(
            x_ptr=P(bf), s_ptr=P(bf), sh_ptr=P(bf), inv_ptr=P(f32), q_ptr=P(i8), qs_ptr=P(f32), K=k,
            tokens_per_batch=4096, eps=1e-6, stride_xm=k, stride_sb=k, stride_shb=k, stride_qm=k),
            dict(HAS_SMOOTH=True, NORM_DT=1, SCALE_DT=1, PROD_DT=1, SCALE_RECIP=True, **tiles), warps)
        if not rowtile.fits(k):
            continue
        tiles, warps = rowtile.row_tiles(k, residual.RESIDUAL_ONE_PASS)
        add("residual", "_gated_residual_kernel", f"gated_residual_rmsnorm K{k}", dict(
            x_ptr=P(bf), o_ptr=P(bf), wn_ptr=P(bf), g_ptr=P(bf), y_ptr=P(bf), w2_ptr=P(bf), s2_ptr=P(bf),
            inv_ptr=P(f32), q_ptr=P(i8), qs_ptr=P(f32), K=k, tokens_per_batch=4096, eps=1e-6, eps2=1e-6,
            stride_xm=k, stride_om=k, stride_gb=k, stride_ym=k, stride_sb=k, stride_qm=k),
            dict(NORM_DT=1, GATE_DT=1, OUT_DT=1, HAS_NEXT=True, HAS_SMOOTH=True, NEXT_PROD_DT=1, SCALE_RECIP=True,
                 **tiles), warps, {"enable_fp_fusion": False})
        tiles, warps = rowtile.row_tiles(k, residual.RESIDUAL_LN_ONE_PASS)
        for mode, what in ((0, "residual_add (x + y * gate)"), (1, "residual_add_layernorm"),
                           (2, "residual_add_layernorm_modulate_quantize")):
            o2 = i8 if mode == 2 else bf
            add("residual", "_residual_layernorm_kernel", f"{what} K{k}", dict(
                x_ptr=P(bf), y_ptr=P(bf), g_ptr=P(bf), r_ptr=P(bf), w_ptr=P(bf), b_ptr=P(bf), s_ptr=P(bf),
                sh_ptr=P(bf), inv_ptr=P(f32 if mode == 2 else bf), n_ptr=P(o2), q_ptr=P(o2),
                qs_ptr=P(f32 if mode == 2 else bf), K=k, tokens_per_batch=4096, eps=1e-6, stride_xm=k, stride_ym=k,
                stride_gb=k, stride_rm=k, stride_sb=k, stride_shb=k, stride_nm=k),
                dict(HAS_GATE=True, ROUND_PRODUCT=mode == 0, MODE=mode, HAS_W=mode == 1, HAS_B=mode == 1,
                     HAS_SMOOTH=mode == 2, DT=1, SCALE_DT=1 if mode == 2 else 0, PROD_DT=1, SCALE_RECIP=True,
                     **tiles), warps)
    for f in ffns:
        tiles, warps = rowtile.row_tiles(f, swiglu.SWIGLU_ONE_PASS, swiglu.SWIGLU_PLAN)
        add("swiglu", "_swiglu_quant_kernel", f"swiglu_quantize F{f}", dict(
            a_ptr=P(bf), b_ptr=P(bf), inv_ptr=P(f32), q_ptr=P(i8), qs_ptr=P(f32), F=f, stride_am=2 * f,
            stride_bm=2 * f, stride_qm=f), dict(HAS_SMOOTH=True, DT=1, CLAMP_FP16=False, SCALE_RECIP=True, **tiles),
            warps)
    for ka, f, what in [(0, f, "gelu_tanh_quantize") for f in ffns] + [(3072, 12288, "concat_gelu_quantize")]:
        segs = segments(f, gelu.GELU_ONE_PASS)  # as kernel.gelu._concat_gelu chooses
        asegs = segments(ka, gelu.GELU_ONE_PASS) if ka else (0, 0, 0)
        if segs is not None and asegs is not None and asegs[2] == 0:
            tiles = dict(BLOCK=0, SINGLE=False, A0=asegs[0], A1=asegs[1], S0=segs[0], S1=segs[1], S2=segs[2])
            warps = seg_warps(tuple(asegs) + tuple(segs), gelu.GELU_ONE_PASS)
        else:
            tiles, warps = rowtile.row_tiles(max(ka, f), None, gelu.GELU_PLAN)
            tiles.update(A0=0, A1=0)
        add("gelu", "_concat_gelu_quant_kernel", f"{what} {'KA%d ' % ka if ka else ''}F{f}", dict(
            a_ptr=P(bf), h_ptr=P(bf), inv_ptr=P(f32), q_ptr=P(i8), qs_ptr=P(f32), KA=ka, F=f, stride_am=ka,
            stride_hm=f, stride_qm=ka + f), dict(HAS_A=ka > 0, HAS_SMOOTH=True, DT=1, SCALE_RECIP=True,
                                                 FAST=gelu.GELU_FAST, **tiles), warps)
    seen = set()
    for model, (dim, _, heads, d) in MODELS.items():
        row = model.startswith("wan")  # Wan's QK norm spans the row (kernel.rope.qk_rmsnorm_rope_rows)
        if row:
            block_h = 1 << (heads - 1).bit_length()
            warps = 4 if block_h * d <= 4096 else 8
        else:
            block_h = max(1, min(heads & -heads, rope.QK_GROUP_ELEMS // d))
            warps = max(2, min(8, block_h * d // 256))
        consts = dict(D=d, BLOCK_H=block_h, DT=1, HAS_PE=True, SPLIT_HALF=model == "ideogram4", NORM_ROW=row,
                      WRITE_V=not row, PREFETCH=rope.QK_PREFETCH)
        key = (tuple(sorted(consts.items())), warps)
        if key in seen:
            continue
        seen.add(key)
        w = heads * d if row else 3 * heads * d
        add("rope", "_qk_norm_rope_kernel", f"qk_norm_rope {model} {heads}x{d}", dict(
            src_ptr=P(bf), ksrc_ptr=P(bf), wq_ptr=P(bf), wk_ptr=P(bf), pe_ptr=P(f32), q_ptr=P(bf), k_ptr=P(bf),
            v_ptr=P(bf), L=4096, H=heads, row_offset=512, k_off=0 if row else heads * d, eps_q=1e-6, eps_k=1e-6,
            stride_sb=4096 * w, stride_sl=w, stride_pb=0, stride_pl=d * 2, stride_ob=4608 * heads * d,
            stride_oh=d, stride_ol=heads * d), consts, warps)
    return out


def quant_jobs(arch: int) -> list[dict]:
    """``quantize_per_token`` at the plans its launcher chooses for the model widths and ``QUANT_WIDTHS``."""
    import torch

    from kernel import quantize as q
    bf, f32, i8 = torch.bfloat16, torch.float32, torch.int8
    widths = sorted({v[0] for v in MODELS.values()} | {v[1] for v in MODELS.values()} | set(QUANT_WIDTHS))
    out = []
    for k in widths:
        base = dict(x_ptr=P(bf), inv_ptr=P(f32), q_ptr=P(i8), s_ptr=P(f32), K=k, stride_xm=k, stride_qm=k)
        segs = q.segments(k, q.QUANT_ONE_PASS)
        if segs is not None:
            consts = dict(HAS_SMOOTH=True, SCALE_RECIP=True, S0=segs[0], S1=segs[1], S2=segs[2], INTERPRET=False)
            warps = q.seg_warps(segs, q.QUANT_ONE_PASS)
            out.append(job("quant", "kernel.quantize", "_quant_rows_seg_kernel", f"quantize_per_token K{k}", base,
                           consts, warps, 1))
            if q.QUANT_ROW_LOOP:
                out.append(job("quant", "kernel.quantize", "_quant_rows_loop_kernel",
                               f"quantize_per_token K{k} (row loop)", dict(base, M=4608), consts, warps, 1))
        else:
            bk, warps, one = q._block_k(k)
            out.append(job("quant", "kernel.quantize", "_quant_rows_kernel", f"quantize_per_token K{k}",
                           dict(base, M=4608, stride_xk=1), dict(HAS_SMOOTH=True, SCALE_RECIP=True, BLOCK_K=bk,
                                                                 ONE_CHUNK=one, INTERPRET=False), warps, 3))
    # ConvRot's rotate + quantize kernels (K is a runtime integer there: one build per group size serves every width)
    from kernel import hadamard as hd
    for group in (64, 256):
        g1, g2 = hd.group_split(group)
        common = dict(G1=g1, G2=g2, BM=hd.BLOCK_M, SCALE_RECIP=True, INTERPRET=False)
        # ACT 0: the plain rotation; 1: SwiGLU in front (w2 of Flux.2's MLP); 2: GELU after a first part (Flux's
        # linear2: attention 3072 | MLP 12288)
        for act, what, k, ka in ((0, "hadamard_quantize", 3072, 3072), (1, "swiglu_hadamard_quantize", 12288, 12288),
                                 (2, "concat_gelu_hadamard_quantize", 15360, 3072)):
            out.append(job("quant", "kernel.hadamard", "_hadamard_quant_kernel", f"{what} G{group}", dict(
                x_ptr=P(bf), b_ptr=P(bf), q_ptr=P(i8), s_ptr=P(f32), f_ptr=P(f32), M=4608, K=k, KA=ka,
                stride_xm=2 * k if act == 1 else ka, stride_bm={0: k, 1: 2 * k, 2: k - ka}[act], stride_qm=k,
                stride_fm=0), dict(common, HALF=False, ACT=act, DT=1, CLAMP_FP16=False, FAST=act == 2,
                                   STORE_FLOAT=False), 4, 1))
        for rms, what in ((False, "layernorm"), (True, "rmsnorm")):
            out.append(job("quant", "kernel.hadamard", "_norm_mod_hadamard_quant_kernel",
                           f"{what}_modulate_hadamard_quantize G{group}", dict(
                               x_ptr=P(bf), w_ptr=P(bf), s_ptr=P(bf), sh_ptr=P(bf), q_ptr=P(i8), qs_ptr=P(f32),
                               M=4608, K=3072, tokens_per_batch=4096, eps=1e-6, stride_xm=3072, stride_sb=3072,
                               stride_shb=3072, stride_qm=3072),
                           dict(common, RMS=rms, NORM_DT=1, SCALE_DT=0 if rms else 1, PROD_DT=1), 4, 1))
    return out


def attn_jobs(arch: int) -> list[dict]:
    import torch

    from kernel import attention8 as at
    from kernel import autotune
    bf, f32, i8 = torch.bfloat16, torch.float32, torch.int8
    limit = autotune.SMEM_OPTIN[TARGETS[arch]]
    out = []
    for d in ATTN_HEAD_DIMS:
        cfgs = at.configs(d, limit)
        default = at.default_config(d, limit, interpret=False)
        if default not in cfgs:
            cfgs = cfgs + [default]
        blocks = set()
        for cfg in cfgs:
            bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
            blocks.add(bn)
            label = f"attention D{d} {at.config_text(cfg)}" + (" (default)" if cfg == default else "")
            out.append(job("attn", "kernel.attention8", "_attn_int8_kernel", label, dict(
                Q=P(bf), QQ=P(i8), QS=P(f32), KQ=P(i8), KS=P(f32), V=P(bf), O=P(bf), Lq=4608, Lk=4608, H=24, GROUP=24,
                qmult=0.127, n_qblocks=4608 // bm, n_kblocks=4608 // bn, stride_qb=4608 * 24 * d, stride_qh=d,
                stride_ql=24 * d, stride_vb=4608 * 24 * d, stride_vh=d, stride_vl=24 * d, stride_ob=4608 * 24 * d,
                stride_oh=d, stride_ol=24 * d), dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, Q_PREQUANT=False,
                                                     RESCALE_TAU=float(cfg.get("RESCALE_TAU", 0.0)), INTERPRET=False),
                cfg["num_warps"], cfg["num_stages"], cfg=cfg))
        for b in sorted(blocks):
            out.append(job("attn", "kernel.attention8", "_quant_blocks_kernel", f"attention K quantizer D{d} block {b}",
                           dict(X=P(bf), MEAN=P(f32), XQ=P(i8), XS=P(f32), L=4608, HX=24, mult=1.0,
                                n_blocks=4608 // b, stride_xb=4608 * 24 * d, stride_xh=d, stride_xl=24 * d),
                           dict(HEAD_DIM=d, BLOCK=b, HAS_MEAN=True, INTERPRET=False), 4, 3))
    return out


JOBS = {"gemm": gemm_jobs, "row": row_jobs, "quant": quant_jobs, "attn": attn_jobs}


# ------------------------------------------------------------------------------------------------------- compiling
def _materialize(v):
    import torch
    if isinstance(v, P):
        return torch.empty(64, dtype=v.dtype)
    if isinstance(v, D):
        from triton.tools.tensor_descriptor import TensorDescriptor
        return TensorDescriptor(torch.empty(64, dtype=v.dtype), v.shape, v.strides, v.block)
    return v


def compile_one(spec: dict, arch: int):
    """(CompiledKernel, its cubin) of ``spec`` for sm_``arch``: Triton's binder specializes the arguments as a launch
    would, ``triton.compile`` builds them for that target; an ``s8`` spec is then rewritten as the pack does."""
    import importlib

    import triton
    from triton._utils import find_paths_if, get_iterable_path
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    runtime = [p.name for p in fn.params if not p.is_constexpr]
    missing, extra = set(runtime) - set(spec["args"]), set(spec["args"]) - set(runtime)
    if missing or extra:
        raise TypeError(f"{spec['kernel']}: arguments missing {sorted(missing)}, unknown {sorted(extra)}")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(spec["consts"], num_warps=spec["warps"], num_stages=spec["stages"], **spec["opts"])
    bound, specialization, _ = binder(*[_materialize(spec["args"][n]) for n in runtime], **kwargs)
    sigvals = [s[0] for s in specialization]
    signature = dict(zip([p.name for p in fn.params], sigvals))
    constexprs = {p: get_iterable_path(list(bound.values()), p)
                  for p in find_paths_if(sigvals, lambda _, v: v == "constexpr")}
    attrvals = ["" if s[0] == "constexpr" else s[1] for s in specialization]
    attrs = {p: backend.parse_attr(get_iterable_path(attrvals, p))
             for p in find_paths_if(attrvals, lambda _, x: isinstance(x, str))}
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                            options=backend.parse_options(kwargs).__dict__)
    if spec["s8"]:
        from kernel import s8wgmma
        kernel = s8wgmma.rewritten(kernel)
    return kernel, kernel.asm["cubin"]


def cuobjdump_path() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(cubin: bytes) -> dict:
    """Registers a thread, static shared memory, local memory (spills) and stack of the cubin's kernel."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(cubin)
        text = subprocess.run([cuobjdump_path(), "-res-usage", path], capture_output=True, text=True).stdout
    got = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    if "REG" not in got:
        raise RuntimeError(f"cuobjdump -res-usage gave no resources: {text[:300]!r}")
    return {"regs": int(got["REG"]), "static_shared": int(got.get("SHARED", 0)),
            "local_bytes": int(got.get("LOCAL", 0)), "stack": int(got.get("STACK", 0))}


def run_spec(spec: dict, arch: int) -> dict:
    """One row of the table: the kernel, its config, and what compiling it for sm_``arch`` gave (or the error)."""
    from kernel import autotune
    row = {"kind": spec["kind"], "kernel": spec["kernel"], "label": spec["label"], "num_warps": spec["warps"],
           "num_stages": spec["stages"], **({"opts": spec["opts"]} if spec["opts"] else {})}
    if spec["cfg"] is not None:
        row["config"] = spec["cfg"]
    try:
        try:
            kernel, cubin = compile_one(spec, arch)
            if spec["s8"]:
                row["s8_rewrite"] = True
        except Exception as e:  # noqa: BLE001
            if not spec["s8"]:
                raise
            # kernel.s8wgmma._build: any failure of the fp8 build or its rewrite turns the path off and the same
            # tile runs as Triton's int8 build; that build is what this target then gets
            row["s8_rewrite"] = False
            row["s8_error"] = f"{type(e).__name__}: {str(e)[:600]}"
            kernel, cubin = compile_one(dict(spec, s8=False, args=_as_int8(spec["args"])), arch)
        res = resources(cubin)
        row.update(res, shared=int(kernel.metadata.shared), n_spills=res["local_bytes"] // 4, error=None)
    except Exception as e:  # noqa: BLE001 - recorded: the test fails on it
        row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    row["smem_limit"] = autotune.SMEM_OPTIN[TARGETS[arch]]
    return row


def _as_int8(args: dict) -> dict:
    """``args`` with its fp8 operands as int8 (the s8 build's int8 twin)."""
    import torch

    def conv(v):
        if isinstance(v, P) and v.dtype == torch.float8_e4m3fn:
            return P(torch.int8)
        if isinstance(v, D) and v.dtype == torch.float8_e4m3fn:
            return D(torch.int8, v.shape, v.strides, v.block)
        return v
    return {k: conv(v) for k, v in args.items()}


def _run_one(a):
    spec, arch = a
    return arch, run_spec(spec, arch)


def compile_targets(targets, kinds, workers: int = 1) -> dict:
    """{"sm_<arch>": {capability, smem_limit, candidates, kernels: [rows]}} for ``targets`` and ``kinds``."""
    from kernel import autotune
    work = [(spec, arch) for arch in targets for kind in kinds for spec in JOBS[kind](arch)]
    if workers > 1:
        with concurrent.futures.ProcessPoolExecutor(workers) as ex:
            done = list(ex.map(_run_one, work))
    else:
        done = [_run_one(a) for a in work]
    out = {}
    for arch in targets:
        cap = TARGETS[arch]
        out[f"sm_{arch}"] = {
            "capability": list(cap), "smem_limit": autotune.SMEM_OPTIN[cap],
            "candidates": {b: [tile_text(c) for c in cs] for b, cs in autotune.target_candidates(cap).items()},
            "kernels": [row for a, row in done if a == arch]}
    return out


def tile_text(cfg: dict) -> str:
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']} "
            f"g{cfg['GROUP_M']}" + (" s8" if cfg.get("S8") else "") + (" persistent" if cfg.get("PERSIST") else ""))


def problems(table: dict) -> list[str]:
    """What breaks the rules in a ``compile_targets`` table: a failed compile, shared memory past the target's limit
    (or a GEMM's past ``autotune.smem_bytes`` + ``SMEM_HEADROOM``, the bound its candidates are filtered by), spills
    past ``SPILL_BOUND``."""
    from kernel import autotune
    bad = []
    for name, t in table.items():
        for r in t["kernels"]:
            what = f"{name} {r['kernel']} [{r['label']}]"
            if r.get("error"):
                bad.append(f"{what}: {r['error']}")
                continue
            if r["shared"] + r["static_shared"] > r["smem_limit"]:
                bad.append(f"{what}: shared memory {r['shared']} + {r['static_shared']} > {r['smem_limit']}")
            # the filter's bound is the tile's (a tail-split build also stages its partials' sum: the limit only)
            est = autotune.smem_bytes(r["config"]) + autotune.SMEM_HEADROOM \
                if r["kind"] == "gemm" and "tail split" not in r["label"] else None
            if est is not None and r["shared"] > est:
                bad.append(f"{what}: shared memory {r['shared']} > the candidate filter's bound {est}")
            if r["local_bytes"] > SPILL_BOUND:
                bad.append(f"{what}: {r['local_bytes']} bytes of spills > {SPILL_BOUND}")
    return bad


def triton_info() -> dict:
    import triton
    from kernel import s8wgmma
    info = {"triton": triton.__version__, "triton_dir": os.path.dirname(triton.__file__)}
    for arch in (86, 90, 120):
        try:
            v = subprocess.run([s8wgmma.ptxas_path(arch), "--version"], capture_output=True, text=True).stdout
            info[f"ptxas_sm{arch}"] = (re.findall(r"release [\d.]+, V[\d.]+", v) or ["?"])[0]
        except OSError as e:
            info[f"ptxas_sm{arch}"] = f"? ({e})"
    return info


def other_triton(path: str, targets=(90,), kinds=("gemm",), workers: int = 1, timeout: int = 1800) -> dict:
    """The same compile with the Triton installed in ``path`` (a ``pip install --target`` folder), in a subprocess."""
    if not (Path(path) / "triton" / "__init__.py").is_file():
        raise FileNotFoundError(f"no Triton in {path}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(path).resolve()), str(ROOT)]))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--targets", ",".join(map(str, targets)),
           "--kinds", ",".join(kinds), "--workers", str(workers), "--json-stdout"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--targets", default="80,86,89,90,120", help="compute capabilities as 80,86,89,90,120")
    ap.add_argument("--kinds", default=",".join(KINDS), help="of " + ",".join(KINDS))
    ap.add_argument("--workers", type=int, default=2, help="compile processes")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "compile-targets.json"))
    ap.add_argument("--other-triton", action="append", default=None,
                    help="a folder with another Triton (pip install --target): sm_90's GEMMs compiled with it too "
                         "(default: .runtime/triton-* where present)")
    ap.add_argument("--json-stdout", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("run without TRITON_INTERPRET: this compiles for real targets")
    targets = [int(t) for t in args.targets.split(",") if t]
    kinds = [k for k in args.kinds.split(",") if k]
    table = compile_targets(targets, kinds, args.workers)
    result = {"info": triton_info(), "targets": table, "problems": problems(table)}
    if args.json_stdout:
        print(json.dumps(result))
        return 0
    from bench.lib import provenance
    others = args.other_triton
    if others is None:
        others = sorted(str(p) for p in (ROOT / ".runtime").glob("triton-*") if (p / "triton").is_dir())
    result["other_tritons"] = {}
    for path in others:
        try:
            res = other_triton(path, workers=args.workers)
            result["other_tritons"][res["info"]["triton"]] = res
        except Exception as e:  # noqa: BLE001 - recorded as what it is
            result["other_tritons"][path] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    result["provenance"] = dict(commit=provenance.commit(), dirty=provenance.dirty(),
                                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                command=[sys.executable, *sys.argv], spill_bound_bytes=SPILL_BOUND, gpu=None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, t in table.items():
        rows = [r for r in t["kernels"] if not r.get("error")]
        top = {f: max((r[f] for r in rows), default=0) for f in ("regs", "local_bytes", "shared")}
        print(f"{name}: {len(t['kernels'])} kernels, {len(t['kernels']) - len(rows)} failed; regs max {top['regs']}, "
              f"spills max {top['local_bytes']} B, shared max {top['shared']} / {t['smem_limit']}")
    for v, res in result["other_tritons"].items():
        print(f"Triton {v}: " + (res.get("error") or f"{len(res['problems'])} problems"))
    print("\n".join(result["problems"]) or "no problems")
    print(f"wrote {args.out}")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
