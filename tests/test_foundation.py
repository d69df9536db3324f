"""The pack inside a real ComfyUI 0.3.75 server: it is loaded, its nodes are described, a miniature
DiT of each architecture samples through a real workflow; importing the pack is light; the runtime
setup reuses what it built."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import comfy_harness as H

PACK_DIR_NAME = "comfyui-int8-fused"


def _pack_nodes(info: dict) -> dict:
    return {k: v for k, v in info.items() if v.get("python_module", "").endswith(PACK_DIR_NAME)}


def pack_import_failures(log: str) -> list[str]:
    """ComfyUI's own report that *this pack* failed to import: "Cannot import <custom_nodes>/<pack> module"
    or "(IMPORT FAILED): <custom_nodes>/<pack>". Not any line that merely holds the pack's folder name:
    the test runtime lives inside the clone, so ComfyUI's own import errors carry that name in their paths."""
    pat = re.compile(r"(Cannot import |IMPORT FAILED\): )\S*[/\\]custom_nodes[/\\]" + re.escape(PACK_DIR_NAME)
                     + r"( module|\s*$)")
    return [ln for ln in log.splitlines() if pat.search(ln)]


def test_pack_import_failure_matcher_ignores_comfyuis_own_errors_in_a_clone_named_like_the_pack():
    """Regression: in a clone named comfyui-int8-fused, ComfyUI's `No module named 'torchaudio'` lines hold
    the pack's folder name in their paths and were taken for the pack failing to import."""
    clone = "/home/u/comfyui-int8-fused/.runtime/ComfyUI"
    own = [f"Cannot import {clone}/comfy_extras/nodes_audio.py module for custom nodes: No module named 'torchaudio'",
           f"   0.0 seconds (IMPORT FAILED): {clone}/comfy_extras/nodes_audio.py"]
    ours = [f"Cannot import {clone}/custom_nodes/comfyui-int8-fused module for custom nodes: boom",
            f"   0.1 seconds (IMPORT FAILED): {clone}/custom_nodes/comfyui-int8-fused"]
    assert pack_import_failures("\n".join(own)) == []
    assert pack_import_failures("\n".join(own + ours)) == ours


def test_server_lists_pack_nodes_with_categories_and_tooltips(comfy_server):
    info = comfy_server.object_info()
    ours = _pack_nodes(info)
    assert ours, ("no node of the pack in /object_info; server log:\n" + comfy_server.log_tail())
    log = comfy_server.log_tail(2000)
    assert not pack_import_failures(log), pack_import_failures(log)
    # the runtime gives ComfyUI what it imports at start (torchaudio, ...): no import error at all
    failed = [ln for ln in log.splitlines() if "IMPORT FAILED" in ln or "Cannot import" in ln]
    assert not failed, failed
    problems = []
    for name, d in ours.items():
        if not d["category"].startswith("quantization/int8"):
            problems.append(f"{name}: category {d['category']!r}")
        if not d.get("display_name"):
            problems.append(f"{name}: no display name")
        for group in ("required", "optional"):
            for inp, spec in d["input"].get(group, {}).items():
                opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
                if not opts.get("tooltip"):
                    problems.append(f"{name}.{inp}: no tooltip")
    assert not problems, "; ".join(problems)
    assert "Int8TestConditioning" in ours


def test_server_serves_pack_web_extension(comfy_server):
    js = sorted(p.name for p in (H.ROOT / "web").glob("*.js"))
    if not js:
        pytest.skip("the pack has no web/*.js yet")
    served = comfy_server.get_json("/extensions")
    for name in js:
        assert f"/extensions/{PACK_DIR_NAME}/{name}" in served, (name, served)


