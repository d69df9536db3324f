"""Fused Wan 2.x attention blocks (issue 13, adapters/wan/) on the CPU (TRITON_INTERPRET=1).

A tiny Wan 2.1 T2V (dim 64, 2 heads, ffn 128, 2 layers) built from ComfyUI's own ``WanModel`` class, pinned 0.3.75
in-process and the current ComfyUI (COMFYUI_CURRENT, 0.33.0: ``WanFeedForward``, attention patches) in a subprocess:

* the adapter turns every ``blocks.N`` into a ``FusedWanBlock``; ``int8_layers()`` gives back every covered layer
  with identical int8 weights and scales; ``INT8_FUSED_FUSION=0`` gives the per-linear patches;
* on block 0 (inputs captured from a real model call, batch 2), the int8 activation every GEMM of the fused block
  receives equals what the per-linear INT8 block quantizes (its Int8Linear inputs through
  ``quantize_per_token_ref``): bit for bit in bf16 (the LayerNorm output rounds to the model dtype; the modulation
  sum is computed by the same torch op as ComfyUI's), equal codes and scales within 2^-20 in fp32 (the LayerNorm's
  fp32 sum order). q, k and v read ONE activation: the LayerNorm kernel runs once per block (norm1 for q/k/v),
  ffn.0's input comes with the residual sum before it (``residual_add_layernorm_modulate_quantize``), and the GELU
  kernel feeds ffn.2; the other two residual tails run as one kernel each (``residual_add_layernorm`` with norm3,
  ``residual_add``; tests/test_wan_residual.py); q and k get norm_q / norm_k and RoPE from one
  ``qk_rmsnorm_rope_rows`` launch (its numerics: tests/test_qk_norm_rope.py);
* whole-model output vs the per-linear path within ``REL_MODEL``: equal int8 GEMM inputs leave only fp32 op-order
  differences in the float glue (0 on the CPU); on a GPU a rare +-1 code (a LayerNorm / GELU result within an fp32
  ulp of a bf16 rounding midpoint: rate p < 1e-3, tests/test_flux_fused.py part 1) moves a GEMM output by about
  sqrt(p) * crest / 127 <= 0.03 * 4 / 127 ~ 1e-3 relative;
* Wan 2.2 5B's per-token modulation (``e`` [B, L, 6, C]) runs fused too (within ``REL_MODEL``; in depth:
  tests/test_wan22_fused.py); calls the fused path does not implement run ComfyUI's own forward on the INT8 twin
  (results equal the per-linear block's exactly): ``attn2_patch`` (applied by 0.33.0, ignored by 0.3.75);
* a model whose blocks are another class (``VaceWanAttentionBlock`` through ``wan_attn_block_class``) stays
  per-linear with one log line; kept-float ffn.2 / different SmoothQuant vectors on q/k/v still fuse the rest.

Run: TRITON_INTERPRET=1 .runtime/venv/bin/python -m pytest tests/test_wan_fused.py -q
"""
import logging

import pytest
import torch

import fused_block_helpers as fbh

REL_MODEL = 2e-3
BF16, FP32 = torch.bfloat16, torch.float32


def tiny_wan(dtype, layers=2, cross_attn_norm=True, block_class=None, seed=0):
    """A tiny Wan 2.1 T2V from the running ComfyUI's WanModel, random weights."""
    import comfy.ldm.wan.model as wan
    import comfy.ops
    kw = {} if block_class is None else {"wan_attn_block_class": block_class}
    dm = wan.WanModel(model_type="t2v", patch_size=(1, 2, 2), text_len=8, in_dim=16, dim=64, ffn_dim=128,
                      freq_dim=32, text_dim=32, out_dim=16, num_heads=2, num_layers=layers,
                      cross_attn_norm=cross_attn_norm, device="cpu", dtype=dtype,
                      operations=comfy.ops.disable_weight_init, **kw)
    fbh.randomize(dm, seed)
    return dm


_layers, _swap, _rel = fbh.int8_layers, fbh.swapped, fbh.rel


def _inputs(dtype, b=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 16, 2, 4, 8, generator=g).to(dtype)  # 2 frames of 2 x 4 patches: 16 tokens a sample
    ctx = torch.randn(b, 8, 32, generator=g).to(dtype)
    return x, torch.tensor([600.0, 300.0][:b]), ctx


