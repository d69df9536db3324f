"""Fused Wan blocks on Wan 2.2 TI2V 5B's per-token modulation (adapters/wan/) on the CPU (TRITON_INTERPRET=1).

A tiny Wan 2.2 5B (dim 64, 2 heads, ffn 128, 2 layers) built through ComfyUI's own model config (``WAN22_T2V``:
in / out_dim 48, ``model_base.WAN22``), pinned 0.3.75 in-process and the current ComfyUI (COMFYUI_CURRENT, 0.33.0)
in a subprocess. Its timestep is per latent frame: ``WAN22.process_timestep`` turns a denoise mask (frame 0 kept,
as image-to-video sets it) into t [B, T], so each block gets ``e`` [B, T, 6, C] and ComfyUI's ``repeat_e`` makes
each modulation chunk [B, L, C]. The fused block serves these calls (the kernels read one modulation row per
token) instead of falling back to ComfyUI's forward:

* on blocks.0 (inputs captured from a real ``apply_model`` call, batch 2): the int8 activation every GEMM of the
  fused block receives equals what the per-linear INT8 block quantizes (its Int8Linear inputs through
  ``quantize_per_token_ref``): bit for bit in bf16 (the LayerNorm output rounds to the model dtype, ``1 + scale``
  and the addcmul round as torch's ops, the per-token rows are the ones ``repeat_e`` built), codes equal and scales
  within 2^-20 in fp32 (the LayerNorm's fp32 sum order). The norm · modulation kernel runs with
  ``tokens_per_batch`` 1 and the three residual-tail kernels run on gates of x's shape; also for T not dividing L
  (``repeat_e`` truncates) and T = L;
* whole ``apply_model`` output vs the per-linear path within ``REL_MODEL``, derived as in tests/test_wan_fused.py:
  equal int8 GEMM inputs leave only fp32 op-order differences in the float glue (0 on the CPU); on a GPU a rare +-1
  code (rate p < 1e-3) moves a GEMM output by about sqrt(p) * crest / 127 <= 0.03 * 4 / 127 ~ 1e-3 relative.

And the 14B layout (Wan 2.1 / 2.2 14B: head_dim 128, ``cross_attn_norm``, I2V cross-attention with image k/v; the
width reduced to two heads): the adapter picks ``FusedWanBlock`` for its block, which covers all twelve INT8
layers, and the model output stays within ``REL_MODEL`` of the per-linear path.

Run: bash scripts/test.sh tests/test_wan22_fused.py
"""

import pytest
import torch

import fused_block_helpers as fbh

REL_MODEL = 2e-3
BF16, FP32 = torch.bfloat16, torch.float32
FRAMES = 3   # latent frames; 4 x 4 latents -> 2 x 2 patches a frame, L = 12 tokens


_randomize = fbh.randomize


