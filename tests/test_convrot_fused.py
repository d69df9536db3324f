"""ConvRot layers inside fused blocks (issue 39 item 1: the rotation fused with the block's norm).

1. ``kernel.hadamard``'s ``layernorm_modulate_hadamard_quantize`` / ``rmsnorm_modulate_hadamard_quantize`` against
   ComfyUI's unfused sequences: torch's ``F.layer_norm`` + ``addcmul`` (``F.rms_norm`` * (1 + s)) in the model
   dtype, then ``hadamard_quantize`` (checked against a float64 Hadamard in tests/test_convrot.py). Tolerance,
   derived: the kernels compute the same roundings; only their fp32 mean / variance sum order differs from torch's,
   which can move a value lying within a few fp32 ulps of a dtype rounding boundary by one dtype ulp. One such move
   shifts the group's rotated values by at most ulp / sqrt(G), far below an int8 step, so a code can flip by 1 only
   where it sat on a rounding midpoint: codes equal except at most 1 % of them by +-1, scales within 2^-12. Also
   zero rows, NaN / Inf rows, refusals, and the helpers' torch.compile branches (torch's ops + the custom op). The
   same for the activation kernels (``swiglu_hadamard_quantize``, ``concat_gelu_hadamard_quantize``) against
   torch's SwiGLU / tanh GELU (and concatenation) in the model dtype, then ``hadamard_quantize``.
2. Tiny models from ComfyUI's classes with ConvRot layers on fused_triton (Flux.1, Flux.2, Wan 2.1, Qwen-Image,
   Lumina 2 pinned 0.3.75 in-process; those and a small Ideogram 4 on 0.33.0): the adapters build fused blocks, the
   norm-fed layers get their input from the new kernels, the activation-fed ones (GELU: Flux's mlp.2 and linear2,
   Wan's ffn.2, Qwen-Image's fc2; SwiGLU: Flux.2's mlp.2) from the activation kernels, a FeedForward's w2 from the
   SwiGLU GEMM's epilogue (calls counted; q / k / v and w1 / w3 stacked as one ConvRot layer where the model
   stacks them), ``int8_layers`` gives every layer back with its codes and rotation, and the
   whole model equals the per-linear ConvRot path (ComfyUI's torch norm, then each layer's rotate + quantize kernel)
   within the bound of the unrotated fused blocks (``REL_MODEL``; Qwen-Image's RoPE rounding: its ``REL_ROPE``).
   Everywhere the kernel-fed blocks give the same bits as the same blocks feeding each ConvRot layer its float
   input. Flux.1 with every layer rotated is checked by that alone: its distance from ComfyUI's forward there is
   the QK-norm + RoPE kernel's, which rounds a rare value one bf16 ulp away from torch's ops
   (tests/test_qk_norm_rope.py); on this tiny model that moves the output by ~2e-3 after four blocks, and by 0 with
   that kernel replaced by ComfyUI's ops.

Run: TRITON_INTERPRET=1 .runtime/venv/bin/python -m pytest tests/test_convrot_fused.py -q
"""
import math

import pytest
import torch
import torch.nn.functional as F

import fused_block_helpers as fbh

REL_MODEL = 2e-3
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(scope="module")
def hd():
    from kernel import hadamard
    return hadamard


def _unfused(hd, x, scale, shift, group, eps=1e-6):
    """ComfyUI's sequence: the model-dtype LayerNorm and addcmul, then the ConvRot layer's rotate + quantize."""
    m, k = x.shape
    b = scale.reshape(-1, k).shape[0]
    y = torch.addcmul(shift.reshape(b, 1, k), F.layer_norm(x, (k,), eps=eps).reshape(b, -1, k),
                      1 + scale.reshape(b, 1, k))
    return hd.hadamard_quantize(y.reshape(m, k), group)


