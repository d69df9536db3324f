"""INT8 calibration: SmoothQuant factors, per-layer W8A8 errors and the layers to keep in float.

Flow (the "INT8 Calibrate" node drives it; everything here is plain torch):

1. :class:`quant.calib_capture.ActivationCapture` hooks the linears chosen by
   ``quant.select.select_linears`` and records running statistics while real sampling steps run.
2. :func:`build_calibration` turns those statistics and the float weights into a
   :class:`Calibration`: per layer a SmoothQuant divisor ``s`` (alpha fixed or searched on a grid),
   the relative W8A8 output error with and without smoothing (measured on the captured sample with
   ``Int8Linear``, fp32 compute, against the float product), and a ranking that marks the worst
   layers ``protected`` (kept in float): the ``protect_top_k`` largest errors and every layer whose
   error exceeds ``protect_threshold``. Layers that read one activation (SwiGLU's w1 / w3; found from the
   capture's statistics) share one vector, from the column absmax over their weights, so that a fused kernel
   can still quantize their input once.
3. Optionally static per-timestep-bucket activation scales ``max_t,j |X[t, j] / s_j| / 127``.

A :class:`Calibration` is saved as safetensors (tensors ``<layer>.smooth`` and
``<layer>.static_act_scale``, everything else as JSON in the header), never pickled.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os

import torch

from .calib_capture import ActivationCapture, shared_input_groups
from .calib_smooth import ALPHA_GRID, search_alpha_group, shared_col_absmax, smooth_factors, w8a8_error
from .fmt_write import atomic_save
from .formats import CheckpointError, json_metadata
from .quantize import QMAX

FORMAT = "int8_fused_calibration"
VERSION = 1


@dataclasses.dataclass
class LayerCalibration:
    """Calibration of one linear; ``name`` is relative to the diffusion model."""
    name: str
    in_features: int
    out_features: int
    smooth: torch.Tensor | None        # fp32 [K] divisor s: activations x / s, weights W * s
    alpha: float | None
    protected: bool                    # keep this layer in float
    err_plain: float                   # relative W8A8 output error, no smoothing
    err_smoothed: float                # same with ``smooth`` (== err_plain when smooth is None)
    static_act_scale: torch.Tensor | None = None  # fp32 [buckets]; see Calibration.meta["buckets"]

    @property
    def err(self) -> float:
        """Error of the layer as it will be quantized (smoothed when ``smooth`` is set)."""
        return self.err_smoothed if self.smooth is not None else self.err_plain


class Calibration:
    """Per-layer calibration of one diffusion model plus ``meta`` (arch, steps, alpha mode, ...)."""

    def __init__(self, layers: dict[str, LayerCalibration], meta: dict | None = None):
        self.layers = dict(layers)
        self.meta = dict(meta or {})

    def __repr__(self) -> str:
        n_p = sum(l.protected for l in self.layers.values())
        return f"Calibration({len(self.layers)} layers, {n_p} protected, arch={self.meta.get('arch')!r})"

    # ------------------------------------------------------------------ use
    def for_layer(self, name: str, out_features: int, in_features: int) -> LayerCalibration | None:
        """The layer's calibration, None when it was not calibrated; ValueError on a shape mismatch."""
        lc = self.layers.get(name)
        if lc is None:
            return None
        if (lc.out_features, lc.in_features) != (out_features, in_features):
            raise ValueError(
                f"calibration layer {name} was made for weight [{lc.out_features}, {lc.in_features}] "
                f"but the model's layer is [{out_features}, {in_features}]: this calibration belongs to "
                f"another model ({self.meta.get('arch', '?')}); calibrate this model or load its own file")
        return lc

    def check_model(self, named_linears) -> None:
        """Raise ValueError listing calibrated layers missing from ``named_linears`` or of other shape.

        ``named_linears``: iterable of (name, module with in/out_features) or a dict of those.
        """
        items = named_linears.items() if isinstance(named_linears, dict) else named_linears
        shapes = {n: (m.out_features, m.in_features) for n, m in items}
        missing = [n for n in self.layers if n not in shapes]
        wrong = [f"{n}: calibrated [{l.out_features}, {l.in_features}], model {list(shapes[n])}"
                 for n, l in self.layers.items() if n in shapes and shapes[n] != (l.out_features, l.in_features)]
        if missing or wrong:
            parts = []
            if missing:
                parts.append(f"{len(missing)} calibrated layers not in the model "
                             f"(e.g. {', '.join(missing[:5])})")
            if wrong:
                parts.append(f"{len(wrong)} shape mismatches ({'; '.join(wrong[:5])})")
            raise ValueError(f"calibration (arch {self.meta.get('arch', '?')}, "
                             f"{len(self.layers)} layers) does not match this model: " + "; ".join(parts)
                             + ". Use the calibration made for this model, or calibrate it.")

    def weight_mismatches(self, get_weight, modules: dict, max_layers: int = 8, tol: float = 1e-2) -> list[str]:
        """Names of up to ``max_layers`` calibrated layers (spread over the model) whose weights differ
        from the ones calibrated: the same shapes but other weights (e.g. Ideogram 4's other backbone,
        another checkpoint, or a LoRA). Compares the ``PROBES`` weight entries recorded at calibration,
        within ``tol`` of the layer's largest probe (bf16/fp8 storage stays well inside)."""
        probes = self.meta.get("weight_probe") or {}
        names = [n for n in self.layers if n in probes and n in modules]
        pick = names[::max(1, len(names) // max_layers)][:max_layers]
        bad = []
        for n in pick:
            want = torch.tensor(probes[n], dtype=torch.float64)
            got = weight_probe(get_weight(n, modules[n]))
            if (got - want).abs().max() > tol * max(float(want.abs().max()), 1e-30):
                bad.append(n)
        return bad

    def protected_names(self) -> list[str]:
        return [n for n, l in self.layers.items() if l.protected]

    def summary_text(self, max_rows: int | None = None) -> str:
        """Human-readable table: per layer alpha, error before/after smoothing, protection."""
        m = self.meta
        n_p = len(self.protected_names())
        head = [f"INT8 calibration: {len(self.layers)} layers, {n_p} kept in float; arch {m.get('arch', '?')}, "
                f"{m.get('steps', '?')} steps, alpha {m.get('alpha_mode', '?')}"
                + (f" {m['alpha']}" if m.get("alpha_mode") == "fixed" else "")
                + f", activation scales {m.get('activation_scales', 'dynamic')}"]
        errs = [l.err for l in self.layers.values()]
        if errs:
            gm = lambda v: math.exp(sum(math.log(max(e, 1e-12)) for e in v) / len(v))
            head.append(f"mean W8A8 error (geometric): plain {gm([l.err_plain for l in self.layers.values()]):.4g}"
                        f" -> calibrated {gm(errs):.4g}")
        if m.get("shared_smoothing"):
            g = m["shared_smoothing"]
            head.append(f"{len(g)} groups of layers reading one activation share a smoothing vector "
                        f"(e.g. {' + '.join(g[0])})")
        if m.get("unreached"):
            head.append(f"not reached during sampling (left uncalibrated): {', '.join(m['unreached'][:8])}"
                        + (" ..." if len(m["unreached"]) > 8 else ""))
        rows = [f"{'layer':<44} {'K->N':>13} {'alpha':>5} {'err plain':>10} {'err smooth':>10}  float"]
        order = sorted(self.layers.values(), key=lambda l: -l.err)
        for l in order[:max_rows] if max_rows else order:
            a = "-" if l.alpha is None else f"{l.alpha:.2f}"
            es = f"{l.err_smoothed:.4g}" if l.smooth is not None else "-"
            rows.append(f"{l.name:<44} {f'{l.in_features}->{l.out_features}':>13} {a:>5} "
                        f"{l.err_plain:>10.4g} {es:>10}  {'yes' if l.protected else ''}")
        return "\n".join(head + rows)

    # ------------------------------------------------------------------ files
    def save(self, path: str, overwrite: bool = False) -> str:
        """Write safetensors (tensors + JSON header) atomically (``fmt_write.atomic_save``: a temp file
        beside ``path``, renamed); an existing file raises ``OutputExistsError`` unless ``overwrite``."""
        if not self.layers:
            raise ValueError("refusing to save an empty calibration (no layer was calibrated)")
        tensors, layers = {}, {}
        for n, l in self.layers.items():
            if l.smooth is not None:
                tensors[f"{n}.smooth"] = l.smooth.detach().float().cpu().contiguous()
            if l.static_act_scale is not None:
                tensors[f"{n}.static_act_scale"] = l.static_act_scale.detach().float().cpu().contiguous()
            layers[n] = {"in_features": l.in_features, "out_features": l.out_features, "alpha": l.alpha,
                         "protected": l.protected, "err_plain": l.err_plain, "err_smoothed": l.err_smoothed}
        header = {"format": FORMAT, "version": str(VERSION), "meta": json.dumps(self.meta),
                  "layers": json.dumps(layers)}
        return atomic_save(tensors, os.fspath(path), header, overwrite=overwrite)

    @classmethod
    def load(cls, path: str) -> "Calibration":
        from safetensors import safe_open
        path = os.fspath(path)
        try:
            with safe_open(path, framework="pt") as f:
                header = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except FileNotFoundError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path} is not a readable safetensors file ({e}); the file is damaged: "
                                  "calibrate again") from None
        if header.get("format") != FORMAT:
            raise ValueError(f"{path} is not an INT8 calibration file (format {header.get('format')!r}, "
                             f"expected {FORMAT!r}); make one with the INT8 Calibrate node")
        try:
            version = int(header.get("version", 0))
        except ValueError:
            raise CheckpointError(f"{path}: invalid calibration format version {header.get('version')!r}; "
                                  "the file is damaged: calibrate again") from None
        if version > VERSION:
            raise ValueError(f"{path} has calibration format version {header['version']}; this pack reads "
                             f"up to {VERSION}: update the pack")
        meta = json_metadata(path, header, "meta", dict, required=True)
        layers = json_metadata(path, header, "layers", dict, required=True)
        if not layers:
            raise ValueError(f"{path} holds an empty calibration (no layers)")
        out = {}
        for n, d in layers.items():
            out[n] = _layer_from_header(path, n, d, tensors)
        return cls(out, meta)


