"""Which linears of a diffusion model get quantized.

Presets work on module names relative to the diffusion model (``layers.0.attention.qkv``):

* ``blocks`` (the default for every architecture): the linears inside the repeated transformer blocks
  (``layers.N``, ``double_blocks.N``, ``transformer_blocks.N``, ...), minus the adaLN/modulation
  GEMVs, which run with M = batch (a GEMV gains nothing from INT8 and their errors scale every
  activation of the block).
* ``blocks+modulation``: the above plus the modulation GEMVs.
* ``all``: every linear, embedders and final layer included.

``include`` / ``exclude`` are regular expressions matched (``re.search``) against the names, one per line or
separated by commas outside ``{}``, ``[]`` and ``()`` (``[0-9]{1,2}`` stays whole; ``\\,`` is a literal comma);
``exclude`` wins. Which layers each pattern matched is logged; one that matches nothing is a warning. Layers
smaller than ``MIN_FEATURES`` in either dimension stay float.

Which containers hold the blocks and which linears are modulation GEMVs is architecture knowledge: each model
adapter (``adapters/``) declares its own :class:`BlockRules`; ``GENERIC`` (the union over the DiTs ComfyUI loads)
serves architectures without an adapter.
"""
from __future__ import annotations

import dataclasses
import logging
import re

import torch
from torch import nn

# Repeated-block containers across the DiTs ComfyUI loads (Ideogram 4 / Lumina2 / Z-Image `layers`,
# Flux `double_blocks`/`single_blocks`, SD3 `joint_blocks`, Qwen-Image / HunyuanImage
# `transformer_blocks`, Wan `blocks`, Lumina2 refiners).
_BLOCK = re.compile(r"(^|\.)(layers|blocks|double_blocks|single_blocks|joint_blocks|transformer_blocks"
                    r"|noise_refiner|context_refiner|single_transformer_blocks)\.\d+\.")
# adaLN / modulation projections (Ideogram 4 `adaln_modulation`, Lumina2 `adaLN_modulation.1`,
# Flux `img_mod.lin`, `modulation.lin`, Qwen-Image `img_mod.1`, Wan `modulation`).
_MODULATION = re.compile(r"(adaln|adaLN|modulation|_mod\.|(^|\.)mod\.|norm1_context\.linear|norm1\.linear"
                         r"|norm\.linear)", re.I)

PRESETS = ("blocks", "blocks+modulation", "all")
MIN_FEATURES = 16


@dataclasses.dataclass(frozen=True)
class BlockRules:
    """Where the repeated blocks sit (``blocks``: a name with a ``<container>.<index>.`` part) and which of
    their linears are modulation GEMVs (``modulation``, searched in the name)."""
    blocks: re.Pattern
    modulation: re.Pattern

    def in_block(self, name: str) -> bool:
        return self.blocks.search(name) is not None

    def is_modulation(self, name: str) -> bool:
        return self.modulation.search(name) is not None


def block_rules(containers, modulation: str) -> BlockRules:
    """BlockRules for block containers (names, e.g. ``("double_blocks", "single_blocks")``) and a modulation
    regular expression."""
    alt = "|".join(re.escape(c) for c in containers)
    return BlockRules(re.compile(rf"(^|\.)({alt})\.\d+\."), re.compile(modulation))


GENERIC = BlockRules(_BLOCK, _MODULATION)
log = logging.getLogger("int8_fused")
_QUANTIFIER = re.compile(r"\{\d*,\d*\}")
SHOWN = 4  # layer names shown per pattern in the log


def split_patterns(text: str | None) -> list[str]:
    """The regular expressions in ``text``: one per line, or separated by commas that are not escaped (``\\,``)
    and not inside a ``{m,n}`` quantifier, a ``[...]`` class or a ``(...)`` group; stripped, empty ones dropped."""
    out, cur, depth, i, text = [], [], 0, 0, text or ""
    while i < len(text):
        c = text[i]
        if c == "\\":
            cur.append(text[i:i + 2])
            i += 2
            continue
        if c == "[":  # a class runs to the first unescaped "]" after its first character ("[]a]", "[^]a]")
            j = i + 1 + (text[i + 1:i + 2] == "^")
            j += text[j:j + 1] == "]"
            while j < len(text) and text[j] not in "]\n":
                j += 2 if text[j] == "\\" else 1
            j += text[j:j + 1] == "]"  # an unclosed class ends at the line's end (re.compile then names it)
            cur.append(text[i:j])
            i = j
            continue
        m = _QUANTIFIER.match(text, i) if c == "{" else None
        if m:
            cur.append(m.group())
            i = m.end()
            continue
        depth += (c == "(") - (c == ")" and depth > 0)
        if c == "\n" or (c == "," and depth == 0):
            out.append("".join(cur))
            cur, depth = [], 0
        else:
            cur.append(c)
        i += 1
    out.append("".join(cur))
    return [p.strip() for p in out if p.strip()]


