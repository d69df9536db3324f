"""INT8 checkpoint formats (no ComfyUI): Ideogram-4-keyed miniatures in every layout, read back bit-exact,
and corrupt / truncated / wrong-architecture / pickle / inconsistent files rejected with precise errors."""
import json
import struct

import pytest
import torch

from adapters.ideogram4 import layout as i4
from quant import formats as F
from quant import fmt_write as W
from quant.quantize import dequantize

WID = i4.widths(hidden=64, heads=4, ffn=96, adaln=32, text=48, channels=8)
NL = 2
SMOOTHED = "layers.0.attention.qkv"


def _branch(seed):
    sd = i4.random_state_dict(NL, WID, seed=seed)
    names = [n for n in i4.linear_specs(NL, WID) if n.startswith("layers.") and not n.endswith("w2")]
    g = torch.Generator().manual_seed(seed + 7)
    smooth = {SMOOTHED: torch.rand(WID["hidden"], generator=g) + 0.5}
    return i4.quantize_state_dict(sd, names, smooth)


@pytest.fixture(scope="module")
def branches():
    return {"conditional": _branch(1), "unconditional": _branch(2)}


def _same(ck, br, quant, floats):
    b = ck.branches[br]
    assert set(b.quant) == set(quant) and set(b.floats) == set(floats)
    for n, L in quant.items():
        q, s, bias, sm = ck.quant_tensors(br, n)
        assert q.dtype == torch.int8 and torch.equal(q, L["qweight"])
        assert torch.equal(s, L["weight_scale"])
        assert (bias is None) == (L["bias"] is None) and (bias is None or torch.equal(bias, L["bias"]))
        assert (sm is None) == (L["smooth"] is None) and (sm is None or torch.equal(sm, L["smooth"]))
    for n, t in floats.items():
        got = ck.tensor(b.floats[n])
        assert got.dtype == t.dtype and torch.equal(got, t)


@pytest.mark.parametrize("scale_shape", ["vector", "column"])
def test_transformerlab_two_branches_bit_exact(tmp_path, branches, scale_shape):
    p = W.write_transformerlab(str(tmp_path / "tl.safetensors"), branches, scale_shape=scale_shape)
    with F.open_checkpoint(p) as ck:
        assert ck.format == F.FMT_TRANSFORMERLAB and sorted(ck.branches) == ["conditional", "unconditional"]
        for br, (q, f) in branches.items():
            _same(ck, br, q, f)
            assert i4.check_branch(ck.branches[br], ck.header, ck.name, real_widths=False) == []
        assert ck.branches["conditional"].quant[SMOOTHED].smooth is not None


def test_transformerlab_gguf_prefixes_and_missing_norms(tmp_path, branches):
    q, f = branches["conditional"]
    f = {k: v for k, v in f.items() if k not in i4.float_specs(NL, WID)}
    p = W.write_transformerlab(str(tmp_path / "g.safetensors"), {"conditional": (q, f), "unconditional": (q, f)},
                               prefixes=("cond.", "uncond."))
    with F.open_checkpoint(p) as ck:
        missing = i4.check_branch(ck.branches["unconditional"], ck.header, ck.name, real_widths=False)
    want = sorted(set(i4.float_specs(NL, WID)))
    assert missing == want and "embed_image_indicator.weight" in missing


def test_transformerlab_per_tensor_scale_and_smooth_direction(tmp_path, branches):
    q, f = branches["conditional"]
    L = dict(q[SMOOTHED])
    tensors = {f"conditional.{SMOOTHED}.wq": L["qweight"], f"conditional.{SMOOTHED}.ws": torch.tensor(0.01),
               f"conditional.{SMOOTHED}.smooth": 1.0 / L["smooth"]}
    p = W.atomic_save(tensors, str(tmp_path / "s.safetensors"), {"smooth_direction": "multiply_activation"})
    with F.open_checkpoint(p) as ck:
        _, s, _, sm = ck.quant_tensors("conditional", SMOOTHED)
    assert s.shape == (3 * WID["hidden"],) and torch.all(s == 0.01)
    torch.testing.assert_close(sm, L["smooth"], rtol=1e-6, atol=0)
    W.atomic_save(tensors, str(tmp_path / "bad.safetensors"), {"smooth_direction": "sideways"})
    with pytest.raises(F.CheckpointError, match="smooth_direction"):
        F.open_checkpoint(str(tmp_path / "bad.safetensors"))


