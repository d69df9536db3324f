"""GEMM tile configs as data, and a small autotuner whose winners persist across processes.

Why not ``triton.autotune``: its cache lives in one process, it re-benchmarks in every new ComfyUI session, and
it keys on exact M, so each new image size would tune again. Here the key is ``(N, K, M bucket)`` and the
winners are written to ``$INT8_FUSED_CACHE_DIR`` (default ``~/.cache/comfyui-int8-fused``) in a JSON file
named after the GPU and the Triton version, so a second process reuses them without timing anything.

The cache logic takes the timing function as an argument, so it is tested on the CPU with a fake clock.
No import of triton or CUDA here.
"""
from __future__ import annotations

import json
import math
import re
import threading
from pathlib import Path
from typing import Callable

from . import config
from .atomic import atomic_write

Config = dict  # {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}

SMALL_M = 16        # rows up to here use the GEMV-style configs (adaLN modulation runs with M = batch)
M_BUCKET_CAP = 16384


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 8) -> Config:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group,
            "num_warps": warps, "num_stages": stages}


def hopper_configs() -> list[Config]:
    """sm_90: every tile is wgmma-eligible (BLOCK_M % 64 == 0, warps % 4 == 0, BLOCK_K >= 32).
    First entry: the best tile on every Ideogram 4 block shape in the H200 run of 2026-11-29 (1160-1340 TOP/s,
    bench/RESULTS.md); 96 KB of smem lets two CTAs share an SM, which is why 4 stages (128 KB) ran 25-40 %
    slower. The rest are its neighbours: group size, a 64-deep K step, one warpgroup, wider tiles."""
    return [
        _cfg(128, 128, 128, 8, 3),
        _cfg(128, 128, 128, 8, 3, group=4),
        _cfg(128, 128, 128, 8, 3, group=16),
        _cfg(128, 128, 128, 4, 3),
        _cfg(128, 128, 64, 8, 4),
        _cfg(128, 128, 64, 4, 5),
        _cfg(128, 256, 64, 8, 3),
        _cfg(128, 256, 128, 8, 3),   # 144 KB smem, one CTA an SM: 8-15 % slower in that run
        _cfg(256, 128, 64, 8, 3),
        _cfg(64, 128, 128, 4, 4),    # more tiles for short M (text projection, M = 512)
    ]


def s8_configs(persist: bool = True) -> list[Config]:
    """sm_90 with ``kernel.s8wgmma``: 128 x 256 tiles issued as s8 wgmma n256 (one CTA an SM, 144 KB of shared
    memory). H200, run bw (bench/gemm_n256.py): BLOCK_K 128 in 3 stages ran 1.08-1.22x the first Hopper config on
    Ideogram 4 / Flux.1 block shapes; 64 x 4 stages 0.99-1.14x. ``PERSIST``: the same tile as the persistent TMA
    kernel (``kernel.gemm._int8_gemm_persistent_kernel``), 1.02-1.13x the non-persistent one on those shapes in
    run bz (bench/gemm_persist.py)."""
    tile = {**_cfg(128, 256, 128, 8, 3), "S8": True}
    return [tile, {**tile, "PERSIST": True}] if persist else [tile]


def ampere_configs() -> list[Config]:
    """sm_80/86/89 (mma.sync): tiles sized for 100 KB (RTX 3090/4090) or 164 KB (A100) of shared memory;
    ``fits_smem`` drops the ones a given GPU cannot hold."""
    return [
        _cfg(128, 128, 64, 4, 4),
        _cfg(128, 256, 64, 8, 3),
        _cfg(256, 128, 64, 8, 3),
        _cfg(128, 128, 128, 8, 3),
        _cfg(64, 128, 64, 4, 4),
        _cfg(128, 64, 64, 4, 4),
        _cfg(64, 64, 128, 4, 4),
    ]


