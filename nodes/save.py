""""Save INT8 Model": write a quantized (optionally calibrated) MODEL as an INT8 checkpoint.

Formats:
  int8_fused             this pack's self-describing format (``quant.fmt_write.write_pack``): int8 weights,
                         per-layer SmoothQuant vectors, protected float layers, calibration provenance.
  comfy_int8_tensorwise  ComfyUI core's layout; loads in plain ComfyUI without this pack. Core has no
                         activation smoothing for this format, so smoothing is *folded*: the stored weight is
                         the unsmoothed ``W`` quantized per output channel (from a smoothed INT8 layer:
                         ``dequant(Q(W*s)) / s`` re-quantized). Same float product; the activation is then
                         quantized without the SmoothQuant division, so the smoothing's accuracy gain is lost
                         (and a smoothed INT8 layer's weight is rounded twice). Protected layers stay float.
What is quantized: every ``Int8Linear`` of the MODEL (loaded by "Load Ideogram 4.0 INT8" or patched by
"Apply Fused INT8 GEMM") is written as it is. A float MODEL is quantized here: the layers of the ``layers``
preset (``quant.select``), with a calibration's smoothing and protection when one is connected. LoRA
patches on the MODEL are merged into float weights first; a LoRA loaded after the MODEL was quantized (which runs
as side branches when sampling) is merged into the dequantized weights of the INT8 layers it targets, which are
then quantized again.
Files go under ComfyUI's first ``diffusion_models`` folder (``models/unet`` in a default install, which
ComfyUI lists before ``models/diffusion_models``; both are read by the loaders), and the node shows the
path it wrote. An existing file is an error unless ``overwrite`` is on; writes are atomic (temporary file
+ rename; temporaries left by a killed server are removed by the next save in that folder). The name must end in
a file name (not ``/``, not a bare extension or a hidden ``.name``); any name the file system takes saves, a
longer one is refused before anything is computed. Every tensor of the model is written: INT8 layers as such
(also those inside fused modules), every other tensor from the unpatched module tree, whatever wraps it.
"""
from __future__ import annotations

import logging
import os

from .. import adapters
from ..quant import select
from ..quant.fmt_write import NameTooLongError, check_name_lengths, write_core_int8, write_pack
from ..quant.formats import OutputExistsError
from ..quant.linear import Int8Linear
from ..quant.quantize import quantize_weight_per_channel
from .common import CALIBRATION_TYPE, CATEGORY
from .weights import int8_layers, original_tree

log = logging.getLogger("int8_fused")
FORMATS = ("int8_fused", "comfy_int8_tensorwise")


def _layer_of(m: Int8Linear) -> dict:
    out = {"qweight": m.qweight.detach().cpu(), "weight_scale": m.weight_scale.detach().float().cpu(),
           "bias": None if m.bias is None else m.bias.detach().float().cpu(),
           "smooth": None if m.smooth is None else m.smooth.detach().float().cpu()}
    if getattr(m, "rotation", 0):  # a ConvRot layer (quant.convrot): its group size goes into the file
        out["convrot"] = m.rotation
    return out


def _quantize(weight, bias, smooth) -> dict:
    w = weight.detach().float().cpu()
    if smooth is not None:
        w = w * smooth.float().cpu()[None, :]
    q, s = quantize_weight_per_channel(w)
    return {"qweight": q, "weight_scale": s, "bias": None if bias is None else bias.detach().float().cpu(),
            "smooth": None if smooth is None else smooth.float().cpu()}


def _own_tensors(m):
    """(name, tensor) of a module's own parameters and persistent buffers (its state-dict entries)."""
    skip = getattr(m, "_non_persistent_buffers_set", ())
    return [(pn, t) for pn, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
            if t is not None and pn not in skip]


def _under(name: str, quant: dict) -> bool:
    """Whether ``name`` is a quantized layer or inside one."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in quant for i in range(1, len(parts) + 1))


def _late_lora(model) -> dict:
    """{INT8 layer name: {"weight" | "bias": ComfyUI patch list}} of a LoRA loaded after Apply / the Ideogram 4
    loader (what its run-start branches would add), taken out of the model's ``patches`` as a sampling run takes
    them, so that ComfyUI's load below never patches an int8 weight."""
    from .apply import take_lora_patches
    out: dict = {}
    for key, plist in take_lora_patches(model).items():
        name, param = key.rsplit(".", 1)
        out.setdefault(name, {})[param] = plist
    return out


