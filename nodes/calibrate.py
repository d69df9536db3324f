"""Nodes "INT8 Calibrate", "Save INT8 Calibration", "Load INT8 Calibration" (thin over quant/calibrate.py).

INT8 Calibrate runs real sampling steps of the float MODEL it is given (``comfy.sample.sample``, the
KSampler path) with forward pre-hooks on the selected linears, then computes per layer the
SmoothQuant vector, the W8A8 error with and without it, and the layers to keep in float. Each MODEL
gets its own statistics: the two Ideogram 4 backbones are calibrated by two nodes; the one for the
unconditional backbone sets ``image_tokens_only`` (no text tokens, cfg 1: what that backbone sees
under DualModelGuider with ``negative`` unconnected).

Interrupt (Cancel in the UI) is honoured between steps and between layers; hooks are removed in every
case and no CALIBRATION is produced, so nothing half-made reaches Save.
"""
from __future__ import annotations

import logging
import os
import re
import time

import torch

from .common import CALIBRATION_TYPE, CATEGORY
from .weights import PREFIX, float_tensor, original_modules
from ..quant import select
from ..quant.calib_capture import DEFAULT_ROW_CAP, ActivationCapture
from ..quant.calibrate import Calibration, build_calibration

log = logging.getLogger("int8_fused")
# ComfyUI modules are imported inside functions: the pack must import without ComfyUI on the path.
FOLDER = "int8_calibration"
EXT = ".safetensors"


def register_folder() -> str:
    """models/int8_calibration as a ComfyUI model folder (idempotent); returns its default path."""
    import folder_paths
    default = os.path.join(folder_paths.models_dir, FOLDER)
    if FOLDER not in folder_paths.folder_names_and_paths:
        folder_paths.folder_names_and_paths[FOLDER] = ([default], {EXT})
    else:
        folder_paths.folder_names_and_paths[FOLDER][1].add(EXT)
    return folder_paths.get_folder_paths(FOLDER)[0]


def _weight_fn(model, device):
    """Float weight as the model applies it (LoRA patches merged, fp8 decoded): the Apply node's decoder."""
    return lambda n, m: float_tensor(model, n, m, "weight", device)


def _targets(model, preset, include, exclude):
    """(name, module that really runs) of the linears to calibrate; refuses an INT8-patched model."""
    root = model.model.diffusion_model
    chosen = select.select_from(list(original_modules(model)), preset, include, exclude)
    out, quantized = [], []
    for name, m in chosen:
        live = model.get_model_object(PREFIX + name)
        (out if select.is_linear(live) else quantized).append((name, live))
    if quantized:
        raise ValueError(f"INT8 Calibrate needs the float model, but {len(quantized)} selected layers are "
                         f"already replaced (e.g. {quantized[0][0]} is {type(quantized[0][1]).__name__}): "
                         f"connect the MODEL from before 'Apply Fused INT8 GEMM'")
    if not out:
        raise ValueError(f"INT8 Calibrate: no linear layer of {type(root).__name__} matches preset {preset!r} "
                         f"with include {include!r} / exclude {exclude!r}; widen 'include' or use preset 'all'")
    return out


def _zero_out(cond):
    """ConditioningZeroOut: the same conditioning with zeroed tensors (the default negative)."""
    out = []
    for t, d in cond:
        d = dict(d)
        if d.get("pooled_output") is not None:
            d["pooled_output"] = torch.zeros_like(d["pooled_output"])
        out.append([None if t is None else torch.zeros_like(t), d])
    return out


