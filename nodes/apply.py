"""Node "Apply Fused INT8 GEMM": quantize a loaded DiT's linears once and run them on a chosen backend.

MODEL in -> a clone whose selected linears are object patches (``diffusion_model.<name>`` ->
``Int8Linear``); the input MODEL is not modified, so unpatching gives back the float model exactly.

How it fits ComfyUI's ModelPatcher (comfy/model_patcher.py, 0.3.75):
* Weights are quantized here, once, when the node executes; ComfyUI caches the node's output, so
  sampling steps never quantize weights again.
* LoRA before this node lives as weight patches in ``model.patches``. For each selected layer we merge
  them with ComfyUI's own ``comfy.lora.calculate_weight`` (from the unpatched backup when the model is
  loaded with patches applied), quantize the merged weight, and drop that layer's ``.weight``/``.bias``
  patches from the clone, so nothing later tries to patch the int8 tensor. Other layers keep theirs.
* LoRA after this node (a LoraLoader on its output, any strength, stacked): at each sampling run start (an
  OUTER_SAMPLE wrapper, before ComfyUI loads the model) the patches on INT8 layers move out of that clone's
  ``patches`` into an attachment and run as low-rank side branches (``quant.lora``); the int8 weights are never
  patched, and a clone without LoRA runs its layers plain again. A new strength re-quantizes nothing.
* fp8 / scaled-fp8 / QuantizedTensor checkpoints are cast to fp32 through the layer's own
  ``convert_weight`` (as ``patch_weight_to_device`` does) or ``dequantize()`` before quantizing.
* The model's adapter (``adapters.adapter_for``: one per architecture) gives the layer presets and, on
  ``fused_triton``, fused modules (Ideogram 4 blocks, SwiGLU FeedForwards of Lumina 2 / Z-Image / Ideogram 4,
  a cached ``llm_cond_proj``; ``INT8_FUSED_FUSION=0`` turns that off); the clone then also carries the cache
  wrappers. An architecture without an adapter gets per-linear INT8 with the generic presets.
  ``weights.int8_layers(model)`` gives back the per-layer ``Int8Linear`` of every quantized
  name through the fused modules' ``int8_layers()``, e.g. for Save INT8 Model.
* The clone gets a fresh ``patches_uuid`` and its own size: switching between this clone and the float
  model makes ComfyUI unpatch and move the tree off the GPU, then load the INT8 tree (the replaced
  float weights are no longer in it, so they do not come back to the GPU).
* Under DynamicVRAM the clone also carries an injection whose eject gives back the tensors ComfyUI backed up
  under the fused modules before ComfyUI undoes the object patches (``comfy_cast.restore_patched_backups``).
"""
from __future__ import annotations

import logging
import os
import uuid

import torch

from .common import CALIBRATION_TYPE, CATEGORY
from .weights import PREFIX, float_tensor, original_modules, original_tree
from .. import adapters
from ..quant import backends, cached_linear, convrot, dispatch, lora, select
from ..quant.formats import CheckpointError, check_scale_shape, check_scale_values
from ..quant.linear import Int8Linear
from ..quant.patch import build_int8_layers

from . import attention as attention_routing, comfy_cast, compile_ahead, multigpu, pad_elision, resident_conds, timing

log = logging.getLogger("int8_fused")
# ComfyUI modules are imported inside the functions: pytest imports the pack's __init__ (as a package
# above tests/) without ComfyUI on the path, and that import must not fail.
_CALLBACK_KEY = "int8_fused_apply"
_ATTACHMENT = "int8_fused_apply"
PATTERNS_HELP = ("One pattern per line, or several separated by commas; a comma inside {m,n}, [...] or (...) "
                 "belongs to its pattern (layers\\.[0-9]{1,2}\\. is one), \\, is a literal comma. The log "
                 "says which layers each pattern matched; one that matches none is a warning.")
