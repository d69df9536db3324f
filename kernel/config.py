"""Every environment switch of the pack, in one place: name, type, default and what it does.

The environment is read here only, once per switch (on its first ``get``), and the value kept; setting
``os.environ`` later changes nothing. Tests and benchmarks change a switch in-process with ``override``
(a context manager) or re-read the environment with ``reload``. A switch with ``at_import`` (TRITON_INTERPRET) is
taken when the kernels are defined: ``override`` changes what ``get`` says, not the kernels, so tests of its effect
set it in a subprocess' environment.

This module lives in ``kernel/`` because that package imports nothing else of the pack: ``kernel`` imports it
as ``.config``; ``quant``, ``adapters`` and ``nodes`` as ``..kernel.config``. Tests and benches import the pack one
way (``tests/pack_import.py``), so ``kernel.config`` there is this same module. The README's switch table is
``markdown_table()``. ``gemm_switches`` (what chooses the GEMMs' kernels besides the operands) lives here too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

log = logging.getLogger("int8_fused")

_TRUE = ("1", "true", "on", "yes")  # as Triton reads TRITON_INTERPRET (case-insensitive)
_FALSE = ("0", "false", "off", "no")


@dataclasses.dataclass(frozen=True)
class Switch:
    """One switch. ``choices``: a str switch's valid values (lower case; empty: any text). A value is matched
    case-insensitively; with ``0`` among the choices the other off words (``off``, ``false``, ``no``, ``none``)
    mean ``0``, and the on words (``1``, ``on``, ``true``, ``yes``) mean ``1`` when that is a choice, else the
    default. Any other value warns once, naming the switch and the valid values, and gives the default."""
    name: str
    type: type      # bool or str; an unset or empty variable means ``default``
    default: object
    doc: str        # one line, for the README table
    at_import: bool = False
    choices: tuple = ()


SWITCHES = {s.name: s for s in (
    Switch("INT8_FUSED_BACKEND", str, None,
           "a backend name (`fused_triton`, `torch_int_mm`, ...): Apply lists it first (its default) and the "
           "Ideogram 4 loader's `auto` takes it; for A/B runs from the shell; an unknown name warns once when the "
           "pack loads and counts as unset"),
    Switch("INT8_FUSED_FUSION", bool, True,
           "`0`: no fused modules (norm/SwiGLU + quantization, w1+w3 as one GEMM), one INT8 GEMM per linear; "
           "for A/B runs"),
    Switch("INT8_FUSED_PAD_ELISION", str, None,
           "Ideogram 4's trailing padded text tokens dropped from the conditional pass: unset = on for "
           "`fused_triton` only, `0` off, `1` on for every backend", choices=("auto", "0", "1")),
    Switch("INT8_FUSED_S8_WGMMA", bool, True,
           "sm_90: the INT8 GEMMs may time and run 128 x 256 tiles as s8 wgmma n256, plain or as a persistent kernel "
           "with TMA loads and stores (`kernel/s8wgmma.py`: Triton's fp8 build with its wgmma rewritten to s8, each binary checked bit for bit against Triton's int8 build "
           "on its first call); `0`: Triton's int8 builds only"),
    Switch("INT8_FUSED_S8_DEFER", bool, True,
           "sm_90, with `INT8_FUSED_TUNE=background`: the s8 wgmma builds are compiled between samples, and until "
           "then the calls run Triton's int8 build of the same tiles (the same output bits, a slower instruction); "
           "`0`: the first call of a model waits for them"),
    Switch("INT8_FUSED_LORA_EPILOGUE", bool, True,
           "a LoRA loaded after Apply on a bf16 / fp16 fused layer: its down-projection reads the GEMM's int8 input "
           "and its up-projection is added in the GEMM's epilogue (`kernel/lora.py`); `0`: two small GEMMs beside "
           "the int8 GEMM (the path that also runs under torch.compile and for float32 models)"),
    Switch("INT8_FUSED_ATTN_INT8_AUTO", bool, False,
           "`1`: the Apply node's attention `auto` also times the pack's INT8 attention kernel (`int8`, "
           "approximate: int8 Q·Kᵀ) and may pick it; unset, `auto` chooses among the exact SDPA backends only"),
    Switch("INT8_FUSED_CACHE_DIR", str, "~/.cache/comfyui-int8-fused",
           "folder of the GEMM autotune cache: one JSON file per GPU and Triton version, so a new process "
           "does not tune again"),
    Switch("INT8_FUSED_DISPATCH", str, "auto",
           "`fused_triton` layers per shape: `auto` runs the INT8 kernel where it beat the float path when "
           "timed on this GPU (once per shape, cached next to the autotune cache), else F.linear on a bf16 "
           "copy of the weight; `int8` / `float` force one path (A/B runs, tests)", choices=("auto", "int8", "float")),
    Switch("INT8_FUSED_COMPILE_AHEAD", bool, True,
           "a model call's first run with new input shapes is preceded by a dry run that compiles its INT8 kernels "
           "in parallel (`kernel/ahead.py`); `0`: each kernel compiles when the call first reaches it"),
    Switch("INT8_FUSED_COMPILE_PROCS", str, "0",
           "how many worker processes do the dry run's compiles (`kernel/procs.py`; started when Apply runs, gone "
           "after 2 idle minutes): `0` (default): threads in ComfyUI's process; `auto`: one per CPU core but one, "
           "at most 16; a number. Each worker holds about 155 MiB of private RAM; on an H100 machine 8 workers did "
           "not make the first sample shorter than the threads (bench/RESULTS.md)"),
    Switch("INT8_FUSED_TUNE", str, "background",
           "when the alternatives of a new shape (GEMM tiles, tail splits, int8 vs float, attention backends) are "
           "timed: `background` runs it on a predicted config at once and times the rest between samples; "
           "`first_call` times them on the shape's first call (slow first sample); `off` never times",
           choices=("background", "first_call", "off")),
    Switch("TRITON_INTERPRET", bool, False,
           "Triton's own switch: `1` runs the kernels in Triton's CPU interpreter (tests only, far too slow for "
           "inference)", at_import=True),
)}

_read: dict[str, object] = {}      # name -> value parsed from the environment, on first get
_overrides: dict[str, object] = {}  # name -> value set by override()
_generation = [0]                   # bumped whenever what ``get`` returns may change (override, reload)


def _choice(s: Switch, v: str):
    """A value of a str switch with ``choices`` (lower case, stripped) as one of them, or None."""
    if v in s.choices:
        return v
    if "0" in s.choices and v in _FALSE + ("none",):
        return "0"
    if v in _TRUE:
        return "1" if "1" in s.choices else s.default
    return None


def _parse(s: Switch, raw: str | None):
    if raw is None or raw.strip() == "":
        return s.default
    if s.type is str:
        if not s.choices:
            return raw.strip()
        v = _choice(s, raw.strip().lower())
        if v is not None:
            return v
        log.warning("%s=%r is not one of %s: using the default (%s)", s.name, raw, "|".join(s.choices),
                    "unset" if s.default is None else s.default)
        return s.default
    v = raw.strip().lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    log.warning("%s=%r is not one of %s / %s: using the default (%s)", s.name, raw, "|".join(_TRUE),
                "|".join(_FALSE), s.default)
    return s.default


def _switch(name: str) -> Switch:
    s = SWITCHES.get(name)
    if s is None:
        raise KeyError(f"unknown switch {name!r}; known: {', '.join(SWITCHES)}")
    return s


def parse(name: str, raw: str | None):
    """``raw`` read as switch ``name``'s environment value would be (validated; an invalid value warns)."""
    return _parse(_switch(name), raw)


