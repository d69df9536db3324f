"""Fused Flux.1 blocks (issue 13) on the CPU (TRITON_INTERPRET=1).

1. The three new row kernels of kernel/norm.py and kernel/gelu.py (``layernorm_modulate_quantize``, ``gelu_tanh_quantize``,
   ``concat_gelu_quantize``) against their definition (quant/blocks.py ``*_ref``, torch fp32 with the model dtype's
   roundings), against ComfyUI's unfused torch sequence, and against a float64 evaluation of the definition:

   Tolerance, derived. The kernels and torch compute the same fp32 formula; they may differ by a few fp32 ulps
   (sum order of the mean / variance, rsqrt vs 1/sqrt, the interpreter's exp-based tanh vs torch's). A rounding
   to the model dtype (``dt`` = bf16 / fp16) then agrees unless the exact value lies within that error of a
   rounding midpoint ("tie"). We evaluate the definition in float64, round it as the definition does (``y_ideal``)
   and mark every element within ``d`` of a rounding boundary: ``d = 2^-20 |n| + log2(K) 2^-23 mean|x| rstd`` for
   the norm (fp32 LayerNorm: tree / pairwise sums err by <= log2(K) 2^-24 of the sum of magnitudes, so the
   variance by that relatively, rstd by half of it plus 2^-23 for the root; the mean's error times rstd is absolute;
   ``d`` is twice these), ``2^-22 |v|`` for the addcmul (one fp32 rounding: 2^-24), ``2^-20 (|v| + |h|)`` for the
   GELU (fp32 error of ``1 + tanh`` under cancellation, times 0.5 |h|). Given ``y`` equal to ``y_ideal``, the
   quantizer is the same fp32 arithmetic as ``quantize_per_token_ref`` (kernel/quantize.py: bit-exact), so: codes
   and scales equal ``quantize_per_token_ref(y_ideal)`` except at marked elements (there: +-1); a row whose marked
   element could be its maximum (within 2^-6) may move its scale by one dt ulp (2^-7 relative) and any code by
   +-1. For fp32 (no dt rounding) the marks are the int8 rounding midpoints (``|frac(y * 127 / amax) - 0.5| <
   2^-13``) and scales agree to 2^-18. A value whose code is 0 with margin (``|y| 127 / amax < 0.49``) cannot flip
   and is not marked. Each check also requires the marks to be few (<= 5 % of the elements + 4), and is applied to
   the unfused torch sequence too: fused and unfused can only differ at ties.
   Zero rows, empty inputs, NaN / Inf rows (scale NaN, zeros, other rows untouched: kernel/quantize.py's rule).
2. A tiny Flux.1 built from ComfyUI's own classes (scripts/miniature.py's config), pinned 0.3.75 in-process and the
   current ComfyUI (COMFYUI_CURRENT, 0.33.0) in a subprocess: the adapter fuses every block; ``int8_layers()`` gives
   back every covered layer with identical int8 weights; on one double and one single block the int8 activations
   every GEMM receives equal what the per-linear INT8 path quantizes (``INT8_FUSED_FUSION=0`` through
   kernel.config.override builds that path): bit for bit in bf16 / fp16 (the norm output rounds to the model
   dtype), equal codes and scales within 2^-20 in fp32 (the LayerNorm's fp32 sum order). Whole-model output vs the
   per-linear path within ``REL_MODEL``: equal int8 GEMM inputs leave only fp32 op-order differences in the float
   glue (0 on the CPU); on a GPU a rare +-1 code (rate p < 1e-3, part 1) moves a GEMM output by about
   sqrt(p) * crest / 127 <= 0.03 * 4 / 127 ~ 1e-3 relative.
   Calls the fused path does not implement (``attn1_output_patch``) run ComfyUI's own forward on the INT8 twin.
   Also (pinned): modulation GEMVs and kept-float mlp.2 / linear2 inside fused blocks, other backends and
   ``INT8_FUSED_FUSION=0`` unfused, the Apply node through ModelPatcher (patch, sample, unpatch), torch.compile
   (fullgraph) of both blocks, and the compiled (sm_90) branches of the new kernels.
3. Flux.2 and Chroma (modulation passed into the blocks, fused too): tests/test_flux_external_mod_fused.py,
   tests/test_chroma_fused.py.

Run: TRITON_INTERPRET=1 .runtime/venv/bin/python -m pytest tests/test_flux_fused.py -q
"""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import fused_block_helpers as fbh

REL_MODEL = 2e-3
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(scope="module")
def kf():
    import kernel.ops
    kernel.ops.row_modules()
    return kernel


@pytest.fixture(scope="module")
def qf():
    from quant import blocks
    return blocks


def _qref(y, inv=None):
    from quant.quantize import quantize_per_token_ref
    return quantize_per_token_ref(y, inv)


# ----------------------------------------------------------------------------------- the tie analysis (module doc)
def _ties(v64: torch.Tensor, d: torch.Tensor, dtype) -> torch.Tensor:
    """Whether a rounding boundary of ``dtype`` lies within ``d`` of the exact value ``v64``."""
    if dtype == FP32:
        return torch.zeros_like(v64, dtype=torch.bool)
    return (v64 - d).to(dtype) != (v64 + d).to(dtype)


def _round64(v64, dtype):
    return v64.to(dtype).double()


