"""Core INT8 models through "Apply Fused INT8 GEMM" on a current ComfyUI (0.33.0): adopted, not re-rounded.

A 1-layer Ideogram 4 (at narrow widths: ComfyUI's config narrowed, ``comfy_harness.narrow_ideogram4``) is written
in ComfyUI's own ``int8_tensorwise`` layout (per-channel scales, built here by hand: int8 = round(W / s), s = max|W_row| / 127) and loaded by
core (``comfy.sd.load_diffusion_model``: QuantizedTensor weights). Apply must then

* adopt the stored int8 weights and scales bit for bit (no second rounding), and say so in its report;
* compute each adopted linear as W8A8 of exactly those weights: checked against a float64 reference
  built here from the stored int8 and scales and a per-token int8 quantization of the input by hand
  (q = round(x / a), a = max|x_row| / 127), within the bf16 rounding of the output;
* sample (2 CFG steps, image-only negative) within 1 % of core's own run of the same file (both are W8A8 of the
  same weights; the per-token activation roundings differ only where ties fall differently);
* round-trip a file written by Save INT8 Model (core layout): core loads it, Apply adopts it unchanged.

Runs in a subprocess (tests/comfy_harness.run_in_current_comfy); skipped, with the reason, without
COMFYUI_CURRENT (scripts/test.sh sets it up from ../shared/comfyui).
"""
import json
import sys
from pathlib import Path

import pytest
import torch


def test_apply_adopts_core_int8_weights_as_stored(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print(res)
    assert res["adopted"] == res["quantized"] == 5 and res["bit_identical"]
    assert res["layer_err_vs_ref"] <= 2 ** -8  # bf16 output rounding (relative)
    assert res["pack_vs_core"] <= 0.01
    assert res["saved_adopted"] == 5 and res["saved_bit_identical"]


def _core_file(sd: dict, names: list, path: str) -> dict:
    """Write ``sd`` with ``names`` in core's int8_tensorwise layout; return {name: (int8, scale)}."""
    from safetensors.torch import save_file
    conf = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
    out, stored = {}, {}
    for k, v in sd.items():
        p = k[: -len(".weight")]
        if k.endswith(".weight") and p in names:
            w = v.double()
            s = w.abs().amax(1) / 127.0
            q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
            out[k], out[p + ".weight_scale"], out[p + ".comfy_quant"] = q, s.float(), conf.clone()
            stored[p] = (q, s.float())
        else:
            out[k] = v
    save_file(out, path)
    return stored


def body(pack, models: Path) -> dict:
    """Runs inside the current ComfyUI (subprocess, ``models`` a fresh default diffusion_models folder)."""
    import comfy.samplers
    import comfy.sd
    from comfy_harness import narrow_ideogram4
    i4 = sys.modules["comfyui_int8_fused.adapters.ideogram4.layout"]
    w = narrow_ideogram4()
    sd = i4.random_state_dict(1, w, seed=3)
    names = [n for n in i4.linear_specs(1, w) if n.startswith("layers.") and n.split(".")[-1] in
             ("qkv", "o", "w1", "w2", "w3")]
    stored = _core_file(sd, names, str(models / "core_i4.safetensors"))
    core = comfy.sd.load_diffusion_model(str(models / "core_i4.safetensors"), model_options={"dtype": torch.bfloat16})
    assert type(core.model.diffusion_model.layers[0].attention.qkv.weight).__name__ == "QuantizedTensor"

    apply = pack.nodes.apply
    (q,) = apply.ApplyFusedInt8GEMM().apply(core, "torch_int_mm", preset="blocks")
    rep = q.int8_report
    layers = pack.nodes.weights.int8_layers(q)
    same = all(torch.equal(layers[n].qweight, stored[n][0]) and torch.equal(layers[n].weight_scale, stored[n][1])
               for n in names)

    # one adopted layer against a float64 W8A8 reference built by hand from the stored tensors
    n0 = "layers.0.attention.o"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, w["hidden"], generator=g).to(torch.bfloat16)
    a = x.double().abs().amax(1, keepdim=True) / 127.0
    xq = torch.round(x.double() / a).clamp(-127, 127)
    qw, sw = stored[n0]
    ref = (xq @ qw.double().T) * a * sw.double()[None, :]
    got = layers[n0](x).double()
    layer_err = float((got - ref).abs().max() / ref.abs().max())

    # sampling: core's own INT8 run vs the pack on the same file (DualModelGuider, image-only negative)
    positive = [[torch.randn(1, 8, w["text"], generator=g), {}]]
    latent = torch.zeros(1, 128, 4, 4)

    def sample(model):
        return sample_image_only_cfg(model, positive, latent, 2).double()  # noqa: F821 (comfy_harness)

    out_core, out_pack = sample(core), sample(q)
    pack_vs_core = float((out_pack - out_core).norm() / out_core.norm())

    # Save INT8 Model (core layout) -> core loads it -> Apply adopts it unchanged
    saved = pack.nodes.save.SaveInt8Model().save(q, "core_rt", "comfy_int8_tensorwise", False, "blocks")
    path = saved["result"][0] if isinstance(saved, dict) else saved[0]
    core2 = comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.bfloat16})
    (q2,) = apply.ApplyFusedInt8GEMM().apply(core2, "torch_int_mm", preset="blocks")
    layers2 = pack.nodes.weights.int8_layers(q2)
    saved_same = all(torch.equal(layers2[n].qweight, layers[n].qweight) and
                     torch.equal(layers2[n].weight_scale, layers[n].weight_scale) for n in names)
    return {"adopted": rep.adopted, "quantized": rep.quantized, "bit_identical": bool(same),
            "layer_err_vs_ref": layer_err, "pack_vs_core": pack_vs_core,
            "saved_adopted": q2.int8_report.adopted, "saved_bit_identical": bool(saved_same)}
