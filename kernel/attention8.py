"""8-bit attention in Triton (SageAttention-style): INT8 Q·Kᵀ, fp32 online softmax, bf16/fp16 P·V.

``attention_int8(q, k, v, scale=None)`` computes ``softmax(q kᵀ · scale) v`` for q [B, H, Lq, D], k/v [B, Hkv, Lk, D]
(the layout of torch SDPA; any strides with a contiguous last dim), bf16 or fp16, D in {64, 128, 256}, any Lq and
Lk ≥ 1, H a multiple of Hkv (grouped-query attention). Non-causal, no mask. The output has q's dtype and layout
(``empty_like(q)``: a [B, L, H, D] buffer viewed as [B, H, L, D] stays so, so ComfyUI's reshape to [B, L, H·D] is
free).

Numerics (the tests derive their error bound from exactly these steps):

* K smoothing: ``k' = k - mean_L(k)`` per (batch, kv head) in fp32 (torch ``mean``). Every key of a head is
  shifted by the same vector, so each query's scores move by one constant and softmax is unchanged; the
  quantization range then covers the spread of the keys instead of their common offset.
* Q: ``q' = q · scale · log2(e)`` in fp32, so the softmax runs on exp2. Per block of BLOCK_M query rows of a head
  one scale ``Δq = max|q'| / 127``; ``q̂ = rint(q' / Δq)`` in int8 (round half to even). Same for K' per block
  of BLOCK_N key rows: ``Δk``. By default Q is quantized inside the attention kernel (its block is loaded once
  per program anyway); ``q_prequant=True`` runs the pre-pass kernel for Q too (same numbers).
* Scores ``s = Δq Δk · (q̂ · k̂)`` with an exact int32 dot product (int8 ``tl.dot``). int32 -> fp32 without a
  convert instruction: |q̂·k̂| ≤ 256·127² < 2²², so the bits of ``int + 0x4B400000`` are the float
  ``1.5·2²³ + int`` exactly; the offset is folded into the exp2 argument (one FMA per score).
* Online softmax in fp32 (running max and sum per row); P = exp2(s - m) rounded to V's dtype, P·V with fp32
  accumulation (tensor cores), divided by the fp32 row sum at the end, stored in q's dtype.
* ``rescale_tau`` > 0 (FA4's lazy rescaling): the running max is only moved when some row's block max exceeds it
  by more than tau (log2 units), so P ≤ 2^tau; exact in real arithmetic, fewer multiplies of the accumulator.
* Non-finite input: a block with NaN/Inf gets a NaN scale, so NaN/Inf in Q makes that BLOCK_M-row block of the
  output NaN, and NaN/Inf anywhere in a head's K (through its mean) or V makes that head's output NaN (V: the
  columns it reaches). Never a silent finite result.

Tile configs: ``configs(D, limit)`` lists the candidates (BLOCK_M 64/128, BLOCK_N 64/128 or, where none of 64
fits, 32, 4/8 warps, 2/3 stages) that fit the device's shared memory (``device_smem_limit``: 227 KB on sm_90, 99 KB
on sm_86 / 89 / 120) and 128 fp32 accumulator registers a thread. On CUDA the first call of a shape
(B·H, Hkv, Lq, Lk, D, dtype, device) times each candidate (pre-pass included, CUDA events) and keeps the fastest
in memory (``tuned``); ``config=`` forces one, ``tune=False`` takes ``default_config(D, limit)``. Quantization blocks
follow the tile (BLOCK_M query rows, BLOCK_N key rows), so the numbers depend on the config within the bound.

Importing this module imports triton.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import config
from .autotune import smem_optin
from .checks import check_usable
from .quantize import interpreter_compat, rint

INTERPRET = config.get("TRITON_INTERPRET")  # taken at import, as Triton itself does
if INTERPRET:
    interpreter_compat()

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)
SMEM_LIMIT = 227 * 1024   # sm_90 opt-in shared memory per block
MAGIC_I = 0x4B400000      # bits of 1.5 * 2**23
MAGIC_F = 12582912.0      # 1.5 * 2**23
MAX_GRID_Y = 65535


# ------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _quant_tile(x, INTERPRET: tl.constexpr):
    """fp32 tile -> (int8 tile, fp32 scale): scale = max|x| / 127 (NaN when x holds NaN/Inf), q = rint(x / scale)
    (zeros for an all-zero or non-finite tile)."""
    ax = tl.abs(x)
    bad = tl.max(tl.max(tl.where(ax < float("inf"), 0, 1), 1), 0) > 0  # NaN fails `< inf` as Inf does
    amax = tl.max(tl.max(ax, 1), 0)
    usable = (amax > 0.0) & (~bad)
    scale = tl.where(bad, float("nan"), amax / 127.0)
    mult = tl.where(usable, 127.0 / tl.where(usable, amax, 1.0), 0.0)
    q = tl.minimum(tl.maximum(rint(tl.where(usable, x, 0.0) * mult, INTERPRET), -127.0), 127.0)
    return q.to(tl.int8), scale


@triton.jit(do_not_specialize=["L", "n_blocks"])
def _quant_blocks_kernel(X, MEAN, XQ, XS, L, HX, mult, n_blocks,
                         stride_xb, stride_xh, stride_xl,
                         HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_MEAN: tl.constexpr,
                         INTERPRET: tl.constexpr):
    """One program per (block of BLOCK rows, batch·head): XQ[bh, rows, :] = int8 of (X - MEAN) * mult, XS[bh, blk]
    its scale. XQ holds n_blocks * BLOCK rows per head; rows past L are zeros."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HX
    h = bh % HX
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)
    valid = rows < L
    base = X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh
    x = tl.load(base + rows[:, None].to(tl.int64) * stride_xl + d[None, :], mask=valid[:, None], other=0.0)
    x = x.to(tl.float32)
    if HAS_MEAN:
        mu = tl.load(MEAN + bh.to(tl.int64) * HEAD_DIM + d)
        x = tl.where(valid[:, None], x - mu[None, :], 0.0)
    q, scale = _quant_tile(x * mult, INTERPRET)
    out = XQ + (bh.to(tl.int64) * n_blocks * BLOCK + rows[:, None]) * HEAD_DIM + d[None, :]
    tl.store(out, q)
    tl.store(XS + bh.to(tl.int64) * n_blocks + blk, scale)


