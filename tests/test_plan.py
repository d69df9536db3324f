"""kernel/plan.py: prepared launches of an INT8 linear / GEMM call, re-issued for operands of the same signature.

On the CPU interpreter a plan re-launches through Triton (``jit_fn[grid]``), so the whole record -> build -> re-issue
chain runs the real kernels: results are compared bit for bit with the checked call and with an independent float64
W8A8 reference, and every signature change (shape, strides, alignment, dtype, device, an absent operand) must fall
back to the checked path with correct results. The direct re-launch of a compiled kernel (GPU) is checked with the
recording stand-in of tests/test_kernel_launch.py: which arguments reach ``compiled.run``, and that a launch hook
sends the launch through Triton. bench/host_int8.py checks plans on the GPU (outputs equal the checked path) and
times them.

Run: TRITON_INTERPRET=1 python -m pytest tests/test_plan.py -q
"""
import pytest
import torch

triton = pytest.importorskip("triton")
import kernel  # noqa: E402
from kernel import config, launch, plan  # noqa: E402
from quant import blocks as qf  # noqa: E402
from quant.linear import Int8Linear  # noqa: E402
from quant.quantize import quantize_per_token_ref  # noqa: E402
from launch_standins import Jit, int8_layer  # noqa: E402


def _layer(n=40, k=72, bias=True, smooth=True, seed=0) -> Int8Linear:
    return int8_layer(n, k, bias, smooth, seed)


def _x(*shape, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype)


def _ref(x, layer) -> torch.Tensor:
    """float64 W8A8: the reference quantizer on x / smooth, exact integer products, both scales, bias."""
    x2 = x.reshape(-1, x.shape[-1])
    a_q, a_s = quantize_per_token_ref(x2, layer.inv_smooth)
    y = (a_q.double() @ layer.qweight.double().t()) * a_s.double()[:, None] * layer.weight_scale.double()[None, :]
    y = y if layer.bias is None else y + layer.bias.double()[None, :]
    return y.reshape(*x.shape[:-1], -1)


def _ops(layer):
    return layer.weight, layer.weight_scale, layer.bias, layer.inv_smooth


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("shape", [(2, 24, 72), (40, 72), (3, 72), (1, 5, 72)])  # two launches / one (M <= 16)
@pytest.mark.parametrize("bias, smooth", [(True, True), (False, False)])
def test_plan_repeats_int8_linear_bit_for_bit(shape, bias, smooth):
    layer = _layer(bias=bias, smooth=smooth)
    y0, p = kernel.int8_linear_planned(_x(*shape), *_ops(layer))
    assert p is not None and y0.shape == (*shape[:-1], 40)
    for seed in (2, 3):  # new data, same signature
        x = _x(*shape, seed=seed)
        y = p(x, *_ops(layer))
        assert y is not None and y.shape == (*shape[:-1], 40) and y.dtype == x.dtype
        assert torch.equal(y, kernel.int8_linear(x, *_ops(layer)))
        assert _rel(y, _ref(x, layer)) < 1e-6


def test_plan_repeats_int8_gemm_bit_for_bit():
    layer = _layer()
    x = _x(24, 72)
    a_q, a_s = kernel.quantize_per_token(x, layer.inv_smooth)
    out, p = kernel.int8_gemm_planned(a_q, a_s, layer.weight, layer.weight_scale, layer.bias, torch.float32)
    assert p is not None
    x2 = _x(24, 72, seed=5)
    b_q, b_s = kernel.quantize_per_token(x2, layer.inv_smooth)
    y = p(b_q, b_s, layer.weight, layer.weight_scale, layer.bias)
    assert torch.equal(y, kernel.int8_gemm(b_q, b_s, layer.weight, layer.weight_scale, layer.bias, torch.float32))
    assert _rel(y, _ref(x2, layer)) < 1e-6


