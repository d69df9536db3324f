"""Per-token activation quantization: one Triton program per row, bit-exact with
``quant.quantize.quantize_per_token_ref``.

``x [M, K]`` float (any strides) -> ``(int8 [M, K] contiguous, fp32 scale [M])``::

    x'       = float32(x) * inv_smooth          (when given; one fp32 multiply, as the reference)
    absmax   = max_k |x'|
    mult     = (1 / absmax) * 127               (1 for all-zero or non-finite rows)
    q        = clamp(rint(x' * mult), -127, 127) (rint: round half to even)
    scale    = absmax / 127          on CPU  (IEEE division)
             = absmax * fp32(1/127)  on CUDA

NOTE: those two lines are what the reference's torch ops compute, rounding for rounding. ``127.0 / t`` is
``t.reciprocal() * 127`` in torch (two roundings, on every device; it differs from one IEEE division for ~25 %
of inputs), and on CUDA ``t / 127.0`` is ``t * (1/127)`` (ATen's div_true_kernel_cuda turns a CPU-scalar divisor
into a reciprocal multiply) while the CPU divides. The divisions here are div_rn (IEEE), never the fast
``div.full`` that Triton's ``/`` gives. So the kernel is bit-exact with ``quantize_per_token_ref`` evaluated on
the same device; the CPU and CUDA references themselves differ by at most 1 ulp in ``scale`` (never in q).

All-zero rows give scale 0 and zeros; a row with NaN/Inf gives scale NaN and zeros (see quant/quantize.py).
Any K and strides. A unit-stride row up to ``QUANT_ONE_PASS.max_row`` is read once, in registers over up to three
power-of-2 segments (with more rows than ``QUANT_ROW_LOOP`` programs an SM, each program loops over rows and issues
the next row's loads before storing the current one); other rows up to MAX_BLOCK_K in one masked tile, longer ones
in two passes over BLOCK_K chunks (the second re-reads from L2). Importing this module imports triton.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import config
from .launch import launch

INTERPRET = config.get("TRITON_INTERPRET")  # taken at import, as Triton itself does
MAX_BLOCK_K = 8192


@dataclass(frozen=True)
class SegmentPlan:
    """A one-pass row kernel over up to three power-of-2 segments (``segments``): rows of ``min_row`` to
    ``max_row`` elements, segments of at least ``min_seg``, one warp per ``per_warp`` elements (``seg_warps``), 4 to
    ``warps`` warps a row."""
    max_row: int
    min_seg: int
    warps: int
    per_warp: int = 512
    min_row: int = 1


# Per-token quantization in one pass over up to three power-of-2 segments (K = 4608: 4096 + 512; 12288: 8192 +
# 4096), the row in registers without masked lanes; None, or a row with a column stride or wider than max_row:
# the BLOCK_K kernel (one masked power-of-2 tile up to MAX_BLOCK_K, else two passes over chunks). Module data, read
# at each call (the tests set it); part of ``kernel.ops.tunables()``. Measured on the H200
# (M 4608): the one-pass plan 10-30 % faster than the BLOCK_K kernel at K 4608 and 12288.
QUANT_ONE_PASS: SegmentPlan | None = SegmentPlan(max_row=16384, min_seg=256, warps=8, per_warp=1024)


# The one-pass quantizer as QUANT_ROW_LOOP programs an SM, each looping over rows with the next row's loads in
# flight (_quant_rows_loop_kernel), where M is larger than that; 0: a program a row. Measured on the H200
# (M 4608): 4 an SM 2-3 % faster than a program a row (2 slower, 8 spills). Codes identical.
# Module data, read at each call.
QUANT_ROW_LOOP = 4


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere: the interpreter's programs run one by one)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def interpreter_compat() -> None:
    """NOTE: Triton 3.6's interpreter turns a scalar kernel argument into a Python int with
    ``int(array([v]))``, which numpy >= 2.4 refuses ("only 0-dimensional arrays ..."), so any
    ``range(0, K, ...)`` loop fails on CPU. Re-patch that one hook to read the single element.
    Only under TRITON_INTERPRET=1; harmless with older numpy."""
    import triton.runtime.interpreter as interp
    orig = interp._patch_lang_tensor
    if getattr(orig, "_int8_fused_compat", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._int8_fused_compat = True
    interp._patch_lang_tensor = patched
    _reuse_launch_patch(interp)
    _np_dtype_once(interp)
    _tuple_type_when_read()


class _NoPatch:
    def restore(self) -> None:
        pass


def _reuse_launch_patch(interp) -> None:
    """The interpreter re-patches triton.language (``_patch_lang``: ``inspect.getmembers`` of four modules) at every
    call of a ``@triton.jit`` device function, in every program: over a third of a row kernel's interpreted time.
    What it patches depends only on the function's module (the language modules it imports), always with the same
    builder, and a device function's patch is never restored before the launch ends; so inside a launch, a function
    of a module already patched in that launch (the kernel's own, or an earlier device function's) skips it.
    Only under TRITON_INTERPRET=1 (the CPU tests and the CPU demo); the results are the same bits."""
    orig_patch, orig_call = interp._patch_lang, interp.GridExecutor.__call__
    if getattr(orig_patch, "_int8_fused_compat", False):
        return
    patched: list[set] = []  # per launch in progress: the modules whose functions' language patch is in force

    def patch_lang(fn):
        if patched and fn.__module__ in patched[-1]:
            return _NoPatch()
        scope = orig_patch(fn)
        if patched:
            patched[-1].add(fn.__module__)
        return scope

    def grid_call(self, *args, **kwargs):
        patched.append(set())
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            patched.pop()

    patch_lang._int8_fused_compat = True
    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = grid_call


def _np_dtype_once(interp) -> None:
    """The interpreter's ``_get_np_dtype`` builds its 18-entry table of numpy dtypes at every call (each operand
    of each operation of each program: a tenth of a model test's interpreted time). The same table, built once
    from the original function; the same lookups."""
    if getattr(interp._get_np_dtype, "_int8_fused_compat", False):
        return
    original = interp._get_np_dtype
    table = {}
    for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
              tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8,
              tl.float8e4b15):
        try:
            table[t] = original(t)
        except KeyError:  # a type this Triton's interpreter does not map: a lookup raises KeyError, as it did
            pass
    pointer, block = tl.pointer_type, tl.block_type
    u64 = original(pointer(tl.int8))

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, pointer):
            return u64
        if isinstance(tt_dtype, block):
            element = tt_dtype.element_ty
            return u64 if isinstance(element, pointer) else table[element]
        return table[tt_dtype]

    get_np_dtype._int8_fused_compat = True
    get_np_dtype.original = original
    interp._get_np_dtype = get_np_dtype


class _TupleTypeWhenRead:
    """``tl.tuple.type`` of a tuple built without one: ``_type_for_tuple_values(values)`` on first read, then kept
    (a data descriptor: an assigned type is kept as given)."""

    def __init__(self, type_for):
        self.type_for = type_for

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        d = obj.__dict__
        if "type" not in d:
            d["type"] = self.type_for(obj.values)
        return d["type"]

    def __set__(self, obj, value):
        obj.__dict__["type"] = value


def _tuple_type_when_read() -> None:
    """Every interpreted tensor wraps its shape in a ``tl.tuple``, whose type (a ``tuple_type`` that names each
    element's type in a string) Triton 3.6 builds at once and the interpreter almost never reads: a sixth of a
    model test's interpreted time. Built when first read instead, by the same function from the same values."""
    from triton.language import core
    if isinstance(core.tuple.__dict__.get("type"), _TupleTypeWhenRead):
        return
    original = core.tuple.__init__

    def tuple_init(self, args, type=None):
        if type is None:
            self.values = [i for i in args]   # the type: _TupleTypeWhenRead
        else:
            original(self, args, type)

    tuple_init.original = original
    core.tuple.type = _TupleTypeWhenRead(core._type_for_tuple_values)
    core.tuple.__init__ = tuple_init


if INTERPRET:
    interpreter_compat()


@triton.jit
def _code8(v, INTERPRET: tl.constexpr):
    """int8 code of ``v`` (already times the row's 127 / amax): round half to even of ``clamp(v, -127, 127)``,
    which equals clamping the rounded value (the bounds are integers). The clamp comes first so no FMA can
    contract the caller's multiply into the rounding. Interpreter: ``c + 1.5 * 2**23`` rounds c to an
    integer in IEEE fp32 (exact for |c| < 2**22) and leaves it in the low mantissa bits, read as int32 minus the
    constant's bits: two adds, no cvt.rni / cvt.s8 on the conversion unit. Else libdevice rint and a cvt. NaN
    (only in rows the caller zeroes) gives an arbitrary code."""
    c = tl.minimum(tl.maximum(v, -127.0), 127.0)
    if INTERPRET:
        return ((c + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000).to(tl.int8)
    else:
        return libdevice.rint(c).to(tl.int8)


@triton.jit
def rint(y, INTERPRET: tl.constexpr):
    # Round half to even. Compiled: libdevice rint (one cvt.rni). The interpreter has no libdevice, so it
    # adds and subtracts 1.5 * 2**23 in IEEE fp32 (exact for |y| < 2**22; |y| <= 127 here); no FMA can
    # contract it there because the interpreter runs each numpy op separately.
    if INTERPRET:
        return (y + 12582912.0) - 12582912.0
    else:
        return libdevice.rint(y)


@triton.jit
def _row_chunk(x_row, inv_ptr, ks, K, stride_xk, HAS_SMOOTH: tl.constexpr):
    mask = ks < K
    x = tl.load(x_row + ks * stride_xk, mask=mask, other=0.0).to(tl.float32)
    if HAS_SMOOTH:
        x = x * tl.load(inv_ptr + ks, mask=mask, other=1.0).to(tl.float32)
    return x, mask


@triton.jit
def quant_params(amax, bad, SCALE_RECIP: tl.constexpr):
    """Per-row (scale, multiplier, usable) from the row's |max| and non-finite flag, rounding for rounding as the
    reference: torch's ``127 / t`` is ``t.reciprocal() * 127``; CUDA's ``t / 127`` is ``t * fp32(1/127)`` (ATen's
    division by a CPU scalar), the CPU's an IEEE division."""
    usable = (amax > 0.0) & (~bad)
    if SCALE_RECIP:
        scale = amax * 0.007874015718698502
    else:
        scale = tl.math.div_rn(amax, 127.0)
    scale = tl.where(bad, float("nan"), scale)
    mult = tl.math.div_rn(1.0, tl.where(usable, amax, 1.0)) * 127.0
    return scale, mult, usable


@triton.jit
def amax_bad(y, amax, bad):
    """The running row |max| and non-finite flag of a one-pass segmented kernel, updated with segment ``y``."""
    ay = tl.abs(y)
    amax = tl.maximum(amax, tl.max(ay, axis=0))
    bad = tl.maximum(bad, tl.max(tl.where(ay < float("inf"), 0, 1), axis=0))  # NaN fails `< inf` as Inf does
    return amax, bad


@triton.jit
def store_q(q_ptrs, y, mult, usable, mask, INTERPRET: tl.constexpr):
    """The int8 codes of fp32 values ``y`` (times the row's multiplier; zeros for an unusable row), stored."""
    tl.store(q_ptrs, tl.where(usable, _code8(y * mult, INTERPRET), 0), mask=mask)


@triton.jit
def _store_seg(q_row, z, K, OFF: tl.constexpr, SEG: tl.constexpr, mult, usable, INTERPRET: tl.constexpr):
    """Quantize and store one segment (columns OFF .. OFF + SEG) of a one-pass row from its fp32 values ``z``."""
    ks = OFF + tl.arange(0, SEG)
    store_q(q_row + ks, z, mult, usable, ks < K, INTERPRET)


@triton.jit
def finish_segments(q_row, s_ptr, row, z0, z1, z2, K, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                     amax, bad, SCALE_RECIP: tl.constexpr, INTERPRET: tl.constexpr):
    """The end of a one-pass segmented row: the row's scale from its |max| and non-finite flag, stored at
    ``s_ptr + row``, and each used segment's fp32 values ``z0..z2`` quantized and stored (an unused segment's
    argument is any placeholder: S1 / S2 = 0 compile its branch away)."""
    scale, mult, usable = quant_params(amax, bad > 0, SCALE_RECIP)
    tl.store(s_ptr + row, scale)
    _store_seg(q_row, z0, K, 0, S0, mult, usable, INTERPRET)
    if S1 > 0:
        _store_seg(q_row, z1, K, S0, S1, mult, usable, INTERPRET)
    if S2 > 0:
        _store_seg(q_row, z2, K, S0 + S1, S2, mult, usable, INTERPRET)


@triton.jit
def finish_tile(q_ptrs, s_ptr, row, y, mask, amax, bad, SCALE_RECIP: tl.constexpr, INTERPRET: tl.constexpr):
    """The end of a row held in one tile ``y`` (fp32, masked lanes 0; of a row in more parts, its last): the row's
    |max| and non-finite flag (``amax`` / ``bad``: those of its other parts as ``amax_bad`` keeps them, ``0.0`` /
    ``0`` where it has none) updated with y's, the scale stored at ``s_ptr + row``, y's codes at ``q_ptrs``
    (``mask``). Returns (mult, usable) for the codes of the row's other parts."""
    amax, bad = amax_bad(y, amax, bad)
    scale, mult, usable = quant_params(amax, bad > 0, SCALE_RECIP)
    tl.store(s_ptr + row, scale)
    store_q(q_ptrs, y, mult, usable, mask, INTERPRET)
    return mult, usable


@triton.jit
def _q_seg(x_row, inv_ptr, K, OFF: tl.constexpr, SEG: tl.constexpr, amax, bad, HAS_SMOOTH: tl.constexpr):
    x, _ = _row_chunk(x_row, inv_ptr, OFF + tl.arange(0, SEG), K, 1, HAS_SMOOTH)
    amax, bad = amax_bad(x, amax, bad)
    return x, amax, bad


@triton.jit
def _quant_rows_seg_kernel(x_ptr, inv_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                           HAS_SMOOTH: tl.constexpr, SCALE_RECIP: tl.constexpr,
                           S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, INTERPRET: tl.constexpr):
    # _quant_rows_kernel for a unit-stride row split into up to three power-of-2 segments (K = 4608: 4096 + 512,
    # where the one-tile kernel masks 3584 of 8192 lanes; 12288: 8192 + 4096, which it reads twice): one read.
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    amax = tl.zeros([], dtype=tl.float32)
    bad = tl.zeros([], dtype=tl.int32)
    x0, amax, bad = _q_seg(x_row, inv_ptr, K, 0, S0, amax, bad, HAS_SMOOTH)
    x1, x2 = x0, x0  # placeholders for unused segments
    if S1 > 0:
        x1, amax, bad = _q_seg(x_row, inv_ptr, K, S0, S1, amax, bad, HAS_SMOOTH)
    if S2 > 0:
        x2, amax, bad = _q_seg(x_row, inv_ptr, K, S0 + S1, S2, amax, bad, HAS_SMOOTH)
    finish_segments(q_row, s_ptr, row, x0, x1, x2, K, S0, S1, S2, amax, bad, SCALE_RECIP, INTERPRET)


@triton.jit
def _seg_row(x_row, K, OFF: tl.constexpr, SEG: tl.constexpr, valid):
    # one segment of a row as stored (a row past the end, ``valid`` False, loads nothing)
    ks = OFF + tl.arange(0, SEG)
    return tl.load(x_row + ks, mask=(ks < K) & valid, other=0.0)


@triton.jit
def _seg_inv(inv_ptr, K, OFF: tl.constexpr, SEG: tl.constexpr, HAS_SMOOTH: tl.constexpr):
    ks = OFF + tl.arange(0, SEG)
    if HAS_SMOOTH:
        return tl.load(inv_ptr + ks, mask=ks < K, other=1.0).to(tl.float32)
    else:
        return tl.full([SEG], 1.0, tl.float32)


@triton.jit
def _seg_vals(x, inv, amax, bad, HAS_SMOOTH: tl.constexpr):
    y = x.to(tl.float32)
    if HAS_SMOOTH:
        y = y * inv
    amax, bad = amax_bad(y, amax, bad)
    return y, amax, bad


@triton.jit(do_not_specialize=["M"])
def _quant_rows_loop_kernel(x_ptr, inv_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm,
                            HAS_SMOOTH: tl.constexpr, SCALE_RECIP: tl.constexpr,
                            S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, INTERPRET: tl.constexpr):
    # _quant_rows_seg_kernel with a program looping over rows pid, pid + P, ... (P programs): the next row's
    # loads are issued before the current row is reduced and stored (one row always in flight), and the
    # smoothing vector is loaded once a program. Each row's arithmetic is the one-row kernel's: the same codes.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    inv0 = _seg_inv(inv_ptr, K, 0, S0, HAS_SMOOTH)
    inv1, inv2 = inv0, inv0  # placeholders for unused segments
    if S1 > 0:
        inv1 = _seg_inv(inv_ptr, K, S0, S1, HAS_SMOOTH)
    if S2 > 0:
        inv2 = _seg_inv(inv_ptr, K, S0 + S1, S2, HAS_SMOOTH)
    first = x_ptr + pid.to(tl.int64) * stride_xm
    n0 = _seg_row(first, K, 0, S0, pid < M)
    n1, n2 = n0, n0
    if S1 > 0:
        n1 = _seg_row(first, K, S0, S1, pid < M)
    if S2 > 0:
        n2 = _seg_row(first, K, S0 + S1, S2, pid < M)
    for row in range(pid, M, nprog):
        c0, c1, c2 = n0, n1, n2
        r64 = tl.zeros([], dtype=tl.int64) + row  # (the interpreter's loop index is a Python int)
        nxt = r64 + nprog
        x_next = x_ptr + nxt * stride_xm
        n0 = _seg_row(x_next, K, 0, S0, nxt < M)
        if S1 > 0:
            n1 = _seg_row(x_next, K, S0, S1, nxt < M)
        if S2 > 0:
            n2 = _seg_row(x_next, K, S0 + S1, S2, nxt < M)
        amax = tl.zeros([], dtype=tl.float32)
        bad = tl.zeros([], dtype=tl.int32)
        y0, amax, bad = _seg_vals(c0, inv0, amax, bad, HAS_SMOOTH)
        y1, y2 = y0, y0
        if S1 > 0:
            y1, amax, bad = _seg_vals(c1, inv1, amax, bad, HAS_SMOOTH)
        if S2 > 0:
            y2, amax, bad = _seg_vals(c2, inv2, amax, bad, HAS_SMOOTH)
        finish_segments(q_ptr + r64 * stride_qm, s_ptr, r64, y0, y1, y2, K, S0, S1, S2, amax, bad,
                         SCALE_RECIP, INTERPRET)


@triton.jit(do_not_specialize=["M"])
def _quant_rows_kernel(x_ptr, inv_ptr, q_ptr, s_ptr,
                       M, K,
                       stride_xm, stride_xk, stride_qm,
                       HAS_SMOOTH: tl.constexpr, SCALE_RECIP: tl.constexpr, BLOCK_K: tl.constexpr,
                       ONE_CHUNK: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    cols = tl.arange(0, BLOCK_K)

    if ONE_CHUNK:  # the whole row stays in registers: one read of x
        x, mask = _row_chunk(x_row, inv_ptr, cols, K, stride_xk, HAS_SMOOTH)
        finish_tile(q_row + cols, s_ptr, row, x, mask, 0.0, 0, SCALE_RECIP, INTERPRET)
    else:
        # pass 1: absmax and a non-finite flag (NaN fails `< inf` as well as Inf does)
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        bad = tl.zeros([BLOCK_K], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            xc, _ = _row_chunk(x_row, inv_ptr, k0 + cols, K, stride_xk, HAS_SMOOTH)
            ax = tl.abs(xc)
            bad = tl.maximum(bad, tl.where(ax < float("inf"), 0, 1))
            amax = tl.maximum(amax, ax)
        scale, mult, usable = quant_params(tl.max(amax, axis=0), tl.max(bad, axis=0) > 0, SCALE_RECIP)
        tl.store(s_ptr + row, scale)
        # pass 2: quantize, re-reading x (mostly from L2)
        for k0 in range(0, K, BLOCK_K):
            xc, mc = _row_chunk(x_row, inv_ptr, k0 + cols, K, stride_xk, HAS_SMOOTH)
            store_q(q_row + k0 + cols, xc, mult, usable, mc, INTERPRET)


@functools.lru_cache(maxsize=None)  # per call it is a dict lookup (triton.next_power_of_2 costs ~2 us)
def _block_k(k: int) -> tuple[int, int, bool]:
    """(BLOCK_K, num_warps, one_chunk): rows up to 8192 in one chunk held in registers (16 elements a
    thread at most); longer rows in 4096-wide chunks, read twice (the second read mostly hits L2)."""
    if k <= MAX_BLOCK_K:
        bk = triton.next_power_of_2(max(k, 16))
        return bk, (1 if bk <= 256 else 2 if bk <= 1024 else 4 if bk <= 2048 else 8 if bk <= 4096 else 16), True
    return 4096, 8, False


@functools.lru_cache(maxsize=256)  # per call a dict lookup (the plans are frozen, hashable)
def segments(n: int, plan: SegmentPlan | None) -> tuple[int, int, int] | None:
    """Up to three power-of-2 widths, largest first (0 = unused), that cover a row of n elements with at most
    ``plan.min_seg`` - 1 masked lanes beyond the last full power of 2 (12288 -> 8192 + 4096; 13824 -> 8192 +
    4096 + 2048); None when there is no plan or n is outside ``plan.min_row`` .. ``plan.max_row`` (the other
    kernel runs)."""
    if plan is None or not max(plan.min_row, 1) <= n <= plan.max_row:
        return None
    segs, rem = [], n
    while rem > 0 and len(segs) < 2:
        s = 1 << (rem.bit_length() - 1)
        if s < plan.min_seg:
            break
        segs.append(s)
        rem -= s
    if rem > 0:
        segs.append(max(triton.next_power_of_2(rem), plan.min_seg))
    return tuple(segs + [0] * (3 - len(segs)))


def seg_warps(segs: tuple, plan: SegmentPlan) -> int:
    """Warps for a segmented row: one per ``plan.per_warp`` elements rounded down to a power of 2, 4 to
    ``plan.warps``."""
    return max(4, min(plan.warps, 1 << max(0, (sum(segs) // plan.per_warp).bit_length() - 1)))


def launch_quantize_per_token(x: torch.Tensor, inv_smooth: torch.Tensor | None,
                              q: torch.Tensor, scale: torch.Tensor) -> None:
    """Fills ``q`` (int8 [M, K], unit column stride) and ``scale`` (fp32 [M]); inputs already validated."""
    m, k = x.shape
    if m == 0:
        return
    if k == 0:
        scale.zero_()
        return
    inv = inv_smooth if inv_smooth is not None else scale  # dummy pointer when HAS_SMOOTH is False
    segs = segments(k, QUANT_ONE_PASS) if x.stride(1) == 1 else None
    if segs is not None:
        consts = dict(HAS_SMOOTH=inv_smooth is not None, SCALE_RECIP=x.is_cuda, S0=segs[0], S1=segs[1], S2=segs[2],
                      INTERPRET=INTERPRET)
        progs = QUANT_ROW_LOOP * sm_count(x.device)  # 0: a program a row
        if 0 < progs < m:
            launch(_quant_rows_loop_kernel, (progs,), (x, inv, q, scale, m, k, x.stride(0), q.stride(0)), consts,
                   seg_warps(segs, QUANT_ONE_PASS), 1, x.device)
        else:
            launch(_quant_rows_seg_kernel, (m,), (x, inv, q, scale, k, x.stride(0), q.stride(0)), consts,
                   seg_warps(segs, QUANT_ONE_PASS), 1, x.device)
        return
    bk, warps, one = _block_k(k)
    launch(_quant_rows_kernel, (m,), (x, inv, q, scale, m, k, x.stride(0), x.stride(1), q.stride(0)),
           dict(HAS_SMOOTH=inv_smooth is not None, SCALE_RECIP=x.is_cuda, BLOCK_K=bk, ONE_CHUNK=one,
                INTERPRET=INTERPRET), warps, 3, x.device)
