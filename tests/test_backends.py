"""Backend registry: the backends agree to rounding on the same int8 operands; constraints, fallbacks,
the comfy_kitchen probe, and quant.patch.build_int8_layers (keep-float, calibration, one-line summary).

"Agree to rounding": every backend quantizes the activation with the same rule, so they multiply the
same int8 operands. torch_int_mm and fused_triton accumulate exactly in int32 and apply the same fp32
epilogue (differences: fp32 operation order, <= a few ulp); dequant_bf16 multiplies the dequantized
values in float — for fp32 inputs its error is the fp32 matmul rounding, <= K * 2^-24 * sum|a||w|
per element. For bf16 outputs all of them round the same fp32 value once: <= 1 bf16 ulp apart.
"""
import logging
import sys
import types

import pytest
import torch

from quant import backends
from quant.linear import Int8Linear
from quant.patch import build_int8_layers
from quant.quantize import dequantize, quantize_per_token_ref

CPU = torch.device("cpu")


def _triton_runs() -> bool:
    try:
        import kernel
        return hasattr(kernel, "int8_linear") and kernel.triton_status(CPU)[0]
    except Exception:
        return False


needs_triton = pytest.mark.skipif(not _triton_runs(), reason="fused_triton needs the pack's kernel and "
                                  "TRITON_INTERPRET=1 on CPU (run: TRITON_INTERPRET=1 pytest ...)")


