"""LoRA loaded AFTER "Apply Fused INT8 GEMM" runs as a low-rank side branch on the INT8 layers (quant/lora.py), on
the pinned ComfyUI in-process (legacy ModelPatcher, CPU): real LoRA safetensors files loaded by ComfyUI's own
LoraLoaderModelOnly, sampled by ComfyUI's sampler (``comfy.sample.sample``, 1 euler step) on the tiny Flux.

References and bounds
---------------------
* H: the Apply'd model WITHOUT the LoRA, with each targeted INT8 layer's output plus ``s * (x A^T) B^T`` computed in
  float64 from the file's tensors (forward hooks; Apply with INT8_FUSED_FUSION=0 so every layer is a module call).
  On fused_triton the fused blocks stay fused with a LoRA and its branch reads the GEMM's own int8 input (the codes
  of x per token): there H's x is that input, rounded in float64 by a quantizer written here (``_int8_input``),
  and the test checks that every branch ran that way (no block fell back to its per-linear path).
  The runtime branch R runs the same int8 base layers and adds the same term rounded in fp32 (relative ~K * 2^-24),
  so R and H differ only where such a rounding moves a downstream activation across an int8 rounding boundary: a
  one-step change of a vanishing fraction of the codes, against the model's int8 error, where every code is
  rounded. Hence ``||R - H|| <= 0.1 * ||H - F||`` (F: the float model with the LoRA patched by ComfyUI).
* M: the LoRA merged, then quantized (LoRA loader BEFORE Apply). R and M are both one W8A8 rounding of nearly the
  same weights (W and W + s B A), so their errors against F have the same distribution; over the latent's
  elements the norms concentrate, and ``||R - F|| <= 2 ||M - F||`` holds with a wide margin.
* The LoRA matters: ``||F - F0|| >= 5 ||H - F||`` (F0: the float model without it).
"""
import pytest
import torch
from safetensors.torch import save_file

PREFIX = "diffusion_model."
TARGETS = ("double_blocks.0.img_attn.qkv", "double_blocks.0.txt_mlp.2", "single_blocks.0.linear1",
           "single_blocks.0.linear2")


@pytest.fixture(scope="module")
def env(comfy_inprocess, pack, tmp_path_factory):
    import comfy.sample
    import folder_paths
    import nodes
    d = tmp_path_factory.mktemp("loras")
    folder_paths.add_model_folder_path("loras", str(d))
    return pack, comfy.sample, nodes, d


def _lora_file(folder, mp, name, targets, rank=4, seed=3, kind="lora"):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for t in targets:
        n, k = mp.get_model_object(PREFIX + t).weight.shape
        if kind == "lora":
            sd[f"{PREFIX}{t}.lora_down.weight"] = torch.randn(rank, k, generator=g) / k ** 0.5
            sd[f"{PREFIX}{t}.lora_up.weight"] = torch.randn(n, rank, generator=g) * 0.3 / rank ** 0.5
            sd[f"{PREFIX}{t}.alpha"] = torch.tensor(float(rank) / 2)
        else:  # LoHa
            for ab, shape in (("1_a", (n, rank)), ("1_b", (rank, k)), ("2_a", (n, rank)), ("2_b", (rank, k))):
                sd[f"{PREFIX}{t}.hada_w{ab}"] = torch.randn(*shape, generator=g) * 0.1
            sd[f"{PREFIX}{t}.alpha"] = torch.tensor(float(rank))
    save_file(sd, str(folder / name))
    return sd


def _sample(cs, model):
    g = torch.Generator().manual_seed(1)
    ctx, y = torch.randn(1, 8, 64, generator=g), torch.randn(1, 64, generator=g)
    latent, noise = torch.zeros(1, 16, 8, 8), torch.randn(1, 16, 8, 8, generator=g)
    pos = [[ctx, {"pooled_output": y}]]
    return cs.sample(model, noise, 1, 1.0, "euler", "simple", pos, pos, latent, seed=0, disable_pbar=True).float()