def check_within_ties(q, s, y_ideal, marked, dtype, inv=None, what=""):
    """``q``/``s`` equal ``quantize_per_token_ref(y_ideal)`` except where the module doc allows. Returns the counts."""
    y32 = y_ideal.float()
    rq, rs = _qref(y32, inv)
    yv = y_ideal.abs() * (inv.double() if inv is not None else 1.0)
    amax = yv.amax(-1, keepdim=True)
    t = yv * 127.0 / amax.clamp_min(1e-300)
    # a value quantizing to 0 with margin keeps its code under a one-ulp change (<= 2^-8 relative): not a tie
    marked = marked & (t >= 0.5 * (1 - 2.0 ** -6))
    if dtype == FP32:  # int8 rounding midpoints: y differs from y_ideal by fp32 ulps everywhere
        marked = marked | ((t - t.floor() - 0.5).abs() < 2.0 ** -13)
    relaxed = (marked & (yv >= amax * (1 - 2.0 ** -6))).any(-1)
    d = (q.int() - rq.int()).abs()
    assert d.max().item() <= 1, f"{what}: a code differs by {d.max().item()}"
    ok_rows = ~relaxed
    bad = (d > 0) & ~marked & ok_rows[:, None]
    assert not bad.any(), f"{what}: {int(bad.sum())} codes differ away from a rounding tie, e.g. {bad.nonzero()[:3]}"
    if dtype == FP32:
        torch.testing.assert_close(s[ok_rows], rs[ok_rows], rtol=2.0 ** -18, atol=0)
    else:
        assert torch.equal(s[ok_rows], rs[ok_rows]), f"{what}: scale differs in a row without a tie at its maximum"
    torch.testing.assert_close(s[relaxed], rs[relaxed], rtol=2.0 ** -7, atol=0)
    frac = marked.float().mean().item()
    assert marked.sum().item() <= 0.05 * marked.numel() + 4, f"{what}: {frac:.1%} of the elements sit on ties"
    return {"flips": int((d > 0).sum()), "marked": int(marked.sum()), "relaxed_rows": int(relaxed.sum())}


def layernorm_modulate_ideal(x, scale, shift, tpb, eps=1e-6):
    """(y_ideal, marked) of the layernorm_modulate definition, evaluated in float64."""
    k = x.shape[-1]
    x64 = x.double()
    mean = x64.mean(-1, keepdim=True)
    c = x64 - mean
    rstd = 1 / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + eps)
    n64 = c * rstd
    # fp32 error of n: relative (variance sum, rsqrt, product) + absolute (the mean's sum error times rstd)
    d = 2.0 ** -20 * n64.abs() + math.log2(k) * 2.0 ** -23 * x64.abs().mean(-1, keepdim=True) * rstd
    marked = _ties(n64, d, x.dtype)
    nb = _round64(n64, x.dtype)
    rows = torch.arange(x.shape[0]) // tpb

    def per_row(t):
        t2 = t.reshape(-1, k).double()
        return t2[rows if t2.shape[0] > 1 else torch.zeros_like(rows)]

    s1 = _round64(1.0 + per_row(scale), scale.dtype)
    y64 = nb * s1 + per_row(shift)
    prod = torch.promote_types(torch.promote_types(x.dtype, scale.dtype), shift.dtype)
    marked |= _ties(y64, 2.0 ** -22 * y64.abs(), prod)
    return _round64(y64, prod), marked


def gelu_ideal(h):
    h64 = h.double()
    g = 0.5 * h64 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h64 + 0.044715 * h64 ** 3)))
    return _round64(g, h.dtype), _ties(g, 2.0 ** -20 * (g.abs() + h64.abs()), h.dtype)


def _rand(shape, dtype, g, std=2.0, mean=0.0):
    return (torch.randn(shape, generator=g) * std + mean).to(dtype)


# ----------------------------------------------------------------------------------- 1. kernels
def _ln_form(kf, monkeypatch, form):
    """Which LayerNorm kernel runs: ``seg`` the one-pass segmented one (segments of 16 and up, so that small rows
    take two or three: 384 = 256 + 128, 300 = 256 + 32 + 16, 200 = 128 + 64 + 16), ``single`` one register
    tile, ``chunked`` 64-wide chunks read four times (the last one partial)."""
    monkeypatch.setattr(kf.norm, "LN_ONE_PASS", kf.quantize.SegmentPlan(max_row=8192, min_seg=16, warps=4)
                        if form == "seg" else None)
    if form == "chunked":
        monkeypatch.setattr(kf.norm, "LN_PLAN", kf.rowtile.TilePlan(max_single=64, chunk=64, chunk_warps=4))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,m,k,b,smooth,form", [
    (BF16, 16, 384, 2, False, "seg"), (BF16, 16, 384, 2, False, "single"), (BF16, 12, 300, 3, True, "chunked"),
    (BF16, 12, 300, 3, True, "seg"), (BF16, 1, 48, 1, True, "single"), (BF16, 1, 48, 1, True, "seg"),
    (FP16, 16, 256, 4, True, "single"), (FP16, 9, 200, 3, False, "chunked"), (FP16, 9, 200, 3, False, "seg"),
    (FP32, 8, 256, 2, True, "seg"), (FP32, 6, 130, 1, False, "chunked")])
