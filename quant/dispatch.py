"""Per-shape dispatch of ``fused_triton`` layers (a backend whose record declares ``per_shape_dispatch``,
``quant.backends``): the INT8 kernel where it beats the float path, else float.

Small or ragged linears (M 77 x 4608 x 4608, 1000 x 3000 x 1000, adaLN GEMVs) can run slower as W8A8 than as a
plain bf16 ``F.linear``: per-call host work (two Triton launches, quantization) and tiles that leave SMs idle
weigh more than the GEMM itself. So an ``Int8Linear`` on ``fused_triton`` picks, per call shape, one of

* ``int8``  the pack's W8A8 path (per-token quantization kernel + fused-epilogue INT8 GEMM);
* ``float`` ``F.linear(x, W', b)`` with ``W' = dequantize(W_q) / smooth`` in the activation dtype, made once per
  layer on its first float call and kept in the layer's derived state (``Int8Linear.derived``; dropped
  when ComfyUI moves or swaps the weight). Memory: N * K * 2 bytes (bf16/fp16; 4 in fp32) on top of the int8
  weight, only for layers that ever run a float call; it is not counted by ComfyUI's memory manager. Numerics:
  weight-only int8 (the activation is not quantized), so at least as accurate as W8A8.

``INT8_FUSED_DISPATCH`` (``kernel.config``): ``auto`` (default), ``int8`` or ``float`` (forced, for A/B runs and
tests). Under ``auto`` on a CUDA device the decision is made per (GPU, M bucket, N, K, bias, dtype): the first
call of that shape times both paths on the call's own operands (:func:`time_pair`: per call the larger of its GPU
time with a cold L2 (the GPU held busy while the host issues the call, so host time does not leak into it) and the
host time to issue it; medians of ``ROUNDS`` interleaved rounds of ``REPS`` calls;
a few ms, once per shape), keeps the result in memory and in ``dispatch-v3-<gpu>-torch-<v>-triton-<v>.json``
next to the GEMM autotune cache (``kernel.autotune.cache_dir``, atomic writes), so later processes time nothing;
a shape the file lacks takes the decision of the pack's shipped table for this GPU (``kernel/tuned``) untimed.
The rule is :func:`decide`: int8 is the incumbent and the float path must be faster by ``MARGIN`` to take the
shape (timing noise does not flip decisions, and int8 keeps its memory saving on a tie); where the two costs tie
within the margin (host-bound calls, whose cost is the host time both paths share) the GPU times decide the same
way, since a model whose GPU paces the step pays only those (a host-bound tie once sent Wan's time projection to
int8 at 0.81x bf16's GPU time). On the CPU, under ``torch.compile`` tracing or CUDA-graph capture nothing is timed and
``auto`` runs int8.

Each layer counts its calls per path (``Int8Linear.dispatch_calls``); :func:`report_line` summarises a model. A
resident layer keeps, per call shape, the path it ran (with the float weight and bias of the float path,
:func:`float_operands`), and ``Int8Linear.forward`` runs that shape's later calls on it directly — one bare
``F.linear``, or the int8 path's prepared launches (``kernel.plan``) — while the int8 weight is the same tensor and
:func:`hot_token` (the mode, the decisions' generation) is unchanged: a small linear's speed is its host time.
Only ``Int8Linear.forward`` dispatches: the fused blocks (``adapters/<model>/blocks.py``) always run their INT8 kernels.
"""
from __future__ import annotations

import collections
import logging
import math
import re
import threading
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..kernel import autotune, config, deferred, jsoncache, launch, retune
from . import backends

log = logging.getLogger("int8_fused")

INT8, FLOAT = "int8", "float"
MODES = ("auto", INT8, FLOAT)
MARGIN = 0.03   # the float path must be 3 % faster than int8 to take a shape
ROUNDS, REPS = 3, 7
_DEQUANT_ROWS = 4096  # rows dequantized at a time when building the float weight (bounds the fp32 temporary)