def _patterns(text: str | None) -> list[re.Pattern]:
    out = []
    for p in split_patterns(text):
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"layer pattern {p!r} is not a valid regular expression: {e}") from None
    return out


def log_matches(what: str, patterns: list[re.Pattern], names) -> None:
    """Log how many of ``names`` (and the first few) each of ``patterns`` matched; a pattern that matches none is
    a warning naming it (``what``: the input it came from, e.g. ``exclude``)."""
    names = list(names)
    for p in patterns:
        hit = [n for n in names if p.search(n)]
        if hit:
            log.info("INT8 layers: %s pattern %r matched %d layer(s): %s%s", what, p.pattern, len(hit),
                     ", ".join(hit[:SHOWN]), ", ..." if len(hit) > SHOWN else "")
        else:
            log.warning("INT8 layers: %s pattern %r matched no layer (of %d); check it (patterns are separated by "
                        "commas outside {}, [] and () or by new lines)", what, p.pattern, len(names))


def is_linear(m: nn.Module) -> bool:
    """A float linear to quantize: nn.Linear, ComfyUI's casting subclasses of it (``comfy.ops.*.Linear``)
    and linears that only look like one (ComfyUI's mixed-precision ``Linear`` holding a core
    ``QuantizedTensor`` weight, e.g. ``int8_tensorwise``). Never an ``Int8Linear`` (already INT8)."""
    from .linear import Int8Linear
    if isinstance(m, Int8Linear):
        return False
    if isinstance(m, nn.Linear):
        return True
    w = getattr(m, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and isinstance(getattr(m, "in_features", None), int)
            and isinstance(getattr(m, "out_features", None), int))


def in_block(name: str, rules: BlockRules = GENERIC) -> bool:
    """Whether layer ``name`` sits inside a repeated transformer block (``layers.3.``, ``double_blocks.0.``, ...)."""
    return rules.in_block(name)


def is_modulation(name: str, rules: BlockRules = GENERIC) -> bool:
    """Whether layer ``name`` is an adaLN / modulation projection (a GEMV: M = batch)."""
    return rules.is_modulation(name)


def compile_patterns(text: str | None) -> list[re.Pattern]:
    """Regular expressions (``split_patterns``) -> compiled list; a bad one raises ValueError naming it."""
    return _patterns(text)


def matches(name: str, patterns: list[re.Pattern]) -> bool:
    return any(p.search(name) for p in patterns)


def select_linears(model: nn.Module, preset: str = "blocks", include: str | None = None,
                   exclude: str | None = None, rules: BlockRules = GENERIC) -> list[tuple[str, nn.Linear]]:
    """(name, module) of each linear of ``model`` to quantize, in model order."""
    return select_from(model.named_modules(), preset, include, exclude, rules)


def select_from(named_modules, preset: str = "blocks", include: str | None = None,
                exclude: str | None = None, rules: BlockRules = GENERIC) -> list[tuple[str, nn.Linear]]:
    """``select_linears`` over an iterable of (name, module) pairs (e.g. with patched modules swapped
    back for their originals); ``rules``: the architecture's block rules (its adapter's)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown layer preset {preset!r}; choose one of {', '.join(PRESETS)}")
    inc, exc = _patterns(include), _patterns(exclude)
    chosen, linears = [], []
    for name, m in named_modules:
        if not is_linear(m):
            continue
        linears.append(name)
        if min(m.in_features, m.out_features) < MIN_FEATURES:
            continue
        if preset == "all":
            take = True
        else:
            take = rules.in_block(name) and (preset == "blocks+modulation" or not rules.is_modulation(name))
        if inc and any(p.search(name) for p in inc):
            take = True
        if exc and any(p.search(name) for p in exc):
            take = False
        if take:
            chosen.append((name, m))
    log_matches("include", inc, linears)
    log_matches("exclude", exc, linears)
    return chosen