_BAD_BACKEND: set = set()
ROTATIONS = ("none", "convrot")
ROTATION_TOOLTIP = (
    "convrot: rotate the weights of float layers along K by ComfyUI's ConvRot block Hadamard (group 256; 64 or 16 "
    "where 256 does not divide the layer's input width) before "
    "quantizing them; the activations are rotated the same way at run time (on fused_triton inside the "
    "quantization kernel). It spreads activation outlier channels over their group, so per-token INT8 loses less "
    "to them; costs one small rotation per linear. Layers whose width is not a multiple of 16 stay unrotated; "
    "SmoothQuant smoothing of a calibration is not used for rotated layers. Checkpoints stored as ConvRot INT8 "
    "(ComfyUI int8_tensorwise with convrot) are adopted as stored whatever this says.")


def forced_backend() -> str | None:
    """INT8_FUSED_BACKEND when it names a backend of the registry, else None: an unknown name warns once, naming
    the switch and the valid names, and counts as unset (Apply's list and the loader's ``auto``). The pack's
    ``nodes/__init__`` calls it when ComfyUI loads the pack, so a typo shows at start."""
    name = backends.env_override()
    if name is None or name in backends.BACKENDS:
        return name
    if name not in _BAD_BACKEND:
        _BAD_BACKEND.add(name)
        log.warning("INT8_FUSED_BACKEND=%r is not a backend of this pack (%s): ignored, as if unset", name,
                    ", ".join(backends.BACKENDS))
    return None


def backend_choices() -> list[str]:
    """What this machine can run, the default first (the bf16 control is always offered)."""
    import comfy.model_management as mm
    names = backends.available(mm.get_torch_device())
    forced = forced_backend()
    if forced in names:
        names = [forced] + [n for n in names if n != forced]
    return names + [n for n, b in backends.BACKENDS.items() if not b.quantizes and n not in names]


def _fuse(model, layers: dict, adapter) -> dict:
    """Object patches relative to the diffusion model: the adapter's fused modules and the remaining plain layers."""
    with original_tree(model) as root:
        patches = adapters.object_patches(root, layers, adapter)
    n_fused = sum(1 for m in patches.values() if getattr(m, "covers", None) is not None)
    if n_fused:
        log.info("INT8 Apply: %d modules fused (%s adapter: norm/activation + quantization in one kernel)", n_fused,
                 adapter.name)
    return patches


def install_patches(out, patches: dict) -> None:
    """Add ``patches`` ({name relative to the diffusion model: module}) to the ModelPatcher ``out`` as object
    patches, the conditioning-on-GPU wrapper (``resident_conds``), and the per-run cache wrappers when a fused
    module needs them (Apply and the Ideogram 4 loader)."""
    from comfy.patcher_extension import WrappersMP
    for name, module in patches.items():
        out.add_object_patch(PREFIX + name, module)
    out.set_injections(_CALLBACK_KEY, [comfy_cast.injection()])  # DynamicVRAM backups out before the unpatch
    multigpu.register(out, _CALLBACK_KEY, install_lora)  # MultiGPU CFG Split's clones: their own INT8 modules
    out.remove_wrappers_with_key(WrappersMP.SAMPLER_SAMPLE, _CALLBACK_KEY)
    out.add_wrapper_with_key(WrappersMP.SAMPLER_SAMPLE, _CALLBACK_KEY, resident_conds.sampler_sample_wrapper)
    if any(isinstance(m, cached_linear.CachedLinear) for m in patches.values()):
        out.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, _CALLBACK_KEY, cached_linear.diffusion_model_wrapper)
        out.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, _CALLBACK_KEY, cached_linear.outer_sample_wrapper)


def core_int8_weight(model, name: str, module):
    """(int8 [N, K], fp32 scale) of a layer that holds ComfyUI core ``int8_tensorwise`` weights (a
    ``QuantizedTensor`` with ``TensorWiseINT8Layout``, per-channel or per-tensor scale, ConvRot-rotated with a
    group size the pack runs or not rotated, not transposed) and no LoRA patch to merge: Apply adopts them as
    stored (a rotated one as a ``ConvRotLinear``, see ``stored_rotations``). None otherwise (the layer is then
    decoded to float and quantized by this pack, as any float layer)."""
    w = getattr(module, "weight", None)
    if type(w).__name__ != "QuantizedTensor" or getattr(w, "_layout_cls", None) != "TensorWiseINT8Layout":
        return None
    if f"{PREFIX}{name}.weight" in model.patches or getattr(module, "pre_quant_scale", None) is not None:
        return None
    p, q = w._params, w._qdata
    group = convrot.stored_convrot(w)
    if (group is not None and group not in convrot.GROUPS) or getattr(p, "transposed", False) \
            or q.dtype != torch.int8 or tuple(q.shape) != tuple(w.shape) or p.scale.numel() not in (1, q.shape[0]):
        return None
    return q, p.scale.float().reshape(-1)  # its values checked by check_core_int8


