"""DynamicVRAM's backups and the pack's object patches, on a current ComfyUI (0.33.0), on the CPU.

``ModelPatcherDynamic.load`` force-loads some tensors of the tree as patched (the weight and bias of cast layers of
16 KiB or less, every parameter of other layers: the norms a fused block holds) and keeps the originals in
``patcher.backup``, keyed by their path under the object patches (``diffusion_model.layers.0.feed_forward...``).
Its ``unpatch_model`` undoes the object patches first and restores the backups afterwards: on the H200
``unload_all_models`` raised ``AttributeError: 'FeedForward' object has no attribute 'w13'``
(12fd228:bench/calibrate_e2e.py), and keys that exist in the float model (``attention.qkv``) put the INT8 layer's
tensors on ComfyUI's float Linear. An ``Int8Linear``'s ``weight_scale`` / ``smooth`` are not Parameters, so this
load neither backs them up nor copies them to the GPU at every sample (the per-sample tax, issue 49).

ComfyUI's own code runs here: ``LoadedModel.model_load`` / ``model_unload`` (what ``load_models_gpu`` and
``unload_all_models`` call), ``ModelPatcherDynamic.partially_load`` / ``load`` / ``detach`` / ``unpatch_model``. The
only stand-ins are for comfy-aimdo's native (CUDA-only) VRAM "vbar" and pinned host buffers, and 'meta' for the GPU.
Model: the width-128 Lumina 2 (scripts/miniature.py) through "Apply Fused INT8 GEMM" on fused_triton (fused blocks
whose FeedForward holds the merged ``w13``, the layout Ideogram 4's fused block has).

Scenarios: (1) the Apply clone loaded then unloaded; (2) the README's side-by-side graph: one loader feeding the
float KSampler and the Apply node, the float model loaded while the INT8 clone is (``load_models_gpu`` detaches the
clone, then loads the float patcher), then unloaded. After each: no error, the float model's parameters are the ones
it had (same names, same storage), every INT8 tensor equals the one Apply made, no backup left.
"""
import torch


def test_dynamic_vram_unload_after_apply(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res)
    assert res["fused"] >= 4 and res["patched_backed_up"] >= 4  # the crash's precondition is exercised
    # the small vectors stay where they are: no backup, the same tensors after a load (nothing copied per sample)
    assert res["small_backed_up"] == 0 and res["small_swapped"] == 0 and res["small_vectors"] > 0
    for name in ("unload", "switch"):
        r = res[name]
        assert r["error"] is None, r["error"]
        assert r["float_params_changed"] == [], r["float_params_changed"]
        assert r["int8_tensors_changed"] == [] and r["backups_left"] == 0
    assert res["legacy_untouched"] == 0


def body(pack, models) -> dict:
    import sys
    import comfy.model_detection
    import comfy.model_management as mm
    import comfy.model_patcher as mp
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import comfy_harness
    Int8Linear = sys.modules["comfyui_int8_fused.quant.linear"].Int8Linear
    comfy_cast = sys.modules["comfyui_int8_fused.nodes.comfy_cast"]
    mini = comfy_harness.miniature()
    cpu, gpu = torch.device("cpu"), torch.device("meta")
    sd = mini.tiny_state_dict("lumina2", 0, torch.float32)
    mc = comfy.model_detection.model_config_from_unet_config(dict(mini.TINY_UNET_CONFIG["lumina2"]), sd)
    mc.set_inference_dtype(torch.float32, None)
    model = mc.get_model(sd, "", device=cpu)
    model.diffusion_model.load_state_dict(sd, strict=False)  # 0.33.0's Lumina 2 has no norm_final
    float_patcher = mp.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    (int8_patcher,) = pack.nodes.apply.ApplyFusedInt8GEMM().apply(float_patcher, "fused_triton")
    legacy_untouched = comfy_cast.restore_patched_backups(int8_patcher)

    class VBar:  # comfy_aimdo.model_vbar.ModelVBAR stand-in: address ranges, nothing resident, nothing to free
        top = 0

        def prioritize(self):
            pass

        def alloc(self, size):
            self.top += size
            return (self, self.top - size, size)

        def free_memory(self, size):
            return 0

        def loaded_size(self):
            return 0

    class HostBuffer:  # comfy_aimdo.host_buffer.HostBuffer stand-in (nothing pinned)
        size = 0

    def dynamic(p):
        """``p`` as the ModelPatcherDynamic ComfyUI builds on a GPU (``__new__`` gives a CPU one the legacy class)."""
        p.__class__, p.load_device = mp.ModelPatcherDynamic, gpu
        return p

    model.dynamic_vbars = {gpu: VBar()}
    model.dynamic_pins = {gpu: {k: (HostBuffer(), [], [-1], [0], [0], {})
                                for k in ("weights", "patches", "weights-loaded", "patches-loaded")}}
    model.dynamic_pins[gpu].update(hostbufs_initialized=True, failed=False, active=False, current_prompt=False)
    P, C = dynamic(float_patcher), dynamic(int8_patcher)

    def float_params():
        return {n: (p.data_ptr(), p.device.type) for n, p in model.named_parameters()}

    int8 = {id(m): m for top in C.object_patches.values() for m in top.modules() if isinstance(m, Int8Linear)}
    ref_float = float_params()
    ref_int8 = {(k, n): t.detach().clone() for k, m in int8.items() for n, t in m.state_dict().items()}
    small = {(k, n): getattr(m, n) for k, m in int8.items() for n in ("weight_scale", "smooth")
             if getattr(m, n) is not None}
    fused = sum(1 for m in C.object_patches.values() if getattr(m, "covers", None))
    seen = {"patched": 0, "small": 0, "swapped": 0}

    def state(error):
        now = float_params()
        changed = sorted(set(now) ^ set(ref_float)) + sorted(n for n in now if n in ref_float and now[n] != ref_float[n])
        bad = [f"{type(m).__name__}.{n}" for (k, n), t in ref_int8.items()
               for m in [int8[k]] if getattr(m, n).device != t.device or not torch.equal(getattr(m, n), t)]
        return {"error": error, "float_params_changed": changed[:8], "int8_tensors_changed": bad[:8],
                "backups_left": len(C.backup) + len(C.backup_buffers)}

    def run(steps):
        try:
            steps()
            return None
        except Exception as e:  # noqa: BLE001  (reported, asserted by the test)
            return f"{type(e).__name__}: {e}"

    def unload():
        lm = mm.LoadedModel(C)
        lm.model_load(0)
        under = [k for k in C.backup if any(k.startswith(f"{p}.") for p in C.object_patches)]
        seen["patched"] = len(under)
        seen["small"] = sum(k.endswith((".weight_scale", ".smooth")) for k in C.backup)
        seen["swapped"] = sum(getattr(int8[k], n) is not t for (k, n), t in small.items())
        lm.model_unload()

    out = {"fused": fused, "legacy_untouched": legacy_untouched}
    out["unload"] = state(run(unload))
    out.update(patched_backed_up=seen["patched"], small_backed_up=seen["small"], small_swapped=seen["swapped"],
               small_vectors=len(small))

    def switch():
        lm = mm.LoadedModel(C)
        lm.model_load(0)
        C.detach(unpatch_all=False)  # load_models_gpu([float]): its loaded clone is detached first
        lf = mm.LoadedModel(P)
        lf.model_load(0)
        lf.model_unload()

    out["switch"] = state(run(switch))
    return out
