"""Apply Fused INT8 GEMM in-process on the pinned ComfyUI (CPU): tiny Lumina 2 and Flux DiTs.

Model-level error bound
-----------------------
tests/test_linear.py derives the per-element variance of one W8A8 layer's output error (eq. (1)):
    var_mn = dx_m^2 / 12 * ||W_n||^2 + dw_n^2 / 12 * ||x_m||^2,   dx_m = max|x_m| / 127, dw_n = max|W_n| / 127
and checks it within +-25 %. Through the whole model these per-layer errors are small perturbations
(~1 %) that propagate to the output linearly to first order, so the output error of the INT8 model
has the same size as the output change of the FLOAT model when independent Gaussian noise of exactly
that variance (computed from each layer's actual input and weight) is added to every selected layer's
output. We measure that prediction (rms over two noise draws) and assert

    0.7 * predicted <= ||y_int8 - y_float|| <= 1.4 * predicted.

Measured ratios are 0.93-1.05 for both architectures in fp32, bf16, fp16 and from fp8 weights; the
window allows for the two noise draws and second-order terms. It makes no assumption about gates or
residual gains (in these miniatures the adaLN gates shrink block outputs, so the model error is ~1e-3
while single layers err by ~1 %): a broken scale, a dropped bias or smoothing, or a layer that silently
stays float would fall outside it.
"""
import logging
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
PREFIX = "diffusion_model."
QMAX = 127.0


@pytest.fixture(scope="module")
def comfy(comfy_inprocess):
    import comfy.lora
    import comfy.model_management
    import comfy.model_patcher
    import comfy.ops
    import comfy.supported_models
    return comfy


@pytest.fixture(scope="module")
def node(pack):
    return pack.nodes.apply.ApplyFusedInt8GEMM()


def _miniature():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import miniature
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return miniature


def tiny(comfy, arch, dtype=torch.float32, manual_cast=None, seed=0):
    """ModelPatcher of the width-128 miniature with weights stored in ``dtype`` (fp8: manual cast)."""
    mini = _miniature()
    cls = {"lumina2": comfy.supported_models.Lumina2, "flux": comfy.supported_models.Flux}[arch]
    mc = cls(dict(mini.TINY_UNET_CONFIG[arch]))
    mc.set_inference_dtype(dtype, manual_cast)
    model = mc.get_model({}, "", device=CPU)
    model.diffusion_model.load_state_dict(mini.tiny_state_dict(arch, seed), strict=True)
    return comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)


def run(comfy, mp, arch, seed=1):
    """One denoiser call of ``mp`` the way samplers load it (load_models_gpu, object patches)."""
    comfy.model_management.load_models_gpu([mp])
    g = torch.Generator().manual_seed(seed)
    x, ctx = torch.randn(1, 16, 8, 8, generator=g), torch.randn(1, 8, 64, generator=g)
    extra = {"num_tokens": 8} if arch == "lumina2" else {"y": torch.randn(1, 64, generator=g)}
    with torch.no_grad():
        return mp.model.apply_model(x, torch.tensor([0.6]), c_crossattn=ctx, **extra).float()


def apply(node, mp, backend, **kw):
    return node.apply(mp, backend, **kw)[0]


def int8_names(patched):
    return [k[len(PREFIX):] for k in patched.object_patches if k.startswith(PREFIX)]


def _noise_hook(g):
    def hook(m, inputs, out):
        x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
        w = m.weight.to(torch.float64)
        dx2 = (x.abs().amax(1) / QMAX) ** 2 / 12
        dw2 = (w.abs().amax(1) / QMAX) ** 2 / 12
        var = dx2[:, None] * (w * w).sum(1)[None, :] + dw2[None, :] * (x * x).sum(1)[:, None]
        noise = torch.randn(var.shape, generator=g, dtype=torch.float64) * var.sqrt()
        return out + noise.reshape(out.shape).to(out.dtype)
    return hook


def predicted_error(comfy, mp, arch, names, ref) -> float:
    """rms over two draws of ||y_float+noise - y_float|| (see the module docstring)."""
    mods = [mp.get_model_object(PREFIX + n) for n in names]  # the float originals
    errs = []
    for seed in (100, 101):
        g = torch.Generator().manual_seed(seed)
        hooks = [m.register_forward_hook(_noise_hook(g)) for m in mods]
        try:
            errs.append((run(comfy, mp, arch) - ref).norm().item())
        finally:
            for h in hooks:
                h.remove()
    return (sum(e * e for e in errs) / len(errs)) ** 0.5


CASES = [("lumina2", torch.float32, None), ("lumina2", torch.bfloat16, None),
         ("lumina2", torch.float8_e4m3fn, torch.float32), ("flux", torch.float32, None),
         ("flux", torch.bfloat16, None), ("flux", torch.float16, None)]