def _source_file(model) -> str:
    """The file name of a model core's loaders loaded (they keep ``(loader, (path, ...))``), else a description."""
    init = getattr(model, "cached_patcher_init", None)
    path = init[1][0] if init and len(init) > 1 and init[1] and isinstance(init[1][0], str) else None
    return os.path.basename(path) if path else "the loaded checkpoint"


def check_core_int8(model, name: str, module) -> int | None:
    """Check a layer holding ComfyUI core ``int8_tensorwise`` weights before anything adopts or decodes it: its
    ``weight_scale`` as this pack's readers check theirs (``quant.formats.check_scale_shape`` /
    ``check_scale_values``: NaN/Inf, negative values, a shape other than scalar / [N] / [N, 1] refused; all zero
    warns) and a ConvRot group size that comfy-kitchen cannot decode either (not a power of 4, or not dividing K).
    Raises CheckpointError naming the file and the layer. Returns the stored ConvRot group size, or None."""
    w = getattr(module, "weight", None)
    if type(w).__name__ != "QuantizedTensor" or getattr(w, "_layout_cls", None) != "TensorWiseINT8Layout":
        return None
    p = w._params
    where = f"{_source_file(model)}: layer {name!r} (ComfyUI int8_tensorwise)"
    if not getattr(p, "transposed", False):
        check_scale_shape(tuple(p.scale.shape), w.shape[0], where)
    check_scale_values(p.scale.detach().float().reshape(-1), where)
    g = convrot.stored_convrot(w)
    if g is not None:
        try:
            convrot.check_group(w.shape[-1], g, name, runs=False)
        except ValueError as e:
            raise CheckpointError(f"{_source_file(model)}: {e}. Neither ComfyUI nor this pack can decode this "
                                  "layer: the file is damaged. Download it again or quantize the float model "
                                  "again") from None
    return g


def stored_rotations(model, pairs) -> dict:
    """{name: group size} of the selected layers stored as ConvRot ``int8_tensorwise`` that Apply adopts as stored.
    Every selected core INT8 layer is checked first (``check_core_int8``: a damaged one raises CheckpointError
    naming the file and the layer, before anything is decoded); a valid group size the pack does not run (a power
    of 4 dividing K: 4, 4096, ...) is decoded to float and quantized again (a warning)."""
    out = {}
    for name, m in pairs:
        g = check_core_int8(model, name, m)
        if g is None:
            continue
        if g not in convrot.GROUPS:
            log.warning("INT8 Apply: layer %r is ConvRot-rotated with group size %d, which the pack does not run "
                        "(it runs %s): decoded to float and quantized again", name, g, convrot.GROUPS)
        elif core_int8_weight(model, name, m) is not None:
            out[name] = g
    return out


_LORA = "int8_fused_lora"


class _LoraPatches:
    """Attachment: the weight patches (LoRA loaded after Apply) on this clone's INT8 layers, taken out of
    ``patcher.patches`` so that ComfyUI never patches the int8 weights with them; a clone gets its own copy."""

    def __init__(self, patches=None):
        self.patches = patches or {}

    def on_model_patcher_clone(self):
        return _LoraPatches({k: v[:] for k, v in self.patches.items()})


