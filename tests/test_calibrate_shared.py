"""Layers that read one activation share one SmoothQuant vector (issue 35 item 2), on the tiny Lumina 2 DiT in the
pinned ComfyUI (in-process, CPU, TRITON_INTERPRET=1).

Before, INT8 Calibrate gave SwiGLU's w1 and w3 a vector each. ``quant.blocks.merge_int8`` refuses to merge such a
pair, so on fused_triton a calibrated Ideogram 4, Lumina 2 or Z-Image kept every block on the per-linear path (the
CPU tests used the unfused backends, so only the H200 would have shown it).

* w1 and w3 of every block carry the same vector, and it is the SmoothQuant formula (alpha 0.5, geometric mean 1 over
  live channels) on the FeedForward input's channel absmax, seen by the test's own hook, and the column absmax over
  both weights, in float64; qkv's vector is its own;
* Apply (fused_triton) with the calibration connected fuses every block it fuses without it, and the sampled output
  stays within 2e-3 (relative L2) of the per-linear INT8 path with the same calibration (torch_int_mm).
"""
import pytest
import torch

import comfy_harness as H

ALPHA = 0.5
REL_FUSED = 2e-3


def conditioning(seed, tokens=8, width=64):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, tokens, width, generator=g), {}]]


LATENT = {"samples": torch.zeros(1, 16, 16, 16)}


@pytest.fixture(scope="module")
def calibrated(comfy_inprocess, pack):
    model = H.load_tiny("lumina2")
    root = model.model.diffusion_model
    ffn_in = {}  # block name -> float64 channel absmax of the FeedForward input, from the test's own hooks

    def hook(name):
        def pre(mod, args):
            a = args[0].detach().double().reshape(-1, args[0].shape[-1]).abs().amax(0)
            ffn_in[name] = a if name not in ffn_in else torch.maximum(ffn_in[name], a)
        return pre
    blocks = {n[: -len(".feed_forward")]: m for n, m in root.named_modules() if n.endswith(".feed_forward")}
    handles = [m.w1.register_forward_pre_hook(hook(b)) for b, m in blocks.items()]
    try:
        out = pack.nodes.calibrate.Int8Calibrate().calibrate(
            model, conditioning(1), LATENT, seed=1, steps=2, cfg=2.0, sampler_name="euler", scheduler="simple",
            alpha=ALPHA, alpha_search=False, protect_top_k=0, protect_threshold=0.0, preset="blocks", include="",
            exclude="", activation_scales="dynamic", negative=conditioning(101))
    finally:
        for h in handles:
            h.remove()
    return model, blocks, ffn_in, out["result"][0]


def smoothquant_f64(act, wcol, alpha):
    live = (act > 0) & (wcol > 0)
    log_s = alpha * act.clamp(min=1e-30).log() - (1 - alpha) * wcol.clamp(min=1e-30).log()
    log_s = log_s - log_s[live].mean()
    return torch.where(live, log_s.exp().clamp(1e-4, 1e4), torch.ones_like(log_s))


def test_w1_w3_share_the_formula_vector(calibrated):
    model, blocks, ffn_in, cal = calibrated
    assert blocks and set(ffn_in) == set(blocks)
    for b, ff in blocks.items():
        l1, l3 = cal.layers[f"{b}.feed_forward.w1"], cal.layers[f"{b}.feed_forward.w3"]
        assert l1.smooth is not None and torch.equal(l1.smooth, l3.smooth), b
        wcol = torch.maximum(ff.w1.weight.detach().double().abs().amax(0), ff.w3.weight.detach().double().abs().amax(0))
        torch.testing.assert_close(l1.smooth.double(), smoothquant_f64(ffn_in[b], wcol, ALPHA), rtol=1e-5, atol=0)
        assert not torch.equal(l1.smooth, cal.layers[f"{b}.attention.qkv"].smooth)
        assert l1.err_smoothed > 0 and l3.err_smoothed > 0
    # every FeedForward (layers, noise_refiner, context_refiner), in model order: nothing else reads one input twice
    assert cal.meta["shared_smoothing"] == [[n, n[:-1] + "3"] for n in cal.layers if n.endswith("feed_forward.w1")]
    assert len(cal.meta["shared_smoothing"]) == len(blocks)


@pytest.mark.slow
def test_calibrated_apply_stays_fused_and_matches_per_linear(calibrated, pack, comfy_inprocess):
    import comfy.sample
    model, blocks, _, cal = calibrated
    apply = pack.nodes.apply.ApplyFusedInt8GEMM()

    def fused_types(m):
        return sorted(type(v).__name__ for v in m.object_patches.values() if type(v).__name__.startswith("Fused"))
    (plain,) = apply.apply(model, "fused_triton", "blocks", "", "", "")
    (fused,) = apply.apply(model, "fused_triton", "blocks", "", "", "", calibration=cal)
    assert fused_types(plain) and fused_types(fused) == fused_types(plain)
    assert fused.int8_report.smoothed == len(cal.layers)
    (per_linear,) = apply.apply(model, "torch_int_mm", "blocks", "", "", "", calibration=cal)

    def sample(m):
        lat = LATENT["samples"]
        return comfy.sample.sample(m, comfy.sample.prepare_noise(lat, 7), 1, 2.0, "euler", "simple",
                                   conditioning(7), conditioning(107), lat, seed=7, disable_pbar=True)
    a, b = sample(fused), sample(per_linear)
    assert torch.isfinite(a).all()
    assert float((a.double() - b.double()).norm() / b.double().norm()) < REL_FUSED