def test_layernorm_modulate_quantize(kf, qf, monkeypatch, dtype, m, k, b, smooth, form):
    _ln_form(kf, monkeypatch, form)
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = _rand((m, k), dtype, g, 2.0, 0.7)        # an offset: the mean matters
    mod = _rand((b, 1, 3 * k), dtype, g, 0.4)    # Flux's ModulationOut: chunks (views) of one [B, 1, 3K] output
    shift, scale = mod[..., :k], mod[..., k:2 * k]
    inv = (0.5 + torch.rand(k, generator=g)) if smooth else None
    tpb = m // b
    q, s = kf.norm.layernorm_modulate_quantize(x, scale, shift, tpb, inv)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == (m, k) and s.shape == (m,)
    y_ideal, marked = layernorm_modulate_ideal(x, scale, shift, tpb)
    got = check_within_ties(q, s, y_ideal, marked, dtype, inv, "kernel")
    rq, rs = qf.layernorm_modulate_quantize_ref(x, scale, shift, tpb, inv)
    check_within_ties(rq, rs, y_ideal, marked, dtype, inv, "reference")
    # ComfyUI's unfused sequence: F.layer_norm (LayerNorm without affine), apply_mod's addcmul, Int8Linear's quantizer
    y = torch.addcmul(shift, F.layer_norm(x, (k,), eps=1e-6).reshape(b, tpb, k), 1 + scale)
    check_within_ties(*_qref(y.reshape(m, k), inv), y_ideal, marked, dtype, inv, "unfused torch")
    print(got)


@pytest.mark.interpreter
@pytest.mark.parametrize("form", ["seg", "single"])
def test_layernorm_modulate_quantize_flux_width(kf, monkeypatch, form):
    """Flux.1's width (K = 3072: segments 2048 + 1024 by default, or the one 4096 tile) in bf16, broadcast
    modulation (B = 1)."""
    if form == "single":
        monkeypatch.setattr(kf.norm, "LN_ONE_PASS", None)
    else:  # the default plan's segments, derived by hand
        assert kf.quantize.segments(3072, kf.norm.LN_ONE_PASS) == (2048, 1024, 0) and \
            kf.quantize.seg_warps((2048, 1024, 0), kf.norm.LN_ONE_PASS) == 4
    seen, real = [], kf.norm.launch

    def spy(fn, grid, args, constexprs, *rest):  # the constexprs of the form that runs (S0 > 0: the segments)
        seen.append((fn.fn.__name__, tuple(constexprs[s] if (s != "BLOCK") == (constexprs["S0"] > 0) else None
                                           for s in ("S0", "S1", "S2", "BLOCK"))))
        return real(fn, grid, args, constexprs, *rest)
    monkeypatch.setattr(kf.norm, "launch", spy)
    g = torch.Generator().manual_seed(7)
    x = _rand((8, 3072), BF16, g, 3.0, -1.0)
    scale, shift = _rand((1, 3072), BF16, g, 0.3), _rand((1, 3072), BF16, g, 0.3)
    q, s = kf.norm.layernorm_modulate_quantize(x, scale, shift, 8)
    assert seen == ([("_layernorm_modulate_quant_kernel", (None, None, None, 4096))] if form == "single" else
                    [("_layernorm_modulate_quant_kernel", (2048, 1024, 0, None))])
    y_ideal, marked = layernorm_modulate_ideal(x, scale, shift, 8)
    check_within_ties(q, s, y_ideal, marked, BF16, None, "K=3072")


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (the interpreter) on NaN / Inf rows
@pytest.mark.parametrize("form", ["seg", "single"])
def test_layernorm_modulate_quantize_zero_nan_and_errors(kf, qf, monkeypatch, form):
    _ln_form(kf, monkeypatch, form)
    g = torch.Generator().manual_seed(3)
    x = _rand((6, 64), BF16, g)
    zero = torch.zeros(1, 64, dtype=BF16)
    shift = _rand((1, 64), BF16, g)
    x[1] = 0
    x[3, 7] = float("nan")
    x[4, 9] = float("inf")
    q, s = kf.norm.layernorm_modulate_quantize(x, zero, zero, 6)
    assert s[1] == 0 and not q[1].any()                            # zero row, zero shift: scale 0, zeros
    assert all(math.isnan(s[i]) and not q[i].any() for i in (3, 4))  # NaN / Inf: scale NaN, zeros
    rq, rs = qf.layernorm_modulate_quantize_ref(x, zero, zero, 6)
    assert torch.equal(q, rq) and torch.equal(s.isnan(), rs.isnan())  # the reference's rule too (kernel/quantize.py)
    ok = [0, 2, 5]
    assert torch.equal(q[ok], qf.layernorm_modulate_quantize_ref(x[ok], zero, zero, 3)[0])  # other rows untouched
    q, s = kf.norm.layernorm_modulate_quantize(torch.zeros(2, 64, dtype=BF16), zero, shift, 2)
    rq, rs = _qref(shift.float().expand(2, 64))                     # a zero row is quantized shift
    assert torch.equal(q, rq) and torch.equal(s, rs)
    q, s = kf.norm.layernorm_modulate_quantize(x[:0], zero, zero, 1)
    assert q.shape == (0, 64) and s.shape == (0,)
    with pytest.raises(ValueError, match="batch rows"):
        kf.norm.layernorm_modulate_quantize(x, torch.zeros(4, 64), zero, 2)
    with pytest.raises(ValueError, match="shift must be"):
        kf.norm.layernorm_modulate_quantize(x, zero, torch.zeros(1, 63), 6)


def _gelu_form(kf, monkeypatch, form):
    """Which GELU kernel runs: ``seg`` the one-pass segmented one (segments of 16 and up, so that small rows
    take two or three of them: 300 = 256 + 32 + 16, 96 = 64 + 32), ``single`` one register tile,
    ``chunked`` 64-wide chunks read twice."""
    if form == "seg":
        monkeypatch.setattr(kf.gelu, "GELU_ONE_PASS", kf.quantize.SegmentPlan(max_row=16384, min_seg=16, warps=4))
    else:
        monkeypatch.setattr(kf.gelu, "GELU_ONE_PASS", None)
    if form == "chunked":
        monkeypatch.setattr(kf.gelu, "GELU_PLAN", kf.rowtile.TilePlan(max_single=64, chunk=64, chunk_warps=4))