def _int8_input(x, inv_smooth):
    """x as the int8 GEMM reads it, in float64: the codes of ``x * inv_smooth`` per token (step max|row| / 127,
    round half to even, as torch.round), times the step, divided by inv_smooth again."""
    xs = x * (1.0 if inv_smooth is None else inv_smooth.double())
    step = xs.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 127.0
    q = torch.round(xs / step).clamp(-127, 127) * step
    return q / (1.0 if inv_smooth is None else inv_smooth.double())


def _hooked(base, loras, targets=TARGETS, from_codes=False):
    """Forward hooks adding sum_i s_i (x A_i^T) B_i^T in float64 to the INT8 layers of ``base``; ``from_codes``: x as
    the int8 GEMM reads it (``_int8_input``), which is what a fused block's LoRA branch reads (quant.lora
    ``add_quantized``)."""
    hooks = []
    for t in targets:
        layer = base.object_patches.get(PREFIX + t)
        assert layer is not None, t

        def hook(m, inp, out, t=t):
            x = inp[0].double()
            if from_codes:
                x = _int8_input(x, getattr(m, "inv_smooth", None))
            add = 0
            for sd, strength in loras:
                a, b = sd[f"{PREFIX}{t}.lora_down.weight"].double(), sd[f"{PREFIX}{t}.lora_up.weight"].double()
                add = add + strength * float(sd[f"{PREFIX}{t}.alpha"]) / a.shape[0] * (x @ a.T) @ b.T
            return (out.double() + add).to(out.dtype)
        hooks.append(layer.register_forward_hook(hook))
    return hooks


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch_int_mm", "fused_triton"])
def test_lora_after_apply_runs_as_side_branch(env, tiny_model, backend, monkeypatch):
    pack, cs, nodes, folder = env
    from kernel import config
    loader = nodes.LoraLoaderModelOnly()
    mp = tiny_model("flux")
    sd1 = _lora_file(folder, mp, "one.safetensors", TARGETS, seed=3)
    sd2 = _lora_file(folder, mp, "two.safetensors", TARGETS, rank=8, seed=4)
    apply = pack.nodes.apply.ApplyFusedInt8GEMM()
    quantized = []
    real = pack.quant.linear.quantize_weight_per_channel  # what Int8Linear.from_float quantizes with (a counter)
    monkeypatch.setattr(pack.quant.linear, "quantize_weight_per_channel",
                        lambda *a, **k: quantized.append(1) or real(*a, **k))
    q = apply.apply(mp, backend)[0]
    n_quant = len(quantized)
    base0 = _sample(cs, q)

    f0 = _sample(cs, mp)
    f1 = _sample(cs, loader.load_lora_model_only(mp, "one.safetensors", 1.0)[0])
    ran = []  # which branch form ran: from the int8 codes (fused block) or from the float input (module call)
    br = pack.quant.lora.Branches
    with pytest.MonkeyPatch.context() as mp_:
        for name in ("add", "add_quantized"):
            mp_.setattr(br, name, lambda self, *a, _f=getattr(br, name), _n=name: ran.append(_n) or _f(self, *a))
        r1 = _sample(cs, loader.load_lora_model_only(q, "one.safetensors", 1.0)[0])
    # fused_triton: every target is fed by a fused block's kernel, which stays fused: all four branches read the
    # codes (2 CFG-batched model calls: 1 euler step, cond and uncond in one call); torch_int_mm: module calls
    assert sorted(set(ran)) == (["add_quantized"] if backend == "fused_triton" else ["add"]), ran
    assert len(ran) == len(TARGETS)
    import comfy.model_management as mm
    mm.unload_all_models()  # the per-linear twin below and the fused clones above patch nested names of one tree
    with config.override(INT8_FUSED_FUSION=False):
        h = apply.apply(mp, backend)[0]
    # fused_triton's fused blocks feed the LoRA branch the GEMM's own int8 input (the block stays fused): its
    # reference reads x through the same rounding; torch_int_mm runs each layer as a module call (float x)
    codes = backend == "fused_triton"
    hooks = _hooked(h, [(sd1, 1.0)], from_codes=codes)
    try:
        h1 = _sample(cs, h)
    finally:
        for x in hooks:
            x.remove()
    mm.unload_all_models()
    m1 = _sample(cs, apply.apply(loader.load_lora_model_only(mp, "one.safetensors", 1.0)[0], backend)[0])
    err = (h1 - f1).norm()
    assert (f1 - f0).norm() >= 5 * err          # the LoRA matters
    assert (r1 - h1).norm() <= 0.1 * err, ((r1 - h1).norm(), err)
    assert (r1 - f1).norm() <= 2 * (m1 - f1).norm()

    # a new strength and a second LoRA stacked: no Apply re-run, no quantization
    n_before = len(quantized)
    q2 = loader.load_lora_model_only(loader.load_lora_model_only(q, "one.safetensors", -0.7)[0],
                                     "two.safetensors", 0.5)[0]
    mm.unload_all_models()
    r2 = _sample(cs, q2)
    assert len(quantized) == n_before
    hooks = _hooked(h, [(sd1, -0.7), (sd2, 0.5)], from_codes=codes)
    try:
        h2 = _sample(cs, h)
    finally:
        for x in hooks:
            x.remove()
    f2 = _sample(cs, loader.load_lora_model_only(loader.load_lora_model_only(mp, "one.safetensors", -0.7)[0],
                                                 "two.safetensors", 0.5)[0])
    assert (r2 - h2).norm() <= 0.1 * (h2 - f2).norm()
    # ComfyUI never patched the int8 weights: the LoRA clone holds no patch on an INT8 layer any more
    assert not any(k[len(PREFIX):].rsplit(".", 1)[0] in TARGETS for k in q2.patches)
    # the base model after the LoRA clones: its own output again, bit for bit
    mm.unload_all_models()
    assert _sample(cs, q).equal(base0)
    assert n_quant > 0 and len(quantized) == n_before