def test_pack_round_trip_and_metadata(tmp_path, branches):
    p = W.write_pack(str(tmp_path / "p.safetensors"), branches, protected=["layers.0.feed_forward.w2"],
                     calibration={"seed": 1, "alpha": 0.5}, architecture="Ideogram4")
    with F.open_checkpoint(p) as ck:
        assert ck.format == F.FMT_PACK
        m = ck.metadata
        assert m["format_version"] == "1" and json.loads(m["calibration"]) == {"seed": 1, "alpha": 0.5}
        assert json.loads(m["layers"])[f"conditional.{SMOOTHED}"]["smooth"] is True
        for br, (q, f) in branches.items():
            _same(ck, br, q, f)
        sd = ck.branch_state_dict("conditional")
    W.write_pack(str(tmp_path / "p2.safetensors"), {"": (
        {n[:-8]: {"qweight": sd[n], "weight_scale": sd[n[:-8] + ".weight_scale"],
                  "bias": sd.get(n[:-8] + ".bias"), "smooth": sd.get(n[:-8] + ".smooth")}
         for n in sd if n.endswith(".qweight")},
        {n: t for n, t in sd.items() if not n.rsplit(".", 1)[1] in ("qweight", "weight_scale", "smooth")
         and not (n.endswith(".bias") and n[:-5] in branches["conditional"][0])})})
    with F.open_checkpoint(str(tmp_path / "p2.safetensors")) as ck2:
        _same(ck2, "", *branches["conditional"])


def test_pack_newer_version_rejected(tmp_path, branches):
    p = W.write_pack(str(tmp_path / "v.safetensors"), {"": branches["conditional"]},
                     extra_meta={"format_version": "9"})
    with pytest.raises(F.CheckpointError, match="newer version of this pack"):
        F.open_checkpoint(p)


def test_core_scales_are_columns_as_comfy_kitchen_dequantizes_them(tmp_path):
    """A core file's per-channel scales are [N, 1]: comfy-kitchen dequantizes an int8_tensorwise weight as
    ``q.float() * scale`` (its eager ``dequantize_int8_simple``, what ComfyUI runs where comfy-kitchen has no int8
    kernel for an op, e.g. a linear without bias), which must give row n the scale of output channel n, on square
    and non-square weights alike (an [N] scale would scale the columns of a square one)."""
    from safetensors.torch import load_file
    g = torch.Generator().manual_seed(3)
    quant = {}
    for name, (n, k) in {"square": (16, 16), "wide": (8, 24)}.items():
        quant[name] = {"qweight": torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                       "weight_scale": torch.rand(n, generator=g) + 0.01, "bias": None, "smooth": None}
    sd = load_file(W.write_core_int8(str(tmp_path / "c.safetensors"), quant, {}))
    for name, L in quant.items():
        n, k = L["qweight"].shape
        assert sd[f"{name}.weight_scale"].shape == (n, 1)
        got = sd[f"{name}.weight"].float() * sd[f"{name}.weight_scale"]
        want = torch.stack([L["qweight"][r].float() * L["weight_scale"][r] for r in range(n)])  # row by row
        assert torch.equal(got, want), name


def test_core_round_trip_and_folding(tmp_path, branches):
    q, f = branches["conditional"]
    p = W.write_core_int8(str(tmp_path / "c.safetensors"), q, f)
    with F.open_checkpoint(p) as ck:
        assert ck.format == F.FMT_CORE
        b = ck.branches[""]
        for n, L in q.items():
            qw, s, bias, sm = ck.quant_tensors("", n)
            assert sm is None
            if L["smooth"] is None:  # unsmoothed layers are written as they are
                assert torch.equal(qw, L["qweight"]) and torch.equal(s, L["weight_scale"])
            else:  # folded: same float weight within one weight step per channel
                want = dequantize(L["qweight"], L["weight_scale"]) / L["smooth"][None, :]
                err = (dequantize(qw, s) - want).abs().amax(1)
                assert torch.all(err <= s * 0.5 + 1e-7)
        assert set(b.floats) == set(f)
        raw = ck.tensor(f"{SMOOTHED}.comfy_quant")
        assert json.loads(raw.numpy().tobytes()) == {"format": "int8_tensorwise"}


