"""Interop round trips on the current ComfyUI (0.33.0) for every architecture with an adapter (issue 39, item 4).

Per architecture (Flux.1, Wan 2.1, SD3, Lumina 2, Qwen-Image, Ideogram 4; Chroma and Flux.2, which the Flux adapter
serves, and Wan 2.2 TI2V 5B, which the Wan adapter serves) a miniature with random weights is built with ComfyUI's
own classes, written as a bf16 safetensors file and loaded by ComfyUI's loader (``comfy.sd.load_diffusion_model``,
what UNETLoader calls). Flux.1, Flux.2, Wan 2.1 / 2.2 and SD3: width 128, which ComfyUI's detection rebuilds from the
weights. The others have widths ComfyUI fixes, and both processes narrow those first (``_narrow``), changing nothing
else: Ideogram 4's model config (``comfy_harness.narrow_ideogram4``: 2 heads of the real 256), Qwen-Image's (1 head of
the real 128, text 64: its widths are the model class's defaults, which the config overrides), and the constants
detection sets for Lumina 2 (heads and RoPE from the width: 3 heads of the real 96, 1 KV head) and for Chroma (the
approximator: out = the width 128, hidden 256). Detection still finds every architecture from the file's keys. Wan 2.2
5B samples image to video (``FIRST_FRAME``). Then, on the CPU:

a. Apply Fused INT8 GEMM (fused_triton: the adapter's fused blocks) -> Save INT8 Model (``comfy_int8_tensorwise``):
   the file's int8 codes and scales are Apply's, bit for bit. A second process that never imports the pack loads the
   file with ComfyUI's loader (the int8 layers as core ``QuantizedTensor`` weights) and samples it (2 euler steps,
   cfg 1, fixed noise; compared: the model's output at each step): within ``BOUND_SAME`` of the pack model's and
   within ``BOUND_FLOAT`` of the float model's; every int8 layer's output there, on the input it got, within
   ``BOUND_LAYER`` of what the file's weights give (``_layers_vs_file``).
   The pack models are sampled on fused_triton (Triton interpreter), Lumina 2 and Flux.2 on torch_int_mm
   (``SAMPLE_BACKEND``: the same int8 codes, checked).
b. The same file loaded by ComfyUI and put through Apply again: every int8 layer adopted as stored (codes and scales
   equal to the file's bit for bit, none re-quantized), and its outputs equal the first Apply's bit for bit.
c. INT8 Calibrate (2 steps) -> Apply with the calibration -> Save (core format) folds the smoothing: per weight
   element ``|dequant(file) - W| <= a1 / (2 s) + a2 / 2`` (``a1`` the smoothed layer's step, ``s`` its smoothing
   factor, ``a2`` the file's step: ``Q(W s) / s`` re-rounded, see ``quant.fmt_write.fold_smoothing``), and the plain
   process samples the file within ``2 * BOUND_FLOAT`` of the calibrated pack model (both within ``BOUND_FLOAT`` of
   the float model). Calibration, the smoothing and its fold name no model (``quant.calibrate``,
   ``quant.fmt_write``); the calibrated file's layout is Save's (checked per architecture in a.). Shared-input
   groups (Wan's q / k / v: one smoothing vector) and stacked layers (Flux.1's qkv) are among them.

Bounds. ``BOUND_SAME``: the pack and core (comfy-kitchen's ``int8_linear``) multiply the same int8 weights with
per-row int8 activations (step ``absmax / 127`` both), exactly in int32; they differ only in bf16 roundings of the
dequantized outputs (at most 2^-8 relative) and the activation codes those move by one. Up to 20 quantized linears
run in sequence (Lumina 2: 2 + 2 refiner blocks and 1 layer, 4 each; Chroma and Flux.2 6: a double block's qkv,
proj, mlp.0, mlp.2, a single block's linear1, linear2; Wan 2.2 6: self- and cross-attention q, o, ffn.0, ffn.2), the
roundings independent: sqrt(20) * 2^-8 = 1.7 %, so 2 %. A layer ComfyUI dequantizes instead (``BOUND_LAYER``; Flux.2's
bias-free attention projections, one a stream) leaves its activations unrounded: ~0.9 % (``BOUND_FLOAT``) for each,
at most 2 (img and txt, side by side): sqrt(2) * 0.9 % = 1.3 %, within 2 %.
``BOUND_LAYER``: the float64 reference takes the activation codes comfy-kitchen's ``int8_linear`` takes and
multiplies exactly; what remains is the output's rounding (at most one bf16 rounding, 2^-9 an element, and the fp32
scale products): 2^-8. Where ComfyUI dequantizes the weight instead (comfy-kitchen's fallback for an op it does not
handle: the ``expand`` torch's matmul issues for Flux.2's bias-free attention projections), the reference is the
dequantized weight's product, with the same rounding.
``BOUND_FLOAT``: one W8A8 linear is ~1 % from its float product (weight and activation each rounded to steps of
``absmax / 127``: rms error ``step / sqrt(12)`` ~ 0.9 % of the rms for absmax ~ 4 rms, ~1.2 % for ~5 rms at width
3072); n in sequence, their errors independent as in ``BOUND_SAME``: sqrt(n) times one's, for the 6 of Chroma, Flux.2
and Wan 2.2 at most sqrt(6) * 1.2 % = 2.9 %, for Lumina 2's 20 sqrt(20) * 0.9 % = 4.0 %: 5 % (the bound
tests/test_ideogram4_current.py uses). Runs in two subprocesses (tests/comfy_harness.py);
skipped, naming COMFYUI_CURRENT, without a current ComfyUI.
"""
import json
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
from comfy_harness import NARROW_IDEOGRAM4, NARROW_QWEN