def test_unsupported_lora_kind_is_refused_naming_the_layer(env, tiny_model):
    pack, cs, nodes, folder = env
    mp = tiny_model("flux")
    _lora_file(folder, mp, "loha.safetensors", TARGETS[:1], kind="loha")
    q = pack.nodes.apply.ApplyFusedInt8GEMM().apply(mp, "torch_int_mm")[0]
    late = nodes.LoraLoaderModelOnly().load_lora_model_only(q, "loha.safetensors", 1.0)[0]
    with pytest.raises(RuntimeError, match=r"LoHa patch on INT8 layer 'double_blocks\.0\.img_attn\.qkv'.*BEFORE"):
        _sample(cs, late)
    # merged before Apply it still works
    early = nodes.LoraLoaderModelOnly().load_lora_model_only(mp, "loha.safetensors", 1.0)[0]
    assert torch.isfinite(_sample(cs, pack.nodes.apply.ApplyFusedInt8GEMM().apply(early, "torch_int_mm")[0])).all()


def test_branch_matches_float64_low_rank_term(pack):
    from comfy.weight_adapter.lora import LoRAAdapter
    """One layer: int8(x) + branch - int8(x) equals s (x A^T) B^T within fp32 rounding: per element at most
    (K + r + 2) * 2^-24 * (|x| |A|^T |B|^T |s| + |y|) (the dot-product error bound of each product and the add)."""
    lora, Int8Linear = pack.quant.lora, pack.quant.linear.Int8Linear
    g = torch.Generator().manual_seed(0)
    n, k, r = 48, 64, 6
    layer = Int8Linear.from_float(torch.randn(n, k, generator=g), torch.randn(n, generator=g), name="blk.0.qkv")
    x = torch.randn(5, 3, k, generator=g)
    a, b = torch.randn(r, k, generator=g), torch.randn(16, r, generator=g)
    base = layer(x)
    layers = lora.owners({"blk.0.qkv": layer})
    lora.install({"blk.0.qkv.weight": [(0.8, LoRAAdapter(set(), (b, a, 3.0, None, None, None)), 1.0, (0, 16, 16),
                                        None)]}, layers)
    y = layer(x)
    s = 0.8 * 3.0 / r
    ref = torch.zeros(5, 3, n, dtype=torch.float64)
    ref[..., 16:32] = s * (x.double() @ a.double().T) @ b.double().T
    mag = torch.zeros_like(ref)
    mag[..., 16:32] = abs(s) * (x.double().abs() @ a.double().abs().T) @ b.double().abs().T
    bound = (k + r + 2) * 2.0 ** -24 * (mag + y.double().abs())
    assert ((y.double() - base.double() - ref).abs() <= bound).all()
    lora.install({}, layers)
    assert layer.derived.lora is None and layer(x).equal(base)
    with pytest.raises(lora.LoraError, match="DoRA.*'blk.0.qkv'.*BEFORE"):
        dora = LoRAAdapter(set(), (b, a, 3.0, None, torch.ones(16), None))
        lora.install({"blk.0.qkv.weight": [(1.0, dora, 1.0, (0, 16, 16), None)]}, layers)


