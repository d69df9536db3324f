""""Load Ideogram 4.0 INT8": an INT8 W8A8 checkpoint (any layout ``quant.formats`` reads) -> two MODELs.

How a branch becomes a MODEL without ever holding its float weights (``build_branch``):
  1. A skeleton state dict is made from the file: float tensors (norms, embeddings, protected linears)
     are read; each quantized linear contributes its int8 ``qweight``/``weight_scale``/``smooth``/``bias``
     plus a *meta-device* ``weight`` [N, K] so ComfyUI's architecture detection sees the usual shapes.
  2. ``comfy.sd.load_diffusion_model_state_dict`` builds the model with ``custom_operations`` whose
     ``Linear`` is created on the meta device (no storage) and, on load, keeps the int8 tensors (or
     materializes a float weight for protected layers).
  3. Each such Linear that received int8 tensors is replaced in the module tree by the pack's
     ``quant.linear.Int8Linear`` (the same module "Apply Fused INT8 GEMM" uses), its backend resolved
     once for the load device. A linear that received nothing raises an error naming it.
Peak memory is one branch's int8 weights plus its float tensors; branches are built one after the other
and the conditional and unconditional backbones are never both in float.
"""
from __future__ import annotations

import collections
import functools
import logging
import os

import torch
from torch import nn

from .. import adapters
from ..adapters.ideogram4 import layout as i4
from ..quant import backends, convrot
from ..quant.formats import CheckpointError, open_checkpoint, read_header
from ..quant.linear import Int8Linear
from . import attention as attention_routing, pad_elision
from .apply import backend_choices, enable_lora, forced_backend, install_patches
from .common import CATEGORY

log = logging.getLogger("int8_fused")
NONE = "none"
REQUIRED_COMFYUI = "0.33.0"


# ComfyUI is imported inside functions: pytest imports the pack's __init__ without ComfyUI on the path.
@functools.cache
def slot_ops():
    """``custom_operations`` whose Linear is built without storage and, on load, keeps int8 tensors
    (``int8_tensors``) or materializes a float weight (protected layers)."""
    import comfy.ops

    class Int8Slot(comfy.ops.manual_cast.Linear):
        def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
            super().__init__(in_features, out_features, bias, device="meta", dtype=dtype)
            # Empty (0-element) CPU placeholders rather than meta tensors: older ComfyUI moves the model
            # with .to() before loading weights, which meta tensors refuse.
            dt = dtype or torch.float32
            self.weight = nn.Parameter(torch.empty(0, dtype=dt), requires_grad=False)
            if bias:
                self.bias = nn.Parameter(torch.empty(0, dtype=dt), requires_grad=False)
            self.int8_tensors = None
            self.slot_dtype = dtype

        def _load_from_state_dict(self, sd, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                  error_msgs):
            if prefix + "qweight" in sd:
                self.int8_tensors = {k: sd.pop(prefix + k) for k in ("qweight", "weight_scale", "bias", "smooth")
                                     if prefix + k in sd}
                sd.pop(prefix + "weight", None)
                return
            w, b = sd.pop(prefix + "weight", None), sd.pop(prefix + "bias", None)
            if w is None or w.is_meta or w.numel() == 0:
                missing_keys.append(prefix + "weight")
                return
            dt = self.slot_dtype or w.dtype
            self.weight = nn.Parameter(w.to(dt), requires_grad=False)
            if self.bias is not None or b is not None:
                self.bias = None if b is None else nn.Parameter(b.to(dt), requires_grad=False)

    class Int8SlotOps(comfy.ops.manual_cast):
        Linear = Int8Slot

    return Int8SlotOps


def _int8_module(name: str, t: dict, backend: str, device: torch.device,
                 rotation: int | None = None) -> tuple[Int8Linear, str | None]:
    """(the layer on the backend that runs it here, why ``backend`` was passed over or None); ``rotation``: the
    ConvRot group size of a rotated core ``int8_tensorwise`` layer (a ``ConvRotLinear``, as Apply adopts it)."""
    q, s = t["qweight"], t["weight_scale"].float().reshape(-1)
    N, K = q.shape
    chosen, note = backends.resolve(backend, device, N, K)
    if rotation is not None:
        return convrot.ConvRotLinear.from_stored(q, s, rotation, t.get("bias"), backend=chosen, name=name), note
    return Int8Linear.from_quantized(q, s, t.get("bias"), t.get("smooth"), backend=chosen, name=name), note