@triton.jit
def _round_like(p, v):
    """Interpreter only: fp32 P rounded to V's 16-bit type (nearest even, as the GPU's cvt.rn), kept in fp32.
    NOTE: Triton 3.6's interpreter truncates fp32 -> bf16 and multiplies bf16 dot operands as raw bits, so
    P·V runs there as an fp32 dot of the rounded values (the same products, fp32 accumulation)."""
    if v.dtype == tl.bfloat16:
        bits = p.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return p.to(tl.float16).to(tl.float32)


@triton.jit
def _attn_block(acc, l_i, m_i, q, qs, kq_ptr, ks_ptr, v_ptr, stride_vl, j, Lk,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, RESCALE_TAU: tl.constexpr,
                INTERPRET: tl.constexpr):
    """One key block j: int8 scores, online softmax update, P·V."""
    n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(kq_ptr + n[:, None] * HEAD_DIM + d[None, :])  # int8 [BLOCK_N, D], D-contiguous (K-major)
    s = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
    c = qs * tl.load(ks_ptr + j)
    c = tl.where(c < 1e-30, 1e-30, c)  # an all-zero block: scores 0, not 0 * -inf; NaN stays NaN
    bits = (s + 1262485504).to(tl.float32, bitcast=True)  # = 1.5 * 2**23 + s exactly (|s| < 2**22)
    if MASK:
        bits = tl.where((n < Lk)[None, :], bits, float("-inf"))
    m_blk = tl.max(bits, 1) * c - 12582912.0 * c
    if RESCALE_TAU > 0:
        m_new = tl.maximum(m_i, m_blk)
        if tl.max(m_new - m_i, 0) > RESCALE_TAU:
            alpha = tl.math.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        p = tl.math.exp2(bits * c - (12582912.0 * c + m_i)[:, None])
        l_i = l_i + tl.sum(p, 1)
        m_out = m_i
    else:
        m_new = tl.maximum(m_i, m_blk)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(bits * c - (12582912.0 * c + m_new)[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_out = m_new
    if MASK:
        v = tl.load(v_ptr + n[:, None].to(tl.int64) * stride_vl + d[None, :], mask=(n < Lk)[:, None], other=0.0)
    else:
        v = tl.load(v_ptr + n[:, None].to(tl.int64) * stride_vl + d[None, :])
    if INTERPRET:
        acc = tl.dot(_round_like(p, v), v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_out


@triton.jit(do_not_specialize=["Lq", "Lk", "n_qblocks", "n_kblocks"])
def _attn_int8_kernel(Q, QQ, QS, KQ, KS, V, O,
                      Lq, Lk, H, GROUP, qmult, n_qblocks, n_kblocks,
                      stride_qb, stride_qh, stride_ql,
                      stride_vb, stride_vh, stride_vl,
                      stride_ob, stride_oh, stride_ol,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      Q_PREQUANT: tl.constexpr, RESCALE_TAU: tl.constexpr, INTERPRET: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hkv = h // GROUP
    bhk = b * (H // GROUP) + hkv
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    if Q_PREQUANT:
        q = tl.load(QQ + (bh.to(tl.int64) * n_qblocks * BLOCK_M + rows[:, None]) * HEAD_DIM + d[None, :])
        qs = tl.load(QS + bh.to(tl.int64) * n_qblocks + pid_m)
    else:
        q_ptr = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        x = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_ql + d[None, :], mask=(rows < Lq)[:, None],
                    other=0.0)
        q, qs = _quant_tile(x.to(tl.float32) * qmult, INTERPRET)
    kq_ptr = KQ + bhk.to(tl.int64) * n_kblocks * BLOCK_N * HEAD_DIM
    ks_ptr = KS + bhk.to(tl.int64) * n_kblocks
    v_ptr = V + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    n_full = Lk // BLOCK_N
    for j in range(0, n_full):
        acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, qs, kq_ptr, ks_ptr, v_ptr, stride_vl, j, Lk,
                                    HEAD_DIM, BLOCK_N, False, RESCALE_TAU, INTERPRET)
    if n_full * BLOCK_N < Lk:  # the ragged last key block
        acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, qs, kq_ptr, ks_ptr, v_ptr, stride_vl, n_full, Lk,
                                    HEAD_DIM, BLOCK_N, True, RESCALE_TAU, INTERPRET)
    out = acc / l_i[:, None]
    o_ptr = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_ptr + rows[:, None].to(tl.int64) * stride_ol + d[None, :], out.to(O.dtype.element_ty),
             mask=(rows < Lq)[:, None])


# ------------------------------------------------------------------------------------------------ configs
def _cfg(bm, bn, warps, stages, tau=8.0):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "RESCALE_TAU": tau}


