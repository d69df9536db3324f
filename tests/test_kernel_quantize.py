"""Per-token quantization kernel vs quant.quantize.quantize_per_token_ref, bit for bit (CPU, Triton interpreter).

Run: TRITON_INTERPRET=1 python -m pytest tests/test_kernel_quantize.py -q
"""
import pytest
import torch

pytest.importorskip("triton")
import kernel  # noqa: E402
from quant.quantize import quantize_per_token_ref  # noqa: E402

pytestmark = pytest.mark.interpreter


def _assert_same(x, inv=None):
    q, s = kernel.quantize_per_token(x, inv)
    qr, sr = quantize_per_token_ref(x, inv)
    assert q.dtype == torch.int8 and q.is_contiguous() and s.dtype == torch.float32
    assert torch.equal(q, qr), f"{(q != qr).sum().item()} quantized values differ"
    assert torch.equal(s.isnan(), sr.isnan())
    assert torch.equal(s.nan_to_num(-1.0), sr.nan_to_num(-1.0)), "scales differ"
    return q, s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 48), (17, 80), (33, 300)])
@pytest.mark.parametrize("smooth", [False, True])
def test_bit_exact_random(dtype, m, k, smooth):
    x = (torch.randn(m, k) * torch.rand(m, 1) * 8).to(dtype)
    inv = (torch.rand(k) + 0.25) if smooth else None
    _assert_same(x, inv)


def _rows_where_one_division_differs(n_rows=6):
    """Rows [absmax, v] for which rint(v * 127/absmax) changes if 127/absmax were one IEEE division instead of
    torch's reciprocal-then-multiply (two roundings) — random data almost never lands on such a boundary."""
    g = torch.Generator().manual_seed(3)
    rows = []
    while len(rows) < n_rows:
        a = (torch.rand(1, generator=g) * 100 + 1).float()
        m_torch = 127.0 / a                                    # reciprocal * 127
        m_ieee = torch.tensor([127.0], dtype=torch.float64).div(a.double()).float()  # one rounding
        if torch.equal(m_torch, m_ieee):
            continue
        for j in range(1, 126):
            v = torch.tensor([(j + 0.5) / m_ieee.item()], dtype=torch.float32)
            for c in (torch.nextafter(v, -v.abs() - 1), v, torch.nextafter(v, v.abs() + 1)):
                if torch.round(c * m_torch) != torch.round(c * m_ieee):
                    rows.append(torch.cat([a, c]))
                    break
            if len(rows) and rows[-1][0] == a[0]:
                break
    return torch.stack(rows)


def test_multiplier_rounds_like_torch_reciprocal():
    x = _rows_where_one_division_differs()
    _assert_same(x)


def test_long_rows_loop_over_k():
    _assert_same(torch.randn(2, 53248, dtype=torch.bfloat16))           # text projection K, chunked
    _assert_same(torch.randn(3, 8200) * 3, torch.rand(8200) + 0.5)      # just past one chunk, ragged tail


def test_non_contiguous_inputs():
    base = torch.randn(40, 96, dtype=torch.bfloat16)
    _assert_same(base[::2, 5:85])                        # row stride 192, column offset
    _assert_same(torch.randn(64, 24).t())                # transposed view: unit row stride
    inv = torch.rand(2 * 80)[::2] + 0.5                  # strided smoothing vector
    _assert_same(base[:17, :80], inv)


def _kernels_launched(monkeypatch):
    """Names of the kernels kernel/quantize.py launches (and their segment widths), in order."""
    from kernel import quantize as kq
    seen, real = [], kq.launch

    def spy(fn, grid, args, constexprs, *rest):
        seen.append((fn.__name__, tuple(constexprs.get(s) for s in ("S0", "S1", "S2"))))
        return real(fn, grid, args, constexprs, *rest)
    monkeypatch.setattr(kq, "launch", spy)
    return seen