def test_core_header_metadata_convrot_and_other_formats(tmp_path, branches):
    q, _ = branches["conditional"]
    L = q["layers.0.attention.o"]
    t = {"layers.0.attention.o.weight": L["qweight"], "layers.0.attention.o.weight_scale": L["weight_scale"]}
    ok = {"_quantization_metadata": json.dumps({"layers": {"layers.0.attention.o": {"format": "int8_tensorwise"}}})}
    W.atomic_save(t, str(tmp_path / "m.safetensors"), ok)
    with F.open_checkpoint(str(tmp_path / "m.safetensors")) as ck:
        assert torch.equal(ck.quant_tensors("", "layers.0.attention.o")[0], L["qweight"])
    for conf, msg in (({"format": "int8_tensorwise", "convrot": True}, "ConvRot"),
                      ({"format": "float8_e4m3fn"}, "float8_e4m3fn")):
        meta = {"_quantization_metadata": json.dumps({"layers": {"layers.0.attention.o": conf}})}
        W.atomic_save(t, str(tmp_path / "x.safetensors"), meta, overwrite=True)
        with pytest.raises(F.CheckpointError, match=msg):
            F.open_checkpoint(str(tmp_path / "x.safetensors"))


def test_core_convrot_group_read_or_refused(tmp_path, branches):
    """Issue 47 C: a ConvRot core layer is read with its group size (the Ideogram 4 loader builds a ConvRotLinear
    from it); a group size the kernels do not rotate with is refused naming the file, the layer, the group and K."""
    q, _ = branches["conditional"]
    L = q["layers.0.attention.o"]  # K = 64
    t = {"layers.0.attention.o.weight": L["qweight"], "layers.0.attention.o.weight_scale": L["weight_scale"]}
    for group, want in ((64, 64), (16, 16), (48, "group size 48 is not supported.*K = 64.*damaged"),
                        (4096, "group size 4096 does not divide the input width K = 64.*damaged"),
                        (4, "group size 4 is not supported.*K = 64.*'Apply Fused INT8 GEMM'.*decodes"),
                        ("x", "group size 'x' is not an integer")):
        conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}
        meta = {"_quantization_metadata": json.dumps({"layers": {"layers.0.attention.o": conf}})}
        W.atomic_save(t, str(tmp_path / "r.safetensors"), meta, overwrite=True)
        if isinstance(want, int):
            with F.open_checkpoint(str(tmp_path / "r.safetensors")) as ck:
                assert ck.branches[""].quant["layers.0.attention.o"].rotation == want
        else:
            with pytest.raises(F.CheckpointError, match=r"r\.safetensors: .*'layers\.0\.attention\.o'.*" + want):
                F.open_checkpoint(str(tmp_path / "r.safetensors"))
    meta = {"_quantization_metadata": json.dumps({"layers": {"layers.0.attention.o": {"format": "int8_tensorwise"}}})}
    W.atomic_save(t, str(tmp_path / "r.safetensors"), meta, overwrite=True)
    with F.open_checkpoint(str(tmp_path / "r.safetensors")) as ck:
        assert ck.branches[""].quant["layers.0.attention.o"].rotation is None  # unrotated: a plain layer


def test_pickle_and_non_safetensors_rejected(tmp_path):
    for name in ("m.ckpt", "m.pt", "m.pth"):
        (tmp_path / name).write_bytes(b"x" * 64)
        with pytest.raises(F.CheckpointError, match="only .safetensors"):
            F.open_checkpoint(str(tmp_path / name))
    torch.save({"a": torch.zeros(2)}, str(tmp_path / "disguised.safetensors"))
    with pytest.raises(F.CheckpointError, match="pickle"):
        F.open_checkpoint(str(tmp_path / "disguised.safetensors"))
    import pickle
    (tmp_path / "legacy.safetensors").write_bytes(pickle.dumps({"a": list(range(50))}, protocol=2))
    with pytest.raises(F.CheckpointError, match="pickle"):
        F.open_checkpoint(str(tmp_path / "legacy.safetensors"))