# --------------------------------------------------------------------------- the decision (pure)
def mode() -> str:
    """``INT8_FUSED_DISPATCH``: one of MODES (``kernel/config.py`` warns about an unknown value and gives ``auto``)."""
    return config.get("INT8_FUSED_DISPATCH")


def _ms(t) -> float:
    try:
        t = float(t)
    except (TypeError, ValueError):
        return math.inf
    return t if math.isfinite(t) and t >= 0 else math.inf


def decide(int8_ms: float, float_ms: float, incumbent: str = INT8, margin: float = MARGIN,
           int8_gpu_ms: float | None = None, float_gpu_ms: float | None = None) -> str:
    """The path for a shape from its two costs (ms, ``effective_ms``). The ``incumbent`` (int8 on a first decision;
    the earlier decision when a shape is timed again) keeps the shape unless the other path is faster by ``margin``
    (``t_other * (1 + margin) < t_incumbent``): noise never flips it. Where neither cost beats the other by the
    margin, the GPU times (when given) decide by the same rule. A failed or non-finite timing counts as infinitely
    slow; both failed: the incumbent."""
    if incumbent not in (INT8, FLOAT):
        raise ValueError(f"incumbent must be {INT8!r} or {FLOAT!r}, got {incumbent!r}")
    other = FLOAT if incumbent == INT8 else INT8
    t = {INT8: _ms(int8_ms), FLOAT: _ms(float_ms)}
    g = {INT8: _ms(int8_gpu_ms), FLOAT: _ms(float_gpu_ms)}
    if t[other] == math.inf:
        return incumbent
    if t[other] * (1.0 + margin) < t[incumbent]:
        return other
    if t[incumbent] * (1.0 + margin) < t[other]:
        return incumbent
    return other if g[other] * (1.0 + margin) < g[incumbent] else incumbent


def m_bucket(m: int) -> int:
    """Rows rounded up to a power of two (the GEMM autotuner's buckets: one decision per bucket)."""
    return autotune.m_bucket(max(int(m), 1))


def shape_key(m: int, n: int, k: int, has_bias: bool, dtype: torch.dtype) -> str:
    return f"M{m_bucket(m)}_N{n}_K{k}_{'bias' if has_bias else 'nobias'}_{str(dtype).replace('torch.', '')}"


# --------------------------------------------------------------------------- the cache file
DECISIONS_VERSION = "v3"  # v2: GPU times without the host's share (``time_call``); v3: ties go by GPU time.
# Older files are not read.


def cache_path(gpu_name: str, torch_version: str, triton_version: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9.]+", "-",
                  f"{gpu_name}-torch-{torch_version}-triton-{triton_version}").strip("-")
    return autotune.cache_dir() / f"dispatch-{DECISIONS_VERSION}-{slug}.json"


def _valid_decision(key: str, entry) -> bool:
    return isinstance(entry, dict) and entry.get("path") in (INT8, FLOAT)


class DecisionCache(jsoncache.JsonCache):
    """Decisions of one GPU + software versions: {shape_key: {"path", "int8_ms", "float_ms", "m", ...}} in memory,
    mirrored to a JSON file by the autotune cache's file handling (``kernel.jsoncache``): writes merge with the
    file under a lock (another process may have added shapes) and replace it atomically; a damaged file is set
    aside with one warning (its valid decisions kept, the rest timed again). ``gpu``: the GPU's name, whose shipped
    table (``kernel.tuned``, its ``dispatch`` section, of this ``DECISIONS_VERSION``) seeds the shapes the file
    lacks."""

    def __init__(self, path, gpu: str | None = None):
        from ..kernel import tuned
        seed = tuned.Seed(gpu, "dispatch", require={"decisions": DECISIONS_VERSION}) if gpu else None
        super().__init__(path, "decisions", what="decision cache", who="INT8 dispatch", valid=_valid_decision,
                         seed=seed)


_CACHES: dict = {}      # device index -> DecisionCache
_DECISIONS: dict = {}   # (device, M bucket, N, K, has_bias, dtype) -> path, for this process
_LOCK = threading.Lock()


