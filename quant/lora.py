"""LoRA on INT8 layers at run time: low-rank side branches (pure torch, no ComfyUI import).

A LoRA loaded after the Apply node arrives as ComfyUI weight patches (``ModelPatcher.patches``: key
``diffusion_model.<layer>.weight`` -> [(strength, adapter, strength_model, offset, function)]). The int8 weights are
never patched: each INT8 layer gets its LoRAs as a branch beside the int8 GEMM,

    y = int8_linear(x) + sum_i s_i * (x A_i^T) B_i^T        s_i = strength_i * alpha_i / rank_i

(A = down [r, K], B = up [N, r], alpha / rank as ``comfy.lora`` computes it), run as one GEMM pair in the layer's
dtype over the concatenated ranks: ``h = x D^T`` (D [R, K]: every down) and ``y + h U^T`` (U [N, R]: every up times
its s, one ``addmm``). A patch with an offset (a diffusers LoRA's q / k / v into a fused qkv, a w1 / w3 of a merged
w1+w3 GEMM) fills its rows / columns of D and U, zeros elsewhere. A bias ``diff`` patch adds its vector.

Supported: ComfyUI's plain LoRA (``LoRAAdapter`` without ``lora_mid`` / ``dora_scale`` / reshape) on weights, and
``diff`` on biases. Anything else on an INT8 layer (LoCon, DoRA, LoHa, LoKr, full diffs, ``set``, a weight function,
``strength_model`` != 1) raises :class:`LoraError` naming the layer: such a LoRA has to be merged (loaded before
Apply). A LoRA that would break the output however it runs (rank 0; NaN / Inf in its tensors, alpha or strength,
its tensors read once each) raises :class:`LoraError` naming the layer too. :func:`install` sets the branches of
every INT8 layer of a model at its run start (``Int8Linear.set_lora``); the device copies of the LoRA tensors are
made once per source tensor, device and dtype (:func:`on_device`), so a new strength only rescales U on the device.
"""
from __future__ import annotations

import math
import weakref

import torch

from ..kernel.checks import LORA_CHUNK
from .linear import Int8Linear

MERGE_HINT = ("Load that LoRA BEFORE 'Apply Fused INT8 GEMM' (it merges the LoRA into the weights it quantizes), "
              "or use another LoRA format.")


class LoraError(RuntimeError):
    """A weight patch on an INT8 layer that cannot run as a low-rank branch."""


def _refuse(what: str, name: str, v=None):
    raise LoraError(f"LoRA after Apply: {what} on INT8 layer '{name}'{_source(v)} cannot run as a low-rank side "
                    "branch. " + MERGE_HINT)


def _source(v) -> str:
    """Where a patch's tensors come from in its LoRA file (ComfyUI keeps their keys, ``loaded_keys``, not the
    file's name), for an error message; empty when unknown."""
    keys = sorted(getattr(v, "loaded_keys", None) or ())
    return f" (the LoRA file's {', '.join(repr(k) for k in keys[:3])}{', ...' if len(keys) > 3 else ''})" \
        if keys else ""


def _damaged(what: str, name: str, v=None):
    """A LoRA that has no usable low-rank term (rank 0, NaN / Inf values or strength): LoraError naming the layer
    (no merge hint: merged before Apply it breaks the float weights as well)."""
    raise LoraError(f"LoRA after Apply: the LoRA on INT8 layer '{name}'{_source(v)} {what}.")


def _per_source(cache: dict, t: torch.Tensor, key, make):
    """``cache[key]``, made by ``make()`` the first time, dropped from ``cache`` when the source tensor ``t`` is
    freed: what this module derives from a LoRA tensor is derived once while the tensor lives."""
    v = cache.get(key)
    if v is None:
        v = cache[key] = make()
        weakref.finalize(t, cache.pop, key, None)
    return v


_FINITE: dict = {}  # id(source tensor) -> whether every value is finite


