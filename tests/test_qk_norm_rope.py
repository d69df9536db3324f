"""``kernel.rope.qk_norm_rope`` (Flux's and Ideogram 4's QK RMSNorm + RoPE + attention layout in one pass) on the CPU
(TRITON_INTERPRET=1), against torch written here from ComfyUI's ops:

* reference: ``q = F.rms_norm(q_h, (D,), w, eps)`` on the [B, H, L, D] view of the qkv output (what
  ``QKNorm`` does through ComfyUI's RMSNorm), then ``apply_rope1`` (``comfy/ldm/flux/math.py``: fp32,
  ``x_out = f[..., 0] * x0; x_out.addcmul_(f[..., 1], x1)``, rounded to the dtype once), ``v`` the view itself;
  txt rows written at row 0 and img rows after them, as ``torch.cat((txt, img), dim=2)``;
* tolerance, derived: the kernel and torch compute the same fp32 formulas; the sum of squares may add in another
  order (rstd within a few fp32 ulps) and ``f0 x0 + f1 x1`` may round once less (FMA) — each rounding to the dtype
  then agrees unless the exact value sits within ~2^-20 relative of a rounding midpoint, so elements may differ by
  one ulp of the dtype, and only rarely (checked: <= 1 % of elements, none by more than one ulp in bf16 / fp16;
  fp32 within 2^-20 relative). On the CPU interpreter the orders coincide and the results are equal.
* float64: the result is within the dtype's rounding of the float64 evaluation (two roundings: 2 ulps).
* bad input: clear errors; empty L: nothing written; ``pe`` None: norm only.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fused_block_helpers as fbh

pytestmark = pytest.mark.interpreter


@pytest.fixture(scope="module")
def kf():
    import kernel.ops
    kernel.ops.row_modules()
    return kernel


def _rope_ref(x, pe):
    """comfy.ldm.flux.math.apply_rope1, written out (fp32 math, one rounding to x's dtype)."""
    x_ = x.to(pe.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    out = pe[..., 0] * x_[..., 0]
    out.addcmul_(pe[..., 1], x_[..., 1])
    return out.reshape(*x.shape).type_as(x)


def _rope_table(bsz, length, d, seed):
    """Rotation matrices as comfy.ldm.flux.math.rope builds them ([B, 1, L, D/2, 2, 2] fp32)."""
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(bsz, length, d // 2, generator=g, dtype=torch.float64) * 6.283
    c, s = torch.cos(ang), torch.sin(ang)
    return torch.stack([c, -s, s, c], dim=-1).reshape(bsz, 1, length, d // 2, 2, 2).float()


def _reference(parts, heads, wq, wk, eps, pe):
    qs, ks, vs = [], [], []
    for qkv in parts:
        b, l, _ = qkv.shape
        q, k, v = qkv.view(b, l, 3, heads, -1).permute(2, 0, 3, 1, 4)
        qs.append(F.rms_norm(q, (q.shape[-1],), wq, eps))
        ks.append(F.rms_norm(k, (k.shape[-1],), wk, eps))
        vs.append(v)
    q, k, v = torch.cat(qs, 2), torch.cat(ks, 2), torch.cat(vs, 2)
    if pe is not None:
        q, k = _rope_ref(q, pe), _rope_ref(k, pe)
    return q, k, v


def _run(kf, parts, heads, wq, wk, eps, pe):
    b, d = parts[0].shape[0], parts[0].shape[2] // (3 * heads)
    total = sum(p.shape[1] for p in parts)
    q, k, v = [torch.full((b, heads, total, d), float("nan"), dtype=parts[0].dtype) for _ in range(3)]
    off = 0
    for p in parts:
        kf.rope.qk_norm_rope(p, heads, wq, wk, eps, eps, pe, q, k, v, off)
        off += p.shape[1]
    return q, k, v


_ulps = fbh.ulps


def _assert_as_ops(got, want, dtype):
    """q, k, v against ComfyUI's ops within the module doc's tolerance: every row written; fp32 within 2^-20
    relative; bf16 / fp16 at most one ulp apart, in at most 1 % of the elements."""
    for name, x, y in zip("qkv", got, want):
        assert not torch.isnan(x).any(), name  # every row written
        if dtype == torch.float32:
            torch.testing.assert_close(x, y, rtol=2 ** -20, atol=1e-6, msg=name)
        else:
            u = _ulps(x, y)
            assert float(u.max()) <= 1.0, (name, float(u.max()))
            assert float((u > 0).float().mean()) <= 0.01, name


@pytest.mark.parametrize("prefetch", [True, False], ids=["pe_vectors", "pe_scalars"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,d", [(3, 16), (4, 8), (2, 32), (6, 16)])  # 6: three programs of 2 heads
def test_equals_comfyuis_ops(kf, monkeypatch, dtype, heads, d, prefetch):
    monkeypatch.setattr(kf.rope, "QK_PREFETCH", prefetch)
    g = torch.Generator().manual_seed(heads * 100 + d)
    b, lt, li = 2, 3, 5
    txt = (torch.randn(b, lt, 3 * heads * d, generator=g) * 2).to(dtype)
    # img as the single block hands it over: the first part of a wider tensor (strided rows)
    wide = (torch.randn(b, li, 3 * heads * d + 24, generator=g) * 2).to(dtype)
    img = wide[..., :3 * heads * d]
    wq = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
    wk = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
    pe = _rope_table(b, lt + li, d, seed=d)
    got = _run(kf, [txt, img], heads, wq, wk, 1e-6, pe)
    want = _reference([txt, img], heads, wq, wk, 1e-6, pe)
    _assert_as_ops(got, want, dtype)
    # float64 evaluation of the same formula: within the dtype's two roundings
    q64 = torch.cat([p.view(b, p.shape[1], 3, heads, d).permute(2, 0, 3, 1, 4)[0].double() for p in (txt, img)], 2)
    n64 = q64 * torch.rsqrt(q64.pow(2).mean(-1, keepdim=True) + 1e-6) * wq.double()
    x0, x1 = n64[..., 0::2], n64[..., 1::2]
    f = pe.double()[..., :, :, :]
    r0 = f[..., 0, 0] * x0 + f[..., 0, 1] * x1
    r1 = f[..., 1, 0] * x0 + f[..., 1, 1] * x1
    r64 = torch.stack([r0, r1], -1).reshape(n64.shape)
    tol = 4 * torch.finfo(dtype).eps * (n64.abs().amax(-1, keepdim=True) + r64.abs()) + 1e-30
    assert bool(((got[0].double() - r64).abs() <= tol).all())


def _apply_rope_split_half1(x, freqs):
    """comfy.ldm.ideogram4.model._apply_rope_split_half1, written out: pair i is (x[i], x[i + D/2]), fp32 math
    (``f0 * x0 + f1 * x1``), one rounding to x's dtype."""
    t = x.reshape(*x.shape[:-1], 2, -1).movedim(-2, -1).unsqueeze(-2).to(freqs.dtype)
    out = freqs[..., 0] * t[..., 0] + freqs[..., 1] * t[..., 1]
    return out.movedim(-1, -2).reshape(*x.shape).to(x.dtype)


def _split_half_table(length, d, seed):
    """Rotations as Ideogram 4's ``_split_half_rope_matrix`` lays them out: fp32 [1, L, 1, D/2, 2, 2] of
    (cos, -sin, sin, cos)."""
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(length, d // 2, generator=g, dtype=torch.float64) * 6.283
    c, s = torch.cos(ang), torch.sin(ang)
    return torch.stack([c, -s, s, c], dim=-1).reshape(1, length, 1, d // 2, 2, 2).float()


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "per_part"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,d", [(3, 16), (2, 64), (6, 16)])
def test_split_half_equals_ideogram4s_ops(kf, monkeypatch, dtype, heads, d, prefetch):
    """Ideogram 4: ``rms_rope_split_half`` = F.rms_norm per head, then the split-half RoPE, on q / k of the
    [B, L, 3, H, D] qkv output; here written [B, H, L, D] (the attention layout) by one launch. ``QK_PREFETCH``:
    q's and k's halves loaded up front and the rotations as vectors, or one part after the other."""
    monkeypatch.setattr(kf.rope, "QK_PREFETCH", prefetch)
    g = torch.Generator().manual_seed(heads * 10 + d)
    b, l = 2, 7
    qkv = (torch.randn(b, l, 3 * heads * d, generator=g) * 2).to(dtype)
    wq = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
    wk = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
    freqs = _split_half_table(l, d, seed=d)
    q, k, v = [torch.full((b, heads, l, d), float("nan"), dtype=dtype) for _ in range(3)]
    kf.rope.qk_norm_rope(qkv, heads, wq, wk, 1e-5, 1e-5, freqs.transpose(1, 2), q, k, v, 0, split_half=True)
    q_, k_, v_ = qkv.view(b, l, 3, heads, d).unbind(2)
    want = (_apply_rope_split_half1(F.rms_norm(q_, (d,), wq, 1e-5), freqs).transpose(1, 2),
            _apply_rope_split_half1(F.rms_norm(k_, (d,), wk, 1e-5), freqs).transpose(1, 2), v_.transpose(1, 2))
    _assert_as_ops((q, k, v), want, dtype)
    # the pairing itself, in float64: element i rotates with element i + D/2 (not 2i with 2i + 1)
    n64 = q_.double() * torch.rsqrt(q_.double().pow(2).mean(-1, keepdim=True) + 1e-5) * wq.double()
    f = freqs.double()
    x0, x1 = n64[..., : d // 2], n64[..., d // 2:]
    r64 = torch.cat([f[..., 0, 0] * x0 + f[..., 0, 1] * x1, f[..., 1, 0] * x0 + f[..., 1, 1] * x1], -1)
    tol = 4 * torch.finfo(dtype).eps * (n64.abs().amax(-1, keepdim=True) + r64.abs()) + 1e-30
    assert bool(((q.transpose(1, 2).double() - r64).abs() <= tol).all())


@pytest.mark.parametrize("split_half", [False, True])
def test_blhd_layout_and_no_v(kf, split_half):
    """Outputs may be [B, L, H, D] buffers seen as [B, H, L, D] (what the fused blocks pass, so SDPA's output needs
    no copy): the same values as contiguous outputs; v None: v is not written; strides that differ from q's or a
    strided head_dim are refused."""
    g = torch.Generator().manual_seed(11)
    heads, d, b, l = 3, 16, 2, 5
    x = (torch.randn(b, l, 3 * heads * d, generator=g) * 2).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(d, generator=g)).to(torch.bfloat16)
    pe = _rope_table(b, l, d, seed=3)
    flat = [torch.zeros(b, heads, l, d, dtype=torch.bfloat16) for _ in range(3)]
    kf.rope.qk_norm_rope(x, heads, w, w, 1e-6, 1e-6, pe, *flat, 0, split_half=split_half)
    blhd = [torch.zeros(b, l, heads, d, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
    kf.rope.qk_norm_rope(x, heads, w, w, 1e-6, 1e-6, pe, blhd[0], blhd[1], None, 0, split_half=split_half)
    assert torch.equal(blhd[0], flat[0]) and torch.equal(blhd[1], flat[1])
    assert not blhd[2].any()  # v None: untouched
    assert torch.equal(flat[2], x.view(b, l, 3, heads, d)[:, :, 2].transpose(1, 2))
    with pytest.raises(ValueError, match="q's strides"):
        kf.rope.qk_norm_rope(x, heads, w, w, 1e-6, 1e-6, pe, blhd[0], flat[1], None)
    with pytest.raises(ValueError, match="unit stride"):
        kf.rope.qk_norm_rope(x, heads, w, w, 1e-6, 1e-6, pe, *(t.transpose(2, 3).contiguous().transpose(2, 3)
                                                        for t in flat))


def test_batch_broadcast_pe_and_no_pe(kf):
    g = torch.Generator().manual_seed(7)
    heads, d = 2, 16
    x = torch.randn(3, 4, 3 * heads * d, generator=g).to(torch.bfloat16)
    w = torch.ones(d, dtype=torch.bfloat16)
    pe1 = _rope_table(1, 4, d, seed=1)
    got = _run(kf, [x], heads, w, w, 1e-6, pe1)
    want = _reference([x], heads, w, w, 1e-6, pe1.expand(3, -1, -1, -1, -1, -1))
    for a, b_ in zip(got, want):
        assert float(_ulps(a, b_).max()) <= 1.0
    got = _run(kf, [x], heads, w, w, 1e-6, None)  # no RoPE: the norm and the layout only
    want = _reference([x], heads, w, w, 1e-6, None)
    for a, b_ in zip(got, want):
        assert float(_ulps(a, b_).max()) <= 1.0


def test_empty_rows_write_nothing_and_bad_input_says_what_is_wrong(kf):
    heads, d = 2, 8
    q, k, v = [torch.zeros(1, heads, 4, d, dtype=torch.bfloat16) for _ in range(3)]
    w = torch.ones(d, dtype=torch.bfloat16)
    kf.rope.qk_norm_rope(torch.empty(1, 0, 3 * heads * d, dtype=torch.bfloat16), heads, w, w, 1e-6, 1e-6, None, q, k, v, 2)
    assert not q.any() and not k.any() and not v.any()
    x = torch.randn(1, 4, 3 * heads * d).to(torch.bfloat16)
    with pytest.raises(ValueError, match="3 \\* heads"):
        kf.rope.qk_norm_rope(x, 5, w, w, 1e-6, 1e-6, None, q, k, v)
    with pytest.raises(ValueError, match="power of two"):
        kf.rope.qk_norm_rope(torch.randn(1, 4, 3 * heads * 6).to(torch.bfloat16), heads, w[:6], w[:6], 1e-6, 1e-6,
                        None, q, k, v)
    with pytest.raises(ValueError, match="contiguous"):
        kf.rope.qk_norm_rope(x, heads, w, w, 1e-6, 1e-6, None, q.transpose(1, 2), k, v)
    with pytest.raises(ValueError, match="do not fit"):
        kf.rope.qk_norm_rope(x, heads, w, w, 1e-6, 1e-6, None, q, k, v, 1)
    with pytest.raises(ValueError, match="pe must be fp32"):
        kf.rope.qk_norm_rope(x, heads, w, w, 1e-6, 1e-6, _rope_table(1, 4, d, 0).double(), q, k, v)


def _wan_reference(xq, heads, w, eps, pe):
    """WanSelfAttention's ``apply_rope1(norm_q(q).view(b, s, n, d), freqs)``: F.rms_norm over the whole row (one
    rounding), then apply_rope1 (fp32, one rounding); as [B, H, L, D]."""
    b, l, width = xq.shape
    n = F.rms_norm(xq, (width,), w, eps).view(b, l, heads, -1)
    return _rope_ref(n.transpose(1, 2), pe) if pe is not None else n.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,d", [(3, 16), (12, 8), (2, 32)])
def test_row_norm_equals_wans_ops(kf, dtype, heads, d):
    """Wan: ``norm_q`` / ``norm_k`` normalise the whole heads * D row (not each head), q and k come from two GEMMs;
    3 and 12 heads leave masked lanes in the [next_pow2(H), D] tile, which must not enter the row's sum."""
    g = torch.Generator().manual_seed(heads * 7 + d)
    b, l, width = 2, 5, heads * d
    xq = (torch.randn(b, l, width, generator=g) * 3).to(dtype)
    xk = (torch.randn(b, l, width, generator=g) * 0.5 + 0.25).to(dtype)
    wq = (1 + 0.2 * torch.randn(width, generator=g)).to(dtype)
    wk = (1 + 0.2 * torch.randn(width, generator=g)).to(dtype)
    pe = _rope_table(1, l, d, seed=d)  # Wan: one rotation table for the batch
    # outputs as the fused Wan block allocates them: [B, L, H, D] buffers seen as [B, H, L, D]
    q, k = (torch.full((b, l, heads, d), float("nan"), dtype=dtype).transpose(1, 2) for _ in range(2))
    kf.rope.qk_rmsnorm_rope_rows(xq, xk, heads, wq, wk, 1e-6, 1e-5, pe, q, k)
    want = (_wan_reference(xq, heads, wq, 1e-6, pe), _wan_reference(xk, heads, wk, 1e-5, pe))
    for name, x, y in zip("qk", (q, k), want):
        assert not torch.isnan(x).any(), name
        if dtype == torch.float32:
            torch.testing.assert_close(x, y, rtol=2 ** -20, atol=1e-6, msg=name)
        else:
            u = _ulps(x, y)
            assert float(u.max()) <= 1.0 and float((u > 0).float().mean()) <= 0.01, (name, float(u.max()))
    # float64 of the row norm: a per-head norm would be off by the heads' differing rms, far beyond 2 roundings
    x64 = xq.double()
    n64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * wq.double()
    n64 = n64.view(b, l, heads, d).transpose(1, 2)
    x0, x1 = n64[..., 0::2], n64[..., 1::2]
    f = pe.double()
    r64 = torch.stack([f[..., 0, 0] * x0 + f[..., 0, 1] * x1, f[..., 1, 0] * x0 + f[..., 1, 1] * x1], -1)
    r64 = r64.reshape(n64.shape)
    tol = 4 * torch.finfo(dtype).eps * (n64.abs().amax(-1, keepdim=True) + r64.abs()) + 1e-30
    assert bool(((q.double() - r64).abs() <= tol).all())


def test_row_norm_bad_input_says_what_is_wrong(kf):
    heads, d = 2, 8
    xq = torch.randn(1, 4, heads * d).to(torch.bfloat16)
    w = torch.ones(heads * d, dtype=torch.bfloat16)
    q, k = (torch.zeros(1, heads, 4, d, dtype=torch.bfloat16) for _ in range(2))
    with pytest.raises(ValueError, match="xk must match xq"):
        kf.rope.qk_rmsnorm_rope_rows(xq, xq[:, :3], heads, w, w, 1e-6, 1e-6, None, q, k)
    with pytest.raises(ValueError, match="not heads"):
        kf.rope.qk_rmsnorm_rope_rows(xq, xq, 3, w, w, 1e-6, 1e-6, None, q, k)
    with pytest.raises(ValueError, match="q_weight"):  # a per-head weight where the norm spans the row
        kf.rope.qk_rmsnorm_rope_rows(xq, xq, heads, w[:d], w, 1e-6, 1e-6, None, q, k)
    with pytest.raises(ValueError, match="unit stride"):
        kf.rope.qk_rmsnorm_rope_rows(xq.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :4], xq, heads, w, w, 1e-6,
                                1e-6, None, q, k)
    kf.rope.qk_rmsnorm_rope_rows(xq[:, :0], xq[:, :0], heads, w, w, 1e-6, 1e-6, None, q[:, :, :0], k[:, :, :0])
    assert not q.any() and not k.any()  # no rows: nothing written


# ------------------------------------------------------------------- in the fused blocks
# Flux.1's fused blocks: tests/test_flux_fused.py (flux_equivalence counts this kernel's launches, one per stream and
# block, on both ComfyUIs, the model within its REL_MODEL of the per-linear one through ComfyUI's QK norm and RoPE);
# with a batch of two (the RoPE table broadcast over the batch): tests/test_chroma_fused.py.


def _ideogram4_qk_rope(pack) -> dict:
    """A 2-layer Ideogram 4 from ComfyUI's classes (current ComfyUI only): the fused blocks (one
    ``qk_norm_rope(split_half=True)`` launch per block, counted) against the per-linear INT8 model through ComfyUI's
    own ops (its torch path: ``norm_q`` / ``norm_k`` then ``_apply_rope_split_half1``; comfy_kitchen's fused op has no
    CPU kernel here)."""
    import comfy.model_management as mm
    import test_adapters as ta
    qf = pack.quant.blocks
    m, layers, patches, (x, t, ctx) = ta.tiny_ideogram4(pack, 2)
    calls, real = [], qf.kernels().rope.qk_norm_rope

    def spy(*a, **kw):
        calls.append(a[11] if len(a) > 11 else kw.get("split_half"))  # split_half, positional through kernel.plan
        return real(*a, **kw)
    before = mm.in_training
    try:
        with torch.no_grad():
            mm.in_training = True  # ComfyUI's torch ops (reference)
            ref = ta._swap(m, layers)(x, t, context=ctx)
            mm.in_training = False
            qf.kernels().rope.qk_norm_rope = spy
            with fbh.unplanned(qf.kernels().plan):  # counted through the checked wrapper
                got = ta._swap(m, patches)(x, t, context=ctx)
            qf.kernels().rope.qk_norm_rope = real
            planned = [ta._swap(m, patches)(x, t, context=ctx) for _ in range(2)]  # prepared launches re-issued
    finally:
        qf.kernels().rope.qk_norm_rope = real
        mm.in_training = before
    return {"rel": ta._rel(got, ref), "calls": calls, "layers": 2, "finite": bool(torch.isfinite(got).all()),
            "planned_equal": all(torch.equal(p, got) for p in planned)}


def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    from comfyui_version import __version__
    return {"comfyui": __version__, "ideogram4": _ideogram4_qk_rope(pack)}


def test_ideogram4_blocks_with_fused_qk_rope_on_the_current_comfyui(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    ideo = res["ideogram4"]  # one split-half launch per block, the model as ComfyUI's ops compute it
    assert ideo["calls"] == [True] * ideo["layers"] and ideo["finite"] and ideo["planned_equal"], ideo
    assert ideo["rel"] <= 2e-3, ideo


def _hopper_check() -> str:
    """Builds the compiled branch of ``_qk_norm_rope_kernel`` for sm_90."""
    import kernel.rope as krope
    # Flux (24 heads in groups of 8, D 128, interleaved pairs), Ideogram 4 (18 heads in groups of 2, D 256,
    # split-half pairs), Wan (12 heads, D 128, the norm over the row, fp16)
    for ty, consts in (("bf16", {"D": 128, "BLOCK_H": 8, "DT": 1, "HAS_PE": True, "SPLIT_HALF": False,
                                 "NORM_ROW": False, "WRITE_V": True, "INTERPRET": False}),
                       ("bf16", {"D": 256, "BLOCK_H": 2, "DT": 1, "HAS_PE": True, "SPLIT_HALF": True,
                                 "NORM_ROW": False, "WRITE_V": False, "INTERPRET": False}),
                       ("bf16", {"D": 256, "BLOCK_H": 2, "DT": 1, "HAS_PE": True, "SPLIT_HALF": True,
                                 "NORM_ROW": False, "WRITE_V": False, "PREFETCH": False, "INTERPRET": False}),
                       ("fp16", {"D": 128, "BLOCK_H": 16, "DT": 2, "HAS_PE": True, "SPLIT_HALF": False,
                                 "NORM_ROW": True, "WRITE_V": False, "INTERPRET": False})):
        types = {p: f"*{ty}" for p in ("src_ptr", "ksrc_ptr", "wq_ptr", "wk_ptr", "q_ptr", "k_ptr", "v_ptr")}
        types.update(pe_ptr="*fp32", eps_q="fp32", eps_k="fp32")
        problem = fbh.build_sm90(krope._qk_norm_rope_kernel, types, {"PREFETCH": True, **consts})
        if problem:
            return problem
    return "OK"


def test_qk_norm_rope_compiles_for_hopper():
    """In a subprocess without TRITON_INTERPRET (under it kernels are not compilable); skipped without ptxas."""
    fbh.hopper_check_in_subprocess("test_qk_norm_rope")