def _one_layer(pack):
    Int8Linear = pack.quant.linear.Int8Linear
    g = torch.Generator().manual_seed(5)
    layer = Int8Linear.from_float(torch.randn(48, 64, generator=g), torch.randn(48, generator=g), name="blk.0.qkv")
    return layer, pack.quant.lora.owners({"blk.0.qkv": layer}), torch.randn(2, 3, 64, generator=g)


def test_rank0_lora_refused_naming_layer_and_file(pack):
    """Issue 47 D1: a rank-0 LoRA (lora_up [N, 0], lora_down [0, K]) was a bare ZeroDivisionError (alpha / rank):
    a LoraError naming the layer and the LoRA file's tensors, before any layer changes."""
    from comfy.weight_adapter.lora import LoRAAdapter
    lora = pack.quant.lora
    layer, layers, x = _one_layer(pack)
    base = layer(x)
    keys = {f"{PREFIX}blk.0.qkv.lora_up.weight", f"{PREFIX}blk.0.qkv.lora_down.weight", f"{PREFIX}blk.0.qkv.alpha"}
    rank0 = LoRAAdapter(keys, (torch.zeros(48, 0), torch.zeros(0, 64), torch.tensor(4.0), None, None, None))
    with pytest.raises(lora.LoraError, match=r"INT8 layer 'blk\.0\.qkv' \(the LoRA file's .*blk\.0\.qkv\.alpha'.*"
                                             r"lora_down\.weight'.*\) has rank 0"):
        lora.install({"blk.0.qkv.weight": [(1.0, rank0, 1.0, None, None)]}, layers)
    assert layer.derived.lora is None and layer(x).equal(base)


def test_non_finite_lora_strength_or_weights_refused(pack):
    """Issue 47 D2: a NaN strength (the API takes one) or NaN / Inf inside lora_up / lora_down / alpha / a bias diff
    made every output NaN without a word: refused when the branches are built (``install``), naming the layer; the
    layer keeps the branches it had."""
    from comfy.weight_adapter.lora import LoRAAdapter
    lora = pack.quant.lora
    layer, layers, x = _one_layer(pack)
    g = torch.Generator().manual_seed(6)
    up, down = torch.randn(48, 4, generator=g), torch.randn(4, 64, generator=g)
    good = LoRAAdapter(set(), (up, down, 2.0, None, None, None))
    lora.install({"blk.0.qkv.weight": [(0.5, good, 1.0, None, None)]}, layers)
    branch, y = layer.derived.lora, layer(x)
    assert branch is not None and torch.isfinite(y).all()
    nan_up = up.clone()
    nan_up[3, 1] = float("nan")
    inf_down = down.clone()
    inf_down[0, 0] = float("inf")
    cases = [
        ({"blk.0.qkv.weight": [(float("nan"), good, 1.0, None, None)]}, r"non-finite strength \(nan\)"),
        ({"blk.0.qkv.weight": [(float("inf"), good, 1.0, None, None)]}, r"non-finite strength \(inf\)"),
        ({"blk.0.qkv.weight": [(1.0, LoRAAdapter(set(), (nan_up, down, 2.0, None, None, None)), 1.0, None, None)]},
         r"NaN / Inf in its lora_up"),
        ({"blk.0.qkv.weight": [(1.0, LoRAAdapter(set(), (up, inf_down, None, None, None, None)), 1.0, None, None)]},
         r"NaN / Inf in its lora_down"),
        ({"blk.0.qkv.weight": [(1.0, LoRAAdapter(set(), (up, down, torch.tensor(float("nan")), None, None, None)),
                                1.0, None, None)]}, r"non-finite scale"),
        ({"blk.0.qkv.bias": [(1.0, (torch.full((48,), float("nan")),), 1.0, None, None)]},
         r"NaN / Inf in its bias diff"),
        ({"blk.0.qkv.bias": [(float("nan"), (torch.ones(48),), 1.0, None, None)]}, r"non-finite strength"),
    ]
    for patches, what in cases:
        with pytest.raises(lora.LoraError, match=r"INT8 layer 'blk\.0\.qkv'.* " + what):
            lora.install(patches, layers)
        assert layer.derived.lora is branch and layer(x).equal(y)  # nothing changed
    # strength 0 switches a LoRA off, whatever it holds
    lora.install({"blk.0.qkv.weight": [(0.0, LoRAAdapter(set(), (nan_up, down, 2.0, None, None, None)), 1.0, None,
                                        None)]}, layers)
    assert layer.derived.lora is None


