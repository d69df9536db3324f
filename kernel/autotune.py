"""GEMM tile configs as data, and a small autotuner whose winners persist across processes.

Why not ``triton.autotune``: its cache lives in one process, it re-benchmarks in every new ComfyUI session, and
it keys on exact M, so each new image size would tune again. Here the key is ``(N, K, M bucket)`` and the
winners are written to ``$INT8_FUSED_CACHE_DIR`` (default ``~/.cache/comfyui-int8-fused``) in a JSON file
named after the GPU and the Triton version, so a second process reuses them without timing anything.

The cache logic takes the timing function as an argument, so it is tested on the CPU with a fake clock.
No import of triton or CUDA here.
"""
from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Callable

from . import config
from .jsoncache import JsonCache

log = logging.getLogger("int8_fused")

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
    memory). Measured on the H200: BLOCK_K 128 in 3 stages ran 1.08-1.22x the first Hopper config on Ideogram 4 /
    Flux.1 block shapes; 64 x 4 stages 0.99-1.14x. ``PERSIST``: the same tile as the persistent TMA kernel
    (``kernel.gemm._int8_gemm_persistent_kernel``), 1.02-1.13x the non-persistent one on those shapes."""
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
    """TRITON_INTERPRET=1 (CPU tests): small tiles so several K steps and program ids get exercised. The kernel
    tests launch these explicitly (tests/test_kernel_gemm.py, test_s8wgmma.py, ...)."""
    return [_cfg(32, 32, 32, 4, 1, group=2), _cfg(16, 16, 64, 4, 1, group=1)]


def interpreter_run_config(m: int) -> Config:
    """The tile a model-level run gets under TRITON_INTERPRET=1 (no timing on a CPU): large, so that each
    interpreted program does its work in a few large numpy operations (5-17x less time than the small tiles on the
    tiny models' shapes). The int8 GEMMs accumulate exactly in int32 and dequantize element by element, so their
    output bits do not depend on the tile; the small tiles' K steps and program ids are the kernel tests' to
    exercise (``interpreter_configs``). ``m <= SMALL_M``: the one-launch small-M kernel's tile."""
    if m <= SMALL_M:
        return _cfg(16, 128, 256, 4, 1, group=1)
    return _cfg(32 if m <= 32 else 64, 128, 256, 4, 1, group=1)


# Shared memory a block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin) by compute capability: the GeForce
# generations' 100 KB an SM less the 1 KB the driver keeps (sm_86 RTX 30, sm_89 RTX 40, sm_120 RTX 50), A100's 164 KB
# and H100 / H200's 227 KB. ``candidates`` never offers a tile whose stages exceed it (tests/test_compile_targets.py
# compiles every candidate for each of these targets and checks the compiled kernel's shared memory against it).
SMEM_OPTIN = {(8, 0): 166912, (8, 6): 101376, (8, 9): 101376, (9, 0): 232448, (12, 0): 101376}


def smem_optin(capability: tuple[int, int], reported: int | None = None) -> int:
    """Shared memory a block may use on a GPU of ``capability``: the lower of ``SMEM_OPTIN``'s figure and
    ``reported`` (the device's own), whichever is known."""
    table = SMEM_OPTIN.get(tuple(capability))
    if table is None or not reported:
        return int(reported or table or 0)
    return min(table, int(reported))


def smem_bytes(cfg: Config) -> int:
    """Shared memory of the A and W stages, ``num_stages`` buffers (sm_90's wgmma pipeline holds that many,
    mma.sync's cp.async ring one fewer): W int8, A int8 or, for tiles of up to SMALL_M rows (the small-M kernel
    quantizes its bf16 rows on the fly), 2 bytes an element; a persistent config (``PERSIST``) also stages half an
    output tile (2 bytes an element) for its TMA store. With ``fits_smem``'s 4 KB of headroom an upper bound of what
    every compiled GEMM takes on every target (tests/test_compile_targets.py checks each candidate)."""
    a_bytes = 2 if cfg["BLOCK_M"] <= SMALL_M else 1
    stages = (a_bytes * cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * cfg["num_stages"]
    return stages + (cfg["BLOCK_M"] * cfg["BLOCK_N"] if cfg.get("PERSIST") else 0)


SMEM_HEADROOM = 4096  # bytes kept free beside ``smem_bytes``: barriers and the epilogue's scratch


def fits_smem(cfg: Config, smem_limit: int) -> bool:
    return smem_bytes(cfg) <= smem_limit - SMEM_HEADROOM


def candidates(capability: tuple[int, int], smem_limit: int | None, m_bucket: int, s8: bool = False,
               persist: bool = False) -> list[Config]:
    """The configs worth timing on a GPU of this capability for rows in this bucket (``s8``: with the s8 wgmma
    n256 tiles, which need sm_90; ``persist``: and their persistent TMA form). ``smem_limit``: the device's opt-in
    shared memory a block (None: ``SMEM_OPTIN``'s figure); a tile must fit the lower of the two."""
    cap = tuple(capability)
    limit = smem_optin(cap, smem_limit)
    if m_bucket <= SMALL_M:
        return [c for c in small_m_configs() if fits_smem(c, limit)]
    base = hopper_configs() if cap[0] == 9 else ampere_configs()
    if s8 and cap == (9, 0):
        base = base + s8_configs(persist)
    if m_bucket <= MEDIUM_M:
        base = base + [c for c in medium_m_configs() if c not in base]
    out = [c for c in base if fits_smem(c, limit) and c["BLOCK_M"] <= max(64, m_bucket)]
    return out or [_cfg(64, 64, 64, 4, 2)]


def target_candidates(capability: tuple[int, int], s8: bool = True) -> dict[str, list[Config]]:
    """Every config a GPU of ``capability`` may time, by row bucket ("small": M <= SMALL_M, "medium": up to
    MEDIUM_M, "large"), at ``SMEM_OPTIN``'s limit; on sm_90 with the s8 tiles (``s8``) in both forms. What
    tests/compile_targets.py compiles for that target."""
    return {name: candidates(capability, None, bucket, s8=s8, persist=s8)
            for name, bucket in (("small", SMALL_M), ("medium", MEDIUM_M), ("large", M_BUCKET_CAP))}


M_CLASSES = ("small", "medium", "large")


def m_class(m: int) -> str:
    """The row class of a call: ``small`` (M <= SMALL_M: GEMVs), ``medium`` (up to MEDIUM_M: text projections,
    short prompts) or ``large`` (image and video tokens). A shape's config is chosen per class before it is timed
    (``predicted``), and a process keeps one compiled config per (N, K, class) until background timing finds a
    better one (``choose``): a new resolution lands in a class that already has its kernels."""
    return "small" if m <= SMALL_M else "medium" if m <= MEDIUM_M else "large"


def predicted(capability: tuple[int, int], smem_limit: int | None, m: int, s8: bool = False,
              persist: bool = False) -> list[Config]:
    """The candidates of a shape of ``m`` rows on this GPU (``candidates`` of the class's widest bucket), best guess
    first, by class and GPU generation only:
    - ``small``: the 16 x 64 x 256 GEMV tile (10 of the H200's 16 small-M picks);
    - ``large``: on sm_90 with the s8 wgmma tiles the persistent 128 x 256 x 128 s8 tile (34 of the H200's 40
      picks at M > 1024; its plain form where ``persist`` is off), else the first Hopper / Ampere tile;
    - ``medium``: the large class's tile. The narrow tiles that suit 16 < M <= 256 (``medium_m_configs``: 64 x 64 x
      128 first) are timed between samples; before the first sample the class shares the large class's compiled
      kernel instead of compiling its own (Z-Image's 256-token caption layers: two of the twelve compiles of its
      first sample on an H100, bench/RESULTS.md). Where that tile is not a candidate here, 64 x 64 x 128.
    The rest follow in ``candidates``' order, for a GPU where the first fails to build."""
    cls = m_class(m)
    bucket = {"small": SMALL_M, "medium": MEDIUM_M}.get(cls, M_BUCKET_CAP)
    cands = candidates(capability, smem_limit, bucket, s8=s8, persist=persist)
    if cls == "small":
        first = small_m_configs()[0]
    elif s8 and tuple(capability) == (9, 0):
        first = s8_configs(persist)[-1]
    else:
        first = (hopper_configs() if tuple(capability)[0] == 9 else ampere_configs())[0]
    if cls == "medium" and first not in cands:
        first = medium_m_configs()[0]
    return sorted(cands, key=lambda c: c != first)


def choose(cache: "ConfigCache", key: str, built: list[Config], guesses: list[Config], tune: str,
           time_fn: Callable[[Config], float], meta: dict | None = None,
           check: Callable[[Config], object] | None = None, later: Callable[[str, Config | None], object] = None
           ) -> Config:
    """The config a call of ``key`` runs now, by ``tune`` (``kernel.deferred.mode()``):
    - ``first_call``: ``pick_config`` (the cache, the shipped table, else every one of ``guesses`` timed now);
    - ``background`` / ``off``: nothing is timed here. The key's entry (the user's cache, else the shipped table's)
      where this process has built it already (``built``: the configs built for the key's (N, K, row class)) or
      has built nothing for the class yet (a shipped entry is run once by ``check`` first); else, while the class
      runs, ``built[0]`` (a new resolution builds nothing on its critical path); else the first of ``guesses``
      that ``check`` runs. Where the key's entry is not what runs, or no entry exists, ``later("adopt", entry)``
      / ``later("tune", None)`` hands it to background timing (``kernel.deferred``), which the caller arranges
      (None: nothing later)."""
    if tune == "first_call":
        return pick_config(cache, key, guesses, time_fn, meta, check)
    own = cache.get(key, seed=False)
    if built:
        entry = own if own is not None else (cache.seed_get(key) if hasattr(cache, "seed_get") else None)
        if entry is not None and entry in built:
            return entry
        if later is not None:
            later("tune", None) if entry is None else later("adopt", entry)
        return built[0]
    if own is not None:
        return own
    hit = seed_entry(cache, key, check, guesses)
    if hit is not None:
        return hit
    failed = []
    for cfg in guesses:
        try:
            if check is not None:
                check(cfg)
        except Exception as e:  # noqa: BLE001 - a tile this GPU or Triton cannot build: the next guess
            failed.append(f"{cfg}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if later is not None:
            later("tune", None)
        return cfg
    raise RuntimeError(f"int8 GEMM {key}: no candidate config builds here: " + "; ".join(failed))


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


TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
_GEMM_KEY = re.compile(r"^(?:[A-Z]+_)?N\d+_K\d+_M\d+(?:_s8p?)?(_T\d+_split)?(?:_tilep?)?$")


def valid_entry(key: str, entry) -> bool:
    """Whether a read entry of the GEMM cache may be used: under a GEMM key (``ConfigCache.key``, with the prefixes
    and suffixes the kernels add) a tile config (``TILE_KEYS`` positive ints, other values ints or bools) or, for a
    ``_T<tiles>_split`` key, ``{"SPLIT": n}``; under any other key (the attention cache's) a JSON object."""
    if not isinstance(entry, dict):
        return False
    m = _GEMM_KEY.match(key)
    if m is None:
        return True
    if not all(isinstance(v, int) for v in entry.values()):
        return False
    if m.group(1):
        return type(entry.get("SPLIT")) is int and entry["SPLIT"] >= 1
    return all(type(entry.get(t)) is int and entry[t] > 0 for t in TILE_KEYS)


class ConfigCache(JsonCache):
    """Winning configs of one GPU + Triton version: in memory, mirrored to a JSON file (``{"configs": {key:
    config}}`` and the tuning's meta). ``kernel.jsoncache`` handles the file: writes merge with it under a lock
    and replace it atomically; a damaged file is set aside (one warning) and its shapes tuned again.
    ``valid``: which read entries may be used (default ``valid_entry``). ``gpu``: the GPU's name, whose shipped
    table (``kernel.tuned``, its ``gemm`` section) seeds the keys the file lacks; ``seed``: another seed."""

    def __init__(self, path: Path, valid=valid_entry, what: str = "GEMM autotune cache", who: str = "INT8 autotune",
                 gpu: str | None = None, seed=None):
        if seed is None and gpu:
            from .tuned import Seed
            seed = Seed(gpu, "gemm")
        super().__init__(path, "configs", what=what, who=who, valid=valid, seed=seed)

    @staticmethod
    def key(n: int, k: int, bucket: int, s8: bool = False, persist: bool = False) -> str:
        """``s8``: a tuning whose candidates held the s8 wgmma tiles (``s8_configs``; ``persist``: their persistent
        form too, suffix ``_s8p``, as the GEMMs tune now), kept apart from the one without them
        (``INT8_FUSED_S8_WGMMA=0``, a GPU where that path was turned off)."""
        return f"N{n}_K{k}_M{bucket}" + (("_s8p" if persist else "_s8") if s8 else "")


TIMINGS: dict[str, list[tuple[Config, float]]] = {}  # key -> every candidate's time, for bench reports
FINALISTS = 3        # candidates within FINAL_WITHIN of the fastest single timing are timed again, at most this many,
FINAL_WITHIN = 0.10  # in FINAL_ROUNDS interleaved rounds; the lowest median wins. On the H200 kernel timings vary
FINAL_ROUNDS = 3     # 4-7 %: one timing each could keep a tile 4-9 % slower than the best


def pick_config(cache: ConfigCache, key: str, configs: list[Config],
                time_fn: Callable[[Config], float], meta: dict | None = None,
                check: Callable[[Config], object] | None = None) -> Config:
    """Cached winner for ``key``: the cache file's, else the shipped table's (``seed_entry``: ``check(config)`` runs
    it once first), else time every candidate (``time_fn`` -> ms; an exception such as out-of-resources counts as
    infinitely slow), store the fastest and return it. The timing is a ``kernel.tuned.progress`` task (logged)."""
    hit = cache.get(key, seed=False)
    if hit is not None:
        return hit
    hit = seed_entry(cache, key, check, configs)
    if hit is not None:
        return hit
    from .tuned import progress
    n = len(configs)
    with progress.task("GEMM", progress.gemm_label(key), f"{n} candidate{'s' if n != 1 else ''}", cache.path):
        return _tune(cache, key, configs, time_fn, meta)


def seed_entry(cache, key: str, check: Callable[[Config], object] | None = None,
               configs: list[Config] | None = None) -> Config | None:
    """The shipped table's config of ``key`` (``cache.seed_get``) where it may run here, else None (then it is
    tuned): its ``S8`` / ``PERSIST`` flags must be offered by one of ``configs`` (the current switches' and
    Triton's candidates, when given), and ``check(config)`` (one build and launch) must not raise. A failed entry
    is refused for the process; the first failure of a cache is logged as a warning, later ones at debug level."""
    hit = cache.seed_get(key) if hasattr(cache, "seed_get") else None
    if hit is None:
        return None
    if configs is not None and not all(any(c.get(f) for c in configs) for f in ("S8", "PERSIST") if hit.get(f)):
        cache.refuse_seed(key)
        return None
    if check is not None:
        try:
            check(hit)
        except Exception as e:  # noqa: BLE001 - whatever stops it from building or running: tune the shape
            cache.refuse_seed(key)
            first, cache._seed_failed = not getattr(cache, "_seed_failed", False), True
            log.log(logging.WARNING if first else logging.DEBUG,
                    "INT8 autotune: the shipped config of %s failed here (%s: %s); tuning it%s", key,
                    type(e).__name__, str(e)[:300], " (shipped configs that fail later are tuned too, logged at debug "
                    "level)" if first else "")
            return None
    return hit


def tune_now(cache, key: str, configs: list[Config], time_fn, meta=None) -> Config:
    """Times every one of ``configs`` (``pick_config``'s rule: the close ones again, interleaved), stores the winner
    under ``key`` and returns it: a background job's timing (``kernel.retune``), which the widget does not show."""
    return _tune(cache, key, configs, time_fn, meta)


def _tune(cache, key: str, configs: list[Config], time_fn, meta) -> Config:
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
