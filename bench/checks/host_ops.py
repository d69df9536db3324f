"""Host work of one model call and one sample on the Flux family (Chroma, Flux.1), counted on the CPU: a deterministic
proxy for host time, no timing.

    TRITON_INTERPRET=1 .runtime/venv-current/bin/python bench/checks/host_ops.py [--models chroma,flux]
        [--backends fused_triton,torch_int_mm,float] [--batch 1] [--steps 2] [--json out.json]

Per model (the width-128 miniatures of tests/test_chroma_fused.py and tests/test_flux_fused.py: Chroma 2 double + 2
single blocks, its modulation from the approximator; Flux.1 schnell-style 2 + 2; bf16) and path (the Apply node on
``fused_triton``, whose blocks are the fused ones, or ``torch_int_mm``, which fuses nothing: ComfyUI's blocks on
Int8Linear layers; ``float``: ComfyUI's own model, no Apply), through ComfyUI (``COMFYUI_CURRENT``, default
.runtime/ComfyUI-current) and its ModelPatcher on the CPU, attention by torch's SDPA as on a GPU:

* ``aten``: the aten ops dispatched (a ``TorchDispatchMode`` counter), ``py``: Python function calls and ``c``:
  built-in calls (a ``sys.setprofile`` counter; one pass each, so neither counter counts the other);
* ``launches``: Triton kernel launches. Under TRITON_INTERPRET=1 each launch runs the kernel in Triton's interpreter:
  everything inside a launch is left out of the counts (on a GPU it is the launcher's own C call), the launch itself
  is counted (two Python calls each: ``fn[grid]``'s lambda and the counting hook);
* per model call (``BaseModel.apply_model`` on a batch of ``--batch``, warm: after two calls, so prepared launches and
  caches are built), of which each block call (double / single: inclusive, from its module call; the counting
  wrapper's own call left out) and the rest (embedders, Chroma's approximator and modulation slicing, final layer,
  ComfyUI's glue);
* per sample: ComfyUI's ``CFGGuider.sample`` (euler, ``--steps`` steps, cfg 1.0: one model call a step), less its
  model calls (each ``apply_model``): what runs once per sample (the Apply node's OUTER_SAMPLE / SAMPLER_SAMPLE
  wrappers, ComfyUI's loading and sampler set-up) plus the sampler's work between calls; of it, the LoRA
  OUTER_SAMPLE wrapper's ``install_lora``.

The counts are of this machine's torch / ComfyUI / Triton. Op and call counts per block do not depend on the width
(a GEMM with few rows may take one launch instead of two); a model's counts scale with its number of blocks.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMFY = Path(os.environ.get("COMFYUI_CURRENT") or ROOT / ".runtime" / "ComfyUI-current")


def comfy_import():
    """ComfyUI (``COMFYUI_CURRENT``, default .runtime/ComfyUI-current) on the CPU, then the pack."""
    sys.path.insert(0, str(COMFY))
    import comfy.cli_args
    comfy.cli_args.args.cpu = True
    # torch's SDPA, as on the GPU (ComfyUI's CPU default is its sub-quadratic attention in torch ops)
    comfy.cli_args.args.use_pytorch_cross_attention = True
    import comfy.model_management  # noqa: F401
    import comfy.sd  # noqa: F401
    import utils.extra_config  # noqa: F401  (before nodes.py puts comfy/ first on sys.path, as main.py does)
    import nodes  # noqa: F401
    sys.path.insert(1, str(ROOT))
    sys.path.insert(2, str(ROOT / "tests"))
    import pack_import
    pack_import.install()
    return pack_import.import_pack()


# ----------------------------------------------------------------------------------------------- counters
class State:
    paused = 0
    aten: collections.Counter = collections.Counter()
    py = 0
    c = 0
    launches = 0

    @classmethod
    def snap(cls) -> tuple:
        return sum(cls.aten.values()), cls.py, cls.c, cls.launches, cls.aten.copy()


def _op_counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCount(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not State.paused:
                State.aten[func.__name__] += 1
            return func(*args, **(kwargs or {}))
    return OpCount()


def _profile(frame, event, arg):
    if State.paused:
        return
    if event == "call":
        State.py += 1
    elif event == "c_call":
        State.c += 1


@contextlib.contextmanager
def counting(kind: str):
    """``kind`` "aten": the dispatch counter; "py": the setprofile counter."""
    if kind == "aten":
        with _op_counter():
            yield
        return
    sys.setprofile(_profile)
    try:
        yield
    finally:
        sys.setprofile(None)


def hook_launches():
    """Count each interpreted Triton launch and leave its inside out of the counts."""
    from triton.runtime import interpreter
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        State.launches += 1
        State.paused += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            State.paused -= 1
    interpreter.InterpretedFunction.run = counted


SCOPES: dict = {}   # scope name -> list of (aten, py, c, launches, Counter) deltas


def scoped(cls, name: str) -> None:
    """Record each call of ``cls`` instances (from their module call) under ``name`` (a subclass of a recorded class
    is recorded once, by the inherited wrapper)."""
    orig = cls.__call__
    if getattr(orig, "host_ops_scope", None):
        return

    def call(self, *a, **k):
        s0 = State.snap()
        try:
            return orig(self, *a, **k)
        finally:
            s1 = State.snap()
            d = [s1[i] - s0[i] for i in range(4)]
            d[1] -= 1  # this wrapper's own frame is not the block's
            SCOPES.setdefault(name, []).append((*d, s1[4] - s0[4]))
    call.host_ops_scope = name
    cls.__call__ = call


def scoped_fn(module, attr: str, name: str) -> None:
    """Record each call of ``module.attr`` (a function its module calls by global name) under ``name``."""
    orig = getattr(module, attr)

    def call(*a, **k):
        s0 = State.snap()
        try:
            return orig(*a, **k)
        finally:
            s1 = State.snap()
            d = [s1[i] - s0[i] for i in range(4)]
            d[1] -= 1
            SCOPES.setdefault(name, []).append((*d, s1[4] - s0[4]))
    setattr(module, attr, call)


# ----------------------------------------------------------------------------------------------- models
def build(name: str, b: int = 1):
    """(ModelPatcher, apply_model kwargs for a batch of ``b``, positive conds) of the miniature ``name`` (bf16)."""
    import torch
    import comfy.model_patcher
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(1)
    if name == "chroma":
        import test_chroma_fused as tc
        model = tc.tiny_chroma(torch.bfloat16)
        ctx = torch.randn(b, 6, 64, generator=g)
        extra = {"guidance": torch.zeros(b)}
    else:
        import test_flux_fused as tf
        import comfy.model_detection
        import comfy_harness as H
        mini = H.miniature()
        sd = mini.tiny_state_dict("flux", 0, torch.bfloat16)
        cfg = dict(mini.TINY_UNET_CONFIG["flux"])
        cfg["txt_ids_dims"] = []
        mc = comfy.model_detection.model_config_from_unet_config(cfg, sd)
        mc.set_inference_dtype(torch.bfloat16, None)
        model = mc.get_model(sd, "", device=cpu)
        model.diffusion_model.load_state_dict(tf.tiny_flux(torch.bfloat16).state_dict())
        ctx = torch.randn(b, 6, 64, generator=g)
        extra = {"y": torch.randn(b, 64, generator=g)}
    x = torch.randn(b, 16, 8, 8, generator=g)
    kw = dict(x=x, t=torch.linspace(0.8, 0.4, b), c_crossattn=ctx, **extra)
    mp = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    pooled = {"pooled_output": extra["y"][:1]} if "y" in extra else {}
    return mp, kw, [[ctx[:1], pooled]]


def patched(pack, mp, path: str):
    if path == "float":
        return mp
    return pack.nodes.apply.ApplyFusedInt8GEMM().apply(mp, path)[0]


def per_call(m, kw, kind: str) -> dict:
    """Counts of one warm ``apply_model`` call (after two uncounted ones) and of its blocks."""
    import torch
    import comfy.model_management as mm
    mm.load_models_gpu([m])
    with torch.no_grad():
        for _ in range(2):
            m.model.apply_model(kw["x"], kw["t"], **{k: v for k, v in kw.items() if k not in ("x", "t")})
        SCOPES.clear()
        s0 = State.snap()
        with counting(kind):
            out = m.model.apply_model(kw["x"], kw["t"], **{k: v for k, v in kw.items() if k not in ("x", "t")})
        s1 = State.snap()
    del out
    return {"total": [s1[i] - s0[i] for i in range(4)], "ops": s1[4] - s0[4], "scopes": dict(SCOPES)}


def per_sample(m, pos, kind: str, steps: int) -> dict:
    """Counts of one ``CFGGuider.sample`` (after one uncounted) and of its model calls."""
    import torch
    import comfy.samplers
    import comfy.patcher_extension as pe
    guider = comfy.samplers.CFGGuider(m)
    guider.set_conds(pos, pos)
    guider.set_cfg(1.0)
    sigmas = comfy.samplers.calculate_sigmas(m.get_model_object("model_sampling"), "simple", steps)
    latent = torch.zeros(1, 16, 8, 8)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(3))
    calls = []

    def timer(executor, *a, **k):
        s0 = State.snap()
        try:
            return executor(*a, **k)
        finally:
            s1 = State.snap()
            calls.append([s1[i] - s0[i] for i in range(4)])

    def sample():
        return guider.sample(noise, latent, comfy.samplers.sampler_object("euler"), sigmas, disable_pbar=True,
                             seed=3)
    m.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, "host_ops", timer)
    try:
        sample()
        calls.clear()
        SCOPES.clear()
        s0 = State.snap()
        with counting(kind):
            sample()
        s1 = State.snap()
    finally:
        m.remove_wrappers_with_key(pe.WrappersMP.APPLY_MODEL, "host_ops")
    total = [s1[i] - s0[i] for i in range(4)]
    inside = [sum(c[i] for c in calls) for i in range(4)]
    # the timer wrapper's own frame (and its executor hop) are in the calls: not the model's, not the sampler's
    lora = SCOPES.get("install_lora", [])
    return {"total": total, "model_calls": len(calls), "outside_calls": [t - c for t, c in zip(total, inside)],
            "install_lora": [sum(r[i] for r in lora) for i in range(3)] if lora else [0, 0, 0]}


def summarize(scopes: dict) -> dict:
    """{scope: counts of its first call, how many calls, whether every call counted the same}."""
    out = {}
    for name, rows in scopes.items():
        first = rows[0]
        out[name] = {"calls": len(rows), "aten": first[0], "py_calls": first[1], "c_calls": first[2],
                     "launches": first[3], "same_each_call": all(r[:4] == first[:4] for r in rows),
                     "ops": dict(sorted(first[4].items(), key=lambda kv: (-kv[1], kv[0])))}
    return out


def measure(pack, m, kw, pos, steps: int) -> dict:
    row = {"call": {}, "sample": {"steps": steps}}
    for kind in ("aten", "py"):
        c = per_call(m, kw, kind)
        t, blocks = c["total"], summarize(c["scopes"])
        if kind == "aten":
            row["call"].update(aten=t[0], launches=t[3],
                               ops=dict(sorted(c["ops"].items(), key=lambda kv: (-kv[1], kv[0]))))
            row["blocks"] = blocks
            for k in ("aten", "launches"):  # what the call runs outside its blocks
                row["call"][f"{k}_outside_blocks"] = row["call"][k] - sum(b[k] * b["calls"] for b in blocks.values())
        else:
            row["call"].update(py_calls=t[1], c_calls=t[2])
            for k, v in blocks.items():
                row["blocks"][k].update(py_calls=v["py_calls"], c_calls=v["c_calls"])
        s = per_sample(m, pos, kind, steps)
        row["sample"]["model_calls"] = s["model_calls"]
        if kind == "aten":
            row["sample"].update(aten_outside_calls=s["outside_calls"][0],
                                 launches_outside_calls=s["outside_calls"][3], install_lora_aten=s["install_lora"][0])
        else:
            row["sample"].update(py_outside_calls=s["outside_calls"][1], c_outside_calls=s["outside_calls"][2],
                                 install_lora_py=s["install_lora"][1], install_lora_c=s["install_lora"][2])
    return row


def run(models, paths, steps: int, batch: int) -> dict:
    pack = comfy_import()
    hook_launches()
    import comfy.ldm.flux.layers as fl
    blocks = pack.adapters.flux.blocks
    ext = pack.adapters.flux.external_mod
    for cls, nm in ((fl.DoubleStreamBlock, "double"), (fl.SingleStreamBlock, "single"),
                    (blocks.FusedFluxDoubleBlock, "double"), (blocks.FusedFluxSingleBlock, "single"),
                    (ext.ExternalModDoubleBlock, "double"), (ext.ExternalModSingleBlock, "single")):
        scoped(cls, nm)
    scoped_fn(pack.nodes.apply, "install_lora", "install_lora")  # the LoRA OUTER_SAMPLE wrapper's work
    import comfy.model_management as mm
    res = {}
    for name in models:
        mp, kw, pos = build(name, batch)
        for path in paths:
            res[f"{name}/{path}"] = measure(pack, patched(pack, mp, path), kw, pos, steps)
            mm.unload_all_models()
    return res


def report(res: dict) -> None:
    print("per model call (apply_model, warm): aten ops / Python calls / built-in calls / Triton launches; each block "
          "call (inclusive); the rest of the call")
    print(f"{'model/path':22} {'aten':>5} {'py':>6} {'c':>6} {'lnch':>4} | {'double: aten':>12} {'py':>4} {'c':>5} "
          f"{'lnch':>4} | {'single: aten':>12} {'py':>4} {'c':>5} {'lnch':>4} | {'rest aten':>9}")
    for key, row in res.items():
        c, b = row["call"], row["blocks"]
        cells = []
        for blk in ("double", "single"):
            d = b.get(blk)
            cells.append(f"{d['aten']:12d} {d['py_calls']:4d} {d['c_calls']:5d} {d['launches']:4d}" if d
                         else f"{'-':>12} {'-':>4} {'-':>5} {'-':>4}")
        print(f"{key:22} {c['aten']:5d} {c['py_calls']:6d} {c['c_calls']:6d} {c['launches']:4d} | {cells[0]} | "
              f"{cells[1]} | {c['aten_outside_blocks']:9d}")
    print("\nper sample (CFGGuider.sample, less its model calls): aten ops / Python calls / built-in calls; of which "
          "the LoRA OUTER_SAMPLE wrapper's install_lora")
    print(f"{'model/path':22} {'calls':>5} {'aten':>6} {'py':>7} {'c':>7} | {'install_lora: aten':>18} {'py':>6} "
          f"{'c':>6}")
    for key, row in res.items():
        s = row["sample"]
        print(f"{key:22} {s['model_calls']:5d} {s['aten_outside_calls']:6d} {s['py_outside_calls']:7d} "
              f"{s['c_outside_calls']:7d} | {s['install_lora_aten']:18d} {s['install_lora_py']:6d} "
              f"{s['install_lora_c']:6d}")
    print("\naten ops of one block call:")
    for key, row in res.items():
        for blk, d in sorted(row["blocks"].items()):
            print(f"  {key} {blk}: {d['ops']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="chroma,flux")
    ap.add_argument("--backends", default="fused_triton,torch_int_mm,float",
                    help="Apply node backends, and float: ComfyUI's own model")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1, help="batch of the counted model calls (1: cfg 1.0, 2: CFG)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("run with TRITON_INTERPRET=1 (the kernels run in Triton's interpreter; their inside is not counted)")
        return 2
    res = run(a.models.split(","), a.backends.split(","), a.steps, a.batch)
    report(res)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
