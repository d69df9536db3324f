"""The demo's full-size mode: the pack measured on your NVIDIA GPU (``bash scripts/demo.sh --full-size --arch flux``).

Builds the full-size model from random weights (no download) in the key layout ComfyUI detects, samples it through
ComfyUI's sampler with bf16, ``fp8_e4m3fn_fast``, core INT8 (``int8_tensorwise``) and the pack (``fused_triton``),
each in its own process, and prints the side-by-side table and a block to paste into an issue. The measuring is
bench/e2e_models.py's (``--isolate``: one process per path, whole-sample s/step, peak VRAM and host RAM per path);
this script states beforehand what the run needs, refuses when the machine has less, and reports.

The random weights are written once, one tensor at a time, to safetensors files in ``--model-dir`` (default
``output/full_size/models``: the bf16 model and its core INT8 file, kept for later runs), and every path loads its
file as UNETLoader loads a checkpoint (``bench/e2e_models.py --from-file``): host RAM as your ComfyUI would use it.

Requirements, from the parameter count P: bf16 weights 2P bytes, INT8 / fp8 weights P bytes; VRAM at least the
INT8 weights plus a working set (below that ComfyUI streams every path's weights each step and the table measures
the PCIe bus); host RAM 2P bytes plus the process (an upper estimate: ComfyUI holding the whole bf16 model in RAM;
the table reports each path's measured peak); disk for the model files not written yet (3P bytes) and the kernel
caches; minutes as an upper estimate for a card with 30 TFLOPS of bf16.

Which ComfyUI: ``--comfy PATH``, else ``$COMFYUI_CURRENT`` (the demo's runtime: 0.33.0 from ../shared/comfyui),
else the ComfyUI whose custom_nodes holds this clone. It needs ComfyUI 0.33.0 or newer (comfy/ldm/ideogram4,
comfy-aimdo, comfy-kitchen). Exit codes: 0 measured, 2 bad arguments or unsuitable ComfyUI, 3 this machine lacks
what the run needs (no CUDA GPU, too little VRAM / RAM / disk), 4 the bench failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import e2e_models  # noqa: E402  (no torch / ComfyUI at import)
from bench.lib import e2e_runs, provenance  # noqa: E402

GIB = 2 ** 30
EXIT_USAGE, EXIT_MACHINE, EXIT_BENCH = 2, 3, 4
PATHS = ("bf16", "fp8_fast", "core_int8", "pack:fused_triton")
LABELS = {"bf16": "bf16", "fp8_fast": "fp8_e4m3fn_fast", "core_int8": "core INT8", "pack:fused_triton": "pack"}
WORKING_SET_GIB = 3.0  # activations, CUDA context, ComfyUI's reserve: H200 peaks were the weights + 1.5 to 2.6 GiB
PROCESS_GIB = 3.0  # host RAM of a bench process besides its weights (torch, CUDA libraries, ComfyUI, the pack)
DISK_GIB = 1.0  # Triton's and the pack's kernel caches
TFLOPS_FLOOR = 30.0  # bf16 rate the minutes estimate assumes (a GeForce RTX 3090's, fp32 accumulation)
START_MIN = 0.5  # per path: process start, ComfyUI import
TUNE_MIN = 1.0  # the pack's first-use kernel tuning
HOST_COPY_BPS = 1e9  # model file read (and, once, written) per second
SAMPLES = 4  # per path: first sample, timed sample, two whole samples (bench/e2e_models.py)

# --arch -> (bench/e2e_models.py model, title, parameters (ComfyUI's layout), width, attention layers, patch area,
# text tokens joined to the image tokens in attention). Widths and depths are the bench's configs.
ARCHS = {
    "flux": ("flux", "Flux.1-dev", 11_901_408_320, e2e_models.FLUX["hidden_size"],
             e2e_models.FLUX["depth"] + e2e_models.FLUX["depth_single_blocks"], 4, True),
    "zimage": ("zimage", "Z-Image", 6_154_908_736, e2e_models.ZIMAGE["dim"], e2e_models.ZIMAGE["n_layers"], 4, True),
    "wan": ("wan13", "Wan 2.1 T2V 1.3B", 1_418_996_800, e2e_models.WAN13["dim"], e2e_models.WAN13["num_layers"], 4,
            False),
    "ideogram4": ("ideogram4", "Ideogram 4", 9_279_288_448, 4608, 34, 1, True),  # bench/lib/e2e.py: HIDDEN, 34 layers
}


def log(*a):
    print("[full-size]", *a, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="bash scripts/demo.sh --full-size", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full-size", action="store_true", help="this mode (demo.sh passes it on)")
    ap.add_argument("--arch", required=True, choices=list(ARCHS))
    ap.add_argument("--comfy", default=None, help="ComfyUI folder (0.33.0 or newer); default: the demo's runtime, "
                                                  "else the ComfyUI whose custom_nodes holds this clone")
    ap.add_argument("--steps", type=int, default=6, help="sampling steps per sample (default 6, the bench's)")
    ap.add_argument("--out", default=None, help="JSON of the run (default output/full_size/<arch>.json)")
    ap.add_argument("--model-dir", default=None,
                    help="folder of the random-weight model files, written once and reused (default "
                         "output/full_size/models; 3 bytes a parameter)")
    a = ap.parse_args(argv)
    if a.steps < 2:
        ap.error("--steps must be at least 2 (the median step needs two)")
    return a


def tokens(arch: str) -> int:
    """Tokens in the joint attention at the bench's inputs: latent tokens (patches) plus, where joined, text."""
    model, _, _, _, _, patch, joint = ARCHS[arch]
    spec = e2e_models.MODELS[model][3](False)
    return math.prod(spec["latent"][2:]) // patch + (spec["text"][1] if joint else 0)


