"""``Int8Linear``: the W8A8 replacement for ``nn.Linear``.

Holds an int8 weight [N, K] quantized per output channel with fp32 scales [N], an optional fp32
SmoothQuant vector ``smooth`` [K] and an optional fp32 bias [N]. The forward flattens leading dimensions,
quantizes the activation per token (dividing by ``smooth`` first) and runs the selected backend:

    y = (Q(x / s) @ Q(W * s).T) * a_scale[m] * w_scale[n] + bias        [..., K] -> [..., N]

How it lives in ComfyUI's memory manager (comfy/model_patcher.py of 0.33.0 and 0.3.75):
* ``weight`` and ``bias`` are Parameters (no grad): ``weight`` is the int8 tensor itself (``qweight`` is an
  alias), so ComfyUI counts, moves, pins and offloads it like any weight. The module carries
  ``comfy_cast_weights`` like ``comfy.ops`` layers: when ComfyUI sets it (DynamicVRAM always does, the
  legacy patcher on a partial load), the forward fetches weight and bias through ComfyUI's own
  ``cast_bias_weight`` (installed by the nodes package with :func:`set_comfy_cast`): under
  ``ModelPatcherDynamic`` they are faulted once into its VRAM "vbar" and stay resident across steps until
  ComfyUI evicts them; under the legacy patcher they stream from pinned memory on ComfyUI's offload
  stream. No per-call pageable copy.
* The small vectors (``weight_scale``, ``smooth``; 4 bytes per channel, ~0.1 % of the weight) are plain tensor
  attributes, not Parameters: DynamicVRAM's load copies every Parameter of a managed layer other than weight and
  bias to the GPU again at every sample (``ModelPatcherDynamic.load``: ``force_load_param``, a device allocation
  and a copy each), which made them the largest item of the pack's per-sample tax (issue 49). They are kept in
  pinned memory where they live on the CPU, and the layer keeps one device copy of each (:meth:`vector_on`), made
  once, not per call or per sample. They still are state-dict entries (``state_dict``, ``load_state_dict``,
  ComfyUI's ``module_size``) and move with ``.to()`` like the Parameters.
* ``weight`` is int8: ComfyUI never casts it (the fetch asks for int8). A LoRA added after quantization runs
  as a low-rank side branch (``quant.lora``, :meth:`set_lora`; the Apply node takes its patches away from
  ComfyUI at each run start); weight patches that still reach the layer (:meth:`set_weight`, weight-function
  lists) are refused with a message saying to put LoRA loaders before the Apply node.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernel as _kernel
from ..kernel import launch as _launch
from . import backends, dispatch
from .quantize import dequantize, quantize_weight_per_channel

#: Input dtypes every backend takes (the compute dtypes of ComfyUI's diffusion models).
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# (layer, device) -> (weight, bias, release): ComfyUI's cast for a layer ComfyUI manages. Set by
# nodes/comfy_cast.py when ComfyUI is there; None in plain torch (tests, benches without ComfyUI).
_COMFY_CAST: Callable | None = None
# Int8Linear._planned's kernel calls: name -> (the checked entry point, its planned form) in ``kernel``
_CALLS = {"linear": ("int8_linear", "int8_linear_planned"), "gemm": ("int8_gemm", "int8_gemm_planned"),
          "gemm_lora": ("int8_gemm_lora", "int8_gemm_lora_planned")}


def set_comfy_cast(fn: Callable | None) -> None:
    """Install the function that fetches a ComfyUI-managed layer's weight and bias (see module doc)."""
    global _COMFY_CAST
    _COMFY_CAST = fn


# (module, device) -> release() or None: ComfyUI's fetch of every weight it manages under a fused block, in one
# call before the block runs (quant.blocks.FetchedBlock; nodes/comfy_cast.py). None in plain torch.
_BLOCK_FETCH: Callable | None = None


def set_block_fetch(fn: Callable | None) -> None:
    """Install the function that fetches a whole fused block's ComfyUI-managed weights at once."""
    global _BLOCK_FETCH
    _BLOCK_FETCH = fn


def block_fetch() -> Callable | None:
    """The installed block fetch (None: each layer fetches its own weights)."""
    return _BLOCK_FETCH


