"""Two "Apply Fused INT8 GEMM" variants of one loaded model sampled in turn, on ComfyUI 0.33.0 (COMFYUI_CURRENT, CPU;
skipped with the reason otherwise). The pinned-ComfyUI version and the argument: tests/test_apply_twice.py.

On a CPU 0.33.0 uses the legacy ``ModelPatcher`` (``CoreModelPatcher``: main.py turns on ``ModelPatcherDynamic`` only
with DynamicVRAM on a GPU); the test checks that it is what the core loaders would give. Sequence, per model (tiny
Flux, tiny Lumina 2, fp32, random weights): Apply A (fused_triton) -> sample A -> Apply B (Flux: torch_int_mm;
Lumina 2: fused_triton with INT8_FUSED_FUSION=0) -> sample B -> sample A -> sample the base; for Flux also A behind
TorchCompileModel's wrapper (``set_torch_compile_wrapper``, what the node calls, with the ``eager`` backend: dynamo
traces and runs the graphs op by op; in fp32 not always the same bits as uncompiled, so its reference is the
compiled A alone) -> sample -> Apply B -> sample B -> sample A -> the base.
Reference: each variant on its own model in ANOTHER process, sampled alone. Every output must be the same bits.
Run: bash scripts/test.sh tests/test_apply_twice_current.py
"""
import torch

from comfy_harness import run_in_current_comfy

_SCRIPT = """
import runpy, torch
ns = runpy.run_path({file!r})
torch.save(ns[{fn!r}](import_pack()), {out!r})
"""


def _run(fn, out):
    cp = run_in_current_comfy(_SCRIPT.format(file=__file__, fn=fn, out=str(out)), timeout=1500)
    assert cp.returncode == 0, f"{cp.stdout[-3000:]}\n{cp.stderr[-6000:]}"
    return torch.load(out)


def test_second_apply_after_sampling_the_first_current(comfy_current, tmp_path):
    seq, ref = _run("sequence", tmp_path / "seq.pt"), _run("alone", tmp_path / "ref.pt")
    assert seq["patcher"] == ref["patcher"] == "ModelPatcher", (seq["patcher"], ref["patcher"])
    assert seq["core_patcher"] == "ModelPatcher"
    expected = {"flux": ("a", "b", "a", "float"), "lumina2": ("a", "b", "a", "float"),
                "flux_compiled": ("a_compiled", "b", "a_compiled", "float")}
    for case, names in expected.items():
        outs = seq[case]
        assert len(outs) == len(names), case
        for i, (name, got) in enumerate(zip(names, outs)):
            want = ref[case.split("_")[0]][name]
            assert torch.equal(got, want), (case, i, name, (got - want).abs().max().item())
        assert not torch.equal(outs[0], outs[3]) and not torch.equal(outs[1], outs[3]), case


# ---- run inside the current ComfyUI (subprocesses)
VARIANTS = {"flux": ("torch_int_mm", True), "lumina2": ("fused_triton", False)}  # B: backend, INT8_FUSED_FUSION


def _tiny(arch, seed=0):
    import comfy.model_detection
    import comfy.model_patcher
    import comfy.supported_models
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))  # noqa: F821 (runpy sets __file__)
    from comfy_harness import miniature
    cfg = dict(miniature().TINY_UNET_CONFIG[arch])
    mc = comfy.model_detection.model_config_from_unet_config(dict(cfg, txt_ids_dims=[]), {}) if arch == "flux" \
        else comfy.supported_models.Lumina2(cfg)
    mc.set_inference_dtype(torch.float32, None)
    cpu = torch.device("cpu")
    model = mc.get_model({}, "", device=cpu)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.diffusion_model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * r if "norm" in n else r * p[0].numel() ** -0.5 if p.dim() >= 2 else 0.02 * r)
    return comfy.model_patcher.CoreModelPatcher(model, load_device=cpu, offload_device=cpu)


def _sample(model, arch):
    import comfy.sample
    g = torch.Generator().manual_seed(1)
    ctx = torch.randn(1, 8, 64, generator=g)
    extra = {"pooled_output": torch.randn(1, 64, generator=g)} if arch == "flux" else {}
    latent, noise = torch.zeros(1, 16, 8, 8), torch.randn(1, 16, 8, 8, generator=g)
    pos = [[ctx, extra]]
    return comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", pos, pos, latent, seed=0,
                               disable_pbar=True).float()


def _apply(pack, base, arch, which):
    """Apply A (fused_triton), B (``VARIANTS``) or A behind TorchCompileModel's wrapper (``a_compiled``)."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from kernel import config
    backend, fusion = VARIANTS[arch] if which == "b" else ("fused_triton", True)
    with config.override(INT8_FUSED_FUSION=fusion):
        out = pack.nodes.apply.ApplyFusedInt8GEMM().apply(base, backend)[0]
    if which == "a_compiled":
        out = out.clone()
        set_torch_compile_wrapper(model=out, backend="eager")
    return out


def alone(pack) -> dict:
    """Each variant on its own model, the loaded models unloaded before each."""
    import comfy.model_management as mm
    out = {}
    for arch in VARIANTS:
        out[arch] = {}
        for which in ("a", "b", "float") + (("a_compiled",) if arch == "flux" else ()):
            mm.unload_all_models()
            m = _tiny(arch)
            out[arch][which] = _sample(m if which == "float" else _apply(pack, m, arch, which), arch)
    out["patcher"] = type(m).__name__
    return out


def sequence(pack) -> dict:
    """One base per case, the variants applied and sampled in turn without unloading."""
    import comfy.model_management as mm
    import comfy.model_patcher
    out = {"core_patcher": comfy.model_patcher.CoreModelPatcher.__name__}
    for case in ("flux", "lumina2", "flux_compiled"):
        mm.unload_all_models()
        arch = case.split("_")[0]
        base = _tiny(arch)
        a = _apply(pack, base, arch, "a_compiled" if case == "flux_compiled" else "a")
        outs = [_sample(a, arch)]
        assert base.object_patches_backup, "A's object patches are not in the shared tree: nothing is tested"
        b = _apply(pack, base, arch, "b")
        outs += [_sample(b, arch), _sample(a, arch), _sample(base, arch)]
        out[case] = outs
        out["patcher"] = type(base).__name__
    return out
