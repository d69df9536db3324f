"""INT8 Calibrate inside the pinned ComfyUI (in-process, CPU): real sampling of a tiny Lumina 2 DiT
with injected activation outlier channels, the Apply node consuming the result, Save/Load nodes,
interrupt and mismatch errors.

Outliers are injected without changing the float function: the RMSNorm gains feeding
``attention.qkv`` and ``feed_forward.w1/w3`` are multiplied by g on a few channels and those weight
columns divided by g; ``feed_forward.w3`` rows are multiplied by g and the matching ``w2`` columns
divided by g (the SwiGLU product is linear in w3). That is the DiT pattern SmoothQuant targets.
"""
import os

import pytest
import torch

import comfy_harness as H

OUT_CH = [5, 40, 77, 101]          # hidden channels given outliers
OUT_GAIN = [25.0, 50.0, 80.0, 120.0]
FFN_CH = [3, 200, 333]             # FFN hidden channels given outliers (w2 inputs)


@pytest.fixture(scope="module")
def comfy(comfy_inprocess):
    import comfy.model_detection
    import comfy.model_management
    import comfy.model_patcher
    import comfy.sample
    import comfy.supported_models
    return comfy


@pytest.fixture(scope="module")
def calib(pack):
    return pack.nodes.calibrate


def inject_outliers(sd: dict) -> dict:
    """Same float function, outlier input channels on qkv, w1, w3 and w2 of every block."""
    sd = {k: v.clone() for k, v in sd.items()}
    gain = torch.tensor(OUT_GAIN)
    blocks = {k.rsplit(".attention.qkv.weight", 1)[0] for k in sd if k.endswith("attention.qkv.weight")}
    for p in blocks:
        sd[f"{p}.attention_norm1.weight"][OUT_CH] *= gain
        sd[f"{p}.attention.qkv.weight"][:, OUT_CH] /= gain
        sd[f"{p}.ffn_norm1.weight"][OUT_CH] *= gain
        for w in ("w1", "w3"):
            sd[f"{p}.feed_forward.{w}.weight"][:, OUT_CH] /= gain
        g2 = torch.tensor([30.0, 60.0, 90.0])
        sd[f"{p}.feed_forward.w3.weight"][FFN_CH] *= g2[:, None]
        sd[f"{p}.feed_forward.w2.weight"][:, FFN_CH] /= g2
    return sd


def tiny_model(comfy, arch="lumina2", outliers=True, seed=0):
    """ModelPatcher of the tiny (width 128) miniature, fp32 on the CPU (as conftest's ``tiny_model``,
    with the outlier channels injected into its state dict)."""
    mini = H.miniature()
    sd = mini.tiny_state_dict(arch, seed)
    if outliers:
        sd = inject_outliers(sd)
    mc = comfy.model_detection.model_config_from_unet_config(dict(mini.TINY_UNET_CONFIG[arch]), sd)
    mc.set_inference_dtype(torch.float32, None)
    cpu = torch.device("cpu")
    model = mc.get_model(sd, "", device=cpu)
    model.diffusion_model.load_state_dict(sd, strict=True)
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def conditioning(seed, tokens=8, width=64):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, tokens, width, generator=g), {}]]


LATENT = {"samples": torch.zeros(1, 16, 16, 16)}
SAMPLE = dict(steps=3, cfg=2.0, sampler_name="euler", scheduler="simple")


def sample(comfy, model, seed, cond_seed):
    lat = LATENT["samples"]
    noise = comfy.sample.prepare_noise(lat, seed)
    return comfy.sample.sample(model, noise, SAMPLE["steps"], SAMPLE["cfg"], SAMPLE["sampler_name"],
                               SAMPLE["scheduler"], conditioning(cond_seed), conditioning(cond_seed + 100),
                               lat, seed=seed, disable_pbar=True)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def calibrate(calib, model, **kw):
    args = dict(seed=1, alpha=0.5, alpha_search=False, protect_top_k=0, protect_threshold=0.0,
                preset="blocks", include="", exclude="", activation_scales="dynamic", **SAMPLE)
    args.update(kw)
    out = calib.Int8Calibrate().calibrate(model, conditioning(1), LATENT, negative=conditioning(101), **args)
    assert set(out) == {"ui", "result"}
    cal, text = out["result"]
    assert out["ui"]["text"] == [text] and text == cal.summary_text()
    return cal


