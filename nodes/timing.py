"""Per-step timing of the MODELs this pack patches, sent to the frontend widget (web/int8_fused.js).

``instrument(model_patcher, node_id=..., backend=..., backends_used=None, attention=None)`` adds three wrappers to
a cloned ModelPatcher (``add_wrapper_with_key``, so other packs' wrappers and ``set_model_unet_function_wrapper``
keep working):

  OUTER_SAMPLE     brackets one sampling run: opens a :class:`Run`, wraps the sampler's per-step callback
                   to mark step boundaries, and in ``finally`` closes the run (also when interrupted or
                   failed), sends ``int8_fused.summary``, keeps it in a bounded ring buffer and logs one
                   line (INFO; WARNING for an error).
  APPLY_MODEL      one model call: reads the CFG branch from ``transformer_options["cond_or_uncond"]``
                   (0 cond, 1 uncond; [1, 0] is both batched together) and times the call unless ...
  DIFFUSION_MODEL  ... the architecture also runs this one (Flux, Lumina2/Z-Image, Qwen, Wan, ...): then
                   the time is that of the diffusion model's forward alone.

A step's time is the sum of the wall times of the model calls between two of the sampler's per-step
callbacks (the progress-bar ticks): cond + uncond, or both batched in one call; a second-order
sampler (Heun, DPM2) calls back between its two evaluations, so its "step" k holds the correction of
step k-1 and the prediction of step k; calls after the last callback join the last step. A sampler
that never calls back gets one step per sigma tensor instead.

No synchronisation is added inside a step. On a GPU each model call records two CUDA events on the
current stream (``Event.record`` is asynchronous); nothing waits on them while sampling. At each step
boundary the finished steps are resolved with ``Event.query()``, which never blocks, and their
``int8_fused.step`` events are sent then (so on a GPU the live chart may trail the sampler by a step).
Only when sampling has ended does the summary ``synchronize()`` the last event, when the sampler's output
is about to be consumed anyway. On the CPU, calls are synchronous and timed with ``time.perf_counter``.

The MODEL whose guider runs OUTER_SAMPLE drives the sampling; another instrumented MODEL that the
guider also calls (DualModelGuider's unconditional backbone, which ComfyUI runs under the first
model's wrappers: the call's model, ``executor.class_obj``, tells them apart) gets its own run on the
same step boundaries, with the same ``group``. Each model call is timed once, by the outermost
instrumented wrapper around it. ``branches`` are ComfyUI's ``cond_or_uncond`` tags, which are
positional: DualModelGuider's negative-model pass is tagged "cond"; the run's node names the model.

Backend: what ran, not what the node asked for. A layer that cannot run the requested backend runs
its fallback (``quant.backends.resolve``: fused_triton -> torch_int_mm -> dequant_bf16), and each
``Int8Linear`` names the one it runs in ``.backend``. A run reports
  backends           {backend: number of Int8Linear layers running it}, counted in the model the run's
                     first model call runs (object patches applied); before that call (or for a run
                     that fails before it), the count ``instrument`` took: the caller's
                     ``backends_used`` or, without it, the patcher's Int8Linear object patches and modules.
  backend            the backend that ran: the one most layers run (ties: the first name in alphabetical
                     order); "bf16" when the model has no Int8Linear layer (the float model ran).
  backend_requested  the backend the node asked for (``instrument``'s ``backend``).
Log line and widget show them as one label (``backend_label``; web/int8_format.js ``backendLabel``):
  "fused_triton"                                                   all layers ran what was asked
  "torch_int_mm (fallback from fused_triton)"                      all layers fell back
  "fused_triton (4 of 124 layers on torch_int_mm)"                 a mix: the majority, then the others
  "torch_int_mm (fallback from fused_triton; 1 of 4 layers on dequant_bf16)"
  "fused_triton (requested bf16)"                                  a bf16 node on an INT8 model upstream
The widget's side-by-side comparison groups runs by ``backend`` (what ran).

Attention: what ran, next to the GEMM backend. The Apply node's ``attention`` input routes ComfyUI's attention
calls through a ``quant.attention.Router`` (nodes/attention.py), which counts the calls per SDPA backend torch ran
(or "comfy_default" for calls it left to ComfyUI's function). Around each timed model call the difference of those
counts is added to the run:
  attentions           {backend: attention calls} (empty without a Router: ComfyUI's own attention ran)
  attention            the backend most calls ran (ties: alphabetical); "comfy_default" when there is none
  attention_requested  the node's ``attention`` input: ``instrument``'s ``attention``, else the ``mode`` of the
                       Router installed on the patcher when ``instrument`` runs, else "comfy_default"
Label (``attention_label``): "cudnn"; "flash (auto)"; "flash (requested cudnn)" (torch could not run cuDNN, or
a CPU); "cudnn (auto; 4 of 68 calls on flash)". Log line and widget badge add "attn <label>" unless both the
request and what ran are comfy_default: "fused_triton · attn cudnn · NVIDIA H200".

Status: "ok"; "interrupted" (ComfyUI's InterruptProcessingException, i.e. the cancel button, or a
KeyboardInterrupt); "error" for any other exception, with ``error`` = "<type>: <message>" (at most
ERROR_CHARS characters; None otherwise). The exception still propagates to ComfyUI.

WebSocket events (``PromptServer.instance.send_sync``, to every connected page):
  int8_fused.step     {run, group, node, backend, backend_requested, backends, attention,
                       attention_requested, attentions, device, step (0-based), steps, seconds, branches, calls}
  int8_fused.summary  {run, group, node, backend, backend_requested, backends, attention, attention_requested,
                       attentions, device, workload,
                       prompt_id, status ("ok" | "interrupted" | "error"), error, timer ("cuda_events" |
                       "perf_counter"), steps, step_seconds [..], mean, median, total,
                       branches {branch: seconds}, calls, started (unix time)}
  int8_fused.tuning   kernel.tuned.progress.snapshot() while kernels are tuned on a user's call (the widget's
                       "Tuning INT8 kernels for this GPU" line, then the session's summary and the shipped tables'
                       counts): sent by :class:`TuningRelay`, a progress listener, at most one per TUNING_INTERVAL_S
                       (the latest one held back follows when the interval has passed; a session's end at once).
                       A sampling's end ends the tuning session it ran (``progress.finish()``: its summary now
                       rather than QUIET_S later) and sends the shipped tables' counts when they changed.
HTTP: GET /int8_fused/runs -> {"runs": [summary, ...] (oldest first, at most RING_SIZE), "ring_size"}
      GET /int8_fused/tuning -> the tuning snapshot now (a page opened during or after a tuning)
"""
from __future__ import annotations