def tiny_wan22(dtype, layers=2, seed=0):
    """The BaseModel (``WAN22``) of a tiny Wan 2.2 TI2V 5B from the running ComfyUI's model config, random
    weights."""
    import comfy.model_detection
    cfg = {"image_model": "wan2.1", "model_type": "t2v", "in_dim": 48, "out_dim": 48, "dim": 64, "ffn_dim": 128,
           "num_heads": 2, "num_layers": layers, "patch_size": (1, 2, 2), "freq_dim": 32, "text_dim": 32,
           "text_len": 8, "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
    mc = comfy.model_detection.model_config_from_unet_config(cfg)
    mc.set_inference_dtype(dtype, None)
    model = mc.get_model({}, "", device=torch.device("cpu"))
    _randomize(model.diffusion_model, seed)
    return model


def _inputs(b=2, seed=1):
    """(x, sigma, context, denoise_mask): frame 0 kept (mask 0), as Wan 2.2's image-to-video sets it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 48, FRAMES, 4, 4, generator=g)
    ctx = torch.randn(b, 8, 32, generator=g)
    mask = torch.ones(b, 1, FRAMES, 4, 4)
    mask[:, :, 0] = 0
    return x, torch.tensor([0.9, 0.5][:b]), ctx, mask


def _apply(model, dm, x, sigma, ctx, mask):
    """``model.apply_model`` with ``dm`` as its diffusion model."""
    orig = model.diffusion_model
    model.diffusion_model = dm
    try:
        with torch.no_grad():
            return model.apply_model(x, sigma, c_crossattn=ctx, denoise_mask=mask)
    finally:
        model.diffusion_model = orig


def _block_inputs(model):
    """(args, kwargs) blocks.0 receives in a float ``apply_model`` call."""
    got = {}

    def hook(mod, args, kwargs):
        got.setdefault("in", (tuple(a.clone() if torch.is_tensor(a) else a for a in args),
                              {k: (v.clone() if torch.is_tensor(v) else v) for k, v in kwargs.items()}))

    h = model.diffusion_model.blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        _apply(model, model.diffusion_model, *_inputs())
    finally:
        h.remove()
    return got["in"]


class _Spies:
    """Records, while active, the int8 input of every GEMM a fused block issues, the ``tokens_per_batch`` of its
    norm · modulation and residual-tail kernels, and the per-linear block's Int8Linear inputs (quantized by the
    reference quantizer)."""

    TAILS = ("residual_add", "residual_add_layernorm", "residual_add_layernorm_modulate_quantize")

    def __init__(self, pack, plain=None):
        self.qf, self.Int8Linear = pack.quant.blocks, pack.quant.linear.Int8Linear
        self.kf = self.qf.kernels()
        self.plain = plain
        self.fused, self.ref, self.ln_tokens, self.tail_tokens = {}, {}, [], {n: [] for n in self.TAILS}

    def __enter__(self):
        from quant.quantize import quantize_per_token_ref
        qf, kf = self.qf, self.kf
        self._saved = (qf.gemm, qf.ln_mod_quant, self.Int8Linear.int8_call,
                       {n: getattr(kf.residual, n) for n in self.TAILS})
        gemm, ln, call, tails = self._saved

        def spy_gemm(a_q, a_s, layer, dt):
            self.fused.setdefault(id(layer), (a_q.clone(), a_s.clone()))
            return gemm(a_q, a_s, layer, dt)

        def spy_ln(x2, scale, shift, tokens, *a):
            self.ln_tokens.append((tokens, scale.shape))
            return ln(x2, scale, shift, tokens, *a)

        def spy_call(layer, x_in):   # qf.linear: quantization + GEMM as one prepared call
            self.fused.setdefault(id(layer), quantize_per_token_ref(x_in.reshape(-1, x_in.shape[-1]),
                                                                    layer.inv_smooth))
            return call(layer, x_in)

        def spy_tail(name):
            def f(x, y, gate, tokens, *a, **kw):
                self.tail_tokens[name].append(tokens)
                return tails[name](x, y, gate, tokens, *a, **kw)
            return f

        def record(mod, a):
            self.ref.setdefault(id(mod), quantize_per_token_ref(a[0].reshape(-1, a[0].shape[-1]), mod.inv_smooth))

        mods = self.plain.modules() if self.plain is not None else ()
        self._hooks = [m.register_forward_pre_hook(record) for m in mods if isinstance(m, self.Int8Linear)]
        qf.gemm, qf.ln_mod_quant, self.Int8Linear.int8_call = spy_gemm, spy_ln, spy_call
        for n in self.TAILS:
            setattr(kf.residual, n, spy_tail(n))
        self._unplanned = fbh.unplanned(kf.plan)   # a prepared call skips the wrappers: count each
        self._unplanned.__enter__()
        return self

    def __exit__(self, *exc):
        self._unplanned.__exit__(*exc)
        gemm, ln, call, tails = self._saved
        self.qf.gemm, self.qf.ln_mod_quant, self.Int8Linear.int8_call = gemm, ln, call
        for n, f in tails.items():
            setattr(self.kf.residual, n, f)
        for h in self._hooks:
            h.remove()

    def same_activations(self, dtype) -> bool:
        return bool(self.fused) and set(self.fused) <= set(self.ref) and all(
            torch.equal(self.fused[i][0], self.ref[i][0]) and (
                torch.equal(self.fused[i][1], self.ref[i][1]) if dtype != FP32 else
                torch.allclose(self.fused[i][1], self.ref[i][1], rtol=2.0 ** -20, atol=0))
            for i in self.fused)


def block_check(pack, model, layers, patches, dtype) -> dict:
    """blocks.0, fused vs per-linear, on the per-token ``e`` of a real call, one whose T does not divide L, and
    T = L."""
    name = "blocks.0"
    args, kwargs = _block_inputs(model)
    x, e = args[0], kwargs.pop("e")
    plain = fbh.swapped(model.diffusion_model.get_submodule(name),
                        {k[len(name) + 1:]: v for k, v in layers.items() if k.startswith(name + ".")})
    fused = patches[name]

    def call(blk, ee):
        return blk(x.clone(), *args[1:], e=ee, **kwargs)

    with torch.no_grad():
        with _Spies(pack, plain) as s:
            ref, got = call(plain, e), call(fused, e)
        l = x.shape[1]
        e5 = torch.cat([e, e[:, :2] * 0.5], 1)          # T = 5 rows for L = 12: repeat_e repeats 3, truncates
        eL = e.repeat_interleave(l // e.shape[1], 1) * torch.linspace(0.5, 1.5, l, dtype=e.dtype)[:, None, None]
        rels = {f"T={ee.shape[1]}": fbh.rel(call(fused, ee), call(plain, ee)) for ee in (e5, eL)}
    return {"e_shape": list(e.shape), "x_shape": list(x.shape), "frames_differ": not torch.equal(e[:, 0], e[:, 1]),
            "same_activations": s.same_activations(dtype), "gemms_fused": len(s.fused), "int8_layers": len(s.ref),
            "ln_tokens": [[t, list(sh)] for t, sh in s.ln_tokens], "tail_tokens": s.tail_tokens,
            "rel": fbh.rel(got, ref), "rels": rels}


def wan22_equivalence(pack, dtype=BF16) -> dict:
    A, cfg = pack.adapters, pack.quant.blocks.config
    model = tiny_wan22(dtype)
    dm = model.diffusion_model
    layers = fbh.int8_layers(pack, dm)
    patches = A.object_patches(dm, layers)
    with cfg.override(INT8_FUSED_FUSION=False):
        plain = A.object_patches(dm, layers)
    covered = sorted(n for m in patches.values() for n in getattr(m, "covers", ()))
    inputs = _inputs()
    t = model.process_timestep(model.model_sampling.timestep(inputs[1]).float(), x=inputs[0],
                               denoise_mask=inputs[3])
    with _Spies(pack) as s:
        got = _apply(model, fbh.swapped(dm, patches), *inputs)
    ref = _apply(model, fbh.swapped(dm, plain), *inputs)
    flt = _apply(model, dm, *inputs)
    return {"model": type(model).__name__, "adapter": A.adapter_for(dm).name,
            "kinds": sorted({type(m).__name__ for m in patches.values()}), "fused": sorted(patches),
            "covered_all": covered == sorted(layers), "plain_is_per_linear": plain == layers,
            "timestep_shape": list(t.shape), "ln_tokens": sorted({tk for tk, _ in s.ln_tokens}),
            "ln_calls": len(s.ln_tokens), "rel": fbh.rel(got, ref), "rel_float": fbh.rel(ref, flt),
            "block": block_check(pack, model, layers, patches, dtype)}


def wan14b_layout(pack) -> dict:
    """A 14B-shaped Wan model (I2V, head_dim 128, cross_attn_norm; two heads, one block): the fused block is picked
    and matches the per-linear path."""
    import comfy.ldm.wan.model as wan
    import comfy.ops
    A = pack.adapters
    dm = wan.WanModel(model_type="i2v", patch_size=(1, 2, 2), text_len=8, in_dim=36, dim=256, ffn_dim=704,
                      freq_dim=32, text_dim=32, out_dim=16, num_heads=2, num_layers=1, qk_norm=True,
                      cross_attn_norm=True, eps=1e-6, device="cpu", dtype=BF16,
                      operations=comfy.ops.disable_weight_init)
    _randomize(dm, 2)
    layers = fbh.int8_layers(pack, dm)
    patches = A.object_patches(dm, layers)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 36, 1, 4, 4, generator=g).to(BF16)
    ctx, clip = torch.randn(1, 8, 32, generator=g).to(BF16), torch.randn(1, 4, 1280, generator=g).to(BF16)
    t = torch.tensor([700.0])
    with torch.no_grad():
        ref = fbh.swapped(dm, layers)(x, t, ctx, clip_fea=clip)
        got = fbh.swapped(dm, patches)(x, t, ctx, clip_fea=clip)
    blk = patches.get("blocks.0")
    return {"kinds": sorted({type(m).__name__ for m in patches.values()}), "head_dim": dm.blocks[0].self_attn.head_dim,
            "covers": sorted(n.split(".", 2)[2] for n in getattr(blk, "covers", ())), "n_layers": len(layers),
            "rel": fbh.rel(got, ref)}


def _check(res):
    assert res["model"] == "WAN22" and res["adapter"] == "wan" and res["kinds"] == ["FusedWanBlock"], res
    assert res["fused"] == ["blocks.0", "blocks.1"] and res["covered_all"] and res["plain_is_per_linear"], res
    assert res["timestep_shape"] == [2, FRAMES], res             # per latent frame
    # the fused path ran (no fallback): norm1's kernel once a block, one modulation row per token
    assert res["ln_calls"] == 2 and res["ln_tokens"] == [1], res
    assert res["rel"] <= REL_MODEL and res["rel_float"] < 5e-2, res
    b = res["block"]
    assert b["e_shape"][1] == FRAMES and b["x_shape"][1] == 4 * FRAMES and b["frames_differ"], b
    # q, k, v, o, ffn.0, ffn.2 fused (cross-attention per-linear: 4 more int8 layers); bit-equal GEMM inputs
    assert b["same_activations"] and b["gemms_fused"] == 6 and b["int8_layers"] == 10, b
    assert b["ln_tokens"] == [[1, [2, 4 * FRAMES, 64]]], b    # norm1: per-token rows [B, L, C], one a token
    assert b["tail_tokens"] == {"residual_add": [1], "residual_add_layernorm": [1],
                                "residual_add_layernorm_modulate_quantize": [1]}, b
    assert b["rel"] <= REL_MODEL and all(r <= REL_MODEL for r in b["rels"].values()), b


def _check_14b(res):
    assert res["kinds"] == ["FusedWanBlock"] and res["head_dim"] == 128, res
    assert res["covers"] == sorted(["self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q",
                                    "cross_attn.k", "cross_attn.v", "cross_attn.o", "cross_attn.k_img",
                                    "cross_attn.v_img", "ffn.0", "ffn.2"]) and res["n_layers"] == 12, res
    assert res["rel"] <= REL_MODEL, res


# ----------------------------------------------------------------------------------- pinned ComfyUI (in-process)
@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_tiny_wan22_5b_fused_vs_per_linear_pinned(pack, dtype):
    res = wan22_equivalence(pack, dtype)
    print(res)
    _check(res)


@pytest.mark.interpreter
def test_wan_14b_layout_is_fused_pinned(pack):
    _check_14b(wan14b_layout(pack))


# ----------------------------------------------------------------------------------- current ComfyUI (subprocess)
def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    from comfyui_version import __version__
    return {"comfyui": __version__, "bf16": wan22_equivalence(pack, BF16), "fp32": wan22_equivalence(pack, FP32),
            "14b": wan14b_layout(pack)}


def test_tiny_wan22_5b_fused_on_the_current_comfyui(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res)
    _check(res["bf16"])
    _check(res["fp32"])
    _check_14b(res["14b"])