def test_apply_counts_only_the_lora_patches_comfy_merged(pack, tiny_model, caplog):
    """Issue 47 D3: a LoRA loaded BEFORE Apply is merged by ComfyUI's ``calculate_weight``, which skips a malformed
    one (here one row too many for its layer) with an error in its log and leaves the weight as it was; Apply's log
    said "2 LoRA patches merged" all the same. It counts what ComfyUI merged and says what it skipped."""
    import logging
    from comfy.weight_adapter.lora import LoRAAdapter
    quantize = pack.quant.quantize.quantize_weight_per_channel
    mp = tiny_model("flux")
    good, bad = "double_blocks.0.img_attn.qkv", "single_blocks.0.linear2"
    w_good, w_bad = (mp.get_model_object(PREFIX + t).weight.detach().float() for t in (good, bad))
    g = torch.Generator().manual_seed(8)
    up, down = torch.randn(w_good.shape[0], 4, generator=g) * 0.1, torch.randn(4, w_good.shape[1], generator=g) * 0.1
    ml = mp.clone()
    assert len(ml.add_patches({
        PREFIX + good + ".weight": LoRAAdapter(set(), (up, down, None, None, None, None)),
        PREFIX + bad + ".weight": LoRAAdapter(set(), (torch.randn(w_bad.shape[0] + 1, 4, generator=g),
                                                     torch.randn(4, w_bad.shape[1], generator=g),
                                                     None, None, None, None))}, 1.0)) == 2
    with caplog.at_level(logging.INFO):
        q = pack.nodes.apply.ApplyFusedInt8GEMM().apply(ml, "torch_int_mm")[0]
    msgs = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("ERROR") and bad in m for m in msgs)  # ComfyUI's own word on the skipped one
    assert q.int8_report.lora_patches_merged == 1
    line = next(m for m in msgs if m.startswith("INT8 Apply [torch_int_mm"))
    assert "; 1 LoRA patches merged" in line, line
    assert any("1 LoRA patches on the INT8 layers were not merged" in m for m in msgs), msgs
    # what the layers hold: the good LoRA merged, the bad layer's own weight
    for name, w in ((good, w_good + up @ down), (bad, w_bad)):
        qw, ws = quantize(w)
        layer = q.object_patches[PREFIX + name]
        assert torch.equal(layer.weight, qw) and torch.equal(layer.weight_scale, ws), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_branch_from_int8_codes_rounds_once_per_step(pack, dtype):
    """``Branches.add_quantized`` (a fused block's LoRA branch, from the int8 input codes): the bits of its documented
    steps spelled out here, h = a_q D^T in the output dtype, h * a_s in fp32 rounded once, y + h U^T in one addmm;
    and within the output dtype's rounding of the float64 low-rank term."""
    lora = pack.quant.lora
    g = torch.Generator().manual_seed(3)
    m, n, k, r = 37, 24, 64, 8
    down, up = torch.randn(r, k, generator=g) / 8, torch.randn(n, r, generator=g) / 8
    br = lora.Branches([lora.Term(down, up, 0.75)], [], n, k)
    a_q = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    a_s = torch.rand(m, generator=g) / 64 + 1e-3
    y = torch.randn(m, n, generator=g).to(dtype)
    out = br.add_quantized(a_q, a_s, y)
    d, u = down.to(dtype), (up.to(dtype) * 0.75)
    h = a_q.to(dtype) @ d.t()
    h = (h.float() * a_s[:, None]).to(dtype)
    assert torch.equal(out, torch.addmm(y, h, u.t()))
    ref = y.double() + 0.75 * ((a_q.double() * a_s.double()[:, None]) @ down.double().t()) @ up.double().t()
    mag = y.double().abs() + 0.75 * ((a_q.double().abs() * a_s.double()[:, None]) @ down.double().abs().t()) \
        @ up.double().abs().t()
    eps = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    assert ((out.double() - ref).abs() <= (k + r + 4) * eps * mag).all()