pytestmark = pytest.mark.slow
ARCHS = ("flux", "wan", "sd3", "lumina2", "qwen_image", "ideogram4", "chroma", "flux2", "wan22")
BOUND_SAME = 0.02
BOUND_FLOAT = 0.05
BOUND_LAYER = 2.0 ** -8
STEPS = 2
FUSED = ("flux", "wan", "lumina2", "qwen_image", "ideogram4", "chroma", "flux2", "wan22")  # fused blocks built
# image to video (Wan 2.2 TI2V 5B as Wan22ImageToVideoLatent sets it up): latent frame 0 a start image's, kept by a
# denoise mask 0 there, so WAN22 runs per-frame timesteps (per-token modulation); the kept frame's output is the
# start image whatever the model, so only the denoised frames are compared
FIRST_FRAME = ("wan22",)
ADAPTER = {"chroma": "flux", "flux2": "flux", "wan22": "wan"}  # the adapter serving it, where not its own

# unet configs as ComfyUI 0.33.0's detection rebuilds them from the weights (checked: the loaded model's state dict
# has the file's keys and shapes)
CONFIGS = {
    "flux": dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=64, context_in_dim=64,
                 hidden_size=128, mlp_ratio=4.0, num_heads=1, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56],
                 theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False, txt_ids_dims=[]),
    "wan": dict(image_model="wan2.1", model_type="t2v", dim=128, out_dim=16, num_heads=1, ffn_dim=256, num_layers=2,
                patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True,
                eps=1e-6, in_dim=16),
    "sd3": dict(in_channels=16, patch_size=2, out_channels=16, depth=2, input_size=None, adm_in_channels=64,
                context_embedder_config={"target": "torch.nn.Linear",
                                         "params": {"in_features": 64, "out_features": 128}},
                num_patches=256, pos_embed_max_size=16, pos_embed_scaling_factor=None, x_block_self_attn_layers=[]),
    # Lumina 2: detection sets the heads and RoPE from the width (2304: 24 heads of 96, 8 KV heads); both processes
    # narrow that (_narrow): 3 heads of 96, 1 KV head (the same grouped attention), width 288
    "lumina2": dict(image_model="lumina2", patch_size=2, in_channels=16, dim=288, cap_feat_dim=64, n_layers=1,
                    qk_norm=True, n_heads=3, n_kv_heads=1, axes_dims=[32, 32, 32], axes_lens=[300, 512, 512],
                    rope_theta=10000.0, ffn_dim_multiplier=4.0),
    # Qwen-Image: its widths are the model class's defaults, which ComfyUI's model config can set (its
    # unet_extra_config, empty in 0.33.0): both processes set one head of the real 128 and text 64 first (_narrow)
    "qwen_image": dict(image_model="qwen_image", in_channels=64, num_layers=1),
    # Ideogram 4: ComfyUI's model config fixes the widths; both processes narrow that config first
    # (comfy_harness.narrow_ideogram4: 2 heads of the real 256)
    "ideogram4": dict(image_model="ideogram4", in_channels=128, num_layers=1),
    # Chroma: detection fixes the approximator (in 64, hidden 5120, 5 layers, out 3072), whose output is the
    # blocks' modulation: width 3072 (24 heads of 128); both processes narrow those constants (_narrow): out = the
    # width 128 (1 head of 128), hidden 256
    "chroma": dict(image_model="chroma", in_channels=64, out_channels=64, vec_in_dim=None, context_in_dim=64,
                   hidden_size=128, mlp_ratio=4.0, num_heads=1, depth=1, depth_single_blocks=1,
                   axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, txt_ids_dims=[], in_dim=64,
                   out_dim=128, hidden_dim=256, n_layers=5),
    # Flux.2: detection sets heads = width / 128 (axes 4 x 32)
    "flux2": dict(image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=64,
                  hidden_size=128, mlp_ratio=3.0, num_heads=1, depth=1, depth_single_blocks=1,
                  axes_dim=[32, 32, 32, 32], theta=2000, patch_size=1, qkv_bias=False, ops_bias=False,
                  global_modulation=True, mlp_silu_act=True, txt_ids_dims=[3], default_ref_method="index",
                  ref_index_scale=10.0, guidance_embed=False, yak_mlp=False, txt_norm=False),
    # Wan 2.2 TI2V 5B: out_dim 48 selects WAN22_T2V (model_base.WAN22)
    "wan22": dict(image_model="wan2.1", model_type="t2v", dim=128, out_dim=48, num_heads=1, ffn_dim=256,
                  num_layers=1, patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True,
                  cross_attn_norm=True, eps=1e-6, in_dim=48),
}
# (latent shape, text tokens x width, pooled width or 0). A few tokens each (4 image tokens: a 2 x 2 patch grid, 2
# latent frames for the Wans; Ideogram 4 1 x 2 tokens and 2 text tokens): plain ComfyUI's int8 layers run
# torch._int_mm, which on the CPU costs ~0.2 s per token a step at width 3072 (the real-width models' samples were
# most of this file's time), and the Triton interpreter's row kernels cost per row. Flux.2's text is padded to 512
# tokens by its model_base whatever is given.
INPUTS = {"flux": ((1, 16, 4, 4), (4, 64), 64), "wan": ((1, 16, 2, 4, 4), (4, 4096), 0),
          "sd3": ((1, 16, 4, 4), (4, 64), 64), "lumina2": ((1, 16, 4, 4), (4, 64), 0),
          "qwen_image": ((1, 16, 1, 4, 4), (4, NARROW_QWEN["joint_attention_dim"]), 0),
          "ideogram4": ((1, 128, 1, 2), (2, NARROW_IDEOGRAM4["llm_features_dim"]), 0),
          "chroma": ((1, 16, 4, 4), (4, 64), 0), "flux2": ((1, 128, 4, 4), (8, 64), 0),
          "wan22": ((1, 48, 2, 4, 4), (4, 4096), 0)}
