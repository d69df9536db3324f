"""scripts/miniature.py: real key layouts that the pinned ComfyUI detects, deterministic weights,
sane scales; the tiny variants build with ComfyUI's own classes and give finite, non-trivial outputs."""
import pytest
import torch

import comfy_harness as H

EXPECTED_CLASS = {"lumina2": "Lumina2", "flux": "FluxSchnell"}


@pytest.fixture(scope="module")
def mini():
    return H.miniature()


def _meta_sd(mini, arch, tiny=False):
    return {k: torch.empty(shape, device="meta") for k, shape, _ in mini.layout(arch, tiny)}


@pytest.mark.parametrize("arch", ["lumina2", "flux"])
def test_detected_and_layout_matches_comfy_model(comfy_inprocess, mini, arch):
    """Detection picks the right model class and the model it builds has exactly our keys/shapes."""
    import comfy.model_detection
    sd = _meta_sd(mini, arch)
    mc = comfy.model_detection.model_config_from_unet(sd, "")
    assert mc is not None, f"ComfyUI did not detect the {arch} miniature"
    assert type(mc).__name__ == EXPECTED_CLASS[arch]
    with torch.device("meta"):
        model = mc.get_model(sd, "")
    ref = {k: tuple(v.shape) for k, v in model.diffusion_model.state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in sd.items()}
    assert ref == ours, (set(ref) ^ set(ours), [k for k in ref if k in ours and ref[k] != ours[k]])


@pytest.mark.parametrize("arch", ["lumina2", "flux"])
def test_tiny_layout_matches_comfy_model(comfy_inprocess, mini, arch):
    import comfy.model_detection
    sd = _meta_sd(mini, arch, tiny=True)
    mc = comfy.model_detection.model_config_from_unet_config(dict(mini.TINY_UNET_CONFIG[arch]), sd)
    assert type(mc).__name__ == EXPECTED_CLASS[arch]
    with torch.device("meta"):
        model = mc.get_model(sd, "")
    ref = {k: tuple(v.shape) for k, v in model.diffusion_model.state_dict().items()}
    assert ref == {k: tuple(v.shape) for k, v in sd.items()}


@pytest.mark.parametrize("arch", ["lumina2", "flux"])
def test_block_linears_are_selected(comfy_inprocess, mini, arch):
    """Every block linear is wide enough for quant/select.py and a multiple of 16."""
    names = [(k, s) for k, s, kind in mini.layout(arch, tiny=True) if kind == "linear" and
             any(b in k for b in ("layers.", "blocks.", "refiner."))]
    assert names
    for k, (n, kk) in names:
        assert n % 16 == 0 and kk % 16 == 0 and min(n, kk) >= 64, (k, n, kk)
    if arch == "lumina2":
        assert any(k.endswith("feed_forward.w1.weight") for k, _ in names)


def test_weights_deterministic_and_seeded(mini):
    a, b, c = (mini.tiny_state_dict("lumina2", s) for s in (0, 0, 1))
    k = "layers.0.feed_forward.w1.weight"
    assert torch.equal(a[k], b[k]) and not torch.equal(a[k], c[k])
    w = a[k]
    assert abs(w.std().item() * w.shape[1] ** 0.5 - 1.0) < 0.05  # N(0, 1/fan_in)


@pytest.mark.parametrize("arch", ["lumina2", "flux"])
def test_tiny_forward_finite_and_not_trivial(comfy_inprocess, mini, arch):
    mp = H.load_tiny(arch)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, 16, 16, generator=g)
    ctx = torch.randn(1, 8, 64, generator=g)
    extra = {"num_tokens": 8} if arch == "lumina2" else {"y": torch.randn(1, 64, generator=g)}
    with torch.no_grad():
        y1 = mp.model.apply_model(x, torch.tensor([0.7]), c_crossattn=ctx, **extra)
        y2 = mp.model.apply_model(x, torch.tensor([0.7]), c_crossattn=ctx * -1.0, **extra)
    assert y1.shape == x.shape and torch.isfinite(y1).all()
    assert 0.05 < y1.std() < 50, y1.std()
    assert (y1 - y2).abs().max() > 1e-4  # the conditioning reaches the output


def test_write_miniature_reuses_file(mini, tmp_path):
    p = mini.write_miniature("flux", tmp_path / "f.safetensors", seed=0, tiny=True)
    m1 = p.stat().st_mtime_ns
    mini.write_miniature("flux", p, seed=0, tiny=True)
    assert p.stat().st_mtime_ns == m1
    mini.write_miniature("flux", p, seed=1, tiny=True)
    from safetensors import safe_open
    with safe_open(str(p), "pt") as f:
        assert '"seed": 1' in f.metadata()["int8_fused_miniature"]


def test_detectable_file_loads_with_comfy_sd(comfy_inprocess, miniature_models):
    """The file the server loads, through comfy.sd.load_diffusion_model: no missing/unexpected keys."""
    import comfy.sd
    path = comfy_inprocess / "models" / "diffusion_models" / miniature_models["lumina2"]
    mp = comfy.sd.load_diffusion_model(str(path))
    assert type(mp.model).__name__ == "Lumina2"
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
    assert set(mp.model.diffusion_model.state_dict()) == keys
    w = mp.model.diffusion_model.layers[0].feed_forward.w1.weight
    assert w.shape == (9216, 2304) and torch.isfinite(w).all() and w.float().std() > 0
    del mp