def _base_tensor(base_path: str, branch: str, name: str, f, keys: set) -> torch.Tensor | None:
    for k in (f"{branch}.{name}" if branch else name, name, f"model.diffusion_model.{name}"):
        if k in keys:
            return f.get_tensor(k)
    return None


def skeleton(ck, branch: str, base_path: str | None = None, missing: list[str] = ()) -> dict:
    """Step 1 of the module docstring; ``missing`` non-linear tensors come from ``base_path``."""
    sd = ck.branch_state_dict(branch)
    for n, e in ck.branches[branch].quant.items():
        sd[f"{n}.weight"] = torch.empty(e.out_features, e.in_features, device="meta", dtype=torch.bfloat16)
    if missing:
        if base_path is None:
            raise CheckpointError(
                f"{ck.name}: the {branch or 'model'} branch lacks {len(missing)} non-linear tensors (norms, "
                f"embeddings): {missing[:8]}{' ...' if len(missing) > 8 else ''}. Choose the matching float/FP8 "
                "Ideogram 4 checkpoint as base checkpoint (the unconditional branch needs the unconditional "
                "one) to take them from")
        from safetensors import safe_open
        header, _ = read_header(base_path)
        with safe_open(base_path, framework="pt", device="cpu") as f:
            keys = set(header)
            absent = []
            for n in missing:
                t = _base_tensor(base_path, branch, n, f, keys)
                if t is None:
                    absent.append(n)
                else:
                    sd[n] = t
        if absent:
            raise CheckpointError(f"{os.path.basename(base_path)}: base checkpoint lacks {absent[:8]} too; "
                                  "choose the Ideogram 4 checkpoint of the same branch")
    return sd


def build_branch(ck, branch: str, backend: str, base_path: str | None = None, missing: list[str] = (),
                 dtype: torch.dtype | None = None, disable_dynamic: bool = False):
    """A ComfyUI ModelPatcher for one branch of an opened INT8 checkpoint (see the module docstring)."""
    import comfy.model_management as mm
    import comfy.sd

    sd = skeleton(ck, branch, base_path, missing)
    ops = slot_ops()
    opts = {"custom_operations": ops}
    if dtype is not None:
        opts["dtype"] = dtype
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options=opts, **(
        {"disable_dynamic": True} if disable_dynamic else {}))
    if patcher is None:
        raise CheckpointError(f"{ck.name}: ComfyUI could not detect the model architecture of the "
                              f"{branch or 'model'} branch; is it a diffusion model this ComfyUI supports?")
    dm = patcher.model.diffusion_model
    device = mm.get_torch_device()
    n_q, empty, bad, notes, layers = 0, [], [], {}, {}
    ran = collections.Counter()
    for name, mod in list(dm.named_modules()):
        if not isinstance(mod, ops.Linear):
            continue
        if mod.int8_tensors is None:
            if mod.weight.numel() == 0:
                empty.append(name)
            continue
        q = mod.int8_tensors["qweight"]
        if tuple(q.shape) != (mod.out_features, mod.in_features):
            bad.append(f"{name}: file [{q.shape[0]}, {q.shape[1]}], model [{mod.out_features}, {mod.in_features}]")
            continue
        entry = ck.branches[branch].quant.get(name)
        new, note = _int8_module(name, mod.int8_tensors, backend, device, entry.rotation if entry else None)
        ran[new.backend] += 1
        if note:
            notes.setdefault(new.backend, note)
        parent, _, leaf = name.rpartition(".")
        setattr(dm.get_submodule(parent) if parent else dm, leaf, new)
        layers[name] = new
        n_q += 1
    if bad:
        raise CheckpointError(f"{ck.name}: {len(bad)} layers do not fit the model ComfyUI built: {bad[:4]}; "
                              "the file is for another model size or architecture")
    if empty:
        raise CheckpointError(f"{ck.name}: the {branch or 'model'} branch has no weights for {empty[:8]}"
                              f"{' ...' if len(empty) > 8 else ''}; the file is incomplete")
    patcher.int8_backends = dict(ran.most_common())
    # What Apply fuses on fused_triton (the Ideogram 4 adapter: whole blocks, FeedForwards, llm_cond_proj cache),
    # as object patches over the tree that already holds the plain Int8Linear layers.
    fused_modules = {n: m for n, m in adapters.object_patches(dm, layers).items()
                     if getattr(m, "covers", None) is not None}
    install_patches(patcher, fused_modules)
    enable_lora(patcher, layers)  # a LoRA after the loader runs as side branches, as after Apply
    patcher.int8_fused_modules = len(fused_modules)
    n_rot = sum(isinstance(m, convrot.ConvRotLinear) for m in layers.values())
    log.info("[int8_fused] %s %s: %d INT8 linears on %s (asked %s)%s%s%s", ck.name, branch or "model", n_q,
             ", ".join(f"{b}: {n}" for b, n in ran.most_common()) or "none", backend,
             "".join(f"; {b} because {why}" for b, why in notes.items()),
             f"; {n_rot} ConvRot-rotated (their input rotated in the quantization kernel)" if n_rot else "",
             f"; {len(fused_modules)} modules fused" if fused_modules else "")
    return patcher


