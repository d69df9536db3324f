"""Model adapters (adapters/): the registry resolves ComfyUI's own model classes (pinned 0.3.75 in-process, the current
ComfyUI in a subprocess), architectures without an adapter get per-linear INT8 only, each adapter's presets select
what the generic presets select, and each fused adapter's forward equals the unfused INT8 path within rounding on
tiny models built from ComfyUI's classes. Also: no ``__globals__`` reach in the pack's torch code, and importing
``adapters`` imports neither ComfyUI nor Triton.

Run: TRITON_INTERPRET=1 .runtime/venv/bin/python -m pytest tests/test_adapters.py -q
"""
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
REL = 5e-3  # fused vs per-linear INT8, relative L2 (an activation code flipping by one here and there)

# ComfyUI class -> adapter name (None: no adapter). The pinned 0.3.75 lacks some (skipped there by import).
CLASSES = {
    "comfy.ldm.ideogram4.model.Ideogram4Transformer2DModel": "ideogram4",
    "comfy.ldm.lumina.model.NextDiT": "lumina2",
    "comfy.ldm.lumina.model.NextDiTPixelSpace": "lumina2",
    "comfy.ldm.flux.model.Flux": "flux",
    "comfy.ldm.chroma.model.Chroma": "flux",
    "comfy.ldm.chroma_radiance.model.ChromaRadiance": "flux",
    "comfy.ldm.qwen_image.model.QwenImageTransformer2DModel": "qwen_image",
    "comfy.ldm.wan.model.WanModel": "wan",
    "comfy.ldm.wan.model.VaceWanModel": "wan",
    "comfy.ldm.wan.model.CameraWanModel": "wan",
    "comfy.ldm.wan.ar_model.CausalWanModel": "wan",
    "comfy.ldm.modules.diffusionmodules.mmdit.OpenAISignatureMMDITWrapper": "sd3",
    "comfy.ldm.hidream.model.HiDreamImageTransformer2DModel": None,
    "comfy.ldm.aura.mmdit.MMDiT": None,   # AuraFlow's MMDiT: the same class name as SD3's, another class
}


def resolved_names(pack) -> dict:
    """{class path: adapter name or None} for each class of CLASSES the running ComfyUI has."""
    import importlib
    out = {}
    for path in CLASSES:
        module, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        a = pack.adapters.adapter_for(cls)
        out[path] = None if a is None else a.name
    return out


def per_linear_models(device="meta") -> dict:
    """Tiny Wan 2.x, Qwen-Image and SD3 diffusion models from ComfyUI's classes (no storage on ``meta``)."""
    import comfy.ldm.modules.diffusionmodules.mmdit as mmdit
    import comfy.ldm.qwen_image.model as qwen
    import comfy.ldm.wan.model as wan
    import comfy.ops
    kw = dict(device=device, dtype=torch.float32, operations=comfy.ops.disable_weight_init)
    return {
        "wan": wan.WanModel(dim=64, ffn_dim=128, freq_dim=32, text_dim=32, num_heads=2, num_layers=2, text_len=8,
                            **kw),
        "qwen_image": qwen.QwenImageTransformer2DModel(in_channels=16, out_channels=4, num_layers=2,
                                                       attention_head_dim=32, num_attention_heads=2,
                                                       joint_attention_dim=32, pooled_projection_dim=32,
                                                       axes_dims_rope=(8, 12, 12), **kw),
        "sd3": mmdit.OpenAISignatureMMDITWrapper(
            patch_size=2, in_channels=16, depth=2, adm_in_channels=32, pos_embed_max_size=16, num_patches=256,
            context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 32, "out_features": 128}},
            **kw),
    }


