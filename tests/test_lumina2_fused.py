"""Fused Lumina 2 / Z-Image blocks (issue 13) on the CPU (TRITON_INTERPRET=1).

A tiny NextDiT built from ComfyUI's own classes (scripts/miniature.py's ``TINY_UNET_CONFIG["lumina2"]``: GQA, 4
heads / 2 kv heads) and a Z-Image-style variant (``z_image_modulation``: adaLN without SiLU from a 256-wide
timestep embedding; width 256, its tensors random; no GQA, which takes 0.33.0's comfy_kitchen ``rms_rope``
instead of ``rms_rope1``), pinned 0.3.75 in-process and the current ComfyUI (COMFYUI_CURRENT, 0.33.0) in a
subprocess (``body``):

* the adapter turns every modulated block (``layers.N``, ``noise_refiner.N``) into a ``FusedLumina2Block`` and
  keeps ``context_refiner.N`` (no modulation) on the FeedForward-only fusion; the covered names plus the plain
  Int8Linear patches (context_refiner's attention) are exactly the INT8 layers, each once; ``int8_layers()``
  gives back every one of them with identical int8 weights and scales;
* on ``layers.0`` and ``noise_refiner.0``: the int8 activations (codes and per-token scales) the qkv, out, merged
  w1+w3 and w2 GEMMs receive equal what the per-linear INT8 block quantizes (``quantize_per_token_ref`` of each
  Int8Linear's input; w1+w3 against w1's). qkv and w1+w3 come from ``rmsnorm_modulate_quantize``, whose definition
  is ComfyUI's ``modulate(rms_norm(x), scale)`` = ``x * (1 + scale)`` with the same two roundings, so bf16 is bit
  for bit; fp32 codes bit for bit and scales within 2^-20 (the norm's fp32 sum order, as for Flux).
  w2's input comes from the SwiGLU kernel after an identical w1+w3 GEMM: equal too, except a value on an exact
  bf16 / int8 rounding tie (none here; the kernel tests of tests/test_fused.py bound those);
* block and whole-model outputs vs the per-linear path within ``REL_MODEL`` = 2e-3 (relative L2): with equal int8
  inputs the GEMM outputs are equal, and what remains is fp32 op order in the float glue (the same torch ops on
  the same values: 0 here) plus, on a GPU, the rare +-1 code at a tie (rate p < 1e-3) moving a GEMM output by
  about sqrt(p) * crest / 127 <= 0.03 * 4 / 127 ~ 1e-3 relative;
* QK norm + RoPE: without GQA (the Z-Image config) one ``qk_norm_rope`` launch per block call (numerics:
  tests/test_qk_norm_rope.py), none with GQA;
* fallbacks, each with one log line: calls with attention patches (and, 0.33.0, ``timestep_zero_index``) run
  ComfyUI's own ``JointTransformerBlock.forward`` on the fused block's INT8 twin (result within ``REL_MODEL`` of
  the per-linear block); a ComfyUI whose lumina functions are unknown keeps every block on the FeedForward-only
  fusion.

Run: TRITON_INTERPRET=1 .runtime/venv/bin/python -m pytest tests/test_lumina2_fused.py -q
"""
import logging
import sys

import pytest
import torch

import fused_block_helpers as fbh

REL_MODEL = 2e-3
BF16, FP32 = torch.bfloat16, torch.float32
CONFIGS = {"lumina2": {}, "z_image": {"z_image_modulation": True, "dim": 256, "n_heads": 8, "n_kv_heads": 8,
                                         "ffn_dim_multiplier": 8 / 3}}
# z_image: width 256 (adaLN reads min(dim, 256) features of a 256-wide timestep embedding, so 128 cannot run);
# head_dim 32 = sum(axes_dims) as in the miniature
BLOCKS = ("layers.0", "noise_refiner.0")