def smem_bytes(cfg: dict, head_dim: int) -> int:
    """Shared memory estimate: the int8 Q tile plus num_stages buffers of an int8 K tile and a 16-bit V tile."""
    return cfg["BLOCK_M"] * head_dim + cfg["num_stages"] * cfg["BLOCK_N"] * head_dim * 3


def configs(head_dim: int, smem_limit: int = SMEM_LIMIT) -> list[dict]:
    """Candidate tiles for ``head_dim``: BLOCK_M 64/128 x BLOCK_N 64/128 x 4/8 warps x 2/3 stages, lazy rescaling
    (tau 8), kept when the estimate fits ``smem_limit`` and the fp32 accumulator needs ≤ 128 registers a thread.
    Where no BLOCK_N 64 tile fits (D 256 in the 99 KB of sm_86 / 89 / 120) the BLOCK_N 32 tiles instead."""
    def grid(widths):
        tiles = (_cfg(bm, bn, w, s) for bm in (128, 64) for bn in widths for w in (8, 4) for s in (2, 3))
        return [c for c in tiles if smem_bytes(c, head_dim) <= smem_limit
                and c["BLOCK_M"] * head_dim // (32 * c["num_warps"]) <= 128]
    out = grid((64, 128))
    return out if any(c["BLOCK_N"] == 64 for c in out) else out + grid((32,))


# untuned tile by preference, the first that fits the limit: sm_90 (and A100 below D 256) take the first
DEFAULT_TILES = {
    128: (_cfg(128, 128, 8, 3), _cfg(128, 64, 8, 3), _cfg(128, 64, 8, 2), _cfg(64, 64, 4, 2), _cfg(64, 32, 4, 2)),
    256: (_cfg(128, 64, 8, 3), _cfg(128, 64, 8, 2), _cfg(128, 32, 8, 2), _cfg(64, 32, 4, 2), _cfg(64, 32, 4, 1)),
}


def default_config(head_dim: int, smem_limit: int = SMEM_LIMIT, interpret: bool = INTERPRET) -> dict:
    """The tile ``attention_int8`` runs untuned: the first of ``DEFAULT_TILES`` whose ``smem_bytes`` fits
    ``smem_limit`` (the device's, ``device_smem_limit``), else the smallest; a small one in the interpreter."""
    if interpret:
        return _cfg(64, 64, 4, 1)
    tiles = DEFAULT_TILES[128 if head_dim <= 128 else 256]
    return dict(next((c for c in tiles if smem_bytes(c, head_dim) <= smem_limit), tiles[-1]))


def device_smem_limit(device) -> int:
    """Opt-in shared memory a block on ``device``: the lower of ``autotune.SMEM_OPTIN``'s figure for its
    capability and the device's report, as the GEMM's candidates use (``SMEM_LIMIT`` off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return SMEM_LIMIT
    props = torch.cuda.get_device_properties(device)
    return smem_optin((props.major, props.minor), props.shared_memory_per_block_optin)


tuned: dict[tuple, dict] = {}   # shape key -> config chosen by timing (CUDA)
tune_log: dict[tuple, dict] = {}  # shape key -> {config text: ms or error}


def config_text(cfg: dict) -> str:
    return (f"M{cfg['BLOCK_M']}_N{cfg['BLOCK_N']}_w{cfg['num_warps']}_s{cfg['num_stages']}"
            f"_tau{cfg.get('RESCALE_TAU', 0):g}")


# ------------------------------------------------------------------------------------------------ launcher
def check_inputs(q, k, v, scale=None) -> None:
    """ValueError naming what is wrong with an input this kernel does not take."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim] (SDPA layout), got shape "
                             f"{tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; attention_int8 takes bfloat16 or float16")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    bq, h, lq, d = q.shape
    bk, hk, lk, dk = k.shape
    if bq != bk:
        raise ValueError(f"batch of q ({bq}) and k/v ({bk}) differ")
    if d != dk:
        raise ValueError(f"head_dim of q ({d}) and k/v ({dk}) differ")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim {d} is not supported; attention_int8 takes {HEAD_DIMS}")
    if hk == 0 or h % hk:
        raise ValueError(f"q heads ({h}) must be a multiple of k/v heads ({hk})")
    if bq == 0 or h == 0 or lq == 0 or lk == 0:
        raise ValueError(f"empty attention: q {tuple(q.shape)}, k {tuple(k.shape)} (every size must be >= 1)")
    if scale is not None and not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")