@pytest.mark.interpreter
@pytest.mark.parametrize("fast", [False, True], ids=["tanhf", "fast"])
@pytest.mark.parametrize("dtype,m,f,smooth,form", [
    (BF16, 12, 512, False, "single"), (BF16, 7, 300, True, "chunked"), (FP16, 8, 256, True, "single"),
    (FP16, 5, 200, False, "chunked"), (FP32, 6, 200, True, "single"), (BF16, 7, 300, True, "seg"),
    (FP16, 5, 200, False, "seg"), (FP32, 6, 200, True, "seg")])
def test_gelu_tanh_quantize(kf, qf, monkeypatch, dtype, m, f, smooth, form, fast):
    monkeypatch.setattr(kf.gelu, "GELU_FAST", fast)  # h * sigmoid(2u): the same function, other fp32 roundings
    _gelu_form(kf, monkeypatch, form)
    g = torch.Generator().manual_seed(m * 100 + f)
    h = _rand((m, f), dtype, g, 3.0)
    inv = (0.5 + torch.rand(f, generator=g)) if smooth else None
    q, s = kf.gelu.gelu_tanh_quantize(h, inv)
    y_ideal, marked = gelu_ideal(h)
    print(check_within_ties(q, s, y_ideal, marked, dtype, inv, "kernel"))
    check_within_ties(*qf.gelu_tanh_quantize_ref(h, inv), y_ideal, marked, dtype, inv, "reference")
    check_within_ties(*_qref(F.gelu(h, approximate="tanh"), inv), y_ideal, marked, dtype, inv, "unfused torch")


@pytest.mark.interpreter
@pytest.mark.parametrize("fast", [False, True], ids=["tanhf", "fast"])
@pytest.mark.parametrize("dtype,m,ka,f,smooth,form", [
    (BF16, 10, 128, 512, True, "single"), (BF16, 6, 96, 200, False, "chunked"), (BF16, 4, 300, 100, True, "chunked"),
    (FP16, 6, 64, 256, True, "single"), (FP32, 5, 64, 160, False, "single"), (BF16, 6, 96, 200, False, "seg"),
    (BF16, 4, 300, 100, True, "seg"), (FP16, 6, 64, 256, True, "seg")])
def test_concat_gelu_quantize(kf, qf, monkeypatch, dtype, m, ka, f, smooth, form, fast):
    """Flux's single block: ``linear2(cat(attn, gelu(mlp)))`` with mlp a column slice of linear1's output."""
    monkeypatch.setattr(kf.gelu, "GELU_FAST", fast)
    _gelu_form(kf, monkeypatch, form)
    g = torch.Generator().manual_seed(m * 10 + ka + f)
    attn = _rand((m, ka), dtype, g, 1.0)
    lin1 = _rand((m, 3 * ka + f), dtype, g, 3.0)
    mlp = lin1[:, 3 * ka:]                                         # a strided view, as torch.split gives it
    inv = (0.5 + torch.rand(ka + f, generator=g)) if smooth else None
    q, s = kf.gelu.concat_gelu_quantize(attn, mlp, inv)
    assert q.shape == (m, ka + f)
    g_ideal, g_marked = gelu_ideal(mlp)
    y_ideal = torch.cat((attn.double(), g_ideal), -1)
    marked = torch.cat((torch.zeros(m, ka, dtype=torch.bool), g_marked), -1)
    print(check_within_ties(q, s, y_ideal, marked, dtype, inv, "kernel"))
    check_within_ties(*qf.concat_gelu_quantize_ref(attn, mlp, inv), y_ideal, marked, dtype, inv, "reference")
    unfused = torch.cat((attn, F.gelu(mlp, approximate="tanh")), -1)
    check_within_ties(*_qref(unfused, inv), y_ideal, marked, dtype, inv, "unfused torch")


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (the interpreter) on NaN / Inf rows
@pytest.mark.parametrize("form", ["seg", "single"])
@pytest.mark.parametrize("fast", [False, True], ids=["tanhf", "fast"])
def test_gelu_kernels_zero_nan_and_errors(kf, qf, monkeypatch, fast, form):
    monkeypatch.setattr(kf.gelu, "GELU_FAST", fast)  # fast: gelu(-inf) = -inf (torch: NaN); the row is bad either way
    _gelu_form(kf, monkeypatch, form)
    g = torch.Generator().manual_seed(5)
    h = _rand((5, 80), BF16, g)
    a = _rand((5, 32), BF16, g)
    h[0], a[0] = 0, 0
    h[1, 3] = float("nan")
    h[2, 0] = float("inf")
    h[3, 5] = -float("inf")                                        # 0.5 * -inf * (1 + tanh(-inf)) = NaN, as torch
    a[4, 1] = float("nan")                                         # a NaN in the first part poisons the row too
    for q, s, (rq, rs) in ((*kf.gelu.gelu_tanh_quantize(h), qf.gelu_tanh_quantize_ref(h)),
                           (*kf.gelu.concat_gelu_quantize(a, h), qf.concat_gelu_quantize_ref(a, h))):
        assert s[0] == 0 and not q[0].any()
        assert torch.equal(s.isnan(), rs.isnan()) and torch.equal(q, rq)
        assert all(math.isnan(s[i]) and not q[i].any() for i in (1, 2, 3))
    assert not math.isnan(kf.gelu.gelu_tanh_quantize(h)[1][4])           # only the concatenation sees a's NaN
    assert math.isnan(kf.gelu.concat_gelu_quantize(a, h)[1][4])
    q, s = kf.gelu.concat_gelu_quantize(a[:0], h[:0])
    assert q.shape == (0, 112) and s.shape == (0,)
    with pytest.raises(ValueError, match="must match"):
        kf.gelu.concat_gelu_quantize(a.float(), h)
    with pytest.raises(ValueError, match="inv_smooth"):
        kf.gelu.concat_gelu_quantize(a, h, torch.ones(80))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_gelu_one_pass_equals_chunked(kf, monkeypatch, dtype):
    """The one-pass kernel computes the same values as the two-pass chunked one (gelu once instead of twice, an
    order-free max): codes and scales equal bit for bit, with a strided GELU part, smoothing and a NaN row."""
    g = torch.Generator().manual_seed(11)
    a = _rand((9, 96), dtype, g, 1.0)
    h = _rand((9, 2 * 300), dtype, g, 3.0)[:, 300:]
    h[4, 7] = float("nan")
    inv = 0.5 + torch.rand(396, generator=g)
    out = {}
    for form in ("seg", "chunked"):
        with monkeypatch.context() as mp:
            _gelu_form(kf, mp, form)
            out[form] = (*kf.gelu.concat_gelu_quantize(a, h, inv), *kf.gelu.gelu_tanh_quantize(h, inv[96:]))
    for got, ref in zip(out["seg"], out["chunked"]):
        assert torch.equal(got, ref) or (got.isnan().any() and torch.equal(got.isnan(), ref.isnan())
                                         and torch.equal(got.nan_to_num(), ref.nan_to_num()))
    assert out["seg"][1][4].isnan() and not out["seg"][0][4].any()