_TENSORS = ("weight", "weight_scale", "bias", "smooth")
# The small vectors: plain attributes, not Parameters (module doc), in pinned memory where they live on the CPU and
# CUDA is present (``_pin``), so that their device copy (``vector_on``) is an asynchronous copy.
_SMALL = ("weight_scale", "smooth")
_PIN_OK: list = []


def _pin(t: torch.Tensor) -> torch.Tensor:
    """``t`` in pinned memory when it is a CPU tensor and CUDA is present, else ``t``."""
    if t.device.type != "cpu" or t.is_pinned():
        return t
    if not _PIN_OK:
        _PIN_OK.append(bool(torch.cuda.is_available()))
    if not _PIN_OK[0]:
        return t
    try:
        return t.pin_memory()
    except RuntimeError:  # no pinned memory to be had (a container's limit, WSL): pageable, as before
        _PIN_OK[0] = False
        return t


LORA_AFTER_APPLY = ("weight patches (a LoRA loaded after this layer was quantized) reached the INT8 layer "
                    "{name} outside a sampling run or as a LoRA hook, where ComfyUI would patch the int8 weight "
                    "itself (sampling runs LoRAs as side branches). Put LoRA loaders BEFORE 'Apply Fused INT8 GEMM' "
                    "(it merges them into the weights it quantizes), or apply the LoRA to the float model.")


class Derived:
    """Everything an Int8Linear keeps besides its tensors, in one place (``Int8Linear.derived``), written only by the
    layer's methods; :meth:`Int8Linear.clear_derived` drops what holds tensors (a move, a cast, a load).

    ``tensors``     {key: (source, (device, data_ptr), value)} (:func:`derived`): 1/smooth, device copies of the small
                    vectors, the dispatch float path's weight and bias; each made again when its source changes
    ``fp8``         (fp8 e4m3 weight, fp32 scales) of the fp8_rowwise backend, made again on another device
    ``hot``         {(shape, dtype, device, ``dispatch.hot_token()``): (weight, its data_ptr, float weight or None,
                    float bias)}: the path ``forward`` took per call shape; dropped when a tensor is set
    ``plans``       {call key: ``kernel.plan.Plan``, or False where the call cannot be planned}: launches, no tensor
    ``paths``       {(rows, dtype, device): "int8" | "float"}: the dispatch decisions this layer took
    ``calls``       fused_triton calls per path (``Int8Linear.dispatch_calls``)
    ``float_rows``  {(rows, forced)}: the row counts that ran on the float path (``dispatch.counts``)
    ``lora``        ``quant.lora.Branches`` or None: the LoRA side branches of the running model (set at each run
                    start, ``Int8Linear.set_lora``); kept on a move (its device copies live in the branches)
    """
    __slots__ = ("tensors", "fp8", "hot", "plans", "paths", "calls", "float_rows", "lora")

    def __init__(self):
        self.tensors, self.fp8, self.hot, self.plans, self.paths = {}, None, {}, {}, {}
        self.calls, self.float_rows, self.lora = collections.Counter(), set(), None

    def clear(self) -> None:
        """Drop what holds tensors (the decisions, plans and counts stay)."""
        self.tensors.clear()
        self.fp8 = None
        self.hot.clear()