def _sampling_workflow(unet: str, arch: str, steps: int = 2) -> dict:
    """UNETLoader -> two conditionings (seeds 0, 1) -> KSampler each, same noise seed -> SaveLatent."""
    width, pooled = H.miniature().CONDITIONING[arch]
    wf = {
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "latent": {"class_type": "EmptyLatentImage", "inputs": {"width": 32, "height": 32, "batch_size": 1}},
    }
    for c in (0, 1):
        wf[f"cond{c}"] = {"class_type": "Int8TestConditioning",
                          "inputs": {"tokens": 8, "width": width, "pooled_width": pooled, "seed": c,
                                     "scale": 1.0}}
        wf[f"sample{c}"] = {"class_type": "KSampler", "inputs": {
            "model": ["unet", 0], "positive": [f"cond{c}", 0], "negative": [f"cond{c}", 0],
            "latent_image": ["latent", 0], "seed": 7, "steps": steps, "cfg": 1.0, "sampler_name": "euler",
            "scheduler": "simple", "denoise": 1.0}}
        wf[f"save{c}"] = {"class_type": "SaveLatent",
                          "inputs": {"samples": [f"sample{c}", 0], "filename_prefix": f"foundation_{arch}_c{c}"}}
    return wf


def _latent(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file
    return load_file(str(path))["latent_tensor"]


@pytest.mark.parametrize("arch", ["lumina2", "flux"])
def test_miniature_samples_through_real_workflow(comfy_server, miniature_models, arch):
    pid = comfy_server.queue(_sampling_workflow(miniature_models[arch], arch))
    entry = comfy_server.wait(pid, timeout=900)
    files = sorted(comfy_server.output_files(entry))
    assert len(files) == 2 and all(f.is_file() for f in files), files
    a, b = (_latent(f) for f in files)
    for t in (a, b):
        assert t.shape == (1, 16, 4, 4)
        assert torch.isfinite(t).all()
        assert t.std() > 0.1 and t.abs().max() < 1e3, (t.std(), t.abs().max())
    # Same noise seed, different conditioning: the model (and the conditioning) shaped the result.
    assert (a - b).abs().max() > 1e-3
    kinds = {e["type"] for e in comfy_server.prompt_events(pid)}
    assert {"execution_start", "executing"} <= kinds, kinds
    log = comfy_server.log_tail(300)
    assert "unet missing" not in log and "unet unexpected" not in log


_IMPORT_PROBE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import comfy.cli_args
comfy.cli_args.args.cpu = True
import utils.extra_config, torch, comfy.model_management  # main.py's order, up to loading custom nodes:
import execution, server, nodes  # noqa: E401
sys.path.insert(0, sys.argv[2])
import comfy_harness as H
before = set(sys.modules)
t = time.perf_counter()
pack = H.import_pack()
dt = time.perf_counter() - t
new = sorted(set(sys.modules) - before)
print(json.dumps({"seconds": dt, "triton": [m for m in new if m.split(".")[0] == "triton"],
                  "cuda_initialized": torch.cuda.is_initialized(), "nodes": len(pack.NODE_CLASS_MAPPINGS),
                  "web": pack.WEB_DIRECTORY}))
"""


def test_pack_import_is_light():
    H.check_runtime()
    cp = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, str(H.COMFY_DIR), str(H.ROOT / "tests")],
                        capture_output=True, text=True, timeout=300, cwd=H.COMFY_DIR)
    assert cp.returncode == 0, cp.stderr[-3000:]
    r = json.loads(cp.stdout.strip().splitlines()[-1])
    print(f"pack import: {r['seconds'] * 1000:.0f} ms, {r['nodes']} nodes")
    assert r["triton"] == [], f"importing the pack imported Triton: {r['triton']}"
    assert not r["cuda_initialized"], "importing the pack initialized CUDA"
    assert r["nodes"] > 0 and r["web"] == "./web"
    # A loose bound that catches kernel compilation or model work at import (torch/comfy excluded).
    assert r["seconds"] < 5.0, r


def test_setup_reuses_existing_runtime():
    H.check_runtime()
    stamps = list(H.RUNTIME.glob(".ready-v*"))
    assert stamps, "no recipe stamp in the runtime"
    before = stamps[0].stat().st_mtime
    t = time.monotonic()
    cp = subprocess.run(["bash", str(H.ROOT / "scripts" / "setup_runtime.sh")], capture_output=True, text=True,
                        timeout=600, env={**os.environ, "INT8_RUNTIME_DIR": str(H.RUNTIME)})
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "(reused)" in cp.stdout, cp.stdout
    assert stamps[0].stat().st_mtime == before
    assert (H.COMFY_DIR / "custom_nodes" / PACK_DIR_NAME).resolve() == H.ROOT.resolve()
    print(f"setup re-run: {time.monotonic() - t:.1f} s")


def test_example_workflows_convert_against_installed_nodes(comfy_server):
    """Every UI-format workflow in example_workflows/ maps onto the nodes the server has installed
    (widget counts match the node definitions), so it loads in the template browser and queues."""
    W = _workflow_module()
    files = sorted((H.ROOT / "example_workflows").glob("*.json"))
    assert files, "no example workflow"
    info = comfy_server.object_info()
    ours = "\n".join(p.read_text() for p in (H.ROOT / "nodes").glob("*.py"))
    checked, newer = [], []
    for f in files:
        ui = json.loads(f.read_text())
        assert "nodes" in ui and "links" in ui, f"{f.name} is not in UI (litegraph) format"
        missing = {n["type"] for n in ui["nodes"] if n["type"] not in info} - W.SKIP_TYPES
        missing_ours = {t for t in missing if f'"{t}"' in ours}
        assert not missing_ours, f"{f.name}: the pack's nodes {missing_ours} are not registered"
        if missing:  # core nodes of a newer ComfyUI (e.g. Ideogram 4 workflows)
            newer.append(f"{f.name} ({', '.join(sorted(missing))})")
            continue
        assert W.ui_to_api(ui, info), f.name
        checked.append(f.name)
    print(f"converted: {checked}; need a newer ComfyUI than 0.3.75: {newer}")
    assert "int8_fused_miniature_demo.json" in checked


def _workflow_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("int8fused_workflow", H.ROOT / "scripts" / "workflow.py")
    W = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(W)
    return W


_INFO = {
    "Loader": {"input": {"required": {"name": [["a.safetensors", "b.safetensors"], {}]}}},
    "Sampler": {"input": {"required": {"model": ["MODEL", {}], "seed": ["INT", {"control_after_generate": True}],
                                       "steps": ["INT", {}], "cfg": ["FLOAT", {}]},
                          "optional": {"note": ["STRING", {}]}}},
}


def _ui(widgets, steps_link=False):
    sampler_inputs = [{"name": "model", "type": "MODEL", "link": 1}]
    links = [[1, 1, 0, 2, 0, "MODEL"]]
    if steps_link:
        sampler_inputs.append({"name": "steps", "type": "INT", "widget": {"name": "steps"}, "link": 2})
        links.append([2, 3, 0, 2, 1, "INT"])
    nodes = [{"id": 1, "type": "Loader", "mode": 0, "inputs": [], "widgets_values": ["b.safetensors"]},
             {"id": 2, "type": "Sampler", "mode": 0, "inputs": sampler_inputs, "widgets_values": widgets},
             {"id": 3, "type": "Loader", "mode": 2, "inputs": [], "widgets_values": ["a.safetensors"]},
             {"id": 4, "type": "Note", "mode": 0, "inputs": [], "widgets_values": ["text"]}]
    return {"nodes": nodes, "links": links}


def test_workflow_conversion_rules():
    W = _workflow_module()
    api = W.ui_to_api(_ui([5, "fixed", 3, 1.5, "hi"]), _INFO)
    assert set(api) == {"1", "2"}  # muted node and note left out
    assert api["1"]["inputs"] == {"name": "b.safetensors"}
    assert api["2"]["inputs"] == {"seed": 5, "steps": 3, "cfg": 1.5, "note": "hi", "model": ["1", 0]}
    # control value absent (older saves): still maps; a link from a muted node is dropped
    api = W.ui_to_api(_ui([5, 3, 1.5, "hi"], steps_link=True), _INFO)
    assert api["2"]["inputs"]["steps"] == 3 and api["2"]["inputs"]["cfg"] == 1.5
    with pytest.raises(W.WorkflowError, match=r"node 2 \(Sampler\): 6 widget values but the installed node takes 5"):
        W.ui_to_api(_ui([5, "fixed", 3, 1.5, "hi", 9]), _INFO)
    bad = _ui([5, "fixed", 3, 1.5, "hi"])
    bad["nodes"][1]["type"] = "Missing"
    with pytest.raises(W.WorkflowError, match="'Missing' is not installed"):
        W.ui_to_api(bad, _INFO)
