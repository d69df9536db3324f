"""Prepared calls: the kernel launches of one checked call, re-issued for later calls whose operands have the same
signature.

Why: on the H200 machine's host (bench/host_int8.py) one W8A8 linear of a small problem cost 93 us through
``int8_linear`` (operand checks, output allocations, config lookup, launch-key building, two launches) and 122-128 us
through an ``Int8Linear`` or a fused block, against 48 us for its three allocations and two raw launches and 25 us
for a bf16 ``F.linear``. A small linear's speed is its host time.

A :class:`Plan` is built from the launches ``kernel.launch.record`` saw during one checked call (``build``). Each
tensor argument of those launches must be one of the call's operands or one of the tensors the call allocated;
everything else (integers: shapes, strides; constexprs; grids; the compiled kernels; a buffer its launcher keeps
across calls, ``launch.keep``) is kept. A TMA descriptor argument over such a tensor is made again, with the same
shape, strides and block, over the later call's tensor. A later call passes
its operands; the plan compares each operand's signature — dtype, shape, strides, device and 16-byte alignment,
everything the recorded integers and the compiled kernels depend on — with the recorded one, allocates the
temporaries and re-issues the launches with the new tensors. Any difference returns None, and the caller runs the
checked path (which may build a new plan). Results are bit-identical to the checked call's: same kernels, same
configs, same arguments.

Two users: ``quant.linear.Int8Linear`` keeps a plan per call shape (its INT8 linear and its fused blocks' GEMMs);
:func:`call` keeps one per argument key for the fused blocks' row kernels (quantizers, norm · modulation, GELU,
SwiGLU), whose views of their operands are mapped by address.

A launch hook (a profiler) makes the plan launch through Triton's ``JITFunction.run``, as ``kernel.launch`` does;
on the CPU interpreter every launch goes through Triton (the tests run plans there).
"""
from __future__ import annotations

import torch

from . import launch


def signature(t: torch.Tensor | None):
    """What a plan requires of an operand to repeat a recorded launch with it (None for an absent operand)."""
    if t is None:
        return None
    return t.dtype, t.shape, t.stride(), t.device, t.data_ptr() & 15 == 0


class Plan:
    """Launches recorded from one checked call; ``plan(*operands)`` -> the result, or None when an operand's
    signature differs from the recorded call's (then run the checked path)."""
    __slots__ = ("_sigs", "_temps", "_steps", "_result", "_device", "_index")

    def __init__(self, sigs, temps, steps, result, device):
        self._sigs, self._temps, self._steps, self._result = sigs, temps, steps, result
        self._device, self._index = device, device.index if device.type == "cuda" else None

    def __call__(self, *operands):
        sigs = self._sigs
        if len(operands) != len(sigs):
            return None
        for t, sig in zip(operands, sigs):
            if t is None:
                if sig is not None:
                    return None
            elif sig is None or sig != (t.dtype, t.shape, t.stride(), t.device, t.data_ptr() & 15 == 0):
                return None
        return self._run(operands)

    def _run(self, operands):
        """The launches with ``operands`` (signatures already matched) and new temporaries; the result."""
        dev = self._device
        vals = list(operands)
        for shape, dtype in self._temps:
            vals.append(torch.empty(shape, dtype=dtype, device=dev))
        hooked = None
        for st in self._steps:
            jit_fn, grid, template, subs, compiled, tail, constexprs, warps, stages = st
            args = list(template)
            for pos, slot, desc in subs:
                args[pos] = vals[slot] if desc is None else launch.descriptor_over(vals[slot], *desc)
            if compiled is not None:
                if hooked is None:
                    import triton
                    hooked = launch.launch_hooked(triton.knobs.runtime)
                    stream = None if hooked else torch._C._cuda_getCurrentRawStream(self._index)
                if not hooked:
                    n = len(grid)
                    compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream,
                                 compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)
                    continue
            jit_fn[grid](*args, **constexprs, num_warps=warps, num_stages=stages)
        r = self._result
        if type(r) is int:
            return vals[r]
        return None if r is None else tuple(None if i is None else vals[i] for i in r)


