"""Ideogram 4 key layout (ComfyUI ``comfy.ldm.ideogram4`` names), checks of a branch against it, and a
deterministic random-weight generator at any width (tiny for format tests, real for the 1-layer test).

Widths of the real model (ComfyUI fixes them): hidden 4608 (18 heads x 256), FFN 12288, adaLN 512,
text features 53248, in/out channels 128; ``layers.N`` blocks. Source: the defaults of
``Ideogram4Transformer2DModel.__init__`` in ComfyUI's ``comfy/ldm/ideogram4/model.py`` (ComfyUI 0.33.0;
its detection in ``comfy/model_detection.py`` reads only the depth and in_channels from the file).
"""
from __future__ import annotations

import re

import torch

from ...quant.formats import Branch, CheckpointError
from ...quant.quantize import quantize_weight_per_channel

REAL = dict(hidden=4608, heads=18, ffn=12288, adaln=512, text=53248, channels=128)

# Linear layers: name template -> (in, out, bias) as functions of the widths.
_TOP_LINEARS = {
    "input_proj": ("channels", "hidden", True),
    "llm_cond_proj": ("text", "hidden", True),
    "t_embedding.mlp_in": ("hidden", "hidden", True),
    "t_embedding.mlp_out": ("hidden", "hidden", True),
    "adaln_proj": ("hidden", "adaln", True),
    "final_layer.adaln_modulation": ("adaln", "hidden", True),
    "final_layer.linear": ("hidden", "channels", True),
}
_BLOCK_LINEARS = {
    "adaln_modulation": ("adaln", "hidden*4", True),
    "attention.qkv": ("hidden", "hidden*3", False),
    "attention.o": ("hidden", "hidden", False),
    "feed_forward.w1": ("hidden", "ffn", False),
    "feed_forward.w3": ("hidden", "ffn", False),
    "feed_forward.w2": ("ffn", "hidden", False),
}
# Non-linear tensors (norms, embeddings): name -> shape spec.
_TOP_FLOATS = {"embed_image_indicator.weight": ("2", "hidden"), "llm_cond_norm.weight": ("text",)}
_BLOCK_FLOATS = {"attention.norm_q.weight": ("head",), "attention.norm_k.weight": ("head",),
                 "attention_norm1.weight": ("hidden",), "attention_norm2.weight": ("hidden",),
                 "ffn_norm1.weight": ("hidden",), "ffn_norm2.weight": ("hidden",)}
_LAYER = re.compile(r"^layers\.(\d+)\.")


def _dim(spec: str, w: dict) -> int:
    if spec.isdigit():
        return int(spec)
    name, _, mul = spec.partition("*")
    return w[name] * (int(mul) if mul else 1)


def widths(hidden=4608, heads=18, ffn=12288, adaln=512, text=53248, channels=128) -> dict:
    return dict(hidden=hidden, heads=heads, head=hidden // heads, ffn=ffn, adaln=adaln, text=text,
                channels=channels)


def linear_specs(n_layers: int, w: dict) -> dict[str, tuple[int, int, bool]]:
    """{name: (in_features, out_features, has_bias)} of every linear of an ``n_layers`` backbone."""
    out = {n: (_dim(i, w), _dim(o, w), b) for n, (i, o, b) in _TOP_LINEARS.items()}
    for L in range(n_layers):
        for n, (i, o, b) in _BLOCK_LINEARS.items():
            out[f"layers.{L}.{n}"] = (_dim(i, w), _dim(o, w), b)
    return out


