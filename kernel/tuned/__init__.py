"""Shipped tuned tables: per-GPU seeds of the GEMM autotune, dispatch and attention caches.

Without them a new user's first sample times every GEMM shape's candidate tiles (each one compiled), its tail
splits, every linear shape's int8-vs-float dispatch and every attention shape's SDPA backend. ``<gpu slug>.json``
in this folder holds what a bench run on that GPU measured, built by ``bench/checks/tuned_tables.py`` from the run's
``INT8_FUSED_CACHE_DIR``::

    {"format": 1, "gpu": "NVIDIA H200",
     "measured_with": {"gemm": {"triton": "3.4.0"}, "dispatch": {"decisions": "v3", "torch": .., "triton": ..},
                       "attention": {"torch": ..}},
     "gemm": {key: config}, "dispatch": {key: decision}, "attention": {key: choice}, "sources": [..]}

The keys are the caches' own (``kernel.autotune.ConfigCache.key`` with its split / SwiGLU / small-M forms,
``quant.dispatch.shape_key``, ``quant.attention.key_text`` with the device index dropped). A cache
(``kernel.jsoncache.JsonCache``) asks its ``Seed`` for a key its file lacks: the user's entries win, and a seed entry
is never written into the user's file (a newer pack's tables apply at once). A seed applies to the GPU whose name it
records, exactly. ``kernel.autotune.pick_config`` runs a seeded tile once before trusting it and tunes as usual
where it fails.

``ENABLED`` (module attribute, default True): False, and every cache tunes as without seeds (a bench of cold tuning
sets it before the first INT8 call). ``SEED_DIR``: the folder read. No torch here.
"""
from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path
from typing import Callable

log = logging.getLogger("int8_fused")

ENABLED = True
SEED_DIR = Path(__file__).resolve().parent
FORMAT = 1
SECTIONS = ("gemm", "dispatch", "attention")

_FILES: dict = {}      # path -> ((mtime_ns, size), data or None)
_WARNED: set = set()   # paths warned about


def slug(gpu: str) -> str:
    """The seed file's stem for a GPU name (``NVIDIA H200`` -> ``NVIDIA-H200``)."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", gpu).strip("-")


def seed_path(gpu: str, folder: Path | None = None) -> Path:
    return Path(folder or SEED_DIR) / f"{slug(gpu)}.json"


def _problem(data) -> str | None:
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    if data.get("format") != FORMAT:
        return f"format {data.get('format')!r}, not {FORMAT}"
    if not isinstance(data.get("gpu"), str):
        return "no GPU name"
    for s in SECTIONS:
        if not isinstance(data.get(s, {}), dict) or not isinstance(data.get("measured_with", {}).get(s, {}), dict):
            return f"section {s!r} is not an object"
    return None


def read(path: Path) -> dict | None:
    """The seed file at ``path`` (read again when it changes), or None: missing, or damaged (one warning)."""
    try:
        st = path.stat()
    except OSError:
        return None
    stamp = (st.st_mtime_ns, st.st_size)
    have = _FILES.get(path)
    if have is not None and have[0] == stamp:
        return have[1]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        problem = _problem(data)
    except (OSError, ValueError, RecursionError, AttributeError) as e:
        data, problem = None, f"{type(e).__name__}: {str(e)[:200]}"
    if problem is not None:
        if path not in _WARNED:
            _WARNED.add(path)
            log.warning("INT8 tuned tables: ignoring the shipped table %s (%s); shapes are tuned on this GPU", path,
                        problem)
        data = None
    _FILES[path] = (stamp, data)
    return data


def table(gpu: str) -> dict | None:
    """The seed file of GPU ``gpu`` when seeds are enabled and it names that GPU exactly, else None."""
    if not ENABLED or not gpu:
        return None
    data = read(seed_path(gpu))
    return data if data is not None and data["gpu"] == gpu else None


class Seed:
    """The ``section`` entries of GPU ``gpu``'s seed file, looked up per key (``get``), read when asked.
    ``require``: values the section's ``measured_with`` must hold (the dispatch decisions' version); ``key``:
    how a cache key is normalised before the lookup (the attention keys' device index)."""

    def __init__(self, gpu: str, section: str, require: dict | None = None,
                 key: Callable[[str], str] | None = None):
        if section not in SECTIONS:
            raise ValueError(f"section must be one of {SECTIONS}, got {section!r}")
        self.gpu, self.section, self.require, self.key = gpu, section, dict(require or {}), key

    def __repr__(self):
        return f"Seed({self.gpu!r}, {self.section!r})"

    def entries(self) -> dict:
        data = table(self.gpu)
        if data is None:
            return {}
        measured = data.get("measured_with", {}).get(self.section, {})
        if any(measured.get(k) != v for k, v in self.require.items()):
            return {}
        return data.get(self.section, {})

    def get(self, key: str):
        """A copy of the seed's entry for ``key``, or None."""
        e = self.entries().get(self.key(key) if self.key else key)
        return copy.deepcopy(e) if e is not None else None


def attention_key(key: str) -> str:
    """An attention cache key without its CUDA device index (``..._cuda:1`` -> ``..._cuda``)."""
    return re.sub(r"_cuda:\d+(?=(_int8ok)?$)", "_cuda", key)


def describe(gpu: str) -> str | None:
    """One line on GPU ``gpu``'s shipped table for a log or a widget, or None without one."""
    data = table(gpu)
    if data is None:
        return None
    counts = ", ".join(f"{len(data.get(s, {}))} {s}" for s in SECTIONS)
    versions = "; ".join(f"{s} " + " ".join(f"{k} {v}" for k, v in sorted(m.items()))
                         for s, m in data.get("measured_with", {}).items() if m)
    return f"shipped tuned table for {gpu}: {counts} entries (measured with {versions or 'unknown versions'})"
