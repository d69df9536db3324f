"""A per-run cache for a linear whose input is constant within a sampling run (:class:`CachedLinear`), and the
ComfyUI wrappers that bind and empty such caches (``diffusion_model_wrapper``, ``outer_sample_wrapper``; the Apply
node installs them when a fused module holds one). Pure torch; no ComfyUI import.
"""
from __future__ import annotations

import contextlib
import logging
import weakref

import torch
from torch import nn

from .linear import Int8Linear

log = logging.getLogger("int8_fused")

_ALL_CACHES: "weakref.WeakSet[CachedLinear]" = weakref.WeakSet()
MAX_ENTRIES = 8  # per module: conds of one run (positive, negative, area conds); oldest dropped first


def invalidate_all() -> None:
    """Empty every CachedLinear in the process (cheap; called at the start and end of a sampling run)."""
    for m in list(_ALL_CACHES):
        m.invalidate()


class CachedLinear(nn.Module):
    """Memoises a linear whose input is constant within a sampling run (e.g. a projection of the text features,
    which the model recomputes every step, equal every step).

    Correctness: a cached result is reused only under a *bound key* (``bind(key)``; the nodes layer binds
    the cond uuids ComfyUI gives each conditioning per sampling run, see ``diffusion_model_wrapper``) AND for
    an input of the same shape/dtype/device AND while the wrapped weight is the same tensor at the same
    version. The first reuse of an entry also compares a GPU fingerprint of the new input with the stored
    one (one host sync per entry per run); a mismatch turns caching off for that key. No key bound ->
    plain call (e.g. a direct ``diffusion_model(...)`` call outside a sampler). ``invalidate()`` drops
    everything; the nodes layer calls it when a sampling run starts and ends (OUTER_SAMPLE wrapper).

    ``weight``/``bias`` read and write through to the wrapped module, so ComfyUI's weight patching (LoRA)
    still reaches the layer by its usual key ``<name>.weight``."""

    def __init__(self, inner: nn.Module, name: str = ""):
        super().__init__()
        self.inner = inner
        self.name = name
        self._key = None
        self._entries: dict = {}
        self._bad: set = set()
        self.hits = 0      # counters for tests and the bench log
        self.misses = 0
        _ALL_CACHES.add(self)

    # -- attribute pass-through for ComfyUI's weight patching
    def __getattr__(self, name):
        if name in ("weight", "bias"):
            return getattr(self._modules["inner"], name)
        return super().__getattr__(name)

    def __setattr__(self, name, value):
        if name in ("weight", "bias") and "inner" in self.__dict__.get("_modules", {}):
            setattr(self._modules["inner"], name, value)
        else:
            super().__setattr__(name, value)

    def int8_layers(self) -> dict[str, Int8Linear]:
        """{"": the wrapped layer} when it is an Int8Linear (the name is this module's own), else {}."""
        return {"": self.inner} if isinstance(self.inner, Int8Linear) else {}

    # -- cache control
    def invalidate(self) -> None:
        self._entries.clear()
        self._bad.clear()

    @contextlib.contextmanager
    def bind(self, key):
        """Within this block, calls belong to ``key`` (hashable; None = do not cache)."""
        prev, self._key = self._key, key
        try:
            yield self
        finally:
            self._key = prev

    def _weight_id(self):
        t = getattr(self.inner, "qweight", None)
        if t is None:
            t = getattr(self.inner, "weight", None)
        return None if t is None else (id(t), _version(t), t.device)

    @staticmethod
    def _fingerprint(x: torch.Tensor, rows: int = 64) -> torch.Tensor:
        """Per-row sum and position-weighted sum, fp32 on x's device (deterministic for equal inputs). In
        chunks of ``rows`` rows: a [512, 53248] input would need 2 x 109 MB of fp32 at once."""
        v = x.reshape(-1, x.shape[-1])
        ramp = torch.arange(1, v.shape[-1] + 1, device=v.device, dtype=torch.float32).mul_(0.6180339887).frac_()
        parts = []
        for c in v.split(rows):
            cf = c.float()
            parts.append(torch.stack([cf.sum(-1), (cf * ramp).sum(-1)]))
        return torch.cat(parts, dim=1) if parts else v.new_zeros((2, 0), dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = self._key
        if key is None or key in self._bad or getattr(self.inner, "weight_function", None):
            return self.inner(x)
        full = (key, tuple(x.shape), x.dtype, x.device, self._weight_id())
        e = self._entries.get(full)
        if e is not None and _version(e["y"]) == e["version"]:
            if e["fp"] is not None:  # first reuse in this run: check the content once
                if not torch.equal(self._fingerprint(x), e["fp"]):
                    log.warning("INT8 cache %s: input changed under the same conditioning key; caching off "
                                "for it", self.name or "?")
                    self._bad.add(key)
                    self._entries.pop(full, None)
                    return self.inner(x)
                e["fp"] = None
            self.hits += 1
            return e["y"]
        self.misses += 1
        y = self.inner(x)
        while len(self._entries) >= MAX_ENTRIES:
            self._entries.pop(next(iter(self._entries)))
        self._entries[full] = {"y": y, "version": _version(y), "fp": self._fingerprint(x)}
        return y


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter; None for inference tensors (ComfyUI runs nodes and
    sampling under ``torch.inference_mode``, whose tensors keep no counter: they cannot be modified
    in place outside inference mode, and nothing in the model modifies these in place)."""
    return None if t.is_inference() else t._version


def cache_modules(diffusion_model: nn.Module) -> list[CachedLinear]:
    return [m for m in diffusion_model.modules() if isinstance(m, CachedLinear)]


@contextlib.contextmanager
def bind_caches(diffusion_model: nn.Module | None, key):
    """Bind ``key`` on every CachedLinear of the model for the duration (e.g. a bench loop: one key per
    prompt); ``diffusion_model=None``: on every live CachedLinear of the process, without walking a module
    tree (the sampler's per-call wrapper: walking a large model's thousands of modules every call is host time
    on every step).
    Binding a model that is not running is harmless: its caches are only read by its own forward."""
    with contextlib.ExitStack() as stack:
        for m in (cache_modules(diffusion_model) if diffusion_model is not None else list(_ALL_CACHES)):
            stack.enter_context(m.bind(key))
        yield


def _transformer_options(args, kwargs):
    to = kwargs.get("transformer_options")
    if isinstance(to, dict):
        return to
    return next((a for a in args if isinstance(a, dict) and ("uuids" in a or "cond_or_uncond" in a)), {})


def diffusion_model_wrapper(executor, *args, **kwargs):
    """A ComfyUI DIFFUSION_MODEL wrapper: runs the model with the CachedLinears bound to this call's conditioning
    uuids (``transformer_options["uuids"]``: fresh per cond per sampling run, stable across its steps)."""
    to = _transformer_options(args, kwargs)
    uuids = to.get("uuids")
    key = tuple(uuids) if uuids else None
    dm = getattr(executor, "class_obj", None)
    if key is None or dm is None:
        return executor(*args, **kwargs)
    with bind_caches(None, key):
        return executor(*args, **kwargs)


def outer_sample_wrapper(executor, *args, **kwargs):
    """A ComfyUI OUTER_SAMPLE wrapper: empties every cache when a sampling run starts and when it ends
    (the uuid keys already differ between runs; this frees the entries and guards against reuse)."""
    invalidate_all()
    try:
        return executor(*args, **kwargs)
    finally:
        invalidate_all()