def build(launches: list, operands: tuple, temps: tuple, result, device: torch.device, by_address: bool = False):
    """A :class:`Plan` repeating ``launches`` (``kernel.launch.record``'s entries of one call), or None when that
    call cannot be repeated this way (no launch; a tensor argument that is neither an operand nor a temporary, e.g.
    a converted copy).

    ``operands``: the call's inputs in the order the plan will take them, each a tensor, None, or a pair
    (what callers will pass, what the kernels received) when the kernels saw a view of the caller's tensor that
    starts at the same address (``x`` and its ``reshape(-1, K)``: the signature of ``x`` fixes the view's strides).
    ``temps``: the tensors the call allocated (contiguous), each a tensor or a pair (tensor, the shape to allocate
    it with: same elements, e.g. [..., N] for an [M, N] output). ``result``: the temporary or operand the plan
    returns, a tuple of temporaries, operands and Nones, or None (a call that writes into its operands only).
    ``by_address``: a launch argument that is none of these but starts at the address of exactly one operand, with
    its dtype, is taken as a view of it made by the call (a reshape of a [B, 1, K] modulation row to [B, K]): sound
    for calls whose views are functions of their operands' signatures, which the recorded integers then hold."""
    if not launches or launch.dry_run():
        return None
    slots, sigs = [], []
    for op in operands:
        caller, seen = op if isinstance(op, tuple) else (op, op)
        if caller is not None and (seen is None or seen.data_ptr() != caller.data_ptr()):
            return None
        slots.append(seen)
        sigs.append(signature(caller))
    ptrs = [t.data_ptr() for t in slots if t is not None]
    if len(set(ptrs)) != len(ptrs):  # aliased operands: the launches could not tell which one to take later
        return None
    alloc = []
    for tmp in temps:
        t, shape = tmp if isinstance(tmp, tuple) else (tmp, tmp.shape)
        if not t.is_contiguous() or t.numel() != _numel(shape) or t.device != device:
            return None
        slots.append(t)
        alloc.append((tuple(shape), t.dtype))
    if result is None:  # the call wrote into its operands only
        result_slot = None
    elif isinstance(result, tuple):
        result_slot = tuple(None if r is None else _slot(slots, r) for r in result)
        if any(i is None and r is not None for i, r in zip(result_slot, result)):
            return None
    else:
        result_slot = _slot(slots, result)
        if result_slot is None:
            return None
    steps = []
    for ln in launches:
        subs, template = [], list(ln.args)
        for pos, a in enumerate(ln.args):
            desc = None
            if launch.is_descriptor(a):  # a TMA descriptor: made again over the new tensor, same layout
                desc = (type(a), a.shape, a.strides, a.block_shape, a.padding)
                a = a.base
            if isinstance(a, torch.Tensor):
                slot = _slot(slots, a)
                if slot is None and by_address:
                    slot = _view_of(slots[:len(operands)], a)
                if slot is None:
                    if launch.kept(a) and desc is None:  # a launcher's own buffer (launch.keep): the plan holds it
                        continue
                    return None
                subs.append((pos, slot, desc))
                template[pos] = None  # the plan holds no other tensor of the recorded call
        steps.append((ln.jit_fn, tuple(ln.grid), tuple(template), tuple(subs), ln.compiled, ln.tail,
                      ln.constexprs, ln.num_warps, ln.num_stages))
    return Plan(tuple(sigs), tuple(alloc), tuple(steps), result_slot, device)


def _view_of(ops: list, t: torch.Tensor) -> int | None:
    """The one operand that ``t`` starts at, with ``t``'s dtype and device; None when none or several do."""
    hits = [i for i, o in enumerate(ops) if o is not None and o.data_ptr() == t.data_ptr() and o.dtype == t.dtype
            and o.device == t.device]
    return hits[0] if len(hits) == 1 else None


# --------------------------------------------------------------------------- plans keyed by the call itself
_CALLS: dict = {}      # (fn, argument key) -> Plan, or False when the call cannot be planned
_MAX_CALLS = 4096


def call(fn, *args, salt=()):
    """``fn(*args)`` for a kernel wrapper that only checks its arguments, allocates its outputs with ``torch.empty``
    and launches (launches alone do the work whenever it launches at all): the first call of each argument key
    — every tensor's signature, every other argument's value — runs ``fn`` and records a plan; later calls of the
    key re-issue it. Results are the wrapper's outputs, operands it wrote in place, or None; a result that is
    none of these (a view made after the launches) or a launch argument that is no operand, output or view of one
    leaves the key unplanned: ``fn`` runs each time. The same tensor object passed twice (``out=x`` for in place)
    is one operand, and that pattern is part of the key. ``salt``: whatever else ``fn`` reads to choose its launches
    (``kernel.ops.tunables()``), part of the key."""
    ops = [a for a in args if isinstance(a, torch.Tensor) or a is None]
    key = (fn, salt, *[(a.dtype, a.shape, a.stride(), a.device, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor)
                 else a for a in args])
    ids = [id(a) for a in ops if a is not None]
    if len(set(ids)) != len(ids):  # one object passed twice: one operand, the pattern keyed
        key = (*key, tuple(ids.index(i) for i in ids))
        ops = [a for i, a in enumerate(ops) if a is None or not any(b is a for b in ops[:i])]
    p = _CALLS.get(key)
    if p:
        return p._run(ops)  # the key matched them
    if p is False or launch.dry_run():  # kernel.ahead's dry run: launches compile, nothing is recorded
        return fn(*args)
    with launch.record() as rec:
        out = fn(*args)
    res = out if isinstance(out, tuple) else (out,)
    temps = tuple(t for t in res if isinstance(t, torch.Tensor) and _slot(ops, t) is None)
    p = None
    devs = [t.device for t in (*temps, *ops) if t is not None]
    if all(t is None or isinstance(t, torch.Tensor) for t in res) and devs:
        p = build(rec, tuple(ops), temps, out, devs[0], by_address=True)
    if len(_CALLS) >= _MAX_CALLS:
        _CALLS.clear()
    _CALLS[key] = p if p is not None else False
    return out


def _slot(slots: list, t) -> int | None:
    for i, s in enumerate(slots):
        if s is t:
            return i
    return None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