def requirements(arch: str, steps: int = 6) -> dict:
    """What the run needs (GiB, minutes), from the parameter count (see the module doc)."""
    _, _, p, width, layers, _, _ = ARCHS[arch]
    n = tokens(arch)
    flops = 2 * p * n + 4 * n * n * width * layers  # linears + attention (QK^T and PV), one forward
    step_s = flops / (TFLOPS_FLOOR * 1e12)
    minutes = len(PATHS) * (START_MIN + 2 * p / HOST_COPY_BPS / 60) + TUNE_MIN \
        + len(PATHS) * SAMPLES * steps * step_s / 60 + 3 * p / HOST_COPY_BPS / 60
    return {"params": p, "bf16_gib": 2 * p / GIB, "int8_gib": p / GIB,
            "vram_gib": p / GIB + WORKING_SET_GIB, "vram_resident_gib": 2 * p / GIB + WORKING_SET_GIB,
            "ram_gib": 2 * p / GIB + PROCESS_GIB, "files_gib": 3 * p / GIB, "disk_gib": 3 * p / GIB + DISK_GIB,
            "minutes": minutes}


def needs_text(arch: str, r: dict) -> str:
    title = ARCHS[arch][1]
    return (f"{title} at full size: {r['params'] / 1e9:.2f} B parameters, random weights (nothing downloaded) "
            f"written once to model files and loaded as ComfyUI loads a checkpoint, sampled with "
            f"{', '.join(LABELS[p] for p in PATHS)}, one process each. It needs:\n"
            f"  VRAM   {r['vram_gib']:.1f} GiB free (INT8 / fp8 weights {r['int8_gib']:.1f} GiB + "
            f"{WORKING_SET_GIB:g} GiB working set); bf16 is resident from {r['vram_resident_gib']:.1f} GiB, below "
            f"that ComfyUI streams part of its {r['bf16_gib']:.1f} GiB each step, as in your workflows\n"
            f"  RAM    {r['ram_gib']:.1f} GiB available (at most the bf16 model as ComfyUI loads it + "
            f"{PROCESS_GIB:g} GiB process; the table gives each path's measured peak)\n"
            f"  disk   {r['disk_gib']:.1f} GiB free (the model files, {r['files_gib']:.1f} GiB, less what an earlier "
            f"run left in the model folder; {DISK_GIB:g} GiB of kernel caches)\n"
            f"  time   about {math.ceil(r['minutes'])} min at most (a card with {TFLOPS_FLOOR:g} TFLOPS of bf16; "
            f"faster cards take less)")


def no_gpu_message(arch: str) -> str:
    mini = " --arch flux" if arch == "flux" else ""
    return ("[full-size] refused: the full-size mode needs an NVIDIA GPU (CUDA, compute capability 8.0 or newer), "
            "and torch finds none on this machine.\n"
            f"[full-size] To see the pack run here, use the miniature demo: bash scripts/demo.sh{mini}")


def shortfalls(req: dict, have: dict) -> list[str]:
    """One line per resource the machine has less of than ``req``: what, how much it has, how much is missing."""
    out = []
    for key, what, where in (("vram_gib", "VRAM", f"{have.get('gpu', 'the GPU')} has"),
                             ("ram_gib", "host RAM", "this machine has"),
                             ("disk_gib", "disk", f"{have.get('disk_path', 'the output folder')} has")):
        got = have.get(key)
        if got is not None and got < req[key]:
            out.append(f"{what}: needs {req[key]:.1f} GiB free, {where} {got:.1f} GiB free: "
                       f"{req[key] - got:.1f} GiB short")
    return out


def comfy_version(comfy: Path) -> str:
    import re
    f = comfy / "comfyui_version.py"
    m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", f.read_text()) if f.exists() else None
    return m.group(1) if m else "(version unknown)"


