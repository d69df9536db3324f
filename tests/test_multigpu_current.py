"""MultiGPU CFG Split's deep clones carry the pack's INT8 modules (issue 51 item 1; nodes/multigpu.py), on the CPU
with ComfyUI 0.33.0's own code paths: ``ModelPatcher.deepclone_multigpu`` (what ``create_multigpu_deepclones``
calls per extra GPU; here the "other device" is the CPU again, the only one there is) and ``match_multigpu_clones``
(what the sampler calls on a later clone of the main model).

A tiny Flux.1 (one double, one single block, bf16) from ComfyUI's classes, loaded through a factory recorded as
``cached_patcher_init`` the way UNETLoader records it, goes through Apply (fused_triton: both blocks fused, kernels
in the Triton interpreter). Its deep clone must:
* hold INT8 modules of its own: the same object patch names and module types, no module and no tensor shared with
  the original, the same int8 codes, scales and backend;
* have its fused blocks run its own tree: a fused block's float submodules (norms) are the clone's model's modules
  at the same name, not the original's;
* sample the same output bit for bit (one euler step, cfg 1) as the original.
Then ``match_multigpu_clones`` on a clone of the main model reuses the extra clone's copies (the same objects), and
copies what a second Apply added after the split; a LoRA loaded after Apply runs as branches on the clone's own
layers as on the main model's. A model without ``cached_patcher_init`` gets ComfyUI's own error,
which names the cause.
"""
import torch

from test_lora_runtime import TARGETS


