"""The pack's demo: a miniature DiT sampled through a real ComfyUI with every INT8 backend this machine
can run, against the unquantized (bf16 control) run of the same seed.

Run through ``bash scripts/demo.sh`` (which builds the pinned runtime first). Steps:
 1. write the miniature model (scripts/miniature.py) into the runtime's models/diffusion_models;
 2. start the pinned ComfyUI (``main.py --cpu`` unless a GPU is there) with the pack in custom_nodes;
 3. convert example_workflows/int8_fused_miniature_demo.json (UI format) to API format with the
    server's /object_info and queue it once per backend offered by "Apply Fused INT8 GEMM" (bf16 first);
 4. save each output latent (ComfyUI's SaveLatent) and a PNG preview of it under output/;
 5. print per-step timing (the pack's GET /int8_fused/runs) and each backend's error against bf16,
    and which backends did not run on this machine, with the reason.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

# The Triton interpreter is for tests: with it, the fused kernel would "run" on the CPU, emulated in
# numpy at a crawl. The demo shows what this machine really runs.
os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import pack_import  # noqa: E402

pack_import.install()  # kernel, quant, adapters: the pack's subpackages, imported one way (tests/pack_import.py)

import torch  # noqa: E402

import comfy_harness as H  # noqa: E402
import workflow as W  # noqa: E402

WORKFLOW = ROOT / "example_workflows" / "int8_fused_miniature_demo.json"
APPLY = "ApplyFusedInt8GEMM"


def _wall_seconds(entry: dict) -> float | None:
    """execution_start -> execution_success of a prompt, from its /history status messages (ms)."""
    ts = {m[0]: m[1].get("timestamp") for m in entry.get("status", {}).get("messages", [])}
    if ts.get("execution_start") and ts.get("execution_success"):
        return (ts["execution_success"] - ts["execution_start"]) / 1000.0
    return None


def _latent(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file
    return load_file(str(path))["latent_tensor"].float()


def _png(latent: torch.Tensor, path: Path, scale: int = 32) -> None:
    """Preview: channels 0..2 of the first latent, each normalised to 0..255, nearest-upscaled."""
    from PIL import Image
    x = latent[0, :3]
    lo, hi = x.amin(dim=(1, 2), keepdim=True), x.amax(dim=(1, 2), keepdim=True)
    x = ((x - lo) / (hi - lo).clamp(min=1e-8) * 255).round().byte().permute(1, 2, 0).numpy()
    img = Image.fromarray(x, "RGB")
    img.resize((img.width * scale, img.height * scale), Image.NEAREST).save(path)


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _prepare(api: dict, arch: str, unet: str, steps: int | None, size: int | None) -> dict:
    mini = H.miniature()
    width, pooled = mini.CONDITIONING[arch]
    for nid in W.find_nodes(api, "UNETLoader"):
        api[nid]["inputs"]["unet_name"] = unet
    for nid in W.find_nodes(api, "Int8TestConditioning"):
        api[nid]["inputs"].update(width=width, pooled_width=pooled)
    for nid in W.find_nodes(api, "KSampler"):
        if steps:
            api[nid]["inputs"]["steps"] = steps
    for nid in W.find_nodes(api, "EmptyLatentImage"):
        if size:
            api[nid]["inputs"].update(width=size, height=size)
    return api


def _without_apply(api: dict) -> dict:
    """The workflow with the Apply node removed (its consumers take its model input directly)."""
    api = copy.deepcopy(api)
    for nid in W.find_nodes(api, APPLY):
        src = api[nid]["inputs"]["model"]
        del api[nid]
        for n in api.values():
            for k, v in n["inputs"].items():
                if isinstance(v, list) and len(v) == 2 and v[0] == nid:
                    n["inputs"][k] = src
    return api


def _runs_by_prompt(server) -> dict[str, dict] | None:
    try:
        runs = server.get_json("/int8_fused/runs").get("runs", [])
    except Exception:
        return None
    return {r.get("prompt_id"): r for r in runs if r.get("prompt_id")}


def _comfy() -> tuple[Path, str | None]:
    """The ComfyUI the demo runs: the current one (0.33.0 from ../shared/comfyui, as scripts/demo.sh sets
    COMFYUI_CURRENT) when there, else the pinned 0.3.75; and the Python that runs it."""
    cur, _ = H.current_comfy_dir()
    if cur is not None and (cur / "custom_nodes" / "comfyui-int8-fused").exists():
        return cur, os.environ.get("COMFYUI_CURRENT_PYTHON") or None
    return H.COMFY_DIR, None


def _version(comfy_dir: Path) -> str:
    import full_size
    return full_size.comfy_version(comfy_dir)


def main() -> int:
    if "--full-size" in sys.argv[1:]:  # the full-size model on this machine's GPU: scripts/full_size.py
        import full_size
        return full_size.main(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="lumina2", choices=["lumina2", "flux"])
    ap.add_argument("--steps", type=int, default=None, help="sampling steps (default: the workflow's)")
    ap.add_argument("--size", type=int, default=None, help="image size in pixels (default: the workflow's)")
    ap.add_argument("--backends", default="", help="comma-separated subset of backends (default: all offered)")
    ap.add_argument("--workflow", default=str(WORKFLOW))
    ap.add_argument("--out", default=str(ROOT / "output"))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per prompt")
    a = ap.parse_args()

    out = Path(a.out)
    previews = out / "int8_fused_demo"
    previews.mkdir(parents=True, exist_ok=True)
    dev = _device()
    t0 = time.monotonic()
    print(f"[demo] writing the {a.arch} miniature (random weights, real layout) ...", flush=True)
    comfy_dir, python = _comfy()
    unet = H.write_miniature_models(comfy_dir, [a.arch])[a.arch]
    server = H.ComfyServer(comfy_dir, output_dir=out / "comfy", cpu=dev.type != "cuda", python=python)
    print(f"[demo] starting ComfyUI {_version(comfy_dir)} ({dev.type.upper()}) on {server.url} ...", flush=True)
    with server:
        info = server.object_info()
        ui = json.loads(Path(a.workflow).read_text())
        api = W.ui_to_api(ui, info)
        api = _prepare(api, a.arch, unet, a.steps, a.size)
        if APPLY in info:
            offered = list(info[APPLY]["input"]["required"]["backend"][0])
        else:
            print("[demo] the 'Apply Fused INT8 GEMM' node is not installed yet: running the float model only")
            offered = ["bf16"]
            api = _without_apply(api)
        order = ["bf16"] + [b for b in offered if b != "bf16"]
        if a.backends:
            keep = {b.strip() for b in a.backends.split(",") if b.strip()}
            unknown = keep - set(order)
            if unknown:
                print(f"[demo] not offered on this machine: {', '.join(sorted(unknown))}; offered: {', '.join(order)}")
                return 2
            order = [b for b in order if b in keep or b == "bf16"]
        results = {}
        for b in order:
            run = copy.deepcopy(api)
            for nid in W.find_nodes(run, APPLY):
                run[nid]["inputs"]["backend"] = b
            for nid in W.find_nodes(run, "SaveLatent"):
                run[nid]["inputs"]["filename_prefix"] = f"int8_fused_demo/{a.arch}_{b}"
            print(f"[demo] sampling with backend {b} ...", flush=True)
            t = time.monotonic()
            pid = server.queue(run)
            entry = server.wait(pid, timeout=a.timeout)
            files = server.output_files(entry)
            lat = _latent(files[0])
            png = previews / f"{a.arch}_{b}.png"
            _png(lat, png)
            results[b] = {"pid": pid, "latent": lat, "file": files[0], "png": png,
                          "wall": _wall_seconds(entry) or (time.monotonic() - t)}
        timing = _runs_by_prompt(server)

    ref = results["bf16"]["latent"]
    print()
    print(f"ComfyUI INT8 Fused demo: {a.arch} miniature, {tuple(ref.shape)} latent, same seed for every backend")
    print(f"device: {dev}{' (' + torch.cuda.get_device_name() + ')' if dev.type == 'cuda' else ''}")
    hdr = f"{'backend':<14} {'per-step ms (median)':>21} {'steps ms':<28} {'prompt wall s':>13} {'max|err|':>10} {'mean|err|':>10}"
    print(hdr)
    print("-" * len(hdr))
    for b, r in results.items():
        s = (timing or {}).get(r["pid"])
        if s and s.get("step_seconds"):
            steps_ms = ", ".join(f"{x * 1000:.0f}" for x in s["step_seconds"])
            med = f"{s.get('median', sorted(s['step_seconds'])[len(s['step_seconds']) // 2]) * 1000:.1f}"
        else:
            steps_ms, med = "(no per-step timing)", "-"
        d = (r["latent"] - ref).abs()
        err = ("(reference)", "") if b == "bf16" else (f"{d.max().item():.3e}", f"{d.mean().item():.3e}")
        print(f"{b:<14} {med:>21} {steps_ms:<28.28} {r['wall']:>13.2f} {err[0]:>10} {err[1]:>10}")
    if timing is None:
        print("per-step timing: GET /int8_fused/runs not available; 'prompt wall s' is the whole prompt "
              "(model load and quantization included), measured from /history timestamps")
    else:
        print("per-step ms: the model calls of each sampling step (the pack's timing wrappers); "
              "prompt wall s: the whole prompt incl. model load and weight quantization")
    from quant import backends as B
    reasons = B.device_reasons(dev)
    print()
    print("backends that ran: " + ", ".join(results))
    for name, why in reasons.items():
        if name in results:
            continue
        if name == "fused_triton" and dev.type == "cpu":
            why = "no GPU on this machine: the fused INT8 kernel runs on NVIDIA GPUs with compute capability >= 8.0"
        print(f"did not run: {name}: {why or 'not offered by the Apply node on this machine'}")
    if dev.type == "cpu":
        print("note: on a CPU these timings say nothing about GPU speed (no INT8 tensor cores here); "
              "the fused Triton kernel needs an NVIDIA GPU with compute capability >= 8.0.")
    print()
    print(f"outputs: latents in {out / 'comfy' / 'int8_fused_demo'}, previews in {previews}")
    print(f"[demo] done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