def test_a_changed_signature_is_refused():
    """Each thing the recorded integers or the compiled kernels depend on, changed: the plan returns None."""
    layer = _layer()
    x = _x(24, 72)
    _, p = kernel.int8_linear_planned(x, *_ops(layer))
    w, ws, b, inv = _ops(layer)
    store = torch.zeros(24 * 72 + 1)
    misaligned = store[1:].view(24, 72)  # 4 bytes past a 16-byte boundary
    misaligned.copy_(x)
    assert p(x.clone(), w, ws, b, inv) is not None
    refused = {
        "shape": p(_x(23, 72), w, ws, b, inv),
        "dtype": p(x.to(torch.bfloat16), w, ws, b, inv),
        "strides": p(_x(72, 24).t(), w, ws, b, inv),
        "alignment": p(misaligned, w, ws, b, inv),
        "device": p(x.to("meta"), w, ws, b, inv),
        "no bias": p(x, w, ws, None, inv),
        "a bias where none was": kernel.int8_linear_planned(x, w, ws, None, inv)[1](x, w, ws, b, inv),
        "weight dtype": p(x, w.float(), ws, b, inv),
        "operand count": p(x, w, ws, b),
    }
    assert all(v is None for v in refused.values()), [k for k, v in refused.items() if v is not None]
    # the checked path takes the misaligned view and gives the same result
    assert torch.equal(kernel.int8_linear(misaligned, w, ws, b, inv), kernel.int8_linear(x, w, ws, b, inv))


def test_no_plan_where_the_call_converted_an_operand():
    """A bias as [N, 1] is reshaped by the checked path: the kernel saw another tensor, so nothing can be planned
    (the call itself is right)."""
    layer = _layer()
    x = _x(24, 72)
    b = layer.bias.reshape(-1, 1)
    y, p = kernel.int8_linear_planned(x, layer.weight, layer.weight_scale, b, layer.inv_smooth)
    assert p is None
    assert _rel(y, _ref(x, layer)) < 1e-6


def test_no_plan_without_launches():
    layer = _layer()
    y, p = kernel.int8_linear_planned(torch.zeros(0, 72), *_ops(layer))
    assert p is None and y.shape == (0, 40)


def _spy(monkeypatch, name):
    calls = []
    real = getattr(kernel, name)

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)
    monkeypatch.setattr(kernel, name, spy)
    return calls


@pytest.mark.parametrize("dispatch_mode", ["int8", "auto"])  # auto on the CPU: int8, nothing timed
def test_layer_plans_once_per_call_shape(monkeypatch, dispatch_mode):
    planned, checked = _spy(monkeypatch, "int8_linear_planned"), _spy(monkeypatch, "int8_linear")
    layer = _layer()
    with config.override(INT8_FUSED_DISPATCH=dispatch_mode):
        for seed in range(4):
            x = _x(2, 24, 72, seed=seed)
            assert _rel(layer(x), _ref(x, layer)) < 1e-6
    # the first call plans [48, 72] (dispatch sees x flattened), the second [2, 24, 72] (forward's hot path),
    # the later ones re-issue that plan
    assert planned == [torch.Size([48, 72]), torch.Size([2, 24, 72])] and checked == []
    assert layer.dispatch_calls["int8"] == 4


def test_unplannable_call_is_remembered(monkeypatch):
    """A call that cannot be planned (zero rows: no launch) is tried once, then takes the checked path."""
    planned, checked = _spy(monkeypatch, "int8_linear_planned"), _spy(monkeypatch, "int8_linear")
    layer = _layer()
    for _ in range(3):
        assert layer.int8_call(torch.zeros(0, 72)).shape == (0, 40)
    assert len(planned) == 1 and len(checked) == 2


def test_layer_plan_follows_a_new_weight():
    """Plans hold no tensor: a new weight (ComfyUI swapping or reloading it) is used at once."""
    layer = _layer()
    x = _x(24, 72)
    layer.int8_call(x), layer.int8_call(x)
    other = _layer(seed=7)
    layer.weight = other.weight.clone()
    layer.weight_scale = other.weight_scale.clone()
    layer.bias = other.bias.clone()
    layer.smooth = other.smooth.clone()
    assert _rel(layer.int8_call(x), _ref(x, other)) < 1e-6
    with torch.no_grad():
        layer.weight.copy_(_layer(seed=8).weight)  # in place: same tensor, new values
    assert torch.equal(layer.int8_call(x), kernel.int8_linear(x, *_ops(layer)))


