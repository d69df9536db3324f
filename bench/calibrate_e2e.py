"""INT8 Calibrate where users run it (issue 35 item 2): full-size Ideogram 4 and Flux.1 on the H200, ComfyUI 0.33.0
under DynamicVRAM.

Set-up as bench/e2e_sampler.py / bench/e2e_models.py: ComfyUI started as ``main.py`` does on NVIDIA (``cuda_malloc``,
comfy-aimdo ``init`` / ``init_devices``, ``CoreModelPatcher = ModelPatcherDynamic``); full-size backbones with
seeded random weights loaded through ``comfy.sd.load_diffusion_model_state_dict`` (the UNETLoader path). Every node
runs as ComfyUI's executor runs it: ``getattr(cls(), cls.FUNCTION)(**inputs)`` inside ``torch.inference_mode()``,
the inputs being the node's defaults from INPUT_TYPES (optional widgets too: the frontend sends every widget), the
linked inputs and the hidden UNIQUE_ID. The sampling rows run inside ``torch.inference_mode()`` too.

Per model (``--models ideogram4,flux``):
  calibrate   INT8 Calibrate on the float MODEL as the README tells users: Ideogram 4 one node per backbone, the
              unconditional one with ``image_tokens_only``; Flux.1 one node. Models unloaded first (a fresh queue,
              weights faulted in by the node). Wall time per node (and the node's own split: loading + sampling
              with the hooks, then the per-layer analysis); peak VRAM as ``torch.cuda.max_memory_allocated``
              (torch's allocator: activations, capture, analysis) and as device-wide use from ``mem_get_info``
              polled every 10 ms (DynamicVRAM's vbar, the weights, is outside torch's allocator); peak host RSS
              (polled; also the process's VmHWM); the calibrated backbones' resident weight size
              (ComfyUI's ``model_size``); ``fits_24gib`` = peak device-wide VRAM < 24 GiB.
  bf16        the float model(s) sampled: the reference final latent
  pack        Apply Fused INT8 GEMM (``fused_triton``, the node's defaults), no calibration: a warm-up run, then a
              timed run (s/step: whole ``sample()`` / steps, and the median step)
  pack+cal    the same with each backbone's calibration connected
  recheck     INT8 Calibrate of the first backbone again after pack+cal sampled (its INT8 clone was loaded last;
              clones share one module tree): must reproduce the first calibration
  core_int8   ComfyUI core ``int8_tensorwise`` file of the same layers (per-channel scales), sampled
  cap         (``--cap-gib``, CUDA) INT8 Calibrate of the first backbone with a filler allocation leaving a card of
              that many GiB: does it run on a 24 GiB card, how long, and does it give the same calibration
Sampling: Ideogram 4 DualModelGuider (cfg 4, ``negative`` unconnected), Flux.1 CFGGuider cfg 1 with FluxGuidance 3.5;
euler, ``simple``, ``--steps``; final latents compared with bf16's (relative L2, float64).

Random weights: full-size random-weight models have no real activation outlier channels, which is what
SmoothQuant is for; the errors here show the calibration runs and is applied correctly, not what it gains on
trained weights (the JSON says so).

Output: JSON {gpu, driver, torch, triton, commit, command, comfyui, dynamic_vram, note, summary: {model: {...}},
rows: [...], checks: [...]}, written after every row. ``--device cpu --tiny`` smoke-runs every code path on the CPU
apart from the CUDA set-up (legacy patcher, 1-layer Ideogram 4 at full width on ``torch_int_mm``, a shrunken
Flux.1 on ``fused_triton`` in the Triton interpreter); ``--save DIR`` also writes each model's final latents and
calibrations there (for tests/test_bench_calibrate_e2e.py). No timing claims on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # bench.lib; appended, so the pack's root (its nodes/) never shadows ComfyUI's modules
from bench.e2e_models import MODELS, ModelsBench  # noqa: E402  (imports neither torch nor ComfyUI at import time)
from bench.e2e_sampler import has_comfy, start  # noqa: E402
from bench.lib.e2e_runs import host_rss, logger, reset_peak_rss  # noqa: E402

log = logger("calib")

GIB = 2 ** 30
NOTE = ("Full-size models with random weights: their activations have no real outlier channels (what SmoothQuant "
        "is for), so the calibrated errors show that INT8 Calibrate runs and that Apply uses its output, not what it "
        "gains on trained weights. s_per_step_wall = whole sample() / steps.")


class Peaks:
    """Peaks over a block: device-wide VRAM in use (``mem_get_info``: total - free, polled every ``interval`` s on
    a thread, so DynamicVRAM's vbar counts), torch's allocator peak (``max_memory_allocated``) and host RSS
    (VmRSS polled, and VmHWM restarted at the start where Linux allows). ``result``: GiB figures, with the values
    before the block."""

    def __init__(self, torch, dev, interval: float = 0.01):
        self.torch, self.dev, self.interval = torch, dev, interval
        self.cuda = dev.type == "cuda"

    def _used(self) -> int:
        free, total = self.torch.cuda.mem_get_info(self.dev)
        return total - free

    def _sample(self):
        self.rss = max(self.rss, host_rss().get("host_rss_gib", 0.0))
        if self.cuda:
            self.vram = max(self.vram, self._used())

    def _poll(self):
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)
            try:  # torch's allocator statistics (cudaMallocAsync's pool watermarks under ComfyUI's cuda_malloc)
                self.torch.cuda.reset_peak_memory_stats(self.dev)
                self.stats = True
            except RuntimeError as e:
                log(f"torch allocator statistics unavailable: {e}")
                self.stats = False
            self.vram0 = self.vram = self._used()
            self.alloc0 = self.torch.cuda.memory_allocated(self.dev)
        r = host_rss()
        self.rss0 = self.rss = r.get("host_rss_gib", 0.0)
        self.hwm0 = r.get("host_rss_peak_gib", 0.0)
        self.hwm_reset = reset_peak_rss()  # VmHWM at the end is then the block's own peak, exactly
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)
        self._stop.set()
        self._t.join()
        self._sample()
        hwm = host_rss().get("host_rss_peak_gib", 0.0)
        peak = max(self.rss, hwm if self.hwm_reset else 0.0)
        r = {"host_rss_before_gib": self.rss0, "host_rss_peak_gib": peak,
             "host_vmhwm_process_gib": max(hwm, self.hwm0, peak), "host_vmhwm_reset": self.hwm_reset}
        if self.cuda:
            r.update(vram_used_before_gib=self.vram0 / GIB, vram_used_peak_gib=self.vram / GIB,
                     torch_allocated_before_gib=self.alloc0 / GIB if self.stats else None,
                     torch_max_allocated_gib=self.torch.cuda.max_memory_allocated(self.dev) / GIB if self.stats
                     else None)
        self.result = r


def cal_diff(a, b) -> dict:
    """How far calibration ``a`` is from ``b``: same layers, largest difference of a layer's errors, largest
    relative L2 difference of a smoothing vector."""
    from bench.lib.e2e import rel_l2
    same = list(a.layers) == list(b.layers)
    d_err, d_s = 0.0, 0.0
    for n, la in a.layers.items():
        lb = b.layers.get(n)
        if lb is None:
            continue
        d_err = max(d_err, abs(la.err_plain - lb.err_plain), abs(la.err_smoothed - lb.err_smoothed))
        if (la.smooth is None) != (lb.smooth is None):
            d_s = float("inf")
        elif la.smooth is not None:
            d_s = max(d_s, rel_l2(la.smooth, lb.smooth, f64=True))
    return {"same_layers": same, "max_err_diff": d_err, "max_smooth_rel_diff": d_s}


def parse_widgets(items: list[str]) -> dict:
    """``NAME=value`` strings (value as JSON, else the string) -> {NAME: value}."""
    out = {}
    for it in items:
        k, _, v = it.partition("=")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


class CalibrateBench(ModelsBench):

    def __init__(self, a, dynamic: bool, e2e):
        super().__init__(a, dynamic, e2e)
        import importlib
        self.mods = {m: importlib.import_module(f"{self.pack.__name__}.{m}") for m in ("quant.select", "adapters")}
        self.Calibrate = self.pack.NODE_CLASS_MAPPINGS["Int8Calibrate"]
        self.widgets = parse_widgets(a.calib_set)
        self.checks: list[dict] = []
        self.doc_extra = {"note": NOTE, "steps": a.steps, "tiny": a.tiny, "res": a.res,
                          "calibrate_widgets": self.widgets, "summary": {}, "checks": self.checks}
        self.save = Path(a.save) if a.save else None
        if self.save:
            self.save.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ inputs
    def inputs(self, name: str) -> dict:
        """Conditioning (one per backbone, as the workflow links it), latent and noise of ``name``."""
        torch, tiny, res = self.torch, self.a.tiny, self.a.res
        g = torch.Generator().manual_seed(7)
        if name == "ideogram4":
            ctx = torch.randn((1, 8, 53248) if tiny else (1, self.a.text_tokens, 53248), generator=g).to(torch.bfloat16)
            latent = torch.zeros((1, 128, 4, 4) if tiny else (1, 128, res // 16, res // 16))
            pos, extra = [[ctx, {}]], {}
        else:
            spec = MODELS["flux"][3](tiny)
            ctx = torch.randn(spec["text"], generator=g).to(torch.bfloat16)
            extra = {"pooled_output": torch.randn(spec["pooled"], generator=g).to(torch.bfloat16),
                     "guidance": spec["guidance"]}
            latent = torch.zeros(spec["latent"] if tiny else (1, 16, res // 8, res // 8))
            pos = [[ctx, dict(extra)]]
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(3))
        return {"ctx": ctx, "extra": extra, "positive": pos, "latent": latent, "noise": noise}

    def guider(self, name: str, models: list, inp: dict):
        """Ideogram 4: DualModelGuider (cfg 4, negative unconnected); Flux.1: CFGGuider cfg 1 (one pass a step)."""
        import comfy.samplers
        import comfy_extras.nodes_custom_sampler as ncs
        if name == "ideogram4":
            g = ncs.Guider_DualModel(models[0], models[1])
            g.set_conds([[inp["ctx"], {}]], [[None, {}]])
            g.set_cfg(4.0)
        else:
            g = comfy.samplers.CFGGuider(models[0])
            g.set_conds([[inp["ctx"], dict(inp["extra"])]], [[self.torch.zeros_like(inp["ctx"]), dict(inp["extra"])]])
            g.set_cfg(1.0)
        return g

    # ------------------------------------------------------------------ nodes
    def calibrate(self, name: str, models: list, inp: dict, label: str) -> tuple[list, dict]:
        """INT8 Calibrate on each backbone (Ideogram 4's unconditional one with image_tokens_only), timed and
        with memory peaks; returns (calibrations, row)."""
        cals, per = [], []
        row = {"model": name, "stage": label, "weights_gib": sum(m.model_size() for m in models) / GIB}
        for i, m in enumerate(models):
            widgets = dict(self.widgets, **({"image_tokens_only": True} if i == 1 else {}))
            links = {"model": m, "positive": inp["positive"], "latent_image": {"samples": inp["latent"]}}
            with Peaks(self.torch, self.dev) as pk:
                t0 = time.perf_counter()
                cal, text = self.e2e.run_node(self.Calibrate, links, widgets, unique_id=f"calibrate-{i}")
                wall = time.perf_counter() - t0
            cals.append(cal)
            per.append({"backbone": ["cond", "uncond"][i], "wall_s": wall, "layers": len(cal.layers),
                        "node_seconds": cal.meta.get("seconds"), "image_tokens_only": bool(i == 1),
                        "shared_smoothing_groups": len(cal.meta.get("shared_smoothing") or []),
                        "weights_gib": m.model_size() / GIB, "summary_head": text.splitlines()[:3], **pk.result})
            log(f"{name} {label} backbone {i}: {wall:.1f} s, {len(cal.layers)} layers; {text.splitlines()[0]}")
        row.update(wall_s=sum(p["wall_s"] for p in per), backbones=per)
        for k in per[0]:  # the memory figures over the node calls: the first's "before", the peaks' maximum
            if k.endswith("_before_gib"):
                row[k] = per[0][k]
            elif k.endswith("_gib") and k != "weights_gib" and all(p[k] is not None for p in per):
                row[k] = max(p[k] for p in per)
        if "vram_used_peak_gib" in row:
            row["fits_24gib"] = row["vram_used_peak_gib"] < 24.0
        return cals, row

    def apply(self, models: list, backend: str, cals: list | None) -> list:
        return [self.e2e.pack_apply(self.pack, m, backend, None if cals is None else cals[i], unique_id=f"apply-{i}")
                for i, m in enumerate(models)]

    def sampled(self, name: str, models: list, inp: dict, timed: bool) -> tuple[object, dict]:
        """The final latent of ``models`` sampled; ``timed``: after a warm-up run, with step times."""
        g = self.guider(name, models, inp)
        if not timed:
            t0 = time.perf_counter()
            out = self.sample(g, models[0], inp["latent"], inp["noise"], self.a.steps)
            return out.float().cpu(), {"sample_s": time.perf_counter() - t0}
        t0 = time.perf_counter()
        if self.dev.type == "cuda":  # autotune, DynamicVRAM faults; a CPU smoke run has neither
            self.sample(g, models[0], inp["latent"], inp["noise"], self.a.steps)
        warm = time.perf_counter() - t0
        out, s, s_wall, peak = self.timed(g, models[0], inp["latent"], inp["noise"])
        return out, {"warmup_s": warm, "s_per_step": s, "s_per_step_wall": s_wall, "peak_gib": peak}

    def fused_counts(self, models: list) -> dict:
        """{module type: count} of the pack's object patches (fused blocks, Int8Linear, ...) over ``models``."""
        c: dict = {}
        for m in models:
            for v in m.object_patches.values():
                c[type(v).__name__] = c.get(type(v).__name__, 0) + 1
        return c

    def core_int8_sd(self, sd: dict, names: list[str]) -> dict:
        """ComfyUI core ``int8_tensorwise`` layout of the linears ``names`` (bench/lib/e2e.py)."""
        keep = set(names)
        return self.e2e.core_int8_state_dict(sd, self.dev, lambda p, w: p in keep)

    # ------------------------------------------------------------------ rows
    def add(self, row: dict) -> dict:
        self.rows.append(row)
        log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                        if k not in ("backbones",)}))
        self.write()
        return row

    def check(self, name: str, what: str, ok, detail) -> None:
        self.checks.append({"model": name, "check": what, "pass": None if ok is None else bool(ok), "detail": detail})
        log(f"check {'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}: {name} {what}: {detail}")

    def step(self, name: str, stage: str, fn):
        """Run one stage; an exception is recorded as the stage's row (the run goes on) and returns None."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001  (a stage that cannot run is reported, not hidden)
            import traceback
            traceback.print_exc()
            self.add({"model": name, "stage": stage, "error": f"{type(e).__name__}: {e}"[:800]})
            return None

    def run_model(self, name: str):
        torch = self.torch
        t0 = time.perf_counter()
        backend = "fused_triton" if (self.smoke_path(name, "pack:fused_triton") or "").endswith("fused_triton") \
            else "torch_int_mm"
        sm: dict = {"backend": backend, "calibrate_widgets": self.widgets}
        self.doc_extra["summary"][name] = sm
        gen = self.dev if self.dev.type == "cuda" else torch.device("cpu")
        if name == "ideogram4":
            layers = MODELS[name][2]["layers"] if self.a.tiny else self.a.ideogram_layers
            sds = [self.e2e.random_state_dict(layers, gen, seed=s) for s in (0, 1)]
        else:
            sd, cls, cfg = self.make_sd(name)
            sds = [sd]
        inp = self.inputs(name)
        sm["params_per_backbone"] = sum(v.numel() for v in sds[0].values())
        log(f"{name}: {len(sds)} backbone(s), {sm['params_per_backbone'] / 1e9:.2f} B params each, state dicts in "
            f"{time.perf_counter() - t0:.1f} s; latent {list(inp['latent'].shape)}, text {list(inp['ctx'].shape)}")
        floats = [self.load_path("bf16", sd, label=f"{name} bf16") for sd in sds]
        sm.update(self.check_detection(name, floats[0], "Ideogram4" if name == "ideogram4" else cls,
                                       None if name == "ideogram4" else cfg))
        sm["patcher"] = type(floats[0]).__name__
        sm["weights_gib"] = sum(m.model_size() for m in floats) / GIB
        root = floats[0].model.diffusion_model
        sel = self.mods["quant.select"]
        names = [n for n, _ in sel.select_from(list(root.named_modules()), "blocks", "", "",
                                               self.mods["adapters"].block_rules(root))]
        lat: dict = {}

        # 1. INT8 Calibrate on a fresh queue (nothing loaded)
        self.cleanup()
        got = self.step(name, "calibrate", lambda: self.calibrate(name, floats, inp, "calibrate"))
        cals = None
        if got is not None:
            cals, row = got
            self.add(row)
            sm.update({k: row.get(k) for k in ("wall_s", "vram_used_before_gib", "vram_used_peak_gib",
                                               "torch_max_allocated_gib", "host_rss_before_gib", "host_rss_peak_gib",
                                               "host_vmhwm_process_gib", "fits_24gib")})
            sm["calibration_s"] = sm.pop("wall_s")
            sm["calibration_s_per_backbone"] = [p["wall_s"] for p in row["backbones"]]
            sm["calibration_node_seconds"] = [p["node_seconds"] for p in row["backbones"]]
            self.check(name, "calibrated every blocks-preset linear", all(list(c.layers) == names for c in cals),
                       f"{[len(c.layers) for c in cals]} layers of {len(names)}")
            if self.save:
                for i, c in enumerate(cals):
                    c.save(str(self.save / f"{name}-{['cond', 'uncond'][i]}.safetensors"), overwrite=True)

        # 2. bf16 reference
        def ref():
            with torch.inference_mode():
                out, info = self.sampled(name, floats, inp, timed=False)
            lat["bf16"] = out
            self.add({"model": name, "stage": "bf16", "finite": bool(torch.isfinite(out).all()), **info})
        self.step(name, "bf16", ref)

        # 3. / 4. the pack without and with the calibration
        for stage, use in (("pack", None), ("pack+cal", cals)):
            if stage == "pack+cal" and cals is None:
                continue

            def pack_row(stage=stage, use=use):
                t1 = time.perf_counter()
                packed = self.apply(floats, backend, use)
                build = time.perf_counter() - t1
                with torch.inference_mode():
                    out, info = self.sampled(name, packed, inp, timed=True)
                lat[stage] = out
                self.add({"model": name, "stage": stage, "backend": backend, "apply_s": build, **info,
                          "rel_l2_vs_bf16": self.e2e.rel_l2(out, lat["bf16"], f64=True) if "bf16" in lat else None,
                          "finite": bool(torch.isfinite(out).all()), "modules": self.fused_counts(packed),
                          "smoothed": [m.int8_report.smoothed for m in packed],
                          "kept_float": [len(m.int8_report.kept_float) for m in packed],
                          "apply_summary": packed[0].int8_report.summary(), "dispatch": self.dispatch_line(packed[0])})
                if stage == "pack+cal" and self.a.recheck:
                    # 5. Calibrate again while this INT8 clone is still loaded (clones share one module tree), as
                    # when a user changes a Calibrate widget and queues again
                    self.step(name, "recheck", lambda: self.recheck(name, floats, inp, cals[0]))
            self.step(name, stage, pack_row)
            self.cleanup()

        # 6. core INT8 of the same layers
        def core():
            cores = [self.load_path("core_int8", sd, core_sd=lambda sd=sd: self.core_int8_sd(sd, names),
                                    label=f"{name} core_int8") for sd in sds]
            with torch.inference_mode():
                out, info = self.sampled(name, cores, inp, timed=False)
            lat["core_int8"] = out
            self.add({"model": name, "stage": "core_int8", "layers_int8": len(names),
                      "rel_l2_vs_bf16": self.e2e.rel_l2(out, lat["bf16"], f64=True) if "bf16" in lat else None,
                      "finite": bool(torch.isfinite(out).all()), **info})
        self.step(name, "core_int8", core)
        self.cleanup()

        # 7. the first backbone calibrated on a card of --cap-gib GiB
        if cals is not None and self.a.cap_gib and self.dev.type == "cuda":
            self.step(name, "cap", lambda: self.capped(name, floats, inp, cals[0], sm))

        self.summarize(name, sm, lat)
        if self.save and lat:
            from safetensors.torch import save_file
            save_file({k.replace("+", "_"): v.contiguous() for k, v in lat.items()},
                      str(self.save / f"{name}-latents.safetensors"))
        del floats, sds
        self.cleanup()
        sm["total_s"] = time.perf_counter() - t0

    def recheck(self, name, floats, inp, first):
        (again,), row = self.calibrate(name, floats[:1], inp, "recheck")
        d = cal_diff(again, first)
        row.update(d)
        self.add(row)
        self.check(name, "recalibration with the calibrated INT8 clone loaded matches",
                   d["same_layers"] and d["max_err_diff"] <= 1e-3 and d["max_smooth_rel_diff"] <= 1e-3, d)

    def capped(self, name, floats, inp, first, sm):
        """INT8 Calibrate of the first backbone with a filler that leaves a card of ``--cap-gib`` GiB."""
        torch = self.torch
        self.cleanup()
        free, total = torch.cuda.mem_get_info(self.dev)
        room = int(self.a.cap_gib * GIB) - (total - free)  # what a card of that size has left beside this use
        if room <= 0:
            raise RuntimeError(f"{(total - free) / GIB:.1f} GiB in use after unloading: no room for a "
                               f"{self.a.cap_gib:g} GiB card")
        fill = max(0, free - room)
        filler = torch.empty(fill, dtype=torch.uint8, device=self.dev)
        log(f"{name}: filler {filler.numel() / GIB:.1f} GiB, a {self.a.cap_gib} GiB card")
        try:
            (again,), row = self.calibrate(name, floats[:1], inp, f"cap{self.a.cap_gib:g}")
        finally:
            del filler
            self.cleanup()
        d = cal_diff(again, first)
        # device-wide use without the filler: what the card of cap_gib held
        on_card = row["vram_used_peak_gib"] - fill / GIB
        row.update(cap_gib=self.a.cap_gib, filler_gib=fill / GIB, vram_used_peak_on_card_gib=on_card, **d)
        self.add(row)
        sm["capped"] = {"cap_gib": self.a.cap_gib, "wall_s": row["wall_s"], "filler_gib": fill / GIB,
                        "vram_used_peak_on_card_gib": on_card,
                        "torch_max_allocated_gib": row.get("torch_max_allocated_gib"), **d}
        sm["fits_24gib_capped"] = self.a.cap_gib <= 24 and d["same_layers"] and on_card <= self.a.cap_gib + 0.01
        self.check(name, f"calibration on a {self.a.cap_gib:g} GiB card matches",
                   d["same_layers"] and d["max_err_diff"] <= 1e-3, d)

    def summarize(self, name: str, sm: dict, lat: dict):
        rows = {r["stage"]: r for r in self.rows if r.get("model") == name and "stage" in r and "error" not in r}
        sm["rel_l2_vs_bf16"] = {k: rows[k].get("rel_l2_vs_bf16") for k in ("pack", "pack+cal", "core_int8")
                                if k in rows}
        sm["s_per_step_wall"] = {k: rows[k]["s_per_step_wall"] for k in ("pack", "pack+cal") if k in rows}
        sm["s_per_step"] = {k: rows[k]["s_per_step"] for k in ("pack", "pack+cal") if k in rows}
        sm["errors"] = {r["stage"]: r["error"] for r in self.rows if r.get("model") == name and "error" in r}
        if "pack" in rows and "pack+cal" in rows:
            p, c = rows["pack"], rows["pack+cal"]
            sm["cal_step_ratio"] = c["s_per_step_wall"] / p["s_per_step_wall"]
            fused = {k: v for k, v in p["modules"].items() if k.startswith("Fused")}
            self.check(name, "calibration keeps the fused modules", c["modules"] == p["modules"],
                       f"without {p['modules']}, with {c['modules']}" if fused or c["modules"] != p["modules"]
                       else f"no fused modules on {sm['backend']}: {p['modules']}")
            self.check(name, "calibrated pack no worse than 1.5x the uncalibrated error vs bf16",
                       c["rel_l2_vs_bf16"] is not None and c["rel_l2_vs_bf16"] <= 1.5 * p["rel_l2_vs_bf16"],
                       f"{c['rel_l2_vs_bf16']:.4g} vs {p['rel_l2_vs_bf16']:.4g}")
            if self.dev.type == "cuda":
                self.check(name, "step time with the calibration within 10 % of without", sm["cal_step_ratio"] <= 1.10,
                           f"{c['s_per_step_wall']:.4f} vs {p['s_per_step_wall']:.4f} s/step")

    def run(self) -> int:
        log(f"DynamicVRAM {'on' if self.dynamic else 'off'}; models {self.a.models}; {self.a.res}², "
            f"{self.a.steps} steps")
        t0 = time.perf_counter()
        for name in self.a.models.split(","):
            if name not in ("ideogram4", "flux"):
                self.add({"model": name, "error": "unknown model (ideogram4, flux)"})
                continue
            self.run_model(name)
        self.doc_extra["wall_s"] = time.perf_counter() - t0
        self.write()
        for name, sm in self.doc_extra["summary"].items():
            log(f"{name}: {json.dumps(sm, default=str)}")
        log(f"wrote {self.a.out} ({time.perf_counter() - t0:.0f} s)")
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", default=os.environ.get("COMFYUI_CURRENT"), help="ComfyUI 0.33.0 tree")
    ap.add_argument("--models", default="ideogram4,flux")
    ap.add_argument("--res", type=int, default=1024, help="image size (square) of calibration and sampling")
    ap.add_argument("--steps", type=int, default=6, help="sampling steps of the bf16 / pack / core rows")
    ap.add_argument("--text-tokens", type=int, default=512, help="Ideogram 4 text tokens")
    ap.add_argument("--ideogram-layers", type=int, default=34)
    ap.add_argument("--calib-set", action="append", default=[], metavar="NAME=VALUE",
                    help="an INT8 Calibrate widget other than its default (repeatable), e.g. steps=4")
    ap.add_argument("--no-recheck", dest="recheck", action="store_false",
                    help="skip calibrating again after the calibrated pack ran")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="CUDA: also calibrate the first backbone on a card "
                    "of this many GiB (a filler takes the rest); 0: skip")
    ap.add_argument("--save", default="", help="folder for each model's final latents and calibrations")
    ap.add_argument("--tiny", action="store_true", help="shrunken models (smoke runs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--comfy-flag", action="append", default=[], help="extra ComfyUI flag (repeatable)")
    ap.add_argument("--out", default=str(HERE / "results" / "h200-calibrate-e2e.json"))
    a = ap.parse_args()
    if not has_comfy(a):
        return 2
    dynamic = start(a)
    if dynamic is None:
        return 2
    import torch

    from bench.lib import e2e
    with torch.inference_mode():  # ComfyUI's executor runs every node inside it
        return CalibrateBench(a, dynamic, e2e).run()


if __name__ == "__main__":
    sys.exit(main())