def _merged(m: Int8Linear, name: str, patches: dict) -> dict:
    """An INT8 layer with a LoRA loaded after it, for the file: the LoRA merged by ComfyUI's own
    ``comfy.lora.calculate_weight`` into the layer's dequantized weight (and bias), quantized again per output
    channel with the layer's smoothing (a second rounding of the weight, as if the LoRA had been loaded before
    Apply on the dequantized model)."""
    import comfy.lora
    if getattr(m, "rotation", 0):
        raise ValueError(f"Save INT8 Model: layer {name!r} is ConvRot-rotated and has a LoRA loaded after Apply, "
                         "which cannot be merged into its rotated weight; save the model before the LoRA loader, "
                         "or load the LoRA before 'Apply Fused INT8 GEMM'")
    key = f"diffusion_model.{name}"
    w = comfy.lora.calculate_weight(patches.get("weight", []), m.dequantized_weight().float().cpu().clone(),
                                    key + ".weight")
    b = m.bias
    if b is not None and patches.get("bias"):
        b = comfy.lora.calculate_weight(patches["bias"], b.detach().float().cpu().clone(), key + ".bias")
    return _quantize(w, b, m.smooth)


def collect(model, fmt: str, preset: str = "blocks", calibration=None):
    """(quant layers, float tensors, protected names) of a MODEL, relative to its diffusion model. A LoRA loaded
    after the MODEL was quantized is merged into the INT8 layers it targets (:func:`_merged`)."""
    late = _late_lora(model)
    n_late = len(late)
    if getattr(model, "patches", None):
        import comfy.model_management as mm
        mm.load_models_gpu([model], force_full_load=True)  # merges LoRA/weight patches into the weights
    dm = model.model.diffusion_model
    # INT8 layers: Int8Linear object patches and those held by fused modules (int8_layers()). Every other tensor
    # is read from the unpatched tree: a wrapper (a fused block, the llm_cond_proj cache) may hold its float
    # layers as children the original names do not reach.
    mods = dict(dm.named_modules())
    if hasattr(model, "object_patches_backup"):
        with original_tree(model) as root:
            mods = dict(root.named_modules())
    if getattr(model, "object_patches", None):
        mods.update((n, m) for n, m in int8_layers(model).items() if n in mods)
    has_int8 = any(isinstance(m, Int8Linear) for m in mods.values())
    rules = adapters.block_rules(dm)
    chosen = set() if has_int8 else {n for n, _ in select.select_linears(dm, preset, rules=rules)}
    quant, floats, protected = {}, {}, []
    expected = [f"{n}.{pn}" if n else pn for n, m in mods.items() if not isinstance(m, Int8Linear)
                for pn, _ in _own_tensors(m)]  # the float model's state-dict keys (INT8 layers: written as such)
    for name, m in mods.items():
        if _under(name, quant):
            continue
        if isinstance(m, Int8Linear):
            quant[name] = _merged(m, name, late.pop(name)) if name in late else _layer_of(m)
            continue
        if select.is_linear(m) and name in chosen:
            cal = calibration.for_layer(name, m.out_features, m.in_features) if calibration is not None else None
            if cal is not None and cal.protected:
                protected.append(name)
            else:
                smooth = cal.smooth if (cal is not None and fmt == "int8_fused") else None
                quant[name] = _quantize(m.weight, m.bias, smooth)
                continue
        for pn, t in _own_tensors(m):
            floats[f"{name}.{pn}" if name else pn] = t.detach().cpu()
    if n_late:
        log.info("[int8_fused] Save INT8 Model: %d INT8 layers have a LoRA loaded after quantization: merged into "
                 "their dequantized weights and quantized again", n_late - len(late))
    if late:
        raise RuntimeError(f"Save INT8 Model: a LoRA loaded after Apply targets INT8 layers the model does not hold "
                           f"({sorted(late)[:4]}); nothing written")
    missing = [k for k in expected if k not in floats and not _under(k.rpartition(".")[0], quant)]
    if missing:
        raise RuntimeError(f"Save INT8 Model: {len(missing)} tensors of the model were not collected (e.g. "
                           f"{missing[:4]}); nothing written")
    if not quant:
        raise ValueError("Save INT8 Model: the model has no INT8 layer and none was selected for quantization; "
                         "connect a model from 'Apply Fused INT8 GEMM' / 'Load Ideogram 4.0 INT8' or pick a preset")
    protected += [n for n, m in mods.items() if has_int8 and select.is_linear(m) and n not in quant
                  and rules.in_block(n)]
    return quant, floats, sorted(set(protected))