def get(name: str):
    """The switch's value: an override, else the environment as read on the first call, else its default."""
    if name in _overrides:
        return _overrides[name]
    if name not in _read:
        _read[name] = _parse(_switch(name), os.environ.get(name))
    return _read[name]


@contextlib.contextmanager
def override(**values):
    """Set switches for the duration (tests, benchmarks), e.g. ``with config.override(INT8_FUSED_FUSION=False):``.

    Values have the switch's type (None restores the default of a str switch; a str switch's value is read as
    the environment's: an invalid one warns and gives the default); nested overrides restore the outer ones.
    Switches read "at import" were already taken by their module: override changes ``get`` only."""
    for name, v in values.items():
        s = _switch(name)
        if not (isinstance(v, s.type) or (v is None and s.type is str)):
            raise TypeError(f"{name} takes a {s.type.__name__}, got {v!r}")
    saved = {n: _overrides[n] for n in values if n in _overrides}
    _overrides.update({n: _parse(SWITCHES[n], v) if SWITCHES[n].type is str else v for n, v in values.items()})
    _generation[0] += 1
    try:
        yield
    finally:
        for n in values:
            if n in saved:
                _overrides[n] = saved[n]
            else:
                _overrides.pop(n, None)
        _generation[0] += 1


def reload() -> None:
    """Forget what was read, so the next ``get`` of each switch reads the environment again."""
    _read.clear()
    _generation[0] += 1


def generation() -> int:
    """A number that changes whenever a switch's value may have changed (``override``, ``reload``): callers that
    derive something from switches on every call (``kernel.gemm_switches``) keep it until this moves."""
    return _generation[0]


def markdown_table() -> str:
    """The README table: switch | default | what it does (with a str switch's valid values)."""
    rows = ["| switch | default | what it does |", "|---|---|---|"]
    for s in SWITCHES.values():
        default = ("unset" if s.default is None else f"`{int(s.default)}`" if s.type is bool
                   else f"`{s.default}`")
        values = f". Values: {', '.join(f'`{c}`' for c in s.choices)}; anything else warns and means the default" \
            if s.choices else ""
        rows.append(f"| `{s.name}` | {default} | {s.doc}{values} |")
    return "\n".join(rows)


_GEMM_SWITCHES: list = [None, None]  # [config generation, the switches' values read then]
_FORCED_GENERATION: list = [None]    # a bench's forced tile-set capability (``kernel.gemm.forced_generation``)


_RETUNED = [0]                       # bumped when background timing changed a shape's config (``retune``)


def gemm_switches() -> tuple:
    """What chooses the INT8 GEMMs' kernels and tiles besides the operands: (INT8_FUSED_S8_WGMMA, the capability a
    bench forces with ``kernel.gemm.forced_generation`` or None, the count of ``retune`` calls). Part of every
    prepared call's key (``kernel.plan``), so an A/B of the s8 path on a loaded model re-plans its calls, and so
    does a config that background timing changed. Read again only when ``generation()`` moved (this runs on every
    INT8 call)."""
    cached, gen = _GEMM_SWITCHES, generation()
    if cached[0] != gen:
        cached[1] = (get("INT8_FUSED_S8_WGMMA"), _FORCED_GENERATION[0], _RETUNED[0])
        cached[0] = gen
    return cached[1]


def retune() -> None:
    """Background timing (``kernel.retune``) changed a config: prepared calls plan again on their next call."""
    _RETUNED[0] += 1
    _GEMM_SWITCHES[0] = None


def force_generation(capability: tuple | None) -> None:
    """Sets (None: clears) the forced tile-set capability and makes ``gemm_switches`` read again."""
    _FORCED_GENERATION[0] = capability
    _GEMM_SWITCHES[0] = None
