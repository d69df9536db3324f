"""Ideogram 4 pad-token elision on a current ComfyUI (0.33.0, native Ideogram 4), on the CPU in fp32.

A 1-layer Ideogram 4 at narrow widths (ComfyUI fixes them in its config; the test narrows it first:
``comfy_harness.narrow_ideogram4``), random weights, loaded by core. Text conditioning of
12 tokens whose ``attention_mask`` ends in zeros (padding). Compared:

* ComfyUI's own masked computation (the plain MODEL): every attention call gets the block-diagonal mask over
  12 + 16 tokens;
* the MODEL out of "Apply Fused INT8 GEMM" (backend bf16, so only the elision differs) with
  ``INT8_FUSED_PAD_ELISION=1``: the attention calls get no mask and 8 + 16 tokens (recorded by an attention override
  that calls ComfyUI's function), and the image-token output equals the masked one within fp32 rounding.

Sensitivity controls (same model, same inputs): dropping one real text token changes the output by orders of
magnitude more than the tolerance, so a wrong elision would show. A batch of two rows padded to different lengths
keeps the rest masked and still matches. The Apply node's attention Router (ComfyUI 0.33.0's ``wrap_attn``) gives
the same output on the masked call (``cudnn``: torch's CPU kernel here) and on the elided one (``math``). Two CFG
sampling steps through the sampler (the conditioning's ``attention_mask`` reaching the model through core's
``extra_conds``) match too. The switch: on by default only for fused_triton, ``0`` off.
"""
import importlib
import types

import torch

TOL = 1e-5  # fp32: a different number of (exactly ignored) tokens changes only summation order


def test_pad_elision_equals_the_masked_computation(comfy_current):
    from comfy_harness import NARROW_IDEOGRAM4, run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res)
    h = NARROW_IDEOGRAM4["num_attention_heads"]
    assert res["ref_calls"] == [[[1, h, 28, 256], [1, 1, 28, 28]]]  # ComfyUI: masked, 12 text + 16 image tokens
    assert res["elided_calls"] == [[[1, h, 24, 256], None]]  # elided: no mask, 8 text + 16 image tokens
    assert res["err_elided"] <= TOL
    assert res["err_drop_real_token"] >= 1e3 * max(res["err_elided"], 1e-8)
    assert res["batch2_calls"] == [[[2, h, 26, 256], [2, 1, 26, 26]]] and res["err_batch2"] <= TOL
    assert res["err_sampled"] <= TOL and res["sampled_elisions"] == 2 and res["sampled_tokens_removed"] == 8
    # The attention Router on the same model: masked (bf16 keeps the mask by default) and elided; CPU SDPA kernels.
    (err_c, ran_c), (err_m, ran_m) = res["routed"]["cudnn_masked"], res["routed"]["math_elided"]
    assert err_c <= TOL and sum(ran_c.values()) == 1 and set(ran_c) <= {"flash", "math"}
    assert err_m <= TOL and ran_m == {"math": 1}
    assert res["switch"] == {"fused_triton": True, "torch_int_mm": False, "off": False, "bf16_on": True,
                             "not_ideogram4": False}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


class _Record:
    """An attention override that records (q shape, mask shape) and runs ComfyUI's own function."""

    def __init__(self):
        self.calls = []

    def __call__(self, func, *args, **kwargs):
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        self.calls.append([list(args[0].shape), None if mask is None else list(mask.shape)])
        return func(*args, **kwargs)


