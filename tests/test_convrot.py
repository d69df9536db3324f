"""ConvRot INT8 (issue 39 item 1): rotated ``int8_tensorwise`` checkpoints adopted as stored, the rotate + quantize
kernel, Apply's ``rotation`` input and Save's ConvRot layout.

References are independent of the pack: the block Hadamard as a float64 Kronecker power of ComfyUI's 4 x 4 matrix
built here, comfy-kitchen's own eager ConvRot linear and quantizers (``comfy_kitchen.backends.eager``, in the
current ComfyUI's runtime), and files ComfyUI 0.33.0 itself loads.
"""
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kernel import hadamard as hd
from quant import convrot
from quant.quantize import quantize_per_token_ref, quantize_weight_per_channel

ROOT = Path(__file__).resolve().parents[1]
H4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)


def h64(group: int) -> torch.Tensor:
    """float64 regular Hadamard of order ``group``: Kronecker power of H4, normalized."""
    h = H4
    while h.shape[0] < group:
        h = torch.kron(h, H4)
    return h / group ** 0.5


def rot64(x: torch.Tensor, group: int) -> torch.Tensor:
    m, k = x.shape
    return (x.double().reshape(m, k // group, group) @ h64(group)).reshape(m, k)


@pytest.mark.parametrize("group", [16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_rotation_against_float64(group, dtype):
    g = torch.Generator().manual_seed(group)
    x = torch.randn(37, 3 * group, generator=g)
    x[:, 5] *= 40.0  # an outlier channel
    x[3] = 0.0       # an all-zero row: scale 0, zeros
    x = x.to(dtype)
    ref = rot64(x, group)
    f = hd.hadamard_rotate(x, group)
    # bf16 / fp16 inputs: exact products, fp32 sums (G = 256: the fp32 intermediate through a bf16 head + tail,
    # about 2^-14 of its size); fp32 inputs: the same split of the input, about 2^-12 of the row max after G terms
    bound = (2.0 ** -12 if dtype == torch.float32 else 2.0 ** -14) * ref.abs().amax(1, keepdim=True)
    assert ((f.double() - ref).abs() <= bound).all()
    assert torch.equal(convrot.hadamard(group), h64(group))  # the torch reference the layers use
    # the codes: exactly quantize_per_token_ref of the kernel's rotated values; within half a step of float64's
    q, s = hd.hadamard_quantize(x, group)
    q2, s2 = quantize_per_token_ref(f)
    assert torch.equal(q, q2) and torch.equal(s, s2)
    assert s[3] == 0 and not q[3].any()
    step = ref.abs().amax(1, keepdim=True) / 127
    assert ((q.double() * s.double()[:, None] - ref).abs() <= step * (0.5 + 2 ** -8)).all()


def test_group_and_ragged_k_refused():
    x = torch.randn(4, 384)
    with pytest.raises(ValueError, match="group size 128 is not supported.*powers of 4"):
        hd.hadamard_quantize(torch.randn(4, 256), 128)
    with pytest.raises(ValueError, match="group size 256 does not divide the input width K = 384"):
        hd.hadamard_quantize(x, 256)
    with pytest.raises(ValueError, match="'blk.w'.*does not divide the input width K = 384"):
        convrot.ConvRotLinear.rotate_float(torch.randn(8, 384), 256, name="blk.w")
    with pytest.raises(ValueError, match="ragged K"):
        convrot.ConvRotLinear.from_stored(torch.zeros(8, 100, dtype=torch.int8), torch.ones(8), 64)
    assert convrot.group_for(3072) == 256 and convrot.group_for(128) == 64 and convrot.group_for(40) is None


def _one_piece(w: torch.Tensor, group: int) -> torch.Tensor:
    """The rotation as Apply and ``rotate_float`` computed it before issue 47 E: the whole weight in float64."""
    return (w.double().reshape(w.shape[0], -1, group) @ convrot.hadamard(group)).reshape(w.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_chunked_rotation_equals_one_piece_float64(dtype):
    """Issue 47 E: the weight rotated a chunk of rows at a time (Apply's ``rotate_weight``, in place on its fp32
    copy; ``rotate_float``'s rotate + quantize) gives the one-piece float64 rotation's fp32 values, int8 codes and
    scales bit for bit, chunks with a ragged tail and single rows included."""
    g = torch.Generator().manual_seed(47)
    for group in (16, 64, 256):
        w = torch.randn(37, 2 * group, generator=g) * torch.rand(37, 1, generator=g)
        w[:, 3] *= 30.0  # an outlier channel
        w[5] = 0.0       # an all-zero row
        w = w.to(dtype)
        ref = _one_piece(w, group).float()
        q_ref, s_ref = quantize_weight_per_channel(_one_piece(w, group))
        k = w.shape[1]
        for chunk in (None, 16 * k, 5 * 16 * k, 1 << 30):  # default, 1 row, 5 rows (tail of 2), one piece
            assert torch.equal(convrot.rotate_weight(w, group, chunk_bytes=chunk), ref), (group, chunk)
        w32 = w.to(torch.float32, copy=True)
        assert convrot.rotate_weight(w32, group, out=w32) is w32 and torch.equal(w32, ref)
        assert convrot.chunk_rows(37, k) < 37  # the default splits this weight too
        layer = convrot.ConvRotLinear.rotate_float(w, group)
        assert torch.equal(layer.weight, q_ref) and torch.equal(layer.weight_scale, s_ref), group
    bad = torch.randn(40, 64)
    bad[33, 7] = float("nan")
    with pytest.raises(ValueError, match=r"output rows \[33\]"):  # the row in the whole weight, not in its chunk
        convrot.ConvRotLinear.rotate_float(bad, 16)


class _PeakBytes(TorchDispatchMode):
    """Peak bytes held by the CPU tensors the ops under it create: a storage no input of its op shares is counted
    from that op until it is freed (inputs, views and in-place results are not counted)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st.data_ptr() in inputs or getattr(st, "_peak_counted", False):
                continue
            st._peak_counted, n = True, st.nbytes()
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._free, n)
        return out

    def _free(self, n):
        self.live -= n


def _peak(fn) -> int:
    with _PeakBytes() as m:
        out = fn()
    del out
    assert m.live == 0  # every temporary freed: the meter saw them all go
    return m.peak


def test_rotation_peak_memory_within_the_layers_fp32_size():
    """Issue 47 E: rotating a weight (Apply: in place on its fp32 copy) and rotating + quantizing it (``rotate_float``,
    int8 codes included) hold at most the layer's fp32 size in new tensors at once; the one-piece float64 rotation
    held four to six times that (measured here by the same meter, so this test fails for it)."""
    n, k, group = 256, 1024, 64
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    fp32 = n * k * 4
    one_piece = _peak(lambda: _one_piece(w, group).float())
    one_piece_q = _peak(lambda: quantize_weight_per_channel(_one_piece(w, group)))
    assert one_piece >= 4 * fp32 and one_piece_q >= 4 * fp32, (one_piece / fp32, one_piece_q / fp32)
    with_codes = _peak(lambda: convrot.ConvRotLinear.rotate_float(w, group))
    assert with_codes <= fp32, with_codes / fp32
    w32 = w.clone()
    in_place = _peak(lambda: convrot.rotate_weight(w32, group, out=w32))
    assert in_place <= fp32, in_place / fp32
    assert torch.equal(w32, _one_piece(w, group).float())


def test_apply_rotation_codes_equal_one_piece_and_rotation_in_place(pack, tiny_model, monkeypatch):
    """Issue 47 E through the Apply node (pinned ComfyUI, tiny Flux, ``rotation: convrot``): every rotated layer
    holds the codes and scales of the one-piece float64 rotation of its float weight, and Apply rotates each
    weight in place on its own fp32 copy, within the layer's fp32 size of new tensors (besides the G x G Hadamard
    matrix, built here beforehand: at the tiny model's widths it outweighs a layer)."""
    PREFIX = "diffusion_model."
    mp = tiny_model("flux")
    cr = pack.quant.convrot
    peaks, real = [], cr.rotate_weight
    hs = {g: cr.hadamard(g) for g in cr.GROUPS}
    monkeypatch.setattr(cr, "hadamard", lambda group, dtype=torch.float64, device=None: hs[group].to(device, dtype))

    def metered(w, group, out=None, chunk_bytes=None):
        assert out is w and w.dtype == torch.float32  # no second copy of the weight
        with _PeakBytes() as m:
            r = real(w, group, out=out, chunk_bytes=chunk_bytes)
        peaks.append(m.peak / (w.numel() * 4))
        return r
    monkeypatch.setattr(cr, "rotate_weight", metered)
    q = pack.nodes.apply.ApplyFusedInt8GEMM().apply(mp, "torch_int_mm", rotation="convrot")[0]
    rotated = q.int8_report.rotated
    assert rotated and len(peaks) == len(rotated) and max(peaks) <= 1.0, max(peaks)
    for name, group in rotated.items():
        layer = q.object_patches[PREFIX + name]
        w = mp.get_model_object(PREFIX + name).weight.detach().float()
        q_ref, s_ref = quantize_weight_per_channel(_one_piece(w, group))
        assert isinstance(layer, cr.ConvRotLinear) and layer.rotation == group, name
        assert torch.equal(layer.weight, q_ref) and torch.equal(layer.weight_scale, s_ref), name


@pytest.mark.parametrize("backend", ["fused_triton", "torch_int_mm"])
def test_layer_against_float64_w8a8(backend):
    """A ConvRotLinear computes W8A8 of its stored codes on the rotated input: float64 reference by hand."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 512, generator=g) / 20
    x = torch.randn(2, 5, 512, generator=g)
    x[..., 7] *= 30.0
    layer = convrot.ConvRotLinear.rotate_float(w, 256, torch.randn(48, generator=g), backend=backend)
    wr = rot64(w, 256)
    assert ((layer.weight.double() * layer.weight_scale.double()[:, None] - wr).abs()
            <= wr.abs().amax(1, keepdim=True) / 127 * 0.5001).all()
    y = layer(x).double().reshape(10, 48)
    xr = rot64(x.reshape(10, 512), 256)
    a = xr.abs().amax(1, keepdim=True) / 127
    xq = torch.round(xr / a).clamp(-127, 127)
    ref = (xq @ layer.weight.double().T) * a * layer.weight_scale.double()[None, :] + layer.bias.double()
    # a code may differ by one where float64 and the fp32 rotation fall on two sides of a rounding boundary: one
    # activation step times one weight, allowed twice per output; plus the fp32 epilogue
    wd = (layer.weight.double() * layer.weight_scale.double()[:, None]).abs().max()
    tol = 2 * a.max() * wd + 1e-5 * ref.abs().max()
    assert (y - ref).abs().max() <= tol
    deq = layer.weight.double() * layer.weight_scale.double()[:, None]
    assert torch.allclose(layer.dequantized_weight().double(), rot64(deq, 256), atol=1e-6)  # rotated back


def test_rotation_lowers_error_on_outlier_miniature(tmp_path):
    """Apply's rotation on bench/checks/calibration_quality.py's outlier miniature (one held-out seed, fp32): the whole
    model's final latent moves less from the float model's with rotation than without."""
    out = tmp_path / "q.json"
    cp = subprocess.run([sys.executable, str(ROOT / "bench" / "convrot.py"), "--quality-cpu", "--seeds", "7",
                         "--fp32-only", "--out", str(out)], capture_output=True, text=True, timeout=1200,
                        env=dict(os.environ, TRITON_INTERPRET="1"))
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    rows = {r["rotation"]: r for r in json.loads(out.read_text())["rows"]}
    print(rows)
    assert rows["convrot"]["rotated_layers"] == rows["convrot"]["int8_layers"] > 0
    assert rows["none"]["rotated_layers"] == 0
    assert rows["convrot"]["rel_err_mean"] < rows["none"]["rel_err_mean"]


def test_bench_smoke(comfy_current, tmp_path):
    """bench/convrot.py's CPU smoke run: the kernel rows and tiny Flux through ComfyUI's sampler with rotation."""
    out = tmp_path / "smoke.json"
    py = os.environ.get("COMFYUI_CURRENT_PYTHON") or sys.executable
    cp = subprocess.run([py, str(ROOT / "bench" / "convrot.py"), "--device", "cpu", "--tiny", "--steps", "1",
                         "--paths", "bf16,pack:fused_triton^convrot", "--out", str(out)], capture_output=True,
                        text=True, timeout=1500, env=dict(os.environ, TRITON_INTERPRET="1",
                                                          COMFYUI_CURRENT=str(comfy_current)))
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["gpu"] and doc["commit"] and all(r["status"] == "ok" and r["codes_equal_ref"] for r in doc["kernel"])
    rows = {r["path"]: r for r in doc["rows"] if "path" in r}
    assert rows["pack:fused_triton^convrot"]["status"] == "ok" and doc["rotated_layers"]["convrot"] > 0
    assert 0 < rows["pack:fused_triton^convrot"]["rel_l2_vs_bf16"] < 0.05


# --------------------------------------------------------------------------- ComfyUI 0.33.0 (subprocess)
@pytest.fixture(scope="module")
def current(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res)
    return res


def test_stored_convrot_adopted_as_stored(current):
    assert current["loaded_convrot"] == current["layers"] > 0  # ComfyUI read the rotation from the file
    assert current["adopted"] == current["quantized"] == current["rotated"] == current["layers"]
    assert current["bit_identical"] and current["scales_as_stored"]
    assert current["fusable"] == 0  # fused blocks feed them float inputs


def test_adopted_layer_matches_comfy_kitchen(current):
    for name, (err, bound) in current["vs_kitchen"].items():
        assert err <= bound, (name, err, bound)
    assert current["pack_vs_core_sample"] <= 0.02


def test_save_convrot_loads_in_plain_comfy(current):
    assert current["saved_convrot"] == current["layers"] and current["saved_adopted_identical"]
    assert current["saved_int8_fused_refused"]


def test_apply_rotation_on_float_model(current):
    assert current["float_rotated"] == current["layers"]
    assert current["float_weight_err"] <= 0.5001  # in half steps of each row's grid
    assert current["float_rot_vs_bf16"] <= 0.05


def _write_convrot(sd: dict, names: list, path: str) -> dict:
    """``sd`` with ``names`` in ComfyUI's ConvRot int8_tensorwise layout, quantized by comfy-kitchen's own eager
    code: even layers per output channel (its ConvRot weight quantizer, scale [N, 1]), odd ones with ONE scale for
    the tensor (its rotation, then its tensorwise quantizer). Returns {name: (int8, scale)}."""
    from comfy_kitchen.backends.eager import quantization as ck
    from safetensors.torch import save_file
    out, stored = {}, {}
    for k, v in sd.items():
        p = k[: -len(".weight")]
        if k.endswith(".weight") and p in names:
            if names.index(p) % 2 == 0:
                q, s = ck.quantize_int8_convrot_weight(v.float(), 256)
            else:
                q, s = ck.quantize_int8_tensorwise(ck.rotate_int8_convrot_weight(v.float(), 256))
            conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
            out[k], out[p + ".weight_scale"] = q, s.float()
            out[p + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
            stored[p] = (q, s.float())
        else:
            out[k] = v
    save_file(out, path)
    return stored


def body(pack, models: Path) -> dict:
    """Runs inside ComfyUI 0.33.0 (subprocess): tiny Flux (bench/e2e_models.py's config, detected by ComfyUI)."""
    import comfy.samplers
    import comfy.sd
    from comfy_kitchen.backends.eager import quantization as ck
    sys.path.append(str(ROOT))  # appended: the pack's root must not shadow ComfyUI's modules
    from bench import e2e_models
    cfg = e2e_models.unet_config("flux", True)
    sd, _ = e2e_models.random_state_dict("flux", cfg, torch.device("cpu"))
    sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
    names = sorted(k[: -len(".weight")] for k, v in sd.items() if v.dim() == 2 and k.endswith(".weight")
                   and k.startswith(("double_blocks.", "single_blocks.")) and "mod" not in k.split(".")[-3])
    stored = _write_convrot(sd, names, str(models / "convrot.safetensors"))
    core = comfy.sd.load_diffusion_model(str(models / "convrot.safetensors"))
    dm = core.model.diffusion_model
    loaded = sum(1 for n, m in dm.named_modules() if n in names and getattr(m.weight._params, "convrot", False))

    apply = pack.nodes.apply.ApplyFusedInt8GEMM()
    (q,) = apply.apply(core, "fused_triton", preset="blocks")
    rep = q.int8_report
    layers = pack.nodes.weights.int8_layers(q)
    qb = sys.modules[pack.__name__ + ".quant.blocks"]
    same = all(torch.equal(layers[n].qweight, stored[n][0]) for n in names)
    scales = all(torch.equal(layers[n].weight_scale, stored[n][1].reshape(-1).expand(layers[n].out_features))
                 for n in names)

    # each adopted layer against comfy-kitchen's eager ConvRot linear on the same stored tensors and inputs.
    # Bound: both are sum_k a_k wd[n, k] (wd = stored codes x scale) with the rotated input xr approximated by
    # a_k: ours within s/2 (per-token step s = max|xr| / 127) plus the fp32 rotation's 2^-14 of max|xr|;
    # comfy-kitchen's within s'/2 of its bf16-rounded rotation (2^-8 |xr_k|). Then the bf16 output roundings
    # (ours one, comfy-kitchen's two: product and bias).
    g = torch.Generator().manual_seed(5)
    vs = {}
    for n in names:
        L = layers[n]
        x = (torch.randn(7, L.in_features, generator=g) * (1 + 20 * (torch.arange(L.in_features) % 97 == 0))
             ).to(torch.bfloat16)
        ours = L(x).double()
        ref = ck.int8_linear(x, stored[n][0], stored[n][1], L.bias.to(torch.bfloat16) if L.bias is not None else None,
                             torch.bfloat16, convrot=True, convrot_groupsize=256).double()
        xr = rot64(x.double(), 256)
        s = xr.abs().amax(1, keepdim=True) / 127
        wd = (stored[n][0].double() * stored[n][1].double().reshape(-1, 1)).abs()
        bound = (s * (1 + 2 ** -9) + 2 ** -14 * xr.abs().amax(1, keepdim=True)) @ wd.sum(1, keepdim=True).T
        bound = bound + 2 ** -8 * (xr.abs() @ wd.T) + 2 ** -8 * (ours.abs() + 2 * ref.abs()) + 1e-6
        vs[n] = (float(((ours - ref).abs() / bound).max()), 1.0)

    # sampling (cfg 1, one step): the pack's run vs core's own ConvRot run of the same file
    ctx = torch.randn(1, 16, 64, generator=g)
    extra = {"pooled_output": torch.randn(1, 32, generator=g), "guidance": 3.5}
    latent = torch.zeros(1, 16, 8, 8)
    noise = torch.randn(latent.shape, generator=g)

    def sample(m):
        guider = comfy.samplers.CFGGuider(m)
        guider.set_conds([[ctx, dict(extra)]], [[torch.zeros_like(ctx), dict(extra)]])
        guider.set_cfg(1.0)
        sampler = comfy.samplers.sampler_object("euler")
        sig = comfy.samplers.calculate_sigmas(m.get_model_object("model_sampling"), "simple", 1)
        return guider.sample(noise, latent, sampler, sig, seed=1).double()

    out_core, out_pack = sample(core), sample(q)

    # Save INT8 Model (core layout) -> ComfyUI reads convrot back -> Apply adopts it unchanged; int8_fused refused
    save = pack.nodes.save.SaveInt8Model()
    saved = save.save(q, "convrot_rt", "comfy_int8_tensorwise", False, "blocks")
    core2 = comfy.sd.load_diffusion_model(saved["result"][0])
    dm2 = core2.model.diffusion_model
    saved_convrot = sum(1 for n, m in dm2.named_modules() if n in names and getattr(m.weight._params, "convrot", False)
                        and m.weight._params.convrot_groupsize == 256)
    (q2,) = apply.apply(core2, "torch_int_mm", preset="blocks")
    layers2 = pack.nodes.weights.int8_layers(q2)
    saved_same = all(torch.equal(layers2[n].qweight, layers[n].qweight) and
                     torch.equal(layers2[n].weight_scale, layers[n].weight_scale) for n in names) \
        and len(q2.int8_report.rotated) == len(names)
    try:
        save.save(q, "convrot_pack", "int8_fused", False, "blocks")
        refused = False
    except ValueError as e:
        refused = "ConvRot" in str(e)

    # Apply's rotation on the float model: every block linear rotated (group 256) and quantized from float
    fmodel = comfy.sd.load_diffusion_model_state_dict(dict(sd))
    (qf,) = apply.apply(fmodel, "fused_triton", preset="blocks", rotation="convrot")
    lf = pack.nodes.weights.int8_layers(qf)
    werr = 0.0
    for n in names:
        wr = rot64(sd[n + ".weight"].double(), 256)
        step = lf[n].weight_scale.double()[:, None]
        werr = max(werr, float(((lf[n].qweight.double() * step - wr).abs() / step).max()))
    out_f, out_qf = sample(fmodel), sample(qf)
    return {"layers": len(names), "loaded_convrot": loaded, "adopted": rep.adopted, "quantized": rep.quantized,
            "rotated": len(rep.rotated), "bit_identical": bool(same), "scales_as_stored": bool(scales),
            "fusable": sum(1 for n in names if qb.fusable(layers[n])), "vs_kitchen": vs,
            "pack_vs_core_sample": float((out_pack - out_core).norm() / out_core.norm()),
            "saved_convrot": saved_convrot, "saved_adopted_identical": bool(saved_same),
            "saved_int8_fused_refused": refused, "float_rotated": len(qf.int8_report.rotated),
            "float_weight_err": werr, "float_rot_vs_bf16": float((out_qf - out_f).norm() / out_f.norm())}