def test_truncated_and_corrupt(tmp_path, branches):
    p = W.write_transformerlab(str(tmp_path / "t.safetensors"), branches)
    data = open(p, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    # the cases below hit the regions they claim: the last 1000 bytes are tensor data, bytes 8..16 header
    assert 8 + n <= len(data) - 1000 and n >= 8
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(F.CheckpointError, match=r"truncated: its header needs \d+ bytes.*download it again"):
        F.open_checkpoint(str(tmp_path / "cut.safetensors"))
    (tmp_path / "cuthdr.safetensors").write_bytes(data[: 8 + n // 2])  # cut inside the JSON header
    with pytest.raises(F.CheckpointError, match=f"header claims {n} bytes but the file has {8 + n // 2}"):
        F.open_checkpoint(str(tmp_path / "cuthdr.safetensors"))
    (tmp_path / "hdr.safetensors").write_bytes(data[:8] + b"{garbage" + data[16:])
    with pytest.raises(F.CheckpointError, match="corrupt safetensors header"):
        F.open_checkpoint(str(tmp_path / "hdr.safetensors"))
    (tmp_path / "tiny.safetensors").write_bytes(data[:5])
    with pytest.raises(F.CheckpointError, match="too short"):
        F.open_checkpoint(str(tmp_path / "tiny.safetensors"))


def test_inconsistent_files_named_precisely(tmp_path, branches):
    q, f = branches["conditional"]
    L = q["layers.1.attention.o"]
    cases = [
        ({"conditional.layers.1.attention.o.wq": L["qweight"]}, "no scale 'layers.1.attention.o.ws'"),
        ({"conditional.layers.1.attention.o.wq": L["qweight"].float(),
          "conditional.layers.1.attention.o.ws": L["weight_scale"]}, "must be int8"),
        ({"conditional.layers.1.attention.o.wq": L["qweight"],
          "conditional.layers.1.attention.o.ws": L["weight_scale"][:5]}, r"scale has shape \[5\]"),
        ({"conditional.layers.1.attention.o.wq": L["qweight"], "conditional.layers.1.attention.o.ws":
          L["weight_scale"], "conditional.layers.1.attention.o.smooth": torch.ones(3)}, r"smooth has shape \[3\]"),
        ({"conditional.layers.1.attention.o.wq": L["qweight"], "conditional.layers.1.attention.o.ws":
          L["weight_scale"], "layers.1.x": torch.ones(3)}, "without a branch prefix"),
        ({"conditional.a.ws": torch.ones(3), "conditional.b.wq": L["qweight"],
          "conditional.b.ws": L["weight_scale"]}, "belongs to no quantized layer"),
    ]
    for i, (t, msg) in enumerate(cases):
        p = W.atomic_save(t, str(tmp_path / f"i{i}.safetensors"))
        with pytest.raises(F.CheckpointError, match=msg) as e:
            F.open_checkpoint(p)
        assert f"i{i}.safetensors" in str(e.value)


def test_wrong_architecture_and_shapes(tmp_path, branches):
    q, f = branches["conditional"]
    fl = {"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 4), "img_in.weight": torch.zeros(4, 4)}
    fq = {"double_blocks.0.img_mlp.0": dict(q["layers.0.attention.o"])}
    p = W.write_transformerlab(str(tmp_path / "flux.safetensors"), {"conditional": (fq, fl)})
    with F.open_checkpoint(p) as ck, pytest.raises(F.CheckpointError, match="not an Ideogram 4"):
        i4.check_branch(ck.branches["conditional"], ck.header, ck.name, real_widths=False)
    extra = dict(f, **{"layers.0.attention.extra_proj.weight": torch.zeros(4, 4)})
    p = W.write_transformerlab(str(tmp_path / "extra.safetensors"), {"conditional": (q, extra)})
    with F.open_checkpoint(p) as ck, pytest.raises(F.CheckpointError, match="extra_proj"):
        i4.check_branch(ck.branches["conditional"], ck.header, ck.name, real_widths=False)
    # a miniature checked against the real widths: mis-shaped layers named with both shapes
    p = W.write_transformerlab(str(tmp_path / "mini.safetensors"), {"conditional": (q, f)})
    with F.open_checkpoint(p) as ck, pytest.raises(F.CheckpointError, match=r"mis-shaped.*expected \["):
        i4.check_branch(ck.branches["conditional"], ck.header, ck.name, real_widths=True)
    q2 = {k: v for k, v in q.items() if k != "layers.1.feed_forward.w1"}
    p = W.write_transformerlab(str(tmp_path / "hole.safetensors"), {"conditional": (q2, f)})
    with F.open_checkpoint(p) as ck, pytest.raises(F.CheckpointError, match="layers.1.feed_forward.w1"):
        i4.check_branch(ck.branches["conditional"], ck.header, ck.name, real_widths=False)


def test_not_int8_and_overwrite_guard(tmp_path, branches):
    _, f = branches["conditional"]
    p = W.atomic_save(f, str(tmp_path / "float.safetensors"))
    with pytest.raises(F.CheckpointError, match="not an INT8 checkpoint"):
        F.open_checkpoint(p)
    with pytest.raises(F.CheckpointError, match="already exists.*overwrite"):
        W.atomic_save(f, p)
    W.atomic_save({"a": torch.ones(2)}, p, overwrite=True)
    assert list(tmp_path.glob(".*.tmp")) == []


# --------------------------------------------------------------------------- a file built by hand
# The transformerlab layout as documented (quant/formats.py), written with plain safetensors, no pack
# writer. Expected values are worked out by hand in the comments.
O_WQ = [[127, -64, 0, 1], [-127, 5, 10, -3], [0, 0, 0, 0]]   # conditional layers.0.attention.o, [N=3, K=4]
O_WS = [0.5, 0.25, 0.0]                                       # [N]; row 2 is all zero: scale 0 is legal
O_B = [1.0, -2.0, 0.5]
# W = wq * ws[:, None] = [[63.5, -32, 0, 0.5], [-31.75, 1.25, 2.5, -0.75], [0, 0, 0, 0]]
# x = [1, 2, 3, 4]: y = W @ x + b = [63.5 - 64 + 2 + 1, -31.75 + 2.5 + 7.5 - 3 - 2, 0.5] = [2.5, -26.75, 0.5]
O_Y = [2.5, -26.75, 0.5]
QKV_WQ = [[10, -20, 30, 127], [1, 2, 3, 4]]                   # unconditional layers.0.attention.qkv, [2, 4]
QKV_WS = [[0.125], [2.0]]                                     # [N, 1] in bf16 (exact)
QKV_SMOOTH = [2.0, 4.0, 0.5, 1.0]                             # divisor s: stored wq = Q(W * s)
# float W = dequant / s = [[0.625, -0.625, 7.5, 15.875], [1, 1, 12, 8]];
# x = [2, 4, 1, -1]: y = W @ x = [1.25 - 2.5 + 7.5 - 15.875, 2 + 4 + 12 - 8] = [-9.625, 10]
QKV_Y = [-9.625, 10.0]


def _hand_file(path, o_ws=O_WS, metadata=None, smooth=QKV_SMOOTH):
    from safetensors.torch import save_file
    t = {
        "conditional.layers.0.attention.o.wq": torch.tensor(O_WQ, dtype=torch.int8),
        "conditional.layers.0.attention.o.ws": torch.tensor(o_ws, dtype=torch.float32),
        "conditional.layers.0.attention.o.bias": torch.tensor(O_B, dtype=torch.float32),
        "conditional.layers.0.feed_forward.w1.wq": torch.tensor([[1, -1], [2, 3]], dtype=torch.int8),
        "conditional.layers.0.feed_forward.w1.ws": torch.tensor(0.5, dtype=torch.float16),  # per tensor
        "conditional.layers.0.feed_forward.w2.weight": torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16),
        "unconditional.layers.0.attention.qkv.wq": torch.tensor(QKV_WQ, dtype=torch.int8),
        "unconditional.layers.0.attention.qkv.ws": torch.tensor(QKV_WS, dtype=torch.bfloat16),
        "unconditional.layers.0.attention.qkv.smooth": torch.tensor(smooth, dtype=torch.float32),
        "unconditional.layers.0.attention_norm1.weight": torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16),
    }
    save_file(t, str(path), metadata=metadata)
    return str(path)


def _y(q, s, b, sm, x):
    """Float product the reader's tensors define: (x / smooth) @ (q * s[:, None]).T + b, in float64."""
    x = torch.tensor(x, dtype=torch.float64)
    if sm is not None:
        x = x / sm.double()
    y = (q.double() * s.double()[:, None]) @ x
    return y + b.double() if b is not None else y


def test_transformerlab_hand_built_file(tmp_path):
    p = _hand_file(tmp_path / "hand.safetensors")
    with F.open_checkpoint(p) as ck:
        assert ck.format == F.FMT_TRANSFORMERLAB and sorted(ck.branches) == ["conditional", "unconditional"]
        c, u = ck.branches["conditional"], ck.branches["unconditional"]
        assert sorted(c.quant) == ["layers.0.attention.o", "layers.0.feed_forward.w1"]
        assert c.floats == {"layers.0.feed_forward.w2.weight": "conditional.layers.0.feed_forward.w2.weight"}
        assert sorted(u.quant) == ["layers.0.attention.qkv"]
        assert u.floats == {"layers.0.attention_norm1.weight": "unconditional.layers.0.attention_norm1.weight"}
        e = c.quant["layers.0.attention.o"]
        assert (e.out_features, e.in_features, e.smooth) == (3, 4, None)
        q, s, b, sm = ck.quant_tensors("conditional", "layers.0.attention.o")
        assert q.dtype == torch.int8 and q.tolist() == O_WQ
        assert s.dtype == torch.float32 and s.tolist() == O_WS
        assert b.dtype == torch.float32 and b.tolist() == O_B and sm is None
        assert _y(q, s, b, sm, [1, 2, 3, 4]).tolist() == O_Y
        q, s, b, sm = ck.quant_tensors("conditional", "layers.0.feed_forward.w1")
        assert s.dtype == torch.float32 and s.tolist() == [0.5, 0.5] and b is None and sm is None
        q, s, b, sm = ck.quant_tensors("unconditional", "layers.0.attention.qkv")
        assert q.tolist() == QKV_WQ and s.shape == (2,) and s.tolist() == [0.125, 2.0]
        assert sm.dtype == torch.float32 and sm.tolist() == QKV_SMOOTH and b is None
        assert _y(q, s, b, sm, [2, 4, 1, -1]).tolist() == QKV_Y
        sd = ck.branch_state_dict("conditional")
        assert sorted(sd) == ["layers.0.attention.o.bias", "layers.0.attention.o.qweight",
                              "layers.0.attention.o.weight_scale", "layers.0.feed_forward.w1.qweight",
                              "layers.0.feed_forward.w1.weight_scale", "layers.0.feed_forward.w2.weight"]
        assert sd["layers.0.feed_forward.w2.weight"].dtype == torch.bfloat16
        assert sd["layers.0.feed_forward.w2.weight"].tolist() == [[1.5, -2.0]]
    # the other smoothing convention: the file stores v = 1 / s and says so; the reader returns s
    p = _hand_file(tmp_path / "mul.safetensors", metadata={"smooth_direction": "multiply_activation"},
                   smooth=[0.5, 0.25, 2.0, 1.0])
    with F.open_checkpoint(p) as ck:
        q, s, b, sm = ck.quant_tensors("unconditional", "layers.0.attention.qkv")
        assert sm.tolist() == QKV_SMOOTH and _y(q, s, b, sm, [2, 4, 1, -1]).tolist() == QKV_Y


def test_negative_weight_scale_refused_naming_file_and_tensor(tmp_path):
    p = _hand_file(tmp_path / "neg.safetensors", o_ws=[0.5, -0.25, 0.0])
    with F.open_checkpoint(p) as ck:
        ck.quant_tensors("unconditional", "layers.0.attention.qkv")  # the other layers still read
        with pytest.raises(F.CheckpointError, match=r"neg\.safetensors.*'conditional\.layers\.0\.attention\.o\.ws'"
                                                    r".*1 negative.*channel 1"):
            ck.quant_tensors("conditional", "layers.0.attention.o")
        with pytest.raises(F.CheckpointError, match="negative"):
            ck.branch_state_dict("conditional")


# --------------------------------------------------------------------------- damaged metadata
@pytest.mark.parametrize("key,value,msg", [
    ("layers", "{not json", "'layers' is not valid JSON"),
    ("layers", '["layers.0.attention.qkv"]', "'layers' should be an object but is list"),
    ("layers", '{"layers.0.attention.qkv": 5}', "'layers' entry of 'layers.0.attention.qkv' is int"),
    ("branches", "[conditional", "'branches' is not valid JSON"),
    ("branches", '{"a": 1}', "'branches' should be a list but is dict"),
])
def test_pack_damaged_metadata_named(tmp_path, branches, key, value, msg):
    p = W.write_pack(str(tmp_path / "dmg.safetensors"), {"": branches["conditional"]}, extra_meta={key: value})
    with pytest.raises(F.CheckpointError, match=r"dmg\.safetensors: .*" + msg.replace("[", r"\[")):
        F.open_checkpoint(p)


@pytest.mark.parametrize("conf,meta,msg", [
    (b"[1, 2]", None, "quantization config of layer 'layers.0.attention.o' is list"),
    (b'"int8_tensorwise"', None, "quantization config of layer 'layers.0.attention.o' is str"),
    (None, '{"layers": ["layers.0.attention.o"]}', "holds 'layers' of type list"),
    (None, '{"layers": {"layers.0.attention.o": 3}}', "quantization config of layer 'layers.0.attention.o' is int"),
    (None, "{bad", "'_quantization_metadata' is not valid JSON"),
])
def test_core_damaged_metadata_named(tmp_path, branches, conf, meta, msg):
    L = branches["conditional"][0]["layers.0.attention.o"]
    t = {"layers.0.attention.o.weight": L["qweight"], "layers.0.attention.o.weight_scale": L["weight_scale"]}
    if conf is not None:
        t["layers.0.attention.o.comfy_quant"] = torch.tensor(list(conf), dtype=torch.uint8)
    W.atomic_save(t, str(tmp_path / "core.safetensors"), {"_quantization_metadata": meta} if meta else None)
    with pytest.raises(F.CheckpointError, match=r"core\.safetensors: .*" + msg.replace("[", r"\[")):
        F.open_checkpoint(str(tmp_path / "core.safetensors"))


# --------------------------------------------------------------------------- errors and writer hygiene
def test_exceptions_have_a_stable_module_and_one_exists_type(tmp_path):
    # ComfyUI shows an exception's type as f"{cls.__module__}.{cls.__qualname__}" (execution.full_type_name)
    for cls in (F.CheckpointError, F.OutputExistsError):
        assert f"{cls.__module__}.{cls.__qualname__}" == f"int8_fused.{cls.__name__}"
    p = W.atomic_save({"a": torch.ones(2)}, str(tmp_path / "e.safetensors"))
    with pytest.raises(FileExistsError, match=r"e\.safetensors already exists.*overwrite") as e:
        W.atomic_save({"a": torch.ones(2)}, p)
    assert isinstance(e.value, F.CheckpointError) and isinstance(e.value, ValueError)


def test_nul_in_file_name_refused(tmp_path):
    with pytest.raises(ValueError, match="invalid file name.*NUL"):
        W.atomic_save({"a": torch.ones(2)}, str(tmp_path / "a\x00b.safetensors"))
    assert list(tmp_path.iterdir()) == []


def test_stale_temporary_of_a_killed_writer_is_removed_by_the_next_save(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path
    root = str(Path(__file__).resolve().parents[1])
    script = ("import sys, time\nsys.path[:0] = [sys.argv[1], sys.argv[1] + '/tests']\nimport pack_import\n"
              "pack_import.install()\nimport torch, safetensors.torch\n"
              "def hang(tensors, path, metadata=None):\n"
              "    open(path, 'wb').write(b'partial'); print('writing', flush=True); time.sleep(600)\n"
              "safetensors.torch.save_file = hang\nfrom quant import fmt_write\n"
              "fmt_write.atomic_save({'a': torch.ones(2)}, sys.argv[2])\n")
    proc = subprocess.Popen([sys.executable, "-c", script, root, str(tmp_path / "m.safetensors")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the server is killed while saving
        proc.wait()
    stale = tmp_path / f".m.safetensors.{proc.pid}.tmp"
    assert stale.read_bytes() == b"partial"
    live = tmp_path / f".busy.safetensors.{os.getpid()}.tmp"  # a save in progress in a live process
    other = tmp_path / ".notes.tmp"                            # not this pack's naming
    live.write_bytes(b"x")
    other.write_bytes(b"x")
    W.atomic_save({"a": torch.ones(2)}, str(tmp_path / "next.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".busy.safetensors.%d.tmp" % os.getpid(), ".notes.tmp",
                                                          "next.safetensors"]