def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    import comfy.patcher_extension
    import comfy.sd
    i4 = importlib.import_module("comfyui_int8_fused.adapters.ideogram4.layout")
    pe = importlib.import_module("comfyui_int8_fused.adapters.ideogram4.pad_elision")
    from comfy_harness import narrow_ideogram4
    w = narrow_ideogram4()  # ComfyUI's Ideogram 4 config at narrow widths
    model = comfy.sd.load_diffusion_model_state_dict(i4.random_state_dict(1, w, seed=0, dtype=torch.float32),
                                                     {"dtype": torch.float32})
    dm = model.model.diffusion_model
    assert type(dm).__name__ == "Ideogram4Transformer2DModel"
    assert dm.layers[0].attention.qkv.weight.dtype == torch.float32
    node = pack.nodes.apply.ApplyFusedInt8GEMM()
    config = importlib.import_module(pack.__name__ + ".kernel.config")  # switches are read once
    with config.override(INT8_FUSED_PAD_ELISION="1"):
        (elided,) = node.apply(model, "bf16")

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 128, 4, 4, generator=g)
    ctx = torch.randn(1, 12, w["text"], generator=g)
    mask = torch.ones(1, 12)
    mask[:, 8:] = 0

    def call(patcher, c, m, xx=x):
        rec = _Record()
        to = {"wrappers": comfy.patcher_extension.copy_nested_dicts(patcher.wrappers),
              "optimized_attention_override": rec}
        with torch.no_grad():
            out = dm(xx, torch.full((xx.shape[0],), 0.4), context=c, attention_mask=m, transformer_options=to)
        return out, rec.calls

    ref, ref_calls = call(model, ctx, mask)
    got, elided_calls = call(elided, ctx, mask)

    def routed(patcher):  # the Apply node's attention Router instead of the recorder (ComfyUI 0.33.0's wrap_attn)
        router = patcher.model_options["transformer_options"]["optimized_attention_override"]
        to = {"wrappers": comfy.patcher_extension.copy_nested_dicts(patcher.wrappers),
              "optimized_attention_override": router}
        with torch.no_grad():
            out = dm(x, torch.full((1,), 0.4), context=ctx, attention_mask=mask, transformer_options=to)
        return _rel(out, ref), dict(router.counts)

    err_cudnn_masked, ran_cudnn_masked = routed(node.apply(model, "bf16", attention="cudnn")[0])
    with config.override(INT8_FUSED_PAD_ELISION="1"):
        err_math_elided, ran_math_elided = routed(node.apply(model, "bf16", attention="math")[0])
    drop, _ = call(model, ctx[:, :7], None)  # one real token fewer: what a wrong elision would look like

    x2 = torch.randn(2, 128, 4, 4, generator=g)
    ctx2 = torch.randn(2, 12, w["text"], generator=g)
    mask2 = torch.ones(2, 12)
    mask2[0, 7:], mask2[1, 10:] = 0, 0
    ref2, _ = call(model, ctx2, mask2, x2)
    got2, batch2_calls = call(elided, ctx2, mask2, x2)

    def sample(patcher):  # the harness' CFG sampling (euler, 2 steps, image-only negative)
        return sample_image_only_cfg(patcher, [[ctx, {"attention_mask": mask}]], torch.zeros(1, 128, 4, 4), cfg=3.0)

    s_ref = sample(model)
    pe.stats.clear()
    s_got = sample(elided)
    sampled = dict(pe.stats)

    glue = pack.nodes.pad_elision
    key = comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL

    def installed(backend, env=None, patcher=model):
        with config.override(INT8_FUSED_PAD_ELISION=env):
            if patcher is not model:
                return glue.install(patcher, backend)
            clone = patcher.clone()
            done = glue.install(clone, backend)
            assert done == bool(clone.get_wrappers(key, glue.KEY))
            return done

    flux_like = types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=torch.nn.Linear(1, 1)))
    switch = {"fused_triton": installed("fused_triton"), "torch_int_mm": installed("torch_int_mm"),
              "off": installed("fused_triton", "0"), "bf16_on": installed("bf16", "1"),
              "not_ideogram4": installed("fused_triton", patcher=flux_like)}
    assert not node.apply(model, "bf16")[0].get_wrappers(key, glue.KEY)  # default: bf16 stays as ComfyUI runs it
    return {"ref_calls": ref_calls, "elided_calls": elided_calls, "err_elided": _rel(got, ref),
            "err_drop_real_token": _rel(drop, ref), "batch2_calls": batch2_calls, "err_batch2": _rel(got2, ref2),
            "err_sampled": _rel(s_got, s_ref), "sampled_elisions": sampled.get("calls", 0),
            "sampled_tokens_removed": sampled.get("tokens_removed", 0), "switch": switch,
            "routed": {"cudnn_masked": [err_cudnn_masked, ran_cudnn_masked],
                       "math_elided": [err_math_elided, ran_math_elided]}}