def test_deep_clone_runs_its_own_int8_modules(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print({k: v for k, v in res.items() if k != "keys"})
    assert res["keys"] and res["same_keys"] and res["same_types"], res
    assert res["fused"] == ["FusedFluxDoubleBlock", "FusedFluxSingleBlock"], res
    assert res["shared_modules"] == 0 and res["shared_tensors"] == 0, res
    assert res["codes_equal"] and res["int8_layers"] > 0 and res["backends"] == ["fused_triton"], res
    assert res["norms_from_clone_tree"] and not res["norms_from_original_tree"], res
    assert res["sample_equal"], res
    assert res["match_reuses"] and res["match_copies_new"] and res["match_new_own"], res
    assert "cached_patcher_init" in res["no_factory_error"], res["no_factory_error"]
    # LoRA after Apply: the branches on the clone's own layers too, no weight patch left for ComfyUI to apply to int8
    assert res["lora_targets"] == sorted(TARGETS) and res["lora_on_clone"] == res["lora_targets"], res
    assert res["lora_clone_own_layers"] and not any(k.startswith("diffusion_model.double_blocks.0.img_attn")
                                                    for k in res["lora_patches_left"]), res


def _factory():
    """The tiny Flux.1 as a loader would give it again: the same weights every call."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))  # noqa: F821 (runpy sets __file__)
    import test_torch_compile_current as tc
    torch.manual_seed(0)
    return tc._tiny_flux_patcher(torch.bfloat16)


def body(pack, models) -> dict:
    """Runs inside ComfyUI 0.33.0 (subprocess)."""
    import comfy.model_management as mm
    mp = _factory()
    mp.cached_patcher_init = (_factory, ())
    g = torch.Generator().manual_seed(2)
    pos = [[torch.randn(1, 6, 64, generator=g), {"pooled_output": torch.randn(1, 64, generator=g), "guidance": 3.5}]]
    latent = torch.zeros(1, 16, 8, 8)
    apply = pack.nodes.apply.ApplyFusedInt8GEMM().apply
    multigpu, weights = pack.nodes.multigpu, pack.nodes.weights
    (applied,) = apply(mp, "fused_triton", attention="math")
    ref = sample_image_only_cfg(applied, pos, latent, steps=1, cfg=1.0)  # noqa: F821 (the harness defines it)
    mm.unload_all_models()

    clone = applied.deepclone_multigpu(new_load_device=torch.device("cpu"))
    mine, theirs = multigpu.pack_patches(applied), multigpu.pack_patches(clone)
    out = {"keys": sorted(mine), "same_keys": sorted(mine) == sorted(theirs),
           "same_types": all(type(mine[k]) is type(theirs[k]) for k in mine),
           "fused": sorted(type(m).__name__ for m in theirs.values() if hasattr(m, "covers"))}
    # nothing shared: no module, no tensor (parameters and buffers of every INT8 module and what it holds)
    ours = {id(m) for p in mine.values() for m in p.modules()}
    out["shared_modules"] = sum(id(m) in ours for p in theirs.values() for m in p.modules())
    ptrs = {t.data_ptr() for p in mine.values() for t in list(p.parameters()) + list(p.buffers()) if t.numel()}
    out["shared_tensors"] = sum(t.data_ptr() in ptrs for p in theirs.values()
                                for t in list(p.parameters()) + list(p.buffers()) if t.numel())
    a, b = weights.int8_layers(applied), weights.int8_layers(clone)
    out["int8_layers"] = len(a)
    out["codes_equal"] = sorted(a) == sorted(b) and all(
        torch.equal(a[n].qweight, b[n].qweight) and torch.equal(a[n].weight_scale, b[n].weight_scale) for n in a)
    out["backends"] = sorted({layer.backend for layer in b.values()})
    # the fused double block's norms: the clone's tree's modules at the same name
    key = "diffusion_model.double_blocks.0"
    tree_c = clone.model.diffusion_model.double_blocks[0]
    tree_a = applied.model.diffusion_model.double_blocks[0]
    fused_c = theirs[key]
    out["norms_from_clone_tree"] = fused_c.img_norm1 is tree_c.img_norm1 and fused_c.txt_norm1 is tree_c.txt_norm1
    out["norms_from_original_tree"] = fused_c.img_norm1 is tree_a.img_norm1
    got = sample_image_only_cfg(clone, pos, latent, steps=1, cfg=1.0)  # noqa: F821
    out["sample_equal"] = bool(torch.equal(got, ref))
    mm.unload_all_models()

    # a later clone of the main model, matched onto the extra clone's model: the extra clone's own copies again;
    # an INT8 module added after the split (a second Apply, on the layers the first left float) copied for it
    applied.set_additional_models("multigpu", [clone])
    later = applied.clone()
    later.match_multigpu_clones()
    (matched,) = later.get_additional_models_with_key("multigpu")
    mt = multigpu.pack_patches(matched)
    out["match_reuses"] = matched.model is clone.model and all(mt[k] is theirs[k] for k in theirs)
    (second,) = apply(applied, "fused_triton", preset="all", attention="math")
    second.match_multigpu_clones()
    (matched2,) = second.get_additional_models_with_key("multigpu")
    new = sorted(set(multigpu.pack_patches(second)) - set(mine))
    m2 = multigpu.pack_patches(matched2)
    out["match_copies_new"] = bool(new) and all(k in m2 for k in new) and all(m2[k] is theirs[k] for k in theirs)
    out["match_new_own"] = all(m2[k] is not multigpu.pack_patches(second)[k] for k in new)

    # a LoRA after Apply (LoraLoaderModelOnly on the split model): the sampling run's start gives the main model's
    # layers their branches (nodes.apply's run-start wrapper), the match gives the clone's own layers theirs
    import folder_paths
    import nodes
    import test_lora_runtime as tlr
    loras = models / "loras"
    loras.mkdir()
    folder_paths.add_model_folder_path("loras", str(loras))
    tlr._lora_file(loras, applied, "split.safetensors", tlr.TARGETS)
    (with_lora,) = nodes.LoraLoaderModelOnly().load_lora_model_only(applied, "split.safetensors", 1.0)
    pack.nodes.apply.install_lora(with_lora)
    main_layers = weights.int8_layers(with_lora)
    with_lora.match_multigpu_clones()
    (matched3,) = with_lora.get_additional_models_with_key("multigpu")
    clone_layers = weights.int8_layers(matched3)
    out["lora_targets"] = sorted(n for n in tlr.TARGETS if main_layers[n].derived.lora is not None)
    out["lora_on_clone"] = sorted(n for n in tlr.TARGETS if clone_layers[n].derived.lora is not None)
    out["lora_clone_own_layers"] = all(clone_layers[n] is not main_layers[n] for n in tlr.TARGETS)
    out["lora_patches_left"] = sorted(k for k in matched3.patches if k.endswith(".weight"))

    plain = _factory()
    (no_factory,) = apply(plain, "fused_triton", attention="math")
    try:
        no_factory.deepclone_multigpu(new_load_device=torch.device("cpu"))
        out["no_factory_error"] = "no error"
    except RuntimeError as e:
        out["no_factory_error"] = str(e)
    return out