import collections
import itertools
import logging
import statistics
import sys
import threading
import time
import weakref

import torch

from ..kernel import deferred
from ..kernel.tuned import progress

log = logging.getLogger("int8_fused")

WRAPPER_KEY = "int8_fused.timing"
RING_SIZE = 64
ERROR_CHARS = 500
FLOAT = "bf16"  # the pack's name for the unquantized model (quant.backends.BACKENDS["bf16"])
COMFY_ATTENTION = "comfy_default"  # ComfyUI's own attention (quant.attention.COMFY)
_RUNS: collections.deque = collections.deque(maxlen=RING_SIZE)
_RUNS_LOCK = threading.Lock()
_RUN_IDS = itertools.count(1)


# --------------------------------------------------------------------------- messages
def _server():
    """ComfyUI's running PromptServer, or None in-process without a server. ComfyUI's main.py imports
    its ``server`` module before it loads custom nodes; importing it here would only add weight."""
    cls = getattr(sys.modules.get("server"), "PromptServer", None)
    return getattr(cls, "instance", None)


def _send(event: str, data: dict) -> None:
    srv = _server()
    if srv is None:
        return
    try:
        srv.send_sync(event, data)
    except Exception as e:  # a closed loop must never break sampling
        log.debug("int8_fused: could not send %s: %s", event, e)


TUNING_EVENT = "int8_fused.tuning"
TUNING_INTERVAL_S = 0.25