def _layer(N, K, bias, smooth, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if bias else None
    s = torch.rand(K, generator=g) + 0.5 if smooth else None
    return Int8Linear.from_float(w, b, smooth=s)


def _run(layer, name, x):
    layer.backend = name
    return layer(x)


def _abs_dot_bound(x, layer):
    """sum_k |a_mk| |w_nk| of the dequantized operands: scale of fp32 matmul rounding."""
    a_q, a_s = quantize_per_token_ref(x, layer.inv_smooth)
    return dequantize(a_q, a_s).abs() @ dequantize(layer.qweight, layer.weight_scale).abs().t()


@pytest.mark.parametrize("M,N,K", [(1, 32, 64), (17, 48, 40), (33, 24, 136)])
@pytest.mark.parametrize("bias,smooth", [(True, False), (False, True)])
def test_int_mm_and_dequant_agree_to_rounding(M, N, K, bias, smooth):
    layer = _layer(N, K, bias, smooth)
    x = torch.randn(M, K)
    a = _run(layer, "torch_int_mm", x)
    d = _run(layer, "dequant_bf16", x)
    tol = K * 2.0 ** -24 * _abs_dot_bound(x, layer) + 1e-6
    assert ((a - d).abs() <= tol).all()
    xb = x.bfloat16()
    ab, db = _run(layer, "torch_int_mm", xb), _run(layer, "dequant_bf16", xb)
    assert ab.dtype == db.dtype == torch.bfloat16
    # dequant_bf16 casts its dequantized operands to bf16 (the baseline's precision): 2^-8 relative each
    tol_b = 2 * 2.0 ** -8 * _abs_dot_bound(xb, layer) + ab.float().abs() * 2.0 ** -7
    assert ((ab.float() - db.float()).abs() <= tol_b).all()


@needs_triton
@pytest.mark.parametrize("M,N,K", [(1, 32, 64), (17, 48, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_triton_agrees_with_torch_int_mm(M, N, K, dtype):
    layer = _layer(N, K, bias=True, smooth=True)
    x = torch.randn(M, K).to(dtype)
    f = _run(layer, "fused_triton", x)
    t = _run(layer, "torch_int_mm", x)
    assert f.dtype == dtype and f.shape == (M, N)
    if dtype == torch.float32:
        torch.testing.assert_close(f, t, rtol=4 * 2.0 ** -24, atol=1e-6)
    else:  # both round one fp32 value to bf16: at most one ulp apart
        assert ((f.float() - t.float()).abs() <= t.float().abs() * 2.0 ** -7 + 1e-6).all()
    d = _run(layer, "dequant_bf16", x.float())
    assert ((f.float() - d).abs() <= d.abs() * 2.0 ** -7 + K * 2.0 ** -22 * _abs_dot_bound(x.float(), layer)
            + 1e-5).all()


def test_available_on_cpu_lists_runnable_default_first():
    names = backends.available(CPU)
    assert "bf16" in names and "dequant_bf16" in names and "torch_int_mm" in names
    assert "fp8_rowwise" not in names
    assert names.index("torch_int_mm") < names.index("dequant_bf16") < names.index("bf16")
    assert backends.default_backend(CPU) == names[0] != "bf16"
    assert backends.device_reasons(CPU)["fp8_rowwise"] == "FP8 tensor cores need a CUDA GPU"


def test_resolve_walks_fallbacks_with_reasons():
    assert backends.resolve("torch_int_mm", CPU, 64, 64) == ("torch_int_mm", None)
    used, why = backends.resolve("torch_int_mm", CPU, 64, 60)
    assert used == "dequant_bf16" and "K divisible by 8" in why and "K=60" in why
    used, why = backends.resolve("fp8_rowwise", CPU, 64, 64)
    assert used == "dequant_bf16" and "CUDA" in why
    with pytest.raises(ValueError, match="unknown INT8 backend 'int4'; known: fused_triton"):
        backends.resolve("int4", CPU, 64, 64)


@pytest.fixture
def fresh_kitchen(monkeypatch):
    monkeypatch.setattr(backends, "_KITCHEN_OK", {})
    yield
    backends._KITCHEN_OK.clear()


def _fake_kitchen(per_channel: bool):
    """A stand-in comfy_kitchen: int8_linear with per-row activation quantization (its documented
    contract); ``per_channel=False`` models a version that only takes one per-tensor scale."""
    def int8_linear(x, weight, weight_scale, bias=None, out_dtype=None, **_):
        a_q, a_s = quantize_per_token_ref(x.float())
        ws = weight_scale.float() if per_channel else weight_scale.float().reshape(-1)[0]
        y = (a_q.float() @ weight.float().t()) * a_s[:, None] * ws
        y = y if bias is None else y + bias.float()
        return y.to(out_dtype or torch.bfloat16)
    return types.SimpleNamespace(int8_linear=int8_linear)


def test_comfy_kitchen_unavailable_with_reason(monkeypatch, fresh_kitchen):
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)  # import raises ImportError
    why = backends.device_reasons(CPU)["comfy_kitchen"]
    assert why.startswith("comfy_kitchen is not importable") and "pip install comfy-kitchen" in why
    assert "comfy_kitchen" not in backends.available(CPU)


def test_comfy_kitchen_available_when_importable_and_correct(monkeypatch, fresh_kitchen):
    monkeypatch.setitem(sys.modules, "comfy_kitchen", _fake_kitchen(per_channel=True))
    assert backends.device_reasons(CPU)["comfy_kitchen"] is None
    assert "comfy_kitchen" in backends.available(CPU)
    layer = _layer(32, 64, bias=True, smooth=True)
    x = torch.randn(5, 64)
    k = _run(layer, "comfy_kitchen", x)
    ref = _run(layer, "torch_int_mm", x)
    # smoothing is applied before kitchen sees x (one fp32 rounding), so compare at W8A8 level
    assert ((k - ref).norm() / ref.norm()) < 2e-2


def test_comfy_kitchen_rejected_when_it_ignores_per_channel_scales(monkeypatch, fresh_kitchen):
    monkeypatch.setitem(sys.modules, "comfy_kitchen", _fake_kitchen(per_channel=False))
    why = backends.device_reasons(CPU)["comfy_kitchen"]
    assert why is not None and "per-channel" in why
    assert backends.resolve("comfy_kitchen", CPU, 64, 64)[0] == "torch_int_mm"


# --------------------------------------------------------------------------- build_int8_layers
class _Entry:
    def __init__(self, smooth=None, protected=False):
        self.smooth, self.protected = smooth, protected


class _Calibration:
    """Duck-typed INT8_CALIBRATION: for_layer(name, N, K) -> None | entry, ValueError on shape."""

    def __init__(self, layers):
        self.layers = layers

    def for_layer(self, name, n, k):
        e = self.layers.get(name)
        if e is not None and e.smooth is not None and e.smooth.numel() != k:
            raise ValueError(f"calibration for {name} has K={e.smooth.numel()}, the layer has K={k}")
        return e


def _linears():
    torch.manual_seed(0)
    return [("blocks.0.qkv", torch.nn.Linear(64, 192)), ("blocks.0.out", torch.nn.Linear(64, 64)),
            ("blocks.0.odd", torch.nn.Linear(60, 64)), ("blocks.1.qkv", torch.nn.Linear(64, 192))]


def test_build_int8_layers_keep_float_calibration_fallback_summary(caplog):
    lin = _linears()
    cal = _Calibration({"blocks.0.qkv": _Entry(smooth=torch.rand(64) + 0.5),
                        "blocks.0.out": _Entry(protected=True)})
    with caplog.at_level(logging.WARNING, logger="int8_fused"):
        layers, rep = build_int8_layers(lin, "torch_int_mm", calibration=cal, keep_float=[r"blocks\.1\."])
    assert set(layers) == {"blocks.0.qkv", "blocks.0.odd"}
    assert rep.kept_float == {"blocks.0.out": "protected by calibration", "blocks.1.qkv": "keep_float pattern"}
    assert layers["blocks.0.qkv"].smooth is not None and rep.smoothed == 1
    assert layers["blocks.0.odd"].backend == "dequant_bf16" and layers["blocks.0.qkv"].backend == "torch_int_mm"
    assert list(rep.fallbacks) == ["blocks.0.odd"]
    assert len([r for r in caplog.records if "fallback" in r.getMessage()]) == 1  # one line, not per layer
    assert rep.float_bytes == (192 * 64 + 192 + 64 * 60 + 64) * 4
    assert rep.int8_bytes == sum(m.nbytes() for m in layers.values())
    assert "2 linears -> INT8" in rep.summary()
    x = torch.randn(3, 64)
    ref = lin[0][1](x)
    assert ((layers["blocks.0.qkv"](x) - ref).norm() / ref.norm()) < 0.05


def test_build_int8_layers_errors_and_control():
    lin = _linears()
    bad = _Calibration({"blocks.0.qkv": _Entry(smooth=torch.ones(5))})
    with pytest.raises(ValueError, match="blocks.0.qkv has K=5"):
        build_int8_layers(lin, "torch_int_mm", calibration=bad)
    with pytest.raises(ValueError, match="unknown INT8 backend"):
        build_int8_layers(lin, "nope")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        build_int8_layers(lin, "torch_int_mm", keep_float="blocks.(")
    assert build_int8_layers(lin, "bf16")[0] == {}


def test_build_int8_layers_weight_fn_and_tuples():
    w, b = torch.randn(32, 64), torch.randn(32)
    merged = w + 0.5
    layers, rep = build_int8_layers([("a", (w, b))], "dequant_bf16", weight_fn=lambda n, m: merged)
    torch.testing.assert_close(layers["a"].dequantized_weight(), merged, atol=merged.abs().max().item() / 254 + 1e-6,
                               rtol=0)
    assert rep.float_bytes == (32 * 64 + 32) * 4


# --------------------------------------------------------------------------- layer selection by name
def _tree(names, dim=32):
    """An nn.Module tree with an nn.Linear at each dotted name (ComfyUI's module names of that DiT)."""
    root = torch.nn.Module()
    for name in names:
        parent = root
        *path, leaf = name.split(".")
        for p in path:
            if not hasattr(parent, p):
                parent.add_module(p, torch.nn.Module())
            parent = getattr(parent, p)
        parent.add_module(leaf, torch.nn.Linear(dim, dim))
    return root


ARCH_NAMES = {  # (quantized by 'blocks', left float by 'blocks')
    "ideogram4": (["layers.0.attention.qkv", "layers.0.attention.o", "layers.0.feed_forward.w1",
                   "layers.0.feed_forward.w2", "layers.0.feed_forward.w3"],
                  ["layers.0.adaln_modulation", "llm_cond_proj", "x_embedder", "final_layer.linear"]),
    "flux": (["double_blocks.0.img_attn.qkv", "double_blocks.0.txt_mlp.0", "single_blocks.0.linear1",
              "single_blocks.0.linear2"],
             ["double_blocks.0.img_mod.lin", "single_blocks.0.modulation.lin", "img_in", "time_in.in_layer",
              "final_layer.adaLN_modulation.1"]),
    "flux2": (["double_blocks.0.img_attn.qkv", "double_blocks.0.img_mlp.0", "single_blocks.0.linear1"],
              ["double_stream_modulation_img.lin", "single_stream_modulation.lin", "img_in"]),
    "qwen_image": (["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj",
                    "transformer_blocks.0.img_mlp.net.0.proj", "transformer_blocks.0.txt_mlp.net.2"],
                   ["transformer_blocks.0.img_mod.1", "transformer_blocks.0.txt_mod.1", "img_in", "proj_out"]),
    "lumina2": (["layers.0.attention.qkv", "noise_refiner.0.feed_forward.w2", "context_refiner.0.attention.out"],
                ["layers.0.adaLN_modulation.1", "noise_refiner.0.adaLN_modulation.1", "cap_embedder.1",
                 "t_embedder.mlp.0"]),
    "wan": (["blocks.0.self_attn.q", "blocks.0.cross_attn.o", "blocks.0.ffn.0", "blocks.0.ffn.2"],
            ["time_projection.1", "text_embedding.0", "head.head"]),
    "sd3": (["joint_blocks.0.x_block.attn.qkv", "joint_blocks.0.context_block.mlp.fc1"],
            ["joint_blocks.0.x_block.adaLN_modulation.1", "x_embedder.proj", "final_layer.linear"]),
}


@pytest.mark.parametrize("arch", sorted(ARCH_NAMES))
def test_blocks_preset_selects_block_linears_of_each_dit(arch):
    from quant.select import _BLOCK, select_linears
    take, leave = ARCH_NAMES[arch]
    tree = _tree(take + leave)
    assert [n for n, _ in select_linears(tree, "blocks")] == take
    mods = {n for n, _ in select_linears(tree, "blocks+modulation")}
    block_mod = {n for n in leave if "mod" in n.lower() and _BLOCK.search(n)}
    assert mods == set(take) | block_mod
    assert {n for n, _ in select_linears(tree, "all")} == set(take + leave)
    assert [n for n, _ in select_linears(tree, "blocks", include=leave[-1], exclude=take[0])] == take[1:] + [leave[-1]]


@needs_triton
def test_fused_triton_compiles_as_one_custom_op_without_graph_breaks():
    """Under torch.compile the fused_triton backend goes through torch.ops.int8_fused.linear."""
    layer = _layer(48, 64, bias=True, smooth=True)
    layer.backend = "fused_triton"
    assert backends.resolve("fused_triton", CPU, 48, 64)[0] == "fused_triton"  # registers the op
    x = torch.randn(2, 5, 64)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=capture, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x))
    calls = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("int8_fused.linear" in c for c in calls), calls


# ---------------------------------------------------------------- what a backend can do: declared on its record
def test_backends_declare_what_their_callers_need():
    """The capabilities the layer, dispatch, the fused blocks, ConvRot, pad elision and Apply ask of a record
    (``quant.backends.Backend``): only this pack's Triton backend dispatches per shape, takes a pre-quantized input
    and elides padding by default; only the bf16 control does not quantize. A name that is no backend declares
    nothing, and asking never raises."""
    b = backends.BACKENDS
    fused = b[backends.FUSED_BACKEND]
    assert backends.FUSED_BACKEND == "fused_triton" == backends.PREFERENCE[0]
    assert fused.per_shape_dispatch and callable(fused.dispatch_int8) and fused.feeds_fused
    assert fused.pad_elision_by_default and fused.quantizes
    others = [r for n, r in b.items() if n != backends.FUSED_BACKEND]
    assert not any(r.per_shape_dispatch or r.feeds_fused or r.pad_elision_by_default for r in others)
    assert [n for n, r in b.items() if not r.quantizes] == ["bf16"] and b["bf16"].linear is None
    for name in (None, "int4", ""):
        r = backends.capabilities(name)
        assert not (r.per_shape_dispatch or r.feeds_fused or r.pad_elision_by_default or r.quantizes)
    assert backends.capabilities("torch_int_mm") is b["torch_int_mm"]


@needs_triton
def test_callers_follow_the_record_not_the_name(monkeypatch):
    """The fused_triton record under another name behaves as fused_triton (per-shape dispatch counted, fed by the
    fused blocks, padding elided); fused_triton's record without those capabilities behaves as a plain backend."""
    import dataclasses

    from adapters.base import pad_elision_enabled
    from kernel import config
    from quant import blocks, dispatch

    fused = backends.BACKENDS["fused_triton"]
    monkeypatch.setitem(backends.BACKENDS, "renamed", dataclasses.replace(fused, name="renamed"))
    layer = _layer(24, 40, bias=True, smooth=True)
    x = torch.randn(5, 40)
    ref = _run(layer, "torch_int_mm", x)
    with config.override(INT8_FUSED_DISPATCH="int8", INT8_FUSED_PAD_ELISION=None):
        y = _run(layer, "renamed", x)
        assert dict(layer.dispatch_calls) == {"int8": 1} and dispatch.counts([layer])["layers"] == 1
        assert blocks.fusable(layer) and pad_elision_enabled("renamed")
        monkeypatch.setitem(backends.BACKENDS, "fused_triton", dataclasses.replace(
            fused, dispatch_int8=None, feeds_fused=False, pad_elision_by_default=False))
        plain = _layer(24, 40, bias=True, smooth=True)  # a new layer: forward's hot path keeps what a layer ran
        z = _run(plain, "fused_triton", x)
        assert not plain.dispatch_calls and dispatch.counts([plain])["layers"] == 0
        assert not blocks.fusable(plain) and not pad_elision_enabled("fused_triton")
    torch.testing.assert_close(y, ref, rtol=4 * 2.0 ** -24, atol=1e-6)
    torch.testing.assert_close(z, y, rtol=4 * 2.0 ** -24, atol=1e-6)