@pytest.fixture(scope="module")
def tiny(comfy):
    return tiny_model(comfy)


@pytest.fixture(scope="module")
def calibrations(calib, tiny):
    return {"plain": calibrate(calib, tiny), "protect": calibrate(calib, tiny, protect_top_k=3),
            "search": calibrate(calib, tiny, alpha_search=True, activation_scales="static", static_buckets=3,
                                exclude="refiner")}


def test_calibration_covers_selected_layers(calib, comfy, tiny, calibrations, pack):
    cal = calibrations["plain"]
    comfy.model_management.load_models_gpu([tiny])
    names = [n for n, _ in pack.quant.select.select_linears(tiny.model.diffusion_model, "blocks")]
    assert list(cal.layers) == names and names
    assert cal.meta["arch"] == "Lumina2" and cal.meta["steps"] == 3 and not cal.meta["unreached"]
    qkv = [l for n, l in cal.layers.items() if n.endswith("attention.qkv")]
    assert all(l.smooth is not None and l.err_smoothed < l.err_plain / 2 for l in qkv), cal.summary_text()
    assert len(calibrations["protect"].protected_names()) == 3
    search = calibrations["search"]
    assert list(search.layers) == [n for n in names if "refiner" not in n]
    for n, l in search.layers.items():
        assert l.err <= cal.layers[n].err + 1e-9
        assert l.static_act_scale.shape == (3,) and (l.static_act_scale > 0).all()
    # no hook left behind on any module of the model
    assert not any(m._forward_pre_hooks for m in tiny.model.diffusion_model.modules())


def test_calibrated_int8_closer_to_float_on_held_out_seed(comfy, pack, tiny, calibrations):
    apply = pack.nodes.apply.ApplyFusedInt8GEMM()
    ref = sample(comfy, tiny, seed=7, cond_seed=7)  # held out: calibration used seed 1
    errs = {}
    for key, cal in [("uncalibrated", None), ("calibrated", calibrations["plain"]),
                     ("calibrated+protect", calibrations["protect"])]:
        (m,) = apply.apply(tiny, "dequant_bf16", "blocks", "", "", "", calibration=cal)
        errs[key] = rel(sample(comfy, m, seed=7, cond_seed=7), ref)
    print("error vs float on a held-out seed:", errs)
    assert errs["calibrated"] < 0.7 * errs["uncalibrated"], errs
    assert errs["calibrated+protect"] < errs["calibrated"], errs