def float_specs(n_layers: int, w: dict) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the non-linear tensors (norms, the image-indicator embedding)."""
    out = {n: tuple(_dim(s, w) for s in sh) for n, sh in _TOP_FLOATS.items()}
    for L in range(n_layers):
        for n, sh in _BLOCK_FLOATS.items():
            out[f"layers.{L}.{n}"] = tuple(_dim(s, w) for s in sh)
    return out


def count_layers(names) -> int:
    idx = [int(m.group(1)) for n in names if (m := _LAYER.match(n))]
    return max(idx) + 1 if idx else 0


def infer_widths(branch: Branch, header: dict) -> dict:
    """Widths of a branch from its tensors (input_proj / qkv / w1 / adaln_proj / llm_cond_proj shapes)."""
    def shape(n):
        if n in branch.quant:
            e = branch.quant[n]
            return e.in_features, e.out_features
        if f"{n}.weight" in branch.floats:
            o, i = header[branch.floats[f"{n}.weight"]]["shape"]
            return i, o
        return None
    w = {}
    for name, ki, ko in (("input_proj", "channels", "hidden"), ("llm_cond_proj", "text", "hidden"),
                         ("adaln_proj", "hidden", "adaln"), ("layers.0.feed_forward.w1", "hidden", "ffn")):
        s = shape(name)
        if s is not None:
            w.setdefault(ki, s[0]), w.setdefault(ko, s[1])
    if "layers.0.attention.norm_q.weight" in branch.floats:
        w["head"] = header[branch.floats["layers.0.attention.norm_q.weight"]]["shape"][0]
    return w


def check_branch(branch: Branch, header: dict, file_name: str, real_widths: bool | dict = True) -> list[str]:
    """Validate a branch against the Ideogram 4 layout; returns the non-linear tensors it lacks.

    Raises CheckpointError naming unknown (extra) tensors, missing linears and mis-shaped layers.
    ``real_widths``: True checks against the real model's widths (``REAL``), a dict against those widths (what the
    ComfyUI in use builds: ``nodes.loader.comfy_widths``; ComfyUI fixes them), False against the widths inferred
    from the file (miniatures).
    """
    where = f"{file_name}: {branch.name + ' branch' if branch.name else 'model'}"
    n = count_layers(list(branch.quant) + list(branch.floats))
    if n == 0:
        raise CheckpointError(f"{where}: no 'layers.N.' tensors: not an Ideogram 4 checkpoint (wrong "
                              "architecture?). This node loads Ideogram 4 only; use 'Load Diffusion Model' "
                              "+ 'Apply Fused INT8 GEMM' for other models")
    if isinstance(real_widths, dict):
        w = dict(real_widths)
    elif real_widths:
        w = widths()
    else:
        inf = infer_widths(branch, header)
        w = widths(**{k: v for k, v in inf.items() if k in ("hidden", "ffn", "adaln", "text", "channels")})
        if "head" in inf:
            w["head"] = inf["head"]
    lin, flt = linear_specs(n, w), float_specs(n, w)
    extra, bad = [], []
    have_linear = set(branch.quant)
    for k, key in branch.floats.items():
        shape = tuple(header[key]["shape"])
        base, _, leaf = k.rpartition(".")
        if base in lin and leaf in ("weight", "bias"):
            i, o, b = lin[base]
            want = (o, i) if leaf == "weight" else (o,)
            if leaf == "bias" and not b:
                extra.append(k)
            elif shape != want:
                bad.append(f"{k} {list(shape)} (expected {list(want)})")
            if leaf == "weight":
                have_linear.add(base)
        elif k in flt:
            if shape != flt[k]:
                bad.append(f"{k} {list(shape)} (expected {list(flt[k])})")
        else:
            extra.append(k)
    for name, e in branch.quant.items():
        if name not in lin:
            extra.append(name)
            continue
        i, o, b = lin[name]
        if (e.in_features, e.out_features) != (i, o):
            bad.append(f"{name} [{e.out_features}, {e.in_features}] (expected [{o}, {i}])")
        if e.bias is None and b:
            bad.append(f"{name} has no bias (Ideogram 4's {name} has one)")
    if extra:
        raise CheckpointError(f"{where}: {len(extra)} tensors are not Ideogram 4 ones, e.g. {sorted(extra)[:6]} "
                              "(wrong architecture or a newer model revision)")
    if bad:
        raise CheckpointError(f"{where}: mis-shaped layers: {'; '.join(bad[:6])}"
                              + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
                              + ("; the real Ideogram 4 widths are fixed by ComfyUI" if real_widths else ""))
    missing_lin = sorted(set(lin) - have_linear)
    if missing_lin:
        raise CheckpointError(f"{where}: linears missing from the file (neither int8 nor float): "
                              f"{missing_lin[:6]}{' ...' if len(missing_lin) > 6 else ''}")
    return sorted(set(flt) - set(branch.floats))


# --------------------------------------------------------------------------- miniatures
def random_state_dict(n_layers: int, w: dict, seed: int = 0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Deterministic random float Ideogram 4 state dict (ComfyUI names) at widths ``w``."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for n, (i, o, b) in linear_specs(n_layers, w).items():
        sd[f"{n}.weight"] = (torch.randn(o, i, generator=g) / i ** 0.5).to(dtype)
        if b:
            sd[f"{n}.bias"] = (torch.randn(o, generator=g) * 0.02).to(dtype)
    for n, shape in float_specs(n_layers, w).items():
        sd[n] = (1.0 + 0.1 * torch.randn(*shape, generator=g)).to(dtype) if "norm" in n \
            else torch.randn(*shape, generator=g).to(dtype)
    return sd


def quantize_state_dict(sd: dict[str, torch.Tensor], names, smooth: dict | None = None):
    """Split a float state dict into (quant layers {name: layer dict}, float tensors) quantizing ``names``.

    ``smooth``: {name: fp32 [K] divisor}; the stored weight is then Q(W * s).
    """
    quant, floats = {}, dict(sd)
    for n in names:
        w = floats.pop(f"{n}.weight").float()
        s = None if smooth is None else smooth.get(n)
        if s is not None:
            w = w * s[None, :]
        q, sc = quantize_weight_per_channel(w)
        b = floats.pop(f"{n}.bias", None)
        quant[n] = {"qweight": q, "weight_scale": sc, "bias": None if b is None else b.float(), "smooth": s}
    return quant, floats
