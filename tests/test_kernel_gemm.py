"""Fused INT8 GEMM (CPU, Triton interpreter): int32 accumulator bit-exact, epilogue within fp32 rounding.

Tolerances: the fp32 epilogue rounds acc -> fp32, two products and one add, so each element is within
4 * 2**-24 (< 1e-6) of the float64 reference relative to |acc * a_scale * w_scale| + |bias|; bf16 / fp16
outputs add one final rounding, so they are within half an ulp of the output type (at most 2**-8 / 2**-11
relative; fp16 subnormals: 2**-25 absolute) plus that.

Run: TRITON_INTERPRET=1 python -m pytest tests/test_kernel_gemm.py -q
"""
import json

import pytest
import torch

pytest.importorskip("triton")
import kernel  # noqa: E402
from kernel import autotune  # noqa: E402
from quant.quantize import dequant_epilogue_ref, int8_matmul_ref  # noqa: E402

pytestmark = pytest.mark.interpreter

HALF_ULP = {torch.float32: 1e-6, torch.bfloat16: 2.0 ** -8 + 1e-6, torch.float16: 2.0 ** -11 + 1e-6}


def _i8(*shape):
    return torch.randint(-127, 128, shape, dtype=torch.int8)


def _int_mm_or_ref(a, w):
    ref = int8_matmul_ref(a, w)
    try:  # torch._int_mm on the CPU where it accepts the shape; it must agree with the int64 reference
        mm = torch._int_mm(a, w.t())
        assert torch.equal(mm, ref)
    except RuntimeError:
        pass
    return ref


def _check_epilogue(y, acc, a_s, w_s, bias):
    ref = dequant_epilogue_ref(acc, a_s, w_s, bias)
    mag = acc.double().abs() * a_s.double()[:, None] * w_s.double()[None, :]
    if bias is not None:
        mag = mag + bias.double().abs()[None, :]
    err = (y.double() - ref).abs()
    assert torch.isfinite(y).all(), "unwritten or non-finite output"
    assert (err <= HALF_ULP[y.dtype] * mag + 2.0 ** -25).all(), f"max rel err {(err / mag.clamp_min(1e-30)).max():.3e}"


@pytest.mark.parametrize("m,n,k", [(1, 48, 80), (17, 33, 80), (33, 48, 80), (33, 50, 100), (5, 20, 37),
                                   (64, 64, 64)])
def test_int32_accumulator_bit_exact(m, n, k):
    a, w = _i8(m, k), _i8(n, k)
    out = torch.full((m, n), -12345, dtype=torch.int32)  # poisoned
    acc = kernel.int8_gemm(a, torch.rand(m), w, torch.rand(n), out_int32=True, out=out)
    assert acc is out and torch.equal(acc, _int_mm_or_ref(a, w))


def test_extreme_values_accumulate_exactly():
    a = torch.full((3, 96), -127, dtype=torch.int8)
    w = torch.full((5, 96), 127, dtype=torch.int8)
    w[1] = -127
    acc = kernel.int8_gemm(a, torch.ones(3), w, torch.ones(5), out_int32=True)
    assert torch.equal(acc, int8_matmul_ref(a, w)) and acc[0, 0] == -127 * 127 * 96


@pytest.mark.parametrize("cfg", autotune.interpreter_configs() + [autotune.small_m_configs()[0],
                                                                  autotune.hopper_configs()[0]],
                         ids=lambda c: f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}")
def test_every_config_family_is_exact(cfg):
    from kernel.gemm import launch_int8_gemm
    for m, n, k in [(1, 40, 300), (33, 70, 256)]:   # K tail and EVEN_K (256 % BLOCK_K == 0)
        a, w = _i8(m, k), _i8(n, k)
        out = torch.full((m, n), -1, dtype=torch.int32)
        launch_int8_gemm(a, torch.ones(m), w, torch.ones(n), None, out, cfg)
        assert torch.equal(out, int8_matmul_ref(a, w))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 48, 80), (33, 48, 80), (17, 50, 100)])