# ----------------------------------------------------------------------------------- 2. tiny Flux.1, ComfyUI classes
def tiny_flux(dtype, depth=2, single=2, **overrides):
    """The width-128 Flux.1 miniature (scripts/miniature.py) from the running ComfyUI's classes. 0.33.0: Flux.1's
    detection sets ``txt_ids_dims = []`` and QKNorm's parameter is ``weight`` (0.3.75: ``scale``)."""
    import comfy.ldm.flux.model as fm
    import comfy.model_detection
    import comfy_harness as H
    mini = H.miniature()
    sd = mini.tiny_state_dict("flux", 0, dtype)
    cfg = dict(mini.TINY_UNET_CONFIG["flux"], depth=depth, depth_single_blocks=single, **overrides)
    if "txt_ids_dims" in {f.name for f in dataclasses.fields(fm.FluxParams)}:
        cfg["txt_ids_dims"] = []
    mc = comfy.model_detection.model_config_from_unet_config(cfg, sd)
    mc.set_inference_dtype(dtype, None)
    dm = mc.get_model(sd, "", device=torch.device("cpu")).diffusion_model
    own = dm.state_dict()
    sd = {(k[:-len("scale")] + "weight" if k.endswith("_norm.scale") and k not in own else k): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if k in own and own[k].shape == v.shape}
    missing = dm.load_state_dict(sd, strict=False).missing_keys
    g = torch.Generator().manual_seed(5)  # the same values whatever ran before in the process (not the global RNG)
    with torch.no_grad():
        for k in missing:                                          # variants with extra tensors: small random
            p = dm.get_parameter(k)
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return dm


_layers, _swap, _rel = fbh.int8_layers, fbh.swapped, fbh.rel


def _inputs(dtype, seed=1, b=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 16, 8, 8, generator=g).to(dtype)
    ctx = torch.randn(b, 6, 64, generator=g).to(dtype)
    y = torch.randn(b, 64, generator=g).to(dtype)
    return x, torch.full((b,), 0.6), ctx, y


def block_activations(pack, dm, layers, patches, dtype) -> dict:
    """On double_blocks.0 and single_blocks.0: the (int8, scale) every GEMM receives in the fused block vs what the
    per-linear INT8 block quantizes (its Int8Linear inputs through ``quantize_per_token_ref``), bit for bit; and the
    block outputs. Also: an ``attn1_output_patch`` call takes ComfyUI's own forward (per-linear) on the fused twin."""
    qf, Int8Linear = pack.quant.blocks, pack.quant.linear.Int8Linear
    g = torch.Generator().manual_seed(3)
    hid = dm.hidden_size
    img, txt = torch.randn(2, 12, hid, generator=g).to(dtype), torch.randn(2, 5, hid, generator=g).to(dtype)
    vec = torch.randn(2, hid, generator=g).to(dtype)
    out = {}
    real_gemm = qf.gemm
    for name, call in (("double_blocks.0", lambda blk, **kw: blk(img=img.clone(), txt=txt.clone(), vec=vec, pe=None,
                                                                  **kw)),
                       ("single_blocks.0", lambda blk, **kw: blk(torch.cat((txt, img), 1), vec=vec, pe=None, **kw))):
        plain = _swap(dm.get_submodule(name), {k[len(name) + 1:]: v for k, v in layers.items()
                                                if k.startswith(name + ".")})
        seen_plain, seen_fused = {}, {}
        def record(mod, args, seen=seen_plain):  # returns None: the input passes unchanged
            seen.setdefault(id(mod), _qref(args[0].reshape(-1, args[0].shape[-1]), mod.inv_smooth))

        hooks = [m.register_forward_pre_hook(record) for m in plain.modules() if isinstance(m, Int8Linear)]

        def spy(a_q, a_s, layer, dt):
            seen_fused.setdefault(id(layer), (a_q.clone(), a_s.clone()))
            return real_gemm(a_q, a_s, layer, dt)

        real_call = Int8Linear.int8_call

        def call_spy(layer, x, seen=seen_fused):  # qf.linear: quantization + GEMM as one prepared call
            seen.setdefault(id(layer), _qref(x.reshape(-1, x.shape[-1]), layer.inv_smooth))
            return real_call(layer, x)

        qf.gemm, Int8Linear.int8_call = spy, call_spy
        try:
            with torch.no_grad():
                ref, got = call(plain), call(patches[name])
                to = {"patches": {"attn1_output_patch": [lambda attn, extra: attn * 0.5]}}
                ref_p, got_p = call(plain, transformer_options=to), call(patches[name], transformer_options=to)
        finally:
            qf.gemm, Int8Linear.int8_call = real_gemm, real_call
            for hk in hooks:
                hk.remove()
        ref, got, ref_p, got_p = [t if isinstance(t, tuple) else (t,) for t in (ref, got, ref_p, got_p)]
        # bf16 / fp16: the norm output rounds to the model dtype, so codes and scales are bit-equal; fp32: the codes
        # (no value sits on a rounding midpoint here), scales to fp32 ulps (the LayerNorm's sum order)
        same_act = set(seen_fused) <= set(seen_plain) and all(
            torch.equal(seen_fused[i][0], seen_plain[i][0]) and (
                torch.equal(seen_fused[i][1], seen_plain[i][1]) if dtype != FP32 else
                torch.allclose(seen_fused[i][1], seen_plain[i][1], rtol=2.0 ** -20, atol=0))
            for i in seen_fused)
        out[name] = {"gemms_fused": len(seen_fused), "int8_layers": len(seen_plain), "same_activations": same_act,
                     "rel": max(_rel(a, b) for a, b in zip(got, ref)),
                     "patched_equal": all(torch.equal(a, b) for a, b in zip(got_p, ref_p)),
                     "patch_applied": not all(torch.equal(a, b) for a, b in zip(ref_p, ref))}
    return out


