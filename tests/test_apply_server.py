"""A real ComfyUI server runs one graph with two "Apply Fused INT8 GEMM" nodes on different backends
(torch_int_mm, dequant_bf16) and the float control, each feeding its own KSampler from the same
seed — the side-by-side comparison users wire.

Expected closeness: both INT8 backends multiply the same int8 operands (tests/test_backends.py), so
their latents differ only by float rounding, far below the W8A8 error; the INT8 latents differ from
the float control by the propagated W8A8 error (tests/test_apply.py: ~1e-3 of the output for these
miniatures per model call; two euler steps keep it at that order), checked with a 10x margin (2 %).
"""
import json
import sys

import pytest
import torch

import comfy_harness as H


def _latent(path):
    from safetensors.torch import load_file
    return load_file(str(path))["latent_tensor"]


def side_by_side_workflow(unet: str, arch: str, backends=("torch_int_mm", "dequant_bf16"), steps: int = 2,
                          exclude: str = "refiner"):
    """UNETLoader -> float KSampler, and -> Apply (backend b) -> KSampler for each b; same seed.

    ``exclude='refiner'`` quantizes only the main Lumina 2 layer (5 linears of width 2304): on a CPU
    torch._int_mm and dequantize-per-call are several times slower than float, and this keeps the
    test at a few float-step costs."""
    width, pooled = H.miniature().CONDITIONING[arch]
    wf = {
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "latent": {"class_type": "EmptyLatentImage", "inputs": {"width": 32, "height": 32, "batch_size": 1}},
        "cond": {"class_type": "Int8TestConditioning",
                 "inputs": {"tokens": 8, "width": width, "pooled_width": pooled, "seed": 0, "scale": 1.0}},
    }
    models = {"float": ["unet", 0]}
    for i, b in enumerate(backends):
        wf[f"apply{i}"] = {"class_type": "ApplyFusedInt8GEMM", "inputs": {
            "model": ["unet", 0], "backend": b, "preset": "blocks", "include": "", "exclude": exclude,
            "keep_float": ""}}
        models[b] = [f"apply{i}", 0]
    for name, src in models.items():
        wf[f"sample_{name}"] = {"class_type": "KSampler", "inputs": {
            "model": src, "positive": ["cond", 0], "negative": ["cond", 0], "latent_image": ["latent", 0],
            "seed": 7, "steps": steps, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
            "denoise": 1.0}}
        wf[f"save_{name}"] = {"class_type": "SaveLatent", "inputs": {
            "samples": [f"sample_{name}", 0], "filename_prefix": f"apply_{arch}_{name}"}}
    return wf


def test_node_offered_with_runnable_backends(comfy_server):
    info = comfy_server.object_info("ApplyFusedInt8GEMM")["ApplyFusedInt8GEMM"]
    assert info["category"] == "quantization/int8" and info["display_name"] == "Apply Fused INT8 GEMM"
    choices = info["input"]["required"]["backend"][0]
    assert {"torch_int_mm", "dequant_bf16", "bf16"} <= set(choices) and "fp8_rowwise" not in choices


@pytest.mark.parametrize("arch", ["lumina2"])
def test_two_apply_nodes_on_different_backends_feed_two_samplers(comfy_server, miniature_models, arch):
    entry = comfy_server.wait(comfy_server.queue(side_by_side_workflow(miniature_models[arch], arch)),
                              timeout=900)
    out = comfy_server.output_files(entry)
    files = {k: [f for f in out if f.name.startswith(f"apply_{arch}_{k}_")] for k in
             ("float", "torch_int_mm", "dequant_bf16")}
    assert all(len(v) == 1 for v in files.values()), out
    files = {k: v[0] for k, v in files.items()}
    lat = {k: _latent(f).float() for k, f in files.items()}
    for k, t in lat.items():
        assert torch.isfinite(t).all() and t.std() > 0.1, k
    ref = lat["float"]
    a, d = lat["torch_int_mm"], lat["dequant_bf16"]
    assert (a - d).norm() <= 1e-3 * a.norm()
    for t in (a, d):
        rel = ((t - ref).norm() / ref.norm()).item()
        assert 0 < rel <= 0.02, rel
    log = comfy_server.log_tail(400)
    for b in ("torch_int_mm", "dequant_bf16"):
        assert f"INT8 Apply [{b}, preset blocks]:" in log, log


def test_example_side_by_side_workflow_maps_onto_the_server(comfy_server):
    """example_workflows/int8_side_by_side_backends.json: every node exists with matching widgets;
    one loader feeds the float sampler and every Apply node; all samplers share one seed."""
    sys_path = str(H.ROOT / "scripts")
    sys.path.insert(0, sys_path)
    try:
        import workflow
    finally:
        sys.path.remove(sys_path)
    ui = json.loads((H.ROOT / "example_workflows" / "int8_side_by_side_backends.json").read_text())
    api = workflow.ui_to_api(ui, comfy_server.object_info())
    applies = {k: v for k, v in api.items() if v["class_type"] == "ApplyFusedInt8GEMM"}
    samplers = [v for v in api.values() if v["class_type"] == "KSampler"]
    loader = next(k for k, v in api.items() if v["class_type"] == "UNETLoader")
    assert sorted(v["inputs"]["backend"] for v in applies.values()) == ["dequant_bf16", "fused_triton", "torch_int_mm"]
    assert all(v["inputs"]["model"] == [loader, 0] for v in applies.values())
    assert sorted(s["inputs"]["model"][0] for s in samplers) == sorted([loader, *applies])
    assert len({s["inputs"]["seed"] for s in samplers}) == 1