def _block_inputs(dm, dtype):
    """(args, kwargs) blocks.0 receives in a float model call."""
    got = {}

    def hook(mod, args, kwargs):
        got.setdefault("in", (tuple(a.clone() if torch.is_tensor(a) else a for a in args),
                              {k: (v.clone() if torch.is_tensor(v) else v) for k, v in kwargs.items()}))

    h = dm.blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            dm(*_inputs(dtype))
    finally:
        h.remove()
    return got["in"]


def _logged(fn):
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    log = logging.getLogger("int8_fused")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        return fn(), records
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


def block_activations(pack, dm, layers, patches, dtype) -> dict:
    """On blocks.0: the (int8, scale) every GEMM of the fused block receives vs what the per-linear INT8 block
    quantizes, the block outputs, and the fallback calls."""
    qf = pack.quant.blocks
    Int8Linear = pack.quant.linear.Int8Linear
    from quant.quantize import quantize_per_token_ref
    name = "blocks.0"
    args, kwargs = _block_inputs(dm, dtype)
    x, e = args[0], kwargs.pop("e")                  # WanModel calls block(x, e=e0, freqs=..., context=..., ...)
    plain = _swap(dm.get_submodule(name), {k[len(name) + 1:]: v for k, v in layers.items()
                                            if k.startswith(name + ".")})
    fused = patches[name]
    seen_plain, seen_fused, ln_calls, gelu_calls = {}, {}, [], []

    def record(mod, a):
        seen_plain.setdefault(id(mod), quantize_per_token_ref(a[0].reshape(-1, a[0].shape[-1]), mod.inv_smooth))

    hooks = [m.register_forward_pre_hook(record) for m in plain.modules() if isinstance(m, Int8Linear)]
    real_gemm, real_ln, real_gelu = qf.gemm, qf.ln_mod_quant, qf.cat_gelu_quant

    def spy(a_q, a_s, layer, dt):
        seen_fused.setdefault(id(layer), (a_q.clone(), a_s.clone()))
        return real_gemm(a_q, a_s, layer, dt)

    real_call = Int8Linear.int8_call

    def call_spy(layer, x_in):  # qf.linear: quantization + GEMM as one prepared call (Int8Linear.int8_call)
        seen_fused.setdefault(id(layer), quantize_per_token_ref(x_in.reshape(-1, x_in.shape[-1]), layer.inv_smooth))
        return real_call(layer, x_in)

    def ln_spy(*a):
        ln_calls.append(1)
        return real_ln(*a)

    def gelu_spy(*a):
        gelu_calls.append(1)
        return real_gelu(*a)

    def call(blk, ee=None, **over):
        return blk(x.clone(), *args[1:], e=e if ee is None else ee, **{**kwargs, **over})

    kf = qf.kernels()
    real_qk, qk_calls = kf.rope.qk_rmsnorm_rope_rows, []
    tails = ("residual_add", "residual_add_layernorm", "residual_add_layernorm_modulate_quantize")
    real_tails, tail_calls = {n: getattr(kf.residual, n) for n in tails}, {n: 0 for n in tails}

    def qk_spy(*a):
        qk_calls.append(a[0].shape)
        return real_qk(*a)

    def tail_spy(name):
        def f(*a, **kw):
            tail_calls[name] += 1
            return real_tails[name](*a, **kw)
        return f

    for n in tails:
        setattr(kf.residual, n, tail_spy(n))
    qf.gemm, qf.ln_mod_quant, qf.cat_gelu_quant, kf.rope.qk_rmsnorm_rope_rows = spy, ln_spy, gelu_spy, qk_spy
    Int8Linear.int8_call = call_spy
    try:
        with torch.no_grad():
            with fbh.unplanned(kf.plan):  # counted: a prepared call skips the wrappers
                ref, got = call(plain), call(fused)
            for h in hooks:
                h.remove()
            n_ln, n_gelu, n_qk, n_tails = len(ln_calls), len(gelu_calls), len(qk_calls), dict(tail_calls)
            planned_equal = all(torch.equal(call(fused), got) for _ in range(2))  # prepared launches re-issued
            # Wan 2.2 5B: per-token modulation [B, L, 6, C] (WanModel's e0 is [B, 1, 6, C]; tests/test_wan22_fused.py)
            e4 = e.expand(e.shape[0], x.shape[1], *e.shape[2:]).contiguous()   # e: [B, 1, 6, C]
            ref4, got4 = call(plain, e4), call(fused, e4)
            # VACE / camera models: e0 as [B, 6, C] (the fused path too)
            ref3, got3 = call(plain, e[:, 0]), call(fused, e[:, 0])
            # the modulation in fp32 with bf16 hidden states (ComfyUI promotes: the GEMM inputs are fp32); not with
            # an affine norm3, whose bf16 weight the plain ops of this tiny model do not cast to fp32 inputs
            e32 = isinstance(fused.norm3, torch.nn.Identity)
            c32 = kwargs["context"].float()     # and fp32 text (cross-attention: q is fp32 then)
            ref32, got32 = (call(plain, e.float(), context=c32), call(fused, e.float(), context=c32)) if e32 \
                else (ref, got)
            to = {"patches": {"attn2_patch": [lambda d: d["x"] * 0.5]}}
            ref_p, got_p = call(plain, transformer_options=to), call(fused, transformer_options=to)
    finally:
        qf.gemm, qf.ln_mod_quant, qf.cat_gelu_quant, kf.rope.qk_rmsnorm_rope_rows = real_gemm, real_ln, real_gelu, real_qk
        Int8Linear.int8_call = real_call
        for n in tails:
            setattr(kf.residual, n, real_tails[n])
        for h in hooks:
            h.remove()
    sa = fused.self_attn
    qkv_ids = [id(getattr(sa, n)) for n in ("q", "k", "v")]
    same_act = set(seen_fused) <= set(seen_plain) and all(
        torch.equal(seen_fused[i][0], seen_plain[i][0]) and (
            torch.equal(seen_fused[i][1], seen_plain[i][1]) if dtype != FP32 else
            torch.allclose(seen_fused[i][1], seen_plain[i][1], rtol=2.0 ** -20, atol=0))
        for i in seen_fused)
    return {"gemms_fused": len(seen_fused), "int8_layers": len(seen_plain), "same_activations": same_act,
            "qkv_fused": all(i in seen_fused for i in qkv_ids),
            "qkv_one_activation": all(seen_fused[i][0] is not None and torch.equal(seen_fused[i][0],
                                                                               seen_fused[qkv_ids[0]][0])
                                      for i in qkv_ids if i in seen_fused),
            "ln_kernels": n_ln, "gelu_kernels": n_gelu, "qk_kernels": n_qk, "tail_kernels": n_tails,
            "planned_equal": planned_equal,
            "norm3_affine": isinstance(fused.norm3, torch.nn.LayerNorm), "rel": _rel(got, ref),
            "e4_rel": _rel(got4, ref4), "e3_rel": _rel(got3, ref3),
            "e32_rel": _rel(got32, ref32) if e32 else None, "e32_dtype": got32.dtype == ref32.dtype, "patched_equal": torch.equal(got_p, ref_p),
            "patch_applied": not torch.equal(ref_p, ref)}