def test_fused_gemm_and_linear_go_through_plans(monkeypatch):
    planned = _spy(monkeypatch, "int8_gemm_planned")
    layer = _layer()
    for seed in range(3):
        x = _x(24, 72, seed=seed)
        a_q, a_s = qf.act_quant(x, layer.inv_smooth)
        assert _rel(qf.gemm(a_q, a_s, layer, torch.float32), _ref(x, layer)) < 1e-6
        assert _rel(qf.linear(layer, x), _ref(x, layer)) < 1e-6
    assert len(planned) == 1


# ---------------------------------------------------------------- the direct re-launch (GPU), with a stand-in
class _Jit(Jit):
    def __init__(self):
        super().__init__(("x_ptr", "out_ptr", "n", "BLOCK"))


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(launch, "_USE_FAST", True)
    monkeypatch.setattr(launch, "_COMPILED", {})
    monkeypatch.setattr(launch, "_SAME_CALL", True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 4242, raising=False)


def _recorded_plan(jit, x, out):
    """A plan of one stand-in launch (recorded as on a GPU: the fast path's compiled kernel) on CPU tensors."""
    with launch.record() as rec:
        for _ in range(2):  # the first compiles through Triton, the second is the direct re-launch
            launch.launch(jit, (3,), (x, out, 8), dict(BLOCK=64), 4, 2, torch.device("cuda", 0))
    assert len(rec) == 2 and all(r.compiled is jit.compiled for r in rec)
    return plan.build(rec[1:], (x,), (out,), out, torch.device("cpu"))


def test_plan_relaunches_the_compiled_kernel_with_the_new_tensors(fast):
    jit = _Jit()
    p = _recorded_plan(jit, torch.zeros(8), torch.zeros(8))
    x2 = torch.ones(8)
    y = p(x2)
    c = jit.compiled
    assert len(c.runs) == 2 and len(jit.slow) == 1
    run = c.runs[-1]
    assert run[:9] == (3, 1, 1, 4242, c.function, c.packed_metadata, None, None, None)
    assert run[9] is x2 and run[10] is y and run[11:] == (8, 64)  # new input, new output, the ints, the tail
    assert y.shape == (8,) and y.dtype == torch.float32


def test_plan_goes_through_triton_while_a_launch_hook_is_installed(fast):
    jit = _Jit()
    p = _recorded_plan(jit, torch.zeros(8), torch.zeros(8))
    chain = triton.knobs.runtime.launch_enter_hook

    def hook(metadata):
        pass

    chain.add(hook)
    try:
        x2 = torch.ones(8)
        y = p(x2)
    finally:
        chain.remove(hook)
    grid, args, kw = jit.slow[-1]
    assert len(jit.slow) == 2 and len(jit.compiled.runs) == 1
    assert grid == (3,) and args[0] is x2 and args[1] is y and args[2] == 8
    assert kw == dict(BLOCK=64, num_warps=4, num_stages=2)


def test_autotune_launches_are_not_part_of_a_recording(fast):
    jit = _Jit()
    with launch.record() as rec:
        with launch.not_recorded():
            launch.launch(jit, (3,), (torch.zeros(8), torch.zeros(8), 8), dict(BLOCK=64), 4, 2,
                          torch.device("cuda", 0))
        launch.launch(jit, (3,), (torch.zeros(8), torch.zeros(8), 8), dict(BLOCK=32), 4, 2, torch.device("cuda", 0))
    assert [r.constexprs["BLOCK"] for r in rec] == [32]


class _SeededCache:
    """An autotune cache without entries whose shipped table holds ``seed`` for every key (kernel.tuned)."""
    path = "(test)"

    def __init__(self, seed):
        self.seed, self.seed_gets, self.puts = seed, [], {}

    def get(self, key, seed=True):
        return self.puts.get(key)

    def seed_get(self, key):
        self.seed_gets.append(key)
        return dict(self.seed)

    def refuse_seed(self, key):
        raise AssertionError(f"the shipped config of {key} was refused")

    def put(self, key, val, meta=None):
        self.puts[key] = val