def test_save_load_nodes_round_trip(calib, calibrations, tiny, comfy, tmp_path, monkeypatch):
    import folder_paths
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "int8_calibration", ([str(tmp_path)], {".safetensors"}))
    cal = calibrations["search"]
    calib.SaveInt8Calibration().save(cal, "tiny", overwrite=False)
    assert os.listdir(tmp_path) == ["tiny.safetensors"]
    before = (tmp_path / "tiny.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="tiny.safetensors"):
        calib.SaveInt8Calibration().save(calibrations["plain"], "tiny", overwrite=False)
    assert (tmp_path / "tiny.safetensors").read_bytes() == before
    with pytest.raises(ValueError, match="no folders"):
        calib.SaveInt8Calibration().save(cal, "../escape", overwrite=False)
    assert "tiny.safetensors" in calib.LoadInt8Calibration.INPUT_TYPES()["required"]["calibration_name"][0]
    back, text = calib.LoadInt8Calibration().load("tiny.safetensors", model=tiny)
    for n, l in cal.layers.items():
        b = back.layers[n]
        assert torch.equal(b.smooth, l.smooth) if l.smooth is not None else b.smooth is None
        assert torch.equal(b.static_act_scale, l.static_act_scale)
        assert (b.alpha, b.protected, b.err_plain, b.err_smoothed) == (l.alpha, l.protected, l.err_plain, l.err_smoothed)
    assert not text.startswith("WARNING")
    # same shapes, other weights (e.g. the other Ideogram 4 backbone): loads, with a warning
    _, text2 = calib.LoadInt8Calibration().load("tiny.safetensors", model=tiny_model(comfy, seed=3))
    assert text2.startswith("WARNING: ") and "other weights" in text2
    # a different model: clear error naming layers and shapes
    flux = tiny_model(comfy, "flux", outliers=False)
    with pytest.raises(ValueError, match=r"does not match this model.*layers\.0\.attention\.qkv"):
        calib.LoadInt8Calibration().load("tiny.safetensors", model=flux)


def test_apply_rejects_calibration_of_other_shapes(comfy, pack, calibrations):
    other = tiny_model(comfy, "lumina2", outliers=False)
    cal = calibrations["plain"]
    name = next(iter(cal.layers))
    lc = cal.layers[name]
    bad = type(cal)({name: type(lc)(name, lc.in_features + 1, lc.out_features, None, None, False, 0.1, 0.1)})
    with pytest.raises(ValueError, match=f"{name}.*another model"):
        pack.nodes.apply.ApplyFusedInt8GEMM().apply(other, "dequant_bf16", "blocks", "", "", "", calibration=bad)


def test_interrupt_removes_hooks_and_returns_nothing(calib, comfy, tiny, tmp_path, monkeypatch):
    import folder_paths
    mm = comfy.model_management
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "int8_calibration", ([str(tmp_path)], {".safetensors"}))
    mm.load_models_gpu([tiny])  # undo the object patches of INT8 clones sampled by earlier tests
    first = next(m for n, m in tiny.model.diffusion_model.named_modules() if n.endswith("attention.qkv"))
    calls = []
    assert os.listdir(tmp_path) == []

    def trip(module, args):  # the user presses Cancel during the first step
        calls.append(1)
        mm.interrupt_current_processing(True)
    h = first.register_forward_pre_hook(trip)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            out = calibrate(calib, tiny)
            calib.SaveInt8Calibration().save(out, "never", overwrite=False)  # not reached
    finally:
        h.remove()
        mm.interrupt_current_processing(False)
    assert calls and not any(m._forward_pre_hooks for m in tiny.model.diffusion_model.modules())
    assert os.listdir(tmp_path) == []


def test_progress_bar_and_default_negative(calib, comfy, tiny, monkeypatch):
    import comfy.utils
    seen = []
    monkeypatch.setattr(comfy.utils, "PROGRESS_BAR_HOOK", lambda v, total, preview, node_id=None: seen.append((v, total, node_id)))
    cal, _ = calib.Int8Calibrate().calibrate(tiny, conditioning(1), LATENT, seed=1, steps=2, cfg=3.0,
                                             sampler_name="euler", scheduler="simple", alpha=0.5,
                                             alpha_search=False, protect_top_k=0, protect_threshold=0.0,
                                             preset="blocks", include="", exclude="refiner",
                                             activation_scales="dynamic", unique_id="42")["result"]
    n = len(cal.layers)
    assert n == 10 and seen[-1] == (2 + n, 2 + n, "42")  # steps then layers, on this node
    assert [v for v, _, _ in seen] == sorted(v for v, _, _ in seen)


def test_empty_selection_and_quantized_model_errors(calib, comfy, pack, tiny):
    with pytest.raises(ValueError, match="no linear layer of NextDiT matches"):
        calibrate(calib, tiny, exclude=".")
    (q,) = pack.nodes.apply.ApplyFusedInt8GEMM().apply(tiny, "dequant_bf16", "blocks", "", "", "")
    with pytest.raises(ValueError, match="needs the float model"):
        calibrate(calib, q)


