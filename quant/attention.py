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
  sage                      SageAttention through ComfyUI's own ``attention_sage`` (``Router(sage_fn=...)``; the node
                            lists it only where the ``sageattention`` package imports) for calls it takes: CUDA,
                            head_dim 64/96/128, no mask (``sage_reason``); every other call runs on the predicted
                            exact backend (``predicted``), counted under that backend's name.
  int8                      the pack's 8-bit attention (``attention_int8``: INT8 Q·Kᵀ with per-block scales and K
                            smoothing, fp32 online softmax, bf16/fp16 P·V; approximate, ~1e-2 relative error) for
                            calls it takes: no mask, head_dim 64/128/256, bf16/fp16, a CUDA device with Triton
                            usable (sm_80+), heads a multiple of K/V heads. Every other call goes to ComfyUI's
                            function, counted as ``comfy_default``.

The user's attention. A user who started ComfyUI with ``--use-sage-attention`` (``--use-flash-attention``,
``--use-ck-attention``, xformers, ...) or put an attention node before the pack's (an override set upstream) chose
it: ``Router(upstream=...)`` passes the calls it does not take to that override, and ``auto`` treats it as a
candidate (``USER``) next to the exact backends: timed as they are, per shape, and kept unless an exact backend is at
least ``USER_MARGIN`` (5 %) faster; before it is timed (``INT8_FUSED_TUNE`` background or off) it is kept. Being
approximate is no reason to drop it: the user chose it. One INFO line says what auto kept or replaced, and why.