def test_shipped_swiglu_tile_check_is_not_part_of_a_recording(monkeypatch):
    """The one launch that checks a shipped SwiGLU-epilogue tile (kernel/swiglu.py ``_swiglu_config``) runs inside the
    first call of a shape, which a plan records: recorded, every later call of that shape repeated the whole merged
    w1+w3 GEMM twice (same bits, ~50 ms a step on the H200 for Ideogram 4). The check must run, unrecorded."""
    from kernel import autotune, gemm, s8wgmma, swiglu
    cache = _SeededCache(autotune.interpreter_configs()[0])
    monkeypatch.setattr(s8wgmma, "usable", lambda dev: True)
    monkeypatch.setattr(gemm, "device_cache", lambda dev: cache)
    monkeypatch.setattr(swiglu, "_SW_TILE", {})
    g = torch.Generator().manual_seed(0)
    m, k, f = 40, 128, 64
    a_q = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    w13 = torch.randint(-127, 128, (2 * f, k), dtype=torch.int8, generator=g)
    a_s, w_s = torch.rand(m, generator=g) / 100 + 1e-3, torch.rand(2 * f, generator=g) / 100 + 1e-3
    h = torch.full((m, f), float("nan"), dtype=torch.bfloat16)
    with launch.record() as rec:
        cfg = swiglu._swiglu_config(dict(cache.seed), a_q, a_s, w13, w_s, None, h, False)
    assert cache.seed_gets and cfg == {k_: v for k_, v in cache.seed.items() if k_ != "SPLIT"}
    assert not torch.isnan(h.float()).any()  # the check launched the kernel (it wrote every element) ...
    assert rec == []                         # ... and a plan recording the call does not repeat it
    # what it wrote is the SwiGLU of the float64 W8A8 product, rounded as the kernel's contract says
    acc = (a_q.double() @ w13.double().T) * a_s.double()[:, None] * w_s.double()[None]
    a, b = acc[:, :f].to(torch.bfloat16).float(), acc[:, f:].to(torch.bfloat16).float()
    want = (torch.nn.functional.silu(a).to(torch.bfloat16).float() * b).to(torch.bfloat16)
    assert (h.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


# ---------------------------------------------------------------- plans keyed by the call (kernel.plan.call)
def _kf():
    import kernel.ops
    kernel.ops.row_modules()
    return kernel


def _spy_fn(fn):
    calls = []

    def spy(*a):
        calls.append(1)
        return fn(*a)
    return spy, calls


def test_call_repeats_a_row_kernel_with_a_view_of_its_operand():
    """Flux's LayerNorm · modulation + quantize: its [B, 1, K] modulation rows reach the kernel as a [B, K] view
    (by address); repeated calls with new values equal the wrapper's own result bit for bit."""
    kf = _kf()
    fn, calls = _spy_fn(kf.norm.layernorm_modulate_quantize)
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        x = torch.randn(2 * 12, 64, generator=g).to(torch.bfloat16)
        scale = torch.randn(2, 1, 64, generator=g).to(torch.bfloat16)
        shift = torch.randn(2, 1, 64, generator=g).to(torch.bfloat16)
        inv = torch.rand(64, generator=g) + 0.5
        got = plan.call(fn, x, scale, shift, 12, inv, 1e-6)
        want = kf.norm.layernorm_modulate_quantize(x, scale, shift, 12, inv, 1e-6)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), i
    assert len(calls) == 1  # recorded once, then re-issued


def test_call_key_holds_scalars_and_salt():
    """Another eps / tokens per batch / tile plan is another key: recorded again, never served the old plan."""
    kf = _kf()
    fn, calls = _spy_fn(kf.norm.layernorm_modulate_quantize)
    x = _x(24, 64).to(torch.bfloat16)
    scale, shift = _x(2, 64, seed=2).to(torch.bfloat16), _x(2, 64, seed=3).to(torch.bfloat16)
    for eps, tpb, salt in [(1e-6, 12, ()), (1e-6, 12, ()), (1e-2, 12, ()), (1e-6, 24, ()), (1e-6, 12, ("other",))]:
        nb = 24 // tpb  # batch rows of the modulation
        got = plan.call(fn, x, scale[:nb], shift[:nb], tpb, None, eps, salt=salt)
        want = kf.norm.layernorm_modulate_quantize(x, scale[:nb], shift[:nb], tpb, None, eps)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(calls) == 4  # the repeated first key alone re-issued its plan