def _close(q, s, rq, rs):
    d = (q.int() - rq.int()).abs()
    ok = torch.isfinite(rs)
    assert d.max() <= 1 and (d > 0).float().mean() <= 0.01, (d.max(), (d > 0).float().mean())
    assert torch.equal(s.isnan(), rs.isnan())
    assert ((s[ok] - rs[ok]).abs() <= 2.0 ** -12 * rs[ok].abs()).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,group,m,k,b", [(BF16, 64, 37, 192, 1), (BF16, 256, 20, 512, 2), (BF16, 16, 12, 48, 3),
                                               (FP16, 64, 9, 128, 3), (FP32, 256, 8, 256, 2)])
def test_kernel_against_unfused_sequence(hd, dtype, group, m, k, b):
    g = torch.Generator().manual_seed(m * 100 + k)
    x = (torch.randn(m, k, generator=g) * 2 + 0.7)
    x[:, 5] *= 25.0                                   # an outlier channel: what the rotation is for
    x = x.to(dtype)
    mod = (torch.randn(b, 1, 3 * k, generator=g) * 0.4).to(dtype)  # Flux's ModulationOut: views of one output
    shift, scale = mod[..., :k], mod[..., k:2 * k]
    q, s = hd.layernorm_modulate_hadamard_quantize(x, scale, shift, m // b, group)
    assert q.dtype == torch.int8 and q.shape == (m, k) and s.dtype == torch.float32 and s.shape == (m,)
    _close(q, s, *_unfused(hd, x, scale, shift, group))


def _unfused_rms(hd, x, w, scale, group, eps=1e-6):
    """Lumina 2's / Ideogram 4's sequence: F.rms_norm (fp32 inside, one rounding), times the adaLN 1 + s row per
    sample, then the ConvRot layer's rotate + quantize."""
    m, k = x.shape
    b = scale.reshape(-1, k).shape[0]
    y = F.rms_norm(x, (k,), w.to(x.dtype), eps).reshape(b, -1, k) * scale.reshape(b, 1, k)
    return hd.hadamard_quantize(y.reshape(m, k), group)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,group,m,k,b", [(BF16, 64, 37, 192, 1), (BF16, 256, 20, 512, 2), (FP16, 16, 9, 48, 3),
                                               (FP32, 64, 8, 128, 2)])
def test_rms_kernel_against_unfused_sequence(hd, dtype, group, m, k, b):
    g = torch.Generator().manual_seed(m * 100 + k + 1)
    x = (torch.randn(m, k, generator=g) * 2)
    x[:, 3] *= 25.0
    x = x.to(dtype)
    w = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    scale = (1 + 0.3 * torch.randn(b, k, generator=g)).to(dtype)
    q, s = hd.rmsnorm_modulate_hadamard_quantize(x, w, 1e-6, scale, m // b, group)
    assert q.dtype == torch.int8 and q.shape == (m, k) and s.shape == (m,)
    _close(q, s, *_unfused_rms(hd, x, w, scale, group))


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (the interpreter) on NaN / Inf rows
def test_kernel_zero_nan_rows_and_refusals(hd):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 128, generator=g).to(BF16)
    zero = torch.zeros(1, 128, dtype=BF16)
    x[1] = 0
    x[3, 7] = float("nan")
    x[4, 9] = float("inf")
    q, s = hd.layernorm_modulate_hadamard_quantize(x, zero, zero, 6, 64)
    assert s[1] == 0 and not q[1].any()                                # norm of a zero row with zero shift: 0
    assert all(math.isnan(s[i]) and not q[i].any() for i in (3, 4))    # NaN / Inf: scale NaN, zeros
    ok = [0, 2, 5]
    rq, rs = _unfused(hd, x[ok], zero, zero, 64)
    _close(q[ok], s[ok], rq, rs)                                       # the other rows untouched
    q, s = hd.layernorm_modulate_hadamard_quantize(x[:0], zero, zero, 1, 64)
    assert q.shape == (0, 128) and s.shape == (0,)
    with pytest.raises(ValueError, match="group size 64 does not divide the input width K = 96"):
        hd.layernorm_modulate_hadamard_quantize(torch.randn(2, 96), torch.zeros(1, 96), torch.zeros(1, 96), 2, 64)
    with pytest.raises(ValueError, match="group size 128 is not supported"):
        hd.layernorm_modulate_hadamard_quantize(x, zero, zero, 6, 128)
    with pytest.raises(ValueError, match="scale has 4 batch rows"):
        hd.layernorm_modulate_hadamard_quantize(x, torch.zeros(4, 128), torch.zeros(4, 128), 6, 64)
    # the RMSNorm twin: zero row -> scale 0, NaN / Inf rows -> NaN scale and zeros, the others as the unfused path
    w, one = torch.ones(128, dtype=BF16), torch.ones(1, 128, dtype=BF16)
    q, s = hd.rmsnorm_modulate_hadamard_quantize(x, w, 1e-6, one, 6, 64)
    assert s[1] == 0 and not q[1].any() and all(math.isnan(s[i]) and not q[i].any() for i in (3, 4))
    _close(q[ok], s[ok], *_unfused_rms(hd, x[ok], w, one, 64))
    with pytest.raises(ValueError, match="norm_weight"):
        hd.rmsnorm_modulate_hadamard_quantize(x, torch.ones(64), 1e-6, one, 6, 64)