def run_calibration(model, positive, negative, latent, seed, steps, cfg, sampler_name, scheduler,
                    alpha=0.5, alpha_search=False, protect_top_k=0, protect_threshold=0.0,
                    preset="blocks", include="", exclude="", activation_scales="dynamic",
                    static_buckets=4, rows_per_layer=DEFAULT_ROW_CAP, image_tokens_only=False,
                    node_id=None) -> Calibration:
    """Sample ``steps`` steps with capture hooks installed, then build the Calibration.

    ``image_tokens_only``: sample with an empty conditioning ``[[None, {}]]`` and cfg 1, the input
    Ideogram 4's unconditional backbone gets under DualModelGuider with ``negative`` unconnected.
    """
    import comfy.model_management as mm
    import comfy.sample
    import comfy.utils
    if activation_scales not in ("dynamic", "static"):
        raise ValueError(f"activation_scales must be 'dynamic' or 'static', got {activation_scales!r}")
    if steps < 1:
        raise ValueError("INT8 Calibrate needs steps >= 1")
    t0 = time.perf_counter()
    # Load THIS patcher first: clones share one module tree, and another clone (e.g. the Apply node's
    # INT8 copy) may still have its object patches applied to it from the last run.
    mm.load_models_gpu([model])
    targets = _targets(model, preset, include, exclude)
    if image_tokens_only:
        positive, negative, cfg = [[None, {}]], None, 1.0
    n_buckets = max(1, min(int(static_buckets), steps)) if activation_scales == "static" else 1
    capture = ActivationCapture(targets, n_buckets=n_buckets, row_cap=int(rows_per_layer), seed=seed)
    pbar = comfy.utils.ProgressBar(steps + len(targets), node_id=node_id)

    def on_step(step, x0, x, total):
        mm.throw_exception_if_processing_interrupted()
        capture.set_bucket((step + 1) * n_buckets // max(total, 1))
        pbar.update_absolute(step + 1)

    lat = comfy.sample.fix_empty_latent_channels(model, latent["samples"])
    noise = comfy.sample.prepare_noise(lat, seed, latent.get("batch_index"))
    negative = negative if negative is not None else _zero_out(positive)
    with capture:  # hooks removed on any exit: done, error or interrupt
        comfy.sample.sample(model, noise, steps, cfg, sampler_name, scheduler, positive, negative, lat,
                            noise_mask=latent.get("noise_mask"), callback=on_step,
                            disable_pbar=not comfy.utils.PROGRESS_BAR_ENABLED, seed=seed)
    mm.throw_exception_if_processing_interrupted()
    t1 = time.perf_counter()

    def on_layer(i, n):
        mm.throw_exception_if_processing_interrupted()
        pbar.update_absolute(steps + i)

    dev = model.load_device if model.load_device.type == "cuda" else torch.device("cpu")
    meta = {"arch": type(model.model).__name__, "model_class": type(model.model.diffusion_model).__name__,
            "steps": steps, "seed": seed, "cfg": cfg, "sampler": sampler_name, "scheduler": scheduler,
            "latent_shape": list(lat.shape), "preset": preset, "include": include, "exclude": exclude,
            "bucket_rule": "bucket = step * buckets // steps (sampling step index)",
            "image_tokens_only": bool(image_tokens_only)}
    cal = build_calibration(capture, _weight_fn(model, dev), alpha=alpha, alpha_search=alpha_search,
                            protect_top_k=protect_top_k, protect_threshold=protect_threshold,
                            static_scales=activation_scales == "static", meta=meta, progress=on_layer)
    # where the time went: loading + sampling with the hooks, then the per-layer analysis (weights read once)
    cal.meta["seconds"] = {"sampling": round(t1 - t0, 3), "layers": round(time.perf_counter() - t1, 3)}
    return cal


class Int8Calibrate:
    DESCRIPTION = ("Runs real sampling steps of a float diffusion model with activation hooks and computes "
                   "SmoothQuant vectors, per-layer W8A8 errors (with/without smoothing) and the most sensitive "
                   "layers to keep in float. Feed the CALIBRATION to 'Apply Fused INT8 GEMM'. Calibrate each "
                   "MODEL on its own (Ideogram 4: one node per backbone).")
    CATEGORY = CATEGORY
    FUNCTION = "calibrate"
    OUTPUT_NODE = True
    RETURN_TYPES = (CALIBRATION_TYPE, "STRING")
    RETURN_NAMES = ("calibration", "summary")

    @classmethod
    def INPUT_TYPES(cls):
        import comfy.samplers
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The FLOAT diffusion model to calibrate (before Apply)."}),
                "positive": ("CONDITIONING", {"tooltip": "Prompt conditioning to sample with (use typical prompts)."}),
                "latent_image": ("LATENT", {"tooltip": "Size of the calibration images (e.g. Empty Latent)."}),
                "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF,
                                 "tooltip": "Noise seed of the calibration run."}),
                "steps": ("INT", {"default": 8, "min": 1, "max": 200,
                                  "tooltip": "Sampling steps to observe; covers all noise levels."}),
                "cfg": ("FLOAT", {"default": 4.0, "min": 0.0, "max": 100.0, "step": 0.1, "tooltip": (
                    "CFG scale; 1.0 runs only the positive branch.")}),
                "sampler_name": (comfy.samplers.KSampler.SAMPLERS, {"tooltip": "Sampler, as in KSampler."}),
                "scheduler": (comfy.samplers.KSampler.SCHEDULERS, {"tooltip": "Scheduler, as in KSampler."}),
                "alpha": ("FLOAT", {"default": 0.5, "min": 0.0, "max": 1.0, "step": 0.05, "tooltip": (
                    "SmoothQuant migration strength: s_j = max|X_j|^a / max|W_j|^(1-a).")}),
                "alpha_search": ("BOOLEAN", {"default": False, "tooltip": (
                    "Search alpha per layer on 0.30..0.80 (and 'no smoothing') for the lowest error.")}),
                "protect_top_k": ("INT", {"default": 0, "min": 0, "max": 10000, "tooltip": (
                    "Keep the k layers with the largest W8A8 error in float.")}),
                "protect_threshold": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 10.0, "step": 0.001,
                                                "tooltip": "Also keep in float every layer whose relative "
                                                           "error exceeds this (0 = off)."}),
                "preset": (list(select.PRESETS), {"default": "blocks", "tooltip": (
                    "Which linears to calibrate; use the same as in Apply Fused INT8 GEMM.")}),
                "include": ("STRING", {"default": "", "tooltip": (
                    "Regular expressions of extra layer names, one per line or separated by commas outside "
                    "{m,n}, [...] and (...) (as in Apply).")}),
                "exclude": ("STRING", {"default": "", "tooltip": (
                    "Regular expressions of layer names to skip, one per line or separated by commas outside "
                    "{m,n}, [...] and (...) (as in Apply).")}),
                "activation_scales": (["dynamic", "static"], {"default": "dynamic", "tooltip": (
                    "'static' also stores per-timestep-bucket activation scales in the calibration. "
                    "The Apply node runs dynamic per-token scales either way.")}),
            },
            "optional": {
                "negative": ("CONDITIONING", {"tooltip": "Unconnected: zeroed positive."}),
                "static_buckets": ("INT", {"default": 4, "min": 1, "max": 64, "tooltip": (
                    "Timestep buckets of the static activation scales (steps split evenly).")}),
                "rows_per_layer": ("INT", {"default": DEFAULT_ROW_CAP, "min": 16, "max": 4096, "tooltip": (
                    "Activation rows kept per layer for the error measurement (memory cap).")}),
                "image_tokens_only": ("BOOLEAN", {"default": False, "tooltip": (
                    "Ideogram 4 unconditional backbone: sample with no text tokens (cfg 1), as it runs "
                    "under DualModelGuider with negative unconnected. positive is then ignored.")}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def calibrate(self, model, positive, latent_image, seed, steps, cfg, sampler_name, scheduler, alpha,
                  alpha_search, protect_top_k, protect_threshold, preset, include, exclude,
                  activation_scales, negative=None, static_buckets=4, rows_per_layer=DEFAULT_ROW_CAP,
                  image_tokens_only=False, unique_id=None):
        cal = run_calibration(model, positive, negative, latent_image, seed, steps, cfg, sampler_name,
                              scheduler, alpha, alpha_search, protect_top_k, protect_threshold, preset,
                              include, exclude, activation_scales, static_buckets, rows_per_layer,
                              image_tokens_only, node_id=unique_id)
        text = cal.summary_text()
        log.info("INT8 Calibrate: %s", text.splitlines()[0])
        return {"ui": {"text": [text]}, "result": (cal, text)}


def _safe_name(name: str) -> str:
    name = name.strip()
    if not name.endswith(EXT):
        name += EXT
    if not re.fullmatch(r"[\w\-. ]+", name) or name.startswith("."):
        raise ValueError(f"calibration file name {name!r} may hold letters, digits, '-', '_', '.' and spaces "
                         f"only (no folders); it is saved under models/{FOLDER}/")
    return name


class SaveInt8Calibration:
    DESCRIPTION = f"Saves a CALIBRATION under models/{FOLDER}/ (safetensors, atomic; never overwrites unless told)."
    CATEGORY = CATEGORY
    FUNCTION = "save"
    OUTPUT_NODE = True
    RETURN_TYPES = ()

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "calibration": (CALIBRATION_TYPE, {"tooltip": "Output of INT8 Calibrate."}),
            "filename": ("STRING", {"default": "int8_calibration", "tooltip": (
                f"File name under models/{FOLDER}/ (.safetensors added).")}),
            "overwrite": ("BOOLEAN", {"default": False, "tooltip": "Replace an existing file of that name."}),
        }}

    def save(self, calibration, filename, overwrite=False):
        path = os.path.join(register_folder(), _safe_name(filename))
        calibration.save(path, overwrite=overwrite)
        msg = f"saved {len(calibration.layers)} layers to {path}"
        log.info("INT8 calibration %s", msg)
        return {"ui": {"text": [msg]}}


