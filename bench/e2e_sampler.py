"""Ideogram 4 sampled the way users run it: ComfyUI's own sampler, ComfyUI's default GPU setup.

Sets ComfyUI 0.33.0 up as its ``main.py`` does on an NVIDIA GPU, before torch touches CUDA: ``cuda_malloc``
(cudaMallocAsync on CUDA 13 torch), comfy-aimdo ``control.init`` / ``init_devices`` and
``CoreModelPatcher = ModelPatcherDynamic`` (DynamicVRAM). Then, per path, builds two full-size Ideogram 4
backbones (34 layers, random weights; conditional seed 0, unconditional seed 1) through
``comfy.sd.load_diffusion_model_state_dict`` (the UNETLoader path, default patcher) and samples them with
ComfyUI's sampler code (euler, ``simple`` schedule) in Ideogram 4's workflow (``--workflows dual``, the only one):
``Guider_DualModel`` (DualModelGuider) with both backbones, cfg 4, ``negative`` unconnected (the unconditional
backbone runs image tokens only).

Paths: bf16 | fp8_fast (UNETLoader ``fp8_e4m3fn_fast``) | core_int8 (core ``int8_tensorwise`` file,
per-channel scales) | pack:<backend> (the bf16 backbones through "Apply Fused INT8 GEMM") |
core_int8+pack:<backend> (the core INT8 backbones through Apply: int8 weights adopted as stored).
A ``~<attention>`` suffix sets how attention runs: for pack paths the Apply node's ``attention`` input
(``auto`` / ``comfy_default`` / ``cudnn`` / ``flash`` / ``efficient`` / ``math`` / ``int8``; no suffix = the node's
default); for the others ``kitchen`` = core's ModelAttentionBackend "comfy kitchen attention" (comfy-kitchen INT8
attention), any other mode = the pack's attention router alone on the core model (e.g. ``fp8_fast~cudnn``);
``~user:<name>`` on any path = ComfyUI's registered attention function ``<name>`` set on the model first, as the
"Model Attention Backend" node sets it (e.g. ``bf16~user:sage``; ``pack:fused_triton~user:sage``: then Apply with
its default attention, which keeps the user's unless an exact backend is faster). ``~sage`` on a pack path: Apply's
``sage`` choice.
A final ``^inductor`` / ``^cudagraphs`` puts ComfyUI's TorchCompileModel node with that backend after the rest
(e.g. ``pack:fused_triton^cudagraphs``; the node turns DynamicVRAM off for its clone, reloading the model; the
compile lands in the first sample).

Per (path, resolution): a first sampling run (autotune, DynamicVRAM faulting; its time, synced before
and after, is ``first_sample_s``: for the path's first row the first sample of that path in this process), one
timed run (CUDA events in the step callback: s_per_step = median step; s_per_step_wall = that run / steps),
then two whole samples, synced before and after, without a step callback: ``s_per_step_whole`` = the best
one's time / steps (the headline figure: what a user waits for), ``model_calls_s`` = its model calls' time
(CUDA events around each ``apply_model``) and ``per_sample_tax_s`` = the rest (the sample's time outside model
calls). Also the final latent's relative L2 to bf16's, peak device memory in use (``mem_get_info``; DynamicVRAM's
vbar is not in torch's allocator; less what other processes hold) and the process's host RAM (VmRSS / VmHWM).
A row that fails says ``status`` "oom" or "error" (else "ok").

``--cold`` / ``--vram-gib N[,M]`` / ``--isolate``: each path in its own process (bench/lib/e2e_runs.py): ``--cold``
with new, empty autotune and Triton caches; ``--vram-gib`` with all but N GiB of the GPU held by another process
before ComfyUI starts (ComfyUI plans DynamicVRAM's offload for an N GiB card); rows say ``cold``, ``vram_gib``,
and their host RAM peak (``host_rss_peak_row_gib``: from the model's load on; a process of one path lets go of the
bench's state dicts once loaded).

Output: JSON {gpu, driver, torch, triton, commit, command, rows: [{resolution, workflow, path, patcher,
s_per_step, s_per_step_whole, peak_gib, rel_l2_vs_bf16, ...}]}. Needs a CUDA GPU with comfy-aimdo
and a ComfyUI 0.33.0 tree (--comfy). ``--device cpu`` smoke-runs the code path (legacy patcher,
tiny --layers/--res; no timing claims).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # bench.lib; appended, so the pack's root (its nodes/) never shadows ComfyUI's modules
from bench.lib import av_standin  # noqa: E402
from bench.lib.e2e_runs import logger  # noqa: E402  (no torch / ComfyUI at import)


log = logger("sampler")


def comfy_setup(comfy_dir: str, cpu: bool, comfy_flags: list[str]) -> bool:
    """ComfyUI's start-up as main.py does it on NVIDIA (see module doc). Returns whether DynamicVRAM is on."""
    sys.argv = ["main.py"] + (["--cpu"] if cpu else []) + comfy_flags
    sys.path.insert(0, comfy_dir)
    import comfy.options
    comfy.options.enable_args_parsing()
    from comfy.cli_args import args, enables_dynamic_vram
    if not cpu:
        import cuda_malloc  # noqa: F401  (main.py imports it under __main__: allocator env before CUDA)
    import comfy_aimdo.control
    if enables_dynamic_vram():
        headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024 ** 3)
        try:
            comfy_aimdo.control.init(simple_vram_headroom=headroom, nvml_pressure=not args.disable_nvml_pressure)
        except TypeError:
            comfy_aimdo.control.init(simple_vram_headroom=headroom)
    import comfy.model_management as mm
    import comfy.memory_management
    import comfy.model_patcher
    dynamic = False
    if enables_dynamic_vram() and mm.is_nvidia():
        ok = comfy_aimdo.control.init_devices((d.index, int(args.vram_headroom * 1024 ** 3))
                                              for d in mm.get_all_torch_devices())
        if ok:
            comfy_aimdo.control.set_log_warning()
            comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
            comfy.memory_management.aimdo_enabled = True
            dynamic = True
    import utils.extra_config  # noqa: F401  (main.py order, before nodes.py)
    av_standin.install_if_missing(log)  # comfy_api (TorchCompileModel, the guiders) imports PyAV: the device has none
    return dynamic