def resolve_comfy(arg: str | None) -> Path | None:
    """``--comfy``, else $COMFYUI_CURRENT, else the ComfyUI whose custom_nodes holds this clone (its path as
    called, links kept), else None."""
    if arg:
        return Path(arg).expanduser().absolute()
    if os.environ.get("COMFYUI_CURRENT"):
        return Path(os.environ["COMFYUI_CURRENT"]).expanduser().absolute()
    here = Path(os.path.abspath(__file__)).parent.parent
    if here.parent.name == "custom_nodes" and (here.parent.parent / "main.py").exists():
        return here.parent.parent
    return None


PROBE = r"""
import importlib.util, json
out = {"missing": [m for m in ("comfy_aimdo", "comfy_kitchen") if importlib.util.find_spec(m) is None]}
try:
    import torch
    out.update(torch=torch.__version__, cuda_build=torch.version.cuda, cuda=torch.cuda.is_available())
    if out["cuda"]:
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        out.update(gpu=p.name, capability=[p.major, p.minor], vram_free_gib=free / 2**30, vram_total_gib=total / 2**30)
except Exception as e:
    out.update(cuda=False, error=f"{type(e).__name__}: {e}")
try:
    import triton
    out["triton"] = triton.__version__
except ImportError:
    out["triton"] = None
print(json.dumps(out))
"""