def _unfused_act(hd, group, a=None, h=None, gate=None, clamp_fp16=False):
    """ComfyUI's MLP sequences in the model dtype, then the ConvRot layer's rotate + quantize: ``silu(a) * gate``
    (FeedForward; ``clamp_fp16`` its fp16 clamp) or ``cat(a, gelu_tanh(h))`` (Flux's single block; a None: the
    GELU alone)."""
    if gate is not None:
        y = F.silu(a) * gate
        if clamp_fp16:
            y = torch.nan_to_num(y, nan=0.0, posinf=65504.0, neginf=-65504.0)
    else:
        y = F.gelu(h, approximate="tanh")
        y = y if a is None else torch.cat((a, y), dim=-1)
    return hd.hadamard_quantize(y, group)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,group,m,f", [(BF16, 64, 37, 192), (BF16, 256, 9, 512), (FP16, 16, 12, 48),
                                             (FP32, 64, 8, 128)])
def test_activation_kernels_against_unfused_sequence(hd, dtype, group, m, f):
    """SwiGLU (merged [a | b] and the pair) and GELU (alone and after the attention output) fused with the rotation:
    the unfused sequence's codes and scales (``_close``: the same roundings; exp / the GELU's fast form may move a
    value by an fp32 ulp, as for the unrotated kernels)."""
    g = torch.Generator().manual_seed(m * 10 + f)
    a, b = (torch.randn(m, f, generator=g) * 3).to(dtype), (torch.randn(m, f, generator=g) * 2).to(dtype)
    a[:, 5] *= 8                                      # an outlier channel
    attn = torch.randn(m, 2 * group, generator=g).to(dtype)
    for got in (hd.swiglu_hadamard_quantize(torch.cat((a, b), 1), group), hd.swiglu_hadamard_quantize((a, b), group)):
        assert got[0].shape == (m, f) and got[0].dtype == torch.int8 and got[1].shape == (m,)
        _close(*got, *_unfused_act(hd, group, a, gate=b))
    q, s = hd.concat_gelu_hadamard_quantize(attn, a, group)
    assert q.shape == (m, 2 * group + f)
    _close(q, s, *_unfused_act(hd, group, attn, h=a))
    _close(*hd.concat_gelu_hadamard_quantize(None, a, group), *_unfused_act(hd, group, h=a))


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (the interpreter) on NaN / Inf rows
def test_activation_kernels_edge_rows_and_refusals(hd):
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(5, 128, generator=g).to(FP16), torch.randn(5, 128, generator=g).to(FP16)
    a[1], b[1] = 300.0, 300.0                        # silu(300) * 300 overflows fp16: inf, or 65504 clamped
    a[2, 3] = float("nan")
    for clamp in (False, True):
        q, s = hd.swiglu_hadamard_quantize((a, b), 64, clamp)
        rq, rs = _unfused_act(hd, 64, a, gate=b, clamp_fp16=clamp)
        if clamp:  # ComfyUI's clamp: NaN -> 0, inf -> 65504, so both rows quantize
            assert math.isfinite(s[1]) and math.isfinite(s[2]) and q[1].any()
        else:      # inf / NaN: scale NaN, codes 0
            assert all(math.isnan(s[i]) and not q[i].any() for i in (1, 2))
        _close(q, s, rq, rs)
    h = torch.randn(3, 64, generator=g).to(BF16)
    h[0] = 0
    q, s = hd.concat_gelu_hadamard_quantize(None, h, 64)
    assert s[0] == 0 and not q[0].any()                               # gelu(0) = 0
    q, s = hd.concat_gelu_hadamard_quantize(h[:0], h[:0], 64)
    assert q.shape == (0, 128) and s.shape == (0,)
    with pytest.raises(ValueError, match=r"first part\): group size 64 does not divide the input width K = 48"):
        hd.concat_gelu_hadamard_quantize(torch.randn(3, 48), torch.randn(3, 64), 64)
    with pytest.raises(ValueError, match="h13 has 129 columns"):
        hd.swiglu_hadamard_quantize(torch.randn(2, 129), 64)
    with pytest.raises(ValueError, match="group size 256 does not divide the input width K = 128"):
        hd.swiglu_hadamard_quantize(torch.randn(2, 256), 256)
    with pytest.raises(ValueError, match="in rows, dtype and device"):
        hd.concat_gelu_hadamard_quantize(torch.randn(2, 64), torch.randn(3, 64), 64)