_LAYER_FIELDS = {"in_features": int, "out_features": int, "alpha": (float, int, type(None)), "protected": bool,
                 "err_plain": (float, int), "err_smoothed": (float, int)}


def _layer_from_header(path: str, n: str, d, tensors: dict) -> LayerCalibration:
    """One layer of a calibration file, checked: a damaged entry raises CheckpointError naming it."""
    where = f"{path}: calibration layer {n!r}"
    if not isinstance(d, dict):
        raise CheckpointError(f"{where} is {type(d).__name__}, not an object; the file is damaged: calibrate again")
    for k, t in _LAYER_FIELDS.items():
        if k not in d:
            raise CheckpointError(f"{where} lacks {k!r}; the file is damaged: calibrate again")
        if not isinstance(d[k], t) or (t is int and isinstance(d[k], bool)):
            raise CheckpointError(f"{where}: {k!r} is {d[k]!r}; the file is damaged: calibrate again")
    s, sa = tensors.get(f"{n}.smooth"), tensors.get(f"{n}.static_act_scale")
    if s is not None:
        if s.shape != (d["in_features"],):
            raise CheckpointError(f"{where}: {n}.smooth has shape {tuple(s.shape)}, expected ({d['in_features']},)")
        if not (torch.isfinite(s).all() and (s > 0).all()):
            raise CheckpointError(f"{where}: {n}.smooth holds non-positive or non-finite values; the file is "
                                  "damaged: calibrate again")
    return LayerCalibration(n, d["in_features"], d["out_features"], s, d["alpha"], d["protected"],
                            d["err_plain"], d["err_smoothed"], sa)