class Int8Linear(nn.Module):
    """W8A8 linear layer; see the module docstring. ``backend`` names an entry of ``backends.BACKENDS``."""

    comfy_cast_weights = False  # ComfyUI sets True when it manages the weights (DynamicVRAM, lowvram)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, smooth: bool = False,
                 backend: str = "dequant_bf16", name: str = "", device=None):
        super().__init__()
        self.derived = Derived()
        self.in_features, self.out_features = in_features, out_features
        self.name = name
        self.backend = backend
        self.weight = torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        self.weight_scale = torch.zeros(out_features, dtype=torch.float32, device=device)
        self.bias = torch.zeros(out_features, dtype=torch.float32, device=device) if bias else None
        self.smooth = torch.ones(in_features, dtype=torch.float32, device=device) if smooth else None
        self.weight_function: list = []  # ComfyUI's per-layer weight/bias function lists (lowvram)
        self.bias_function: list = []

    def __setattr__(self, name, value):
        # weight and bias are always no-grad Parameters (ComfyUI assigns Parameters too); the small vectors are
        # plain tensors (module doc), pinned where they live on the CPU.
        if name in _TENSORS:
            d = self.__dict__.get("derived")
            if d is not None:
                d.hot.clear()  # the hot path holds the old tensors: let them go
            if name in _SMALL:
                self._parameters.pop(name, None)  # a layer pickled when they were Parameters
                if isinstance(value, torch.Tensor):
                    value = _pin(value.detach())
            elif isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                value = nn.Parameter(value, requires_grad=False)
        super().__setattr__(name, value)

    def __setstate__(self, state):
        super().__setstate__(state)
        if "derived" not in self.__dict__:  # pickled before ``derived`` existed
            self.derived = Derived()
        for name in _SMALL:  # pickled when the small vectors were Parameters
            if name in self._parameters:
                setattr(self, name, self._parameters[name])

    @property
    def qweight(self) -> torch.Tensor:
        """The int8 weight [N, K] (the Parameter ``weight``)."""
        return self.weight

    @qweight.setter
    def qweight(self, value: torch.Tensor) -> None:
        self.weight = value

    @property
    def inv_smooth(self) -> torch.Tensor | None:
        """1 / smooth (fp32 [K]) on the smoothing vector's device, or None without smoothing."""
        s = self.smooth
        if s is None:
            return None
        return derived(self.derived.tensors, "inv_smooth", s, lambda t: 1.0 / t.detach().float())

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_quantized(cls, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                       smooth: torch.Tensor | None = None, backend: str = "dequant_bf16",
                       name: str = "") -> "Int8Linear":
        """A layer holding already-quantized tensors as they are (no copy where dtypes match): int8
        [N, K], a per-channel (or scalar) fp32 scale, optional bias and SmoothQuant divisor [K]."""
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"{name or 'layer'}: INT8 weight must be int8 [N, K], got {qweight.dtype} "
                             f"{tuple(qweight.shape)}")
        N, K = qweight.shape
        ws = weight_scale.detach().float().reshape(-1)
        if ws.numel() == 1:
            ws = ws.expand(N).contiguous()
        if ws.numel() != N:
            raise ValueError(f"{name or 'layer'}: weight scale has {ws.numel()} entries, the weight {N} rows")
        m = cls(K, N, bias=bias is not None, smooth=smooth is not None, backend=backend, name=name,
                device="meta")
        dev = qweight.device
        m.weight, m.weight_scale = qweight.detach(), ws.to(dev)
        m.bias = None if bias is None else bias.detach().float().reshape(-1).to(dev)
        m.smooth = None if smooth is None else _check_smooth(smooth, K, name).to(dev)
        return m

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   smooth: torch.Tensor | None = None, backend: str = "dequant_bf16",
                   name: str = "") -> "Int8Linear":
        """Quantize a float weight [N, K] (and keep ``bias``) on the weight's device.

        With ``smooth`` (s, [K], positive), the stored weight is ``Q(W * s)`` and activations are
        divided by ``s`` before quantization, so the product is unchanged in exact arithmetic.
        """
        N, K = weight.shape
        w = weight.detach().float()
        if smooth is not None:
            smooth = _check_smooth(smooth, K, name)
            w = w * smooth.to(w.device)[None, :]
        qw, ws = quantize_weight_per_channel(w)
        return cls.from_quantized(qw, ws, bias, smooth, backend=backend, name=name)

    @classmethod
    def from_linear(cls, linear: nn.Module, **kw) -> "Int8Linear":
        return cls.from_float(linear.weight, getattr(linear, "bias", None), **kw)

    def rows(self, start: int, stop: int, name: str = "") -> "Int8Linear":
        """Output rows [start, stop) as an Int8Linear of views (no copy), e.g. w1 and w3 of a merged w1+w3."""
        return Int8Linear.from_quantized(
            self.weight[start:stop], self.weight_scale[start:stop],
            None if self.bias is None else self.bias[start:stop], self.smooth, backend=self.backend,
            name=name)

    def _apply(self, fn, *args, **kw):
        self.clear_derived()  # tensors change device or dtype in place: drop what was derived from them
        out = super()._apply(fn, *args, **kw)
        for name in _SMALL:  # the small vectors go where the Parameters go (``.to()``, ``.cuda()``, a cast)
            t = self.__dict__.get(name)
            if t is not None:
                setattr(self, name, fn(t))
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in _SMALL:
            t = self.__dict__.get(name)
            if t is not None:
                destination[prefix + name] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        self.clear_derived()
        if prefix + "qweight" in state_dict and prefix + "weight" not in state_dict:  # pre-0.2 name
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "qweight")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        # the small vectors as nn.Module loads a Parameter: copied in place, or taken as they are with assign=True
        for name in _SMALL:
            key, cur = prefix + name, self.__dict__.get(name)
            if cur is None:  # a layer without smoothing: a stored smooth stays an unexpected key
                continue
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            if key in unexpected_keys:
                unexpected_keys.remove(key)
            v = state_dict[key]
            if not isinstance(v, torch.Tensor) or v.shape != cur.shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(getattr(v, 'shape', ()))} from checkpoint, the shape in current model is "
                                  f"{tuple(cur.shape)}.")
            elif local_metadata.get("assign_to_params_buffers", False):
                setattr(self, name, v.detach().to(cur.dtype))
            else:
                with torch.no_grad():
                    cur.copy_(v)

    def set_weight(self, value: torch.Tensor, inplace_update: bool = False, seed=None, return_weight: bool = False):
        """ComfyUI writes a weight through ``set_<param>`` (``ModelPatcher.patch_weight_to_device``). An
        int8 tensor (a plain move) is taken as it is; a float one is a LoRA-merged weight: refused, loudly."""
        if value.dtype != torch.int8 or tuple(value.shape) != tuple(self.weight.shape):
            raise RuntimeError(LORA_AFTER_APPLY.format(name=self.name or "?"))
        if return_weight:
            return value
        if inplace_update:
            self.weight.data.copy_(value)
        else:
            self.weight = value

    # ------------------------------------------------------------------ use
    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K] weight this layer effectively applies to the unsmoothed input."""
        w = dequantize(self.weight, self.weight_scale)
        return w if self.smooth is None else w * self.inv_smooth[None, :]

    def vector_on(self, key: str, device: torch.device) -> torch.Tensor | None:
        """A small fp32 vector (weight_scale, inv_smooth) on ``device``: the tensor itself when it is there (the
        layer was moved with ``.to()``), else one cached copy, remade only when the source tensor is swapped."""
        src = self.inv_smooth if key == "inv_smooth" else getattr(self, key)
        if src is None or src.device == device:
            return src
        return derived(self.derived.tensors, (key, device), src,
                       lambda t: t.detach().to(device, non_blocking=t.is_pinned()))

    # ------------------------------------------------------------------ derived state (``Derived``)
    def clear_derived(self) -> None:
        """Drop every tensor derived from this layer's (``Derived.clear``): ``.to()``, a cast, a state-dict load."""
        self.derived.clear()

    def derived_tensor(self, key, src: torch.Tensor, make: Callable):
        """``make(src)`` kept under ``key`` while ``src`` is the same tensor (:func:`derived`)."""
        return derived(self.derived.tensors, key, src, make)

    def fp8_weight(self, device: torch.device, make: Callable[[], tuple]) -> tuple:
        """The fp8_rowwise backend's (weight, scales) on ``device``: ``make()`` once per device."""
        d = self.derived
        if d.fp8 is None or d.fp8[0].device != device:
            d.fp8 = make()
        return d.fp8

    def dispatch_path(self, key: tuple, decide: Callable[[], str | None]) -> str | None:
        """The dispatch path this layer took for ``key`` (rows, dtype, device), else ``decide()``, kept unless None."""
        paths = self.derived.paths
        path = paths.get(key)
        if path is None:
            path = decide()
            if path is not None:
                paths[key] = path
        return path

    def count_call(self, path: str, rows: int, forced: bool = False) -> None:
        """Count one fused_triton call on ``path`` ("int8" / "float") with ``rows`` rows (``forced``: by
        INT8_FUSED_DISPATCH rather than by timing)."""
        d = self.derived
        d.calls[path] += 1
        if path == "float":
            d.float_rows.add((rows, forced))  # the M values (a handful per layer); bucketed by dispatch.counts

    @property
    def dispatch_calls(self) -> collections.Counter:
        """fused_triton calls per path ("int8" / "float") since the layer was built (quant/dispatch.py)."""
        return self.derived.calls

    def set_lora(self, branches) -> None:
        """The LoRA side branches (``quant.lora.Branches``) this layer adds to its output, or None."""
        self.derived.lora = branches

    def __call__(self, x, *args, **kwargs):
        # The LoRA branch is added here, to the module call, so that it sees the caller's input even where a
        # subclass's forward transforms it first (ConvRot rotates x).
        y = super().__call__(x, *args, **kwargs)
        lora = self.derived.lora
        return y if lora is None else lora.add(x, y)

    def _refuse_patches(self) -> None:
        """Raises when weight patches (a LoRA loaded after quantization) target the layer."""
        d = self.__dict__
        if d.get("weight_function") or d.get("bias_function") or d.get("weight_lowvram_function") \
                or d.get("bias_lowvram_function"):
            raise RuntimeError(LORA_AFTER_APPLY.format(name=self.name or "?"))

    def _resident(self, device: torch.device) -> bool:
        """Whether every tensor already is on ``device`` (then the layer itself is its operands). Raises when
        weight patches target the layer. Reads ``__dict__`` / ``_parameters`` directly: nn.Module's
        ``__getattr__`` costs about half a microsecond a lookup, and this runs on every call."""
        self._refuse_patches()
        p, d = self._parameters, self.__dict__
        for t in (p.get("weight"), p.get("bias"), d.get("weight_scale"), d.get("smooth")):
            if t is not None and t.device != device:
                return False
        return True

    @contextlib.contextmanager
    def operands(self, device: torch.device):
        """The tensors a backend needs, on ``device``, for one call: an object with ``qweight``,
        ``weight_scale``, ``bias``, ``inv_smooth``, ``name``, ``backend``, ``in_features``,
        ``out_features``. Through ComfyUI's cast when ComfyUI manages the layer (see module doc)."""
        if self._resident(device):
            yield self
            return
        t, release = self._fetch(device)
        try:
            yield t
        finally:
            if release is not None:
                release()

    def _fetch(self, device: torch.device):
        """(the layer's tensors on ``device`` as ``_Operands``, release or None) for a layer that is not resident:
        :meth:`operands` without the context manager (the hot calls below release in a ``finally``)."""
        w = self.weight
        release = None
        if self.comfy_cast_weights and _COMFY_CAST is not None:
            w, b, release = _COMFY_CAST(self, device)
        else:  # plain torch use (no ComfyUI managing the layer): copy for this call
            w = w.to(device, non_blocking=w.is_pinned())
            b = None if self.bias is None else self.bias.to(device, non_blocking=self.bias.is_pinned())
        try:
            return _Operands(self, w, b, self.vector_on("weight_scale", device),
                             self.vector_on("inv_smooth", device)), release
        except BaseException:
            if release is not None:
                release()
            raise

    # ------------------------------------------------------------------ the W8A8 kernels, prepared
    def int8_call(self, x: torch.Tensor) -> torch.Tensor:
        """The W8A8 kernels (``kernel.int8_linear``) on x [..., K] -> [..., N] in x.dtype with this layer's
        tensors (fetched through ComfyUI when it manages them), whatever the dispatch says: the fused blocks'
        linears. Repeated call signatures re-issue the first call's launches (``kernel.plan``)."""
        if self._resident(x.device):
            return self.run_int8(x)
        t, release = self._fetch(x.device)
        try:
            return t.run_int8(x)
        finally:
            if release is not None:
                release()

    def run_int8(self, x: torch.Tensor) -> torch.Tensor:
        """The W8A8 kernels on x with the layer's own tensors, through its prepared launches, for a caller that has
        found them on x's device (:meth:`operands` yielded the layer itself): :meth:`int8_call`, and the INT8 side of
        per-shape dispatch (``backends.Backend.dispatch_int8``; ``_Operands.run_int8`` is a fetched layer's). Reads
        ``_parameters`` / ``__dict__`` directly: nn.Module's ``__getattr__`` costs about half a microsecond a lookup."""
        p, d = self._parameters, self.__dict__  # a None bias may live in __dict__: .get
        return self._int8_run(x, p["weight"], d["weight_scale"], p.get("bias"),
                              None if d["smooth"] is None else self.inv_smooth)

    def gemm_call(self, a_q: torch.Tensor, a_s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``kernel.int8_gemm`` of an already-quantized input (int8 [M, K], fp32 [M]) with this layer's weight ->
        [M, N] in ``dtype``, prepared like :meth:`int8_call`. The GEMM alone: LoRA branches are the caller's
        (``quant.blocks.gemm`` adds them from the int8 input; a module call adds them from its float input)."""
        if self._resident(a_q.device):
            p = self._parameters
            return self._planned(("gemm", a_q.shape, dtype), (a_q, a_s, p["weight"], self.__dict__["weight_scale"],
                                                              p.get("bias")), dtype)
        t, release = self._fetch(a_q.device)
        try:
            return self._planned(("gemm", a_q.shape, dtype), (a_q, a_s, t.qweight, t.weight_scale, t.bias), dtype)
        finally:
            if release is not None:
                release()

    def gemm_lora_call(self, a_q: torch.Tensor, a_s: torch.Tensor, dtype: torch.dtype, down: torch.Tensor,
                       up: torch.Tensor) -> torch.Tensor:
        """:meth:`gemm_call` plus a LoRA read from the same int8 input, its up-projection added in the GEMM's
        epilogue (``kernel.int8_gemm_lora``; ``down`` [R, K] / ``up`` [N, R] from ``quant.lora.Branches.epilogue``),
        prepared like :meth:`gemm_call`."""
        if self._resident(a_q.device):
            p = self._parameters
            return self._planned(("gemm_lora", a_q.shape, dtype), (a_q, a_s, p["weight"],
                                                                   self.__dict__["weight_scale"], p.get("bias"), down,
                                                                   up), dtype)
        t, release = self._fetch(a_q.device)
        try:
            return self._planned(("gemm_lora", a_q.shape, dtype), (a_q, a_s, t.qweight, t.weight_scale, t.bias, down,
                                                                   up), dtype)
        finally:
            if release is not None:
                release()

    def _int8_run(self, x, w, ws, b, inv):
        """``kernel.int8_linear`` with these operands (the layer's own or fetched ones), through a plan."""
        return self._planned(("linear", x.shape, x.dtype), (x, w, ws, b, inv), x.dtype)

    def _planned(self, key: tuple, ops: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The kernel call ``key[0]`` ("linear" / "gemm" / "gemm_lora", ``_CALLS``) on ``ops``: the plan kept for
        ``key`` when the operands' signatures match it, else the checked call, recording a new plan (``kernel.plan``). Plans hold
        no tensor, only launches, so nothing goes stale when ComfyUI moves or swaps the weights: a changed operand
        signature just fails the plan's check."""
        k = _kernel
        key = (*key, k.gemm_switches())  # an A/B of a GEMM switch on a loaded model is never served the other's plan
        plans = self.derived.plans
        plan = plans.get(key)
        if plan:
            y = plan(*ops)
            if y is not None:
                return y
        checked, planned = _CALLS[key[0]]
        if plan is False or _launch.dry_run():  # cannot be planned (no launch, a converted operand), or a dry run
            return getattr(k, checked)(*ops, out_dtype=dtype)
        y, plan = getattr(k, planned)(*ops, out_dtype=dtype)
        if len(plans) >= 32:  # a handful of call shapes a layer; bounded for varying ones
            plans.clear()
        plans[key] = plan if plan is not None else False
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Hot path: a resident fused_triton layer runs a call shape it ran before on the path dispatch chose for
        # it then, while the int8 weight is the same tensor and the dispatch mode and decisions are those of
        # that call: the float path as a bare F.linear on the kept float weight, the int8 path through the
        # layer's prepared launches (the host cost of a small linear is what decides its speed).
        hot = self.derived.hot
        if hot and not torch.compiler.is_compiling():
            e = hot.get((x.shape, x.dtype, x.device, dispatch.hot_token()))
            if e is not None:
                src = self._parameters["weight"]
                if e[0] is src and e[1] == src.data_ptr():
                    self._refuse_patches()
                    if e[2] is None:  # int8
                        self.derived.calls["int8"] += 1
                        p, d = self._parameters, self.__dict__
                        return self._int8_run(x, src, d["weight_scale"], p.get("bias"),
                                              None if d["smooth"] is None else self.inv_smooth)
                    self.derived.calls["float"] += 1
                    return F.linear(x, e[2], e[3])
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        backend = backends.get(self.backend)
        if backend.per_shape_dispatch and not torch.compiler.is_compiling():
            # per shape: the INT8 kernel where it is faster, else the float path (quant/dispatch.py)
            if self._resident(x.device):  # the common case, without the context manager's cost
                y, path = dispatch.run(self, x2, self)
                # later calls of this shape: the hot path of forward
                src = self._parameters["weight"]
                hot = self.derived.hot
                if len(hot) >= 16:  # a handful of call shapes a layer; bounded for varying ones
                    hot.clear()
                hot[(x.shape, x.dtype, x.device, dispatch.hot_token())] = (
                    src, src.data_ptr(), *(dispatch.float_operands(self, x.dtype) if path == dispatch.FLOAT
                                           else (None, None)))
            else:
                with self.operands(x.device) as layer:
                    y, _ = dispatch.run(layer, x2, self)
        else:
            with self.operands(x.device) as layer:
                y = backend.linear(x2, layer)
        return y if x.dim() == 2 else y.reshape(*lead, self.out_features)

    def nbytes(self) -> int:
        """Bytes of the persistent tensors (what ComfyUI counts for this module)."""
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, smooth={self.smooth is not None}, backend={self.backend}")


class _Operands:
    """A layer's tensors on the call's device (what ``Int8Linear.operands`` yields when it had to fetch)."""
    __slots__ = ("owner", "name", "backend", "in_features", "out_features", "qweight", "weight_scale", "bias",
                 "inv_smooth")

    def __init__(self, layer: Int8Linear, w, b, scale, inv_smooth):
        self.owner, self.name, self.backend = layer, layer.name, layer.backend
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.qweight, self.weight_scale, self.bias, self.inv_smooth = w, scale, b, inv_smooth

    def run_int8(self, x: torch.Tensor) -> torch.Tensor:
        """``Int8Linear.run_int8`` with these fetched tensors (the owner's prepared launches)."""
        return self.owner._int8_run(x, self.qweight, self.weight_scale, self.bias, self.inv_smooth)


def derived(cache: dict, key, src: torch.Tensor, make: Callable):
    """``make(src)``, kept in ``cache[key]`` while ``src`` is the same tensor (same object, device and storage):
    ComfyUI swaps or moves a tensor to change it, and then the derived one is made again."""
    hit = cache.get(key)
    if hit is None or hit[0] is not src or hit[1] != (src.device, src.data_ptr()):
        hit = (src, (src.device, src.data_ptr()), make(src))
        cache[key] = hit
    return hit[2]


def check_input(x: torch.Tensor, layer) -> None:
    """The one input check every backend shares: float activations of the layer's width."""
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"INT8 layer {layer.name or '?'} takes {', '.join(str(d) for d in INPUT_DTYPES)} "
                        f"activations, got {x.dtype} (backend {layer.backend})")
    if x.shape[-1] != layer.in_features:
        raise ValueError(f"INT8 layer {layer.name or '?'} expects inputs [..., {layer.in_features}], "
                         f"got {tuple(x.shape)}")


def _check_smooth(smooth: torch.Tensor, K: int, name: str) -> torch.Tensor:
    s = smooth.detach().float().flatten()
    if s.numel() != K:
        raise ValueError(f"smoothing vector for {name or 'layer'} has {s.numel()} entries, the layer has K={K}")
    if not (torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError(f"smoothing vector for {name or 'layer'} must be finite and positive")
    return s