def wan_equivalence(pack, dtype=BF16, cross_attn_norm=True) -> dict:
    A, cfg = pack.adapters, pack.quant.blocks.config
    dm = tiny_wan(dtype, cross_attn_norm=cross_attn_norm)
    layers = _layers(pack, dm)
    patches = A.object_patches(dm, layers)
    with cfg.override(INT8_FUSED_FUSION=False):
        plain = A.object_patches(dm, layers)
    back = A.int8_layers_of(patches)
    same_layers = back.keys() == layers.keys() and all(torch.equal(back[n].qweight, layers[n].qweight)
                                                       and torch.equal(back[n].weight_scale, layers[n].weight_scale)
                                                       for n in layers)
    covered = sorted(n for m in patches.values() for n in getattr(m, "covers", ()))
    x, t, ctx = _inputs(dtype)
    with torch.no_grad():
        ref = _swap(dm, plain)(x, t, ctx)
        got = _swap(dm, patches)(x, t, ctx)
        flt = dm(x, t, ctx)
    return {"adapter": A.adapter_for(dm).name, "kinds": sorted({type(m).__name__ for m in patches.values()}),
            "fused": sorted(patches), "plain_is_per_linear": plain == layers, "covered_all": covered == sorted(layers),
            "n_layers": len(layers), "same_layers": same_layers, "rel": _rel(got, ref), "rel_float": _rel(ref, flt),
            "block": block_activations(pack, dm, layers, patches, dtype)}


