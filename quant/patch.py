"""Build ``Int8Linear`` replacements for a list of named float linears (pure torch, no ComfyUI).

Used by the "Apply Fused INT8 GEMM" node and by the loader/save code:

    layers, report = build_int8_layers(named_linears, "fused_triton", calibration=cal,
                                       keep_float=["final_layer"], weight_fn=merged_weight)

``named_linears``: (name, module) pairs — an ``nn.Linear`` (or ComfyUI's casting subclass) or a
``(weight [N, K], bias [N] | None)`` tuple. ``weight_fn(name, module)`` returns the float weight to
quantize (e.g. LoRA-merged, fp8 dequantized); without it the module's own weight is used.

Per layer: keep_float patterns and protected calibration entries stay float; the backend is resolved
once (``backends.resolve``), walking its fallbacks for shapes it cannot take; the weight is quantized on
``compute_device`` (the GPU when there is one: fast) and the int8 result stored on ``store_device``
(where ComfyUI keeps offloaded weights). Fallbacks are summarised in ONE log line, never per layer.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Callable, Iterable

import torch
from torch import nn

from . import backends
from .linear import Int8Linear
from .select import compile_patterns, matches

log = logging.getLogger("int8_fused")


@dataclasses.dataclass
class PatchReport:
    """What ``build_int8_layers`` did. Bytes are the persistent tensors (what ComfyUI counts)."""
    backend: str
    quantized: int = 0
    kept_float: dict = dataclasses.field(default_factory=dict)   # name -> reason
    fallbacks: dict = dataclasses.field(default_factory=dict)    # name -> (backend used, why)
    backends_used: Counter = dataclasses.field(default_factory=Counter)
    smoothed: int = 0
    adopted: int = 0       # already-int8 layers (core int8_tensorwise) taken as they are: no second rounding
    float_bytes: int = 0   # bytes of the float modules replaced
    int8_bytes: int = 0    # bytes of their Int8Linear replacements
    # filled in by the node: the whole model's weight bytes and (CUDA) allocated VRAM before/after
    model_bytes_before: int = 0
    model_bytes_after: int = 0
    vram_before: int | None = None
    vram_after: int | None = None
    lora_patches_merged: int = 0

    def summary(self) -> str:
        used = ", ".join(f"{n}: {c}" for n, c in self.backends_used.most_common()) or "none"
        s = (f"{self.quantized} linears -> INT8 ({used}); {self.float_bytes / 2**20:.1f} MiB float -> "
             f"{self.int8_bytes / 2**20:.1f} MiB int8")
        if self.adopted:
            s += f"; {self.adopted} already int8 (core int8_tensorwise) adopted as stored, not re-rounded"
        if self.smoothed:
            s += f"; {self.smoothed} SmoothQuant-calibrated"
        if self.kept_float:
            s += f"; {len(self.kept_float)} kept float"
        if self.fallbacks:
            s += f"; {len(self.fallbacks)} on a fallback backend"
        return s

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["backends_used"] = dict(self.backends_used)
        return d


def module_bytes(m) -> int:
    if isinstance(m, nn.Module):
        return sum(t.numel() * t.element_size() for t in m.state_dict().values()
                   if isinstance(t, torch.Tensor))
    w, b = m
    return sum(t.numel() * t.element_size() for t in (w, b) if t is not None)


def _weight_bias(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(module, tuple):
        return module
    return module.weight, getattr(module, "bias", None)


def _shape(module) -> tuple[int, int]:
    if isinstance(module, tuple):
        return tuple(module[0].shape)
    if hasattr(module, "out_features"):
        return module.out_features, module.in_features
    return tuple(module.weight.shape)


def build_int8_layers(named_linears: Iterable[tuple[str, object]], backend: str, calibration=None,
                      keep_float=(), weight_fn: Callable | None = None, *,
                      bias_fn: Callable | None = None, quantized_fn: Callable | None = None,
                      device: torch.device | None = None,
                      compute_device: torch.device | None = None,
                      store_device: torch.device | None = None) -> tuple[dict[str, Int8Linear], PatchReport]:
    """Quantize each named linear for ``backend``; returns ({name: Int8Linear}, PatchReport).

    ``keep_float``: names or regular expressions (a list, or one comma-separated string) of layers to
    leave in float. ``calibration``: duck-typed ``for_layer(name, out_features, in_features)`` returning
    None or an object with ``.smooth`` (fp32 [K] or None) and ``.protected`` (bool); it raises
    ValueError naming the layer on a shape mismatch. ``device``: where the model will run (decides
    which backend takes each layer; default: the weight's device). ``bias_fn(name, module)``: like
    ``weight_fn`` for the bias. ``quantized_fn(name, module)`` returns (int8 [N, K], fp32 scale [N] or
    scalar) for a layer that is already int8 per output channel (adopted as it is, unless calibration
    smooths it: smoothing needs the float weight), else None. Raises ValueError for an unknown backend.
    """
    b = backends.get(backend)
    report = PatchReport(backend=backend)
    if not b.quantizes:  # the bf16 control: nothing to build
        return {}, report
    pats = compile_patterns(keep_float) if isinstance(keep_float, str) else \
        compile_patterns(",".join(keep_float))
    out: dict[str, Int8Linear] = {}
    for name, module in named_linears:
        if pats and matches(name, pats):
            report.kept_float[name] = "keep_float pattern"
            continue
        N, K = _shape(module)
        entry = calibration.for_layer(name, N, K) if calibration is not None else None
        if entry is not None and getattr(entry, "protected", False):
            report.kept_float[name] = "protected by calibration"
            continue
        smooth = getattr(entry, "smooth", None) if entry is not None else None
        w, bias = _weight_bias(module)
        run_dev = torch.device(device) if device is not None else w.device
        chosen, why = backends.resolve(backend, run_dev, N, K)
        if why is not None:
            report.fallbacks[name] = (chosen, why)
        pre = quantized_fn(name, module) if quantized_fn is not None and smooth is None else None
        if bias_fn is not None:
            bias = bias_fn(name, module)
        if pre is not None:
            qw, ws = (t.to(compute_device) if compute_device is not None else t for t in pre)
            layer = Int8Linear.from_quantized(qw, ws, bias, backend=chosen, name=name)
            report.adopted += 1
        else:
            if weight_fn is not None:
                w = weight_fn(name, module)
            if compute_device is not None:
                w = w.to(compute_device)
                smooth = None if smooth is None else smooth.to(compute_device)
            layer = Int8Linear.from_float(w, bias, smooth=smooth, backend=chosen, name=name)
        if store_device is not None:
            layer = layer.to(store_device)
        out[name] = layer
        report.quantized += 1
        report.smoothed += smooth is not None
        report.backends_used[chosen] += 1
        report.float_bytes += module_bytes(module)
        report.int8_bytes += layer.nbytes()
    if report.fallbacks:
        reasons = Counter(f"{used} ({why})" for used, why in report.fallbacks.values())
        log.warning("INT8 %s: %d of %d layers run on a fallback: %s", backend, len(report.fallbacks),
                    report.quantized, "; ".join(f"{n}x {r}" for r, n in reasons.most_common()))
    return out, report