def small_m_configs() -> list[Config]:
    """M <= 16 (a GEMV in practice): a 16-row tile instead of a 128-row one that would be 99 % padding.
    Memory-bound on the weight, so many narrow N tiles keep every SM streaming."""
    return [
        _cfg(16, 64, 256, 4, 3, group=1),
        _cfg(16, 128, 128, 4, 4, group=1),
        _cfg(16, 32, 256, 2, 4, group=1),
        _cfg(16, 64, 128, 4, 4, group=1),
    ]


MEDIUM_M = 256      # rows up to here also try the narrow tiles of ``medium_m_configs``


def medium_m_configs() -> list[Config]:
    """16 < M <= 256 (text projections, M 77 prompts, ragged small batches): memory-bound on the weight, and a
    128x128 tile leaves most SMs idle (M 77 x N 4608: 36 CTAs on the H200's 132 SMs). Narrow N tiles (and
    64-row M tiles) give 2-4x more CTAs streaming the weight. All wgmma-eligible (BLOCK_M % 64 == 0, 4 warps,
    BLOCK_K >= 32); ``fits_smem`` drops what a GPU cannot hold (64x64x256 in 3 stages needs 96 KB)."""
    return [
        _cfg(64, 64, 128, 4, 4),
        _cfg(64, 32, 256, 4, 3),
        _cfg(64, 64, 256, 4, 3),
        _cfg(128, 64, 128, 4, 4),
        _cfg(128, 32, 128, 4, 4),
    ]


def interpreter_configs() -> list[Config]:
    """TRITON_INTERPRET=1 (CPU tests): small tiles so several K steps and program ids get exercised."""
    return [_cfg(32, 32, 32, 4, 1, group=2), _cfg(16, 16, 64, 4, 1, group=1)]