def _require_ideogram4() -> None:
    try:
        import comfy.ldm.ideogram4.model  # noqa: F401
    except ImportError:
        try:
            from comfyui_version import __version__ as v
        except ImportError:
            v = "unknown"
        raise RuntimeError(f"Load Ideogram 4.0 INT8 needs a ComfyUI with native Ideogram 4 support "
                           f"(comfy.ldm.ideogram4, ComfyUI {REQUIRED_COMFYUI} or newer); this ComfyUI is {v}. "
                           "Update ComfyUI") from None


def comfy_widths() -> dict:
    """The widths this ComfyUI builds Ideogram 4 at: its model config (``supported_models.Ideogram4``) over the
    model class's defaults. Detection reads only the depth and the in/out channels from a file, so a file is checked
    against these (``i4.REAL`` where this ComfyUI names none)."""
    import inspect

    import comfy.supported_models as sm
    from comfy.ldm.ideogram4.model import Ideogram4Transformer2DModel as M
    d = {k: p.default for k, p in inspect.signature(M.__init__).parameters.items()
         if p.default is not inspect.Parameter.empty}
    d.update(getattr(getattr(sm, "Ideogram4", None), "unet_extra_config", {}) or {})
    try:
        heads, head = int(d["num_attention_heads"]), int(d["attention_head_dim"])
        return i4.widths(hidden=heads * head, heads=heads, ffn=int(d["intermediate_size"]),
                         adaln=int(d["adaln_dim"]), text=int(d["llm_features_dim"]))
    except (KeyError, TypeError, ValueError):
        return i4.widths()


class NoBackbone(nn.Module):
    """The diffusion model of a MODEL output whose backbone the file does not hold: raises when called."""

    def __init__(self, message: str, dtype: torch.dtype):
        super().__init__()
        self.message, self.dtype = message, dtype

    def forward(self, *args, **kwargs):
        raise CheckpointError(self.message)


def _empty_branch(patcher, message: str):
    """A MODEL of ``patcher``'s architecture whose diffusion model is a :class:`NoBackbone`: it fails with
    ``message`` wherever it is sampled (a guider's main model, DualModelGuider's ``model_negative``, ...),
    since every path to the backbone calls that module. Its own BaseModel: no weights, no shared state."""
    base = patcher.model
    src = base.model_config  # copied by hand: its __getattr__ answers None for anything, which copy.copy trips on
    cfg = object.__new__(type(src))
    cfg.__dict__.update(vars(src))
    cfg.unet_config = dict(src.unet_config, disable_unet_model_creation=True)
    model = type(base)(cfg, base.model_type, device=None)
    model.diffusion_model = NoBackbone(message, base.get_dtype())
    return type(patcher)(model, load_device=patcher.load_device, offload_device=patcher.offload_device)


def _missing_message(file_name: str, has: str) -> str:
    other = "unconditional" if has == "conditional" else "conditional"
    what = "a single backbone" if has == "conditional" else "only the unconditional backbone"
    return (f"Load Ideogram 4.0 INT8: {file_name} holds {what}, so this loader's model_{other} output is "
            f"empty. Take model_{other} from a second 'Load Ideogram 4.0 INT8' with the {other} INT8 file"
            + (", or use ordinary CFG with model_conditional only" if has == "conditional" else ""))


def _instrument(patcher, node_id, backend) -> None:
    from . import timing  # the pack's own module: imported unconditionally (a broken one must show)
    timing.instrument(patcher, node_id=str(node_id), backend=backend,
                      backends_used=getattr(patcher, "int8_backends", None))


def _build_one(path: str, branch: str, backend: str, base: str | None, real_widths: bool,
               disable_dynamic: bool = False):
    """One branch of ``path`` built again (``cached_patcher_init``: the deep clone of MultiGPU CFG Split; with
    ``disable_dynamic`` the non-DynamicVRAM model ComfyUI asks for under TorchCompileModel)."""
    with open_checkpoint(path) as ck:
        missing = i4.check_branch(ck.branches[branch], ck.header, ck.name,
                                  real_widths=comfy_widths() if real_widths else False)
        return build_branch(ck, branch, backend, base, missing, dtype=torch.bfloat16,
                            disable_dynamic=disable_dynamic)


