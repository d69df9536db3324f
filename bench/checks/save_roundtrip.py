"""Save INT8 Model round trip on full-size Ideogram 4 (issue 35, item 1), the way users run it.

    BENCH_COMMIT=<sha> bash bench/h200.sh exec python3 bench/checks/save_roundtrip.py --comfy .carry/comfy \\
        --out $OUT/h200-save-roundtrip.json
    python bench/checks/save_roundtrip.py --device cpu --layers 1 --res small --narrow  # CPU smoke
        (tests/test_bench_save_roundtrip.py)

ComfyUI 0.33.0 set up as its ``main.py`` does on an NVIDIA GPU (DynamicVRAM; ``bench/e2e_sampler.comfy_setup``), one
full-size Ideogram 4 backbone (34 layers, random bf16 weights, seed 0) loaded the UNETLoader way
(``comfy.sd.load_diffusion_model_state_dict``), then:

  bf16       the float model sampled (context only)
  apply      "Apply Fused INT8 GEMM" with its defaults on ``--backend``, sampled (``apply_sample``): the reference
  save       "Save INT8 Model" of the Apply output in both formats; per file the keys of the float state dict it
             lacks (``missing``; a pack-format int8 layer counts by its ``<layer>.qweight``), its size, the save time
  pack_file  the int8_fused file through "Load Ideogram 4.0 INT8" (same backend, node defaults), sampled
  core_file  the comfy_int8_tensorwise file through plain ComfyUI (``comfy.sd.load_diffusion_model``), sampled

Sampling: euler, ``simple`` schedule, ``CFGGuider`` cfg 3 with a zeroed negative, fixed noise. A failing stage records
its error and the run goes on. Checks (``pass``): every stage ok; no file misses a key; the final latent of the pack
file within ``--tol-pack`` rel L2 of Apply's (same int8 weights, same kernels), the core file's within ``--tol-core``
(core ComfyUI's INT8 on the same weights, smoothing folded). JSON with provenance to ``--out``; exit 1 when a check
fails. ``--device cpu`` runs the legacy patcher and backend torch_int_mm (fused_triton would run interpreted).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # bench.lib; appended, so the pack's root (its nodes/) never shadows ComfyUI's modules
from bench.e2e_sampler import has_comfy, start  # noqa: E402  (no torch / ComfyUI at import)
from bench.lib.e2e_runs import logger  # noqa: E402

FORMATS = ("int8_fused", "comfy_int8_tensorwise")
log = logger("save_roundtrip")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy", default=os.environ.get("COMFYUI_CURRENT"), help="ComfyUI 0.33.0 tree")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    ap.add_argument("--layers", type=int, default=34)
    ap.add_argument("--res", default="1024", help="image side in pixels, or 'small' (64)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--backend", default="", help="default: fused_triton on cuda, torch_int_mm on cpu")
    ap.add_argument("--tol-pack", type=float, default=1e-3, help="rel L2 bound: pack file vs Apply")
    ap.add_argument("--tol-core", type=float, default=0.10, help="rel L2 bound: core file in plain ComfyUI vs Apply")
    ap.add_argument("--narrow", action="store_true",
                    help="smoke runs: Ideogram 4 at narrow widths, ComfyUI's config with it (bench/lib/e2e.py narrow)")
    ap.add_argument("--workdir", default="", help="folder for the saved files (default: a temporary one, removed)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h200-save-roundtrip.json"))
    a = ap.parse_args(argv)
    a.res = 64 if a.res == "small" else int(a.res)
    a.backend = a.backend or ("torch_int_mm" if a.device == "cpu" else "fused_triton")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if not has_comfy(a):
        return 2
    dynamic = start(a)
    if dynamic is None:
        return 2
    work = Path(a.workdir or tempfile.mkdtemp(prefix="save_roundtrip_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return RoundTrip(a, dynamic, work).run()
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)


class RoundTrip:
    def __init__(self, a, dynamic: bool, work: Path):
        import folder_paths
        import comfy.model_management as mm
        from bench.lib import e2e
        folder_paths.add_model_folder_path("diffusion_models", str(work), is_default=True)
        self.a, self.dynamic, self.e2e, self.mm = a, dynamic, e2e, mm
        self.dev = mm.get_torch_device()
        self.pack = e2e.load_pack()
        self.widths = e2e.narrow() if a.narrow else None
        self.stages: dict = {}
        self.latents: dict = {}

    def sample(self, name: str, model) -> None:
        """Sample ``model`` (module doc) and keep its final latent under ``name``."""
        import torch
        import comfy.samplers
        g = torch.Generator().manual_seed(7)
        ctx = torch.randn(1, self.a.text_tokens, self.e2e.TEXT_DIM, generator=g).to(torch.bfloat16)
        latent = torch.zeros(1, self.e2e.IN_CH, self.a.res // 16, self.a.res // 16)
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(3))
        guider = comfy.samplers.CFGGuider(model)
        guider.set_conds([[ctx, {}]], [[torch.zeros_like(ctx), {}]])
        guider.set_cfg(3.0)
        sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "simple", self.a.steps)
        t0 = time.perf_counter()
        out = guider.sample(noise, latent, comfy.samplers.sampler_object("euler"), sigmas, disable_pbar=True, seed=3)
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        self.latents[name] = out.float().cpu()
        self.stages[name].update(sample_s=round(time.perf_counter() - t0, 2),
                                 finite=bool(torch.isfinite(self.latents[name]).all()))

    def stage(self, name: str, fn):
        """Run ``fn()`` as stage ``name``; an exception is recorded (type and message) and None returned."""
        st = self.stages[name] = {}
        t0 = time.perf_counter()
        log(f"{name} ...")
        try:
            out = fn()
            st["status"] = "ok"
            return out
        except Exception as e:  # noqa: BLE001 - the bench records what broke and goes on
            st.update(status="error", error=f"{type(e).__module__}.{type(e).__qualname__}: {e}"[:2000])
            return None
        finally:
            st["stage_s"] = round(time.perf_counter() - t0, 2)
            log(f"{name}: {json.dumps(st)[:600]}")

    def free(self) -> None:
        self.mm.unload_all_models()
        gc.collect()
        self.mm.soft_empty_cache()

    def save(self, applied, fmt: str) -> None:
        from safetensors import safe_open
        node = self.pack.NODE_CLASS_MAPPINGS["SaveInt8Model"]()
        (path,) = node.save(applied, f"roundtrip_{fmt}", fmt, True, "blocks")["result"]
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
        packed = {k[: -len(".qweight")] for k in keys if k.endswith(".qweight")} if fmt == "int8_fused" else set()
        missing = sorted(k for k in self.float_keys if k not in keys and k.rpartition(".")[0] not in packed)
        self.stages[f"save_{fmt}"].update(path=path, bytes=os.path.getsize(path), missing=missing)

    def run(self) -> int:
        import comfy.sd
        a = self.a
        sd = self.e2e.random_state_dict(a.layers, self.dev if self.dev.type == "cuda" else "cpu", seed=0)
        self.float_keys = sorted(sd)
        model = comfy.sd.load_diffusion_model_state_dict(sd, model_options={})
        del sd
        self.stage("bf16", lambda: self.sample("bf16", model))
        applied = self.stage("apply", lambda: self.e2e.pack_apply(self.pack, model, a.backend))
        if applied is not None:
            p = applied.object_patches
            cache = p.get("diffusion_model.llm_cond_proj")
            types = [type(m).__name__ for m in p.values()]
            self.stages["apply"].update(
                object_patches={t: types.count(t) for t in sorted(set(types))},
                llm_cond_proj_patch=None if cache is None else type(cache).__name__,
                llm_cond_proj_covers=None if cache is None else list(getattr(cache, "covers", ())))
            self.stage("apply_sample", lambda: self.sample("apply", applied))
            for fmt in FORMATS:
                self.stage(f"save_{fmt}", lambda fmt=fmt: self.save(applied, fmt))
        del applied, model
        self.free()
        for name, fmt, fn in (("pack_file", "int8_fused", self.load_pack_file),
                              ("core_file", "comfy_int8_tensorwise", self.load_core_file)):
            if self.stages.get(f"save_{fmt}", {}).get("status") == "ok":
                self.stage(name, fn)
                self.free()
        return self.finish()

    def load_pack_file(self) -> None:
        cls = self.pack.NODE_CLASS_MAPPINGS["LoadIdeogram4Int8"]
        cond, _ = cls().load("roundtrip_int8_fused.safetensors", self.a.backend, "none", "none")
        self.stages["pack_file"]["patcher"] = type(cond).__name__
        self.sample("pack_file", cond)

    def load_core_file(self) -> None:
        import comfy.sd
        m = comfy.sd.load_diffusion_model(self.stages["save_comfy_int8_tensorwise"]["path"])
        w = m.model.diffusion_model.llm_cond_proj.weight
        self.stages["core_file"].update(patcher=type(m).__name__,
                                        llm_cond_proj_weight=None if w is None else list(w.shape))
        self.sample("core_file", m)

    def finish(self) -> int:
        import comfyui_version
        a, lat = self.a, self.latents

        pairs = (("apply", "bf16"), ("pack_file", "apply"), ("core_file", "apply"), ("pack_file", "bf16"),
                 ("core_file", "bf16"))
        rels = {f"{x}_vs_{y}": self.e2e.rel_l2(lat[x], lat[y], f64=True) if x in lat and y in lat else None
                for x, y in pairs}
        missing = {fmt: self.stages.get(f"save_{fmt}", {}).get("missing") for fmt in FORMATS}
        within = lambda r, tol: r is not None and r <= tol  # noqa: E731
        checks = {
            "stages_ok": all(s.get("status") == "ok" for s in self.stages.values())
            and {"pack_file", "core_file"} <= set(self.stages),
            "no_missing_keys": all(m == [] for m in missing.values()),
            "pack_file_matches_apply": within(rels["pack_file_vs_apply"], a.tol_pack),
            "core_file_matches_apply": within(rels["core_file_vs_apply"], a.tol_core),
        }
        ok = all(checks.values())
        from bench.lib import provenance
        doc = dict(self.e2e.provenance(self.dev), dirty=provenance.dirty(), command=provenance.command(),
                   comfyui=comfyui_version.__version__, dynamic_vram=self.dynamic, layers=a.layers, res=a.res,
                   steps=a.steps, text_tokens=a.text_tokens, backend=a.backend, narrow_widths=self.widths,
                   tolerances={"pack": a.tol_pack, "core": a.tol_core}, rel_l2=rels, missing=missing,
                   stages=self.stages, checks=checks, **{"pass": ok})
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))
        log(f"rel L2 {json.dumps(rels)}; checks {json.dumps(checks)} -> {'PASS' if ok else 'FAIL'}; wrote {a.out}")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
