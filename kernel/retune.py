"""The GEMM side of background timing (``kernel.deferred``): what a shape runs until it is timed, and the jobs that
time it between samples.

A first call of a GEMM shape runs on a config chosen without timing (``kernel.autotune.choose``): the user's cache
entry, the shipped table's, the config this process already runs for the same (N, K, row class), or the predicted
one (``kernel.autotune.predicted``). So a new resolution compiles nothing new: its calls take the class's compiled
config. What is left to time is queued as a job; the job runs on fresh operands of the call's shapes, dtypes and
strides (``spec`` / ``fresh``: it holds no tensor of the model, so nothing stays allocated while it waits), writes
its winner to the cache file like a first-call timing, adds it to the compiled set and makes the next call choose
again (``forget``; ``kernel.config.retune`` makes prepared calls re-plan). The int8 GEMMs accumulate exactly in
int32, so a config switched between samples leaves the output bits as they were.
"""
from __future__ import annotations

import logging

import torch

from . import config, deferred

log = logging.getLogger("int8_fused")

COMPILED: dict[tuple, list] = {}   # (device, kind, N, K, row class, s8, forced) -> configs built in this process


def class_key(device, kind: str, n: int, k: int, cls: str, s8: bool, forced) -> tuple:
    return (device, kind, n, k, cls, s8, forced)


def built_for(ckey: tuple) -> list:
    """The configs this process built for the class, the first one first (empty: nothing yet)."""
    return list(COMPILED.get(ckey, ()))


def built(ckey: tuple, cfg: dict) -> None:
    lst = COMPILED.setdefault(ckey, [])
    if cfg not in lst:
        lst.append(cfg)


def is_built(ckey: tuple, cfg: dict) -> bool:
    return cfg in COMPILED.get(ckey, ())


def spec(t):
    """What ``fresh`` needs to make a stand-in of the tensor ``t``: shape, strides, dtype, device (a spec or None
    as given)."""
    if t is None or isinstance(t, tuple):
        return t
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.device


def fresh(s):
    """A new tensor of ``spec`` ``s`` with values of the kind the GEMMs read (int8 codes, positive scales)."""
    if s is None:
        return None
    shape, stride, dtype, dev = s
    if any(st == 0 for st in stride):   # a broadcast scalar (a scale or bias of stride 0)
        return torch.full((1,), 0.01, dtype=dtype, device=dev).expand(shape)
    t = torch.empty_strided(shape, stride, dtype=dtype, device=dev)
    if dtype == torch.int8:
        t.random_(-127, 128)
    elif dtype == torch.int32:
        t.zero_()
    else:
        t.uniform_(0.5, 1.5).mul_(0.01)
    return t


def forget(memos: list[dict], device, n: int, k: int) -> None:
    """Drops the memoised configs of (device, N, K) from each of ``memos`` (dicts keyed by tuples holding the device,
    N and K among their first four items) and makes prepared calls re-plan, so that the next call chooses again."""
    for memo in memos:
        for key in list(memo):
            head = key[:4]
            if device in head and n in head and k in head:
                memo.pop(key, None)
    config.retune()


def submit(name: str, job) -> bool:
    """Queues ``job(stop)`` under ``name`` for the idle worker (``kernel.deferred.submit``)."""
    return deferred.submit(name, job)


MEMORY_MARGIN = 1 << 30   # bytes a job leaves free on the GPU beyond twice what it allocates


def nbytes(specs) -> int:
    """Bytes the fresh operands of ``specs`` take (an upper bound: strided extents)."""
    total = 0
    for s in specs:
        if s is None:
            continue
        shape, stride, dtype, _ = s
        extent = 1 + sum((d - 1) * st for d, st in zip(shape, stride) if d > 0)
        total += extent * torch.empty((), dtype=dtype).element_size()
    return total


class NoRoom(Exception):
    """The GPU has too little free memory for a job now (another model may be running between samples)."""


def run_on(device, fn, specs=()):
    """``fn()`` with ``device`` current and nothing recorded into a prepared call (a worker thread's timing). Raises
    :class:`NoRoom` (the job is dropped, the config in use stays) unless the GPU has twice the job's operands free
    plus ``MEMORY_MARGIN``: between samples ComfyUI may be decoding or loading another model."""
    from .launch import not_recorded
    with torch.cuda.device(device), not_recorded():
        make_room(device, nbytes(specs))
        return fn()


def make_room(device, job_bytes: int) -> None:
    """Raises :class:`NoRoom` unless ``device`` has ``2 * job_bytes + MEMORY_MARGIN`` free."""
    need = 2 * job_bytes + MEMORY_MARGIN
    free = torch.cuda.mem_get_info(device)[0]
    if free < need:
        raise NoRoom(f"{free >> 20} MiB free, {need >> 20} MiB wanted")
