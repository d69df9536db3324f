"""Attention routing: ComfyUI's attention calls on a chosen torch SDPA backend, or on the fastest one for the
shape (measured once per shape), or on the pack's INT8 attention kernel (``kernel/attention8.py``). Pure torch
(the ``int8`` mode imports Triton on its first call); the ComfyUI glue is ``nodes/attention.py``.

ComfyUI's ``wrap_attn`` (comfy/ldm/modules/attention.py) hands each ``optimized_attention(_masked)`` call to
``transformer_options["optimized_attention_override"](func, q, k, v, heads, ...)`` when that is set; ``func`` is
ComfyUI's own attention function. A :class:`Router` is such an override. It computes what ComfyUI's
``attention_pytorch`` computes, with the same argument handling (``heads``, ``skip_reshape``,
``skip_output_reshape``, 2-, 3- or 4-D float or bool masks, ``scale``, ``enable_gqa``), inside
``torch.nn.attention.sdpa_kernel(order, set_priority=True)`` with the chosen backend first. A call it cannot take
(an unknown keyword, tensors of another rank, a batch above ComfyUI's SDPA batch limit, a torch without
``sdpa_kernel``) goes to ``func`` unchanged.

Modes (``MODES``):
  comfy_default             no override: nothing here runs (nodes/attention.py installs nothing).
  cudnn / flash / efficient that backend first, then the others in ComfyUI's order (flash, cudnn, efficient, math):
                            on CUDA torch runs the first one that accepts the call. On a CPU torch ignores the
                            priority and runs its CPU flash kernel (or math); results are the same.
  math                      only torch's math backend (the reference implementation), on every device.
  auto                      CUDA: per shape key (B, heads, kv heads, Lq, Lk, head dim, dtype, mask kind, device) each
                            of cudnn / flash / efficient that accepts the call runs ``PROBE_REPS`` times, timed with
                            CUDA events, once; the fastest is kept in memory and in a JSON file next to the GEMM
                            autotune cache (``kernel.autotune.cache_dir()``, ``attention-<gpu>-torch-<version>.json``);
                            a shape it lacks takes the pack's shipped table's choice for the GPU (``kernel/tuned``).
                            On any other device: ComfyUI's own function (what ``comfy_default`` runs).
                            auto is exact-only: it picks ``int8`` only when the environment switch
                            INT8_FUSED_ATTN_INT8_AUTO=1 (kernel/config.py) adds it to the probe, for calls ``int8``
                            takes; those winners are cached under their own key (suffix ``_int8ok``).
  int8                      the pack's 8-bit attention (``attention_int8``: INT8 Q·Kᵀ with per-block scales and K
                            smoothing, fp32 online softmax, bf16/fp16 P·V; approximate, ~1e-2 relative error) for
                            calls it takes: no mask, head_dim 64/128/256, bf16/fp16, a CUDA device with Triton
                            usable (sm_80+), heads a multiple of K/V heads. Every other call goes to ComfyUI's
                            function, counted as ``comfy_default``.

What ran: ``Router.counts`` counts calls per backend torch actually picked (``torch._fused_sdp_choice`` under the
same priority, cached per shape), or ``COMFY`` for calls that went to ComfyUI's function. nodes/timing.py reads the
counts around each model call.
"""
from __future__ import annotations

import collections
import inspect
import logging
import math
import re
from typing import Callable

import torch

log = logging.getLogger("int8_fused")

COMFY = "comfy_default"
BACKENDS = ("cudnn", "flash", "efficient", "math")
INT8 = "int8"
AUTO = "auto"
MODES = (COMFY, AUTO) + BACKENDS + (INT8,)
INT8_HEAD_DIMS = (64, 128, 256)
INT8_DTYPES = (torch.float16, torch.bfloat16)
PROBED = ("cudnn", "flash", "efficient")  # exact fused kernels auto chooses from (math only when none runs)
PROBE_REPS = 3
SDP_BATCH_LIMIT = 2 ** 15  # ComfyUI splits larger batches itself on NVIDIA (attention_pytorch): left to it
_KNOWN_KWARGS = {"scale", "enable_gqa", "transformer_options", "low_precision_attention", "_inside_attn_wrapper"}
_CHOICE_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}  # torch.nn.attention.SDPBackend values

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    _SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    _SET_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters
except (ImportError, AttributeError, TypeError, ValueError):  # torch < 2.3
    sdpa_kernel, _SDPA, _SET_PRIORITY = None, {}, False