def _finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds only finite values: read once per source tensor while it lives (a run start reads no
    LoRA tensor again)."""
    return _per_source(_FINITE, t, id(t), lambda: bool(torch.isfinite(t.detach()).all()))


_COPIES: dict = {}  # (id(source), device, dtype) -> copy, dropped when the source tensor is freed


def on_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t`` on ``device`` in ``dtype``: one copy per source tensor, device and dtype while ``t`` lives."""
    if t.device == device and t.dtype == dtype:
        return t
    return _per_source(_COPIES, t, (id(t), device, dtype), lambda: t.detach().to(device, dtype))


class Term:
    """One LoRA on a layer: ``down`` [r, k], ``up`` [n, r] (the source tensors), ``scale`` = strength * alpha / r,
    its output rows [row, row + n) and input columns [col, col + k) of the layer."""
    __slots__ = ("down", "up", "scale", "row", "col")

    def __init__(self, down, up, scale, row=0, col=0):
        self.down, self.up, self.scale, self.row, self.col = down, up, float(scale), row, col

    def same(self, o: "Term") -> bool:
        return (self.down is o.down and self.up is o.up and self.scale == o.scale and self.row == o.row
                and self.col == o.col)


class Branches:
    """The LoRA branches of one INT8 layer [N, K] for a run: low-rank ``terms`` and bias ``(vector, row)`` adds."""
    __slots__ = ("terms", "bias", "n", "k", "_dev", "_rows")

    def __init__(self, terms, bias, n: int, k: int):
        self.terms, self.bias, self.n, self.k = tuple(terms), tuple(bias), n, k
        self._dev, self._rows = {}, {}

    def same(self, o) -> bool:
        return (isinstance(o, Branches) and len(o.terms) == len(self.terms) and len(o.bias) == len(self.bias)
                and all(a.same(b) for a, b in zip(self.terms, o.terms))
                and all(a[0] is b[0] and a[1] == b[1] for a, b in zip(self.bias, o.bias)))

    def rows(self, start: int, stop: int) -> "Branches | None":
        """The branches of output rows [start, stop) (a row view of a merged GEMM, ``Int8Linear.rows``), made once;
        None where no term or bias reaches them."""
        if (start, stop) not in self._rows:
            terms, bias = [], []
            for t in self.terms:
                a, b = max(start, t.row), min(stop, t.row + t.up.shape[0])
                if a < b:
                    up = t.up if b - a == t.up.shape[0] else t.up[a - t.row:b - t.row]
                    terms.append(Term(t.down, up, t.scale, a - start, t.col))
            for v, row in self.bias:
                a, b = max(start, row), min(stop, row + v.shape[0])
                if a < b:
                    bias.append((v[a - row:b - row], a - start))
            self._rows[(start, stop)] = Branches(terms, bias, stop - start, self.k) if terms or bias else None
        return self._rows[(start, stop)]

    @property
    def rank(self) -> int:
        return sum(t.down.shape[0] for t in self.terms)

    def operands(self, device: torch.device, dtype: torch.dtype):
        """(D [R, K] | None, U [N, R] with the scales | None, bias [N] | None) on ``device`` in ``dtype``, built once."""
        key = (device, dtype)
        ops = self._dev.get(key)
        if ops is None:
            ops = self._dev[key] = self._build(device, dtype)
        return ops

    def _build(self, device, dtype):
        d = u = b = None
        ts = self.terms
        if len(ts) == 1 and ts[0].up.shape[0] == self.n and ts[0].down.shape[1] == self.k:
            d = on_device(ts[0].down, device, dtype)
            u = on_device(ts[0].up, device, dtype) * ts[0].scale
        elif ts:
            d = torch.zeros(self.rank, self.k, device=device, dtype=dtype)
            u = torch.zeros(self.n, self.rank, device=device, dtype=dtype)
            r0 = 0
            for t in ts:
                (r, k), n = t.down.shape, t.up.shape[0]
                d[r0:r0 + r, t.col:t.col + k] = on_device(t.down, device, dtype)
                u[t.row:t.row + n, r0:r0 + r] = on_device(t.up, device, dtype) * t.scale
                r0 += r
        if self.bias:
            b = torch.zeros(self.n, device=device, dtype=torch.float32)
            for v, row in self.bias:
                b[row:row + v.shape[0]] += v.to(device, torch.float32)
            b = b.to(dtype)
        return d, u, b

    def down_from_codes(self, d: torch.Tensor, inv_smooth: torch.Tensor | None) -> torch.Tensor:
        """D with the layer's smoothing folded in, for an input read as int8 codes of ``x * inv_smooth``: D / inv_smooth
        (computed in fp32, rounded once), made once per device, dtype and smoothing vector."""
        if inv_smooth is None:
            return d
        key = (d.device, d.dtype, "smoothed")
        hit = self._dev.get(key)
        if hit is None or hit[0] is not inv_smooth:
            hit = self._dev[key] = (inv_smooth, (d.float() / inv_smooth.float()).to(d.dtype))
        return hit[1]

    def epilogue(self, device: torch.device, dtype: torch.dtype, inv_smooth: torch.Tensor | None):
        """(down [R', K], up [N, R']) for the LoRA-in-the-epilogue GEMM (``kernel.int8_gemm_lora``) on an input read
        as int8 codes of ``x * inv_smooth``: D with the smoothing folded in (:meth:`down_from_codes`) and U with the
        scales, both contiguous in ``dtype``, the rank zero-padded to a multiple of ``kernel.checks.LORA_CHUNK``; made
        once per device, dtype and smoothing vector. None without low-rank terms (bias adds only)."""
        d, u, _ = self.operands(device, dtype)
        if d is None:
            return None
        key = (device, dtype, "epilogue")
        hit = self._dev.get(key)
        if hit is None or hit[0] is not inv_smooth:
            down, up = self.down_from_codes(d, inv_smooth).contiguous(), u.contiguous()
            r = down.shape[0]
            if r % LORA_CHUNK:  # zero rows of D / columns of U: the padded ranks add nothing
                rp = -(-r // LORA_CHUNK) * LORA_CHUNK
                down = torch.cat((down, down.new_zeros((rp - r, self.k))))
                up = torch.cat((up, up.new_zeros((self.n, rp - r))), dim=1)
            hit = self._dev[key] = (inv_smooth, (down, up))
        return hit[1]

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus the bias adds (``diff`` patches on the layer's bias), in y's dtype."""
        b = self.operands(y.device, y.dtype)[2]
        return y if b is None else y + b

    def add_quantized(self, a_q: torch.Tensor, a_s: torch.Tensor, y: torch.Tensor,
                      inv_smooth: torch.Tensor | None = None) -> torch.Tensor:
        """``y`` (the int8 GEMM's output [M, N]) plus the branches, the down-projection read from the GEMM's own
        int8 input (a_q [M, K] int8, a_s [M] fp32: the codes of ``x * inv_smooth``, x = a_q * a_s / inv_smooth):
        ``h = (a_q D_s^T) * a_s`` (a_q exact in ``y``'s dtype, the product accumulated in fp32 by the GEMM, the
        per-token scale applied in fp32), then ``y + h U^T`` in one addmm. A fused block keeps its kernels: the
        branch costs two small GEMMs, not the block's per-linear path. Against :meth:`add` (the float input) the
        only difference is the input's int8 rounding inside the low-rank term."""
        def down(d):
            h = a_q.reshape(-1, self.k).to(y.dtype) @ self.down_from_codes(d, inv_smooth).t()
            # in place: computed in fp32 and rounded to h's dtype once, the bits of (h.float() * a_s).to(dtype)
            # in one launch instead of three
            return h.mul_(a_s.reshape(-1, 1).float())
        return self._plus(y, down)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the int8 output for input ``x``) plus the branches, in y's dtype."""
        return self._plus(y, lambda d: x.reshape(-1, self.k).to(y.dtype) @ d.t())

    def _plus(self, y: torch.Tensor, down) -> torch.Tensor:
        """``y + down(D) U^T`` (one addmm) plus the bias adds, in y's dtype; ``down(D)`` -> h [M, R]."""
        d, u, _ = self.operands(y.device, y.dtype)
        if d is not None:
            y = torch.addmm(y.reshape(-1, self.n), down(d), u.t()).reshape(y.shape)
        return self.add_bias(y)


def _describe(v) -> str:
    if isinstance(v, list):
        return "a nested weight patch"
    if isinstance(v, tuple):
        kind = v[0] if len(v) == 2 and isinstance(v[0], str) else "diff"
        return "a full-weight 'diff' patch" if kind == "diff" else f"a '{kind}' patch"
    name = getattr(v, "name", None) or type(v).__name__
    return {"loha": "a LoHa patch", "lokr": "a LoKr patch"}.get(name, f"a '{name}' patch")


def terms_of(name: str, param: str, patches, n: int, k: int, row0: int = 0):
    """(low-rank terms, bias adds) of ComfyUI patches on ``<name>.<param>`` (a layer [n, k] whose rows start at
    ``row0`` of the INT8 layer holding it); :class:`LoraError` for anything that is not a plain LoRA."""
    terms, bias = [], []
    for p in patches:
        strength, v, strength_model, offset, function = (tuple(p) + (None,) * 5)[:5]
        if function is not None:
            _refuse("a patch with a weight function", name)
        if strength_model != 1.0:
            _refuse(f"a patch scaling the model weight (strength_model {strength_model})", name)
        rows, cols = (0, n), (0, k)
        if offset is not None:
            dim, start, length = offset
            if dim == 0:
                rows = (start, length)
            elif dim == 1 and param == "weight":
                cols = (start, length)
            else:
                _refuse(f"a patch with offset {tuple(offset)}", name)
        if param == "bias":
            diff = v[1] if isinstance(v, tuple) and len(v) == 2 and v[0] == "diff" else v
            if not (isinstance(diff, tuple) and len(diff) >= 1 and isinstance(diff[0], torch.Tensor)
                    and diff[0].numel() == rows[1]):
                _refuse(f"{_describe(v)} on the bias", name)
            _check_strength(strength, name, v)
            if strength != 0.0:
                if not _finite(diff[0]):
                    _damaged("holds NaN / Inf in its bias diff: the LoRA file is damaged (every output of the layer "
                             "would be NaN). Remove that LoRA or load the file again", name, v)
                bias.append((diff[0].detach().reshape(-1).float() * float(strength), row0 + rows[0]))
            continue
        if type(v).__name__ != "LoRAAdapter" or len(getattr(v, "weights", ())) < 6:
            _refuse(_describe(v), name, v)
        up, down, alpha, mid, dora_scale, reshape = v.weights[:6]
        if mid is not None:
            _refuse("a LoCon patch (lora_mid: a convolution LoRA)", name, v)
        if dora_scale is not None:
            _refuse("a DoRA patch (dora_scale: it rescales the merged weight, not a low-rank add)", name, v)
        if reshape is not None:
            _refuse("a reshaping LoRA patch", name, v)
        up, down = up.flatten(1), down.flatten(1)
        if up.shape[1] != down.shape[0] or up.shape[0] != rows[1] or down.shape[1] != cols[1]:
            _refuse(f"a LoRA of shape up {tuple(up.shape)} / down {tuple(down.shape)} for a weight part "
                    f"[{rows[1]}, {cols[1]}]", name, v)
        _check_strength(strength, name, v)
        if strength == 0.0:
            continue
        if down.shape[0] == 0:
            _damaged(f"has rank 0 (lora_up {tuple(up.shape)} / lora_down {tuple(down.shape)}): it holds no "
                     "low-rank term, and its alpha / rank has no value. The LoRA file is damaged or empty: remove "
                     "that LoRA or use another file", name, v)
        a = 1.0 if alpha is None else float(alpha) / down.shape[0]
        if not math.isfinite(float(strength) * a):
            _damaged(f"has a non-finite scale: strength {float(strength)} x alpha {float(alpha)} / rank "
                     f"{down.shape[0]} (every output of the layer would be NaN). The LoRA file's alpha is damaged",
                     name, v)
        for what, t in (("lora_up", v.weights[0]), ("lora_down", v.weights[1])):
            if not _finite(t):
                _damaged(f"holds NaN / Inf in its {what}: the LoRA file is damaged (every output of the layer "
                         "would be NaN). Remove that LoRA or load the file again", name, v)
        terms.append(Term(down, up, float(strength) * a, row0 + rows[0], cols[0]))
    return terms, bias


def _check_strength(strength, name: str, v) -> None:
    """A NaN / Inf strength (reachable through the API, not the UI's widgets) makes every output NaN: refused."""
    if not math.isfinite(float(strength)):
        _damaged(f"has a non-finite strength ({float(strength)}): every output of the layer would be NaN. Give "
                 "its LoRA loader a finite strength_model", name, v)


def owners(object_patches: dict) -> dict:
    """{layer name: (the Int8Linear computing it, its first row there, its rows)} over ``object_patches`` ({name
    relative to the diffusion model: module}): plain INT8 layers, and the layers of fused modules
    (``int8_layers()``); a row view of a merged GEMM (w1 / w3 of w1+w3, q / k / v of a stacked qkv) maps to the
    merged layer, found by its weight storage."""
    out = {}
    for pname, mod in object_patches.items():
        if isinstance(mod, Int8Linear):
            out[pname] = (mod, 0, mod.out_features)
            continue
        listed = getattr(mod, "int8_layers", None)
        if listed is None:
            continue
        real = [m for m in mod.modules() if isinstance(m, Int8Linear)]
        for rel, view in listed().items():
            full = f"{pname}.{rel}" if rel else pname
            if any(view is m for m in real):
                out[full] = (view, 0, view.out_features)
                continue
            ptr = view.weight.untyped_storage().data_ptr()
            for m in real:
                if ptr and m.in_features == view.in_features and m.weight.untyped_storage().data_ptr() == ptr:
                    row = (view.weight.storage_offset() - m.weight.storage_offset()) // max(m.in_features, 1)
                    out[full] = (m, row, view.out_features)
                    break
    return out


_CARRYING: "weakref.WeakSet[Int8Linear]" = weakref.WeakSet()  # layers :func:`install` gave branches


def any_branches() -> bool:
    """Whether an INT8 layer that :func:`install` gave branches still carries them (any model): when not, a run
    without LoRA patches has nothing to take off and can skip :func:`install` (and finding the layers)."""
    for layer in list(_CARRYING):
        if layer.derived.lora is not None:
            return True
        _CARRYING.discard(layer)
    return False


def install(patches: dict, layers: dict) -> int:
    """Set the branches of the INT8 layers of one model from ``patches`` ({"<layer name>.weight" | ".bias": ComfyUI
    patch list}, names relative to the diffusion model; ``layers``: every INT8 layer of that model, from
    :func:`owners`); its other layers lose any branches they carried (a base model after its LoRA clone). Layers
    of other models are left alone (DualModelGuider runs two models in one run). Returns the number of layers with
    branches. Raises :class:`LoraError` before changing anything."""
    found: dict = {}
    for key, plist in patches.items():
        name, param = key.rsplit(".", 1)
        own = layers.get(name)
        if own is None or param not in ("weight", "bias"):
            _refuse(f"a patch on '{param}'" if own is not None else "a weight patch (no INT8 layer found for it)", name)
        layer, row0, n = own
        terms, bias = found.setdefault(id(layer), (layer, [], []))[1:]
        t, b = terms_of(name, param, plist, n, layer.in_features, row0)
        terms += t
        bias += b
    for layer, _, _ in layers.values():
        if id(layer) not in found and layer.derived.lora is not None:
            layer.set_lora(None)
    for layer, terms, bias in found.values():
        new = Branches(terms, bias, layer.out_features, layer.in_features) if terms or bias else None
        old = layer.derived.lora
        if new is None or old is None or not new.same(old):
            layer.set_lora(new)
        if new is not None:
            _CARRYING.add(layer)
    return sum(1 for f in found.values() if f[1] or f[2])