def probe() -> dict:
    """The GPU as torch in this Python sees it, in a process of its own (this one never initialises CUDA)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cp = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    try:
        return json.loads(cp.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"cuda": False, "error": (cp.stderr or cp.stdout)[-500:]}


def host_ram_gib() -> float | None:
    try:
        for ln in Path("/proc/meminfo").read_text().splitlines():
            if ln.startswith("MemAvailable:"):
                return int(ln.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


def disk_free(paths: list[Path]) -> tuple[float, str]:
    """(GiB free, folder) of the fullest file system among ``paths`` (each at its nearest existing folder)."""
    best = None
    for p in paths:
        while not p.exists():
            p = p.parent
        free = shutil.disk_usage(p).free / GIB
        if best is None or free < best[0]:
            best = (free, str(p))
    return best


def driver() -> str | None:
    try:
        cp = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                            capture_output=True, text=True, timeout=60)
        return cp.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def report(doc: dict, arch: str, steps: int, wall_s: float, machine: dict, root: Path = ROOT) -> tuple[str, str]:
    """(the side-by-side table, the block to paste into an issue) of a bench document. The pack is named by the
    commit the bench recorded, else by ``root``'s (the pack's folder) pyproject.toml version, which says so."""
    rows = {r["path"]: r for r in doc.get("rows", []) if "path" in r and "check" not in r}
    s = {p: e2e_runs.headline(rows.get(p)) if rows.get(p, {}).get("status") == "ok" else None for p in PATHS}
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    pack = s["pack:fused_triton"]
    lines = [f"{'path':<17} {'s/step':>8} {'pack is':>9} {'peak VRAM GiB':>14} {'peak RAM GiB':>13}  status"]
    for p in PATHS:
        r = rows.get(p, {})
        x = "" if p == "pack:fused_triton" or not (s[p] and pack) else f"{s[p] / pack:.2f}x"
        ram = r.get("host_rss_peak_row_gib") or r.get("host_rss_peak_gib")
        st = r.get("status", "missing")
        if r.get("error"):
            st += ": " + str(r["error"])[:80]
        lines.append(f"{LABELS[p]:<17} {f(s[p], 4):>8} {x:>9} {f(r.get('peak_gib'), 1):>14} {f(ram, 1):>13}  {st}")
    dt = {r.get("compute_dtype") for r in rows.values() if r.get("compute_dtype")}
    title = ARCHS[arch][1]
    what = doc.get("models", {}).get(ARCHS[arch][0], {}).get("inputs", "")
    head = (f"{title} full size ({ARCHS[arch][2] / 1e9:.2f} B params, random weights), {what}, {steps} steps, "
            f"ComfyUI's sampler (euler, simple, cfg 1.0); s/step = whole sample / steps; 'pack is' = that path's "
            f"s/step / the pack's" + (f"; compute dtype {', '.join(sorted(dt))}" if dt else ""))
    table = head + "\n" + "\n".join(lines)
    v = lambda k: doc.get(k) or machine.get(k)  # noqa: E731  (the bench's provenance, else the probe's)
    total = machine.get("vram_total_gib")
    ratios = " | ".join(f"{s[p] / pack:.2f}x {LABELS[p]}" for p in PATHS[:-1] if s[p] and pack) or "-"
    version = doc.get("commit") if doc.get("commit") not in (None, "", "?") else provenance.pack_version(root)
    block = "\n".join([
        "```text",
        f"comfyui-int8-fused full-size demo: --arch {arch} ({title}, {ARCHS[arch][2] / 1e9:.2f} B params, random "
        f"weights), {steps} steps",
        f"GPU: {v('gpu')}" + (f" ({total:.1f} GiB)" if total else "") + f", driver {v('driver')}, torch {v('torch')}, "
        f"Triton {v('triton')}, ComfyUI {v('comfyui')}, pack {version}",
        "s/step (whole sample): " + " | ".join(f"{LABELS[p]} {f(s[p], 4)}" for p in PATHS),
        f"pack speed-up: {ratios}",
        "peak VRAM GiB: " + " | ".join(f"{LABELS[p]} {f(rows.get(p, {}).get('peak_gib'), 1)}" for p in PATHS),
        f"whole run: {wall_s / 60:.1f} min",
        "```"])
    return table, block


def main(argv=None) -> int:
    t0 = time.monotonic()
    a = parse_args(argv)
    req = requirements(a.arch, a.steps)
    log(needs_text(a.arch, req))
    comfy = resolve_comfy(a.comfy)
    log((f"ComfyUI: {comfy} ({comfy_version(comfy)})" if comfy else "ComfyUI: none found")
        + f"; Python {sys.executable}")
    m = probe()
    if not m.get("cuda"):
        why = m.get("error") or (f"torch {m.get('torch')} is a CPU build" if m.get("torch") and not m.get("cuda_build")
                                 else f"torch {m.get('torch')}: torch.cuda.is_available() is False")
        log(f"no CUDA GPU: {why}")
        print(no_gpu_message(a.arch), flush=True)
        return EXIT_MACHINE
    cap = tuple(m["capability"])
    if cap < (8, 0):
        log(f"refused: {m['gpu']} has compute capability {cap[0]}.{cap[1]}; the pack's INT8 kernels need 8.0 or "
            f"newer")
        return EXIT_MACHINE
    if comfy is None or not (comfy / "comfy" / "ldm" / "ideogram4").is_dir():
        where = f"{comfy} (ComfyUI {comfy_version(comfy)})" if comfy else "no ComfyUI found"
        log(f"refused: needs ComfyUI 0.33.0 or newer (with comfy/ldm/ideogram4): {where}. Pass --comfy PATH, or "
            f"run it from a clone in ComfyUI/custom_nodes")
        return EXIT_USAGE
    if m.get("missing"):
        log(f"refused: {', '.join(m['missing'])} not importable by {sys.executable}: install ComfyUI's "
            f"requirements.txt with the Python that runs ComfyUI")
        return EXIT_USAGE
    out = Path(a.out or ROOT / "output" / "full_size" / f"{a.arch}.json").absolute()
    model_dir = Path(a.model_dir or ROOT / "output" / "full_size" / "models").absolute()
    written = sum(f.stat().st_size for f in model_dir.glob(f"{ARCHS[a.arch][0]}-full-*.safetensors")) \
        if model_dir.is_dir() else 0
    req = dict(req, disk_gib=max(req["files_gib"] - written / GIB, 0.0) + DISK_GIB)
    caches = [Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton"), out.parent, model_dir]
    disk, disk_path = disk_free(caches)
    have = {"gpu": m["gpu"], "vram_gib": m["vram_free_gib"], "ram_gib": host_ram_gib(), "disk_gib": disk,
            "disk_path": disk_path}
    short = shortfalls(req, have)
    if short:
        print("[full-size] refused: this machine has less than the run needs\n" +
              "\n".join(f"[full-size]   {s}" for s in short), flush=True)
        return EXIT_MACHINE
    machine = dict(m, driver=driver(), comfyui=comfy_version(comfy))
    log(f"{m['gpu']} ({m['vram_free_gib']:.1f} of {m['vram_total_gib']:.1f} GiB free), host RAM "
        f"{have['ram_gib'] or 0:.1f} GiB available: starting")
    out.parent.mkdir(parents=True, exist_ok=True)
    per_path_s = req["minutes"] * 60 / len(PATHS)
    cmd = [sys.executable, str(ROOT / "bench" / "e2e_models.py"), "--comfy", str(comfy), "--models",
           ARCHS[a.arch][0], "--paths", ",".join(PATHS), "--steps", str(a.steps), "--isolate",
           "--child-timeout", str(max(600, int(3 * per_path_s))), "--from-file", str(model_dir), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    rc = subprocess.run(cmd, env=env).returncode
    if rc != 0 or not out.exists():
        log(f"the bench failed (exit {rc}): {' '.join(cmd)}")
        return EXIT_BENCH
    table, block = report(json.loads(out.read_text()), a.arch, a.steps, time.monotonic() - t0, machine)
    print("\n" + table + "\n\nTo share it, paste this into an issue:\n" + block, flush=True)
    out.with_suffix(".md").write_text(table + "\n\n" + block + "\n")
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