def test_epilogue_matches_float64_reference(out_dtype, bias_dtype, m, n, k):
    a, w = _i8(m, k), _i8(n, k)
    a_s, w_s = torch.rand(m) * 0.02 + 1e-4, torch.rand(n) * 0.02 + 1e-4
    bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
    out = torch.full((m, n), float("nan"), dtype=out_dtype)  # poisoned: every element must be written
    y = kernel.int8_gemm(a, a_s, w, w_s, bias, out_dtype=out_dtype, out=out)
    assert y.dtype == out_dtype and y.shape == (m, n)
    _check_epilogue(y, int8_matmul_ref(a, w), a_s, w_s, bias)


def test_non_contiguous_operands():
    m, n, k = 21, 30, 72
    a_big, w_big = _i8(m, 2 * k), _i8(n + 7, k + 16)
    a = a_big[:, ::2]                          # column stride 2
    w = w_big[3:3 + n, 8:8 + k]                # row stride k+16, offset
    a_t = _i8(k, m).t()                        # transposed view: unit row stride
    s_big = torch.rand(2 * m)
    a_s, w_s, bias = s_big[::2], torch.rand(n), torch.randn(3 * n)[::3]
    for aa in (a, a_t):
        acc = kernel.int8_gemm(aa, a_s, w, w_s, out_int32=True)
        assert torch.equal(acc, int8_matmul_ref(aa, w))
        y = kernel.int8_gemm(aa, a_s, w, w_s, bias, out_dtype=torch.float32)
        _check_epilogue(y, acc, a_s, w_s, bias)


def test_nan_scale_row_stays_in_its_row():
    m, n, k = 9, 16, 40
    a, w = _i8(m, k), _i8(n, k)
    a_s = torch.rand(m)
    a_s[4] = float("nan")
    y = kernel.int8_gemm(a, a_s, w, torch.rand(n), out_dtype=torch.float32)
    assert y[4].isnan().all() and torch.isfinite(y[torch.arange(m) != 4]).all()


def test_per_tensor_weight_scale_broadcasts():
    m, n, k = 7, 24, 48
    a, w = _i8(m, k), _i8(n, k)
    a_s = torch.rand(m)
    y = kernel.int8_gemm(a, a_s, w, torch.tensor(0.01), out_dtype=torch.float32)
    _check_epilogue(y, int8_matmul_ref(a, w), a_s, torch.full((n,), 0.01), None)


def test_empty_dimensions():
    assert kernel.int8_gemm(_i8(0, 16), torch.rand(0), _i8(8, 16), torch.rand(8)).shape == (0, 8)
    y = kernel.int8_gemm(_i8(3, 0), torch.rand(3), _i8(4, 0), torch.rand(4), torch.ones(4),
                         out_dtype=torch.float32)
    assert torch.equal(y, torch.ones(3, 4))


@pytest.mark.parametrize("kwargs,match", [
    (dict(a_q=_i8(4, 16), w_q=_i8(8, 24)), "K mismatch"),
    (dict(a_q=torch.randn(4, 16), w_q=_i8(8, 16)), "dtype"),
    (dict(a_q=_i8(4, 16), w_q=_i8(8, 16).t()), "not transposed"),  # a [K, N] weight
    (dict(a_q=_i8(16), w_q=_i8(8, 16)), "2-D"),
    (dict(a_q=_i8(4, 16), w_q=_i8(8, 16), a_scale=torch.rand(5)), r"expected \[4\]"),
    (dict(a_q=_i8(4, 16), w_q=_i8(8, 16), w_scale=torch.rand(7)), r"expected \[8\]"),
    (dict(a_q=_i8(4, 16), w_q=_i8(8, 16), bias=torch.rand(9)), r"expected \[8\]"),
    (dict(a_q=_i8(4, 16), w_q=_i8(8, 16), out_dtype=torch.int8), "out_dtype"),
    (dict(a_q=_i8(4, 16), w_q=_i8(8, 16), out=torch.empty(4, 8)), "out must be"),
])
def test_bad_inputs_raise(kwargs, match):
    a_q, w_q = kwargs.pop("a_q"), kwargs.pop("w_q")
    a_scale = kwargs.pop("a_scale", torch.rand(a_q.shape[0]))
    w_scale = kwargs.pop("w_scale", torch.rand(w_q.shape[0]))
    with pytest.raises(ValueError, match=match):
        kernel.int8_gemm(a_q, a_scale, w_q, w_scale, **kwargs)