def _device_cache(device: torch.device) -> DecisionCache:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    c = _CACHES.get(idx)
    if c is None:
        import triton
        name = torch.cuda.get_device_name(idx)
        c = _CACHES[idx] = DecisionCache(cache_path(name, torch.__version__, triton.__version__), gpu=name)
    return c


_GENERATION = [0]  # bumped by forget(): layers' hot float-path entries from before are stale


def forget() -> None:
    """Drop the in-process decisions and open caches (tests; a changed INT8_FUSED_CACHE_DIR)."""
    _CACHES.clear()
    _DECISIONS.clear()
    _GENERATION[0] += 1


def hot_token() -> tuple:
    """What a layer's hot float-path entry must still match to be used: the mode and the decisions' generation."""
    return mode(), _GENERATION[0]



# --------------------------------------------------------------------------- without timing
def predicted(m: int, n: int, k: int, capability: tuple[int, int]) -> str:
    """The path of a shape not yet timed (``INT8_FUSED_TUNE`` other than ``first_call``): ``int8`` for GEMV rows
    (M <= 16: the one-launch small-M kernel) and for GEMMs of at least ``PREDICT_INT8_MNK`` multiply-adds, else
    ``float``. On the H200 every shape the shipped table sends to float has M*N*K <= 3.3e10 (host-bound: the
    int8 path's quantization launch and host work outweigh its faster GEMM), so sm_90's bound is 2**36 (6.9e10);
    GPUs with less bf16 throughput reach that balance at smaller GEMMs, a bound a quarter as large (sm_80) or an
    eighth (GeForce, sm_86 and later)."""
    if m <= 16:
        return INT8
    bound = PREDICT_INT8_MNK.get(tuple(capability)[0], PREDICT_INT8_MNK[0])
    return INT8 if m * n * k >= bound else FLOAT


PREDICT_INT8_MNK = {9: 2 ** 36, 10: 2 ** 36, 8: 2 ** 34, 0: 2 ** 33}   # by major capability; 0: the others


def _submit_timing(layer, x2d: torch.Tensor, skey: str, cache) -> None:
    """Queues the timing of ``skey`` for the idle worker (``kernel.deferred``): on a fresh activation of the call's
    shape and the layer's weight if it is still on the GPU then (else the job is dropped). It writes the decision to
    the cache file only: this process keeps the path it ran, so repeated samples give the same output; the next
    process takes the timed one."""
    import weakref
    ref = weakref.ref(_owner(layer))
    shape, dtype, dev, m = tuple(x2d.shape), x2d.dtype, x2d.device, x2d.shape[0]
    x2d_size = x2d.element_size()

    def job(stop):
        owner = ref()
        if owner is None or owner.qweight.device != dev:
            return
        stop()
        import contextlib
        if dev.type == "cuda":   # the float copy of the weight and the activation (a job leaves the GPU its room)
            retune.make_room(dev, owner.qweight.numel() * 2 + math.prod(shape) * x2d_size)
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            x = torch.randn(shape, dtype=dtype, device=dev)
            c8, cf, _ = measure(owner, x)
        stop()
        path = decide(c8.eff, cf.eff, int8_gpu_ms=c8.gpu, float_gpu_ms=cf.gpu)
        cache.put(skey, {"path": path, "int8_ms": c8.eff, "float_ms": cf.eff, "int8_gpu_ms": c8.gpu,
                         "float_gpu_ms": cf.gpu, "m": m}, _meta(dev))
    deferred.submit(f"dispatch {skey}", job)