# ------------------------------------------------------------------------------ 2. tiny Flux.1 / Wan, pinned
def _rotated_layers(pack, dm, only=()) -> dict:
    """{name: layer} of ``dm``'s block linears on fused_triton: ConvRotLinear as Apply's ``rotation: convrot`` builds
    them (the float weight rotated in float64, quantized per channel), or, for names not ending in one of ``only``
    (when given), plain Int8Linear."""
    A, convrot = pack.adapters, pack.quant.convrot
    pairs = pack.quant.select.select_linears(dm, "blocks", rules=A.block_rules(dm))
    groups = {n: convrot.group_for(m.in_features) for n, m in pairs if not only or n.endswith(only)}
    assert groups and all(groups.values())
    layers = pack.quant.patch.build_int8_layers(
        pairs, "fused_triton", weight_fn=lambda n, m: convrot.rotate(m.weight.detach().float(), groups[n],
                                                                     torch.float64)
        if n in groups else m.weight.detach().float())[0]
    return {n: convrot.ConvRotLinear.of(m, groups[n]) if n in groups else m for n, m in layers.items()}


def _equivalence(pack, dm, run, only=()) -> dict:
    A, cfg, qb = pack.adapters, pack.quant.blocks.config, pack.quant.blocks
    layers = _rotated_layers(pack, dm, only)
    patches = A.object_patches(dm, layers)
    with cfg.override(INT8_FUSED_FUSION=False):
        plain = A.object_patches(dm, layers)
    hmod, smod = qb.kernels().hadamard, qb.kernels().swiglu
    kinds = ("layernorm_modulate_hadamard_quantize", "rmsnorm_modulate_hadamard_quantize")
    acts = ("swiglu_hadamard_quantize", "concat_gelu_hadamard_quantize")
    spied = [(hmod, n) for n in kinds + acts] + [(smod, "gemm_swiglu")]
    real, calls = {n: getattr(mod, n) for mod, n in spied}, []

    def spy(name):
        def f(*a, **kw):
            calls.append(name)
            return real[name](*a, **kw)
        return f

    fused = fbh.swapped(dm, patches)
    with torch.no_grad():
        ref = run(fbh.swapped(dm, plain))
        for mod, n in spied:
            setattr(mod, n, spy(n))
        try:
            with fbh.unplanned(qb.kernels().plan):
                got = run(fused)
        finally:
            for mod, n in spied:
                setattr(mod, n, real[n])
        again = run(fused)  # prepared calls re-issue the kernel: the same bits
        # the same blocks, ConvRot layers fed float (their module calls: torch's norm / activation, then each layer's
        # rotate + quantize kernel)
        norm_fusable, qb.norm_fusable = qb.norm_fusable, qb.fusable
        try:
            float_fed = run(fused)
        finally:
            qb.norm_fusable = norm_fusable
    ffns = sum(all(hasattr(m, w) for w in ("w1", "w2", "w3")) for m in dm.modules())  # SwiGLU FeedForwards
    back = A.int8_layers_of(patches)  # what Save and the widget see: every layer, its codes and rotation as built
    same_layers = back.keys() == layers.keys() and all(
        torch.equal(back[n].qweight, m.qweight) and torch.equal(back[n].weight_scale, m.weight_scale)
        and qb.rotation(back[n]) == qb.rotation(m) for n, m in layers.items())
    return {"kinds": sorted({type(m).__name__ for m in patches.values()}), "plain_is_per_linear": plain == layers,
            "same_layers": same_layers,
            "rotated": sum(getattr(m, "rotation", 0) > 0 for m in layers.values()), "layers": len(layers),
            "calls": sum(c in kinds for c in calls), "rms_calls": calls.count(kinds[1]),
            "swiglu_calls": calls.count(acts[0]), "gelu_calls": calls.count(acts[1]),
            "epilogue_calls": calls.count("gemm_swiglu"), "ffns": ffns, "rel": fbh.rel(got, ref), "again_equal": bool(torch.equal(again, got)),
            "float_fed_equal": bool(torch.equal(float_fed, got))}


