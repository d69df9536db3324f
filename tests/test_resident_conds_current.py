"""The run's conditioning moved to the model's device once per sampling run (``nodes/resident_conds.py``), on a
current ComfyUI (0.33.0) with a 1-layer Ideogram 4 (narrow widths: ``comfy_harness.narrow_ideogram4``), on the CPU.

The CPU machine has no second device, so the move is checked on ComfyUI's own processed conds (captured by a
SAMPLER_SAMPLE wrapper inside a real sampling run) moved to the ``meta`` device: every tensor of a
``model_conds`` entry (here Ideogram 4's one: the 12 text tokens' features) is replaced by a new object of
the same class holding a tensor of the same shape and dtype on the target device; constants stay; the run's
originals and the user's CONDITIONING tensors are untouched; the byte count is the one derived by hand;
``undo`` puts the original objects back (the wrapper does at the end of every run). The DualModel guider's
uncond conds are moved too. A real CFG sampling run with the wrapper installed by "Apply Fused INT8 GEMM"
(backend torch_int_mm; the bf16 control does not get it) returns the same latent as the same model without the
wrapper (on the CPU the wrapper moves nothing: the model's device is the conds' device).
"""
import importlib
import types

import torch


def test_conds_move_once_and_leave_the_users_conditioning(comfy_current):
    from comfy_harness import NARROW_IDEOGRAM4, run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res)
    text_bytes = 12 * NARROW_IDEOGRAM4["llm_features_dim"] * 4  # [1, 12, text width] fp32
    assert res["classes"] == res["classes_after"]
    assert res["moved_bytes"] == text_bytes  # Ideogram 4's extra_conds: the text (an all-ones mask is dropped)
    assert res["moved_devices"] == ["meta"] and res["moved_shapes_equal"]
    assert res["originals_on_cpu"] and res["user_cond_on_cpu"] and res["constants_kept"] and res["undone"]
    assert res["dual_moved_bytes"] == text_bytes and res["dual_device"] == "meta"
    assert res["runs_seen"] == 1 and res["moved_in_cpu_run"] == 0  # the run with the wrapper; it moved nothing
    assert res["same_latent"] and res["latent_finite"]
    assert res["installed"] and not res["installed_bf16"]  # the bf16 control stays as ComfyUI runs it


def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    import comfy.conds
    import comfy.patcher_extension as pe
    import comfy.sd
    i4 = importlib.import_module("comfyui_int8_fused.adapters.ideogram4.layout")
    rc = pack.nodes.resident_conds
    from comfy_harness import narrow_ideogram4
    w = narrow_ideogram4()  # ComfyUI's Ideogram 4 config at narrow widths
    model = comfy.sd.load_diffusion_model_state_dict(i4.random_state_dict(1, w, seed=0, dtype=torch.float32),
                                                     {"dtype": torch.float32})
    (applied,) = pack.nodes.apply.ApplyFusedInt8GEMM().apply(model, "torch_int_mm")

    def installed(patcher):
        return rc.sampler_sample_wrapper in sum(patcher.wrappers.get(pe.WrappersMP.SAMPLER_SAMPLE, {}).values(), [])

    g = torch.Generator().manual_seed(1)
    ctx = torch.randn(1, 12, w["text"], generator=g)
    mask = torch.ones(1, 12)
    seen = {}

    def spy(executor, guider, *args, **kwargs):
        # A copy of the run's conds structure (lists, dicts), moved to meta; the run itself goes on, on the CPU.
        conds = {k: [dict(c, model_conds=dict(c["model_conds"])) for c in v] for k, v in guider.conds.items()}
        before = {k: [dict(c["model_conds"]) for c in v] for k, v in conds.items()}
        n, undo = rc.move_conds(types.SimpleNamespace(conds=conds), torch.device("meta"))
        after = [(b[k], c["model_conds"][k]) for key in conds for b, c in zip(before[key], conds[key])
                 for k in b]
        moved = [(o, m) for o, m in after if o is not m]
        undo()
        seen["undone"] = all(c["model_conds"][k] is b[k] for key in conds for b, c in zip(before[key], conds[key])
                             for k in b)
        seen.update(
            moved_bytes=n, classes=sorted(type(o).__name__ for o, _ in after),
            classes_after=sorted(type(m).__name__ for _, m in after),
            moved_devices=sorted({str(m.cond.device) for _, m in moved}),
            moved_shapes_equal=all(o.cond.shape == m.cond.shape and o.cond.dtype == m.cond.dtype for o, m in moved),
            originals_on_cpu=all(o.cond.device.type == "cpu" for o, _ in moved),
            constants_kept=all(o is m for o, m in after if isinstance(o, comfy.conds.CONDConstant)))
        dual = types.SimpleNamespace(_uncond_conds=[{"model_conds": {"c_crossattn": comfy.conds.CONDCrossAttn(ctx)}}])
        seen["dual_moved_bytes"] = rc.move_conds(dual, torch.device("meta"))[0]
        seen["dual_device"] = str(dual._uncond_conds[0]["model_conds"]["c_crossattn"].cond.device)
        return executor(guider, *args, **kwargs)

    def sample(patcher):  # the harness' CFG sampling (euler, 2 steps, image-only negative)
        return sample_image_only_cfg(patcher, [[ctx, {"attention_mask": mask}]], torch.zeros(1, 128, 4, 4), cfg=3.0)

    spied = applied.clone()
    spied.add_wrapper_with_key(pe.WrappersMP.SAMPLER_SAMPLE, "test_spy", spy)
    rc.stats.update(runs=0, moved_bytes=0)
    on = sample(spied)
    bare = applied.clone()  # the same model without the wrapper, as ComfyUI samples it
    for key in [k for k, fns in bare.wrappers.get(pe.WrappersMP.SAMPLER_SAMPLE, {}).items()
                if rc.sampler_sample_wrapper in fns]:
        bare.remove_wrappers_with_key(pe.WrappersMP.SAMPLER_SAMPLE, key)
    assert not installed(bare)
    off = sample(bare)
    return {**seen, "user_cond_on_cpu": ctx.device.type == "cpu" and mask.device.type == "cpu",
            "runs_seen": rc.stats["runs"], "moved_in_cpu_run": rc.stats["moved_bytes"],
            "same_latent": bool(torch.equal(on, off)), "latent_finite": bool(torch.isfinite(on).all()),
            "installed": installed(applied),
            "installed_bf16": installed(pack.nodes.apply.ApplyFusedInt8GEMM().apply(model, "bf16")[0])}
