"""LoRA loaded AFTER the INT8 model runs as a low-rank side branch (quant/lora.py) on ComfyUI 0.33.0 (COMFYUI_CURRENT, a
subprocess; skipped with the reason otherwise): real LoRA safetensors files through ComfyUI's LoraLoaderModelOnly,
sampled by ComfyUI's own sampler. Helpers and the bound argument: tests/test_lora_runtime.py.

* tiny Flux after "Apply Fused INT8 GEMM" (fused_triton, fused blocks), as test_lora_runtime does on 0.3.75;
* a tiny Ideogram 4 (ComfyUI's Ideogram4 BaseModel at width 128, fp32, 2 blocks) after Apply on fused_triton, a LoRA
  on layers.0's qkv and w1 and layers.1's w3: both blocks stay fused, each branch reading its GEMM's int8 input;
* "Load Ideogram 4.0 INT8" (narrow widths: comfy_harness.narrow_ideogram4, 1 layer, dequant_bf16), both outputs through DualModelGuider with the LoRA
  on each: the negative model's OUTER_SAMPLE wrappers never run, its branches come from its PREPARE_SAMPLING one.

Per model: R the runtime branch, H the same INT8 model without the LoRA plus the LoRA term computed in float64 by
forward hooks, F the float model with the LoRA patched by ComfyUI, F0 without it, M the LoRA merged then quantized.
On fused_triton H's hooks read x as the GEMM reads it (the codes per token, ``tlr._int8_input``), as the fused
blocks' branches do. R and H share every int8 base layer and differ only by the rounding of the branch term in the
model dtype (fp32:
relative ~K 2^-24; the loader's bf16: 2^-8 of the term, against a LoRA effect of tens of percent), and where that
moves a later activation across an int8 rounding boundary. Bounds as test_lora_runtime.py derives them:
||R - H|| <= 0.1 ||H - F|| (INT8 models with a float reference), ||R - F|| <= 2 ||M - F||, ||F - F0|| >= 5 ||H - F||;
for the loader (no float model): ||R - H|| <= 0.1 ||H - R0|| (R0: no LoRA), the LoRA's own effect.
"""
import sys
import types

import torch

IDEO_TARGETS = ("layers.0.attention.qkv", "layers.0.feed_forward.w1", "layers.1.feed_forward.w3")
LOADER_TARGETS = ("layers.0.attention.qkv", "layers.0.feed_forward.w1")


def test_lora_after_int8_on_current_comfyui(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res)
    for case in ("flux", "ideogram4"):
        r = res[case]
        assert r["F-F0"] >= 5 * r["H-F"], (case, r)
        assert r["R-H"] <= 0.1 * r["H-F"], (case, r)
        assert r["R-F"] <= 2 * r["M-F"], (case, r)
    assert res["ideogram4"]["fused_blocks"] == [["layers.0", "FusedIdeogram4Block"],
                                                     ["layers.1", "FusedIdeogram4Block"]], res["ideogram4"]
    ld = res["loader"]
    assert ld["R-H"] <= 0.1 * ld["H-R0"] and ld["H-R0"] > 0, ld


def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    import folder_paths
    import comfy.model_management as mm
    loras = models / "loras"
    loras.mkdir()
    folder_paths.add_model_folder_path("loras", str(loras))
    mm.in_training = True  # Ideogram4Attention's rms+rope through comfy_kitchen needs its GPU backend off training
    out = {"flux": _flux(pack, loras), "ideogram4": _ideogram4(pack, loras)}
    mm.in_training = False
    out["loader"] = _loader(pack, models, loras)
    return out


def _norm(a, b) -> float:
    return float((a.double() - b.double()).norm())


def _compare(pack, mp, lora_name, sd, targets, run, strength=1.0):
    """(Apply'd model, {R-H, H-F, R-F, M-F, F-F0}) of model ``mp`` (see the module doc) with the LoRA at
    ``strength``; ``run(model)`` samples it."""
    import nodes
    import comfy.model_management as mm
    import test_lora_runtime as tlr
    from kernel import config
    loader, apply = nodes.LoraLoaderModelOnly(), pack.nodes.apply.ApplyFusedInt8GEMM()
    q = apply.apply(mp, "fused_triton")[0]
    f0 = run(mp)
    f1 = run(loader.load_lora_model_only(mp, lora_name, strength)[0])
    r1 = run(loader.load_lora_model_only(q, lora_name, strength)[0])
    mm.unload_all_models()  # the per-linear twin below and the fused clones above patch nested names of one tree
    with config.override(INT8_FUSED_FUSION=False):
        h = apply.apply(mp, "fused_triton")[0]
    hooks = tlr._hooked(h, [(sd, strength)], targets, from_codes=True)  # fused blocks: the branch reads the codes
    try:
        h1 = run(h)
    finally:
        for x in hooks:
            x.remove()
    mm.unload_all_models()
    m1 = run(apply.apply(loader.load_lora_model_only(mp, lora_name, strength)[0], "fused_triton")[0])
    mm.unload_all_models()
    return q, {"R-H": _norm(r1, h1), "H-F": _norm(h1, f1), "R-F": _norm(r1, f1), "M-F": _norm(m1, f1),
               "F-F0": _norm(f1, f0)}