def output_path(filename: str) -> str:
    import folder_paths

    rel = filename.strip().replace("\\", "/")
    if not rel or rel.startswith("/") or ".." in rel.split("/") or "\x00" in rel:
        raise ValueError(f"Save INT8 Model: invalid file name {filename!r}; give a name relative to the "
                         "diffusion_models folder, without '..' or NUL characters")
    last = rel.rsplit("/", 1)[-1]
    if not last.strip() or last.startswith("."):
        raise ValueError(f"Save INT8 Model: invalid file name {filename!r}; it must end in a file name (not '/', "
                         "and not a bare extension or a name starting with '.', which would be a hidden file), "
                         "e.g. 'int8/model_int8'")
    if not rel.endswith(".safetensors"):
        rel += ".safetensors"
    path = os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], rel)
    try:
        check_name_lengths(path)
    except NameTooLongError as e:
        raise NameTooLongError(f"Save INT8 Model: invalid file name {filename!r}: {e}") from None
    return path


def save_model(model, path: str, fmt: str, overwrite: bool = False, preset: str = "blocks", calibration=None):
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose {FORMATS}")
    if os.path.exists(path) and not overwrite:
        raise OutputExistsError(f"Save INT8 Model: {path} already exists; choose another name or turn overwrite on")
    quant, floats, protected = collect(model, fmt, preset, calibration)
    rotated = [n for n, L in quant.items() if L.get("convrot")]
    if rotated and fmt != "comfy_int8_tensorwise":
        raise ValueError(f"Save INT8 Model: {len(rotated)} layers are ConvRot-rotated (e.g. {rotated[0]}), which the "
                         f"{fmt} format does not record; save as comfy_int8_tensorwise (ComfyUI's ConvRot layout)")
    if fmt == "comfy_int8_tensorwise":
        write_core_int8(path, quant, floats, overwrite=overwrite)
    else:
        meta = getattr(calibration, "meta", None) if calibration is not None else None
        write_pack(path, {"": (quant, floats)}, protected=protected, calibration=meta,
                   architecture=type(model.model).__name__, overwrite=overwrite)
    log.info("[int8_fused] saved %d INT8 + %d float tensors (%s) to %s", len(quant), len(floats), fmt, path)
    return path


class SaveInt8Model:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The model to save: the output of Apply Fused INT8 GEMM, or a float "
                                           "model (quantized here with the chosen layers)"}),
            "filename": ("STRING", {"default": "int8/model_int8", "tooltip": (
                "relative to ComfyUI's first diffusion_models folder (models/unet in a default install)")}),
            "format": (list(FORMATS), {"tooltip": "int8_fused keeps SmoothQuant; comfy_int8_tensorwise loads in "
                                                  "plain ComfyUI (smoothing folded into the weights)"}),
            "overwrite": ("BOOLEAN", {"default": False, "tooltip": "replace an existing file of that name"}),
            "layers": (list(select.PRESETS), {"tooltip": "which linears to quantize when the model is float"}),
        }, "optional": {"calibration": (CALIBRATION_TYPE, {"tooltip": "optional output of INT8 Calibrate: "
                                                                       "SmoothQuant vectors and float-kept layers"})}}

    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("path",)
    OUTPUT_NODE = True
    FUNCTION = "save"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Saves the model as an INT8 checkpoint in ComfyUI's first diffusion_models folder "
                   "(models/unet in a default install) and shows the path it wrote.")

    def save(self, model, filename, format, overwrite, layers, calibration=None):
        path = save_model(model, output_path(filename), format, overwrite, layers, calibration)
        return {"ui": {"text": [f"saved to {path}"]}, "result": (path,)}


NODE_CLASS_MAPPINGS = {"SaveInt8Model": SaveInt8Model}
NODE_DISPLAY_NAME_MAPPINGS = {"SaveInt8Model": "Save INT8 Model"}