# Apply and Save run on fused_triton for every architecture (fused blocks built, no kernel run); the pack models are
# sampled on fused_triton (the Triton interpreter), except on torch_int_mm (the same int8 codes, checked) for Lumina 2,
# whose 2 + 2 refiner blocks and layer take ~17 s a sample in the interpreter (its fused blocks' numerics:
# tests/test_lumina2_fused.py), and Flux.2, whose model_base pads the text to 512 tokens (~100 s a forward there)
SAMPLE_BACKEND = {"flux": "fused_triton", "wan": "fused_triton", "sd3": "fused_triton", "lumina2": "torch_int_mm",
                  "qwen_image": "fused_triton", "ideogram4": "fused_triton", "chroma": "fused_triton",
                  "flux2": "torch_int_mm", "wan22": "fused_triton"}


# ----------------------------------------------------------------------------------- the test
@pytest.fixture
def results(comfy_current, arch):
    """Both subprocesses for one architecture: {"pack": {...}, "plain": {...}}. One test per architecture, so each
    runs within one test's timeout and the architectures spread over the test workers."""
    work = Path(tempfile.mkdtemp(prefix=f"int8_interop_{arch}_"))
    try:
        pack = _run("pack_body", work, [arch])
        plain = _run("plain_body", work, [arch])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"pack": pack[arch], "plain": plain.get(arch, {"error": "not run"})}


