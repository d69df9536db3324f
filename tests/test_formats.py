"""INT8 checkpoint formats (no ComfyUI): Ideogram-4-keyed miniatures in every layout, read back bit-exact,
and corrupt / truncated / wrong-architecture / pickle / inconsistent files rejected with precise errors."""
import json
import struct

import pytest
import torch

from quant import fmt_ideogram4 as i4
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
    q2 = {SMOOTHED: L}
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
    del q2


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


def test_core_round_trip_and_folding(tmp_path, branches):
    q, f = branches["conditional"]
    p = W.write_core_int8(str(tmp_path / "c.safetensors"), q, f, scale_shape="column")
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
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(F.CheckpointError, match="truncated.*download it again"):
        F.open_checkpoint(str(tmp_path / "cut.safetensors"))
    n = struct.unpack("<Q", data[:8])[0]
    (tmp_path / "hdr.safetensors").write_bytes(data[:8] + b"{garbage" + data[16:])
    with pytest.raises(F.CheckpointError, match="corrupt safetensors header"):
        F.open_checkpoint(str(tmp_path / "hdr.safetensors"))
    (tmp_path / "tiny.safetensors").write_bytes(data[:5])
    with pytest.raises(F.CheckpointError, match="too short"):
        F.open_checkpoint(str(tmp_path / "tiny.safetensors"))
    assert n < len(data)


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