def _shape_key(q, k):
    return (q.shape[0] * q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype, q.device)


def _launch(q, k, v, out, scale, cfg, smooth_k, q_prequant):
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    warps, stages = cfg["num_warps"], cfg["num_stages"]
    tau = float(cfg.get("RESCALE_TAU", 0.0))
    nqb, nkb = triton.cdiv(lq, bm), triton.cdiv(lk, bn)
    qmult = float(scale) * LOG2E
    mean = k.mean(dim=2, dtype=torch.float32).contiguous() if smooth_k else None
    kq = torch.empty(b * hk, nkb * bn, d, dtype=torch.int8, device=q.device)
    ks = torch.empty(b * hk, nkb, dtype=torch.float32, device=q.device)
    _quant_blocks_kernel[(nkb, b * hk)](
        k, mean if mean is not None else ks, kq, ks, lk, hk, 1.0, nkb,
        k.stride(0), k.stride(1), k.stride(2),
        HEAD_DIM=d, BLOCK=bn, HAS_MEAN=mean is not None, INTERPRET=INTERPRET, num_warps=4)
    if q_prequant:
        qq = torch.empty(b * h, nqb * bm, d, dtype=torch.int8, device=q.device)
        qs = torch.empty(b * h, nqb, dtype=torch.float32, device=q.device)
        _quant_blocks_kernel[(nqb, b * h)](
            q, qs, qq, qs, lq, h, qmult, nqb, q.stride(0), q.stride(1), q.stride(2),
            HEAD_DIM=d, BLOCK=bm, HAS_MEAN=False, INTERPRET=INTERPRET, num_warps=4)
    else:
        qq, qs = kq, ks  # unused
    _attn_int8_kernel[(nqb, b * h)](
        q, qq, qs, kq, ks, v, out,
        lq, lk, h, h // hk, qmult, nqb, nkb,
        q.stride(0), q.stride(1), q.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, Q_PREQUANT=bool(q_prequant), RESCALE_TAU=tau, INTERPRET=INTERPRET,
        num_warps=warps, num_stages=stages)
    return out