COMFY_ORDER = ("flash", "cudnn", "efficient", "math")  # comfy/ops.py SDPA_BACKEND_PRIORITY
# The op torch's SDPA runs for a cuDNN call (aten/src/ATen/native/transformers/attention.cpp: no mask, no grad: the
# query, key and value as given, compute_log_sumexp False, its output first). Where this call's shape and strides
# are known to go to cuDNN (``Router._which``), the Router calls it directly: the same kernel and bits without the
# priority context and the dispatcher's backend checks (host time, which paces small steps).
_CUDNN_OP = getattr(getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None), "default", None)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown attention mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


def order(backend: str) -> tuple[str, ...]:
    """Priority list with ``backend`` first (``math``: math alone)."""
    if backend == "math":
        return ("math",)
    return (backend,) + tuple(b for b in COMFY_ORDER if b != backend)


def _kernel(names):
    backends = [_SDPA[n] for n in names]
    return sdpa_kernel(backends, set_priority=True) if _SET_PRIORITY else sdpa_kernel(backends)


# ------------------------------------------------------------------------------------ ComfyUI's SDPA arguments
class Unsupported(Exception):
    """A call this module does not take; the Router hands it to ComfyUI's function."""


def sdpa_inputs(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                **kwargs):
    """ComfyUI's ``attention_pytorch`` argument handling -> (q, k, v [B, H, L, D], mask [.., .., Lq, Lk] | None,
    sdpa keyword arguments, a function turning SDPA's output into what ComfyUI returns). ``attn_precision`` is
    ignored, as attention_pytorch ignores it (SDPA accumulates in fp32)."""
    unknown = set(kwargs) - _KNOWN_KWARGS
    if unknown:
        raise Unsupported(f"keyword arguments {sorted(unknown)}")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise Unsupported("q, k, v are not tensors")
    if q.ndim != (4 if skip_reshape else 3) or k.ndim != q.ndim or v.ndim != q.ndim:
        raise Unsupported(f"q/k/v of rank {q.ndim}/{k.ndim}/{v.ndim} with skip_reshape={skip_reshape}")
    gqa = bool(kwargs.get("enable_gqa", False))
    if skip_reshape:
        b, dim_head = q.shape[0], q.shape[-1]
    else:
        b, dim_head = q.shape[0], q.shape[-1] // heads
        kv_heads = (lambda t: t.shape[-1] // dim_head) if gqa else (lambda t: heads)
        q, k, v = (t.reshape(b, -1, h, dim_head).transpose(1, 2)
                   for t, h in ((q, heads), (k, kv_heads(k)), (v, kv_heads(v))))
    if b > SDP_BATCH_LIMIT:
        raise Unsupported(f"batch {b} above the SDPA batch limit {SDP_BATCH_LIMIT}")
    if mask is not None:
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
    extra = {}
    if "scale" in kwargs:
        extra["scale"] = kwargs["scale"]
    if gqa and q.shape[-3] != k.shape[-3]:
        if mask is not None:  # as comfy.ops.scaled_dot_product_attention off NVIDIA: repeat K/V, exact
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        else:
            extra["enable_gqa"] = True

    def output(out):
        return out if skip_output_reshape else out.transpose(1, 2).reshape(b, -1, heads * dim_head)
    return q, k, v, mask, extra, output


def shape_key(q, k, mask) -> tuple:
    """(B, H, kv heads, Lq, Lk, D, dtype, mask kind, device) of SDPA inputs [B, H, L, D]."""
    kind = "none" if mask is None else f"{str(mask.dtype).replace('torch.', '')}{list(mask.shape[:2])}"
    return (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
            str(q.dtype).replace("torch.", ""), kind, str(q.device))


def key_text(key: tuple) -> str:
    b, h, hk, lq, lk, d, dtype, kind, dev = key
    return f"B{b}_H{h}_Hkv{hk}_Lq{lq}_Lk{lk}_D{d}_{dtype}_mask-{kind}_{dev}"


# ------------------------------------------------------------------------------------ auto: probe and cache
def cuda_time(run: Callable[[], torch.Tensor], reps: int = PROBE_REPS) -> float:
    """Milliseconds of ``run`` on the current CUDA stream: one warm-up, then the median of ``reps`` timed runs."""
    run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def pick_fastest(candidates, time_fn: Callable[[str], float]) -> tuple[str | None, dict]:
    """(fastest name, {name: ms}) over ``candidates``; ``time_fn(name)`` -> ms, an exception = cannot run."""
    times = {}
    for name in candidates:
        try:
            times[name] = float(time_fn(name))
        except Exception as e:  # noqa: BLE001 - "no kernel for this shape" is the common case
            log.debug("int8_fused attention probe: %s cannot run: %s", name, e)
            times[name] = math.inf
    best = min((n for n in candidates if math.isfinite(times[n])), key=lambda n: times[n], default=None)
    return best, times


def _autotune():
    from ..kernel import autotune
    return autotune


_DISK_CACHES: dict = {}


def _progress():
    from ..kernel.tuned import progress
    return progress


def predicted(device: torch.device) -> str:
    """The backend of a shape not yet probed (``INT8_FUSED_TUNE`` other than ``first_call``): ``cudnn`` on sm_90
    and later (the H200's pick on 9 of its 10 shipped shapes, every one with 3,510 tokens or more), else ``flash``.
    The mode is an order: a call the first backend does not take runs on the next (``order``)."""
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    return "cudnn" if cap[0] >= 9 else "flash"


def valid_entry(key: str, entry) -> bool:
    """Whether a read entry of the attention cache may be used: ``{"backend": <a backend or int8>, "ms": {..}}``."""
    return (isinstance(entry, dict) and entry.get("backend") in BACKENDS + (INT8,)
            and isinstance(entry.get("ms", {}), dict))


def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def disk_cache(device: torch.device, gpu: str | None = None):
    """The JSON cache of ``device``'s GPU (``gpu``: that name instead) and this torch version
    (``kernel.autotune.ConfigCache``: its file handling, a damaged file set aside with one warning), seeded with the
    pack's shipped table for that GPU (``kernel.tuned``, its ``attention`` section; keys without the device index)."""
    at = _autotune()
    name = gpu or _gpu_name(device)
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{name}-torch-{torch.__version__}").strip("-")
    path = at.cache_dir() / f"attention-{slug}.json"
    if path not in _DISK_CACHES:
        from ..kernel import tuned
        _DISK_CACHES[path] = at.ConfigCache(path, valid=valid_entry, what="attention cache", who="INT8 attention",
                                            seed=tuned.Seed(name, "attention", key=tuned.attention_key))
    return _DISK_CACHES[path]


# ------------------------------------------------------------------------------------ int8: the pack's kernel
_INT8_STATUS: dict = {}  # device -> (usable, reason), checked once


def _attention8():
    from ..kernel import attention8  # imports triton
    return attention8


def int8_reason(q, k, v, mask, extra, devices=("cuda",)) -> str | None:
    """None when ``attention_int8`` takes this SDPA call (q/k/v [B, H, L, D]), else why not."""
    if mask is not None:
        return "a mask"
    if q.device.type not in devices:
        return f"device {q.device}"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in INT8_DTYPES:
        return f"dtype {q.dtype}/{k.dtype}/{v.dtype}"
    if q.shape[-1] not in INT8_HEAD_DIMS:
        return f"head_dim {q.shape[-1]}"
    if k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0] or k.shape[1] == 0 \
            or q.shape[1] % k.shape[1]:
        return f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}"
    if min(q.shape[2], k.shape[2], q.shape[0], q.shape[1]) == 0:
        return "an empty sequence"
    if q.device not in _INT8_STATUS:
        from .. import kernel
        try:
            _INT8_STATUS[q.device] = kernel.triton_status(q.device)
        except Exception as e:  # noqa: BLE001 - whatever stops Triton stops int8
            _INT8_STATUS[q.device] = (False, str(e))
    ok, why = _INT8_STATUS[q.device]
    return None if ok else why