def flux_case(pack, rotated: str) -> dict:
    """Tiny Flux.1 (two double, two single blocks): ``rotated`` "fed" (the LayerNorm-fed layers) or "all"."""
    from test_flux_fused import _inputs, tiny_flux
    dm = tiny_flux(BF16)
    x, t, ctx, y = _inputs(BF16)
    only = ("attn.qkv", "mlp.0", "linear1") if rotated == "fed" else ()
    res = _equivalence(pack, dm, lambda m: m(x, t, ctx, y=y), only)
    return dict(res, depth=(dm.params.depth, dm.params.depth_single_blocks))


def flux2_case(pack) -> dict:
    """Flux.2's blocks (modulation passed in, SiLU-gated MLPs: adapters/flux/external_mod.py), every layer rotated."""
    from test_flux_fused import _inputs, tiny_flux
    dm = tiny_flux(BF16, depth=1, single=1, global_modulation=True, mlp_silu_act=True, ops_bias=False,
                   qkv_bias=False, vec_in_dim=None)
    x, t, ctx, _ = _inputs(BF16)
    return _equivalence(pack, dm, lambda m: m(x, t, ctx))


def wan_case(pack) -> dict:
    """Tiny Wan 2.1 (two blocks), every layer rotated."""
    from test_wan_fused import _inputs, tiny_wan
    dm = tiny_wan(BF16, layers=2)
    x, t, ctx = _inputs(BF16)
    return dict(_equivalence(pack, dm, lambda m: m(x, t, ctx)), blocks=len(dm.blocks))


def qwen_case(pack) -> dict:
    """Tiny Qwen-Image (two joint blocks), every layer rotated: q / k / v of a stream stacked as one ConvRot layer."""
    from test_qwen_image_fused import _inputs, tiny_qwen
    dm = tiny_qwen(BF16)
    x, t, ctx = _inputs(BF16)
    return dict(_equivalence(pack, dm, lambda m: m(x, t, ctx)), blocks=len(dm.transformer_blocks))


def lumina_case(pack) -> dict:
    """Tiny Lumina 2 (the miniature's config), every layer rotated: RMSNorm-fed qkv and w1+w3 (stacked as one ConvRot
    layer), the unmodulated blocks' feed-forwards rotated by the plain rotate + quantize kernel."""
    from test_lumina2_fused import tiny_lumina
    dm = tiny_lumina(BF16)
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(1, 16, 8, 8, generator=g).to(BF16), torch.randn(1, 6, 64, generator=g).to(BF16)
    t = torch.tensor([0.6])
    res = _equivalence(pack, dm, lambda m: m(x, t, ctx, num_tokens=6))
    return dict(res, modulated=sum(getattr(b, "modulation", False) for b in (*dm.layers, *dm.noise_refiner)))