def flux_equivalence(pack, dtype=BF16) -> dict:
    A, cfg = pack.adapters, pack.quant.blocks.config
    dm = tiny_flux(dtype)
    layers = _layers(pack, dm)
    patches = A.object_patches(dm, layers)
    with cfg.override(INT8_FUSED_FUSION=False):
        plain = A.object_patches(dm, layers)
    back = A.int8_layers_of(patches)
    same_layers = back.keys() == layers.keys() and all(torch.equal(back[n].qweight, layers[n].qweight)
                                                       and torch.equal(back[n].weight_scale, layers[n].weight_scale)
                                                       for n in layers)
    covered = sorted(n for m in patches.values() for n in getattr(m, "covers", ()))
    x, t, ctx, y = _inputs(dtype)
    kf = pack.quant.blocks.kernels()
    tails = ("residual_add", "residual_add_layernorm_modulate_quantize")
    real, calls = {n: getattr(kf.residual, n) for n in tails}, {n: 0 for n in tails}

    def spy(name):
        def f(*a, **kw):
            calls[name] += 1
            return real[name](*a, **kw)
        return f

    real_qk, qk_calls = kf.rope.qk_norm_rope, []

    def qk_spy(*a, **kw):
        qk_calls.append(a[0].shape)
        return real_qk(*a, **kw)

    with torch.no_grad():
        ref = _swap(dm, plain)(x, t, ctx, y=y)  # the per-linear path: ComfyUI's forwards, torch's residual tails
        flt = dm(x, t, ctx, y=y)
        for n in tails:
            setattr(kf.residual, n, spy(n))
        kf.rope.qk_norm_rope = qk_spy
        try:  # the residual tails in the residual kernels (two roundings, as torch's ops), and the QK norm + RoPE
            # kernel (against ComfyUI's norm modules and RoPE in the per-linear path), counted through their checked
            # wrappers
            with fbh.unplanned(kf.plan):
                got = _swap(dm, patches)(x, t, ctx, y=y)
        finally:
            for n in tails:
                setattr(kf.residual, n, real[n])
            kf.rope.qk_norm_rope = real_qk
        tails_planned = [_swap(dm, patches)(x, t, ctx, y=y) for _ in range(2)]  # the second re-issues every tail
    return {"adapter": A.adapter_for(dm).name, "kinds": sorted({type(m).__name__ for m in patches.values()}),
            "fused": sorted(patches), "plain_is_per_linear": plain == layers, "covered_all": covered == sorted(layers),
            "same_layers": same_layers, "rel": _rel(got, ref), "rel_float": _rel(ref, flt),
            "tail_calls": calls, "qk_rope_calls": len(qk_calls), "tails_planned_equal": all(torch.equal(t_, got) for t_ in tails_planned),
            "depth": (dm.params.depth, dm.params.depth_single_blocks),
            "blocks": block_activations(pack, dm, layers, patches, dtype)}


def _check_equivalence(res):
    assert res["adapter"] == "flux" and res["kinds"] == ["FusedFluxDoubleBlock", "FusedFluxSingleBlock"], res
    assert res["fused"] == ["double_blocks.0", "double_blocks.1", "single_blocks.0", "single_blocks.1"], res
    assert res["plain_is_per_linear"] and res["covered_all"] and res["same_layers"], res
    assert res["rel"] <= REL_MODEL and res["rel_float"] < 5e-2, res
    # the residual-tail kernels: per double block two streams x (one sum + mlp.0 input, one sum), per single block
    # one sum; the whole model within REL_MODEL of the per-linear path with torch's tails (above)
    double, single = res["depth"]
    assert res["tail_calls"] == {"residual_add": 2 * double + single,
                                 "residual_add_layernorm_modulate_quantize": 2 * double}, res
    assert res["tails_planned_equal"], res
    assert res["qk_rope_calls"] == 2 * double + single, res  # one launch per stream and block (q and k together)
    for name, b in res["blocks"].items():
        assert b["same_activations"] and b["gemms_fused"] >= (6 if "double" in name else 2), (name, b)
        assert b["rel"] <= REL_MODEL, (name, b)
        assert b["patched_equal"], (name, b)          # the patched call ran ComfyUI's own forward on the twin


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_tiny_flux_fused_vs_per_linear_pinned(pack, dtype):
    res = flux_equivalence(pack, dtype)
    print(res)
    _check_equivalence(res)
    assert not any(b["patch_applied"] for b in res["blocks"].values())   # 0.3.75's blocks ignore attention patches