def take_lora_patches(patcher) -> dict:
    """{key relative to the diffusion model: patch list} of the LoRA patches on the patcher's INT8 layers: those still
    in ``patcher.patches`` move to the clone's ``_LoraPatches`` attachment (after the ones earlier clones moved)."""
    info = patcher.get_attachment(_ATTACHMENT)
    held = patcher.get_attachment(_LORA)
    names = info.names if info is not None else ()
    own = [k for k in patcher.patches if k.startswith(PREFIX) and k[len(PREFIX):].rsplit(".", 1)[0] in names]
    if own:
        held = _LoraPatches({k: v[:] for k, v in held.patches.items()} if held is not None else {})
        for k in own:
            held.patches[k] = held.patches.get(k, []) + patcher.patches.pop(k)
        patcher.set_attachments(_LORA, held)
        patcher.patches_uuid = uuid.uuid4()  # its weight patches changed
    return {k[len(PREFIX):]: v for k, v in held.patches.items()} if held is not None else {}


def install_lora(patcher) -> int:
    """Run start: the INT8 layers of ``patcher`` get the LoRA branches of its patches (none for a clone without
    LoRA: a base model after a LoRA clone runs plain). Raises ``quant.lora.LoraError`` for a LoRA kind that cannot
    run as a branch. Returns the number of layers with branches."""
    patches = take_lora_patches(patcher)
    if not patches and not lora.any_branches():  # no LoRA, and no layer left with branches: nothing to do
        return 0
    info = patcher.get_attachment(_ATTACHMENT)
    names = info.names if info is not None else ()
    # INT8 layers in the tree itself (the Ideogram 4 loader's), then the object patches (which win: fused modules)
    objs = {n: m for n, m in original_modules(patcher) if n in names and isinstance(m, Int8Linear)}
    objs.update((k[len(PREFIX):], m) for k, m in patcher.object_patches.items() if k.startswith(PREFIX))
    n = lora.install(patches, lora.owners(objs))
    if n:
        log.info("INT8 LoRA: %d layers run %d LoRA patches as low-rank side branches (int8 weights unchanged)",
                 n, sum(len(v) for v in patches.values()))
    return n


CUDAGRAPHS_REFUSED = (
    "ComfyUI's TorchCompileModel node with backend 'cudagraphs' cannot run a model with this pack's INT8 layers: "
    "torch's CUDA graph trees fail under ComfyUI's default cudaMallocAsync allocator ('does not yet support "
    "checkPoolLiveAllocations'), and with --disable-cuda-malloc they reject the scratch buffers the pack's GEMM keeps "
    "across calls. Choose backend 'inductor' on that node (or remove it).")


def refuse_cudagraphs(patcher, where: str) -> None:
    """Raise when ``patcher`` carries TorchCompileModel's ``cudagraphs`` wrapper (``CUDAGRAPHS_REFUSED`` says why
    and what to do): at Apply when the node comes first, at the sampling run's start when it comes after Apply."""
    kw = (getattr(patcher, "model_options", None) or {}).get("torch_compile_kwargs") or {}
    if kw.get("backend") == "cudagraphs":
        raise RuntimeError(f"{where}: {CUDAGRAPHS_REFUSED}")


def _run_start(executor, *args, **kwargs):
    """OUTER_SAMPLE wrapper: :func:`install_lora` before ComfyUI loads the model (so it never sees those patches), for
    the guider's model and DualModelGuider's ``model_negative`` (loaded inside this run; its own OUTER_SAMPLE
    wrappers never run); a model with INT8 layers under TorchCompileModel's ``cudagraphs`` is refused first."""
    guider = executor.class_obj
    neg = getattr(guider, "uncond_model_patcher", None)
    for p in (guider.model_patcher, neg):
        if p is not None and p.get_attachment(_ATTACHMENT) is not None:
            refuse_cudagraphs(p, "INT8 sampling")
    install_lora(guider.model_patcher)
    if neg is not None and neg is not guider.model_patcher:
        install_lora(neg)
    return executor(*args, **kwargs)