def _flux(pack, loras):
    import comfy.model_detection
    import comfy.sample
    import test_lora_runtime as tlr
    from comfy_harness import miniature
    # scripts/miniature.py's tiny Flux config; 0.33.0's Flux also takes txt_ids_dims (Flux.1: none)
    mc = comfy.model_detection.model_config_from_unet_config(dict(miniature().TINY_UNET_CONFIG["flux"],
                                                                  txt_ids_dims=[]), {})
    mp = _patcher(mc)
    sd = tlr._lora_file(loras, mp, "flux.safetensors", tlr.TARGETS, seed=3)
    return _compare(pack, mp, "flux.safetensors", sd, tlr.TARGETS, lambda m: tlr._sample(comfy.sample, m))[1]


def _patcher(mc, seed=0):
    """A ModelPatcher of ``mc``'s BaseModel, fp32 on the CPU, random weights (norms near 1, matrices fan-in scaled)."""
    import comfy.model_patcher
    mc.set_inference_dtype(torch.float32, None)
    cpu = torch.device("cpu")
    model = mc.get_model({}, "", device=cpu)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.diffusion_model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * r if "norm" in n else r * p[0].numel() ** -0.5 if p.dim() >= 2 else 0.02 * r)
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def tiny_ideogram4_patcher(seed=0):
    """A ModelPatcher of ComfyUI's Ideogram4 BaseModel at width 128 (2 heads of 64, FFN 256, 2 blocks), fp32, random
    weights: its supported-model config with the widths set after construction (the class fixes the real ones)."""
    import comfy.supported_models as sm
    cfg = sm.Ideogram4({"image_model": "ideogram4", "in_channels": 128, "num_layers": 2})
    cfg.unet_config.update(num_attention_heads=2, attention_head_dim=64, intermediate_size=256, adaln_dim=32,
                           llm_features_dim=64)
    return _patcher(cfg, seed)


def _ideogram4(pack, loras):
    import test_lora_runtime as tlr
    mp = tiny_ideogram4_patcher()
    sd = tlr._lora_file(loras, mp, "ideo.safetensors", IDEO_TARGETS, seed=5)
    g = torch.Generator().manual_seed(7)
    positive, latent = [[torch.randn(1, 5, 64, generator=g), {}]], torch.zeros(1, 128, 2, 2)
    run = lambda m: sample_image_only_cfg(m, positive, latent, 1)  # noqa: E731,F821 (tests/comfy_harness.py)
    q, res = _compare(pack, mp, "ideo.safetensors", sd, IDEO_TARGETS, run, strength=3.0)  # well above INT8 noise
    res["fused_blocks"] = [[k[len("diffusion_model."):], type(v).__name__] for k, v in q.object_patches.items()
                           if k.count(".") == 2 and k.startswith("diffusion_model.layers.")]
    return res


def _loader(pack, models, loras):
    import nodes
    import comfy.model_management as mm
    import test_lora_runtime as tlr
    i4 = sys.modules["comfyui_int8_fused.adapters.ideogram4.layout"]
    W = sys.modules["comfyui_int8_fused.quant.fmt_write"]
    from comfy_harness import narrow_ideogram4
    w = narrow_ideogram4()  # ComfyUI's Ideogram 4 config at narrow widths (the loader checks the file against it)
    names = [n for n in i4.linear_specs(1, w) if n.startswith("layers.") and n.split(".")[-1] in
             ("qkv", "o", "w1", "w3")]
    W.write_transformerlab(str(models / "two.safetensors"), {
        br: i4.quantize_state_dict(i4.random_state_dict(1, w, seed=s), names)
        for br, s in (("conditional", 0), ("unconditional", 1))})
    cond, uncond = pack.nodes.loader.LoadIdeogram4Int8().load("two.safetensors", "dequant_bf16", "none", "none")
    sd = tlr._lora_file(loras, cond, "loader.safetensors", LOADER_TARGETS, seed=9)
    g = torch.Generator().manual_seed(5)
    positive, latent = [[torch.randn(1, 4, w["text"], generator=g), {}]], torch.zeros(1, 128, 2, 2)
    run = lambda m, neg: sample_image_only_cfg(m, positive, latent, 1, neg)  # noqa: E731,F821
    lo = nodes.LoraLoaderModelOnly()
    r = run(lo.load_lora_model_only(cond, "loader.safetensors", 1.0)[0],
            lo.load_lora_model_only(uncond, "loader.safetensors", 1.0)[0])
    mm.unload_all_models()
    r0 = run(cond, uncond)
    tree = lambda m: types.SimpleNamespace(object_patches={  # noqa: E731  the loader's INT8 layers sit in the tree
        "diffusion_model." + t: m.get_model_object("diffusion_model." + t) for t in LOADER_TARGETS})
    hooks = tlr._hooked(tree(cond), [(sd, 1.0)], LOADER_TARGETS) + tlr._hooked(tree(uncond), [(sd, 1.0)],
                                                                                 LOADER_TARGETS)
    try:
        h = run(cond, uncond)
    finally:
        for x in hooks:
            x.remove()
    return {"R-H": _norm(r, h), "H-R0": _norm(h, r0)}