@pytest.mark.parametrize("k,segs", [(4608, (4096, 512, 0)), (12288, (8192, 4096, 0)), (100, (64, 32, 16)),
                                    (70, (64, 16, 0)), (8200, (8192, 16, 0))])
@pytest.mark.parametrize("smooth", [False, True])
def test_one_pass_segments(monkeypatch, k, segs, smooth):
    """Unit-stride rows up to QUANT_ONE_PASS.max_row take the one-pass kernel over power-of-2 segments (16-wide
    minimum here, so 100 and 70 need a partial last segment); bit for bit the reference, zero, NaN and Inf rows
    included, as the BLOCK_K kernel is without the plan."""
    from kernel import quantize as kq
    monkeypatch.setattr(kq, "QUANT_ONE_PASS", kq.SegmentPlan(max_row=16384, min_seg=16, warps=8))
    seen = _kernels_launched(monkeypatch)
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(5, k, generator=g) * torch.rand(5, 1, generator=g) * 8).to(torch.bfloat16)
    x[1] = 0
    x[3, k - 1] = float("nan")
    x[4, k // 3] = float("-inf")
    inv = (torch.rand(k, generator=g) + 0.25) if smooth else None
    q, s = _assert_same(x, inv)
    assert seen == [("_quant_rows_seg_kernel", segs)]
    assert s[1] == 0 and s[3].isnan() and s[4].isnan() and not q[[1, 3, 4]].any()
    # the row loop: 4 programs (the interpreter's "SM count" of kernel.quantize.sm_count) over 11 rows, each
    # issuing its next row's loads before storing the current one: the same codes and scales
    monkeypatch.setattr(kq, "QUANT_ROW_LOOP", 1)
    x11 = torch.cat([x, (torch.randn(6, k, generator=g) * 3).to(torch.bfloat16)])
    seen.clear()
    q11, s11 = _assert_same(x11, inv)
    assert seen == [("_quant_rows_loop_kernel", segs)] and torch.equal(q11[:5], q)
    seen.clear()
    _assert_same(x11[:4], inv)  # no more rows than programs: a program a row
    assert seen == [("_quant_rows_seg_kernel", segs)]
    monkeypatch.setattr(kq, "QUANT_ROW_LOOP", 0)
    monkeypatch.setattr(kq, "QUANT_ONE_PASS", None)
    q2, s2 = _assert_same(x, inv)
    assert seen[1][0] == "_quant_rows_kernel" and torch.equal(q, q2)


def test_strided_and_long_rows_take_the_block_kernel(monkeypatch):
    """A column stride (no vector loads) or a row above QUANT_ONE_PASS.max_row runs the BLOCK_K kernel."""
    seen = _kernels_launched(monkeypatch)
    _assert_same(torch.randn(64, 24).t())                       # column stride 24
    _assert_same(torch.randn(2, 16385, dtype=torch.bfloat16))   # one element past max_row: two passes
    assert [n for n, _ in seen] == ["_quant_rows_kernel", "_quant_rows_kernel"]


def test_zero_rows_give_zero_scale_and_zeros():
    x = torch.randn(6, 50)
    x[2] = 0
    x[4] = -0.0
    q, s = _assert_same(x)
    assert s[2] == 0 and s[4] == 0 and not s.isnan().any()
    assert (q[2] == 0).all() and (q[4] == 0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rows_are_nan_scale_and_zeros(bad):
    x = torch.randn(5, 70, dtype=torch.bfloat16)
    x[1, 33] = bad
    q, s = _assert_same(x)
    assert s[1].isnan() and (q[1] == 0).all()
    assert torch.isfinite(s[[0, 2, 3, 4]]).all() and (s[[0, 2, 3, 4]] > 0).all()


def test_smoothing_overflow_to_inf_is_non_finite():
    x = torch.full((2, 16), 3e38)
    x[1] = 1.0
    q, s = _assert_same(x, torch.full((16,), 4.0))      # 3e38 * 4 overflows fp32 -> that row is NaN
    assert s[0].isnan() and s[1] > 0


def test_round_half_to_even_ties():
    # absmax 127 makes the multiplier exactly 1.0, so x itself is rounded: exact .5 ties
    row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -125.5, 3.5, 4.5, 0.0])
    q, s = _assert_same(row[None, :].repeat(3, 1))
    assert q[0].tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -126, 4, 4, 0]
    # the same ties reached through the SmoothQuant multiplier (x * 0.5) and in bf16 input
    q2, _ = _assert_same((row * 2)[None, :].to(torch.bfloat16), torch.full((12,), 0.5))
    assert q2[0].tolist() == q[0].tolist()