def unsupported_blocks(pack) -> dict:
    """Blocks of another class (VACE's block class as every block) stay per-linear, one log line."""
    import comfy.ldm.wan.model as wan
    A = pack.adapters
    dm = tiny_wan(BF16, layers=2, block_class=wan.VaceWanAttentionBlock)
    layers = _layers(pack, dm)
    patches, records = _logged(lambda: A.object_patches(dm, layers))
    return {"plain": patches == layers and len(layers) > 0, "log": [r for r in records if "Wan blocks" in r]}


def _check_equivalence(res):
    assert res["adapter"] == "wan" and res["kinds"] == ["FusedWanBlock"], res
    assert res["fused"] == ["blocks.0", "blocks.1"] and res["n_layers"] == 20, res
    assert res["plain_is_per_linear"] and res["covered_all"] and res["same_layers"], res
    assert res["rel"] <= REL_MODEL and res["rel_float"] < 5e-2, res
    b = res["block"]
    # q, k, v, o, ffn.0, ffn.2 through the fused GEMM calls (cross-attention per-linear: 4 more int8 layers)
    assert b["same_activations"] and b["gemms_fused"] == 6 and b["int8_layers"] == 10, b
    assert b["qkv_fused"] and b["qkv_one_activation"] and b["ln_kernels"] == 1 and b["gelu_kernels"] == 1, b
    assert b["planned_equal"], b  # the block with prepared launches re-issued: bit for bit the checked calls
    # the residual tails: addcmul + norm3 (a LayerNorm: one kernel; Identity: the sum alone), x + cross-attention +
    # norm2 * (1 + e4) + e3 + quantization for ffn.0 (one kernel), the last addcmul (one kernel)
    affine = b["norm3_affine"]
    assert b["tail_kernels"] == {"residual_add": 1 if affine else 2, "residual_add_layernorm": 1 if affine else 0,
                                 "residual_add_layernorm_modulate_quantize": 1}, b
    # QK norm + RoPE: one kernel launch for q and k; the block within REL_MODEL of the per-linear path (its norm
    # modules and ComfyUI's apply_rope1)
    assert b["qk_kernels"] == 1, b
    assert b["rel"] <= REL_MODEL and b["e3_rel"] <= REL_MODEL and (b["e32_rel"] is None or b["e32_rel"] <= REL_MODEL) and b["e32_dtype"] and b["e4_rel"] <= REL_MODEL and b["patched_equal"], b


def _check_unsupported(res):
    assert res["plain"], res
    assert len(res["log"]) == 1 and "VaceWanAttentionBlock is not ComfyUI's WanAttentionBlock" in res["log"][0], res


# ----------------------------------------------------------------------------------- pinned ComfyUI (in-process)
@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,cross_attn_norm", [(BF16, False), (FP32, True)])
def test_tiny_wan_fused_vs_per_linear_pinned(pack, dtype, cross_attn_norm):
    res = wan_equivalence(pack, dtype, cross_attn_norm)
    print({k: v for k, v in res.items() if k != "block"}, res["block"])
    _check_equivalence(res)
    assert not res["block"]["patch_applied"]          # 0.3.75's Wan block ignores attn2_patch


def test_unsupported_block_class_stays_per_linear_pinned(pack):
    _check_unsupported(unsupported_blocks(pack))


@pytest.mark.interpreter
def test_fusion_switch_other_backends_and_partial_pinned(pack):
    A, qf = pack.adapters, pack.quant.blocks
    dm = tiny_wan(BF16, layers=1)
    layers = _layers(pack, dm)
    with qf.config.override(INT8_FUSED_FUSION=False):
        assert A.object_patches(dm, layers) == layers
    other = _layers(pack, dm, "dequant_bf16")
    assert A.object_patches(dm, other) == other                      # only fused_triton layers are fused
    # kept-float ffn.2 (calibration protection) and a SmoothQuant vector on k only: still fused; k gets its own
    # LayerNorm kernel, q and v share one
    part = {n: m for n, m in layers.items() if not n.endswith("ffn.2")}
    lin = dm.blocks[0].self_attn.k
    part["blocks.0.self_attn.k"] = pack.quant.linear.Int8Linear.from_float(
        lin.weight, lin.bias, smooth=torch.linspace(0.5, 2.0, lin.in_features), backend="fused_triton",
        name="blocks.0.self_attn.k")
    patches = A.object_patches(dm, part)
    assert set(patches) == {"blocks.0"} and patches["blocks.0"]._qkv_src == (0, 1, 0)
    assert A.int8_layers_of(patches).keys() == part.keys()
    x, t, ctx = _inputs(BF16)
    with torch.no_grad():
        ref, got = _swap(dm, part)(x, t, ctx), _swap(dm, patches)(x, t, ctx)
    assert _rel(got, ref) <= REL_MODEL