def ideogram4_case(pack) -> dict:
    """A small Ideogram 4 (0.33.0's class; hidden 128, two blocks), every block layer rotated. ComfyUI's training
    flag is set meanwhile: its RMSNorm + RoPE then runs in torch (comfy-kitchen's fused op needs its GPU backend)."""
    import comfy.ldm.ideogram4.model as im
    import comfy.model_management as mm
    import comfy.ops
    torch.manual_seed(0)
    dm = im.Ideogram4Transformer2DModel(in_channels=16, num_layers=2, num_attention_heads=2, attention_head_dim=64,
                                        intermediate_size=256, adaln_dim=32, llm_features_dim=64,
                                        dtype=BF16, device="cpu", operations=comfy.ops.disable_weight_init)
    with torch.no_grad():
        for n, p in dm.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else torch.randn_like(p) * p.shape[-1] ** -0.5)
    x, ctx = torch.randn(1, 16, 4, 4, dtype=BF16), torch.randn(1, 5, 64, dtype=BF16)
    t = torch.full((1,), 0.4)
    training, mm.in_training = getattr(mm, "in_training", False), True
    try:
        return dict(_equivalence(pack, dm, lambda m: m(x, t, context=ctx)), blocks=len(dm.layers))
    finally:
        mm.in_training = training


def check_flux(res, rotated: str):
    double, single = res["depth"]
    assert res["same_layers"], res
    assert res["kinds"] == ["FusedFluxDoubleBlock", "FusedFluxSingleBlock"] and res["plain_is_per_linear"], res
    assert res["rotated"] == (4 * double + single if rotated == "fed" else res["layers"]) > 0, res
    # per double block: img / txt qkv and img / txt mlp.0 (the residual tail kernel takes no ConvRot layer); per
    # single block: linear1
    assert res["calls"] == 4 * double + single, res
    # all rotated: mlp.2 of each stream from the GELU kernel, linear2 from the concatenation's (attention | GELU)
    assert res["gelu_calls"] == (0 if rotated == "fed" else 2 * double + single), res
    assert res["again_equal"] and res["float_fed_equal"], res
    if rotated == "fed":
        assert res["rel"] <= REL_MODEL, res


def check_flux2(res):
    assert res["same_layers"], res
    assert res["kinds"] == ["ExternalModDoubleBlock", "ExternalModSingleBlock"] and res["plain_is_per_linear"], res
    assert res["rotated"] == res["layers"] > 0 and res["calls"] == 4 + 1, res
    assert res["swiglu_calls"] == 2, res  # each stream's SiLU-gated mlp.2 (the single block's cat is torch's)
    assert res["rel"] <= REL_MODEL and res["again_equal"] and res["float_fed_equal"], res


def check_wan(res):
    assert res["same_layers"], res
    assert res["kinds"] == ["FusedWanBlock"] and res["plain_is_per_linear"], res
    assert res["rotated"] == res["layers"] > 0, res
    assert res["calls"] == 2 * res["blocks"], res  # q / k / v share one rotated input; ffn.0 its own
    assert res["gelu_calls"] == res["blocks"], res  # ffn.2 from the GELU kernel
    assert res["rel"] <= REL_MODEL and res["again_equal"] and res["float_fed_equal"], res


def check_qwen(res):
    from test_qwen_image_fused import REL_ROPE
    assert res["same_layers"], res
    assert res["kinds"] == ["FusedQwenImageBlock"] and res["plain_is_per_linear"], res
    assert res["rotated"] == res["layers"] > 0, res
    assert res["calls"] == 4 * res["blocks"], res  # per block: each stream's stacked q/k/v and its MLP's fc1
    assert res["gelu_calls"] == 2 * res["blocks"], res  # each stream's fc2 from the GELU kernel
    # the fused blocks' RoPE rounding differs from ComfyUI's (tests/test_qwen_image_fused.py): its bound
    assert res["rel"] <= REL_ROPE and res["again_equal"] and res["float_fed_equal"], res