def check_per_linear(pack, models: dict) -> dict:
    """For each model: its adapter's name, whether its presets select what the generic presets select (every
    preset), how many block linears 'blocks' takes, and whether ``object_patches`` adds no fused module."""
    A, sel = pack.adapters, pack.quant.select
    Int8Linear = pack.quant.linear.Int8Linear
    out = {}
    for arch, dm in models.items():
        a = A.adapter_for(dm)
        same = all([n for n, _ in sel.select_linears(dm, p, rules=a.rules)] ==
                   [n for n, _ in sel.select_linears(dm, p)] for p in sel.PRESETS)
        names = [n for n, _ in sel.select_linears(dm, "blocks", rules=a.rules)]
        layers = {n: Int8Linear.from_float(torch.randn(32, 32), backend="fused_triton", name=n) for n in names}
        patches = A.object_patches(dm, layers)
        out[arch] = {"adapter": a.name, "same_presets": same, "blocks": len(names),
                     "plain": patches == layers and all(isinstance(m, Int8Linear) for m in patches.values())}
    return out


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _swap(module, patches: dict):
    """A deep copy of ``module`` with each named submodule replaced (ComfyUI's object patches, without a patcher)."""
    import copy

    import comfy.utils
    m = copy.deepcopy(module)
    for name, sub in patches.items():
        comfy.utils.set_attr(m, name, sub)
    return m


WAN_FUSED = {"fused": ["blocks.0", "blocks.1"], "kinds": ["FusedWanBlock"], "covered_all": True,
             "same_layers": True}


def wan_fused(pack) -> dict:
    """The tiny Wan 2.x of ``per_linear_models`` (meta) with INT8 layers of its shapes on fused_triton: which blocks
    the adapter fuses, whether they cover every layer and give them back through ``int8_layers()``."""
    A, sel = pack.adapters, pack.quant.select
    Int8Linear = pack.quant.linear.Int8Linear
    dm = per_linear_models()["wan"]
    names = [n for n, _ in sel.select_linears(dm, "blocks", rules=A.block_rules(dm))]
    layers = {n: Int8Linear.from_float(torch.randn(dm.get_submodule(n).weight.shape), backend="fused_triton", name=n)
              for n in names}
    patches = A.object_patches(dm, layers)
    covered = sorted(c for m in patches.values() for c in getattr(m, "covers", ()))
    return {"fused": sorted(patches), "kinds": sorted({type(m).__name__ for m in patches.values()}),
            "covered_all": covered == sorted(layers), "same_layers": A.int8_layers_of(patches) == layers}


def lumina2_equivalence(pack) -> dict:
    """A tiny Lumina 2 (NextDiT) from ComfyUI's classes: the adapter's fused blocks / FeedForwards (each fused
    FeedForward counted, also inside a FusedLumina2Block) vs per-linear INT8."""
    import importlib.util
    import comfy.supported_models
    spec = importlib.util.spec_from_file_location("int8fused_miniature", ROOT / "scripts" / "miniature.py")
    mini = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mini)
    mc = comfy.supported_models.Lumina2(dict(mini.TINY_UNET_CONFIG["lumina2"]))
    mc.set_inference_dtype(torch.bfloat16, None)
    model = mc.get_model({}, "", device=torch.device("cpu"))
    dm = model.diffusion_model
    res = dm.load_state_dict(mini.tiny_state_dict("lumina2", 0, torch.bfloat16), strict=False)  # 0.33.0: no
    with torch.no_grad():                                                       # norm_final; its new tensors:
        for k in res.missing_keys:
            dm.get_parameter(k).copy_(torch.randn_like(dm.get_parameter(k)) * 0.02)
    A = pack.adapters
    pairs = pack.quant.select.select_linears(dm, "blocks", rules=A.block_rules(dm))
    layers, _ = pack.quant.patch.build_int8_layers(pairs, "fused_triton")
    patches = A.object_patches(dm, layers)
    n_ffn = sum(isinstance(m, pack.quant.blocks.FusedFeedForward) for p in patches.values() for m in p.modules())
    same_layers = A.int8_layers_of(patches).keys() == layers.keys()
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(1, 16, 4, 4, generator=g), torch.randn(1, 4, 64, generator=g)
    t = torch.tensor([0.6])
    with torch.no_grad():
        ref = _swap(dm, layers)(x.bfloat16(), t, ctx.bfloat16(), num_tokens=4)
        got = _swap(dm, patches)(x.bfloat16(), t, ctx.bfloat16(), num_tokens=4)
    return {"adapter": A.adapter_for(dm).name, "fused_ffn": n_ffn, "ffn": len(list(dm.layers)) + len(
        list(dm.noise_refiner)) + len(list(dm.context_refiner)), "same_layers": same_layers, "rel": _rel(got, ref)}