# ----------------------------------------------------------------------------------- current ComfyUI (subprocess)
def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    from comfyui_version import __version__
    return {"comfyui": __version__, "bf16": wan_equivalence(pack, BF16, False),
            "fp32": wan_equivalence(pack, FP32, True), "unsupported": unsupported_blocks(pack)}


def test_tiny_wan_fused_on_the_current_comfyui(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res["comfyui"], {k: v for k, v in res["bf16"].items() if k != "block"}, res["bf16"]["block"])
    for dt in ("bf16", "fp32"):
        _check_equivalence(res[dt])
        assert res[dt]["block"]["patch_applied"]      # current ComfyUI applies attn2_patch (its own forward ran)
    _check_unsupported(res["unsupported"])


def test_tiny_wan_bf16_lora_runs_inside_the_fused_blocks_gemms_pinned(pack):
    """A LoRA after Apply (``Int8Linear.set_lora``) on every linear of a bf16 tiny Wan 2.1: the fused blocks' q / k / v
    / o / ffn.0 / ffn.2 run it inside their GEMM (bf16 operands); the cross-attention's module calls add the pair from
    their float input. The LoRA's effect on the output is the per-linear model's (every layer's pair from its float
    input) within 5 %: the fused path's LoRA reads the int8-rounded input."""
    A, ql, lin = pack.adapters, pack.quant.lora, pack.quant.linear.Int8Linear
    dm = tiny_wan(BF16)
    layers = _layers(pack, dm)
    patches = A.object_patches(dm, layers)
    with pack.quant.blocks.config.override(INT8_FUSED_FUSION=False):
        plain = A.object_patches(dm, layers)
    x, t, ctx = _inputs(BF16)
    with torch.no_grad():
        base_f, base_p = _swap(dm, patches)(x, t, ctx), _swap(dm, plain)(x, t, ctx)
    g = torch.Generator().manual_seed(9)
    for name, layer in layers.items():
        n, k = layer.out_features, layer.in_features
        layer.set_lora(ql.Branches([ql.Term(torch.randn(8, k, generator=g) / k ** 0.5,
                                            torch.randn(n, 8, generator=g) * 0.5, 1.0)], [], n, k))
    seen = {"epilogue": [], "pair_float": 0, "pair_codes": 0}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lin, "gemm_lora_call", lambda self, *a, _f=lin.gemm_lora_call:
                   seen["epilogue"].append((self.name, a[3].dtype)) or _f(self, *a))  # a: a_q, a_s, dtype, down, up
        mp.setattr(ql.Branches, "add", lambda self, *a, _f=ql.Branches.add: seen.__setitem__(
            "pair_float", seen["pair_float"] + 1) or _f(self, *a))
        mp.setattr(ql.Branches, "add_quantized", lambda self, *a, _f=ql.Branches.add_quantized: seen.__setitem__(
            "pair_codes", seen["pair_codes"] + 1) or _f(self, *a))
        with torch.no_grad():
            got = _swap(dm, patches)(x, t, ctx)
    with torch.no_grad():
        ref = _swap(dm, plain)(x, t, ctx)
    for layer in layers.values():
        layer.set_lora(None)
    names = sorted({n for n, _ in seen["epilogue"]})
    assert names == sorted(f"blocks.{blk}.{p}" for blk in ("0", "1") for p in
                           ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "ffn.0", "ffn.2")), names
    assert {dt for _, dt in seen["epilogue"]} == {BF16}
    assert seen["pair_codes"] == 0 and seen["pair_float"] == 8  # cross_attn q / k / v / o of two blocks
    effect_f, effect_p = (got - base_f).float(), (ref - base_p).float()
    assert effect_p.norm() > 0.1 * base_p.float().norm()  # the LoRA matters
    assert _rel(effect_f, effect_p) < 0.05, _rel(effect_f, effect_p)