def has_comfy(a) -> bool:
    """Whether ``a.comfy`` is a ComfyUI tree with Ideogram 4 (0.33.0 or newer); says so when not."""
    if a.comfy and (Path(a.comfy) / "comfy" / "ldm" / "ideogram4").is_dir():
        return True
    print(f"{sys.argv[0]} needs a ComfyUI 0.33.0 tree (with comfy/ldm/ideogram4): --comfy or COMFYUI_CURRENT")
    return False


def start(a) -> bool | None:
    """``comfy_setup`` for ``a.device`` (with ``a.comfy_flag`` where the bench has it): whether DynamicVRAM is on,
    or None (said why) when a CUDA run finds no GPU."""
    script, cpu = sys.argv[0], a.device == "cpu"
    dynamic = comfy_setup(a.comfy, cpu, getattr(a, "comfy_flag", []))
    import torch
    if cpu or torch.cuda.is_available():
        return dynamic
    print(f"{script} needs a CUDA GPU (or --device cpu for a smoke run)")
    return None


def add_run_args(ap) -> None:
    """The flags bench/e2e_sampler.py and bench/e2e_models.py share: ComfyUI, device, ``--host-sample``, and
    ``--cold`` / ``--vram-gib`` / ``--isolate`` (bench/lib/e2e_runs.py) with the flags a child run gets."""
    ap.add_argument("--comfy", default=os.environ.get("COMFYUI_CURRENT"), help="ComfyUI 0.33.0 tree")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--comfy-flag", action="append", default=[], help="extra ComfyUI flag (repeatable)")
    ap.add_argument("--host-sample", default="", help="comma-separated paths: 4 steps with the host thread's stack "
                    "sampled every ms (bench/lib/stack_sample.py): where its wall time goes, without cProfile's slowdown")
    ap.add_argument("--tax-sample", default="", help="comma-separated paths: one whole sample with the host thread's "
                    "stack sampled, the samples inside apply_model set apart: where the per-sample tax goes")
    ap.add_argument("--cold", action="store_true", help="each path in its own process with new, empty autotune "
                    "(INT8_FUSED_CACHE_DIR) and Triton (TRITON_CACHE_DIR) caches: first_sample_s is a cold start")
    ap.add_argument("--vram-gib", default="", help="N[,M...]: each path in its own process with all but N GiB of "
                    "the GPU held by another process before ComfyUI starts (one round per size)")
    ap.add_argument("--isolate", action="store_true", help="each path in its own process (host RAM per path)")
    ap.add_argument("--child-timeout", type=float, default=600.0, help="seconds one child process may run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a child of an isolated run


def isolated(a) -> bool:
    """Whether this process is the parent of an isolated run (bench/lib/e2e_runs.py)."""
    return (a.cold or bool(a.vram_gib) or a.isolate) and not a.child


# rows compared with one another in the summary (x bf16, x fp8_fast): same workflow, resolution, card size, caches
SUMMARY_KEYS = ("workflow", "resolution", "vram_gib", "cold")


def summary(rows: list[dict]) -> None:
    """The summary table (bench/lib/e2e_runs.py: the whole-sample s/step first) and the target checks."""
    from bench.lib import e2e_runs
    e2e_runs.summary(rows, ("workflow", "resolution", "path"), SUMMARY_KEYS)
    e2e_runs.print_checks(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=34)
    ap.add_argument("--res", default="1024,768")
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--narrow", action="store_true", help="CPU smoke runs: Ideogram 4 at narrow widths, ComfyUI's "
                    "config with it (bench/lib/e2e.py narrow)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--workflows", default="dual", choices=["dual"], help="DualModelGuider (the only workflow)")
    ap.add_argument("--paths", default="bf16,fp8_fast,core_int8,pack:fused_triton,pack:comfy_kitchen,"
                                        "pack:torch_int_mm,pack:fp8_rowwise,pack:dequant_bf16,"
                                        "core_int8+pack:fused_triton")
    add_run_args(ap)
    ap.add_argument("--out", default=str(HERE / "results" / "h200-e2e-sampler.json"))
    a = ap.parse_args()
    if not has_comfy(a):
        return 2
    cpu = a.device == "cpu"
    if isolated(a):  # before torch is imported: each child starts with its own caches / free memory
        from bench.lib import e2e_runs
        units = [{"paths": p} for p in a.paths.split(",")]
        return e2e_runs.run_isolated(Path(__file__), sys.argv[1:], units, a.out, a.cold, a.vram_gib, a.device,
                                     a.child_timeout, table=summary,
                                     finish=lambda rows, doc: [] if cpu else e2e_runs.vram_targets(rows, SUMMARY_KEYS))
    dynamic = start(a)
    if dynamic is None:
        return 2
    from bench.lib import e2e  # Ideogram 4's layout, the pack's import and Apply node
    return SamplerBench(a, dynamic, e2e).run()