def tiny_ideogram4(pack, num_layers: int):
    """An Ideogram 4 of ``num_layers`` blocks from ComfyUI's classes (current ComfyUI only), random weights (seed
    0), its INT8 layers on fused_triton and the adapter's object patches, and inputs (x, t, context)."""
    import comfy.ldm.ideogram4.model as im
    import comfy.ops
    A = pack.adapters
    torch.manual_seed(0)
    m = im.Ideogram4Transformer2DModel(in_channels=16, num_layers=num_layers, num_attention_heads=2,
                                       attention_head_dim=64, intermediate_size=256, adaln_dim=32, llm_features_dim=64,
                                       dtype=torch.bfloat16, device="cpu", operations=comfy.ops.disable_weight_init)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else torch.randn_like(p) * p.shape[-1] ** -0.5)
    pairs = pack.quant.select.select_linears(m, "blocks", rules=A.block_rules(m))
    layers, _ = pack.quant.patch.build_int8_layers(pairs, "fused_triton")
    patches = A.object_patches(m, layers)
    inputs = (torch.randn(1, 16, 4, 4, dtype=torch.bfloat16), torch.full((1,), 0.4),
              torch.randn(1, 5, 64, dtype=torch.bfloat16))
    return m, layers, patches, inputs


def ideogram4_equivalence(pack) -> dict:
    """A 1-layer Ideogram 4 from ComfyUI's classes (current ComfyUI): fused block vs per-linear INT8, and the
    fused modules' ``int8_layers()`` give back every layer (the Save path)."""
    import comfy.model_management as mm
    A = pack.adapters
    mm.in_training = True  # the rms+rope path through comfy_kitchen's fused op needs its GPU backend
    m, layers, patches, (x, t, ctx) = tiny_ideogram4(pack, 1)
    back = A.int8_layers_of(patches)
    same = back.keys() == layers.keys() and all(torch.equal(back[n].qweight, layers[n].qweight) for n in layers)
    with torch.no_grad():
        ref, got = _swap(m, layers)(x, t, context=ctx), _swap(m, patches)(x, t, context=ctx)
    mm.in_training = False
    return {"adapter": A.adapter_for(m).name, "block": type(patches.get("layers.0")).__name__,
            "same_layers": same, "rel": _rel(got, ref)}


# ----------------------------------------------------------------------------------- pinned ComfyUI (in-process)
def test_registry_resolves_the_pinned_classes_and_ideogram4_by_name(pack):
    got = resolved_names(pack)
    assert got == {p: CLASSES[p] for p in got} and len(got) >= 10, got
    assert "comfy.ldm.ideogram4.model.Ideogram4Transformer2DModel" not in got  # 0.3.75 has no Ideogram 4
    stand_in = type("Ideogram4Transformer2DModel", (torch.nn.Module,), {})     # so it is recognised by name
    assert pack.adapters.adapter_for(stand_in()).name == "ideogram4"
    look_alike = type("Flux", (torch.nn.Module,), {})                          # Flux imports: identity only
    assert pack.adapters.adapter_for(look_alike()) is None
    try:                                                                       # nothing to fuse blocks with
        pack.adapters.ideogram4.comfy_functions()
        raise AssertionError("the pinned ComfyUI has no comfy.ldm.ideogram4")
    except (ImportError, AttributeError):
        pass


def test_one_adapter_per_architecture_registered(pack):
    A = pack.adapters
    assert [a.name for a in A.registered()] == ["ideogram4", "lumina2", "flux", "qwen_image", "wan", "sd3"]
    assert [a.name for a in A.registered() if a.fuse is not None] == ["ideogram4", "lumina2", "flux", "qwen_image",
                                                                      "wan"]
    assert A.ideogram4.ADAPTER.checkpoint_layout == "adapters.ideogram4.layout"
    assert sys.modules[f"{pack.__name__}.{A.ideogram4.ADAPTER.checkpoint_layout}"] is pack.adapters.ideogram4.layout


