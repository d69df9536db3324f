"""kernel/quantize.py's patches of Triton's CPU interpreter (``interpreter_compat``, only under TRITON_INTERPRET=1):
the dtype table built once and the shape tuples' types built when read compute what Triton's own code computes,
and the pack's kernels give the same bits with and without them."""
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.interpreter


def _interp():
    import triton.runtime.interpreter as interp

    from kernel import quantize  # noqa: F401 - importing the kernels puts the patches in force
    return interp


def test_patches_are_in_force_under_the_interpreter():
    from triton.language import core

    from kernel import quantize
    assert quantize.INTERPRET
    assert getattr(_interp()._get_np_dtype, "_int8_fused_compat", False)
    assert isinstance(core.tuple.__dict__.get("type"), quantize._TupleTypeWhenRead)


def test_dtype_table_gives_what_the_original_gives():
    import triton.language as tl
    patched = _interp()._get_np_dtype
    original = patched.original
    scalars = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
               tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv,
               tl.float8e4b8, tl.float8e4b15]
    kinds = scalars + [tl.pointer_type(t) for t in scalars] + [tl.block_type(t, [16, 4]) for t in scalars] + \
        [tl.block_type(tl.pointer_type(t), [8]) for t in scalars]
    for t in kinds:
        got, want = patched(t), original(t)
        assert isinstance(got, np.dtype) and got == want, (t, got, want)
    for t in (tl.void, tl.block_type(tl.void, [4])):   # not in Triton's table: both refuse it alike
        with pytest.raises(KeyError):
            original(t)
        with pytest.raises(KeyError):
            patched(t)


def test_tuple_type_when_read_equals_the_eager_type():
    _interp()
    import triton.language as tl
    from triton.language import core
    values = [tl.constexpr(16), tl.constexpr(4)]
    t = core.tuple(values)
    assert "type" not in t.__dict__                         # not built yet
    eager = core._type_for_tuple_values(values)
    assert t.type == eager and str(t.type) == str(eager) == "[:constexpr_type[16],:constexpr_type[4]]"
    assert t.type is t.type                                 # built once
    mixed = [3, 2.5, tl.float32]
    assert core.tuple(mixed).type == core._type_for_tuple_values(mixed)
    given = core.tuple_type([tl.int32, tl.float32], ["a", "b"])
    kept = core.tuple([1, 2], given)
    assert kept.type is given                               # an explicit type is kept as given
    as_list = core.tuple([1, 2], [tl.int32, tl.int8])
    assert as_list.type == core.tuple_type([tl.int32, tl.int8])
    t.type = given                                          # an assignment wins
    assert t.type is given


def _kernels_once():
    from kernel import norm
    from kernel.linear import quantize_per_token
    g = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(9, 320, generator=g)).to(torch.bfloat16)
    x[2, 5] = float("nan")
    q, s = quantize_per_token(x, None)
    w = (1 + 0.1 * torch.randn(320, generator=g)).to(torch.bfloat16)
    sc = (1 + 0.2 * torch.randn(3, 320, generator=g)).to(torch.bfloat16)
    q2, s2 = norm.rmsnorm_modulate_quantize(x, w, 1e-6, sc, 3)
    return [q, s, q2, s2]


def test_kernels_give_the_same_bits_without_the_patches():
    from triton.language import core

    from kernel import quantize
    interp = _interp()
    fast = _kernels_once()
    patched_np, patched_init = interp._get_np_dtype, core.tuple.__init__
    try:
        interp._get_np_dtype = patched_np.original
        core.tuple.__init__ = patched_init.original
        del core.tuple.type
        assert "type" not in core.tuple.__dict__
        plain = _kernels_once()
    finally:
        quantize._np_dtype_once(interp)
        quantize._tuple_type_when_read()
    assert getattr(interp._get_np_dtype, "_int8_fused_compat", False)
    assert isinstance(core.tuple.__dict__.get("type"), quantize._TupleTypeWhenRead)
    assert len(fast) == len(plain) == 4
    for a, b in zip(fast, plain):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.int8 else a.view(torch.int32),
                           b.view(torch.uint8) if b.dtype == torch.int8 else b.view(torch.int32))