def _time_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def autotune(q, k, v, scale=None, candidates=None, smooth_k=True, q_prequant=False, reps: int = 5) -> dict:
    """Time every candidate config (pre-pass included) on these inputs; keep and return the fastest. A config that
    fails to compile or run (e.g. out of shared memory) is skipped and noted in ``tune_log``."""
    check_inputs(q, k, v, scale)
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    key = _shape_key(q, k)
    out = _alloc_out(q)
    results, best, best_ms = {}, None, math.inf
    for cfg in candidates or configs(d, device_smem_limit(q.device)):
        try:
            ms = _time_ms(lambda: _launch(q, k, v, out, scale, cfg, smooth_k, q_prequant), reps)
        except Exception as e:  # noqa: BLE001 - OutOfResources, a compiler error: not a candidate
            results[config_text(cfg)] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            continue
        results[config_text(cfg)] = ms
        if ms < best_ms:
            best, best_ms = cfg, ms
    tune_log[key] = results
    if best is None:
        raise RuntimeError(f"attention_int8: no config ran for {key}: {results}")
    tuned[key] = best
    return best


def _alloc_out(q):
    out = torch.empty_like(q)  # keeps q's layout when dense
    return out if out.stride(-1) == 1 else torch.empty(q.shape, dtype=q.dtype, device=q.device)


def attention_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                   config: dict | None = None, tune: bool = True, smooth_k: bool = True,
                   q_prequant: bool = False) -> torch.Tensor:
    """softmax(q kᵀ · scale) v with INT8 Q·Kᵀ (module doc). q [B, H, Lq, D], k/v [B, Hkv, Lk, D], bf16/fp16,
    D in {64, 128, 256}; scale defaults to D**-0.5. ``config``: a tile (``configs``), else the tuned one (CUDA,
    timed on the first call of a shape unless ``tune=False``), else ``default_config``. ``smooth_k=False`` skips
    the K mean subtraction (tests). ValueError for inputs it does not take, RuntimeError where Triton cannot run."""
    check_inputs(q, k, v, scale)
    check_usable(q, "attention_int8")
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else float(scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if config is None:
        key = _shape_key(q, k)
        config = tuned.get(key)
        if config is None:
            if tune and q.device.type == "cuda" and not INTERPRET and not torch.compiler.is_compiling():
                config = autotune(q, k, v, scale, smooth_k=smooth_k, q_prequant=q_prequant)
            else:
                config = default_config(d, device_smem_limit(q.device))
    out = _alloc_out(q)
    b, h = q.shape[:2]
    step = max(1, MAX_GRID_Y // h)  # grid axis 1 is batch·heads (at most 65535)
    if b <= step:
        return _launch(q, k, v, out, scale, config, smooth_k, q_prequant)
    for s in range(0, b, step):
        _launch(q[s:s + step], k[s:s + step], v[s:s + step], out[s:s + step], scale, config, smooth_k, q_prequant)
    return out