def load_ideogram4(path: str, backend: str, base_cond: str | None, base_uncond: str | None,
                   real_widths: bool = True, node_id=None, attention: str = attention_routing.DEFAULT):
    """(model_conditional, model_unconditional) ModelPatchers built from an INT8 Ideogram 4 file, with
    ``attention`` routing and pad-token elision installed as the Apply node installs them."""
    import comfy.model_management as mm

    attention_routing.check_mode(attention)
    _require_ideogram4()
    if backend == "auto":
        backend = forced_backend() or backends.default_backend(mm.get_torch_device())
    expected = comfy_widths() if real_widths else False
    with open_checkpoint(path) as ck:
        order = [b for b in ("conditional", "unconditional", "") if b in ck.branches]
        out = {}
        for br in order:
            missing = i4.check_branch(ck.branches[br], ck.header, ck.name, real_widths=expected)
            base = base_uncond if br == "unconditional" else base_cond
            out[br] = build_branch(ck, br, backend, base, missing, dtype=torch.bfloat16)
            # how to load this MODEL again, as ComfyUI's own loaders record it: MultiGPU CFG Split's clone for
            # another GPU builds its own from it (nodes/multigpu.py gives it its own fused modules)
            out[br].cached_patcher_init = (_build_one, (path, br, backend, base, real_widths))
            attention_routing.install(out[br], attention)
            pad_elision.install(out[br], backend)
            _instrument(out[br], f"{node_id}:{br or 'model'}", backend)
    name = os.path.basename(path)
    cond = out.get("conditional", out.get(""))
    uncond = out.get("unconditional")
    # A file with one backbone fills one output; the other is a MODEL that errors when sampled.
    if cond is None:
        log.warning("[int8_fused] %s", _missing_message(name, "unconditional"))
        cond = _empty_branch(uncond, _missing_message(name, "unconditional"))
    elif uncond is None:
        uncond = _empty_branch(cond, _missing_message(name, "conditional"))
    return cond, uncond


class LoadIdeogram4Int8:
    """Two MODELs (conditional, unconditional) for DualModelGuider from one INT8 W8A8 file."""

    @classmethod
    def INPUT_TYPES(cls):
        import folder_paths

        files = folder_paths.get_filename_list("diffusion_models")
        bases = [NONE] + files
        return {"required": {
            "unet_name": (files, {"tooltip": "INT8 file in models/diffusion_models: transformerlab W8A8 (both "
                                             "branches), ComfyUI int8_tensorwise or this pack's int8_fused"}),
            "backend": (["auto"] + [b for b in backend_choices() if backends.get(b).quantizes],
                        {"tooltip": "INT8 GEMM backend; only those this machine can run are listed; auto = "
                                    "the fastest of them. The log names the backend each layer runs on"}),
            "base_checkpoint": (bases, {"tooltip": "float/FP8 Ideogram 4 (conditional) supplying norms and "
                                                   "embeddings the INT8 file lacks"}),
            "base_checkpoint_unconditional": (bases, {"tooltip": "the same for the unconditional backbone"}),
        }, "optional": {
            "attention": (attention_routing.CHOICES, {"default": attention_routing.DEFAULT,
                                                      "tooltip": attention_routing.TOOLTIP}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    RETURN_TYPES = ("MODEL", "MODEL")
    RETURN_NAMES = ("model_conditional", "model_unconditional")
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Loads an INT8 W8A8 Ideogram 4.0 checkpoint as two fast MODELs for DualModelGuider. "
                   "A file with one backbone fills one output; the other errors wherever it is sampled (a "
                   "file of the unconditional backbone alone gives model_unconditional).")

    def load(self, unet_name, backend, base_checkpoint, base_checkpoint_unconditional,
             attention=attention_routing.DEFAULT, unique_id=None):
        import folder_paths

        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        get = lambda n: None if n == NONE else folder_paths.get_full_path_or_raise("diffusion_models", n)  # noqa: E731
        return load_ideogram4(path, backend, get(base_checkpoint), get(base_checkpoint_unconditional),
                              node_id=unique_id, attention=attention)


NODE_CLASS_MAPPINGS = {"LoadIdeogram4Int8": LoadIdeogram4Int8}
NODE_DISPLAY_NAME_MAPPINGS = {"LoadIdeogram4Int8": "Load Ideogram 4.0 INT8"}