def test_unknown_architecture_gets_per_linear_int8(pack):
    A, Int8Linear = pack.adapters, pack.quant.linear.Int8Linear
    dm = torch.nn.Module()
    dm.layers = torch.nn.ModuleList([torch.nn.Module()])
    ff = dm.layers[0]
    ff.w1, ff.w2, ff.w3 = torch.nn.Linear(32, 48), torch.nn.Linear(48, 32), torch.nn.Linear(32, 48)
    layers = {f"layers.0.{w}": Int8Linear.from_linear(getattr(ff, w), backend="fused_triton") for w in ("w1", "w2", "w3")}
    assert A.adapter_for(dm) is None and A.block_rules(dm) is pack.quant.select.GENERIC
    assert A.object_patches(dm, layers) == layers            # a SwiGLU look-alike, but no adapter: nothing fused
    assert A.int8_layers_of(layers) == layers


def test_per_linear_adapters_on_pinned_classes(pack):
    # Wan: 10 linears per block; Qwen-Image: 14 minus img_mod / txt_mod; SD3: the last context block is pre-only
    got = check_per_linear(pack, per_linear_models())
    # Wan's and Qwen-Image's blocks are fused (their equivalence: tests/test_wan_fused.py,
    # tests/test_qwen_image_fused.py): not plain here
    assert got == {"wan": {"adapter": "wan", "same_presets": True, "blocks": 20, "plain": False},
                   "qwen_image": {"adapter": "qwen_image", "same_presets": True, "blocks": 24, "plain": False},
                   "sd3": {"adapter": "sd3", "same_presets": True, "blocks": 13, "plain": True}}, got


def test_wan_blocks_fused_pinned(pack):
    assert wan_fused(pack) == WAN_FUSED


def test_flux_adapter_presets_are_the_generic_ones(pack, tiny_model):
    # the Flux adapter selects what the generic presets select (its fused blocks: tests/test_flux_fused.py)
    mp = tiny_model("flux")
    A, sel = pack.adapters, pack.quant.select
    dm = mp.model.diffusion_model
    assert A.adapter_for(dm).name == "flux"
    for p in sel.PRESETS:
        assert [n for n, _ in sel.select_linears(dm, p, rules=A.block_rules(dm))] == \
            [n for n, _ in sel.select_linears(dm, p)]


def test_lumina2_fused_equals_per_linear_pinned(pack):
    got = lumina2_equivalence(pack)
    assert got["adapter"] == "lumina2" and got["fused_ffn"] == got["ffn"] and got["same_layers"], got
    assert got["rel"] < REL, got


# ----------------------------------------------------------------------------------- current ComfyUI (subprocess)
def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    return {"classes": resolved_names(pack), "per_linear": check_per_linear(pack, per_linear_models()),
            "lumina2": lumina2_equivalence(pack), "ideogram4": ideogram4_equivalence(pack),
            "wan": wan_fused(pack)}


def test_adapters_on_the_current_comfyui(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    classes = res["classes"]
    assert classes == {p: CLASSES[p] for p in classes} and len(classes) == len(CLASSES), classes
    assert all(v["same_presets"] and v["plain"] == (k == "sd3") and v["adapter"] == k
               for k, v in res["per_linear"].items())
    assert res["wan"] == WAN_FUSED, res["wan"]
    lum, ideo = res["lumina2"], res["ideogram4"]
    assert lum["fused_ffn"] == lum["ffn"] and lum["same_layers"] and lum["rel"] < REL, lum
    assert ideo["adapter"] == "ideogram4" and ideo["block"] == "FusedIdeogram4Block" and ideo["same_layers"], ideo
    assert ideo["rel"] < REL, ideo


# ----------------------------------------------------------------------------------- layout rules
def test_no_globals_reach_in_torch_code():
    offenders = [str(p.relative_to(ROOT)) for d in ("adapters", "quant", "kernel") for p in (ROOT / d).rglob("*.py")
                 if "__globals__" in p.read_text()]
    assert offenders == []


def test_importing_adapters_imports_no_comfyui_and_no_triton():
    code = ("import sys; sys.path.insert(0, sys.argv[1] + '/tests'); import pack_import; pack_import.install(); "
            "import adapters; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('comfy', 'triton')); print(bad)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]