def check_rms(res, kind: str, modulated: int):
    """Lumina 2 / Ideogram 4: per modulated block, the RMSNorm kernel feeds qkv and the stacked w1+w3."""
    assert res["same_layers"], res
    assert kind in res["kinds"] and res["plain_is_per_linear"], res
    assert res["rotated"] == res["layers"] > 0, res
    assert res["calls"] == res["rms_calls"] == 2 * modulated > 0, res
    assert res["epilogue_calls"] == res["ffns"] > 0, res  # every w2: the SwiGLU GEMM's epilogue, then rotated
    assert res["rel"] <= REL_MODEL and res["again_equal"] and res["float_fed_equal"], res


def check_lumina(res):
    check_rms(res, "FusedLumina2Block", res["modulated"])


def check_ideogram4(res):
    check_rms(res, "FusedIdeogram4Block", res["blocks"])


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("rotated", ["fed", "all"])
def test_tiny_flux_convrot_fused_pinned(pack, rotated):
    res = flux_case(pack, rotated)
    print(res)
    check_flux(res, rotated)


@pytest.mark.interpreter
def test_tiny_flux2_convrot_fused_pinned(pack):
    res = flux2_case(pack)
    print(res)
    check_flux2(res)


@pytest.mark.slow
@pytest.mark.interpreter
def test_tiny_wan_convrot_fused_pinned(pack):
    res = wan_case(pack)
    print(res)
    check_wan(res)


@pytest.mark.interpreter
def test_tiny_lumina2_convrot_fused_pinned(pack):
    res = lumina_case(pack)
    print(res)
    check_lumina(res)


@pytest.mark.slow
@pytest.mark.interpreter
def test_tiny_qwen_image_convrot_fused_pinned(pack):
    res = qwen_case(pack)
    print(res)
    check_qwen(res)


# ----------------------------------------------------------------------------------- current ComfyUI (subprocess)
def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    from comfyui_version import __version__
    return {"comfyui": __version__, "flux_all": flux_case(pack, "all"), "flux2": flux2_case(pack),
            "wan": wan_case(pack), "qwen": qwen_case(pack), "lumina2": lumina_case(pack),
            "ideogram4": ideogram4_case(pack)}


def test_convrot_fused_on_the_current_comfyui(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res)
    assert res["comfyui"] == "0.33.0"
    check_flux(res["flux_all"], "all")
    check_flux2(res["flux2"])
    check_wan(res["wan"])
    check_qwen(res["qwen"])
    check_lumina(res["lumina2"])
    check_ideogram4(res["ideogram4"])


@pytest.mark.interpreter
def test_rotating_norm_helpers_under_torch_compile(pack):
    """Under torch.compile (fullgraph, aot_eager) the helpers feeding a ConvRot layer trace without a graph break: torch's
    norm and modulation (SwiGLU, GELU), then the rotation's custom op; their codes match the eager kernels' (ties aside, ``_close``)."""
    qb = pack.quant.blocks
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, 128, generator=g).to(BF16)
    scale, shift = (0.3 * torch.randn(2, 1, 128, generator=g)).to(BF16), (0.3 * torch.randn(2, 1, 128, generator=g)).to(BF16)
    norm = torch.nn.RMSNorm(128, eps=1e-6, dtype=BF16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(128, generator=g))
    layer = pack.quant.convrot.ConvRotLinear.rotate_float(torch.randn(32, 128, generator=g), 64, backend="fused_triton")
    calls = {"ln": lambda: qb.ln_mod_quant(x, scale, shift, 6, None, 1e-6, 64),
             "rms": lambda: qb.norm_modulate_quantize(norm, x, 1 + scale, 6, None, 64),
             "input": lambda: qb.input_quant(layer, x),
             "swiglu": lambda: qb.swiglu_quant(x, None, False, 64),
             "gelu": lambda: qb.cat_gelu_quant(x[:, :64], x, None, 64)}
    torch._dynamo.reset()
    with torch.no_grad():
        for name, fn in calls.items():
            got = torch.compile(fn, backend="aot_eager", fullgraph=True)()
            _close(*got, *fn())
