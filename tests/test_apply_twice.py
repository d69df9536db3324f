"""Two "Apply Fused INT8 GEMM" variants of one loaded model, sampled in turn (the side-by-side comparison users wire),
on the pinned ComfyUI in-process (legacy ModelPatcher, CPU).

Every clone of a loaded model shares its module tree: while the clone of Apply A is loaded, A's object patches (on
``fused_triton``: whole fused blocks) sit in that tree, and ComfyUI keeps the modules they replaced in the shared
``object_patches_backup``. Apply B on the same float base must read the float linears under those originals, not
the fused blocks' children. Sequence: load -> Apply A (fused_triton) -> sample A -> Apply B -> sample B -> sample A
-> sample the base. Reference: each variant built on its own freshly loaded model and sampled alone (with
``unload_all_models()`` before it). On the CPU every path is deterministic, so each output must be the same bits as
its reference; the base must equal the float model's. B's object patches must be the fresh B's names, types and
int8 weights. The server test runs the same comparison as one prompt with one UNETLoader feeding both Apply nodes
(ComfyUI runs the first Apply's KSampler before the second Apply: a ready node that feeds an output node goes first).
Run: bash scripts/test.sh tests/test_apply_twice.py
"""
import pytest
import torch

import comfy_harness as H

PREFIX = "diffusion_model."
A = ("fused_triton", {}, True)
VARIANTS = {  # name: (backend, Apply inputs, INT8_FUSED_FUSION)
    "torch_int_mm": ("torch_int_mm", {}, True),
    "fusion_off": ("fused_triton", {}, False),
    "modulation": ("fused_triton", {"preset": "blocks+modulation"}, True),
}
CASES = [("flux", "torch_int_mm"), ("lumina2", "fusion_off"), ("flux", "modulation")]


@pytest.fixture(scope="module")
def env(comfy_inprocess, pack):
    import comfy.model_management
    import comfy.sample
    return pack, comfy.sample, comfy.model_management


def _apply(pack, base, variant):
    backend, kw, fusion = variant
    with pack.kernel.config.override(INT8_FUSED_FUSION=fusion):
        return pack.nodes.apply.ApplyFusedInt8GEMM().apply(base, backend, **kw)[0]


def _sample(cs, model, arch):
    g = torch.Generator().manual_seed(1)
    ctx = torch.randn(1, 8, 64, generator=g)
    extra = {"pooled_output": torch.randn(1, 64, generator=g)} if arch == "flux" else {}
    latent, noise = torch.zeros(1, 16, 8, 8), torch.randn(1, 16, 8, 8, generator=g)
    pos = [[ctx, extra]]
    return cs.sample(model, noise, 1, 1.0, "euler", "simple", pos, pos, latent, seed=0, disable_pbar=True).float()


def _int8_state(pack, patcher):
    """{name: (patch type, {int8 layer: (int8 weight, scale)})} of a clone's object patches."""
    layers = pack.nodes.weights.int8_layers(patcher)
    return {k: type(m).__name__ for k, m in patcher.object_patches.items()}, \
        {n: (m.weight, m.weight_scale) for n, m in layers.items()}


def _fresh(env, arch, variant):
    """(output, object patch state) of ``variant`` (None: the float model) on its own freshly loaded model."""
    pack, cs, mm = env
    mm.unload_all_models()
    m = H.load_tiny(arch)
    if variant is not None:
        m = _apply(pack, m, variant)
    return _sample(cs, m, arch), _int8_state(pack, m)


def _same_state(got, want):
    (types, layers), (types0, layers0) = got, want
    assert types == types0
    assert layers.keys() == layers0.keys()
    for n, (w, s) in layers.items():
        assert torch.equal(w, layers0[n][0]) and torch.equal(s, layers0[n][1]), n


def _tree_types(patcher):
    return {type(m).__name__ for m in patcher.model.diffusion_model.modules()}


@pytest.mark.slow
@pytest.mark.parametrize("arch,name", CASES)
def test_second_apply_after_sampling_the_first_matches_each_alone(env, arch, name):
    pack, cs, mm = env
    ref = {"a": _fresh(env, arch, A), "b": _fresh(env, arch, VARIANTS[name]), "float": _fresh(env, arch, None)}
    mm.unload_all_models()
    base = H.load_tiny(arch)
    a = _apply(pack, base, A)
    out_a = _sample(cs, a, arch)
    assert base.object_patches_backup, "A's object patches are not in the shared tree: nothing is tested"
    b = _apply(pack, base, VARIANTS[name])  # raised "no linear layer matches" when A's fused blocks were loaded
    _same_state(_int8_state(pack, b), ref["b"][1])
    _same_state(_int8_state(pack, a), ref["a"][1])
    out_b = _sample(cs, b, arch)
    out_a2 = _sample(cs, a, arch)
    out_f = _sample(cs, base, arch)
    assert "Int8Linear" not in _tree_types(base) and not base.object_patches
    assert torch.equal(out_a, ref["a"][0]) and torch.equal(out_a2, ref["a"][0])
    assert torch.equal(out_b, ref["b"][0])
    assert torch.equal(out_f, ref["float"][0])
    assert not torch.equal(out_a, out_f) and not torch.equal(out_b, out_f)  # the INT8 variants did run


def test_server_one_loader_two_apply_nodes_fused_first(comfy_server, miniature_models, env):
    """One prompt: UNETLoader -> Apply fused_triton -> KSampler, -> Apply torch_int_mm -> KSampler, and the float
    KSampler. Reference: the same node functions in this process, each variant on its own UNETLoader load."""
    import nodes
    from test_apply_server import _latent, side_by_side_workflow
    pack, _, mm = env
    arch, unet, backends = "lumina2", miniature_models["lumina2"], ("fused_triton", "torch_int_mm")
    wf = side_by_side_workflow(unet, arch, backends=backends, steps=1)
    files = comfy_server.output_files(comfy_server.wait(comfy_server.queue(wf), timeout=1500))
    got = {k: _latent(next(f for f in files if f.name.startswith(f"apply_{arch}_{k}_"))).float()
           for k in ("float",) + backends}
    inputs = {k: v["inputs"] for k, v in wf.items()}
    cond = pack.nodes.conditioning.Int8TestConditioning().make(**inputs["cond"])[0]
    latent = nodes.EmptyLatentImage().generate(**inputs["latent"])[0]
    for k, t in got.items():
        mm.unload_all_models()
        model = nodes.UNETLoader().load_unet(unet, "default")[0]
        if k != "float":
            kw = {n: v for n, v in inputs[f"apply{backends.index(k)}"].items() if n != "model"}
            model = pack.nodes.apply.ApplyFusedInt8GEMM().apply(model, **kw)[0]
        kw = {n: v for n, v in inputs[f"sample_{k}"].items() if n not in ("model", "positive", "negative",
                                                                          "latent_image")}
        want = nodes.KSampler().sample(model, positive=cond, negative=cond, latent_image=latent, **kw)[0]["samples"]
        assert torch.equal(t, want.float()), (k, (t - want).abs().max().item())
    mm.unload_all_models()
    assert not torch.equal(got["fused_triton"], got["float"])
    assert "INT8 Apply [fused_triton, preset blocks]:" in comfy_server.log_tail(400)