# ---------------------------------------------------------------- the tail split (kernel.tailsplit)
@pytest.mark.parametrize("tiles, slots, split, kb, want", [
    (1152, 264, 4, 36, (1056, 2, 18)),   # Ideogram 4 o / w2 at M 4096 on the H200: 96 tail tiles, room for 2 each
    (576, 264, 4, 36, (528, 4, 9)),      # 48 tail tiles: 4 pieces fit (48 * 5 <= 264), 9 K steps each
    (528, 264, 4, 36, (528, 1, 36)),     # no tail: plain
    (144, 264, 4, 416, (144, 1, 416)),   # less than one wave: plain
    (400, 264, 2, 36, (400, 1, 36)),     # 136 tail tiles: no room for 2 pieces each
    (5, 4, 4, 5, (4, 3, 2)),             # 5 K steps in pieces of 2: 3 pieces, none empty
    (5, 4, 8, 1, (5, 1, 1)),             # one K step: nothing to cut
])
def test_tail_layout(tiles, slots, split, kb, want):
    from kernel.tailsplit import tail_layout
    assert tail_layout(tiles, slots, split, kb) == want


@pytest.mark.parametrize("m, n, k, split", [(150, 30, 300, 4), (150, 30, 256, 3), (33, 70, 300, 2),
                                            (150, 60, 40, 4), (160, 30, 70, 2)])