def enable_lora(out, names, float_bytes: int | None = None) -> None:
    """Let a LoRA loaded after ``out`` (a ModelPatcher holding the INT8 layers ``names``, by name relative to the
    diffusion model: Apply's clone, the Ideogram 4 loader's models) run as side branches on those layers: the
    run-start wrapper of :func:`install_lora` and the attachment naming the layers (an earlier one's names kept;
    ``float_bytes``: the float model's weight bytes, for the load log line)."""
    from comfy.patcher_extension import WrappersMP
    prev = out.get_attachment(_ATTACHMENT)
    out.set_attachments(_ATTACHMENT, _Info(set(names) | (prev.names if prev else set()),
                                           prev.float_bytes if prev else (float_bytes or out.model_size())))
    out.remove_wrappers_with_key(WrappersMP.OUTER_SAMPLE, _LORA)
    out.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, _LORA, _run_start)


class _Info:
    """Attachment (survives ModelPatcher.clone): the INT8 layer names and the float model's weight bytes,
    for the LoRA branches and the one-time 'loaded' log line."""

    def __init__(self, names, float_bytes: int):
        self.names, self.float_bytes, self.logged = frozenset(names), float_bytes, False

    def on_model_patcher_clone(self):
        return self


def _log_loaded(patcher, device_to, *args):
    """ON_LOAD callback: once, what ComfyUI actually put on the device for the INT8 model."""
    info = patcher.get_attachment(_ATTACHMENT)
    if info is None or info.logged or device_to is None:
        return
    info.logged = True
    dev = torch.device(device_to)
    vram = _vram(dev)
    log.info("INT8 model loaded on %s: %.1f MiB of weights (the float model: %.1f MiB)%s", dev,
             patcher.model.model_loaded_weight_memory / 2**20, info.float_bytes / 2**20,
             "" if vram is None else f"; VRAM allocated {vram / 2**20:.0f} MiB")