# ---------------------------------------------------------------------- a real server
def test_server_calibrate_save_apply_workflow(comfy_server, miniature_models):
    """UNETLoader -> INT8 Calibrate -> (Save INT8 Calibration, Apply -> KSampler) in a real ComfyUI:
    the summary reaches the UI, the file lands in models/int8_calibration/, the Apply node takes it."""
    import uuid
    from quant.calibrate import Calibration
    info = comfy_server.object_info()
    for cls, shown in [("Int8Calibrate", "INT8 Calibrate"), ("SaveInt8Calibration", "Save INT8 Calibration"),
                       ("LoadInt8Calibration", "Load INT8 Calibration")]:
        assert info[cls]["display_name"] == shown and info[cls]["category"] == "quantization/int8"
    assert info["Int8Calibrate"]["output"] == ["INT8_CALIBRATION", "STRING"]
    name = f"test_{uuid.uuid4().hex[:8]}"
    width, pooled = H.miniature().CONDITIONING["lumina2"]
    wf = {
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": miniature_models["lumina2"], "weight_dtype": "default"}},
        "latent": {"class_type": "EmptyLatentImage", "inputs": {"width": 32, "height": 32, "batch_size": 1}},
        "cond": {"class_type": "Int8TestConditioning",
                 "inputs": {"tokens": 8, "width": width, "pooled_width": pooled, "seed": 0, "scale": 1.0}},
        "calib": {"class_type": "Int8Calibrate", "inputs": {
            "model": ["unet", 0], "positive": ["cond", 0], "latent_image": ["latent", 0], "seed": 1, "steps": 2,
            "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "alpha": 0.5, "alpha_search": False,
            "protect_top_k": 1, "protect_threshold": 0.0, "preset": "blocks", "include": "", "exclude": "refiner",
            "activation_scales": "dynamic"}},
        "save": {"class_type": "SaveInt8Calibration", "inputs": {"calibration": ["calib", 0], "filename": name,
                                                                  "overwrite": False}},
        "apply": {"class_type": "ApplyFusedInt8GEMM", "inputs": {
            "model": ["unet", 0], "backend": "dequant_bf16", "preset": "blocks", "include": "", "exclude": "",
            "keep_float": "", "calibration": ["calib", 0]}},
        "sample": {"class_type": "KSampler", "inputs": {
            "model": ["apply", 0], "positive": ["cond", 0], "negative": ["cond", 0], "latent_image": ["latent", 0],
            "seed": 7, "steps": 1, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "out": {"class_type": "SaveLatent", "inputs": {"samples": ["sample", 0], "filename_prefix": f"calib_{name}"}},
    }
    path = H.COMFY_DIR / "models" / "int8_calibration" / f"{name}.safetensors"
    try:
        entry = comfy_server.run(wf, timeout=900)
        text = entry["outputs"]["calib"]["text"][0]
        assert text.startswith("INT8 calibration: 5 layers, 1 kept in float") and "layers.0.feed_forward.w2" in text
        assert str(path) in entry["outputs"]["save"]["text"][0]
        cal = Calibration.load(path)
        assert list(cal.layers) == [f"layers.0.{n}" for n in ("attention.qkv", "attention.out", "feed_forward.w1",
                                                               "feed_forward.w2", "feed_forward.w3")]
        assert len(cal.protected_names()) == 1 and cal.meta["arch"] == "Lumina2"
        assert len(comfy_server.output_files(entry)) == 1
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.browser
def test_browser_shows_summary_on_the_node(comfy_server):
    """web/int8_calibrate.js in the real frontend (Debian chromium): the summary the node returns in
    ui.text appears in a read-only box on the node and is not saved into the workflow or the prompt."""
    from playwright.sync_api import sync_playwright
    args = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=args)
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(comfy_server.url)
            page.wait_for_function("() => window.app?.graph && window.LiteGraph", timeout=120_000)
            got = page.evaluate("""async () => {
              const n = LiteGraph.createNode("Int8Calibrate");
              app.graph.add(n);
              const before = n.serialize().widgets_values.length;
              n.onExecuted({ text: ["INT8 calibration: 2 layers\\nlayers.0.attention.qkv  0.5"] });
              const w = n.widgets.find((x) => x.name === "int8_calibration_summary");
              const prompt = await app.graphToPrompt();
              const inputs = prompt.output[String(n.id)].inputs;
              return { value: w?.value, readOnly: w?.inputEl?.readOnly, before,
                       after: n.serialize().widgets_values.length, inPrompt: "int8_calibration_summary" in inputs };
            }""")
        finally:
            browser.close()
    assert got["value"] == "INT8 calibration: 2 layers\nlayers.0.attention.qkv  0.5", got
    assert got["readOnly"] is True and got["after"] == got["before"] and not got["inPrompt"], got
    assert not [e for e in errors if "int8_calibrate" in e], errors


# ---------------------------------------------------------------------- Ideogram 4 (current ComfyUI)
_I4_SCRIPT = r'''
import json, sys, importlib, torch
pack = import_pack()
import comfy.sd
from comfy_harness import narrow_ideogram4
i4 = importlib.import_module("comfyui_int8_fused.adapters.ideogram4.layout")
C, A = pack.nodes.calibrate, pack.nodes.apply
w = narrow_ideogram4()
models = {br: comfy.sd.load_diffusion_model_state_dict(i4.random_state_dict(1, w, seed=s), {"dtype": torch.bfloat16})
          for br, s in (("cond", 0), ("uncond", 1))}
g = torch.Generator().manual_seed(5)
pos = [[torch.randn(1, 8, w["text"], generator=g).to(torch.bfloat16), {}]]
lat = {"samples": torch.zeros(1, 128, 4, 4)}
cal = {"cond": C.run_calibration(models["cond"], pos, None, lat, 1, 2, 1.0, "euler", "simple", protect_top_k=1),
       "uncond": C.run_calibration(models["uncond"], pos, None, lat, 1, 2, 4.0, "euler", "simple", protect_top_k=1,
                                   image_tokens_only=True)}
root = lambda br: dict((n, m) for n, m in models[br].model.diffusion_model.named_modules() if isinstance(m, torch.nn.Linear))
wf = lambda br: (lambda n, m: m.weight)
(q,) = A.ApplyFusedInt8GEMM().apply(models["cond"], "dequant_bf16", "blocks", "", "", "", calibration=cal["cond"])
res = {br: {"layers": list(c.layers), "arch": c.meta["arch"], "protected": c.protected_names(),
            "tokens": c.meta["tokens"]["layers.0.attention.qkv"]["tokens"], "image_only": c.meta["image_tokens_only"],
            "smooth_qkv": c.layers["layers.0.attention.qkv"].smooth[:4].tolist(),
            "errs": {n: [l.err_plain, l.err_smoothed] for n, l in c.layers.items()},
            "mismatch_own": c.weight_mismatches(wf(br), root(br)),
            "mismatch_other": c.weight_mismatches(wf(br), root("uncond" if br == "cond" else "cond"))}
       for br, c in cal.items()}
res["apply_kept_float"] = q.int8_report.kept_float
res["apply_smoothed"] = q.int8_report.smoothed
print("RESULT " + json.dumps(res))
'''


def test_ideogram4_backbones_calibrated_separately(comfy_current):
    """Both Ideogram 4 backbones (1 layer at narrow widths: comfy_harness.narrow_ideogram4, random weights) calibrated
    by the node code in a current ComfyUI: the conditional one on [text, image] tokens, the unconditional one on
    image tokens only; each gets its own statistics, and the Apply node takes the result."""
    import json
    cp = H.run_in_current_comfy(_I4_SCRIPT, timeout=3000)
    assert cp.returncode == 0, f"exit {cp.returncode}\n{cp.stdout[-3000:]}\n{cp.stderr[-6000:]}"
    res = json.loads(next(ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    print(json.dumps(res, indent=1))
    block = [f"layers.0.{n}" for n in ("attention.qkv", "attention.o", "feed_forward.w1", "feed_forward.w2",
                                       "feed_forward.w3")]
    c, u = res["cond"], res["uncond"]
    assert sorted(c["layers"]) == sorted(u["layers"]) == sorted(block)
    assert c["arch"] == u["arch"] == "Ideogram4" and u["image_only"] and not c["image_only"]
    assert u["tokens"] < c["tokens"]  # the unconditional backbone saw no text tokens
    assert c["smooth_qkv"] != u["smooth_qkv"]
    assert c["mismatch_own"] == [] and c["mismatch_other"] and u["mismatch_own"] == [] and u["mismatch_other"]
    assert all(0 < e[0] < 0.1 and 0 < e[1] < 0.1 for e in list(c["errs"].values()) + list(u["errs"].values()))
    assert list(res["apply_kept_float"]) == c["protected"] and len(c["protected"]) == 1
    assert res["apply_smoothed"] == 4