def tiny_lumina(dtype, config="lumina2"):
    """The width-128 Lumina 2 miniature from the running ComfyUI's classes (``CONFIGS[config]`` on top); tensors
    the miniature does not have (0.33.0's extras, Z-Image's shapes) small random."""
    import comfy.supported_models
    import comfy_harness as H
    mini = H.miniature()
    mc = comfy.supported_models.Lumina2(dict(mini.TINY_UNET_CONFIG["lumina2"], **CONFIGS[config]))
    mc.set_inference_dtype(dtype, None)
    dm = mc.get_model({}, "", device=torch.device("cpu")).diffusion_model
    own = dm.state_dict()
    sd = {k: v for k, v in mini.tiny_state_dict("lumina2", 0, dtype).items()
          if k in own and own[k].shape == v.shape}
    missing = dm.load_state_dict(sd, strict=False).missing_keys
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for k in missing:
            p = dm.get_parameter(k)
            p.copy_((torch.randn(p.shape, generator=g) * (0.02 if "adaLN" in k else 1.0 / p.shape[-1] ** 0.5))
                    .to(p.dtype) if p.dim() > 1 else 1 + 0.02 * torch.randn(p.shape, generator=g).to(p.dtype))
    return dm


_layers, _swap, _rel = fbh.int8_layers, fbh.swapped, fbh.rel


def _qref(y, inv=None):
    from quant.quantize import quantize_per_token_ref
    return quantize_per_token_ref(y, inv)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _logged(fn):
    h, log = _Records(), logging.getLogger("int8_fused")
    old = log.level
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        return fn(), h.lines
    finally:
        log.removeHandler(h)
        log.setLevel(old)


