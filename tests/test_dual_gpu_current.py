"""nodes/dual_gpu.py (issue 51 item 2): Dual Model Guider (two GPUs) gives ComfyUI 0.33.0's DualModelGuider output bit
for bit, with the unconditional call run in the device's worker thread at the same time as the conditional one.

On the CPU the CPU stands in for both devices (``concurrent=True``): two tiny Flux.1 backbones (different weights:
the conditional and unconditional one) through Apply (torch_int_mm: the pack's INT8 layers and wrappers, without the
Triton interpreter, which cannot run in two threads at once), sampled 2 euler steps at cfg 4 with a negative
conditioning by ComfyUI's ``Guider_DualModel`` and by ``Guider_DualModelTwoDevices``: equal outputs, every step's
unconditional call in the worker thread and every conditional call in the sampling thread. Also: cfg 1 runs the
conditional backbone only, as DualModelGuider does; the node refuses a device the machine lacks, naming the ones it
has; the node builds the same guider."""


def test_two_device_guider_equals_dual_model_guider(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res)
    assert res["equal"] and res["rel_to_one_backbone"] > 0, res  # both backbones count in the output
    assert res["uncond_threads"] and all(t != res["main_thread"] for t in res["uncond_threads"]), res
    assert set(res["cond_threads"]) == {res["main_thread"]} and len(res["uncond_threads"]) == 2, res
    assert res["cfg1_uncond_calls"] == 0 and res["cfg1_equal"], res
    assert "cuda:7" in res["bad_device"] and "cpu" in res["bad_device"], res["bad_device"]
    assert res["node_guider"] == "Guider_DualModelTwoDevices" and res["node_equal"], res


def body(pack, models) -> dict:
    """Runs inside ComfyUI 0.33.0 (subprocess)."""
    import threading

    import torch
    import comfy.samplers
    from comfy_extras.nodes_custom_sampler import Guider_DualModel
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))  # noqa: F821 (runpy sets __file__)
    import test_torch_compile_current as tc

    torch.manual_seed(0)
    cond_m = tc._tiny_flux_patcher(torch.bfloat16)
    torch.manual_seed(1)
    uncond_m = tc._tiny_flux_patcher(torch.bfloat16)
    apply = pack.nodes.apply.ApplyFusedInt8GEMM().apply
    (cond_m,) = apply(cond_m, "torch_int_mm", attention="math")
    (uncond_m,) = apply(uncond_m, "torch_int_mm", attention="math")
    g = torch.Generator().manual_seed(2)
    pos = [[torch.randn(1, 6, 64, generator=g), {"pooled_output": torch.randn(1, 64, generator=g), "guidance": 3.5}]]
    neg = [[torch.randn(1, 6, 64, generator=g), {"pooled_output": torch.randn(1, 64, generator=g), "guidance": 3.5}]]
    latent = torch.zeros(1, 16, 8, 8)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(3))

    calls = []
    orig = comfy.samplers.calc_cond_batch

    def counted(model, conds, *a, **kw):
        calls.append((model.diffusion_model is uncond_m.model.diffusion_model, threading.get_ident()))
        return orig(model, conds, *a, **kw)
    comfy.samplers.calc_cond_batch = counted

    def run(guider, cfg=4.0):
        guider.set_conds(pos, neg)
        guider.set_cfg(cfg)
        sigmas = comfy.samplers.calculate_sigmas(cond_m.get_model_object("model_sampling"), "simple", 2)
        calls.clear()
        out = guider.sample(noise, latent, comfy.samplers.sampler_object("euler"), sigmas, disable_pbar=True, seed=0)
        return out.float(), list(calls)

    cls = pack.nodes.dual_gpu.guider_class()
    ref, _ = run(Guider_DualModel(cond_m, uncond_m))
    got, seen = run(cls(cond_m, uncond_m, torch.device("cpu"), concurrent=True))
    one, _ = run(comfy.samplers.CFGGuider(cond_m), cfg=1.0)
    res = {"equal": bool(torch.equal(got, ref)),
           "rel_to_one_backbone": float((ref - one).norm() / one.norm()),
           "main_thread": threading.get_ident(),
           "uncond_threads": [t for u, t in seen if u], "cond_threads": [t for u, t in seen if not u]}
    got1, seen1 = run(cls(cond_m, uncond_m, torch.device("cpu"), concurrent=True), cfg=1.0)
    ref1, _ = run(Guider_DualModel(cond_m, uncond_m), cfg=1.0)
    res["cfg1_uncond_calls"] = sum(u for u, _ in seen1)
    res["cfg1_equal"] = bool(torch.equal(got1, ref1))
    node = pack.nodes.dual_gpu.DualModelGuiderTwoGPUs()
    try:
        node.get_guider(cond_m, uncond_m, pos, 4.0, "cuda:7", neg)
        res["bad_device"] = "no error"
    except ValueError as e:
        res["bad_device"] = str(e)
    (guider,) = node.get_guider(cond_m, uncond_m, pos, 4.0, pack.nodes.dual_gpu.SAME, neg)
    res["node_guider"] = type(guider).__name__
    guider.set_conds(pos, neg)
    node_out, _ = run(guider)
    res["node_equal"] = bool(torch.equal(node_out, ref))
    comfy.samplers.calc_cond_batch = orig
    return res
