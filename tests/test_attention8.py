"""The pack's 8-bit attention (kernel/attention8.py) in Triton's interpreter, and the Router's ``int8`` mode.

Error bound, derived from the kernel's steps (module doc of kernel/attention8.py), per query row i and output
column d, with P, o the float64 reference softmax and output, q' = q·scale·log2(e), k' = k - mean(k) (k when
smoothing is off), Δq(i) / Δk(j) the int8 steps (max|block| / 127) of i's BLOCK_M block / j's BLOCK_N block:

* score error (log2 units): |q̂·k̂ - q'·k'| ≤ Σ_e |q̂_e - q'_e| |k̂_e| + |q'_e| |k̂_e - k'_e|
  ≤ Δq(i)/2 · Σ_e (|k'_je| + Δk(j)/2) + Δk(j)/2 · Σ_e |q'_ie|; E_i = its max over j (plus fp32 slack), in natural
  units ε_i = ln2 · E_i. Subtracting the same mean from every key moves all scores of a row by one constant:
  softmax does not see it, so the reference needs no mean.
* softmax: perturbed weights satisfy P̃/P ∈ [e^{-2ε}, e^{2ε}], and Σ(P̃ - P) = 0, so
  |õ - o| ≤ (e^{2ε_i} - 1) Σ_j P_ij |v_jd - o_id|  (A).
* P rounded to V's dtype (unit roundoff u = 2^-8 bf16, 2^-11 fp16; the row sum stays fp32):
  ≤ u e^{2ε_i} Σ_j P_ij |v_jd|  (Bp) (+ 2^-25 Σ_j |v_jd| for fp16 subnormals).
* fp32 arithmetic (the mean, exp2, accumulation): 1e-5 Σ_j P_ij |v_jd| + 1e-6 (slack, far above what fp32 does).
* the output rounded to q's dtype: u (|o| + A + Bp).

Every element's error must be within the sum. That bound is worst-case (|·| everywhere), so the tests also check
the measured error against the first-order *statistical* prediction (rounding errors uniform on ±step/2,
independent): its mean square must be within 0.5–2× the prediction, so a kernel far more accurate than its int8
steps allow (not quantizing) or far less (a wrong scale) fails. V is taken as given (bf16 values), exactly as the
reference takes it.

Also: K smoothing (a large common key offset: the smoothed error stays at the offset-free level, the unsmoothed
one grows, both within their bounds), the Q pre-pass kernel equals the in-kernel Q quantization bit for bit, lazy
rescaling changes only roundings, strided [B, L, H, D] views, GQA, NaN/Inf propagation, clear errors for inputs
the kernel does not take, and the Router's ``int8`` mode (runs the kernel, falls back to ComfyUI's function for a
mask / another dtype / head_dim / device; ``auto`` times int8 only with INT8_FUSED_ATTN_INT8_AUTO=1).
"""
import math

import pytest
import torch

from kernel import attention8 as A
from kernel import config

LN2 = math.log(2.0)
U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
C64 = A._cfg(64, 64, 4, 1)             # the interpreter's default tile
C128 = A._cfg(128, 64, 4, 1)           # BLOCK_M 128: other quantization blocks
C64_EAGER = A._cfg(64, 64, 4, 1, 0.0)  # rescale on every block
C32 = A._cfg(128, 32, 8, 1)            # BLOCK_N 32: D 256's tiles on 99 KB cards