What ran: ``Router.counts`` counts calls per backend torch actually picked (``torch._fused_sdp_choice`` under the
same priority, cached per shape), ``sage`` / ``int8``, the user's attention by its name (``sage``, ``flash_attn``,
``upstream:<name>``: ``chosen_name``, ``upstream_name``), or ``COMFY`` for calls that went to ComfyUI's plain SDPA
function. nodes/timing.py reads the
counts around each model call.
"""
from __future__ import annotations

import collections
import contextlib
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
SAGE = "sage"
MODES = (COMFY, AUTO) + BACKENDS + (INT8, SAGE)
USER = "user"  # auto's candidate and cache entry: the attention the user chose (ComfyUI's flags, an upstream override)
USER_MARGIN = 0.05  # auto replaces the user's attention only with an exact backend at least this much faster
SAGE_HEAD_DIMS = (64, 96, 128)  # what SageAttention takes (ComfyUI's attention_sage logs an error and falls back else)
SAGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# ComfyUI's attention functions (comfy/ldm/modules/attention.py) that a flag selects in place of its default
# (attention_pytorch; attention_sub_quad where torch's SDPA is off, as on a CPU): the user's choice, by the name it is
# shown under.
CHOSEN_FUNCTIONS = {"attention_sage": "sage", "attention3_sage": "sage3", "attention_flash": "flash_attn",
                    "attention_xformers": "xformers", "attention_comfy_kitchen_int8": "comfy_kitchen_int8",
                    "attention_split": "split"}
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


def chosen_name(func) -> str | None:
    """The name of the attention the user chose that ``func`` (the function ComfyUI hands the override) runs:
    ``sage`` for ``attention_sage`` (``--use-sage-attention``), ``flash_attn``, ``xformers``, ...; None for ComfyUI's
    own SDPA function and for anything this module does not know (tests' stand-ins)."""
    return CHOSEN_FUNCTIONS.get(getattr(func, "__name__", None))


def upstream_name(override) -> str:
    """A short name of an override set before the pack's: ``upstream:<name>``, where ``<name>`` is the ComfyUI
    attention function it wraps (``ModelPatcher.set_model_optimized_attention``'s closure, e.g. the "Model Attention
    Backend" node's choice), else its own name."""
    for cell in getattr(override, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        name = getattr(inner, "__name__", "")
        if callable(inner) and name.startswith("attention"):
            return f"upstream:{CHOSEN_FUNCTIONS.get(name, name)}"
    return f"upstream:{getattr(override, '__name__', type(override).__name__)}"


def sage_reason(q, k, v, mask, kwargs, devices=("cuda",)) -> str | None:
    """None when SageAttention takes this SDPA call (q/k/v [B, H, L, D]), else why not (the call then runs on an
    exact SDPA backend: ComfyUI's ``attention_sage`` would log an error and fall back on every such call)."""
    if mask is not None:
        return "a mask"
    if kwargs.get("low_precision_attention", True) is False:
        return "low_precision_attention=False"
    if q.device.type not in devices:
        return f"device {q.device}"
    if q.shape[-1] not in SAGE_HEAD_DIMS:
        return f"head_dim {q.shape[-1]}"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SAGE_DTYPES:
        return f"dtype {q.dtype}/{k.dtype}/{v.dtype}"
    return None


def keep_user(best: str | None, times: dict, margin: float = USER_MARGIN) -> str | None:
    """auto's choice when the user's attention (``USER``) is a candidate: the user's unless an exact backend is at
    least ``margin`` faster (or the user's could not run)."""
    user = times.get(USER, math.inf)
    if not math.isfinite(user):
        return best
    exact = {n: t for n, t in times.items() if n != USER and math.isfinite(t)}
    fastest = min(exact, key=exact.get, default=None)
    return fastest if fastest is not None and exact[fastest] < user * (1.0 - margin) else USER


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
    """Whether a read entry of the attention cache may be used: ``{"backend": <a backend, int8 or user>, "ms":
    {..}}`` (``user``: the user's own attention won; only keys with a ``_user-`` part hold it)."""
    return (isinstance(entry, dict) and entry.get("backend") in BACKENDS + (INT8, USER)
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
    ``direct_devices``: device types whose cuDNN calls run torch's cuDNN op directly (``direct_cudnn_ok``);
    ``upstream``: the override set before this one (another attention node), which takes the calls ComfyUI's
    function would take and is the user's choice for ``auto``; ``sage_fn``: ComfyUI's SageAttention function
    (``sage`` mode; ``sage_devices``: where it runs, CUDA; tests add "cpu" with a stand-in).

    The user's attention: ``upstream`` when set, else the function ComfyUI hands each call when a flag chose it
    (``chosen_name``: ``--use-sage-attention`` -> ``attention_sage``). ``auto`` keeps it for a shape unless an exact
    backend is at least ``USER_MARGIN`` faster there (timed as the exact ones are); calls that go to it count under
    its name (``sage``, ``upstream:<name>``), calls to ComfyUI's plain SDPA function under ``comfy_default``."""

    def __init__(self, mode: str, time_fn=None, cache=None, probe_devices=("cuda",), int8_devices=("cuda",),
                 direct_devices=("cuda",), upstream=None, sage_fn=None, sage_devices=("cuda",)):
        self.mode = check_mode(mode)
        if mode == COMFY:
            raise ValueError("comfy_default installs no override; do not build a Router for it")
        if mode == SAGE and sage_fn is None:
            raise ValueError("attention sage needs ComfyUI's SageAttention function (the sageattention package)")
        self.time_fn = time_fn or (lambda name, run: cuda_time(run))
        self.cache, self.probe_devices = cache, tuple(probe_devices)
        self.int8_devices, self.direct_devices = tuple(int8_devices), tuple(direct_devices)
        self.upstream, self.sage_fn, self.sage_devices = upstream, sage_fn, tuple(sage_devices)
        self._upstream_name = None if upstream is None else upstream_name(upstream)  # once, not per call
        self.counts: collections.Counter = collections.Counter()  # backend that ran -> calls
        self.winners: dict = {}  # auto: shape key -> backend name (``USER``: the user's attention)
        self.probes: dict = {}   # auto: shape key -> {backend: ms} of the probes this Router ran
        self._ran: dict = {}     # (shape key, strides, order) -> backend torch picks
        self._told: set = set()  # user attentions whose keeping auto has logged

    def __repr__(self):
        return f"Router({self.mode!r})" if self.upstream is None else f"Router({self.mode!r}, upstream={self.upstream!r})"

    def user_choice(self, func) -> str | None:
        """The name of the user's attention for a call handed ``func`` (class doc), None when there is none."""
        return self._upstream_name if self.upstream is not None else chosen_name(func)

    def _user_fn(self, func):
        """What runs a call as the user set it up: the upstream override, else ComfyUI's function."""
        if self.upstream is None:
            return func
        return lambda *a, **kw: self.upstream(func, *a, **kw)

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
            backend = self._auto(func, args, kwargs, q, k, v, mask, extra)
            if backend is None or backend == USER:
                return self._comfy(func, args, kwargs)
        if backend == SAGE:
            why = sage_reason(q, k, v, mask, kwargs, self.sage_devices)
            if why is None:
                self.counts[SAGE] += 1
                return self.sage_fn(*args, **kwargs)
            log.debug("int8_fused attention: sage does not take this call (%s): %s runs it", why, predicted(q.device))
            backend = predicted(q.device)
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
        """The call as the user set it up (the upstream override, else ComfyUI's function), counted by its name."""
        self.counts[self.user_choice(func) or COMFY] += 1
        if self.upstream is not None:
            return self.upstream(func, *args, **kwargs)
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

    def _pick(self, names, time_one, user: str | None) -> tuple[str, dict]:
        """The winner of ``names`` (``USER`` among them when the user chose an attention: kept unless an exact
        backend is ``USER_MARGIN`` faster) and the times; ``math`` when nothing ran."""
        best, times = pick_fastest(names, time_one)
        if user is not None:
            best = keep_user(best, times)
        return best or "math", times

    def _submit_probe(self, func, args, kwargs, q, k, v, extra, with_int8: bool, user: str | None, text: str,
                      cache) -> None:
        """Queues the probe of this shape for the idle worker (``kernel.deferred``), on fresh tensors of the call's
        shapes and dtypes (the user's attention, when there is one, on fresh tensors of the call's own arguments);
        its winner goes to the cache file only (the running process keeps its backend, so repeated samples give the
        same output; the next process takes the winner)."""
        from ..kernel import deferred
        shapes = [(tuple(t.shape), t.dtype, t.device) for t in (q, k, v)]
        extra = {n: val for n, val in extra.items() if not isinstance(val, torch.Tensor)}
        user_fn = self._user_fn(func) if user is not None else None
        rest = args[3:]
        kw = {n: val for n, val in kwargs.items() if not isinstance(val, torch.Tensor)}
        arg_shapes = [(tuple(t.shape), t.dtype, t.device) for t in args[:3]]

        def job(stop):
            from ..kernel import retune
            dev = shapes[0][2]
            if dev.type == "cuda":  # q, k, v and an output each, twice with the user's own arguments
                retune.make_room(dev, sum(math.prod(sh) * torch.empty((), dtype=dt).element_size() * 2
                                          for sh, dt, _ in shapes + (arg_shapes if user_fn is not None else [])))
            qq, kk, vv = (torch.randn(sh, dtype=dt, device=dev) for sh, dt, dev in shapes)
            if user_fn is not None:  # the user's function takes the call's own argument form
                uq, uk, uv = (torch.randn(sh, dtype=dt, device=dev) for sh, dt, dev in arg_shapes)

            def time_one(name):
                stop()

                def run():
                    if name == USER:
                        return user_fn(uq, uk, uv, *rest, **kw)
                    if name == INT8:
                        return run_int8(qq, kk, vv, extra)
                    with _kernel([name]):
                        return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, **extra)
                return self.time_fn(name, run)
            names = ((USER,) if user is not None else ()) + PROBED + ((INT8,) if with_int8 else ())
            with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
                best, times = self._pick(names, time_one, user)
            cache.put(text, {"backend": best, "ms": {n: (t if math.isfinite(t) else None) for n, t in times.items()}},
                      {"gpu": _gpu_name(dev), "torch": torch.__version__})
        deferred.submit(f"attention {text}", job)

    def _auto(self, func, args, kwargs, q, k, v, mask, extra) -> str | None:
        """The winner for this shape: memory, then the JSON cache, then a probe. None: the call as the user set it
        up (ComfyUI's function or the upstream override); ``USER``: the user's attention won or is kept."""
        if q.device.type not in self.probe_devices:
            return None
        user = self.user_choice(func)
        with_int8 = int8_auto_allowed() and int8_reason(q, k, v, mask, extra, self.int8_devices) is None
        key = shape_key(q, k, mask) + (("int8ok",) if with_int8 else ()) + ((f"user:{user}",) if user else ())
        hit = self.winners.get(key)
        if hit is not None:
            return hit
        if torch.compiler.is_compiling():  # no file access in a traced graph: an eager call's winner, else ComfyUI's
            return None
        cache = self.cache if self.cache is not None else disk_cache(q.device)
        text = (key_text(key[:9]) + ("_int8ok" if with_int8 else "")
                + (f"_user-{re.sub(r'[^A-Za-z0-9.]+', '-', user)}" if user else ""))
        stored = cache.get(text)
        allowed = BACKENDS + ((INT8,) if with_int8 else ()) + ((USER,) if user else ())
        if stored and stored.get("backend") in allowed:
            self.winners[key] = stored["backend"]
            self._tell(user, text, stored["backend"], stored.get("ms") or {}, "timed earlier")
            return stored["backend"]

        from ..kernel import deferred
        tune = deferred.mode()
        if tune != "first_call":   # no probe on the critical path: the predicted backend now, the probe later
            guess = USER if user else predicted(q.device)
            self.winners[key] = guess
            if tune == "background" and mask is None:
                self._submit_probe(func, args, kwargs, q, k, v, extra, with_int8, user, text, cache)
            self._tell(user, text, guess, {}, "kept until it is timed between samples (the next process takes "
                       "the result)" if tune == "background" and mask is None else "kept: not timed")
            return guess

        user_fn = self._user_fn(func)

        def time_one(name):
            def run():
                if name == USER:
                    return user_fn(*args, **kwargs)
                if name == INT8:
                    return run_int8(q, k, v, extra)
                with _kernel([name]):  # that backend alone: one that cannot take the call raises
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)
            return self.time_fn(name, run)
        names = ((USER,) if user else ()) + PROBED + ((INT8,) if with_int8 else ())
        with _progress().task("attention", text, f"{len(names)} backends", getattr(cache, "path", None)):
            best, times = self._pick(names, time_one, user)
        self.winners[key], self.probes[key] = best, times
        cache.put(text, {"backend": best, "ms": {n: (t if math.isfinite(t) else None) for n, t in times.items()}},
                  {"gpu": _gpu_name(q.device), "torch": torch.__version__})
        shown = {(user if n == USER else n): t for n, t in times.items()}
        log.info("int8_fused attention auto %s: %s (%s)", text, user if best == USER else best,
                 ", ".join(f"{n} {t:.3f} ms" if math.isfinite(t) else f"{n} cannot run" for n, t in shown.items()))
        if user:
            self._tell(user, text, best, times, "timed now")
        return best

    def _tell(self, user: str | None, text: str, backend: str, ms: dict, how: str) -> None:
        """One INFO line per user attention and outcome: auto kept it, or which exact backend replaced it and why."""
        if user is None or (user, backend == USER) in self._told:
            return
        self._told.add((user, backend == USER))
        if backend == USER:
            log.info("int8_fused attention auto: your attention (%s) runs (%s; %s)", user, how, text)
        else:
            t_user, t_best = ms.get(USER), ms.get(backend)
            timed = all(isinstance(t, (int, float)) and math.isfinite(t) for t in (t_user, t_best))
            why = (f"{t_best:.3f} ms against {t_user:.3f} ms, at least {round(USER_MARGIN * 100)} % faster"
                   if timed else "yours could not run this call")
            log.info("int8_fused attention auto: %s replaces your attention (%s) on %s: %s (%s)", backend, user, text,
                     why, how)