# ---------------------------------------------------------------------- building
def fingerprint(named_shapes) -> str:
    """sha256 (16 hex) over the calibrated layers' names and [N, K] shapes, in model order."""
    h = hashlib.sha256()
    for n, (N, K) in named_shapes:
        h.update(f"{n}:{N}x{K};".encode())
    return h.hexdigest()[:16]


def build_calibration(capture: ActivationCapture, get_weight, alpha: float = 0.5, alpha_search: bool = False,
                      protect_top_k: int = 0, protect_threshold: float = 0.0, static_scales: bool = False,
                      alpha_grid=ALPHA_GRID, backend: str = "dequant_bf16", meta: dict | None = None,
                      progress=None) -> Calibration:
    """Calibration from a finished capture.

    ``get_weight(name, module) -> float weight [N, K]`` returns the weight the model really applies
    (patches such as LoRA merged). ``progress(i, n)`` is called after each layer when given; it may
    raise (ComfyUI's interrupt) and nothing is returned then.
    """
    if protect_top_k < 0 or protect_threshold < 0:
        raise ValueError("protect_top_k and protect_threshold must be >= 0")
    if not capture.stats:
        raise ValueError("no linear layers were selected for calibration: check the preset and the "
                         "include/exclude patterns")
    reached = {n: st for n, st in capture.stats.items() if st.tokens > 0}
    if not reached:
        raise ValueError(f"none of the {len(capture.stats)} selected layers ran during calibration "
                         f"sampling (e.g. {next(iter(capture.stats))}): nothing to calibrate; check that "
                         f"the MODEL given is the one that samples and that steps >= 1")
    groups = shared_input_groups(reached)
    group_of = {g[0]: g for g in groups}
    grouped = {n for g in groups for n in g}
    layers, wprobe = {}, {}
    for name in reached:
        if name in grouped and name not in group_of:
            continue  # calibrated with the first layer of its group
        names = group_of.get(name, [name])
        sts = [reached[n] for n in names]
        ws = []
        for n, st in zip(names, sts):
            st.check_finite()
            w = get_weight(n, capture.modules[n]).detach()
            if tuple(w.shape) != (st.out_features, st.in_features):
                raise ValueError(f"weight of {n} has shape {tuple(w.shape)}, the layer declares "
                                 f"[{st.out_features}, {st.in_features}]")
            wprobe[n] = weight_probe(w).tolist()
            ws.append(w)
        xs, act = [st.sample for st in sts], sts[0].act_absmax()  # one activation: one absmax for the group
        errs_plain = [w8a8_error(x, w, None, backend) for x, w in zip(xs, ws)]
        if alpha_search:
            a, s, errs_s, _ = search_alpha_group(xs, ws, act, alpha_grid, backend)
        else:
            a = float(alpha)
            s = smooth_factors(act, shared_col_absmax(ws), a)
            errs_s = [w8a8_error(x, w, s, backend) for x, w in zip(xs, ws)]
        if s is None:
            errs_s = errs_plain
        for n, st, ep, es in zip(names, sts, errs_plain, errs_s):
            lc = LayerCalibration(n, st.in_features, st.out_features, None if s is None else s.clone(), a, False,
                                  ep, es)
            if static_scales:
                lc.static_act_scale = static_act_scales(st.bucket_absmax(), s)
            layers[n] = lc
            if progress is not None:
                progress(len(layers), len(reached))
        del ws
    layers = {n: layers[n] for n in reached}  # model order
    _protect(layers, protect_top_k, protect_threshold)
    meta = dict(meta or {})
    meta.update({
        "alpha_mode": "search" if alpha_search else "fixed", "alpha": None if alpha_search else float(alpha),
        "alpha_grid": list(alpha_grid) if alpha_search else None, "protect_top_k": int(protect_top_k),
        "protect_threshold": float(protect_threshold), "error_backend": backend,
        "activation_scales": "static" if static_scales else "dynamic", "row_cap": capture.row_cap,
        "buckets": capture.n_buckets, "fingerprint": fingerprint(
            (n, (st.out_features, st.in_features)) for n, st in capture.stats.items()),
        "unreached": [n for n in capture.stats if n not in reached],
        "shared_smoothing": groups,  # layers reading one activation: one smoothing vector each group
        "tokens": {n: st.token_summary() for n, st in reached.items()},
        "weight_probe": wprobe,  # a few weight entries per layer: tells same-shaped models apart
    })
    return Calibration(layers, meta)


PROBES = 16


def weight_probe(w: torch.Tensor) -> torch.Tensor:
    """float64 [PROBES]: the weight entries at PROBES evenly spaced flat positions (fixed per shape)."""
    flat = w.detach().reshape(-1)
    idx = torch.linspace(0, flat.numel() - 1, PROBES, dtype=torch.float64).round().long().to(flat.device)
    return flat[idx].double().cpu()


def static_act_scales(bucket_absmax: torch.Tensor, smooth: torch.Tensor | None) -> torch.Tensor:
    """fp32 [B]: per bucket ``max_{t,j} |X[t, j] / s_j| / 127``; unreached buckets take the max."""
    a = bucket_absmax.float()
    if smooth is not None:
        a = a / smooth.float()[None, :]
    per = a.amax(dim=1) / QMAX
    return torch.where(per > 0, per, per.max().expand_as(per)).contiguous()


def _protect(layers: dict[str, LayerCalibration], top_k: int, threshold: float) -> None:
    ranked = sorted(layers.values(), key=lambda l: -l.err)
    for i, l in enumerate(ranked):
        l.protected = i < top_k or (threshold > 0 and l.err > threshold)