def _qkv(b=1, h=2, hk=2, lq=200, lk=150, d=64, dtype=torch.bfloat16, seed=0, k_offset=0.0, q_mult=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g) * q_mult
    k = torch.randn(b, hk, lk, d, generator=g) + k_offset * torch.randn(b, hk, 1, d, generator=g)
    v = torch.randn(b, hk, lk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _rep(q, k, v):
    k, v = k.double(), v.double()
    if k.shape[1] != q.shape[1]:
        r = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    return q.double(), k, v


def _ref(q, k, v, scale=None):
    """float64 softmax(Q K^T * scale) V on [B, H, L, D] (K/V heads repeated for GQA)."""
    q, k, v = _rep(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v


def _block_steps(x, block):
    """max|x| / 127 per block of ``block`` rows along dim -2, repeated per row: [..., L, 1]."""
    L = x.shape[-2]
    n = -(-L // block)
    pad = torch.zeros(*x.shape[:-2], n * block - L, x.shape[-1], dtype=x.dtype)
    amax = torch.cat([x, pad], -2).abs().reshape(*x.shape[:-2], n, block * x.shape[-1]).amax(-1)
    return (amax / 127).repeat_interleave(block, -1)[..., :L, None]


def _analysis(q, k, v, cfg, scale=None, smooth=True):
    """(reference output, worst-case bound per element, predicted mean square error) for the kernel's steps."""
    u_v, u_o = U[v.dtype], U[q.dtype]
    qd, kd, vd = _rep(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q2 = qd * scale * A.LOG2E                                  # q' (log2 units)
    kk = (k.double() - k.double().mean(2, keepdim=True)) if smooth else k.double()
    if kk.shape[1] != q.shape[1]:
        kk = kk.repeat_interleave(q.shape[1] // kk.shape[1], 1)
    dq = _block_steps(q2, cfg["BLOCK_M"])                      # [B, H, Lq, 1]
    dk = _block_steps(kk, cfg["BLOCK_N"])                      # [B, H, Lk, 1]
    P = torch.softmax(q2 @ kd.transpose(-1, -2) * LN2, -1)     # = softmax(q k^T scale)
    o = P @ vd
    sum_q = q2.abs().sum(-1, keepdim=True)                     # [B, H, Lq, 1]
    sum_k = kk.abs().sum(-1)[..., None, :]                     # [B, H, 1, Lk]
    dk_row = dk.transpose(-1, -2)                              # [B, H, 1, Lk]
    e_score = dq / 2 * (sum_k + dk_row / 2 * k.shape[-1]) + dk_row / 2 * sum_q
    e_score = e_score + 1e-6 * (1 + (q2.abs() @ kk.abs().transpose(-1, -2)))  # fp32 mean / offsets
    eps = LN2 * e_score.amax(-1, keepdim=True)                 # [B, H, Lq, 1]
    w = vd[..., None, :, :] - o[..., :, None, :]               # v_j - o_i: [B, H, Lq, Lk, D]
    a = torch.expm1(2 * eps) * torch.einsum("bhij,bhijd->bhid", P, w.abs())
    pv = P @ vd.abs()
    bp = u_v * torch.exp(2 * eps) * pv
    if v.dtype == torch.float16:
        bp = bp + 2.0 ** -25 * vd.abs().sum(-2, keepdim=True)
    bound = a + bp + 1e-5 * pv + 1e-6
    bound = bound + u_o * (o.abs() + bound)
    # first-order statistics: rounding error ~ U(-step/2, step/2), variance step^2 / 12
    x = P[..., None] * w                                                   # [B, H, Lq, Lk, D]
    amat = torch.einsum("bhje,bhijd->bhied", kk, x)                        # d o_id / d q'_ie (/ ln2)
    var_q = LN2 ** 2 * dq ** 2 / 12 * (amat ** 2).sum(-2)                  # [B, H, Lq, D]
    var_k = LN2 ** 2 * torch.einsum("bhj,bhijd->bhid", dk[..., 0] ** 2 / 12, x ** 2) * (q2 ** 2).sum(-1)[..., None]
    c_rel = lambda u: (2 * u) ** 2 * 0.5410 / 12  # noqa: E731 - E[(ulp/x)^2]/12, log-uniform mantissa
    var_p = c_rel(u_v) * (P ** 2) @ (vd ** 2)
    var_o = c_rel(u_o) * o ** 2
    mse = float((var_q + var_k + var_p + var_o).mean())
    return o, bound, mse


def _check(out, q, k, v, cfg, scale=None, smooth=True, what=""):
    ref, bound, mse = _analysis(q, k, v, cfg, scale, smooth)
    err = (out.double() - ref).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{what}: an element is {worst:.2f}x its derived bound"
    ratio = float((err ** 2).mean()) / mse
    assert 0.5 <= ratio <= 2.0, f"{what}: mean square error {ratio:.2f}x the first-order prediction"
    return ref, bound, err, ratio


# ------------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("d,lq,lk,cfg", [
    (64, 200, 150, C64), (64, 77, 130, C128), (128, 130, 64, C64), (128, 200, 150, C64_EAGER),
    (256, 130, 77, C64), (256, 64, 200, C128), (256, 100, 77, C32)])
def test_error_within_derived_bound(d, lq, lk, cfg):
    q, k, v = _qkv(lq=lq, lk=lk, d=d, seed=d + lq, k_offset=0.5)
    out = A.attention_int8(q, k, v, config=cfg)
    assert out.shape == q.shape and out.dtype == q.dtype
    _, bound, err, ratio = _check(out, q, k, v, cfg, what=f"D{d} Lq{lq} Lk{lk} {A.config_text(cfg)}")
    # relative error: what the H200 benchmark reports (about 5-6x bf16 SDPA's own 2e-3 on random data)
    ref = _ref(q, k, v)
    rel = float((out.double() - ref).norm() / ref.norm())
    assert 3e-3 < rel < 3e-2, rel


def test_fp16_gqa_scale_and_peaked_softmax():
    """fp16, 4 query heads on 2 K/V heads, an explicit scale, and large scores (peaked softmax: the running max
    moves between key blocks, so lazy rescaling runs both of its branches)."""
    q, k, v = _qkv(h=4, hk=2, lq=100, lk=190, d=64, dtype=torch.float16, seed=3, q_mult=3.0)
    for cfg in (C64, C64_EAGER):
        out = A.attention_int8(q, k, v, scale=0.2, config=cfg)
        _check(out, q, k, v, cfg, scale=0.2, what=A.config_text(cfg))


def test_prepass_equals_fused_q_and_lazy_rescale_only_changes_roundings():
    q, k, v = _qkv(lq=150, lk=140, d=128, seed=11, q_mult=2.0)
    fused = A.attention_int8(q, k, v, config=C64)
    pre = A.attention_int8(q, k, v, config=C64, q_prequant=True)
    assert torch.equal(fused, pre)
    eager = A.attention_int8(q, k, v, config=C64_EAGER)
    # the same int8 scores; only where P is rounded and the fp32 rescaling differ: within twice the rounding terms
    ref, bound, _ = _analysis(q, k, v, C64)
    qd, kd, vd = _rep(q, k, v)
    pv = torch.softmax(qd @ kd.transpose(-1, -2) * 128 ** -0.5, -1) @ vd.abs()
    rounding = 2 * (U[v.dtype] * 1.1 * pv + U[q.dtype] * (ref.abs() + bound)) + 1e-5
    assert bool(((fused.double() - eager.double()).abs() <= rounding).all())


def test_k_smoothing_removes_a_common_key_offset():
    """Keys with a large common offset (per head, the same for every key: softmax cannot see it). Smoothed: the
    error stays at the offset-free level. Unsmoothed: the int8 step covers the offset and the error grows several-fold.
    Both stay within their own derived bound (the unsmoothed bound uses k itself)."""
    q0, k0, v0 = _qkv(lq=96, lk=160, d=128, seed=5)
    q, k, v = _qkv(lq=96, lk=160, d=128, seed=5, k_offset=8.0)
    base = _check(A.attention_int8(q0, k0, v0, config=C64), q0, k0, v0, C64, what="no offset")
    smooth = _check(A.attention_int8(q, k, v, config=C64), q, k, v, C64, what="offset, smoothed")
    out_raw = A.attention_int8(q, k, v, config=C64, smooth_k=False)
    raw = _check(out_raw, q, k, v, C64, smooth=False, what="offset, not smoothed")
    rms = lambda e: float(e.pow(2).mean().sqrt())  # noqa: E731
    assert 0.5 < rms(smooth[2]) / rms(base[2]) < 2.0
    assert rms(raw[2]) > 3 * rms(smooth[2])  # the step grows ~5x; Q and P rounding are unchanged
    assert rms(raw[1]) > 3 * rms(smooth[1])  # the bounds say the same


def test_strided_layout_zero_queries_and_batch():
    """[B, L, H, D] buffers viewed as [B, H, L, D] (ComfyUI's layout): the same numbers as contiguous inputs, and the
    output keeps q's layout. An all-zero query block attends uniformly (the mean of V)."""
    q, k, v = _qkv(b=2, lq=70, lk=90, d=64, seed=7)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    out = A.attention_int8(qt, kt, vt, config=C64)
    assert out.stride() == qt.stride()
    assert torch.equal(out.contiguous(), A.attention_int8(q, k, v, config=C64))
    _check(out, q, k, v, C64, what="strided, batch 2")
    qz = torch.zeros_like(q)
    outz = A.attention_int8(qz, k, v, config=C64)
    want = v.double().mean(2, keepdim=True).expand_as(outz)
    assert float((outz.double() - want).abs().max()) < 2 * U[v.dtype] * float(v.double().abs().max())


def test_nan_and_inf_propagate():
    """NaN/Inf in Q: NaN output for that BLOCK_M block of rows of that head only; in K: that head is NaN; in V at
    (key j, column d): NaN in column d of that head. Never a finite result from non-finite input."""
    q, k, v = _qkv(lq=130, lk=100, d=64, seed=9)
    ok = A.attention_int8(q, k, v, config=C64)
    qn = q.clone()
    qn[0, 1, 70, 3] = float("nan")
    out = A.attention_int8(qn, k, v, config=C64)
    nan = out.isnan().any(-1)[0]                                    # [H, Lq]
    assert bool(nan[1, 64:128].all()) and int(nan.sum()) == 64
    assert torch.equal(out[0, 0], ok[0, 0]) and torch.equal(out[0, 1, :64], ok[0, 1, :64])
    qi = q.clone()
    qi[0, 0, 5, 0] = float("inf")
    assert int(A.attention_int8(qi, k, v, config=C64).isnan().any(-1)[0, 0].sum()) == 64
    kn = k.clone()
    kn[0, 0, 99, 0] = float("nan")
    out = A.attention_int8(q, kn, v, config=C64)
    assert bool(out[0, 0].isnan().all()) and not bool(out[0, 1].isnan().any())
    vn = v.clone()
    vn[0, 1, 40, 5] = float("nan")
    out = A.attention_int8(q, k, vn, config=C64)
    assert bool(out[0, 1, :, 5].isnan().all()) and int(out.isnan().sum()) == 130


@pytest.mark.parametrize("case,match", [
    ("3d", "must be 4-D"), ("head_dim", "head_dim 96 is not supported"), ("head_dim_32", "head_dim 32"),
    ("kv_shape", "k and v shapes differ"), ("batch", "batch of q"), ("dq", "head_dim of q"),
    ("heads", "must be a multiple"), ("fp32", "takes bfloat16 or float16"), ("mixed", "dtypes differ"),
    ("lq0", "empty attention"), ("lk0", "empty attention"), ("scale", "scale must be finite"),
    ("list", "must be a torch.Tensor")])
def test_bad_inputs_give_clear_errors(case, match):
    q, k, v = _qkv(lq=8, lk=8, d=64)
    args, kw = {
        "3d": ((q[0], k[0], v[0]), {}),
        "head_dim": ((q[..., :48].repeat(1, 1, 1, 2), k[..., :48].repeat(1, 1, 1, 2), v[..., :48].repeat(1, 1, 1, 2)), {}),
        "head_dim_32": ((q[..., :32], k[..., :32], v[..., :32]), {}),
        "kv_shape": ((q, k, v[:, :, :4]), {}),
        "batch": ((q, torch.cat([k, k]), torch.cat([v, v])), {}),
        "dq": ((torch.cat([q, q], -1), k, v), {}),
        "heads": ((q[:, :1].repeat(1, 3, 1, 1), k, v), {}),
        "fp32": ((q.float(), k.float(), v.float()), {}),
        "mixed": ((q, k.half(), v), {}),
        "lq0": ((q[:, :, :0], k, v), {}),
        "lk0": ((q, k[:, :, :0], v[:, :, :0]), {}),
        "scale": ((q, k, v), {"scale": float("nan")}),
        "list": (([1.0], k, v), {}),
    }[case]
    with pytest.raises(ValueError, match=match):
        A.attention_int8(*args, **kw)


def test_configs_fit_hopper_and_cpu_needs_the_interpreter():
    for d in A.HEAD_DIMS:
        cands = A.configs(d)
        assert cands and all(A.smem_bytes(c, d) <= A.SMEM_LIMIT for c in cands)
        assert all(c["BLOCK_M"] % 64 == 0 and c["num_warps"] % 4 == 0 for c in cands)
        assert all(c["BLOCK_M"] * d // (32 * c["num_warps"]) <= 128 for c in cands)
    assert {(c["BLOCK_M"], c["BLOCK_N"]) for c in A.configs(256)} == {(128, 64), (128, 128), (64, 64), (64, 128)}
    assert A.INTERPRET  # these tests run in the interpreter (conftest)


def test_default_tile_and_candidates_fit_every_target(monkeypatch):
    """The untuned tile (``tune=False``, torch.compile) and the candidates within each target's opt-in shared memory
    (sm_86 / 89 / 120: 99 KB); sm_90's default is still 128 x 128 (D <= 128) / 128 x 64 (D 256) in 3 stages."""
    import types

    from kernel import autotune
    for cap, limit in autotune.SMEM_OPTIN.items():
        for d in A.HEAD_DIMS:
            c = A.default_config(d, limit, interpret=False)
            assert A.smem_bytes(c, d) <= limit and c["BLOCK_M"] * d // (32 * c["num_warps"]) <= 128, (cap, d, c)
            cands = A.configs(d, limit)
            assert c in cands and all(A.smem_bytes(x, d) <= limit for x in cands), (cap, d, c)
    # the old defaults on a 99 KB card, by hand: Q 128 x D int8 + 3 stages of K (int8) and V (bf16), BLOCK_N x D
    assert A.smem_bytes(A._cfg(128, 128, 8, 3), 128) == 128 * 128 + 3 * 128 * 128 * 3 == 163840 > 101376
    assert A.smem_bytes(A._cfg(128, 64, 8, 3), 256) == 128 * 256 + 3 * 64 * 256 * 3 == 180224 > 101376
    h200 = autotune.SMEM_OPTIN[(9, 0)]
    for d in (64, 128):
        assert A.default_config(d, h200, interpret=False) == A.default_config(d, interpret=False) == \
            A._cfg(128, 128, 8, 3)
    assert A.default_config(256, h200, interpret=False) == A._cfg(128, 64, 8, 3)
    assert A.default_config(256, 99 * 1024, interpret=False) == A._cfg(128, 32, 8, 2)
    assert A.default_config(256) == C64  # the interpreter's
    assert {c["BLOCK_N"] for c in A.configs(256, 99 * 1024)} == {32}
    assert A.configs(128, h200) == A.configs(128) and A.configs(256, h200) == A.configs(256)
    # the device's limit: the lower of the table's figure and the device's report
    assert A.device_smem_limit(torch.device("cpu")) == A.SMEM_LIMIT
    for cap, reported, want in (((8, 9), 232448, 101376), ((12, 0), 99 * 1024, 99 * 1024),
                                ((10, 0), 232448, 232448)):
        props = types.SimpleNamespace(major=cap[0], minor=cap[1], shared_memory_per_block_optin=reported)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev, p=props: p)
        assert A.device_smem_limit("cuda:0") == want, cap


# ------------------------------------------------------------------------------------------------ the Router
@pytest.fixture(scope="module")
def att():
    from quant import attention
    return attention


def _flat(t):
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


class _MemCache:
    def __init__(self):
        self.data = {}

    def get(self, key):
        return self.data.get(key)

    def put(self, key, value, meta=None):
        self.data[key] = value


def test_router_int8_runs_the_kernel_and_falls_back_for_what_it_cannot_take(att):
    assert "int8" in att.MODES and att.check_mode("int8") == "int8"
    router = att.Router("int8", int8_devices=("cpu",))
    comfy_calls = []

    def comfy(*a, **kw):
        comfy_calls.append(kw)
        return "comfy"

    never = lambda *a, **k: pytest.fail("ComfyUI's function called for a call int8 takes")  # noqa: E731
    q, k, v = _qkv(h=2, lq=70, lk=90, d=64, seed=2)
    want = A.attention_int8(q, k, v)
    out = router(never, q, k, v, 2, skip_reshape=True, skip_output_reshape=True)
    assert torch.equal(out, want)
    out3 = router(never, _flat(q), _flat(k), _flat(v), 2)  # ComfyUI's [B, L, H*D] form
    assert out3.shape == (1, 70, 128) and torch.equal(out3, _flat(want))
    out = router(never, q, k, v, 2, skip_reshape=True, skip_output_reshape=True, scale=0.1)
    assert torch.equal(out, A.attention_int8(q, k, v, scale=0.1))
    qg, kg, vg = _qkv(h=4, hk=2, lq=40, lk=50, d=64, seed=4)  # GQA
    out = router(never, qg, kg, vg, 4, skip_reshape=True, skip_output_reshape=True, enable_gqa=True)
    assert torch.equal(out, A.attention_int8(qg, kg, vg))
    assert dict(router.counts) == {"int8": 4}
    mask = torch.ones(70, 90, dtype=torch.bool)
    assert router(comfy, q, k, v, 2, mask=mask, skip_reshape=True) == "comfy"             # a mask
    assert router(comfy, q.float(), k.float(), v.float(), 2, skip_reshape=True) == "comfy"  # fp32
    q32, k32, v32 = _qkv(lq=8, lk=8, d=32)
    assert router(comfy, q32, k32, v32, 2, skip_reshape=True) == "comfy"                # head_dim 32
    assert dict(router.counts) == {"int8": 4, "comfy_default": 3}
    assert comfy_calls[0]["mask"] is mask
    on_cuda_only = att.Router("int8")  # the default: CUDA only, so a CPU call is ComfyUI's
    assert on_cuda_only(comfy, q, k, v, 2, skip_reshape=True) == "comfy"
    assert dict(on_cuda_only.counts) == {"comfy_default": 1}
    assert att.int8_reason(q, k, v, mask, {}) == "a mask"


def test_auto_times_int8_only_when_the_switch_allows(att, first_call_tuning):
    q, k, v = _qkv(lq=40, lk=50, d=64, seed=6)
    never = lambda *a, **k: pytest.fail("ComfyUI's function called")  # noqa: E731
    fake = {"cudnn": 3.0, "flash": 2.0, "efficient": 4.0, "int8": 1.0}
    for allowed in (False, True):
        calls, cache = [], _MemCache()

        def time_fn(name, run):
            calls.append(name)
            if name == "int8":
                run()  # the int8 candidate really runs the kernel
            return fake[name]

        router = att.Router("auto", time_fn=time_fn, cache=cache, probe_devices=("cpu",), int8_devices=("cpu",))
        with config.override(INT8_FUSED_ATTN_INT8_AUTO=allowed):
            out = router(never, q, k, v, 2, skip_reshape=True, skip_output_reshape=True)
            router(never, q, k, v, 2, skip_reshape=True, skip_output_reshape=True)  # cached: no new probe
        (text, entry), = cache.data.items()
        if allowed:
            assert sorted(calls) == ["cudnn", "efficient", "flash", "int8"] and entry["backend"] == "int8"
            assert text.endswith("_int8ok") and torch.equal(out, A.attention_int8(q, k, v))
            assert dict(router.counts) == {"int8": 2}
        else:
            assert sorted(calls) == ["cudnn", "efficient", "flash"] and entry["backend"] == "flash"
            assert not text.endswith("_int8ok") and "int8" not in router.counts
    mask = torch.ones(40, 50, dtype=torch.bool)  # int8 cannot take a mask: not even timed with the switch on
    calls.clear()
    with config.override(INT8_FUSED_ATTN_INT8_AUTO=True):
        router(never, q, k, v, 2, mask=mask, skip_reshape=True, skip_output_reshape=True)
    assert sorted(calls) == ["cudnn", "efficient", "flash"]