def test_call_does_not_plan_a_result_made_after_the_launches():
    """A result that is a view of the kernel's output (made by torch after the launch): the key stays unplanned and
    the function runs each time."""
    fn, calls = _spy_fn(lambda x: kernel.quantize_per_token(x)[0].view(-1))
    for seed in range(3):
        x = _x(8, 64, seed=seed)
        assert torch.equal(plan.call(fn, x), kernel.quantize_per_token(x)[0].view(-1))
    assert len(calls) == 3


def test_call_without_launches_runs_the_function_each_time():
    fn, calls = _spy_fn(kernel.quantize_per_token)
    for _ in range(2):
        q, s = plan.call(fn, torch.zeros(0, 64))
        assert q.shape == (0, 64) and s.shape == (0,)
    assert len(calls) == 2


def test_fused_helpers_plan_their_row_kernels(monkeypatch):
    """quant.blocks' act_quant goes through kernel.plan.call: the wrapper runs once per key."""
    calls = []
    real = kernel.quantize_per_token

    def spy(*a):
        calls.append(1)
        return real(*a)
    monkeypatch.setattr(kernel, "quantize_per_token", spy)
    layer = _layer()
    for seed in range(3):
        x = _x(24, 72, seed=seed)
        q, s = qf.act_quant(x, layer.inv_smooth)
        rq, rs = quantize_per_token_ref(x, layer.inv_smooth)
        assert torch.equal(q, rq) and torch.equal(s, rs)
    assert len(calls) == 1


