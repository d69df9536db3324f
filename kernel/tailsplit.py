"""The tail split of the INT8 GEMMs: the tiles of a GEMM's last partial wave run in K pieces, so they keep more SMs
busy; the same int32 sums, the same output bits.

``tail_layout`` decides the pieces of one launch, ``split_launch`` gives a launch its programs and scratch buffers,
``choose_split`` times the split against whole tiles once per shape (kept in the autotune file). The jitted helpers
(``program_tile``, ``tile_sum``, ``sum_pieces``) are what the GEMM kernels of ``kernel.gemm`` call for it: a piece
stores its exact int32 partial and the last piece of a tile to finish sums them and runs the epilogue. Importing
this module imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import keep
from .quantize import sm_count


@triton.jit
def program_tile(a_ptr, w_ptr, DP_TILES, K_PIECE, K, stride_ak, stride_wk, SPLIT: tl.constexpr):
    """(tile, A and W at the program's first K element, its K elements): the program's whole tile without the
    split, else its piece (``split_piece``)."""
    if SPLIT > 1:
        tile, k_lo, k_len = split_piece(tl.program_id(0), DP_TILES, K_PIECE, K, SPLIT)
        a_ptr += k_lo * stride_ak
        w_ptr += k_lo * stride_wk
    else:
        tile = tl.program_id(0)
        k_len = K
    return tile, a_ptr, w_ptr, k_len


@triton.jit
def tile_sum(acc, tile, part_ptr, cnt_ptr, DP_TILES, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             SPLIT: tl.constexpr):
    """(the tile's int32 sum, whether this program runs the tile's epilogue): the program's own ``acc`` and True
    without the split or for a whole tile; for a piece, ``sum_pieces``."""
    if SPLIT > 1:
        finish = tile < DP_TILES
        if tile >= DP_TILES:
            acc, finish = sum_pieces(acc, part_ptr, cnt_ptr, tile - DP_TILES,
                                     (tl.program_id(0) - DP_TILES) % SPLIT, BLOCK_M, BLOCK_N, SPLIT)
    else:
        finish = True
    return acc, finish


@triton.jit
def split_piece(pid, DP_TILES, K_PIECE, K, SPLIT: tl.constexpr):
    """(tile, first K element, K elements) of program ``pid`` under the tail split: a whole tile below DP_TILES,
    else piece (pid - DP_TILES) % SPLIT of tail tile DP_TILES + (pid - DP_TILES) // SPLIT."""
    split = pid >= DP_TILES
    q = tl.maximum(pid - DP_TILES, 0)
    tile = tl.where(split, DP_TILES + q // SPLIT, pid)
    k_lo = tl.where(split, (q % SPLIT) * K_PIECE, 0).to(tl.int64)
    return tile, k_lo, tl.where(split, tl.minimum(K - k_lo, K_PIECE), K)


@triton.jit
def sum_pieces(acc, part_ptr, cnt_ptr, t, piece, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SPLIT: tl.constexpr):
    """Tail tile ``t``'s piece ``piece``: stores its partial, counts itself in; (the tile's int32 sum, True) for
    the piece that counts last, else (acc, False). The counter is left at 0 for the next launch."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    base = part_ptr + t.to(tl.int64) * (SPLIT * BLOCK_M * BLOCK_N)
    tl.store(base + piece * (BLOCK_M * BLOCK_N) + offs, acc)
    tl.debug_barrier()  # every thread's partial is written before the release below publishes it
    last = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
    if last:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for p in range(0, SPLIT):  # a loop (not unrolled: one partial in registers at a time); L2 reads (.cg)
            acc += tl.load(base + p * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
        tl.store(cnt_ptr + t, 0)
    return acc, last


def tail_layout(tiles: int, slots: int, split: int, k_blocks: int) -> tuple[int, int, int]:
    """The tail split of a GEMM of ``tiles`` output tiles on a GPU that runs ``slots`` programs at once:
    (whole-tile programs, pieces a tail tile, BLOCK_K steps a piece).

    The tiles past the last full wave (``tiles % slots`` of them) would run as a partial wave with most slots
    idle; each is cut along K into ``split`` pieces, at most as many as keep every piece in that one wave
    (``slots // tail``) and as there are K steps, none empty. No tail, or no room for 2 pieces a tile: (tiles, 1,
    k_blocks), the plain launch."""
    waves, tail = divmod(tiles, slots)
    split = min(split, slots // tail if tail else 1, k_blocks)
    if split < 2 or waves == 0:
        return tiles, 1, k_blocks
    per = -(-k_blocks // split)
    return waves * slots, -(-k_blocks // per), per


_SLOTS: dict[tuple, int] = {}       # (device index, tile config) -> programs the GPU runs at once


def program_slots(cfg: dict, device: torch.device) -> int:
    """How many programs of this config the GPU runs at once: SMs x CTAs an SM, bounded by the config's shared
    memory, its threads and its registers (128 a thread assumed: sm_90 builds the 8-warp 128 x 128 tile with
    119); a persistent config (``PERSIST``): a program an SM. The interpreter: 4."""
    if device.type != "cuda":
        return 4
    if cfg.get("PERSIST"):
        return sm_count(device)
    key = (device.index, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg["num_stages"])
    n = _SLOTS.get(key)
    if n is None:
        props = torch.cuda.get_device_properties(device)
        # NOTE: older torch builds lack some of these properties: then one CTA an SM is assumed where unknown
        n = _SLOTS[key] = sm_count(device) * ctas_per_sm(cfg, getattr(props, "shared_memory_per_multiprocessor", 0),
                                                          getattr(props, "regs_per_multiprocessor", 0),
                                                          getattr(props, "max_threads_per_multi_processor", 0))
    return n


def ctas_per_sm(cfg: dict, smem: int, regs: int, threads: int) -> int:
    """CTAs of ``cfg`` an SM holds at once (at least 1), bounded by its shared memory (``autotune.smem_bytes`` + 1 KB
    a CTA), registers (128 a thread assumed) and threads; one where any of them is given as 0 (unknown)."""
    from .autotune import smem_bytes
    t = 32 * cfg["num_warps"]
    return max(1, min(have // need if have else 1
                      for have, need in ((smem, smem_bytes(cfg) + 1024), (regs, t * 128), (threads, t))))


def split_maxnreg(ctas: int, num_warps: int) -> int | None:
    """The register cap (``maxnreg``) of a tail-split launch at ``ctas`` CTAs an SM of ``num_warps`` warps: the plain
    build's occupancy kept; None where it would not bind (255 or more)."""
    regs = 65536 // (ctas * 32 * num_warps) // 8 * 8
    return regs if regs < 255 else None


_SCRATCH: dict[tuple, tuple] = {}   # (device index, stream) -> (partials int32, counters int32, all zero)


def scratch(device: torch.device, partials: int, counters: int):
    """The tail split's buffers on this device and stream: int32 partials and per-tile counters (zero; every
    launch leaves them zero). Grown as needed, never shrunk; a launch on another stream gets its own pair. A plan
    (``kernel.plan``) keeps the pair its recorded launch used: it re-issues on the stream it was built on."""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    have = _SCRATCH.get(key)
    if have is None or have[0].numel() < partials or have[1].numel() < counters:
        p = max(partials, have[0].numel() if have else 0)
        c = max(counters, have[1].numel() if have else 0)
        have = _SCRATCH[key] = (keep(torch.empty(p, dtype=torch.int32, device=device)),
                                keep(torch.zeros(c, dtype=torch.int32, device=device)))
    return have


def split_launch(cfg: dict, tiles: int, k: int, device: torch.device, unused: torch.Tensor):
    """The tail split of one launch of ``tiles`` tiles with ``cfg`` (``cfg["SPLIT"]``, default 1): (programs,
    whole-tile programs, K elements a piece, pieces a tail tile, partials, counters, extra launch options). The plain
    launch: (tiles, tiles, 0, 1, unused, unused, {}). A persistent kernel's programs (one a slot, ``program_slots``) loop
    over the whole tiles first, then run the pieces."""
    bk = cfg["BLOCK_K"]
    if cfg.get("SPLIT", 1) > 1:
        slots = program_slots(cfg, device)
        dp, split, per = tail_layout(tiles, slots, cfg["SPLIT"], -(-k // bk))
        if split > 1:
            part, cnt = scratch(device, (tiles - dp) * split * cfg["BLOCK_M"] * cfg["BLOCK_N"], tiles - dp)
            # The pieces' sum would take the sm_90 build from 119 to 176 registers a thread at 8 warps (one CTA
            # an SM); capped at the plain build's occupancy it spills a few words at most (tests/test_fused.py).
            opts = {}
            if device.type == "cuda":
                regs = split_maxnreg(slots // sm_count(device), cfg["num_warps"])
                opts = {"maxnreg": regs} if regs else {}
            return dp + (tiles - dp) * split, dp, per * bk, split, part, cnt, opts
    return tiles, tiles, 0, 1, unused, unused, {}


TAIL_SPLITS = (2, 3, 4)   # the pieces a tail tile is timed with (``choose_split``)
SPLIT_MARGIN = 0.02       # ... and how much faster than whole tiles a split must time to be chosen
SPLIT_ROUNDS = 3          # ... as the median of this many interleaved rounds: on the H200 one launch's time varies
                          # by up to 7 % between processes, as much as a split gains, so one timing each would pick
                          # splits that another process does not repeat


def choose_split(cfg: dict, m: int, n: int, k: int, slots: int, cache, time_fn, meta=None, check=None,
                 tune: str = "first_call", may_build=None, later=None) -> dict:
    """``cfg``, or ``cfg`` with the tail split (``SPLIT``) that timed (``time_fn(config)`` -> ms; the median of
    ``SPLIT_ROUNDS`` interleaved rounds) at least ``SPLIT_MARGIN`` faster than whole tiles for this many row tiles
    on a GPU running ``slots`` programs at once (on the H200 2-8 % faster on some block shapes, slower on others).
    Decided once per (N, K, M bucket, row tiles) and kept in ``cache`` (an ``autotune.ConfigCache``: the tile
    configs' file), else taken from the shipped table (``autotune.seed_entry``; ``check(config)`` runs it
    once first). ``tune`` (``kernel.deferred.mode()``) other than ``first_call``: nothing is timed here; without an
    entry the call runs whole tiles and ``later("split", cfg)`` times the split between samples; a shipped split
    that ``may_build(config)`` does not allow (a kernel this process has not built, on a call whose row class already
    runs) waits for that job too."""
    from . import autotune
    tiles_m = -(-m // cfg["BLOCK_M"])
    tiles, kb = tiles_m * -(-n // cfg["BLOCK_N"]), -(-k // cfg["BLOCK_K"])
    layouts = {}
    for s in TAIL_SPLITS:
        lay = tail_layout(tiles, slots, s, kb)
        if lay[1] > 1 and lay not in layouts.values():
            layouts[s] = lay
    if not layouts:
        return cfg
    key = autotune.ConfigCache.key(n, k, autotune.m_bucket(m), bool(cfg.get("S8")), bool(cfg.get("PERSIST")))
    key = f"{key}_T{tiles_m}_split"
    hit = cache.get(key, seed=False)
    if hit is None and tune != "first_call":
        seed = cache.seed_get(key) if hasattr(cache, "seed_get") else None
        if seed is not None and (seed.get("SPLIT", 1) <= 1 or may_build is None
                                 or may_build({**cfg, "SPLIT": seed["SPLIT"]})):
            hit = autotune.seed_entry(cache, key, check and (lambda h: h["SPLIT"] > 1 and check({**cfg, **h})))
        if hit is None:
            if later is not None:
                later("split", cfg)
            return cfg
    if hit is None:
        hit = autotune.seed_entry(cache, key, check and (lambda h: h["SPLIT"] > 1 and check({**cfg, **h})))
    if hit is None:
        from .tuned import progress
        with progress.task("tail split", progress.gemm_label(key), f"{len(layouts) + 1} variants", cache.path):
            med = autotune.interleaved_medians({1: cfg, **{s: {**cfg, "SPLIT": s} for s in layouts}}, time_fn,
                                               SPLIT_ROUNDS)
        best, best_ms = 1, med.pop(1) * (1 - SPLIT_MARGIN)
        for s, ms in med.items():  # the splits that built
            if ms < best_ms:
                best, best_ms = s, ms
        hit = {"SPLIT": best}
        cache.put(key, hit, meta)
    s = int(hit.get("SPLIT", 1))
    return {**cfg, "SPLIT": s} if s > 1 else cfg