@pytest.mark.slow
def test_bf16_lora_after_apply_runs_in_the_gemm_epilogue(env, tiny_model):
    """A bf16 model on fused_triton, through ComfyUI's LoRA loader and sampler: every targeted layer's LoRA runs
    inside its GEMM (``kernel.int8_gemm_lora``: the down-projection from the GEMM's int8 input, the up-projection
    in the epilogue) and the branch pair never runs; with the epilogue GEMM off, the branch pair runs on each.
    The numerics are tests/test_lora_gemm.py's (a layer against float64). Here, in a width-128 bf16 model, one
    bf16 rounding anywhere moves the latent by about the int8 error (the pair and the epilogue differ by one
    rounding at four outputs: 0.14 against an int8 error of 0.17), so the whole-sample checks are on the LoRA's
    effect (strength 2): ``||(E - E0) - (F - F0)|| <= 0.5 ||F - F0||`` (E, E0: the pack with / without the LoRA;
    F, F0: the bf16 float model with the LoRA patched by ComfyUI / without) and ``||E - P|| <= 0.35 ||F - F0||``
    (P: the branch pair)."""
    pack, cs, nodes, folder = env
    import comfy.model_management as mm
    loader = nodes.LoraLoaderModelOnly()
    mp = tiny_model("flux", dtype=torch.bfloat16)
    _lora_file(folder, mp, "bf16.safetensors", TARGETS, rank=16, seed=5)
    q = pack.nodes.apply.ApplyFusedInt8GEMM().apply(mp, "fused_triton")[0]
    e0 = _sample(cs, q)
    ran, epi = [], []
    br, lin = pack.quant.lora.Branches, pack.quant.linear.Int8Linear
    with pytest.MonkeyPatch.context() as mp_:
        for name in ("add", "add_quantized"):
            mp_.setattr(br, name, lambda self, *a, _f=getattr(br, name), _n=name: ran.append(_n) or _f(self, *a))
        mp_.setattr(lin, "gemm_lora_call", lambda self, *a, _f=lin.gemm_lora_call: epi.append(self) or _f(self, *a))
        e1 = _sample(cs, loader.load_lora_model_only(q, "bf16.safetensors", 2.0)[0])
    assert ran == [] and len(epi) == len(TARGETS), (ran, epi)
    assert pack.quant.backends.lora_epilogue_state() == "up-projection in the int8 GEMM's epilogue"
    mm.unload_all_models()
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(pack.quant.backends, "_LORA_EPILOGUE_FAILED", "off for the test")
        with pytest.MonkeyPatch.context() as mp2:
            mp2.setattr(br, "add_quantized", lambda self, *a, _f=br.add_quantized: ran.append(1) or _f(self, *a))
            p1 = _sample(cs, loader.load_lora_model_only(q, "bf16.safetensors", 2.0)[0])
        assert len(ran) == len(TARGETS)
    mm.unload_all_models()
    f0 = _sample(cs, mp)
    f1 = _sample(cs, loader.load_lora_model_only(mp, "bf16.safetensors", 2.0)[0])
    assert not torch.equal(e1, p1)  # one rounding fewer: not the pair's bits
    lora = (f1 - f0).norm()
    assert ((e1 - e0) - (f1 - f0)).norm() <= 0.5 * lora, (((e1 - e0) - (f1 - f0)).norm(), lora)
    assert (e1 - p1).norm() <= 0.35 * lora, ((e1 - p1).norm(), lora)