def run_int8(q, k, v, extra) -> torch.Tensor:
    """``attention_int8`` on SDPA inputs [B, H, L, D] (``extra``: SDPA's scale / enable_gqa)."""
    return _attention8().attention_int8(q, k, v, scale=extra.get("scale"))


def _switch(name: str) -> bool:
    from ..kernel import config
    return bool(config.get(name))


def int8_auto_allowed() -> bool:
    """INT8_FUSED_ATTN_INT8_AUTO: may ``auto`` time and choose ``int8``."""
    return _switch("INT8_FUSED_ATTN_INT8_AUTO")


def direct_cudnn_ok(q, k, v, mask, extra, devices=("cuda",)) -> bool:
    """Whether a call torch would send to cuDNN may call its op directly (``_CUDNN_OP``): the op exists, a device
    of ``devices``, no mask, no keyword but ``scale``, nothing that needs a gradient, not under torch.compile."""
    if _CUDNN_OP is None or mask is not None or q.device.type not in devices or any(n != "scale" for n in extra):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return not torch.compiler.is_compiling()


# ------------------------------------------------------------------------------------ the override
class Router:
    """``optimized_attention_override`` running torch SDPA with ``mode``'s backend first (module doc).

    ``time_fn(name, run)`` -> ms times one backend for ``auto`` (default: ``cuda_time(run)``); ``cache``: an
    object with ``get(key) -> dict | None`` and ``put(key, dict)`` (default: ``disk_cache(device)``);
    ``probe_devices``: device types ``auto`` probes on (CUDA; tests add "cpu" with a fake ``time_fn``);
    ``int8_devices``: device types ``int8`` runs on (CUDA; tests add "cpu" under TRITON_INTERPRET=1);
    ``direct_devices``: device types whose cuDNN calls run torch's cuDNN op directly (``direct_cudnn_ok``)."""

    def __init__(self, mode: str, time_fn=None, cache=None, probe_devices=("cuda",), int8_devices=("cuda",),
                 direct_devices=("cuda",)):
        self.mode = check_mode(mode)
        if mode == COMFY:
            raise ValueError("comfy_default installs no override; do not build a Router for it")
        self.time_fn = time_fn or (lambda name, run: cuda_time(run))
        self.cache, self.probe_devices = cache, tuple(probe_devices)
        self.int8_devices, self.direct_devices = tuple(int8_devices), tuple(direct_devices)
        self.counts: collections.Counter = collections.Counter()  # backend that ran -> calls
        self.winners: dict = {}  # auto: shape key -> backend name
        self.probes: dict = {}   # auto: shape key -> {backend: ms} of the probes this Router ran
        self._ran: dict = {}     # (shape key, strides, order) -> backend torch picks

    def __repr__(self):
        return f"Router({self.mode!r})"

    def __call__(self, func, *args, **kwargs):
        if sdpa_kernel is None:
            return self._comfy(func, args, kwargs)
        try:
            q, k, v, mask, extra, output = sdpa_inputs(*args, **kwargs)
        except (Unsupported, TypeError) as e:
            log.debug("int8_fused attention: ComfyUI's function runs this call (%s)", e)
            return self._comfy(func, args, kwargs)
        backend = self.mode
        if backend == "auto":
            backend = self._auto(q, k, v, mask, extra)
            if backend is None:
                return self._comfy(func, args, kwargs)
        if backend == INT8:
            why = int8_reason(q, k, v, mask, extra, self.int8_devices)
            if why is not None:
                log.debug("int8_fused attention: int8 does not take this call (%s): ComfyUI's function runs it", why)
                return self._comfy(func, args, kwargs)
            out = run_int8(q, k, v, extra)
            self.counts[INT8] += 1
            return output(out)
        names = order(backend)
        ran = self._which(q, k, v, mask, extra, names)
        if ran == "cudnn" and direct_cudnn_ok(q, k, v, mask, extra, self.direct_devices):
            out = _CUDNN_OP(q, k, v, None, False, 0.0, False, False, scale=extra.get("scale"))[0]
        else:
            with _kernel(names):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0,
                                                                       is_causal=False, **extra)
        self.counts[ran] += 1
        return output(out)

    def _comfy(self, func, args, kwargs):
        self.counts[COMFY] += 1
        return func(*args, **kwargs)

    def _which(self, q, k, v, mask, extra, names) -> str:
        """The backend torch runs for this call under ``names`` (cached per shape and strides)."""
        key = (shape_key(q, k, mask), q.stride(), k.stride(), v.stride(), names)
        ran = self._ran.get(key)
        if ran is None:
            ran = names[0]
            choice = getattr(torch, "_fused_sdp_choice", None)
            if choice is not None and not torch.compiler.is_compiling():
                try:
                    with _kernel(names):
                        ran = _CHOICE_NAMES.get(int(choice(q, k, v, mask, 0.0, False, **extra)), ran)
                except Exception:  # noqa: BLE001 - a private API: keep the requested name
                    pass
            self._ran[key] = ran
        return ran

    def _submit_probe(self, q, k, v, extra, with_int8: bool, text: str, cache) -> None:
        """Queues the probe of this shape for the idle worker (``kernel.deferred``), on fresh tensors of the call's
        shapes and dtypes; its winner goes to the cache file only (the running process keeps its backend, so
        repeated samples give the same output; the next process takes the winner)."""
        from ..kernel import deferred
        shapes = [(tuple(t.shape), t.dtype, t.device) for t in (q, k, v)]
        extra = {n: val for n, val in extra.items() if not isinstance(val, torch.Tensor)}

        def job(stop):
            from ..kernel import retune
            retune.make_room(shapes[0][2], sum(math.prod(sh) * torch.empty((), dtype=dt).element_size() * 2
                                               for sh, dt, _ in shapes))
            qq, kk, vv = (torch.randn(sh, dtype=dt, device=dev) for sh, dt, dev in shapes)

            def time_one(name):
                stop()

                def run():
                    if name == INT8:
                        return run_int8(qq, kk, vv, extra)
                    with _kernel([name]):
                        return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, **extra)
                return self.time_fn(name, run)
            with torch.cuda.device(shapes[0][2]):
                best, times = pick_fastest(PROBED + ((INT8,) if with_int8 else ()), time_one)
            cache.put(text, {"backend": best or "math",
                             "ms": {n: (t if math.isfinite(t) else None) for n, t in times.items()}},
                      {"gpu": _gpu_name(shapes[0][2]), "torch": torch.__version__})
        deferred.submit(f"attention {text}", job)

    def _auto(self, q, k, v, mask, extra) -> str | None:
        """The winner for this shape: memory, then the JSON cache, then a probe. None: ComfyUI's function."""
        if q.device.type not in self.probe_devices:
            return None
        with_int8 = int8_auto_allowed() and int8_reason(q, k, v, mask, extra, self.int8_devices) is None
        key = shape_key(q, k, mask) + (("int8ok",) if with_int8 else ())
        hit = self.winners.get(key)
        if hit is not None:
            return hit
        if torch.compiler.is_compiling():  # no file access in a traced graph: an eager call's winner, else ComfyUI's
            return None
        cache = self.cache if self.cache is not None else disk_cache(q.device)
        text = key_text(key[:9]) + ("_int8ok" if with_int8 else "")
        stored = cache.get(text)
        if stored and (stored.get("backend") in BACKENDS or (with_int8 and stored.get("backend") == INT8)):
            self.winners[key] = stored["backend"]
            return stored["backend"]

        from ..kernel import deferred
        tune = deferred.mode()
        if tune != "first_call":   # no probe on the critical path: the predicted backend now, the probe later
            guess = predicted(q.device)
            self.winners[key] = guess
            if tune == "background" and mask is None:
                self._submit_probe(q, k, v, extra, with_int8, text, cache)
            return guess

        def time_one(name):
            def run():
                if name == INT8:
                    return run_int8(q, k, v, extra)
                with _kernel([name]):  # that backend alone: one that cannot take the call raises
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)
            return self.time_fn(name, run)
        names = PROBED + ((INT8,) if with_int8 else ())
        with _progress().task("attention", text, f"{len(names)} backends", getattr(cache, "path", None)):
            best, times = pick_fastest(names, time_one)
        best = best or "math"
        self.winners[key], self.probes[key] = best, times
        cache.put(text, {"backend": best, "ms": {n: (t if math.isfinite(t) else None) for n, t in times.items()}},
                  {"gpu": _gpu_name(q.device), "torch": torch.__version__})
        log.info("int8_fused attention auto %s: %s (%s)", text, best,
                 ", ".join(f"{n} {t:.3f} ms" if math.isfinite(t) else f"{n} cannot run" for n, t in times.items()))
        return best