def _load_sd(sd: dict, opts: dict, disable_dynamic: bool = False):
    """``comfy.sd.load_diffusion_model_state_dict`` of a copy of ``sd`` (the loader pops its keys): the bench's
    UNETLoader, and how its models are loaded again (``cached_patcher_init``)."""
    import comfy.sd
    if isinstance(sd, (str, os.PathLike)):  # a model file (bench/e2e_models.py --from-file): UNETLoader's own call
        return comfy.sd.load_diffusion_model(str(sd), model_options=opts, disable_dynamic=disable_dynamic)
    if not sd:
        raise RuntimeError("the bench let go of this model's state dict (a one-path isolated run), so it cannot be "
                           "loaded again (a ^inductor / ^cudagraphs path needs that): run it with another path")
    return comfy.sd.load_diffusion_model_state_dict(dict(sd), model_options=opts, disable_dynamic=disable_dynamic)


class compile_log:
    """Triton's compiles during a block (``triton.knobs.compilation.listener``), to split a first sample into what it
    waited for: ``first_compiles`` {main: compiles on the sampling thread and their seconds (on the sample's path),
    pool: those in other threads (the pack's compile-ahead pool: waited for once per dry run), hits: cache hits
    (loaded from Triton's on-disk cache), slowest: the five longest on the sampling thread}; ``first_ahead``: the
    pack's compile-ahead dry runs in the block (kernels, launches, seconds each: ``kernel.ahead.HISTORY``)."""

    def __init__(self, pack=None):
        self.ahead = sys.modules.get(f"{pack.__name__}.kernel.ahead") if pack is not None else None

    def __enter__(self):
        import threading
        self.events, self.main = [], threading.get_ident()
        self.ahead0 = len(self.ahead.HISTORY) if self.ahead is not None else 0
        try:
            from triton import knobs
        except ImportError:
            self.knobs = None
            return self
        self.knobs, self.prev = knobs, knobs.compilation.listener

        def listen(*, src, metadata, metadata_group, times, cache_hit):
            self.events.append((threading.get_ident() == self.main, bool(cache_hit), times.total / 1e6,
                                str(getattr(src, "name", "?"))))
            if self.prev is not None:
                self.prev(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        knobs.compilation.listener = listen
        return self

    def __exit__(self, *exc):
        if self.knobs is not None:
            self.knobs.compilation.listener = self.prev
        return False

    def summary(self) -> dict:
        def agg(sel):
            ev = [e for e in self.events if sel(e)]
            return {"n": len(ev), "s": round(sum(e[2] for e in ev), 3)}
        main = sorted((e for e in self.events if e[0] and not e[1]), key=lambda e: -e[2])
        pool = sorted((e for e in self.events if not e[0] and not e[1]), key=lambda e: -e[2])
        out = {"first_compiles": {"main": agg(lambda e: e[0] and not e[1]), "pool": agg(lambda e: not e[0] and not e[1]),
                                  "hits": agg(lambda e: e[1]),
                                  "slowest": [[e[3], round(e[2], 3)] for e in main[:5]],
                                  "pool_all": [[e[3], round(e[2], 3)] for e in pool]}}
        if self.ahead is not None:
            out["first_ahead"] = list(self.ahead.HISTORY[self.ahead0:])
        return out


class SamplerBench:
    def __init__(self, a, dynamic: bool, e2e):
        import torch
        import comfy.model_management as mm
        self.a, self.dynamic, self.e2e, self.torch, self.mm = a, dynamic, e2e, torch, mm
        self.dev = mm.get_torch_device()
        if getattr(a, "narrow", False):
            e2e.narrow()
        from bench.lib import e2e_runs
        self.runs = e2e_runs
        self.others = e2e_runs.others_bytes()  # device memory another process holds (--vram-gib's holder)
        self.first_done: set = set()  # paths whose first sample in this process is recorded
        self.rows: list[dict] = []
        self.ref: dict = {}  # res -> bf16 final latent
        self.pack = e2e.load_pack()

    # ------------------------------------------------------------------ models
    def build(self, path: str, sds: dict) -> tuple[object, object, str]:
        """(conditional, unconditional) ModelPatchers for ``path``, and the patcher class name."""
        models = [self.load_path(path, sds[br], core_sd=lambda br=br: self.core_sd(br, sds[br]), label=f"{path} {br}")
                  for br in ("cond", "uncond")]
        return models[0], models[1], type(models[0]).__name__

    def load_path(self, path: str, sd: dict, core_sd=None, label: str = ""):
        """One ModelPatcher for ``path`` (grammar in the module doc) from the float state dict ``sd``, loaded the
        UNETLoader way (``comfy.sd.load_diffusion_model_state_dict``); ``core_sd()`` gives the core int8 state
        dict for core_int8 paths. Shared with bench/e2e_models.py."""
        torch = self.torch
        path, _, compiled = path.partition("^")
        base, _, attn = path.partition("~")
        kind, _, backend = base.partition("+") if base.startswith("core_int8+") else ("", "", base)
        src = "core_int8" if kind == "core_int8" else base.split(":")[0]
        if src == "core_int8":
            sd, opts = core_sd(), {}
        elif src == "fp8_fast":
            opts = {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True}
        else:
            opts = {}
        m = _load_sd(sd, opts)
        if m is None:
            raise RuntimeError(f"{path}: ComfyUI did not detect a model in the state dict")
        # what UNETLoader's load_diffusion_model records: how to load the model again (TorchCompileModel's clone
        # without DynamicVRAM reloads it through this)
        m.cached_patcher_init = (_load_sd, (sd, opts))
        pk = backend if kind == "core_int8" else (base if base.startswith("pack:") else "")
        if attn.startswith("user:"):  # the user's own attention, as the "Model Attention Backend" node sets it
            import comfy.ldm.modules.attention as cattn
            fn = cattn.get_attention_function(attn[len("user:"):], None)
            if fn is None:
                raise RuntimeError(f"{path}: ComfyUI has no attention function {attn[len('user:'):]!r} here "
                                   f"(sage needs the sageattention package)")
            m.set_model_optimized_attention(fn)
            attn = ""  # Apply (pack paths) then runs with its default attention
        if pk:
            t0 = time.perf_counter()
            extra = {"attention": attn} if attn else {}
            m = self.e2e.pack_apply(self.pack, m, pk.split(":", 1)[1], **extra)
            log(f"{label or path}: Apply took {time.perf_counter() - t0:.1f} s: "
                f"{getattr(m, 'int8_report', None) and m.int8_report.summary()}")
        elif attn == "kitchen":
            import comfy.ldm.modules.attention as cattn
            fn = cattn.get_attention_function("comfy_kitchen_int8", None)
            if fn is None:
                raise RuntimeError("comfy kitchen attention is not available in this ComfyUI")
            m.set_model_optimized_attention(fn)
        elif attn:
            import importlib
            importlib.import_module(self.pack.__name__ + ".nodes.attention").install(m, attn)
        if compiled:  # ComfyUI's TorchCompileModel node after everything else, as a user wires it
            import comfy_extras.nodes_torch_compile as ntc
            m = ntc.TorchCompileModel.execute(m, compiled).result[0]
        return m

    _core_cache: dict = {}
    doc_extra: dict = {}  # more top-level fields of the JSON document (bench/e2e_models.py)

    def core_sd(self, br, sd):
        if br not in self._core_cache:
            self._core_cache[br] = self.e2e.core_int8_state_dict(sd, self.dev)
        return self._core_cache[br]

    # ------------------------------------------------------------------ sampling
    def conds(self, res: int):
        torch = self.torch
        g = torch.Generator().manual_seed(7)
        ctx = torch.randn(1, self.a.text_tokens, self.e2e.TEXT_DIM, generator=g).to(torch.bfloat16)
        latent = torch.zeros(1, self.e2e.IN_CH, res // 16, res // 16)
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(3))
        return ctx, latent, noise

    def guider(self, cond, uncond, ctx):
        """Ideogram 4's DualModelGuider: both backbones, cfg 4, ``negative`` unconnected."""
        import comfy_extras.nodes_custom_sampler as ncs
        g = ncs.Guider_DualModel(cond, uncond)
        g.set_conds([[ctx, {}]], [[None, {}]])
        g.set_cfg(4.0)
        return g

    denoise_mask = None  # a subclass's sampling mask (bench/e2e_models.py: Wan 2.2 5B's kept start frame)

    def sample(self, guider, model, latent, noise, steps: int, callback=None):
        import comfy.samplers
        sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "simple", steps)
        return guider.sample(noise, latent, comfy.samplers.sampler_object("euler"), sigmas,
                             denoise_mask=self.denoise_mask, callback=callback, disable_pbar=True, seed=3)

    def timed(self, guider, model, latent, noise):
        torch, steps = self.torch, self.a.steps
        cuda = self.dev.type == "cuda"
        marks, used, host = [], [], []

        def cb(step, x0, x, total):
            if cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                host.append(time.perf_counter())
                marks.append(e)
                free, total_b = torch.cuda.mem_get_info(self.dev)
                used.append(total_b - free)
            else:
                marks.append(time.perf_counter())
        if cuda:
            torch.cuda.synchronize()
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
            h_ref = time.perf_counter()  # the GPU reaches ``ref`` about now: its queue is empty
        fetched0 = self._block_fetches()
        gc_spans, gc_start = [], [0.0]  # Python's cyclic collector: host time that grows with the objects kept

        def gc_cb(phase, info):
            if phase == "start":
                gc_start[0] = time.perf_counter()
            else:
                gc_spans.append((info["generation"], time.perf_counter() - gc_start[0]))
        gc.callbacks.append(gc_cb)
        t0 = time.perf_counter()
        try:
            out = self.sample(guider, model, latent, noise, steps, cb)
            if cuda:
                torch.cuda.synchronize()
        finally:
            gc.callbacks.remove(gc_cb)
        wall = time.perf_counter() - t0
        # the pack's one-fetch-per-block (nodes/comfy_cast.py): fused-block calls and modules fetched per step
        fetched = self._block_fetches()
        self.last = {"gc_s_per_step": sum(t for _, t in gc_spans) / steps,
                     "gc_full_collections": sum(g == 2 for g, _ in gc_spans),
                     "loaded_models": len(getattr(self.mm, "current_loaded_models", []) or []),
                     "block_fetches_per_step": round((fetched[0] - fetched0[0]) / steps, 1),
                     "block_fetch_modules_per_step": round((fetched[1] - fetched0[1]) / steps, 1)}
        if cuda:
            deltas = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
            # how far the GPU lags the host at each step's end (ms): about 0 when the host is what paces the
            # step (the GPU finishes what it was given and waits), large and growing when the GPU does
            lags = [(h_ref + ref.elapsed_time(e) / 1e3 - h) * 1e3 for e, h in zip(marks, host)]
            self.last.update(gpu_lag_ms_at_step_end=[round(v, 1) for v in lags],
                             host_s_per_step=statistics.median(b - a for a, b in zip(host, host[1:]))
                             if len(host) > 1 else None)
        else:
            deltas = [b - a for a, b in zip(marks, marks[1:])]
        if used:
            self.last["peak_device_used_gib"] = max(used) / 2 ** 30
        return out.float().cpu(), statistics.median(deltas) if deltas else wall / steps, wall / steps, \
            (max(0, max(used) - self.others) / 2 ** 30 if used else 0.0)

    def synced(self, fn):
        """(``fn()``, its wall time in s) with the device synchronised before and after."""
        cuda = self.dev.type == "cuda"
        if cuda:
            self.torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            self.torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    def first_sample(self, row: dict, key, guider, model, latent, noise, steps: int) -> None:
        """The row's first sampling run (autotune, compiles, DynamicVRAM's first load), synced: ``first_sample_s``;
        ``first_of_path`` when it is the first sample of ``key`` (a path, or (model, path)) in this process."""
        with compile_log(getattr(self, "pack", None)) as compiles:
            _, t = self.synced(lambda: self.sample(guider, model, latent, noise, steps))
        row.update(first_sample_s=t, first_sample_steps=steps, first_of_path=key not in self.first_done)
        row.update(compiles.summary())
        self.first_done.add(key)
        row.update(self.settle_background())

    def settle_background(self, timeout: float = 240.0) -> dict:
        """The idle time a user leaves between samples: waits until the pack's background timing
        (kernel/deferred.py) has run what the first sample queued, so that the warm rows run the timed configs.
        Returns ``background_wait_s`` (the wait, which no sample pays) and ``background_jobs`` (jobs finished so
        far in this process); nothing where the pack is not loaded or its tuning runs on the first call."""
        mod = sys.modules.get(f"{self.pack.__name__}.kernel.deferred") if getattr(self, "pack", None) else None
        if mod is None or mod.mode() != "background":
            return {}
        t0 = time.perf_counter()
        settled = mod.QUEUE.wait_settled(timeout)
        return {"background_wait_s": round(time.perf_counter() - t0, 3), "background_jobs": len(mod.QUEUE.done),
                "background_settled": settled}

    def whole(self, guider, model, latent, noise, reps: int = 2) -> dict:
        """``reps`` whole samples of --steps steps, each synced before and after, no step callback; of the best:
        ``s_per_step_whole`` (its time / steps), ``model_calls_s`` (its model calls' time: CUDA events around each
        ``apply_model``, an APPLY_MODEL wrapper on the guider's patcher, on the GPU's timeline; wall time on the
        CPU) and ``per_sample_tax_s`` (the rest: loading, conditioning, the sampler's work between calls)."""
        import comfy.patcher_extension as pe
        torch, steps, cuda = self.torch, self.a.steps, self.dev.type == "cuda"
        spans: list = []

        def timer(executor, *args, **kw):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = executor(*args, **kw)
                b.record()
                spans.append((a, b))
            else:
                t = time.perf_counter()
                out = executor(*args, **kw)
                spans.append(time.perf_counter() - t)
            return out
        key, patcher, runs = "int8_bench_call_timer", guider.model_patcher, []
        patcher.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, key, timer)
        try:
            for _ in range(reps):
                spans.clear()
                _, wall = self.synced(lambda: self.sample(guider, model, latent, noise, steps))
                calls = sum(a.elapsed_time(b) / 1e3 for a, b in spans) if cuda else sum(spans)
                runs.append((wall, calls, len(spans)))
        finally:
            patcher.remove_wrappers_with_key(pe.WrappersMP.APPLY_MODEL, key)
        wall, calls, n = min(runs)
        return {"s_per_step_whole": wall / steps, "whole_sample_s": [round(w, 4) for w, _, _ in runs],
                "model_calls_s": calls, "model_calls_per_sample": n, "per_sample_tax_s": wall - calls}

    last: dict = {}  # the last timed run's extra fields (block fetches, GPU lag, host time a step)

    def _block_fetches(self) -> tuple[int, int]:
        """(fused-block fetches, modules fetched) by the pack's ``comfy_cast.fetch_block`` in this process."""
        mod = sys.modules.get(f"{self.pack.__name__}.nodes.comfy_cast")
        st = mod.stats if mod is not None else {}
        return st.get("blocks", 0), st.get("modules", 0)

    def host_sampled(self, guider, model, latent, noise, steps: int = 4, top: int = 30) -> dict:
        """Steps 1..``steps`` of a run with this thread's Python stack sampled every ms (``bench/lib/stack_sample.py``):
        ms of wall time a step by innermost line (own, with the C calls it makes) and by function (cumulative)."""
        import threading

        from bench.lib.stack_sample import StackSampler
        torch = self.torch
        s = StackSampler(threading.get_ident())

        def cb(step, *_):
            if step == 0:
                torch.cuda.synchronize()
                s.__enter__()
        self.sample(guider, model, latent, noise, steps + 1, cb)
        torch.cuda.synchronize()
        s.__exit__(None, None, None)
        t = s.table(per=steps, top=top)
        return {"host_sample_wall_s_per_step": round(t["wall_s"] / steps, 4), "host_sample_n": t["samples"],
                "host_sample_own_ms_per_step": t["own"], "host_sample_cum_ms_per_step": t["cum"]}

    def tax_sampled(self, guider, model, latent, noise, top: int = 25) -> dict:
        """One whole sample (--steps steps) with this thread's stack sampled every ms, the samples inside
        ``apply_model`` (the model calls) set apart: ``tax_sample_ms`` the sample's wall ms outside them (the
        per-sample tax, as sampled), ``tax_sample_cum_ms`` / ``tax_sample_own_ms`` where that time went."""
        import threading

        from bench.lib.stack_sample import StackSampler
        self.torch.cuda.synchronize()
        with StackSampler(threading.get_ident(), set_apart="apply_model") as s:
            self.sample(guider, model, latent, noise, self.a.steps)
            self.torch.cuda.synchronize()
        t = s.table(per=1, top=top)
        return {"tax_sample_ms": t["rest_ms"], "tax_sample_model_ms": t["apart_ms"], "tax_sample_own_ms": t["own"],
                "tax_sample_cum_ms": t["cum"]}

    def gpu_busy(self, guider, model, latent, noise, steps: int = 4) -> dict:
        """A ``steps``-step sample traced with CUDA activity only (no host events or stacks: the host keeps its
        pace): ``gpu_busy_s_per_step``, the union of its kernels' and copies' spans on the GPU's timeline a step,
        the first step's share left out (its start waits for the host)."""
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            self.sample(guider, model, latent, noise, steps)
            self.torch.cuda.synchronize()
        trace = Path(self.a.out).with_suffix(".busy.json")
        prof.export_chrome_trace(str(trace))
        ev = json.loads(trace.read_text()).get("traceEvents", [])
        trace.unlink()
        return {"gpu_busy_s_per_step": gpu_busy_s(ev, steps)}

    def row_extras(self, row: dict, path: str, guider, model, latent, noise) -> None:
        """On a GPU: the row's GPU-busy time a step and what paces it (``paced_by``: "host" when the timed run's
        host time a step exceeds the GPU-busy time, else "gpu"); ``--host-sample``'s stack sampling."""
        if self.dev.type != "cuda":
            return
        row.update(self.gpu_busy(guider, model, latent, noise))
        busy, host = row["gpu_busy_s_per_step"], row.get("host_s_per_step")
        if busy is not None and host is not None:
            row["paced_by"] = "host" if host > busy else "gpu"
        if path in getattr(self.a, "tax_sample", "").split(","):
            row.update(self.tax_sampled(guider, model, latent, noise))
            log(f"    per-sample tax (stack samples): {row['tax_sample_ms']:.1f} ms outside apply_model "
                f"({row['tax_sample_model_ms']:.1f} inside); cumulative ms:")
            for where, ms in row["tax_sample_cum_ms"]:
                log(f"    cum {ms:8.2f} ms  {where}")
        if path in self.a.host_sample.split(","):
            row.update(self.host_sampled(guider, model, latent, noise))
            log(f"    host (stack samples, {row['host_sample_n']}) {row['host_sample_wall_s_per_step'] * 1e3:.1f} "
                "ms/step wall; ms a step:")
            for key in ("host_sample_own_ms_per_step", "host_sample_cum_ms_per_step"):
                for where, ms in row[key]:
                    log(f"    {key[12:15]} {ms:8.2f} ms  {where}")

    def dispatch_line(self, patcher) -> str | None:
        """The pack's per-shape dispatch summary of ``patcher``'s model (which linears ran int8 / float), or None
        for a model without fused_triton layers."""
        import importlib
        try:
            dispatch = importlib.import_module(self.pack.__name__ + ".quant.dispatch")
            return dispatch.report_line(patcher.model.diffusion_model)
        except Exception as e:  # noqa: BLE001  (a summary must not end the run)
            return f"unavailable: {type(e).__name__}: {e}"

    @staticmethod
    def attention_counts(patcher) -> dict | None:
        """Calls per attention backend that ran, from the pack's Router on ``patcher`` (None without one): what a
        row's attention actually was (e.g. whether ``sage`` ran), summed over every sample of the row."""
        opts = getattr(patcher, "model_options", {}).get("transformer_options", {})
        counts = getattr(opts.get("optimized_attention_override"), "counts", None)
        return None if counts is None else dict(counts)

    # ------------------------------------------------------------------ driver
    def sample_row(self, row: dict, key, g, model, latent, noise, first_steps: int, ref_key, sets_ref: bool,
                   extras: bool = True) -> None:
        """A row's measurements (module doc): the first sample (``first_steps`` steps; ``key`` as for
        ``first_sample``), the timed run, two whole samples, the relative L2 to the bf16 output kept under
        ``ref_key`` (kept from this row where ``sets_ref`` and none is), the pack's dispatch summary and
        ``row_extras`` where ``extras``. Shared with bench/e2e_models.py."""
        path, torch = row["path"], self.torch
        self.first_sample(row, key, g, model, latent, noise, first_steps)  # autotune, vbar faults
        out, s, s_wall, peak = self.timed(g, model, latent, noise)
        row.update(s_per_step=s, s_per_step_wall=s_wall, peak_gib=peak, finite=bool(torch.isfinite(out).all()),
                   **self.last)
        row.update(self.whole(g, model, latent, noise))
        if sets_ref:
            self.ref.setdefault(ref_key, out)
        ref = self.ref.get(ref_key)
        row["rel_l2_vs_bf16"] = None if ref is None else self.e2e.rel_l2(out, ref)
        if path.startswith("pack:"):
            row["dispatch"] = self.dispatch_line(model)
        counts = self.attention_counts(model)
        if counts is not None:
            row["attention_calls"] = counts
        if extras:
            self.row_extras(row, path, g, model, latent, noise)
        row["status"] = "ok"

    def row_failed(self, row: dict, e: Exception, prefix: str = "") -> None:
        """A row whose path cannot run: reported, not hidden (traceback printed, ``status`` and ``error``)."""
        import traceback
        traceback.print_exc()
        row.update(self.runs.error_fields(e, prefix))

    def finish_row(self, row: dict) -> None:
        """The row's host RAM; the row recorded, logged and written."""
        row.update(self.host_fields())
        self.rows.append(row)
        log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
        self.write()

    def measure(self, path: str, patcher: str, cond, uncond):
        for i, res in enumerate(int(r) for r in self.a.res.split(",")):
            ctx, latent, noise = self.conds(res)
            g = self.guider(cond, uncond, ctx)
            row = {"model": "ideogram4", "resolution": res, "workflow": "dual", "path": path, "patcher": patcher,
                   "params": self.params}
            try:
                self.sample_row(row, path, g, cond, latent, noise, self.a.steps, res, sets_ref=path == "bf16",
                                extras=i == 0)
            except Exception as e:
                self.row_failed(row, e)
            self.finish_row(row)

    def run(self) -> int:
        a, torch = self.a, self.torch
        gen = self.dev if self.dev.type == "cuda" else torch.device("cpu")
        sds = {"cond": self.e2e.random_state_dict(a.layers, gen, seed=0),
               "uncond": self.e2e.random_state_dict(a.layers, gen, seed=1)}
        self.params = sum(v.numel() for sd in sds.values() for v in sd.values())  # both backbones
        if a.child and all(p.split("~")[0] == "core_int8" for p in a.paths.split(",")):
            for br in ("cond", "uncond"):  # a core INT8 user loads the int8 files alone
                self.core_sd(br, sds[br])
                sds[br] = None
        log(f"DynamicVRAM {'on' if self.dynamic else 'off'}; state dicts built")
        for path in a.paths.split(","):
            log(f"building {path}")
            self.rss_mark()
            try:
                cond, uncond, patcher = self.build(path, sds)
                if a.child and len(a.paths.split(",")) == 1:
                    # a process of one path lets go of its state dicts: its host RAM is a user's ComfyUI's
                    for d in [*sds.values(), *self._core_cache.values()]:
                        if d is not None:
                            d.clear()
            except Exception as e:
                row = {"path": path}
                self.row_failed(row, e, "build: ")
                self.finish_row(row)
                cond = uncond = None
                self.cleanup()
                continue
            self.measure(path, patcher, cond, uncond)
            del cond, uncond
            self.cleanup()
        self.write()
        if not a.child:  # an isolated run's parent prints the summary of all its children
            summary(self.rows)
        log(f"wrote {a.out}")
        return 0

    proc_peak = 0.0  # the process's VmHWM before the last restart (rss_mark)

    def rss_mark(self) -> None:
        """Before a path's load: the host RSS now, and VmHWM restarted, so the row's host peak is the path's."""
        r = self.runs.host_rss()
        self.proc_peak = max(self.proc_peak, r.get("host_rss_peak_gib", 0.0))
        self.rss0 = r.get("host_rss_gib")
        self.rss_reset = self.runs.reset_peak_rss()

    def host_fields(self) -> dict:
        """Host RAM of this process (GiB): now, its peak, and (after ``rss_mark``) the peak since the mark
        (``host_rss_peak_row_gib``; None where the kernel does not restart VmHWM)."""
        r = self.runs.host_rss()
        since = r.get("host_rss_peak_gib")
        if since is not None:
            r["host_rss_peak_gib"] = max(since, self.proc_peak)
        if getattr(self, "rss0", None) is not None:
            r["host_rss_before_load_gib"] = self.rss0
            r["host_rss_peak_row_gib"] = since if self.rss_reset else None
        return r

    def cleanup(self):
        self.mm.unload_all_models()
        self.mm.soft_empty_cache()
        gc.collect()
        if self.dev.type == "cuda":
            self.torch.cuda.empty_cache()

    def write(self):
        import comfyui_version

        from bench.lib import provenance
        doc = dict(self.e2e.provenance(self.dev), comfyui=comfyui_version.__version__, dynamic_vram=self.dynamic,
                   command=provenance.command(), **self.doc_extra,
                   caches=self.runs.caches(self.pack), rows=self.rows)
        Path(self.a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(self.a.out).write_text(json.dumps(doc, indent=1))


def gpu_busy_s(ev: list, steps: int) -> float | None:
    """Seconds a step that the GPU was busy in a chrome trace of ``steps`` steps: the union of the spans of its
    kernels, copies and memsets in time order, without the first ``1 / steps`` of them; None for fewer events than steps."""
    gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                 key=lambda e: e["ts"])
    if steps < 2 or len(gpu) < steps:
        return None
    gpu = gpu[len(gpu) // steps:]
    busy, end = 0.0, float("-inf")
    for e in gpu:
        a, b = e["ts"], e["ts"] + e["dur"]
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy / 1e6 / (steps - 1)


if __name__ == "__main__":
    sys.exit(main())