class LoadInt8Calibration:
    DESCRIPTION = (f"Loads a calibration from models/{FOLDER}/. With a MODEL connected it checks that every "
                   "calibrated layer exists there with the same shape.")
    CATEGORY = CATEGORY
    FUNCTION = "load"
    RETURN_TYPES = (CALIBRATION_TYPE, "STRING")
    RETURN_NAMES = ("calibration", "summary")

    @classmethod
    def INPUT_TYPES(cls):
        import folder_paths
        register_folder()
        return {"required": {"calibration_name": (folder_paths.get_filename_list(FOLDER), {"tooltip": (
                    f"A calibration file in models/{FOLDER}/.")})},
                "optional": {"model": ("MODEL", {"tooltip": "Checked against the calibration's layers."})}}

    def load(self, calibration_name, model=None):
        import folder_paths
        register_folder()
        cal = Calibration.load(folder_paths.get_full_path_or_raise(FOLDER, calibration_name))
        if model is not None:
            linears = {n: m for n, m in original_modules(model) if select.is_linear(m)}
            cal.check_model(linears)
            dev = model.load_device if model.load_device.type == "cuda" else torch.device("cpu")
            bad = cal.weight_mismatches(_weight_fn(model, dev), linears)
            if bad:
                warn = (f"WARNING: {len(bad)} checked layers (e.g. {bad[0]}) have other weights than the model "
                        f"this calibration was made on: a different backbone/checkpoint (Ideogram 4: the "
                        f"other branch?) or a LoRA. Shapes match, so it still applies.")
                log.warning("Load INT8 Calibration %s: %s", calibration_name, warn)
                return (cal, warn + "\n" + cal.summary_text())
        return (cal, cal.summary_text())


NODE_CLASS_MAPPINGS = {"Int8Calibrate": Int8Calibrate, "SaveInt8Calibration": SaveInt8Calibration,
                       "LoadInt8Calibration": LoadInt8Calibration}
NODE_DISPLAY_NAME_MAPPINGS = {"Int8Calibrate": "INT8 Calibrate", "SaveInt8Calibration": "Save INT8 Calibration",
                              "LoadInt8Calibration": "Load INT8 Calibration"}