_SCRIPT = """\
import json, runpy
ns = runpy.run_path({file!r}, init_globals={{"import_pack": import_pack}})
print("RESULT " + json.dumps(ns[{fn!r}]({work!r}, {archs!r})))
"""


def _run(fn: str, work: Path, archs: list) -> dict:
    from comfy_harness import run_in_current_comfy
    cp = run_in_current_comfy(_SCRIPT.format(file=__file__, fn=fn, work=str(work), archs=archs), timeout=2400)
    print("\n".join(ln for ln in cp.stdout.splitlines() if not ln.startswith("RESULT "))[-3000:])
    if cp.returncode != 0:
        raise AssertionError(f"{fn}: exit {cp.returncode}\n{cp.stdout[-3000:]}\n{cp.stderr[-6000:]}")
    return json.loads(next(ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT "))[7:])


@pytest.mark.parametrize("arch", ARCHS)
def test_core_file_round_trip(results, arch):
    pack, plain = results["pack"], results["plain"]
    assert "error" not in pack, pack.get("error")
    assert "error" not in plain, plain.get("error")
    assert pack["adapter"] == ADAPTER.get(arch, arch) and pack["loaded_as_file"], _brief(pack)
    # a. Save wrote Apply's int8 codes and scales; plain ComfyUI (no pack imported) reads them as core int8
    assert pack["int8_layers"] > 0 and pack["saved_equal_apply"] and pack["sampled_codes_equal"], _brief(pack)
    assert arch not in FUSED or pack["fused_modules"], _brief(pack)  # Save collected from fused blocks
    assert plain["pack_imported"] == [], plain["pack_imported"][:10]
    assert plain["core_int8_layers"] == pack["int8_layers"] and plain["keys_equal_file"], _brief(plain)
    rel = _rels(_outputs(pack, plain))
    print(arch, pack["seconds"], rel, {k: plain.get(k) for k in ("layers_rel", "cal_layers_rel")})
    print("seconds per stage: pack", pack["laps"], "plain", plain["laps"])
    # every core int8 layer multiplied the file's weights as the pack quantized them
    assert plain["layers_run"] == pack["int8_layers"] and plain["layers_rel"] <= BOUND_LAYER, _brief(plain)
    assert rel["core_vs_pack"] <= BOUND_SAME, rel
    assert 0 < rel["core_vs_float"] <= BOUND_FLOAT and 0 < rel["pack_vs_float"] <= BOUND_FLOAT, rel
    # b. the file back through Apply: adopted as stored, the same sample bit for bit
    assert pack["adopted"] == pack["int8_layers"] and pack["adopted_quantized"] == 0, _brief(pack)
    assert pack["adopted_bit_identical"] and pack["adopted_sample_equal"], _brief(pack)
    # c. calibrated: smoothing folded within the two roundings, the file loads and samples in plain ComfyUI
    assert pack["smoothed_layers"] > 0 and pack["fold_within_bound"], _brief(pack)
    assert pack["cal_file_keys"] == pack["file_keys"], "the calibrated file has another layout"
    assert plain["cal_core_int8_layers"] == pack["int8_layers"], _brief(plain)
    assert plain["cal_layers_run"] == pack["int8_layers"] and plain["cal_layers_rel"] <= BOUND_LAYER, _brief(plain)
    assert rel["cal_core_vs_cal_pack"] <= 2 * BOUND_FLOAT, rel
    assert rel["cal_pack_vs_float"] <= BOUND_FLOAT and rel["cal_core_vs_float"] <= BOUND_FLOAT, rel


def _brief(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ("outputs", "file_keys", "cal_file_keys")}


def _outputs(pack: dict, plain: dict) -> dict:
    return {k: torch.tensor(v) for k, v in {**pack["outputs"], **plain["outputs"]}.items()}


def _rels(o: dict) -> dict:
    def rel(a, b):
        return float((o[a].double() - o[b].double()).norm() / o[b].double().norm())
    pairs = {"core_vs_pack": ("core", "pack"), "core_vs_float": ("core", "float"), "pack_vs_float": ("pack", "float"),
             "cal_core_vs_cal_pack": ("cal_core", "cal_pack"), "cal_pack_vs_float": ("cal_pack", "float"),
             "cal_core_vs_float": ("cal_core", "float")}
    return {k: rel(a, b) for k, (a, b) in pairs.items() if a in o and b in o}


# ----------------------------------------------------------------------------------- inside ComfyUI 0.33.0
def _init_(dm, seed: int) -> dict:
    """Random bf16 weights: norms ~1, biases small, matrices N(0, 1 / fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, t in dm.state_dict(keep_vars=True).items():
            if not t.is_floating_point():
                continue
            if t.dim() == 1:
                v = (1 + 0.05 * torch.randn(t.shape, generator=g)) if ("norm" in n or n.endswith("scale")) \
                    else 0.02 * torch.randn(t.shape, generator=g)
            else:  # modulation at full gain too: gates O(1), so the blocks' INT8 error is not damped
                v = torch.randn(t.shape, generator=g) / (t[0].numel() ** 0.5)
            t.copy_(v)
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in dm.state_dict().items()}


def _float_file(arch: str, path: str) -> None:
    import comfy.model_detection as md
    from safetensors.torch import save_file
    mc = md.model_config_from_unet_config(dict(CONFIGS[arch]), {})
    mc.set_inference_dtype(torch.float32, None)
    model = mc.get_model({}, "", device=torch.device("cpu"))
    save_file(_init_(model.diffusion_model, seed=ARCHS.index(arch)), path)


def _conds(arch: str):
    """(positive, latent, denoise mask or None)."""
    lat, (n, w), pooled = INPUTS[arch]
    g = torch.Generator().manual_seed(7)
    extra = {"pooled_output": torch.randn(1, pooled, generator=g)} if pooled else {}
    positive, latent, mask = [[torch.randn(1, n, w, generator=g), extra]], torch.zeros(lat), None
    if arch in FIRST_FRAME:
        latent[:, :, :1] = torch.randn(latent[:, :, :1].shape, generator=g)
        mask = torch.ones((lat[0], 1, *lat[2:]))
        mask[:, :, :1] = 0.0
    return positive, latent, mask


def _sample(model, arch: str) -> torch.Tensor:
    """ComfyUI's sampler, euler / simple, ``STEPS`` steps, cfg 1 (the positive only), fixed noise; returns the model's
    outputs along the way (``(x - denoised) / sigma`` of each step: these flow models' velocity), which the noise in
    the sample would dilute."""
    import comfy.samplers
    positive, latent, mask = _conds(arch)
    guider = comfy.samplers.CFGGuider(model)
    guider.set_conds(positive, positive)
    guider.set_cfg(1.0)
    sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "simple", STEPS)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(11))
    v = []
    guider.sample(noise, latent, comfy.samplers.sampler_object("euler"), sigmas, denoise_mask=mask,
                  disable_pbar=True, seed=0,
                  callback=lambda i, den, x, n: v.append(((x - den) / sigmas[i]).float().cpu()))
    v = torch.stack(v)
    return v if mask is None else v[:, :, :, 1:]  # the denoised frames


def _load(path: str):
    import comfy.sd
    return comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.bfloat16})


def _file(path: str) -> dict:
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _same_codes(layers: dict, ref: dict) -> bool:
    """Whether ``layers`` ({name: Int8Linear}) hold the int8 codes and scales of ``ref`` ({name: (int8, scale)} or
    Int8Linear), bit for bit, under the same names."""
    def codes(m):
        return m if isinstance(m, tuple) else (m.qweight.cpu(), m.weight_scale.float().cpu().reshape(-1))
    return sorted(layers) == sorted(ref) and all(
        torch.equal(a, b) for n in ref for a, b in zip(codes(layers[n]), codes(ref[n])))


def _free():
    import gc

    import comfy.model_management as mm
    mm.unload_all_models()
    gc.collect()


def _pack_arch(pack, arch: str, work: Path) -> dict:
    A, nodes = pack.adapters, pack.nodes
    lap = _Laps()
    fpath = str(work / f"{arch}_float.safetensors")
    _float_file(arch, fpath)
    lap("float file")
    fl = _load(fpath)
    dm = fl.model.diffusion_model
    res = {"adapter": getattr(A.adapter_for(dm), "name", None),
           "loaded_as_file": {k: tuple(v.shape) for k, v in dm.state_dict().items()}
           == {k: tuple(v.shape) for k, v in _file(fpath).items()}}
    out = {"float": _sample(fl, arch)}
    lap("load + float sample")

    # a. Apply -> Save (core format)
    apply = nodes.apply.ApplyFusedInt8GEMM().apply
    sb = SAMPLE_BACKEND[arch]
    (q,) = apply(fl, "fused_triton")
    lap("apply")
    layers = nodes.weights.int8_layers(q)
    res["fused_modules"] = sorted({type(m).__name__ for m in q.object_patches.values() if hasattr(m, "covers")})
    qs = q if sb == "fused_triton" else apply(fl, sb)[0]
    res["sampled_codes_equal"] = _same_codes(nodes.weights.int8_layers(qs), layers)
    out["pack"] = _sample(qs, arch)
    lap("pack sample")
    save = nodes.save.SaveInt8Model()
    (core_path,) = save.save(q, f"rt_{arch}", "comfy_int8_tensorwise", False, "blocks")["result"]
    os.replace(core_path, work / f"{arch}_core.safetensors")
    core_path = str(work / f"{arch}_core.safetensors")
    stored = _file(core_path)
    names = sorted(k[: -len(".comfy_quant")] for k in stored if k.endswith(".comfy_quant"))
    as_file = {n: (stored[n + ".weight"], stored[n + ".weight_scale"].float().reshape(-1)) for n in names}
    res["int8_layers"] = len(names)
    res["file_keys"] = sorted(stored)
    res["saved_equal_apply"] = _same_codes(layers, as_file)
    del q, qs, layers
    _free()
    lap("save")

    # b. the file back through Apply
    core = _load(core_path)
    (q2,) = apply(core, "fused_triton")
    rep = q2.int8_report
    res["adopted"], res["adopted_quantized"] = rep.adopted, rep.quantized - rep.adopted
    res["adopted_bit_identical"] = _same_codes(nodes.weights.int8_layers(q2), as_file)
    q2s = q2 if sb == "fused_triton" else apply(core, sb)[0]
    res["adopted_sample_equal"] = bool(torch.equal(_sample(q2s, arch), out["pack"]))
    del q2, q2s, core, stored, as_file
    _free()
    lap("b: adopt + sample")

    # c. Calibrate -> Apply -> Save (core format, smoothing folded)
    _calibrated(nodes, fl, arch, fpath, work, out, res, lap)
    res["outputs"], res["laps"] = {k: v.tolist() for k, v in out.items()}, lap.laps
    del fl, dm
    _free()
    return res


def _calibrated(nodes, fl, arch: str, fpath: str, work: Path, out: dict, res: dict, lap) -> None:
    """Stage c on the float model ``fl``: its outputs into ``out``, its checks into ``res``."""
    positive, latent, mask = _conds(arch)
    lat = {"samples": latent} if mask is None else {"samples": latent, "noise_mask": mask}
    cal = nodes.calibrate.run_calibration(fl, positive, None, lat, 0, 2, 1.0, "euler", "simple")
    lap("c: calibrate")
    (qc,) = nodes.apply.ApplyFusedInt8GEMM().apply(fl, SAMPLE_BACKEND[arch], calibration=cal)
    out["cal_pack"] = _sample(qc, arch)
    lap("c: apply + sample")
    (cal_path,) = nodes.save.SaveInt8Model().save(qc, f"rt_{arch}_cal", "comfy_int8_tensorwise", False,
                                                   "blocks")["result"]
    os.replace(cal_path, work / f"{arch}_cal.safetensors")
    cal_file = _file(str(work / f"{arch}_cal.safetensors"))
    res["cal_file_keys"] = sorted(cal_file)
    smoothed, ok = 0, True
    floats = _file(fpath)
    for n, L in nodes.weights.int8_layers(qc).items():
        if L.smooth is None:
            continue
        smoothed += 1
        s, a1 = L.smooth.float().cpu(), L.weight_scale.float().cpu()
        a2 = cal_file[n + ".weight_scale"].float().reshape(-1)
        w = floats[n + ".weight"].float()
        deq = cal_file[n + ".weight"].float() * a2[:, None]
        bound = a1[:, None] / (2 * s[None, :]) + a2[:, None] / 2
        ok &= bool(((deq - w).abs() <= bound * (1 + 1e-5) + 1e-7).all())
    res["smoothed_layers"], res["fold_within_bound"] = smoothed, ok
    del qc, floats, cal, cal_file
    _free()
    lap("c: save + fold check")


class _Laps:
    """Seconds per stage, printed with the results (where a slow architecture spends its time)."""

    def __init__(self):
        self.t, self.laps = time.perf_counter(), {}

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        self.laps[stage] = round(now - self.t, 1)
        self.t = now


# what ComfyUI 0.33.0's detection sets as constants: Lumina 2's heads and RoPE (from its width 2304), Chroma's
# approximator
DETECTION_FIXED = {"lumina2": ("n_heads", "n_kv_heads", "axes_dims", "axes_lens", "rope_theta", "ffn_dim_multiplier"),
                   "chroma": ("in_dim", "out_dim", "hidden_dim", "n_layers")}


def _narrow(archs) -> None:
    """ComfyUI's model configs at narrow widths (``CONFIGS``), in each process that builds or loads one."""
    if "ideogram4" in archs:
        from comfy_harness import narrow_ideogram4
        narrow_ideogram4()
    if "qwen_image" in archs:
        from comfy_harness import narrow_qwen_image
        narrow_qwen_image()
    if "lumina2" in archs or "chroma" in archs:  # the constants detection fixes, nothing else
        import comfy.model_detection as md
        detect = md.detect_unet_config

        def narrowed(state_dict, key_prefix, metadata=None):
            c = detect(state_dict, key_prefix, metadata=metadata)
            arch = c.get("image_model") if isinstance(c, dict) else None
            if arch in DETECTION_FIXED:
                c.update({k: CONFIGS[arch][k] for k in DETECTION_FIXED[arch]})
            return c
        md.detect_unet_config = narrowed


def pack_body(work: str, archs: list) -> dict:
    """Pack process: float file, Apply, Save, adoption, calibration (one architecture at a time)."""
    import folder_paths
    _narrow(archs)
    pack = import_pack()  # noqa: F821 (comfy_harness prelude)
    models = Path(work) / "unet"
    models.mkdir(parents=True, exist_ok=True)
    folder_paths.add_model_folder_path("diffusion_models", str(models), is_default=True)
    res = {}
    for arch in archs:
        t0 = time.perf_counter()
        try:
            res[arch] = _pack_arch(pack, arch, Path(work))
            res[arch]["seconds"] = round(time.perf_counter() - t0, 1)
        except Exception:
            res[arch] = {"error": traceback.format_exc()[-4000:]}
        _free()
        Path(work, f"{arch}_float.safetensors").unlink(missing_ok=True)  # only the core files go on (disk is small)
    return res


class _LayerCapture:
    """(input, output) of each core int8 layer's first call while active: its forward, or ComfyUI's
    ``comfy.ops.linear_input_act`` (Wan's FFN: the activation folded into comfy-kitchen's quantizer, the layer's
    forward never called; its input is then the activation's output)."""

    def __init__(self, dm):
        self.mods = {n: x for n, x in dm.named_modules()
                     if type(getattr(x, "weight", None)).__name__ == "QuantizedTensor"}
        self.names = {id(m): n for n, m in self.mods.items()}
        self.seen = {}

    def _keep(self, name, x, out):
        if name is not None and name not in self.seen:
            self.seen[name] = (x.detach().float().cpu().clone(), out.detach().float().cpu().clone())

    def __enter__(self):
        import comfy.ops
        self.ops, self.input_act = comfy.ops, comfy.ops.linear_input_act

        def input_act(linear, x, act):
            out = self.input_act(linear, x, act)
            self._keep(self.names.get(id(linear)), comfy.ops.INPUT_ACT_EAGER[act](x), out)
            return out
        comfy.ops.linear_input_act = input_act
        self.hooks = [m.register_forward_hook(lambda mod, args, out, n=n: self._keep(n, args[0], out))
                      for n, m in self.mods.items()]
        return self

    def __exit__(self, *exc):
        self.ops.linear_input_act = self.input_act
        for h in self.hooks:
            h.remove()


def _layers_vs_file(seen: dict, stored: dict) -> tuple[float, str]:
    """Largest relative distance (and its layer) of a core int8 layer's output from what the file's weights give on
    the same input: per-row int8 activations (comfy-kitchen's rule: step absmax / 127, round half to even) times the
    int8 codes times the per-channel scales, or, where ComfyUI dequantizes the weight instead, the input times the
    dequantized weight; the nearer of the two, in float64."""
    worst, name = 0.0, ""
    for n, (x, y) in seen.items():
        w = stored[n + ".weight"].double() * stored[n + ".weight_scale"].double().reshape(-1, 1)
        x, y = x.reshape(-1, x.shape[-1]).double(), y.reshape(-1, y.shape[-1]).double()
        step = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30)
        b = stored[n + ".bias"].double() if n + ".bias" in stored else 0.0
        d = min(float((y - r).norm() / r.norm()) for r in (torch.round(x / step) * step @ w.T + b, x @ w.T + b))
        if d >= worst:
            worst, name = d, n
    return worst, name


def plain_body(work: str, archs: list) -> dict:
    """Plain ComfyUI (the pack never imported): load the core files with ComfyUI's loader and sample them."""
    import sys
    _narrow(archs)
    res = {}
    for arch in archs:
        try:
            r, outs, lap = {}, {}, _Laps()
            for tag, name in (("", "core"), ("cal_", "cal")):
                path = str(Path(work) / f"{arch}_{name}.safetensors")
                m = _load(path)
                dm = m.model.diffusion_model
                r[tag + "core_int8_layers"] = sum(type(getattr(x, "weight", None)).__name__ == "QuantizedTensor"
                                                  for x in dm.modules())
                if not tag:
                    r["keys_equal_file"] = set(dm.state_dict()) >= {k for k in _file(path) if not k.endswith(
                        (".comfy_quant", ".weight_scale"))}
                with _LayerCapture(dm) as cap:
                    outs[tag + "core"] = _sample(m, arch).tolist()
                r[tag + "layers_run"] = len(cap.seen)
                r[tag + "layers_rel"], r[tag + "layers_worst"] = _layers_vs_file(cap.seen, _file(path))
                del m, dm, cap
                _free()
                lap(name)
            r["outputs"], r["laps"] = outs, lap.laps
            root = Path(__file__).resolve().parents[1]
            mine = tuple(str(root / d) + os.sep for d in ("kernel", "quant", "adapters", "nodes"))
            stub = sys.modules.get("comfyui_int8_fused")  # the harness registers the package, unexecuted
            r["pack_imported"] = sorted(k for k, v in list(sys.modules.items()) if k.startswith("comfyui_int8_fused.")
                                        or str(getattr(v, "__file__", None) or "").startswith(mine))
            r["pack_imported"] += ["comfyui_int8_fused"] if "WEB_DIRECTORY" in vars(stub or object) else []
            res[arch] = r
        except Exception:
            res[arch] = {"error": traceback.format_exc()[-4000:]}
        for name in ("core", "cal"):
            Path(work, f"{arch}_{name}.safetensors").unlink(missing_ok=True)
    return res