def _vram(device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


class ApplyFusedInt8GEMM:
    DESCRIPTION = ("Quantizes the selected linear layers of a diffusion model to INT8 (W8A8: int8 weights "
                   "per output channel, activations per token) once, and runs them on the chosen backend. "
                   "Returns a patched copy; the input MODEL is unchanged. LoRA loaders before this node are merged "
                   "(exact); LoRA loaders after it run as low-rank side branches on the INT8 layers. Host RAM: "
                   "ComfyUI keeps the loader's float model cached beside the INT8 copy (about the float model's "
                   "size more than loading an INT8 file); for less RAM, save the result once with 'Save INT8 "
                   "Model' (format comfy_int8_tensorwise) and load that file with 'Load Diffusion Model' before "
                   "this node: its INT8 layers are taken as stored, no float copy is read.")
    CATEGORY = CATEGORY
    FUNCTION = "apply"
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("A copy of the model whose selected linears run as INT8 on the chosen backend "
                       "(or the unchanged float model for 'bf16').",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The diffusion model to quantize (bf16/fp16/fp32 or an fp8 "
                                               "checkpoint). LoRAs applied before this node are merged in."}),
                "backend": (backend_choices(), {"tooltip": (
                    "How INT8 linears run. Only backends this machine can run are listed, fastest first: "
                    "fused_triton (this pack's Triton kernel), comfy_kitchen, torch_int_mm (cuBLASLt), "
                    "fp8_rowwise, dequant_bf16 (the slow 'production INT8' baseline), bf16 (no "
                    "quantization: the control for side-by-side comparisons).")}),
                "preset": (list(select.PRESETS), {"default": "blocks", "tooltip": (
                    "Which linears: 'blocks' = the repeated transformer blocks without adaLN/modulation "
                    "GEMVs; 'blocks+modulation' adds those; 'all' also embedders and the final layer.")}),
                "include": ("STRING", {"default": "", "tooltip": (
                    "Regular expressions of extra layer names to quantize (e.g. 'final_layer'). Names are "
                    "relative to the diffusion model. " + PATTERNS_HELP)}),
                "exclude": ("STRING", {"default": "", "tooltip": (
                    "Regular expressions of layer names never to touch (wins over include), e.g. "
                    "'layers\\.[0-9]\\.' or 'layers\\.(0|1)\\.'. " + PATTERNS_HELP)}),
                "keep_float": ("STRING", {"default": "", "tooltip": (
                    "Regular expressions of selected layers to keep in float (sensitive layers); counted as "
                    "'kept float' in the log. " + PATTERNS_HELP)}),
            },
            "optional": {
                "calibration": (CALIBRATION_TYPE, {"tooltip": (
                    "Optional output of 'INT8 Calibrate': per-layer SmoothQuant vectors and layers it "
                    "found too sensitive to quantize (kept float).")}),
                "attention": (attention_routing.CHOICES, {"default": attention_routing.DEFAULT,
                                                          "tooltip": attention_routing.TOOLTIP}),
                "rotation": (ROTATIONS, {"default": "none", "tooltip": ROTATION_TOOLTIP}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def apply(self, model, backend, preset="blocks", include="", exclude="", keep_float="",
              calibration=None, attention=attention_routing.DEFAULT, rotation="none", unique_id=None):
        backends.get(backend)  # unknown name -> ValueError listing the known ones
        attention_routing.check_mode(attention)
        if rotation not in ROTATIONS:
            raise ValueError(f"Apply Fused INT8 GEMM: rotation must be one of {ROTATIONS}, got {rotation!r}")
        select.compile_patterns(keep_float)  # a bad regex -> ValueError naming it, even for bf16
        select.compile_patterns(include), select.compile_patterns(exclude)
        quantizes = backends.get(backend).quantizes
        if quantizes:
            refuse_cudagraphs(model, "Apply Fused INT8 GEMM")
        out = model.clone()
        if not quantizes:
            log.info("INT8 Apply: backend bf16 = the unquantized control; model passed through")
        else:
            if backends.get(backend).feeds_fused:   # the compile workers start while the layers quantize
                compile_ahead.prestart(model)
            _patch(out, model, backend, preset, include, exclude, keep_float, calibration, rotation)
        attention_routing.install(out, attention)
        pad_elision.install(out, backend)
        timing.instrument(out, node_id=str(unique_id), backend=backend)
        return (out,)


def _patch(out, model, backend, preset, include, exclude, keep_float, calibration, rotation="none") -> None:
    """Quantize the selected layers of ``model`` and add them to ``out`` (its clone) as object patches."""
    from comfy.patcher_extension import CallbacksMP
    already = {k[len(PREFIX):] for k in model.object_patches if k.startswith(PREFIX)}
    adapter = adapters.adapter_for(model.model.diffusion_model)
    rules = adapter.rules if adapter is not None else select.GENERIC
    pairs = [(n, m) for n, m in select.select_from(original_modules(model), preset, include, exclude, rules)
             if n not in already and not any(n.startswith(p + ".") for p in already)]
    select.log_matches("keep_float", select.compile_patterns(keep_float), [n for n, _ in pairs])
    if not pairs:
        arch = type(model.model.diffusion_model).__name__
        note = f" ({len(already)} are already INT8-patched)" if already else ""
        raise ValueError(
            f"Apply Fused INT8 GEMM: no linear layer of {arch} matches preset {preset!r} with include "
            f"{include!r} / exclude {exclude!r}{note}. Widen 'include' (e.g. '.') or use preset 'all'.")
    load_dev, store_dev = model.load_device, model.offload_device
    compute_dev = load_dev if load_dev.type == "cuda" else torch.device("cpu")
    before_size, vram_before = model.model_size(), _vram(compute_dev)
    stored = stored_rotations(model, pairs)
    rotated = dict(stored)  # name -> ConvRot group size: stored ones, then the float layers this node rotates

    merged = {}  # weight patch key -> how many of its patches ComfyUI merged (it skips malformed ones)

    def weight_fn(n, m):
        w = float_tensor(model, n, m, "weight", compute_dev, merged)
        g = convrot.group_for(w.shape[-1]) if rotation == "convrot" else None
        if g is not None:
            rotated[n] = g
            return convrot.rotate_weight(w, g, out=w)  # w: float_tensor's own copy, rotated in place by chunks
        return w

    cal = calibration
    if calibration is not None and (stored or rotation == "convrot"):
        cal = convrot.DropSmoothing(calibration, lambda n, k: n in stored or (
            rotation == "convrot" and convrot.group_for(k) is not None))
    layers, report = build_int8_layers(
        pairs, backend, calibration=cal, keep_float=keep_float, weight_fn=weight_fn,
        bias_fn=lambda n, m: float_tensor(model, n, m, "bias", compute_dev, merged),
        quantized_fn=lambda n, m: core_int8_weight(model, n, m),
        device=load_dev, compute_device=compute_dev, store_device=store_dev)
    layers = {n: convrot.ConvRotLinear.of(m, rotated[n]) if n in rotated else m for n, m in layers.items()}
    report.rotated = {n: rotated[n] for n in layers if n in rotated}  # for tests and the bench
    _log_rotation(report.rotated, stored, rotation, len(layers), getattr(cal, "dropped", ()))
    patches = _fuse(model, layers, adapter) if adapter is not None else dict(layers)
    install_patches(out, patches)
    dropped = skipped = 0
    for name in layers:
        for attr in ("weight", "bias"):
            key = f"{PREFIX}{name}.{attr}"
            plist = out.patches.pop(key, None)
            if plist is not None:
                dropped += merged.get(key, 0)
                skipped += len(plist) - merged.get(key, 0)
    out.patches_uuid = uuid.uuid4()  # forces ComfyUI to reload (not reuse) the tree when switching models
    out.size = before_size - report.float_bytes + report.int8_bytes
    enable_lora(out, layers, before_size)  # an earlier Apply upstream: its layers stay guarded (clone's attachment)
    out.add_callback_with_key(CallbacksMP.ON_LOAD, _CALLBACK_KEY, _log_loaded)
    vram_after = _vram(compute_dev)
    mem = f"model weights {before_size / 2**20:.1f} -> {out.size / 2**20:.1f} MiB"
    if vram_before is not None:
        mem += f"; VRAM allocated {vram_before / 2**20:.0f} -> {vram_after / 2**20:.0f} MiB"
    report.model_bytes_before, report.model_bytes_after = before_size, out.size
    report.lora_patches_merged = dropped
    report.vram_before, report.vram_after = vram_before, vram_after
    out.int8_report = report  # for tests and the bench; not carried by later clones
    log.info("INT8 Apply [%s, preset %s]: %s; %s%s", backend, preset, report.summary(), mem,
             f"; {dropped} LoRA patches merged" if dropped else "")
    if skipped:
        log.warning("INT8 Apply: %d LoRA patches on the INT8 layers were not merged: ComfyUI skipped them (its "
                    "warning above says why, e.g. a LoRA of the wrong shape for its layer), so they have no effect",
                    skipped)
    # fused_triton layers outside fused modules (those always run INT8): int8 vs float per shape (issue 14)
    report.dispatch = dispatch.report_line([m for m in patches.values() if isinstance(m, Int8Linear)])
    if report.dispatch:
        log.info("INT8 Apply [%s]: %s", backend, report.dispatch)


def _log_rotation(rotated: dict, stored: dict, rotation: str, n_layers: int, dropped) -> None:
    if not rotated and rotation == "none":
        return
    n_stored = sum(1 for n in rotated if n in stored)
    log.info("INT8 Apply: %d of %d INT8 layers ConvRot-rotated (%d adopted as stored, %d rotated here, group %s); "
             "on fused_triton their input is rotated and quantized in one kernel, unfused from the norm before it",
             len(rotated), n_layers, n_stored, len(rotated) - n_stored,
             "/".join(str(g) for g in sorted(set(rotated.values()))) or "-")
    if rotation == "convrot" and len(rotated) < n_layers:
        log.info("INT8 Apply: %d INT8 layers not rotated (input width not a multiple of 16, or already INT8 "
                 "without rotation: adopted as stored)", n_layers - len(rotated))
    if dropped:
        log.warning("INT8 Apply: the calibration's SmoothQuant smoothing is not used for %d ConvRot layers (e.g. "
                    "%s); its float-kept layers still are", len(dropped), dropped[0])


NODE_CLASS_MAPPINGS = {"ApplyFusedInt8GEMM": ApplyFusedInt8GEMM}
NODE_DISPLAY_NAME_MAPPINGS = {"ApplyFusedInt8GEMM": "Apply Fused INT8 GEMM"}