@pytest.mark.parametrize("dtype", [FP16])
def test_fused_blocks_fp16_pinned(pack, dtype):
    """fp16: the fused forwards clamp like ComfyUI's; the block-level activations stay bit-equal."""
    dm = tiny_flux(dtype, depth=1, single=1)
    layers = _layers(pack, dm)
    res = block_activations(pack, dm, layers, pack.adapters.object_patches(dm, layers), dtype)
    assert all(b["same_activations"] and b["rel"] <= REL_MODEL for b in res.values()), res


def test_fusion_switch_and_other_backends_pinned(pack):
    A = pack.adapters
    dm = tiny_flux(BF16, depth=1, single=1)
    layers = _layers(pack, dm)
    with pack.quant.blocks.config.override(INT8_FUSED_FUSION=False):
        assert A.object_patches(dm, layers) == layers
    other = _layers(pack, dm, "dequant_bf16")
    assert A.object_patches(dm, other) == other                      # only fused_triton layers are fused
    # the modulation GEMVs too (preset blocks+modulation): the fused block runs its own Modulation on them
    pairs = pack.quant.select.select_linears(dm, "blocks+modulation", rules=A.block_rules(dm))
    with_mod = pack.quant.patch.build_int8_layers(pairs, "fused_triton")[0]
    patches = A.object_patches(dm, with_mod)
    assert set(patches) == {"double_blocks.0", "single_blocks.0"}
    assert {"double_blocks.0.img_mod.lin", "single_blocks.0.modulation.lin"} <= set(with_mod)
    assert A.int8_layers_of(patches).keys() == with_mod.keys()
    x, t, ctx, y = _inputs(BF16)
    with torch.no_grad():
        ref, got = _swap(dm, with_mod)(x, t, ctx, y=y), _swap(dm, patches)(x, t, ctx, y=y)
    assert _rel(got, ref) <= REL_MODEL
    # a kept-float mlp.2 / linear2 (calibration protection): still fused, that layer's input from torch
    part = {n: m for n, m in layers.items() if not n.endswith(("img_mlp.2", "linear2"))}
    patches = A.object_patches(dm, part)
    assert set(patches) == {"double_blocks.0", "single_blocks.0"}
    assert A.int8_layers_of(patches).keys() == part.keys()
    with torch.no_grad():
        ref, got = _swap(dm, part)(x, t, ctx, y=y), _swap(dm, patches)(x, t, ctx, y=y)
    assert _rel(got, ref) <= REL_MODEL


@pytest.mark.slow
def test_apply_node_fuses_flux_blocks_pinned(pack, tiny_model):
    """Through the Apply node and ComfyUI's ModelPatcher (object patches, load, apply_model, unpatch): the fused
    blocks replace the four blocks, Save's view of the INT8 layers is the per-linear one, the sampled output equals
    the per-linear INT8 model's, and unpatching gives back the float model."""
    import comfy.model_management as mm
    mp = tiny_model("flux", 0, BF16)
    apply = pack.nodes.apply.ApplyFusedInt8GEMM()
    (fused,) = apply.apply(mp, "fused_triton")
    with pack.quant.blocks.config.override(INT8_FUSED_FUSION=False):
        (plain,) = apply.apply(mp, "fused_triton")
    assert sorted(fused.object_patches) == [f"diffusion_model.{k}_blocks.{i}" for k in ("double", "single")
                                            for i in range(2)]
    assert set(pack.nodes.weights.int8_layers(fused)) == set(pack.nodes.weights.int8_layers(plain))
    x, t, ctx, y = _inputs(BF16)

    def run(m):
        mm.load_models_gpu([m])
        with torch.no_grad():
            return m.model.apply_model(x.float(), t, c_crossattn=ctx.float(), y=y.float()).float()

    try:
        flt = run(mp)
        a, b = run(fused), run(plain)
        assert _rel(a, b) <= REL_MODEL and _rel(a, flt) < 5e-2
        mm.unload_all_models()
        assert torch.equal(run(mp), flt)
    finally:
        mm.unload_all_models()


def test_fused_blocks_compile_without_graph_breaks_pinned(pack):
    """torch.compile(fullgraph=True) traces both fused blocks: every new kernel is a custom op with a fake
    implementation (aot_eager on the CPU). Flux's attention is replaced by plain SDPA here (``functions``): ComfyUI's
    attention dispatch is not what this checks."""
    import comfy.ldm.flux.layers as L
    A, ff = pack.adapters, pack.adapters.flux.blocks

    def attention(q, k, v, pe, mask=None, transformer_options={}):
        b, h, n, d = q.shape
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, h * d)

    dm = tiny_flux(BF16, depth=1, single=1)
    fn = ff.FluxFunctions(attention, L.DoubleStreamBlock.forward, L.SingleStreamBlock.forward)
    patches = A.flux.fuse(dm, _layers(pack, dm), functions=(L, fn))
    g = torch.Generator().manual_seed(3)
    img, txt = torch.randn(1, 12, 128, generator=g).to(BF16), torch.randn(1, 5, 128, generator=g).to(BF16)
    vec = torch.randn(1, 128, generator=g).to(BF16)
    torch._dynamo.reset()
    with torch.no_grad():
        for name, call in (("single_blocks.0", lambda b: (b(torch.cat((txt, img), 1), vec=vec, pe=None),)),
                           ("double_blocks.0", lambda b: b(img=img.clone(), txt=txt.clone(), vec=vec, pe=None))):
            blk = patches[name]
            got = call(torch.compile(blk, backend="aot_eager", fullgraph=True))
            assert all(torch.equal(a, b) for a, b in zip(got, call(blk))), name