def block_activations(pack, dm, layers, patches, dtype, current: bool) -> dict:
    """On ``BLOCKS``: the (int8, scale) each GEMM of the fused block receives vs the per-linear block's Int8Linear
    inputs through ``quantize_per_token_ref``; outputs; the fallback calls (module doc)."""
    qf, Int8Linear = pack.quant.blocks, pack.quant.linear.Int8Linear
    fl = pack.adapters.lumina2.blocks
    g = torch.Generator().manual_seed(3)
    dim, b, l = dm.dim, 2, 10
    x = torch.randn(b, l, dim, generator=g).to(dtype)
    ada = torch.randn(b, dm.layers[0].adaLN_modulation[-1].in_features, generator=g).to(dtype)
    ids = torch.zeros(b, l, 3)
    ids[:, :, 1] = torch.arange(l).float()
    ids[:, :, 2] = torch.arange(l).float() % 3
    freqs = dm.rope_embedder(ids).movedim(1, 2)
    out = {}
    real_gemm = qf.gemm
    for name in BLOCKS:
        plain = _swap(dm.get_submodule(name), {k[len(name) + 1:]: v for k, v in layers.items()
                                               if k.startswith(name + ".")})
        fused = patches[name]
        names_fused = {id(m): n for n, m in fused.named_modules() if isinstance(m, Int8Linear)}
        seen_plain, seen_fused = {}, {}
        hooks = []
        for n, m in plain.named_modules():
            if isinstance(m, Int8Linear):
                def record(mod, args, n=n):
                    seen_plain.setdefault(n, _qref(args[0].reshape(-1, args[0].shape[-1]), mod.inv_smooth))
                hooks.append(m.register_forward_pre_hook(record))

        def spy(a_q, a_s, layer, dt):
            seen_fused.setdefault(names_fused.get(id(layer), "?"), (a_q.clone(), a_s.clone()))
            return real_gemm(a_q, a_s, layer, dt)

        real_call = Int8Linear.int8_call

        def call_spy(layer, x):  # qf.linear: quantization + GEMM as one prepared call (Int8Linear.int8_call)
            seen_fused.setdefault(names_fused.get(id(layer), "?"),
                                  _qref(x.reshape(-1, x.shape[-1]), layer.inv_smooth))
            return real_call(layer, x)

        real_swiglu = qf.gemm_swiglu

        def swiglu_spy(a_q, a_s, layer, dt, clamp=False):  # the w1+w3 GEMM with SwiGLU in its epilogue
            seen_fused.setdefault(names_fused.get(id(layer), "?"), (a_q.clone(), a_s.clone()))
            return real_swiglu(a_q, a_s, layer, dt, clamp)

        kf = qf.kernels()
        real_qk, qk_calls = kf.rope.qk_norm_rope, []

        def qk_spy(*a, **kw):
            qk_calls.append(a[0].shape)
            return real_qk(*a, **kw)

        qf.gemm, qf.gemm_swiglu, kf.rope.qk_norm_rope, Int8Linear.int8_call = spy, swiglu_spy, qk_spy, call_spy
        try:
            with torch.no_grad():
                ref, got = plain(x.clone(), None, freqs, ada), fused(x.clone(), None, freqs, ada)
                n_qk = len(qk_calls)
        finally:
            qf.gemm, qf.gemm_swiglu, kf.rope.qk_norm_rope, Int8Linear.int8_call = real_gemm, real_swiglu, real_qk, real_call
            for hk in hooks:
                hk.remove()
        pairs = {"attention.qkv": "attention.qkv", "attention.out": "attention.out",
                 "feed_forward.w13": "feed_forward.w1", "feed_forward.w2": "feed_forward.w2"}
        same = {}
        for fn_, pn in pairs.items():
            if fn_ not in seen_fused or pn not in seen_plain:
                same[fn_] = False
                continue
            (qa, sa), (qb, sb) = seen_fused[fn_], seen_plain[pn]
            same[fn_] = torch.equal(qa, qb) and (torch.equal(sa, sb) if dtype != FP32 else
                                                 torch.allclose(sa, sb, rtol=2.0 ** -20, atol=0))
        # fallbacks: ComfyUI's own forward on the twin (logged once per reason per process)
        fl._LOGGED.clear()
        to = {"patches": {"attn1_output_patch": [lambda attn, extra: attn]}}
        with torch.no_grad():
            (got_p, lines) = _logged(lambda: fused(x.clone(), None, freqs, ada, transformer_options=to))
            ref_p = plain(x.clone(), None, freqs, ada, transformer_options=to)
            res = {"same": same, "gemms": sorted(seen_fused), "rel": _rel(got, ref), "rel_patched": _rel(got_p, ref_p),
                   "qk_kernels": n_qk, "gqa": dm.layers[0].attention.n_local_heads != dm.layers[0].attention.n_local_kv_heads,
                   "patch_log": [ln for ln in lines if "Lumina 2 blocks run ComfyUI's own forward" in ln]}
            if current:  # 0.33.0: omni mode (timestep_zero_index; the adaLN input carries both timesteps)
                tz = [(l // 2, l)]
                ada2 = torch.cat((ada[:1] * 0.5, ada[:1]), 0)
                got_t, lines_t = _logged(lambda: fused(x[:1].clone(), None, freqs[:1], ada2, timestep_zero_index=tz))
                ref_t = plain(x[:1].clone(), None, freqs[:1], ada2, timestep_zero_index=tz)
                res["rel_tz"] = _rel(got_t, ref_t)
                res["tz_log"] = [ln for ln in lines_t if "timestep_zero_index" in ln]
        out[name] = res
    return out


def lumina_equivalence(pack, dtype=BF16, config="lumina2", current=False) -> dict:
    A, cfg = pack.adapters, pack.quant.blocks.config
    dm = tiny_lumina(dtype, config)
    layers = _layers(pack, dm)
    patches = A.object_patches(dm, layers)
    with cfg.override(INT8_FUSED_FUSION=False):
        plain = A.object_patches(dm, layers)
    back = A.int8_layers_of(patches)
    same_layers = back.keys() == layers.keys() and all(torch.equal(back[n].qweight, layers[n].qweight)
                                                       and torch.equal(back[n].weight_scale, layers[n].weight_scale)
                                                       for n in layers)
    covered = sorted([n for m in patches.values() for n in getattr(m, "covers", ())]   # + context_refiner's
                     + [n for n, m in patches.items() if isinstance(m, pack.quant.linear.Int8Linear)])  # attention
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(1, 16, 8, 8, generator=g).to(dtype), torch.randn(1, 6, 64, generator=g).to(dtype)
    t = torch.tensor([0.6])
    with torch.no_grad():
        ref = _swap(dm, plain)(x, t, ctx, num_tokens=6)
        got = _swap(dm, patches)(x, t, ctx, num_tokens=6)
        flt = dm(x, t, ctx, num_tokens=6)
    return {"adapter": A.adapter_for(dm).name,
            "kinds": {n: type(m).__name__ for n, m in sorted(patches.items()) if not type(m).__name__ == "Int8Linear"},
            "plain_is_per_linear": plain == layers, "covered_all": covered == sorted(layers),
            "same_layers": same_layers, "rel": _rel(got, ref), "rel_float": _rel(ref, flt),
            "blocks": block_activations(pack, dm, layers, patches, dtype, current)}


def unknown_functions_stay_ffn_only(pack) -> dict:
    """A ComfyUI whose lumina functions the adapter does not know: FeedForward-only fusion, one log line."""
    A = pack.adapters
    lum = sys.modules[A.__name__ + ".lumina2"]
    dm = tiny_lumina(BF16)
    layers = _layers(pack, dm)
    real = lum.comfy_functions

    def unknown():
        raise AttributeError("JointTransformerBlock.forward takes unknown arguments ('self', 'x', 'y')")

    lum.comfy_functions = unknown
    try:
        patches, lines = _logged(lambda: A.object_patches(dm, layers))
    finally:
        lum.comfy_functions = real
    kinds = sorted({type(m).__name__ for m in patches.values()} - {"Int8Linear"})
    return {"kinds": kinds, "n_ffn": sum(type(m).__name__ == "FusedFeedForward" for m in patches.values()),
            "log": [ln for ln in lines if "Lumina 2 blocks stay unfused" in ln]}


def _check(res, current=False):
    assert res["adapter"] == "lumina2", res
    kinds = res["kinds"]
    assert kinds == {"context_refiner.0.feed_forward": "FusedFeedForward", "layers.0": "FusedLumina2Block",
                     "layers.1": "FusedLumina2Block", "noise_refiner.0": "FusedLumina2Block"}, kinds
    assert res["plain_is_per_linear"] and res["covered_all"] and res["same_layers"], res
    assert res["rel"] <= REL_MODEL and res["rel_float"] < 5e-2, res
    for name, b in res["blocks"].items():
        assert all(b["same"].values()), (name, b)
        assert b["gemms"] == ["attention.out", "attention.qkv", "feed_forward.w13", "feed_forward.w2"], (name, b)
        assert b["rel"] <= REL_MODEL and b["rel_patched"] <= REL_MODEL, (name, b)
        # QK norm + RoPE: one qk_norm_rope launch per block call without GQA (Z-Image), none with GQA
        assert b["qk_kernels"] == (0 if b["gqa"] else 1), (name, b)
        assert len(b["patch_log"]) == 1 and "attention patches" in b["patch_log"][0], (name, b)
        if current:
            assert b["rel_tz"] <= REL_MODEL and len(b["tz_log"]) == 1, (name, b)


def _check_unknown(res):
    assert res["kinds"] == ["FusedFeedForward"] and res["n_ffn"] == 4, res
    assert len(res["log"]) == 1 and "not the supported ones" in res["log"][0], res


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,config", [(BF16, "lumina2"), (FP32, "lumina2"), (BF16, "z_image")])
def test_tiny_lumina2_fused_vs_per_linear_pinned(pack, dtype, config):
    res = lumina_equivalence(pack, dtype, config)
    print(res)
    _check(res)


def test_unknown_comfyui_functions_keep_feed_forward_fusion_pinned(pack):
    _check_unknown(unknown_functions_stay_ffn_only(pack))


def test_fusion_switch_off_pinned(pack):
    dm = tiny_lumina(BF16)
    layers = _layers(pack, dm)
    with pack.quant.blocks.config.override(INT8_FUSED_FUSION=False):
        assert pack.adapters.object_patches(dm, layers) == layers


# ----------------------------------------------------------------------------------- current ComfyUI (subprocess)
def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    from comfyui_version import __version__
    return {"comfyui": __version__, "bf16": lumina_equivalence(pack, BF16, "lumina2", current=True),
            "z_image": lumina_equivalence(pack, BF16, "z_image", current=True),
            "unknown": unknown_functions_stay_ffn_only(pack)}


def test_tiny_lumina2_fused_on_the_current_comfyui(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res["comfyui"], res["bf16"], res["z_image"])
    _check(res["bf16"], current=True)
    _check(res["z_image"], current=True)
    _check_unknown(res["unknown"])
