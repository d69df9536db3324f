"""INT8 layers in current ComfyUI's (0.33.0) memory manager, on the CPU: a partial (lowvram) load of an Apply'd
Ideogram 4 marks offloaded layers ``comfy_cast_weights``, counts their true size, gives the same output as the
full load, and such a layer fetches its int8 weight through ComfyUI's own ``comfy.ops.cast_bias_weight`` (int8
in, int8 out: never cast) when the compute device differs ('meta' stands in for the GPU: on a CPU-only machine
the offload and compute devices are the same, so the forward needs no fetch).

(DynamicVRAM's vbar path needs a GPU: bench/e2e_sampler.py measured it on the H200, bench/RESULTS.md.)
"""
import torch


def test_partial_load_fetches_int8_through_comfy_cast(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    assert res["offloaded"] > 0 and res["weights_stay_offloaded"]
    assert res["cast_calls"] == 1 and res["cast_dtypes"] == ["torch.int8"]
    assert res["full_vs_partial"] == 0.0  # same int8 operands, same kernels: bit-identical
    assert res["module_size"] == res["int8_bytes"]  # ComfyUI's module_size: weight + scales, nothing hidden
    assert res["fetched"] == ["int8", "meta"] and res["weight_after_fetch"] == "cpu"


def body(pack, models) -> dict:
    import sys
    import comfy.model_management as mm
    import comfy.ops
    import comfy.sd
    i4 = sys.modules["comfyui_int8_fused.adapters.ideogram4.layout"]
    Int8Linear = sys.modules["comfyui_int8_fused.quant.linear"].Int8Linear
    from comfy_harness import narrow_ideogram4
    w = narrow_ideogram4()  # ComfyUI's Ideogram 4 config at narrow widths
    sd = i4.random_state_dict(1, w, seed=2)
    model = comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": torch.bfloat16})
    (q,) = pack.nodes.apply.ApplyFusedInt8GEMM().apply(model, "torch_int_mm")
    cpu = torch.device("cpu")

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 128, 4, 4, generator=g).to(torch.bfloat16)
    ctx = torch.randn(1, 8, w["text"], generator=g).to(torch.bfloat16)

    def run():
        with torch.no_grad():
            return q.model.apply_model(x, torch.tensor([0.6]), c_crossattn=ctx).float()

    q.patch_model(cpu)  # full load
    full = run()
    q.unpatch_model(cpu)
    seen = []
    real = comfy.ops.cast_bias_weight

    def spy(s, *a, **kw):
        if isinstance(s, Int8Linear):
            seen.append(str(kw.get("dtype")))
        return real(s, *a, **kw)

    comfy.ops.cast_bias_weight = spy
    try:
        q.patch_model(cpu, lowvram_model_memory=64 * 1024)  # partial: almost every layer offloaded
        int8 = [m for m in q.model.modules() if isinstance(m, Int8Linear)]
        offloaded = [m for m in int8 if m.comfy_cast_weights]
        partial = run()
        stay = all(m.weight.device == cpu for m in offloaded)
        sizes = sum(mm.module_size(m) for m in int8)
        int8_bytes = sum(m.weight.numel() + 4 * m.weight_scale.numel() for m in int8)
        with offloaded[0].operands(torch.device("meta")) as t:
            fetched = [str(t.qweight.dtype).replace("torch.", ""), t.qweight.device.type]
        after = offloaded[0].weight.device.type
    finally:
        comfy.ops.cast_bias_weight = real
        q.unpatch_model(cpu)
    return {"offloaded": len(offloaded), "weights_stay_offloaded": stay, "cast_calls": len(seen),
            "cast_dtypes": sorted(set(seen)), "full_vs_partial": float((full - partial).abs().max()),
            "module_size": sizes, "int8_bytes": int8_bytes, "fetched": fetched, "weight_after_fetch": after}
