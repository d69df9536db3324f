"""Pad-token elision (adapters/ideogram4/pad_elision.py): which tokens go, when the mask goes, the switch, the wrapper's argument
handling. The model-level check (outputs of a real-width Ideogram 4 equal with and without it) runs on the current
ComfyUI: tests/test_pad_elision_current.py."""
import importlib

import pytest
import torch


@pytest.fixture(scope="module")
def pe(pack):
    return pack.adapters.ideogram4.pad_elision


def _ctx(b, n):
    return torch.arange(b * n * 3, dtype=torch.float32).reshape(b, n, 3)


def test_trailing_padding_of_every_row_goes_and_the_mask_with_it(pe):
    ctx = _ctx(2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]])
    c, m, n = pe.strip_trailing_padding(ctx, mask)
    assert n == 2 and m is None and torch.equal(c, ctx[:, :4])


def test_rows_padded_to_different_lengths_keep_the_rest_masked(pe):
    ctx = _ctx(2, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    c, m, n = pe.strip_trailing_padding(ctx, mask)
    assert n == 1 and torch.equal(c, ctx[:, :5]) and torch.equal(m, mask[:, :5])


def test_padding_that_is_not_at_the_end_stays(pe):
    """Left or interior padding: removing it would move the kept tokens' RoPE positions (arange(L_text))."""
    ctx = _ctx(1, 5)
    for mask in (torch.tensor([[0., 0., 1., 1., 1.]]), torch.tensor([[1., 0., 1., 1., 1.]])):
        c, m, n = pe.strip_trailing_padding(ctx, mask)
        assert n == 0 and c is ctx and m is mask


def test_all_ones_mask_goes_all_padding_and_odd_shapes_stay(pe):
    ctx = _ctx(1, 4)
    c, m, n = pe.strip_trailing_padding(ctx, torch.ones(1, 4))
    assert (n, m) == (0, None) and c is ctx
    zeros = torch.zeros(1, 4)
    assert pe.strip_trailing_padding(ctx, zeros)[1] is zeros  # nothing but padding: left to the model
    for mask in (None, torch.ones(1, 1, 4), torch.ones(1, 5)):
        assert pe.strip_trailing_padding(ctx, mask) == (ctx, mask, 0)
    assert pe.strip_trailing_padding(None, torch.ones(1, 4))[2] == 0


def test_switch(pack):
    """INT8_FUSED_PAD_ELISION, set through the pack's config (switches are read once: kernel/config.py)."""
    config = importlib.import_module(pack.__name__ + ".kernel.config")
    on = pack.adapters.pad_elision_enabled  # the switch of every adapter's pad_elision_wrapper
    with config.override(INT8_FUSED_PAD_ELISION=None):
        assert on("fused_triton") and not on("torch_int_mm") and not on("bf16")
    with config.override(INT8_FUSED_PAD_ELISION="0"):
        assert not on("fused_triton")
    with config.override(INT8_FUSED_PAD_ELISION="1"):
        assert on("bf16") and on("dequant_bf16")
    with config.override(INT8_FUSED_PAD_ELISION="maybe"):  # warned (naming the switch) by config: the default
        assert on("fused_triton") and not on("torch_int_mm")


class Ideogram4Transformer2DModel:  # the pinned ComfyUI has no comfy.ldm.ideogram4: recognised by class name
    pass


class _Executor:
    def __init__(self, obj):
        self.class_obj, self.seen = obj, None

    def __call__(self, *args, **kwargs):
        self.seen = (args, kwargs)
        return "out"


def test_wrapper_rewrites_positional_and_keyword_arguments_of_ideogram4_only(pack):
    wrapper = pack.adapters.ideogram4.diffusion_model_wrapper  # the Ideogram 4 adapter's, on its pad_elision.py
    ctx, mask, to = _ctx(1, 6), torch.tensor([[1, 1, 1, 0, 0, 0]]), {"x": 1}
    ex = _Executor(Ideogram4Transformer2DModel())
    assert wrapper(ex, "x", "t", ctx, mask, to, extra=2) == "out"
    args, kwargs = ex.seen
    assert args[:2] == ("x", "t") and torch.equal(args[2], ctx[:, :3]) and args[3] is None and args[4] is to
    assert kwargs == {"extra": 2}
    wrapper(ex, "x", "t", context=ctx, attention_mask=mask, transformer_options=to)
    args, kwargs = ex.seen
    assert args == ("x", "t") and torch.equal(kwargs["context"], ctx[:, :3]) and kwargs["attention_mask"] is None
    other = _Executor(object())
    wrapper(other, "x", "t", ctx, mask, to)
    assert other.seen[0][2] is ctx and other.seen[0][3] is mask