def test_tail_split_is_bit_exact(m, n, k, split):
    """The interpreter runs 4 programs at once (``tailsplit.program_slots``): 5 or 6 tiles of 32 x 32 leave a tail of
    1-2 tiles that run in K pieces (K tails and EVEN_K both); the int32 sum equals torch._int_mm / the int64 reference, the bf16
    epilogue equals the plain kernel's bit for bit, and a second call (counters reset by the first) again."""
    from kernel import gemm, tailsplit
    cfg = autotune.interpreter_configs()[0]
    tiles = -(-m // 32) * -(-n // 32)
    assert tailsplit.tail_layout(tiles, 4, split, -(-k // 32))[1] > 1  # the case does split
    a, w = _i8(m, k), _i8(n, k)
    a_s, w_s, bias = torch.rand(m) * 1e-2, torch.rand(n) * 1e-2, torch.randn(n).to(torch.bfloat16)
    plain = gemm.launch_int8_gemm(a, a_s, w, w_s, bias, torch.empty(m, n, dtype=torch.bfloat16), cfg)
    for _ in range(2):
        out = torch.full((m, n), -1, dtype=torch.int32)
        gemm.launch_int8_gemm(a, a_s, w, w_s, None, out, {**cfg, "SPLIT": split})
        assert torch.equal(out, _int_mm_or_ref(a, w))
        y = gemm.launch_int8_gemm(a, a_s, w, w_s, bias, torch.full((m, n), float("nan"), dtype=torch.bfloat16),
                                  {**cfg, "SPLIT": split})
        assert torch.equal(y, plain)
        assert all(not c.any() for _, c in tailsplit._SCRATCH.values())  # every counter back at 0


def test_choose_split_times_once_and_keeps_a_margin(tmp_path):
    """``choose_split`` with a fake clock: whole tiles win unless a split is SPLIT_MARGIN faster; the decision is
    kept in the cache (per N, K, M bucket and row tiles) and not timed again; no tail: nothing timed."""
    from kernel import tailsplit
    cfg = autotune.hopper_configs()[0]                # 128 x 128 tiles
    times = {1: 1.0, 2: 0.99, 3: 0.95, 4: 0.97}       # SPLIT 3 is 5 % faster; SPLIT 2 within the margin
    timed = []

    def clock(c):
        timed.append(c.get("SPLIT", 1))
        return times[c.get("SPLIT", 1)]
    cache = autotune.ConfigCache(tmp_path / "gemm.json")
    # M 4608 x N 12288: 36 x 96 = 3456 tiles on 264 slots, a tail of 24: 2, 3 and 4 pieces all fit
    got = tailsplit.choose_split(cfg, 4608, 12288, 4608, 264, cache, clock)
    r = tailsplit.SPLIT_ROUNDS
    assert got == {**cfg, "SPLIT": 3} and timed == [1, 2, 3, 4] * r  # interleaved rounds
    # the same row tiles: the kept decision
    assert tailsplit.choose_split(cfg, 4500, 12288, 4608, 264, cache, clock) == got and len(timed) == 4 * r
    # M 4736: 37 row tiles, 3552 tiles, a tail of 120: room for 2 pieces only, 1 % faster is within the margin
    assert tailsplit.choose_split(cfg, 4736, 12288, 4608, 264, cache, clock) == cfg and timed[4 * r:] == [1, 2] * r
    assert tailsplit.choose_split(cfg, 1408, 12288, 4608, 264, cache, clock) == cfg and len(timed) == 6 * r  # no tail
    data = json.loads((tmp_path / "gemm.json").read_text())["configs"]
    assert data["N12288_K4608_M8192_T36_split"] == {"SPLIT": 3} and data["N12288_K4608_M8192_T37_split"] == {"SPLIT": 1}


def test_choose_split_takes_medians_of_interleaved_rounds(tmp_path):
    """One slow timing of whole tiles (the clock dropping during it, as on the H200 in run bt) does not make a split
    look faster: the medians of the rounds decide; a split that fails to build is dropped, not chosen."""
    from kernel import tailsplit
    cfg = autotune.hopper_configs()[0]
    plain = iter([1.07, 1.0, 1.0])                  # the first round's whole-tile timing 7 % slow

    def clock(c):
        s = c.get("SPLIT", 1)
        if s == 4:
            raise RuntimeError("out of resources")
        return next(plain) if s == 1 else {2: 0.995, 3: 0.99}[s]
    cache = autotune.ConfigCache(tmp_path / "gemm.json")
    assert tailsplit.choose_split(cfg, 4608, 12288, 4608, 264, cache, clock) == cfg  # 0.99 vs median 1.0: within 2 %
    plain = iter([1.0, 1.07, 1.07])                 # whole tiles really slower in most rounds: SPLIT 3 wins
    assert tailsplit.choose_split(cfg, 4608, 12288, 4608, 264, autotune.ConfigCache(tmp_path / "b.json"),
                             clock) == {**cfg, "SPLIT": 3}


def test_plan_keeps_the_tail_split_scratch(monkeypatch):
    """A plan of a split GEMM keeps the scratch its launch used (``launch.keep``) and repeats the call bit for bit."""
    from kernel import gemm, tailsplit
    cfg = {**autotune.interpreter_configs()[0], "SPLIT": 2}
    monkeypatch.setattr(gemm, "select_config", lambda *a, **kw: cfg)
    m, n, k = 150, 30, 300
    w, w_s = _i8(n, k), torch.rand(n)
    out, p = kernel.int8_gemm_planned(_i8(m, k), torch.rand(m), w, w_s, None, torch.float32)
    assert p is not None
    part = tailsplit._SCRATCH[(None, 0)][0]
    assert any(t is part for st in p._steps for t in st[2])  # the recorded launch's scratch, held by the plan
    a2, s2 = _i8(m, k), torch.rand(m)
    y = p(a2, s2, w, w_s, None)
    _check_epilogue(y, int8_matmul_ref(a2, w), s2, w_s, None)
    assert torch.equal(y, kernel.int8_gemm(a2, s2, w, w_s, out_dtype=torch.float32))


def test_slots_from_the_device_properties(monkeypatch):
    """Programs a GPU runs at once, from its properties (values by hand): the H200's 233,472 bytes of shared memory an
    SM hold two 96 KB stages + 1 KB reserved of the 128 x 128 x 128 x 3 tile, its 65,536 registers two 8-warp CTAs at
    128 a thread; the 4-stage 128 KB tile fits once. Properties an older torch lacks: one CTA an SM, no error."""
    import types
    from kernel import tailsplit
    h200 = types.SimpleNamespace(multi_processor_count=132, shared_memory_per_multiprocessor=233472,
                                 regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048)
    old = types.SimpleNamespace(multi_processor_count=82)
    props = {0: h200, 1: old}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props[torch.device(d).index])
    monkeypatch.setattr(tailsplit, "_SLOTS", {})
    three, four = autotune.hopper_configs()[0], dict(autotune.hopper_configs()[0], num_stages=4)
    assert tailsplit.program_slots(three, torch.device("cuda", 0)) == 264
    assert tailsplit.program_slots(four, torch.device("cuda", 0)) == 132
    assert tailsplit.program_slots(three, torch.device("cuda", 1)) == 82
    assert tailsplit.program_slots(three, torch.device("cpu")) == 4


def test_select_config_on_a_gpu_tunes_tiles_then_the_split(monkeypatch, tmp_path, first_call_tuning):
    """``select_config``'s GPU path with a stand-in GPU (H200 properties, a fake clock in place of do_bench, the
    launches recorded instead of run): the tile config is timed once per (N, K, M bucket), the tail split once per
    row tiles (Ideogram 4's w2 at M 4096: a tail of 96 tiles, room for 2 pieces: SPLIT 2 timed 5 % faster is kept);
    the SwiGLU caller (``tail_split=False``) gets the tile config alone; a second process (new memo, same file)
    times nothing."""
    import types

    import triton
    from kernel import config, gemm, tailsplit
    h200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                                 shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472,
                                 regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: h200)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    for memo in ("_TUNED", "_CACHES"):
        monkeypatch.setattr(gemm, memo, {})
    monkeypatch.setattr(tailsplit, "_SLOTS", {})
    best = autotune.hopper_configs()[0]
    timed = []

    def launch(a_q, a_scale, w_q, w_scale, bias, out, cfg):  # what the timed lambda would launch
        timed.append(cfg)

    def do_bench(fn, **kw):
        fn()
        c = timed[-1]
        tile = {x: c[x] for x in best}
        return (1.0 if tile == best else 1.5) * (0.95 if c.get("SPLIT") == 2 else 1.0)
    monkeypatch.setattr(gemm, "launch_int8_gemm", launch)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    cuda = torch.device("cuda", 0)
    a_q = types.SimpleNamespace(shape=(4096, 12288), device=cuda)
    w_q = types.SimpleNamespace(shape=(4608, 12288))
    with config.override(INT8_FUSED_CACHE_DIR=str(tmp_path)):
        cfg = gemm.select_config(a_q, None, w_q, None, None, object())
        n_cands = len(autotune.candidates((9, 0), 232448, 4096))
        n_split = 2 * tailsplit.SPLIT_ROUNDS
        assert cfg == {**best, "SPLIT": 2} and len(timed) == n_cands + n_split  # every tile, then plain vs SPLIT 2
        assert gemm.select_config(a_q, None, w_q, None, None, object()) is cfg and len(timed) == n_cands + n_split
        assert gemm.select_config(a_q, None, w_q, None, None, object(), tail_split=False) == best
        assert len(timed) == n_cands + n_split
        monkeypatch.setattr(gemm, "_TUNED", {})
        monkeypatch.setattr(gemm, "_CACHES", {})
        assert gemm.select_config(a_q, None, w_q, None, None, object()) == {**best, "SPLIT": 2}
        assert len(timed) == n_cands + n_split  # read from the file