def test_call_with_aliased_operands_is_not_planned():
    """The same tensor as scale and shift: a plan could not tell which operand each launch argument was, so the key
    stays unplanned and a later call with two tensors of those signatures gets its own, correct, result."""
    kf = _kf()
    fn, calls = _spy_fn(kf.norm.layernorm_modulate_quantize)
    x = _x(24, 64).to(torch.bfloat16)
    s1, s2 = _x(2, 64, seed=2).to(torch.bfloat16), _x(2, 64, seed=3).to(torch.bfloat16)
    plan.call(fn, x, s1, s1, 12, None, 1e-6)
    got = plan.call(fn, x, s1, s2, 12, None, 1e-6)
    want = kf.norm.layernorm_modulate_quantize(x, s1, s2, 12, None, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(calls) == 2


def test_call_in_place_with_the_output_passed_as_the_input():
    """Flux's ``x += y * gate`` (``residual_add(x, y, gate, tpb, True, x)``): the same object as x and out is one
    operand, and that aliasing is part of the key. Repeated with new tensors the plan writes the new x in place,
    equal to torch's two ops (independent reference: the product rounded to bf16, then the sum); a call whose out
    is another tensor is another key, with its own result and x left as it was."""
    kf = _kf()
    fn, calls = _spy_fn(kf.residual.residual_add)
    gate = torch.tanh(_x(2, 1, 64, seed=9)).to(torch.bfloat16)
    for seed in range(3):
        x, y = _x(24, 64, seed=seed).to(torch.bfloat16), _x(24, 64, seed=seed + 10).to(torch.bfloat16)
        want = (x.view(2, 12, 64) + y.view(2, 12, 64) * gate).view(24, 64)
        r = plan.call(fn, x, y, gate, 12, True, x)
        assert r is x and torch.equal(x, want), seed
    assert len(calls) == 1  # recorded once, then re-issued in place
    x, y, out = (_x(24, 64, seed=s).to(torch.bfloat16) for s in (20, 21, 22))
    x0 = x.clone()
    r = plan.call(fn, x, y, gate, 12, True, out)
    assert r is out and torch.equal(out, (x.view(2, 12, 64) + y.view(2, 12, 64) * gate).view(24, 64))
    assert torch.equal(x, x0) and len(calls) == 2


def test_call_of_a_kernel_that_returns_nothing():
    """QK RMSNorm + RoPE writes q and k (operands) and returns None: re-issued for new buffers, each equal to the
    wrapper's own result on copies of the same inputs."""
    kf = _kf()
    fn, calls = _spy_fn(kf.rope.qk_norm_rope)
    heads, d, l = 2, 16, 6
    w = (1 + 0.1 * _x(d, seed=3)).to(torch.bfloat16)
    for seed in range(3):
        qkv = _x(1, l, 3 * heads * d, seed=seed).to(torch.bfloat16)
        pe = _x(1, 1, l, d // 2, 2, 2, seed=seed + 5)
        q, k, v = (torch.zeros(1, heads, l, d, dtype=torch.bfloat16) for _ in range(3))
        assert plan.call(fn, qkv, heads, w, w, 1e-6, 1e-6, pe, q, k, v, 0) is None
        rq, rk, rv = (torch.zeros(1, heads, l, d, dtype=torch.bfloat16) for _ in range(3))
        kf.rope.qk_norm_rope(qkv, heads, w, w, 1e-6, 1e-6, pe, rq, rk, rv, 0)
        assert torch.equal(q, rq) and torch.equal(k, rk) and torch.equal(v, rv) and q.any(), seed
    assert len(calls) == 1


def test_a_changed_quantizer_plan_is_not_served_a_stale_plan(monkeypatch):
    """kernel.quantize.QUANT_ONE_PASS and QUANT_ROW_LOOP are part of kernel.ops.tunables() (the key salt of
    quant.blocks' calls): after one changes, act_quant runs the kernel the new plan names, not the launches prepared
    under the old one."""
    from kernel import quantize as kq
    seen, real = [], kq.launch

    def spy(fn, *a, **kw):
        seen.append(fn.__name__)
        return real(fn, *a, **kw)
    monkeypatch.setattr(kq, "launch", spy)
    x = _x(7, 88)  # a shape no other test of this file plans (the memo is per process)
    for _ in range(2):
        qf.act_quant(x, None)
    assert seen == ["_quant_rows_seg_kernel"]  # recorded once, then prepared
    loop = kq.QUANT_ROW_LOOP
    monkeypatch.setattr(kq, "QUANT_ROW_LOOP", 1)  # 7 rows over the interpreter's 4 "SMs": the row loop
    qf.act_quant(x, None)
    assert seen == ["_quant_rows_seg_kernel", "_quant_rows_loop_kernel"]
    monkeypatch.setattr(kq, "QUANT_ROW_LOOP", loop)  # back: the first plan again, prepared
    qf.act_quant(x, None)
    assert seen == ["_quant_rows_seg_kernel", "_quant_rows_loop_kernel"]
    monkeypatch.setattr(kq, "QUANT_ONE_PASS", None)
    q, s = qf.act_quant(x, None)
    assert seen == ["_quant_rows_seg_kernel", "_quant_rows_loop_kernel", "_quant_rows_kernel"]
    rq, rs = quantize_per_token_ref(x, None)
    assert torch.equal(q, rq) and torch.equal(s, rs)


def test_the_gemm_tile_switch_keys_the_prepared_calls():
    """The switch that chooses the GEMMs' tiles (INT8_FUSED_S8_WGMMA) is part of the prepared calls' key salt
    (kernel.ops.tunables()): an A/B row with it changed must not re-issue launches planned under the other value
    (the SwiGLU GEMM planned with the s8 tiles, say)."""
    kf = _kf()
    base = kf.ops.tunables()
    with config.override(INT8_FUSED_S8_WGMMA=not config.get("INT8_FUSED_S8_WGMMA")):
        assert kf.ops.tunables() != base
    assert kf.ops.tunables() == base


def test_a_layer_plans_again_when_the_gemm_switch_changes(monkeypatch):
    """An Int8Linear's own plans (its linear and its fused blocks' GEMMs) are keyed by the GEMM switch too: an A/B
    of it on a loaded model (``kernel.config.override`` around a call) records the switched call instead of re-issuing the other value's
    launches; back to the first value, the first plan runs again."""
    planned, checked = _spy(monkeypatch, "int8_linear_planned"), _spy(monkeypatch, "int8_linear")
    layer = _layer()
    x = _x(24, 72)
    y = layer.int8_call(x)
    assert torch.equal(layer.int8_call(x), y) and len(planned) == 1
    with config.override(INT8_FUSED_S8_WGMMA=not config.get("INT8_FUSED_S8_WGMMA")):
        assert torch.equal(layer.int8_call(x), y) and len(planned) == 2
        assert torch.equal(layer.int8_call(x), y) and len(planned) == 2
    assert torch.equal(layer.int8_call(x), y) and len(planned) == 2 and not checked
    assert len(layer.derived.plans) == 2