# ----------------------------------------------------------------------------------- current ComfyUI (subprocess)
def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    from comfyui_version import __version__
    return {"comfyui": __version__, "bf16": flux_equivalence(pack, BF16)}


def test_tiny_flux_fused_on_the_current_comfyui(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res["comfyui"], {k: v for k, v in res["bf16"].items() if k != "blocks"}, res["bf16"]["blocks"])
    _check_equivalence(res["bf16"])
    assert all(b["patch_applied"] for b in res["bf16"]["blocks"].values())  # current ComfyUI applies the patch


# ----------------------------------------------------------------------------------- compiled branches
def _hopper_check() -> str:
    """Builds the compiled (non-interpreter) branches of the new kernels for sm_90 with Triton's bundled ptxas, with
    the 16-divisibility Triton sees at run time on Flux shapes; 'OK' or the first problem (no TRITON_INTERPRET)."""
    import inspect
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernel as kf
    import kernel.ops
    kernel.ops.row_modules()
    types = {"x_ptr": "*bf16", "s_ptr": "*bf16", "sh_ptr": "*bf16", "a_ptr": "*bf16", "h_ptr": "*bf16",
             "inv_ptr": "*fp32", "q_ptr": "*i8", "qs_ptr": "*fp32", "eps": "fp32"}
    common = {"SCALE_RECIP": True, "INTERPRET": False}
    cases = [
        (kf.norm._layernorm_modulate_quant_kernel, {"HAS_SMOOTH": True, "NORM_DT": 1, "SCALE_DT": 1, "PROD_DT": 1,
                                                    "BLOCK": 4096, "SINGLE": True}, 8),
        (kf.norm._layernorm_modulate_quant_kernel, {"HAS_SMOOTH": False, "NORM_DT": 2, "SCALE_DT": 2, "PROD_DT": 2,
                                                    "BLOCK": 1024, "SINGLE": False}, 4),
        (kf.norm._layernorm_modulate_quant_kernel, {"HAS_SMOOTH": True, "NORM_DT": 1, "SCALE_DT": 1, "PROD_DT": 1,
                                                    "S0": 2048, "S1": 1024, "S2": 0}, 4),  # Flux, K 3072
        (kf.norm._layernorm_modulate_quant_kernel, {"HAS_SMOOTH": False, "NORM_DT": 2, "SCALE_DT": 2, "PROD_DT": 2,
                                                    "S0": 4096, "S1": 1024, "S2": 256}, 4),
        (kf.gelu._concat_gelu_quant_kernel, {"HAS_A": True, "HAS_SMOOTH": True, "DT": 1, "BLOCK": 2048,
                                             "SINGLE": False, "FAST": False}, 8),
        (kf.gelu._concat_gelu_quant_kernel, {"HAS_A": False, "HAS_SMOOTH": False, "DT": 1, "BLOCK": 2048,
                                             "SINGLE": True, "FAST": False}, 8),
        (kf.gelu._concat_gelu_quant_kernel, {"HAS_A": True, "HAS_SMOOTH": False, "DT": 1, "BLOCK": 16384,
                                             "SINGLE": True, "FAST": True}, 16),
        (kf.gelu._concat_gelu_quant_kernel, {"HAS_A": True, "HAS_SMOOTH": True, "DT": 1, "A0": 2048, "A1": 1024,
                                             "S0": 8192, "S1": 4096, "S2": 0, "FAST": True}, 16),  # Flux single
        (kf.gelu._concat_gelu_quant_kernel, {"HAS_A": False, "HAS_SMOOTH": False, "DT": 2, "A0": 0, "A1": 0,
                                             "S0": 8192, "S1": 512, "S2": 256, "FAST": True}, 16),  # Wan 1.3B
    ]
    for fn, consts, warps in cases:
        # a row kernel's other form (one tile / segments) is off: its constexprs 0
        consts = {**{p: 0 for p in ("BLOCK", "SINGLE", "A0", "A1", "S0", "S1", "S2") if p in fn.arg_names}, **consts,
                  **common}
        params = list(inspect.signature(fn.fn).parameters)
        sig = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
        attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
                 if p not in consts and p not in ("eps", "tokens_per_batch")}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        if "cubin" not in k.asm or not re.search(r"ld\.global[^\n]*\.v4", k.asm["ptx"]):
            return f"{fn.fn.__name__} {consts}: no cubin or no 16-byte loads"
        if "cvt.rni" not in k.asm["ptx"]:  # the int8 codes from libdevice rint
            return f"{fn.fn.__name__} {consts}: no cvt.rni in the PTX"
    return "OK"


def test_flux_kernels_compile_for_hopper():
    """In a subprocess without TRITON_INTERPRET (under it kernels are not compilable); skipped without ptxas."""
    fbh.hopper_check_in_subprocess("test_flux_fused")