def test_clamped_to_127():
    x = torch.randn(4, 33) * 100
    q, _ = _assert_same(x)
    assert q.abs().max() <= 127 and (q == -128).sum() == 0


def test_empty_and_degenerate_shapes():
    q, s = kernel.quantize_per_token(torch.randn(0, 64))
    assert q.shape == (0, 64) and s.shape == (0,)
    q, s = kernel.quantize_per_token(torch.randn(3, 0))
    assert q.shape == (3, 0) and torch.equal(s, torch.zeros(3))


@pytest.mark.parametrize("args,match", [
    ((torch.randn(8),), "2-D"),
    ((torch.randint(-5, 5, (4, 8)),), "dtype"),
    ((torch.randn(4, 8), torch.rand(7)), r"expected \[8\]"),
    ((torch.randn(4, 8), torch.randint(1, 3, (8,))), "float tensor"),
])
def test_bad_inputs_raise(args, match):
    with pytest.raises(ValueError, match=match):
        kernel.quantize_per_token(*args)


def test_triton_status_on_cpu_under_interpreter():
    ok, reason = kernel.triton_status(torch.device("cpu"))
    assert ok and "interpreter" in reason


def test_segment_widths_and_warps():
    """The default plan's segments and warps, derived by hand: powers of 2 largest first, one warp per 1024
    elements rounded down to a power of 2 (at least 4, at most 8); rows past max_row get none."""
    from kernel import quantize as kq
    plan = kq.QUANT_ONE_PASS
    assert kq.segments(4608, plan) == (4096, 512, 0) and kq.seg_warps((4096, 512, 0), plan) == 4
    assert kq.segments(12288, plan) == (8192, 4096, 0) and kq.seg_warps((8192, 4096, 0), plan) == 8
    assert kq.segments(13824, plan) == (8192, 4096, 2048) and kq.seg_warps((8192, 4096, 2048), plan) == 8
    assert kq.segments(64, plan) == (256, 0, 0) and kq.seg_warps((256, 0, 0), plan) == 4
    assert kq.segments(16385, plan) is None and kq.segments(0, plan) is None and kq.segments(100, None) is None


def test_segment_plan_min_row():
    """A plan's ``min_row``: shorter rows get no segments (their kernel's other form runs). The residual tails'
    default plan segments only rows whose one tile would be 8192 wide (Wan 14B's 5120 = 4096 + 1024, 4 warps);
    Wan 1.3B's 1536 and Flux's 3072 keep their one tile (kernel/residual.py RESIDUAL_LN_ONE_PASS)."""
    from kernel import quantize as kq
    from kernel import residual
    plan = kq.SegmentPlan(max_row=8192, min_seg=256, warps=4, min_row=4097)
    assert kq.segments(4096, plan) is None and kq.segments(4097, plan) == (4096, 256, 0)
    assert kq.segments(8192, plan) == (8192, 0, 0) and kq.segments(8193, plan) is None
    res = residual.RESIDUAL_LN_ONE_PASS
    assert kq.segments(1536, res) is None and kq.segments(3072, res) is None
    assert kq.segments(5120, res) == (4096, 1024, 0) and kq.seg_warps((4096, 1024, 0), res) == 4