# --------------------------------------------------------------------------- the two paths
def dequantized(layer, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] ``dequantize(W_q) / smooth`` in ``dtype`` (fp32 math, one rounding), built in row chunks so the
    fp32 temporary stays small. ``layer``: an Int8Linear or its fetched operands."""
    q, ws, inv = layer.qweight, layer.weight_scale, layer.inv_smooth
    n, k = q.shape
    out = torch.empty((n, k), dtype=dtype, device=q.device)
    for r in range(0, n, _DEQUANT_ROWS):
        w = q[r:r + _DEQUANT_ROWS].float() * ws[r:r + _DEQUANT_ROWS].float()[:, None]
        if inv is not None:
            w = w * inv[None, :]
        out[r:r + _DEQUANT_ROWS] = w
    return out


def _owner(layer):
    """The Int8Linear of ``layer`` (itself, or the owner of its fetched operands), without nn.Module's slow
    ``__getattr__`` miss."""
    d = getattr(layer, "__dict__", None)
    return layer.owner if d is None else d.get("owner", layer)


def float_operands(layer, dtype: torch.dtype, made: torch.Tensor | None = None):
    """(weight, bias) of the float path in ``dtype``, kept in the owner's derived state (see module doc):
    valid while the owner's int8 weight is the same tensor (same object, device and storage), as
    ``Int8Linear.derived_tensor`` rules; ``_apply`` (a move or cast by ComfyUI) drops them."""
    owner = _owner(layer)
    src = owner._parameters["weight"]
    dev = src.device if layer is owner else layer.qweight.device

    def make(_):
        b = layer.bias
        return (made if made is not None else dequantized(layer, dtype),
                None if b is None else b.to(device=dev, dtype=dtype))
    return owner.derived_tensor(("dispatch_float", dev, dtype), src, make)


def float_linear(x2d: torch.Tensor, layer) -> torch.Tensor:
    """The float path: ``F.linear(x, W', b)`` in ``x2d.dtype`` (any M, 0 included)."""
    w, b = float_operands(layer, x2d.dtype)
    return F.linear(x2d, w, b)


def int8_linear(x2d: torch.Tensor, layer) -> torch.Tensor:
    """The INT8 path: the INT8 side of per-shape dispatch that the layer's backend declares
    (``backends.Backend.dispatch_int8``; ``fused_triton``: quantize kernel + fused GEMM through the layer's prepared
    launches, ``run_int8`` of the Int8Linear or of its fetched operands)."""
    return backends.get(layer.backend).dispatch_int8(x2d, layer)


def run(layer, x2d: torch.Tensor, owner) -> tuple[torch.Tensor, str]:
    """One call of a ``fused_triton`` layer: choose the path, run it, count it on ``owner`` (the Int8Linear;
    ``layer`` is it or its fetched operands). Returns the output and the path that ran."""
    m = mode()
    path = _choose_auto(layer, x2d) if m == "auto" else m
    y = float_linear(x2d, layer) if path == FLOAT else int8_linear(x2d, layer)
    if not launch.dry_run():   # kernel.ahead's dry run is not a call
        record(owner, path, x2d.shape[0], forced=m != "auto")
    return y, path


# --------------------------------------------------------------------------- choosing, per call
def choose(layer, x2d: torch.Tensor) -> str:
    """``int8`` or ``float`` for this call of a ``fused_triton`` layer (see module doc). Per call: a mode
    lookup and one dict lookup in the layer's memo once the shape is decided."""
    m = mode()
    return _choose_auto(layer, x2d) if m == "auto" else m


def _choose_auto(layer, x2d: torch.Tensor) -> str:
    dev = x2d.device
    if not _can_time(dev):
        return INT8
    path = _owner(layer).dispatch_path((x2d.shape[0], x2d.dtype, dev), lambda: _decision(layer, x2d))
    return INT8 if path is None else path


def _can_time(device: torch.device) -> bool:
    return device.type == "cuda"


def _meta(device: torch.device) -> dict:
    return {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}


def _decision(layer, x2d: torch.Tensor) -> str | None:
    """The shape's path from the process memo, the cache file, or timing it now; None: cannot time now."""
    dev, dtype, m = x2d.device, x2d.dtype, x2d.shape[0]
    if torch.compiler.is_compiling() or (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return None
    n, k = layer.qweight.shape
    has_bias = layer.bias is not None
    key = (dev, m_bucket(m), n, k, has_bias, dtype)
    path = _DECISIONS.get(key)
    if path is not None:
        return path
    with _LOCK:
        path = _DECISIONS.get(key)
        if path is not None:
            return path
        cache = _device_cache(dev)
        skey = shape_key(m, n, k, has_bias, dtype)
        entry = cache.get(skey)
        tune = deferred.mode()
        if entry is not None:
            path = entry["path"]
        elif tune != "first_call":
            path = predicted(m, n, k, torch.cuda.get_device_capability(dev) if dev.type == "cuda" else (0, 0))
            if tune == "background":
                _submit_timing(layer, x2d, skey, cache)
        else:
            try:
                from ..kernel.tuned import progress
                with progress.task("dispatch", skey, "int8 vs float", cache.path):
                    c8, cf, w = measure(layer, x2d)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory for the float copy: stay on int8
                log.warning("INT8 dispatch: could not time %s (%s: %s); running int8", skey, type(e).__name__, e)
                _DECISIONS[key] = INT8
                return INT8
            path = decide(c8.eff, cf.eff, int8_gpu_ms=c8.gpu, float_gpu_ms=cf.gpu)
            cache.put(skey, {"path": path, "int8_ms": c8.eff, "float_ms": cf.eff, "int8_gpu_ms": c8.gpu,
                             "float_gpu_ms": cf.gpu, "m": m}, _meta(dev))
            log.info("INT8 dispatch %s (M %d): int8 %.4f ms (GPU %.4f), float %.4f ms (GPU %.4f) -> %s", skey, m,
                     c8.eff, c8.gpu, cf.eff, cf.gpu, path)
            if path == FLOAT:
                float_operands(layer, dtype, made=w)  # keep the copy the timing made
        _DECISIONS[key] = path
        return path


STALL_CYCLES = 2_000_000  # GPU clock cycles held before each timed call: 1 ms at 2 GHz, longer at lower clocks


def time_call(f, reps: int, flush: torch.Tensor | None) -> tuple[float, float]:
    """(median GPU ms, median host ms) of ``reps`` calls of ``f`` on the current CUDA stream. Before each call
    ``flush`` (an L2-sized buffer) is zeroed, so weights come from HBM as in a real model, where every layer
    has its own, and the GPU is held busy (``torch.cuda._sleep``, ``STALL_CYCLES``) while the host issues the
    call: the events around the call time its GPU work alone, not the GPU waiting for the host (which made a
    call with more host work look slower on the GPU too). The host time is what issuing it cost; a
    stream of calls costs the larger of the two (``effective_ms``)."""
    import statistics
    import time
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    host = []
    for s, e in evs:
        if flush is not None:
            flush.zero_()
        torch.cuda._sleep(STALL_CYCLES)
        s.record()
        t0 = time.perf_counter()
        f()
        host.append((time.perf_counter() - t0) * 1e3)
        e.record()
    evs[-1][1].synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in evs), statistics.median(host)


def effective_ms(gpu_ms: float, host_ms: float) -> float:
    """What a call costs in a stream of calls: the GPU time, or the host time when issuing it takes longer
    (then the GPU waits for the CPU)."""
    return max(gpu_ms, host_ms)


def flush_buffer(device: torch.device) -> torch.Tensor:
    """A buffer as large as the GPU's L2 cache, zeroed before each timed call (see ``time_call``)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (50 << 20)
    return torch.empty(l2, dtype=torch.int8, device=device)


class Cost(NamedTuple):
    """A path's timing (ms): ``eff`` what a call costs in a stream of calls (``effective_ms``), ``gpu`` its GPU time."""
    eff: float
    gpu: float


def time_pair(fa, fb, rounds: int = ROUNDS, reps: int = REPS) -> tuple[Cost, Cost]:
    """``Cost`` of ``fa`` and of ``fb``: medians over ``rounds`` interleaved rounds of ``reps`` calls each (clock and
    cache drift hit both), after one warm-up call each (compiles, autotunes)."""
    import statistics
    fa()
    fb()
    torch.cuda.synchronize()
    flush = flush_buffer(torch.device("cuda", torch.cuda.current_device()))
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(time_call(fa, reps, flush))
        tb.append(time_call(fb, reps, flush))
    del flush
    return tuple(Cost(statistics.median(effective_ms(*t) for t in ts), statistics.median(g for g, _ in ts))
                 for ts in (ta, tb))


def measure(layer, x2d: torch.Tensor) -> tuple[Cost, Cost, torch.Tensor]:
    """(int8 ``Cost``, float ``Cost``, the float weight made for it) on the call's own operands."""
    w = dequantized(layer, x2d.dtype)
    b = None if layer.bias is None else layer.bias.to(x2d.dtype)
    with torch.cuda.device(x2d.device):  # events, flush buffer and synchronize on the layer's GPU
        c8, cf = time_pair(lambda: int8_linear(x2d, layer), lambda: F.linear(x2d, w, b))
    return c8, cf, w


# --------------------------------------------------------------------------- what ran
def record(layer, path: str, m: int, forced: bool = False) -> None:
    """Count one call of ``layer`` (the Int8Linear) on ``path`` with ``m`` rows (``forced``: by
    INT8_FUSED_DISPATCH rather than by timing)."""
    layer.count_call(path, m, forced)


def _dispatch_layers(model) -> list:
    mods = model.modules() if hasattr(model, "modules") else model
    return [m for m in mods if isinstance(getattr(m, "dispatch_calls", None), collections.Counter)
            and backends.capabilities(getattr(m, "backend", None)).per_shape_dispatch]


def counts(model) -> dict:
    """What the ``fused_triton`` Int8Linear layers of ``model`` (a module or an iterable of modules) ran:
    {"layers", "int8_layers", "float_layers", "int8_calls", "float_calls", "lora_layers" (carrying LoRA branches this
    run), "float_shapes": sorted ["M<=b NxK", ...]} (a layer that ran both paths counts in both)."""
    layers = _dispatch_layers(model)
    shapes = set()
    for m in layers:
        for rows, forced in m.derived.float_rows:
            shapes.add((m_bucket(rows), m.out_features, m.in_features, forced))
    return {"layers": len(layers),
            "int8_layers": sum(1 for m in layers if m.dispatch_calls[INT8]),
            "float_layers": sum(1 for m in layers if m.dispatch_calls[FLOAT]),
            "int8_calls": sum(m.dispatch_calls[INT8] for m in layers),
            "float_calls": sum(m.dispatch_calls[FLOAT] for m in layers),
            "lora_layers": sum(1 for m in layers if m.derived.lora is not None),
            "float_shapes": [f"M<={b} {n}x{k}" + (" (forced)" if forced else "") for b, n, k, forced in sorted(shapes)]}


def report_line(model) -> str | None:
    """One line for the Apply report / the run log, e.g. ``dispatch auto: 120 linears ran int8, 3 on float
    (float faster, unless forced): 2 shapes M<=16 18432x3072, M<=128 4608x4608; calls int8 2400, float 60``
    (a shape run on float because INT8_FUSED_DISPATCH=float says "(forced)"). Counts are since the layers
    were built. None when ``model`` has no ``fused_triton`` layer."""
    c = counts(model)
    if not c["layers"]:
        return None
    head = f"dispatch {mode()}"
    if not (c["int8_calls"] or c["float_calls"]):
        how = "each shape timed on its first call (GPU), cached" if mode() == "auto" else "forced"
        return f"{head}: {c['layers']} fused_triton linears, no calls yet ({how})"
    line = f"{head}: {c['int8_layers']} linears ran int8, {c['float_layers']} on float"
    if c["float_shapes"]:
        line += f" (float faster, unless forced): {len(c['float_shapes'])} shapes " + ", ".join(c["float_shapes"])
    line += f"; calls int8 {c['int8_calls']}, float {c['float_calls']}"
    if not c["int8_calls"]:
        return line
    from ..kernel import s8wgmma
    s8 = s8wgmma.state()
    line = f"{line}; {s8}" if s8 else line
    if c["lora_layers"]:  # how their LoRAs ran on the fused path (quant.blocks.gemm)
        line += f"; LoRA on {c['lora_layers']} layers: {backends.lora_epilogue_state()}"
    return line