class TuningRelay:
    """A ``kernel.tuned.progress`` listener that sends its snapshots to the widget (``send(event, data)``;
    None: ``_send``). Runs on the thread that tunes; at most one event per ``interval`` seconds: a snapshot
    within the interval is held back (the latest one wins) and sent by a ``timer(delay, fn)`` thread when the
    interval has passed, its elapsed time brought up to then; a session's end (a new summary) goes at once."""

    def __init__(self, send=None, interval: float = TUNING_INTERVAL_S, clock=time.monotonic,
                 timer=threading.Timer):
        self.send, self.interval, self.clock, self.timer = send, interval, clock, timer
        self._lock = threading.Lock()
        self._sent_at: float | None = None
        self._sent: dict | None = None       # the last snapshot sent
        self._pending: tuple[dict, float] | None = None
        self._timer = None

    def __call__(self, snap: dict) -> None:
        with self._lock:
            now = self.clock()
            ended = self._sent is not None and snap.get("last_summary") != self._sent.get("last_summary")
            if ended or self._sent_at is None or now - self._sent_at >= self.interval:
                self._emit(snap, now)
                return
            self._pending = (snap, now)
            if self._timer is None:
                self._timer = self.timer(self._sent_at + self.interval - now, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Send the snapshot held back, if any (the timer's call)."""
        with self._lock:
            self._timer = None
            if self._pending is None:
                return
            snap, at = self._pending
            now = self.clock()
            if snap.get("current"):
                snap = {**snap, "current": {**snap["current"], "elapsed_s": snap["current"]["elapsed_s"] + now - at}}
            self._emit(snap, now)

    def settle(self, snap: dict) -> None:
        """Send ``snap`` now if it tells the widget more than the last one sent (a snapshot held back, a new
        summary, the shipped tables' counts); nothing otherwise."""
        with self._lock:
            last = self._sent or {}
            if self._pending is not None or any(snap.get(k) != last.get(k) for k in ("last_summary", "seeded")):
                self._emit(snap, self.clock())

    def _emit(self, snap: dict, now: float) -> None:
        self._pending, self._sent, self._sent_at = None, snap, now
        (self.send or _send)(TUNING_EVENT, snap)


TUNING_RELAY = TuningRelay()


def _register_tuning() -> None:
    """The widget's tuning listener, once per process (a reloaded module replaces its own)."""
    progress.PROGRESS.listeners[:] = [fn for fn in progress.PROGRESS.listeners
                                      if not getattr(fn, "int8_fused_widget", False)]
    TUNING_RELAY.int8_fused_widget = True
    progress.PROGRESS.listeners.append(TUNING_RELAY)


def end_tuning() -> None:
    """A sampling ended: the tuning session it ran ends now (its summary logged and sent), and the widget hears
    of shipped-table entries used without any tuning."""
    try:
        if progress.finish() is None:
            TUNING_RELAY.settle(progress.snapshot())
    except Exception as e:  # noqa: BLE001 - the widget's news must never fail a sampling
        log.debug("int8_fused: tuning summary failed: %s", e)


def recent_runs() -> list[dict]:
    """The summaries of the last ``RING_SIZE`` runs, oldest first."""
    with _RUNS_LOCK:
        return list(_RUNS)


def _register_routes() -> None:
    srv = _server()
    if srv is None or getattr(srv, "_int8_fused_routes", False):
        return
    from aiohttp import web

    @srv.routes.get("/int8_fused/runs")
    async def _runs(request):
        return web.json_response({"runs": recent_runs(), "ring_size": RING_SIZE})

    @srv.routes.get("/int8_fused/tuning")
    async def _tuning(request):
        return web.json_response(progress.snapshot())

    srv._int8_fused_routes = True


# --------------------------------------------------------------------------- timers
class _CpuTimer:
    kind = "perf_counter"

    def __init__(self):
        self.t0 = time.perf_counter()
        self.seconds = None

    def stop(self):
        self.seconds = time.perf_counter() - self.t0

    def ready(self) -> bool:
        return True

    def result(self, block: bool = False) -> float:
        return self.seconds


class _CudaTimer:
    """Two events on the current stream; elapsed time read only once the end event has completed. A timer whose
    end was never recorded (its model call raised) reads as 0 s instead of raising in the sampler's callback."""
    kind = "cuda_events"

    def __init__(self, device):
        self.stream = torch.cuda.current_stream(device)
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.stopped = False
        self.start.record(self.stream)

    def stop(self):
        self.end.record(self.stream)
        self.stopped = True

    def ready(self) -> bool:
        return not self.stopped or self.end.query()  # non-blocking; an unstopped end never completes

    def result(self, block: bool = False) -> float:
        if not self.stopped:
            return 0.0
        if block:
            self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000.0


# The timers run eagerly even inside a torch.compile'd region (ComfyUI's TorchCompileModel compiles the diffusion
# model with the wrappers around it): traced, a timer's events would be ones made at trace time, and the timer the
# step reads would never be recorded (on an H100 the first sample then failed in the step callback with "Both
# events must be recorded before calculating elapsed time"). A graph break at the model call's edges costs nothing.
@torch.compiler.disable
def _timer(device):
    if device is not None and device.type == "cuda":
        return _CudaTimer(device)
    return _CpuTimer()


@torch.compiler.disable
def _stop(timer) -> None:
    timer.stop()


def _branch(cond_or_uncond) -> str:
    """[0] -> "cond", [1] -> "uncond", [1, 0] -> "cond+uncond" (batched together)."""
    names = {0: "cond", 1: "uncond"}
    tags = sorted({names.get(int(c), str(c)) for c in (cond_or_uncond or [])})
    return "+".join(tags) if tags else "unknown"


# --------------------------------------------------------------------------- which backend ran
def _int8_linear_class():
    from ..quant.linear import Int8Linear
    return Int8Linear


def _int8_backends(model) -> dict[str, int]:
    """{backend: layer count} of the Int8Linear modules in ``model`` (an nn.Module) as it is now."""
    cls = _int8_linear_class()
    return dict(collections.Counter(m.backend for m in model.modules() if isinstance(m, cls)))


def _patcher_backends(model_patcher) -> dict[str, int]:
    """{backend: layer count} the patcher will run: its model's Int8Linear modules (the loader's), with
    the patcher's own object patches (Apply's) in place of the modules they replace. A module another
    clone has patched in at the moment is read from ComfyUI's backup of the original."""
    cls = _int8_linear_class()
    layers: dict[str, str] = {}
    model = getattr(model_patcher, "model", None)
    if isinstance(model, torch.nn.Module):
        backup = getattr(model_patcher, "object_patches_backup", None) or {}
        for name, m in model.named_modules():
            m = backup.get(name, m)
            if isinstance(m, cls):
                layers[name] = m.backend
    for name, obj in (getattr(model_patcher, "object_patches", None) or {}).items():
        if isinstance(obj, cls):
            layers[name] = obj.backend
        else:
            layers.pop(name, None)
    return dict(collections.Counter(layers.values()))


def ran_backend(backends: dict) -> str:
    """The backend most INT8 layers ran (ties: alphabetical); FLOAT when there is none."""
    if not backends:
        return FLOAT
    return min(backends.items(), key=lambda kv: (-kv[1], kv[0]))[0]


def backend_label(backend: str, requested: str | None, backends: dict) -> str:
    """"torch_int_mm (fallback from fused_triton; 1 of 4 layers on dequant_bf16)": see the module doc."""
    notes = []
    if requested and requested != backend:
        notes.append(f"requested {requested}" if requested == FLOAT else f"fallback from {requested}")
    n = sum(backends.values())
    for name, c in sorted(backends.items(), key=lambda kv: (-kv[1], kv[0])):
        if name != backend:
            notes.append(f"{c} of {n} layers on {name}")
    return f"{backend} ({'; '.join(notes)})" if notes else backend


def attention_label(attention: str, requested: str | None, attentions: dict) -> str:
    """"flash (requested cudnn)", "cudnn (auto; 4 of 68 calls on flash)": see the module doc."""
    notes = []
    if requested == "auto":
        notes.append("auto")
    elif requested and requested != attention:
        notes.append(f"requested {requested}")
    n = sum(attentions.values())
    for name, c in sorted(attentions.items(), key=lambda kv: (-kv[1], kv[0])):
        if name != attention:
            notes.append(f"{c} of {n} calls on {name}")
    return f"{attention} ({'; '.join(notes)})" if notes else attention


def _router(transformer_options):
    """The attention Router (quant.attention: an override with a Counter ``counts``) in these options, or None."""
    ov = transformer_options.get("optimized_attention_override") if isinstance(transformer_options, dict) else None
    return ov if isinstance(getattr(ov, "counts", None), collections.Counter) else None


def _attention_counts(transformer_options) -> dict | None:
    """A copy of the counts of the attention Router this model call runs with (None without one)."""
    router = _router(transformer_options)
    return None if router is None else dict(router.counts)


def _is_interrupt(e: BaseException) -> bool:
    """ComfyUI's cancel (InterruptProcessingException) or a KeyboardInterrupt-like BaseException."""
    mm = sys.modules.get("comfy.model_management")
    cls = getattr(mm, "InterruptProcessingException", None)
    return not isinstance(e, Exception) or (cls is not None and isinstance(e, cls))


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 1] + "\u2026"


def _dispatch_line(model_ref) -> str | None:
    """quant.dispatch.report_line of the run's model: its fused_triton linears' int8/float calls so far."""
    model = model_ref() if model_ref is not None else None
    if model is None:
        return None
    from ..quant import dispatch
    return dispatch.report_line(model)


# --------------------------------------------------------------------------- one sampling run
class Run:
    """Timers of one sampling run, grouped into steps; resolves them without blocking."""

    def __init__(self, *, node_id, backend, device, workload, steps_planned, prompt_id, backends=None,
                 attention=COMFY_ATTENTION):
        self.id = f"{node_id}-{next(_RUN_IDS)}"
        self.group = self.id  # the sampling it belongs to (the driving model's run id)
        self.node_id, self.requested, self.device = node_id, backend, device
        self.backends = dict(backends or {})  # {backend: INT8 layers}; recounted by see_layers
        self.layers_seen = False
        self.attention_requested = attention
        self.attentions: collections.Counter = collections.Counter()  # attention backend -> calls that ran it
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.workload, self.steps_planned, self.prompt_id = workload, steps_planned, prompt_id
        self.started = time.time()
        self.open: list[tuple[str, object]] = []        # (branch, timer) of the current step
        self.closed: list[list[tuple[str, object]]] = []  # finished steps, timers maybe unresolved
        self.resolved: list[dict] = []                  # {"seconds", "branches", "calls"} per step
        self.open_sigmas: list = []                     # sigma tensor of each open call (by identity)
        self.callbacks_seen = False
        self.after_last = False
        self.timer_kind = "cuda_events" if device.type == "cuda" else "perf_counter"

    @property
    def backend(self) -> str:
        return ran_backend(self.backends)

    @property
    def attention(self) -> str:
        if not self.attentions:
            return COMFY_ATTENTION
        return min(self.attentions.items(), key=lambda kv: (-kv[1], kv[0]))[0]

    def add_attention(self, before: dict | None, after: dict | None) -> None:
        """Count the attention calls one model call ran: the Router's counts ``after`` minus ``before``."""
        if before is None or after is None:
            return
        for name, c in after.items():
            if c - before.get(name, 0) > 0:
                self.attentions[name] += c - before.get(name, 0)

    def see_layers(self, model) -> None:
        """Count the INT8 layers of the model the run's first call runs (object patches applied)."""
        self.layers_seen = True
        if isinstance(model, torch.nn.Module):
            self.backends = _int8_backends(model)
            self.model_ref = weakref.ref(model)  # for the dispatch line at finish (quant/dispatch.py)

    @torch.compiler.disable  # eager inside a compiled region (see _timer)
    def call_started(self, branch: str, sigma, device):
        t = _timer(device)
        self.add_call(branch, sigma, t)
        return t

    def add_call(self, branch: str, sigma, timer) -> None:
        if self.after_last and not self.open and len(self.closed) > len(self.resolved):
            self.open = self.closed.pop()  # a call after the last callback joins the last step
        self.open.append((branch, timer))
        self.open_sigmas.append(sigma)

    def end_step(self, last: bool = False):
        """Close the open step; ``last``: it was the sampler's last callback, so keep it open to
        calls that may still come (resolved at ``finish``)."""
        if self.open:
            self.closed.append(self.open)
            self.open, self.open_sigmas = [], []
        self.after_last = self.after_last or last
        if not self.after_last:
            self.resolve(block=False)

    def resolve(self, block: bool):
        """Turn finished steps into seconds, in order, and announce each; stop at the first pending."""
        while len(self.resolved) < len(self.closed):
            timers = self.closed[len(self.resolved)]
            if not block and not all(t.ready() for _, t in timers):
                return
            branches: dict[str, float] = {}
            for br, t in timers:
                branches[br] = branches.get(br, 0.0) + t.result(block=block)
            step = {"seconds": sum(branches.values()), "branches": branches, "calls": len(timers)}
            self.resolved.append(step)
            _send("int8_fused.step", {**self._tags(), "step": len(self.resolved) - 1,
                                      "steps": self.steps_planned, **step})

    def finish(self, status: str, error: str | None = None) -> dict:
        if not self.callbacks_seen:  # a sampler that never called back: one step per sigma tensor
            groups, prev = [], object()
            for call, sigma in zip(self.open, self.open_sigmas):
                if not groups or sigma is not prev:
                    groups.append([])
                groups[-1].append(call)
                prev = sigma
            self.closed.extend(groups)
            self.open, self.open_sigmas = [], []
        if self.open:
            self.closed.append(self.open)
            self.open, self.open_sigmas = [], []
        self.resolve(block=True)
        secs = [s["seconds"] for s in self.resolved]
        branches: dict[str, float] = {}
        for s in self.resolved:
            for br, v in s["branches"].items():
                branches[br] = branches.get(br, 0.0) + v
        total = sum(secs)
        return {**self._tags(), "workload": self.workload, "prompt_id": self.prompt_id,
                "status": status, "error": error, "timer": self.timer_kind, "steps": len(secs),
                "step_seconds": secs, "mean": total / len(secs) if secs else None,
                "median": statistics.median(secs) if secs else None, "total": total,
                "branches": branches, "calls": sum(s["calls"] for s in self.resolved),
                "started": self.started, "dispatch": _dispatch_line(getattr(self, "model_ref", None))}

    def _tags(self) -> dict:
        return {"run": self.id, "group": self.group, "node": self.node_id, "backend": self.backend,
                "backend_requested": self.requested, "backends": dict(self.backends),
                "attention": self.attention, "attention_requested": self.attention_requested,
                "attentions": dict(self.attentions), "device": self.device_name}


# --------------------------------------------------------------------------- the wrappers
class _Sampling:
    """One sampling (one OUTER_SAMPLE): the driving MODEL's run and the runs of other instrumented
    MODELs it calls (DualModelGuider), which share its step boundaries."""

    def __init__(self, run: Run, meta: dict):
        self.run, self.meta, self.children = run, meta, {}

    def child(self, recorder) -> Run:
        run = self.children.get(id(recorder))
        if run is None:
            run = self.children[id(recorder)] = Run(node_id=recorder.node_id, backend=recorder.requested,
                                                    backends=recorder.backends, attention=recorder.attention,
                                                    **self.meta)
            run.group = self.run.id
        return run

    def runs(self) -> list:
        return [self.run, *self.children.values()]


_BY_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # BaseModel -> _Recorder
_ACTIVE: list[_Sampling] = []  # ComfyUI samples one prompt at a time; a stack for nested samplings
_TIMING = threading.local()  # .owner: the recorder timing the model call in progress on this thread

class _Recorder:
    """The wrappers of one instrumented MODEL (shared by its clones, which copy the wrapper lists)."""

    def __init__(self, node_id: str, backend: str, model=None, backends: dict | None = None,
                 attention: str = COMFY_ATTENTION):
        self.node_id, self.requested, self.attention = node_id, backend, attention
        self.backends = dict(backends or {})  # {backend: INT8 layers} counted by instrument()
        self.model = weakref.ref(model) if model is not None else (lambda: None)  # its BaseModel
        self.run: Run | None = None
        # per thread: MultiGPU CFG Split and the two-GPU guider run model calls on other devices' worker threads
        # at the same time as this thread's
        self._call = threading.local()
        self.inner_seen = False  # this architecture runs the DIFFUSION_MODEL wrapper

    @property
    def in_call(self):
        """(run, branch, sigma, device) of the APPLY_MODEL call in progress on this thread, or None."""
        return getattr(self._call, "in_call", None)

    @in_call.setter
    def in_call(self, value):
        self._call.in_call = value

    @property
    def inner_timed(self) -> bool:
        return getattr(self._call, "inner_timed", False)

    @inner_timed.setter
    def inner_timed(self, value: bool):
        self._call.inner_timed = value

    def outer_sample(self, executor, noise, latent_image, sampler, sigmas, denoise_mask=None,
                     callback=None, *args, **kwargs):
        guider = executor.class_obj
        patcher = getattr(guider, "model_patcher", None)
        device = torch.device(getattr(patcher, "load_device", None) or noise.device)
        model_name = type(getattr(patcher, "model", None)).__name__
        meta = dict(device=device, workload=f"{model_name} {'x'.join(str(d) for d in noise.shape)}",
                    steps_planned=max(int(sigmas.shape[-1]) - 1, 0), prompt_id=_prompt_id())
        run = Run(node_id=self.node_id, backend=self.requested, backends=self.backends, attention=self.attention,
                  **meta)
        ctx = _Sampling(run, meta)
        outer_run, self.run = self.run, run
        _ACTIVE.append(ctx)

        def step_callback(*cb_args, **cb_kwargs):
            last = _is_last_step(cb_args)
            for r in ctx.runs():
                r.callbacks_seen = True
                r.end_step(last=last)
            if callback is not None:
                return callback(*cb_args, **cb_kwargs)

        status, error = "interrupted", None
        try:
            with deferred.busy():  # background timing (kernel/deferred.py) waits while this sample runs
                out = executor(noise, latent_image, sampler, sigmas, denoise_mask, step_callback,
                               *args, **kwargs)
            status = "ok"
            return out
        except BaseException as e:
            if not _is_interrupt(e):
                status, error = "error", _error_text(e)
            raise
        finally:
            self.run = outer_run
            _ACTIVE.remove(ctx)
            for r in ctx.runs():
                try:
                    summary = r.finish(status, error)
                    with _RUNS_LOCK:
                        _RUNS.append(summary)
                    _send("int8_fused.summary", summary)
                    _log_summary(summary)
                except Exception as e:  # timing must never turn a finished sampling into an error
                    log.warning("int8_fused: timing summary failed: %s", e)
            end_tuning()

    def _current_run(self):
        """This MODEL's run: its own sampling, or, when another model's guider drives the sampling
        (DualModelGuider's second model), a run attached to that sampling."""
        if self.run is not None:
            return self.run
        if not _ACTIVE:
            return None
        return _ACTIVE[-1].child(self)

    def _owner(self, model) -> "_Recorder":
        """The recorder of the model a call runs: this one, or, when a guider runs another
        instrumented MODEL under this one's wrappers (ComfyUI's DualModelGuider runs the negative
        model with the positive model's options), that model's recorder."""
        if model is None or model is self.model():
            return self
        return _BY_MODEL.get(model) or self

    def apply_model(self, executor, x, t, c_concat=None, c_crossattn=None, control=None,
                    transformer_options={}, **kwargs):
        model = getattr(executor, "class_obj", None)
        run = self._owner(model)._current_run()
        if run is None or getattr(_TIMING, "owner", None) is not None:
            # Outside sampling (e.g. a calibration pass), or the call is already timed by the
            # wrapper of another instrumented MODEL around it: no second timer.
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
        if not run.layers_seen and model is not None:
            run.see_layers(model)
        branch = branch_on(_branch(transformer_options.get("cond_or_uncond")), x.device, run.device)
        sigma = transformer_options.get("sigmas")  # compared by identity: reading it could sync
        prev = self.in_call, self.inner_timed
        self.in_call, self.inner_timed = (run, branch, sigma, x.device), False
        _TIMING.owner = self
        attn_before = _attention_counts(transformer_options)
        try:
            # Timed here only for architectures without the DIFFUSION_MODEL wrapper.
            timer = None if self.inner_seen else _timer(x.device)
            out = executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
            if not self.inner_timed and timer is not None:
                _stop(timer)
                run.add_call(branch, sigma, timer)
            return out
        finally:
            run.add_attention(attn_before, _attention_counts(transformer_options))
            self.in_call, self.inner_timed = prev
            _TIMING.owner = None

    def diffusion_model(self, executor, *args, **kwargs):
        if self.in_call is None or self.inner_timed:
            return executor(*args, **kwargs)
        run, branch, sigma, device = self.in_call
        self.inner_timed = self.inner_seen = True
        timer = run.call_started(branch, sigma, device)
        try:
            return executor(*args, **kwargs)
        finally:
            _stop(timer)


def branch_on(branch: str, device, run_device) -> str:
    """The branch's name in the step's breakdown: as it is on the run's device, with ``@<device>`` on another (the
    clones of MultiGPU CFG Split, the two-GPU guider's negative model), so that the widget shows each device's time."""
    if device is None or run_device is None or torch.device(device) == torch.device(run_device):
        return branch
    return f"{branch}@{device}"


def _is_last_step(cb_args) -> bool:
    """KSAMPLER calls back with (step, denoised, x, total_steps)."""
    try:
        return int(cb_args[0]) >= int(cb_args[3]) - 1
    except (IndexError, TypeError, ValueError):
        return False


def _log_summary(s: dict) -> None:
    label = backend_label(s["backend"], s["backend_requested"], s["backends"])
    req = s.get("attention_requested") or COMFY_ATTENTION
    if req != COMFY_ATTENTION or s.get("attention", COMFY_ATTENTION) != COMFY_ATTENTION:
        label += f", attn {attention_label(s['attention'], req, s.get('attentions') or {})}"
    head = f"int8_fused: node {s['node']} ran {label} on {s['device']}"
    if s["status"] == "error":
        log.warning("%s: error after %d steps: %s", head, s["steps"], s["error"])
    elif s["status"] != "ok":
        log.info("%s: %s after %d steps", head, s["status"], s["steps"])
    elif s["steps"]:
        log.info("%s: %d steps, mean %.4g s/step, total %.4g s", head, s["steps"], s["mean"], s["total"])
    if s.get("dispatch"):
        log.info("%s: %s", head, s["dispatch"])


def _prompt_id():
    srv = _server()
    return getattr(srv, "last_prompt_id", None) if srv is not None else None


def instrument(model_patcher, *, node_id: str, backend: str, backends_used=None, attention: str | None = None) -> None:
    """Record per-step model-call times of ``model_patcher`` (a clone the caller owns) for the widget.

    ``backend``: the backend the node asked for (reported as ``backend_requested``). ``backends_used``:
    optional {backend: number of INT8 layers running it} as built, e.g. ``PatchReport.backends_used``;
    without it the patcher's Int8Linear object patches and modules are counted. Either way each run
    recounts the layers of the model it actually runs (module docstring, "Backend"). ``attention``: the node's
    attention choice (reported as ``attention_requested``; without it the ``mode`` of the attention Router the
    patcher carries, else "comfy_default"; module docstring, "Attention").
    Calling it again on the same patcher replaces the earlier timing wrappers (the latest node wins).
    """
    import comfy.patcher_extension as pe

    model = getattr(model_patcher, "model", None)
    used = ({str(k): int(v) for k, v in dict(backends_used).items() if v} if backends_used is not None
            else _patcher_backends(model_patcher))
    if attention is None:
        router = _router((getattr(model_patcher, "model_options", None) or {}).get("transformer_options"))
        attention = getattr(router, "mode", COMFY_ATTENTION)
    rec = _Recorder(str(node_id), str(backend), model, used, str(attention))
    if model is not None:
        _BY_MODEL[model] = rec  # clones share their BaseModel: the latest instrumented one owns it
    for kind, fn in ((pe.WrappersMP.OUTER_SAMPLE, rec.outer_sample),
                     (pe.WrappersMP.APPLY_MODEL, rec.apply_model),
                     (pe.WrappersMP.DIFFUSION_MODEL, rec.diffusion_model)):
        model_patcher.remove_wrappers_with_key(kind, WRAPPER_KEY)
        model_patcher.add_wrapper_with_key(kind, WRAPPER_KEY, fn)
    from ..quant import backends as _backends
    from . import compile_ahead   # inside the timing wrapper: the first step's time includes the dry run
    # the compile workers start now where the pack's kernels will run, so their start overlaps what runs before
    # the first sample (kernel/procs.py)
    compile_ahead.install(model_patcher, start_workers=any(getattr(_backends.BACKENDS.get(n), "feeds_fused", False)
                                                           for n in set(used) | {str(backend)}))


_register_routes()
_register_tuning()

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