def smem_bytes(cfg: Config) -> int:
    """Shared memory of the int8 A and W stages (1 byte an element)."""
    return (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * cfg["num_stages"]


def fits_smem(cfg: Config, smem_limit: int) -> bool:
    return smem_bytes(cfg) <= smem_limit - 4096  # headroom for barriers and the epilogue's scratch


def candidates(capability: tuple[int, int], smem_limit: int, m_bucket: int, s8: bool = False,
               persist: bool = False) -> list[Config]:
    """The configs worth timing on a GPU of this capability for rows in this bucket (``s8``: with the s8 wgmma
    n256 tiles, which need sm_90; ``persist``: and their persistent TMA form)."""
    if m_bucket <= SMALL_M:
        return [c for c in small_m_configs() if fits_smem(c, smem_limit)]
    base = hopper_configs() if capability[0] == 9 else ampere_configs()
    if s8 and tuple(capability) == (9, 0):
        base = base + s8_configs(persist)
    if m_bucket <= MEDIUM_M:
        base = base + [c for c in medium_m_configs() if c not in base]
    out = [c for c in base if fits_smem(c, smem_limit) and c["BLOCK_M"] <= max(64, m_bucket)]
    return out or [_cfg(64, 64, 64, 4, 2)]


def m_bucket(m: int) -> int:
    """Rows rounded up to a power of two (at least SMALL_M, at most M_BUCKET_CAP): a new image size
    lands in a bucket that is already tuned."""
    if m <= SMALL_M:
        return SMALL_M
    return min(1 << math.ceil(math.log2(m)), M_BUCKET_CAP)


def cache_dir() -> Path:
    return Path(config.get("INT8_FUSED_CACHE_DIR")).expanduser()


def cache_file(gpu_name: str, triton_version: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{gpu_name}-triton-{triton_version}").strip("-")
    return cache_dir() / f"gemm-{slug}.json"


class ConfigCache:
    """Winning configs of one GPU + Triton version: in memory, mirrored to a JSON file.

    Writes merge with what is on disk (another process may have tuned other shapes meanwhile) and
    replace the file atomically (``kernel.atomic``), so a reader never sees half a file. An unreadable file is
    ignored."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._mem: dict[str, Config] | None = None

    @staticmethod
    def key(n: int, k: int, bucket: int, s8: bool = False, persist: bool = False) -> str:
        """``s8``: a tuning whose candidates held the s8 wgmma tiles (``s8_configs``; ``persist``: their persistent
        form too, suffix ``_s8p``), kept apart from the one without them (``INT8_FUSED_S8_WGMMA=0``, a GPU where
        that path was turned off; ``INT8_FUSED_PERSISTENT=0``)."""
        return f"N{n}_K{k}_M{bucket}" + (("_s8p" if persist else "_s8") if s8 else "")

    def _read_disk(self) -> dict[str, Config]:
        try:
            data = json.loads(self.path.read_text())
            return {k: v for k, v in data.get("configs", {}).items() if isinstance(v, dict)}
        except (OSError, ValueError):
            return {}

    def get(self, key: str) -> Config | None:
        with self._lock:
            if self._mem is None:
                self._mem = self._read_disk()
            return self._mem.get(key)

    def put(self, key: str, cfg: Config, meta: dict | None = None) -> None:
        with self._lock:
            merged = self._read_disk()
            merged.update(self._mem or {})
            merged[key] = cfg
            self._mem = merged
            text = json.dumps({**(meta or {}), "configs": merged}, indent=1, sort_keys=True)
            try:
                atomic_write(self.path, lambda tmp: Path(tmp).write_text(text))
            except OSError:
                pass  # NOTE: a read-only home only costs a re-tune in the next process


TIMINGS: dict[str, list[tuple[Config, float]]] = {}  # key -> every candidate's time, for bench reports
FINALISTS = 3        # candidates within FINAL_WITHIN of the fastest single timing are timed again, at most this many,
FINAL_WITHIN = 0.10  # in FINAL_ROUNDS interleaved rounds; the lowest median wins. H200 (run bx): one timing each
FINAL_ROUNDS = 3     # kept a 128 x 128 tile 4-9 % slower than the s8 tile on two shapes (kernel timings vary 4-7 %)


def pick_config(cache: ConfigCache, key: str, configs: list[Config],
                time_fn: Callable[[Config], float], meta: dict | None = None) -> Config:
    """Cached winner for ``key``, or time every candidate (``time_fn`` -> ms; an exception such as
    out-of-resources counts as infinitely slow), store the fastest and return it."""
    hit = cache.get(key)
    if hit is not None:
        return hit
    best, best_ms = None, math.inf
    TIMINGS[key] = []
    for cfg in configs:
        try:
            ms = float(time_fn(cfg))
        except Exception:  # noqa: BLE001 - a config that fails to compile or launch is just skipped
            TIMINGS[key].append((cfg, math.inf))
            continue
        TIMINGS[key].append((cfg, ms))
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"int8 GEMM autotune {key}: every candidate config failed to run")
    close = sorted((ms, i) for i, (c, ms) in enumerate(TIMINGS[key]) if ms <= best_ms * (1 + FINAL_WITHIN))
    if len(close) > 1:  # the close ones again, interleaved (the fastest first: its failure is raised)
        finals = {i: TIMINGS[key][i][0] for _, i in close[:FINALISTS]}
        med = interleaved_medians(finals, time_fn, FINAL_ROUNDS)
        best = finals[min(med, key=lambda i: (med[i], i))]
    cache.put(key, best, meta)
    return best


def interleaved_medians(variants: dict, time_fn, rounds: int = 3) -> dict:
    """{name: median ms} of ``time_fn(config)`` for each of ``variants`` ({name: config}) over ``rounds`` interleaved
    rounds (clock drift then hits every variant alike). A variant that fails to build is dropped; the first one's
    failure is raised (it is the one the caller falls back to)."""
    import statistics
    first = next(iter(variants))
    times: dict = {name: [] for name in variants}
    for _ in range(rounds):
        for name in list(times):
            try:
                times[name].append(float(time_fn(variants[name])))
            except Exception:  # noqa: BLE001 - a variant that fails to build is not chosen
                if name == first:
                    raise
                del times[name]
    return {name: statistics.median(t) for name, t in times.items()}