@pytest.mark.parametrize("arch,dtype,cast", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_int8_output_within_propagated_w8a8_bound(comfy, node, arch, dtype, cast):
    mp = tiny(comfy, arch, dtype, cast)
    ref = run(comfy, mp, arch)
    q = apply(node, mp, "torch_int_mm")
    names = int8_names(q)
    assert len(names) == 20  # blocks preset: 5 linears x 4 blocks (lumina2) / 4 + 2 per block (flux)
    assert not any("mod" in n.lower() or "embed" in n or "final" in n for n in names)
    out = run(comfy, q, arch)
    err = (out - ref).norm().item()
    pred = predicted_error(comfy, mp, arch, names, ref)
    assert 0.7 * pred <= err <= 1.4 * pred, (err, pred)
    assert err < 0.01 * ref.norm().item()
    if cast is not None:  # fp8 checkpoint: quantized from the fp8 weights decoded by ComfyUI's cast
        lin = mp.get_model_object(PREFIX + names[0])
        assert hasattr(lin, "comfy_cast_weights") and lin.weight.dtype == torch.float8_e4m3fn
        w = lin.weight.float()
        half_step = w.abs().amax(1, keepdim=True) / QMAX / 2
        assert ((q.object_patches[PREFIX + names[0]].dequantized_weight() - w).abs() <= half_step * 1.0001).all()


def test_unpatch_exact_and_input_model_untouched(comfy, node):
    mp = tiny(comfy, "lumina2")
    ref = run(comfy, mp, "lumina2")
    sd = {k: v.clone() for k, v in mp.model.state_dict().items()}
    modules = dict(mp.model.diffusion_model.named_modules())
    obj, patches, uuid0 = dict(mp.object_patches), dict(mp.patches), mp.patches_uuid
    q = apply(node, mp, "torch_int_mm")
    run(comfy, q, "lumina2")
    assert run(comfy, mp, "lumina2").equal(ref)                    # bit-identical after unpatching
    assert mp.object_patches == obj and mp.patches == patches and mp.patches_uuid == uuid0
    assert dict(mp.model.diffusion_model.named_modules()) == modules  # originals back in the tree
    now = mp.model.state_dict()
    assert now.keys() == sd.keys() and all(now[k].equal(sd[k]) for k in sd)


def test_backends_agree_inside_the_model(comfy, node, pack):
    """dequant_bf16 / torch_int_mm / fused_triton multiply the same int8 operands (see test_backends);
    with fusion on, fused_triton replaces Lumina 2's FeedForward by a fused module (w1+w3 one GEMM,
    SwiGLU fused with w2's quantization) whose rounding differs: it must stay well inside the W8A8 error."""
    mp = tiny(comfy, "lumina2")
    ref = run(comfy, mp, "lumina2")
    a = run(comfy, apply(node, mp, "torch_int_mm"), "lumina2")
    d = run(comfy, apply(node, mp, "dequant_bf16"), "lumina2")
    assert (a - d).abs().max() <= 1e-5 * a.abs().max()
    ok, why = pack.kernel.triton_status(CPU)
    if not ok:
        pytest.skip(f"fused_triton: {why}")
    only = r"^(?!layers\.1\.)"  # one block: the interpreter runs ~1 s per kernel launch
    t_mp = apply(node, mp, "torch_int_mm", exclude=only)
    t = run(comfy, t_mp, "lumina2")
    with pack.kernel.config.override(INT8_FUSED_FUSION=False):
        plain = run(comfy, apply(node, mp, "fused_triton", exclude=only), "lumina2")
    assert (plain - t).abs().max() <= 1e-5 * t.abs().max()
    fq = apply(node, mp, "fused_triton", exclude=only)
    assert type(fq.object_patches[PREFIX + "layers.1"]).__name__ == "FusedLumina2Block"  # its FFN: FusedFeedForward
    assert type(fq.object_patches[PREFIX + "layers.1"].feed_forward).__name__ == "FusedFeedForward"
    fused = run(comfy, fq, "lumina2")
    assert (fused - t).norm() <= 0.5 * (t - ref).norm()
    # the per-layer view of a fused model: w1/w3 split back from the merged GEMM, equal to the plain layers
    layers = pack.nodes.weights.int8_layers(fq)
    assert set(layers) == set(int8_names(t_mp))
    for n in ("layers.1.feed_forward.w1", "layers.1.feed_forward.w3", "layers.1.attention.qkv"):
        plain_layer = t_mp.object_patches[PREFIX + n]
        assert layers[n].qweight.equal(plain_layer.qweight) and layers[n].weight_scale.equal(plain_layer.weight_scale)
    # ... which is what Save INT8 Model writes for a fused model (not the hidden float originals)
    quant, floats, _ = pack.nodes.save.collect(fq, "int8_fused")
    assert set(int8_names(t_mp)) == set(quant) and not any(k.startswith("layers.1.feed_forward.w") for k in floats)


def _lora(targets, rank=4, seed=3):
    """A small LoRA (lora_up/lora_down/alpha) for the named Linear shapes {name: (N, K)}."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (n, k) in targets.items():
        sd[f"{PREFIX}{name}.lora_down.weight"] = torch.randn(rank, k, generator=g) / k ** 0.5
        sd[f"{PREFIX}{name}.lora_up.weight"] = torch.randn(n, rank, generator=g) * 0.5 / rank ** 0.5
        sd[f"{PREFIX}{name}.alpha"] = torch.tensor(float(rank))
    return sd


def _with_lora(comfy, mp, lora, strength=1.0):
    """What LoraLoaderModelOnly does (comfy.sd.load_lora_for_models, model half)."""
    key_map = comfy.lora.model_lora_keys_unet(mp.model, {})
    loaded = comfy.lora.load_lora(lora, key_map)
    out = mp.clone()
    added = out.add_patches(loaded, strength)
    assert len(added) == len(loaded)
    return out


def test_lora_before_apply_changes_int8_output_like_float(comfy, node):
    mp = tiny(comfy, "lumina2")
    targets = {"layers.0.attention.qkv": (256, 128), "layers.1.feed_forward.w2": (512 // 1, 512)}
    w2 = mp.get_model_object(PREFIX + "layers.1.feed_forward.w2").weight
    targets["layers.1.feed_forward.w2"] = tuple(w2.shape)
    targets["layers.0.attention.qkv"] = tuple(mp.get_model_object(PREFIX + "layers.0.attention.qkv").weight.shape)
    targets["final_layer.linear"] = tuple(mp.get_model_object(PREFIX + "final_layer.linear").weight.shape)
    lora = _lora(targets)
    ref0 = run(comfy, mp, "lumina2")
    ml = _with_lora(comfy, mp, lora)
    refl = run(comfy, ml, "lumina2")
    q0 = apply(node, mp, "torch_int_mm")
    ql = apply(node, ml, "torch_int_mm")
    out0, outl = run(comfy, q0, "lumina2"), run(comfy, ql, "lumina2")
    d_float, d_int8 = refl - ref0, outl - out0
    assert d_float.norm() > 0.05 * ref0.norm()  # the LoRA matters
    assert (d_int8 - d_float).norm() <= 0.05 * d_float.norm()
    assert (outl - refl).norm() <= 0.01 * refl.norm()
    # merged layers' patches dropped from the clone; the float final layer keeps its patch
    assert f"{PREFIX}layers.0.attention.qkv.weight" in ml.patches
    assert f"{PREFIX}layers.0.attention.qkv.weight" not in ql.patches
    assert f"{PREFIX}final_layer.linear.weight" in ql.patches
    assert ql.int8_report.lora_patches_merged == 2
    # the float model with LoRA is still exact afterwards
    assert run(comfy, ml, "lumina2").equal(refl)


def test_lora_after_apply_runs_as_branch_not_weight_patch(comfy, node):
    """A LoRA after Apply leaves ComfyUI's weight patches at run start (tests/test_lora_runtime.py: its numerics)."""
    mp = tiny(comfy, "lumina2")
    q = apply(node, mp, "torch_int_mm")
    run(comfy, mp, "lumina2")  # float tree in place, as when LoraLoader runs on an unloaded model
    name = "layers.0.attention.qkv"
    late = _with_lora(comfy, q, _lora({name: tuple(mp.get_model_object(PREFIX + name).weight.shape)}))
    assert sys.modules[type(node).__module__].install_lora(late) == 1
    assert f"{PREFIX}{name}.weight" not in late.patches and q.object_patches[PREFIX + name].derived.lora is not None


def test_model_management_load_lowvram_unload(comfy, node, pack, caplog):
    """ComfyUI moves and counts Int8Linear: size accounting, partial (lowvram) load, unload."""
    Int8Linear = pack.quant.linear.Int8Linear
    mp = tiny(comfy, "flux")
    ref = run(comfy, mp, "flux")
    q = apply(node, mp, "dequant_bf16")
    with caplog.at_level(logging.INFO, logger="int8_fused"):
        out = run(comfy, q, "flux")
        run(comfy, q, "flux")
    loaded = [r.getMessage() for r in caplog.records if "INT8 model loaded on cpu" in r.getMessage()]
    assert len(loaded) == 1 and f"{q.model_size() / 2**20:.1f} MiB of weights" in loaded[0], loaded
    assert f"(the float model: {mp.model_size() / 2**20:.1f} MiB)" in loaded[0]
    mm = comfy.model_management
    assert q.model_size() == mm.module_size(q.model) < mp.model_size()  # counted as the INT8 tree
    listed = {n: m for _, _, n, m, _ in q._load_list()}
    int8 = {n: m for n, m in listed.items() if isinstance(m, Int8Linear)}
    assert len(int8) == 20  # ComfyUI's loader sees every INT8 layer (no-grad Parameters)
    assert q.model.model_loaded_weight_memory == q.model_size()
    # partial load: a budget far below the model size offloads (casts per call) most layers
    q.unpatch_model(CPU)
    q.patch_model(CPU, lowvram_model_memory=64 * 1024)
    assert q.model.model_lowvram and any(m.comfy_cast_weights for m in int8.values())
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        x, ctx = torch.randn(1, 16, 8, 8, generator=g), torch.randn(1, 8, 64, generator=g)
        low = q.model.apply_model(x, torch.tensor([0.6]), c_crossattn=ctx, y=torch.randn(1, 64, generator=g))
    assert low.float().equal(out)
    q.unpatch_model(CPU)
    assert not any(m.comfy_cast_weights for m in int8.values())
    mm.unload_all_models()
    assert run(comfy, mp, "flux").equal(ref)


def test_bad_inputs_have_clear_messages(comfy, node):
    mp = tiny(comfy, "flux")
    with pytest.raises(ValueError, match="unknown INT8 backend 'int4'"):
        apply(node, mp, "int4")
    with pytest.raises(ValueError, match=r"pattern 'blocks\(' is not a valid regular expression"):
        apply(node, mp, "torch_int_mm", include="blocks(")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        apply(node, mp, "bf16", keep_float="[")
    with pytest.raises(ValueError, match="no linear layer of Flux matches preset 'blocks'.*Widen 'include'"):
        apply(node, mp, "torch_int_mm", exclude=".")


def test_calibration_keep_float_second_apply_and_timing(comfy, node, pack, monkeypatch):
    mp = tiny(comfy, "lumina2")

    class Entry:
        def __init__(self, smooth=None, protected=False):
            self.smooth, self.protected = smooth, protected

    class Cal:  # duck-typed INT8_CALIBRATION
        layers = {"layers.0.attention.qkv": Entry(smooth=torch.rand(128) + 0.5),
                  "layers.0.attention.out": Entry(protected=True)}

        def for_layer(self, name, n, k):
            return self.layers.get(name)

    calls = []
    monkeypatch.setattr(pack.nodes.apply, "timing",
                        type("T", (), {"instrument": staticmethod(lambda mp, **kw: calls.append(kw))}))
    q = node.apply(mp, "torch_int_mm", keep_float=r"feed_forward\.w2", calibration=Cal(), unique_id="7")[0]
    names = set(int8_names(q))
    assert "layers.0.attention.out" not in names and not any("w2" in n for n in names)
    assert q.object_patches[PREFIX + "layers.0.attention.qkv"].smooth is not None
    assert q.int8_report.kept_float["layers.0.attention.out"] == "protected by calibration"
    assert calls == [{"node_id": "7", "backend": "torch_int_mm"}]
    node.apply(mp, "bf16", unique_id="8")
    assert calls[-1] == {"node_id": "8", "backend": "bf16"}
    # a second Apply on the patched model converts the rest and keeps the earlier layers
    q2 = apply(node, q, "dequant_bf16", preset="all")
    assert set(int8_names(q2)) > names
    assert q2.object_patches[PREFIX + "layers.0.attention.qkv"] is q.object_patches[PREFIX + "layers.0.attention.qkv"]
    assert torch.isfinite(run(comfy, q2, "lumina2")).all()
    guarded = q2.get_attachment("int8_fused_apply").names
    assert guarded == set(int8_names(q2))  # the LoRA guard covers the layers of both Apply nodes


def test_node_definition(pack, comfy):
    cls = pack.nodes.apply.ApplyFusedInt8GEMM
    assert pack.NODE_CLASS_MAPPINGS["ApplyFusedInt8GEMM"] is cls
    assert pack.NODE_DISPLAY_NAME_MAPPINGS["ApplyFusedInt8GEMM"] == "Apply Fused INT8 GEMM"
    spec = cls.INPUT_TYPES()
    choices = spec["required"]["backend"][0]
    assert choices == pack.quant.backends.available(CPU) and "bf16" in choices and "fp8_rowwise" not in choices
    assert spec["required"]["preset"][1]["default"] == "blocks"
    assert spec["optional"]["calibration"][0] == "INT8_CALIBRATION"
    for group in ("required", "optional"):
        for name, (_, opts) in spec[group].items():
            assert opts.get("tooltip"), name
    assert cls.CATEGORY == "quantization/int8" and cls.OUTPUT_TOOLTIPS and cls.RETURN_TYPES == ("MODEL",)
