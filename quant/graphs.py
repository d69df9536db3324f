"""CUDA graphs for fused blocks (``INT8_FUSED_CUDA_GRAPHS=1``, opt-in): the host issues one replay per block
instead of its few dozen kernel launches and the Python around them.

Used by the fused blocks of Flux.1 (``quant/fused_flux.py``) and Ideogram 4 (``adapters/ideogram4.py``).
Why: Flux.1's fused step is paced by the host (bench/RESULTS.md, runs x and y: the GPU catches up with the host
by the end of each step; its kernels take ~91 ms a step, the host 105-115 ms), so a faster host path is a faster
step.

How (``BlockGraphs.run``), per call of a block with tensor inputs ``inputs``:
1. Fetch every weight ComfyUI manages in the block through ComfyUI's own cast (``linear.comfy_cast``: DynamicVRAM
   faults it in and pins it for the call, exactly as the eager block's layers do), and read the address of every
   tensor the block's kernels read: fetched weights and the block's other parameters and buffers. A captured graph
   only replays when every address is the one it was captured with; otherwise the block runs eagerly (a weight
   ComfyUI moved, evicted and re-placed, or patched).
2. The first call of an input signature (shapes, dtypes, strides, device) runs eagerly, on the capture stream: it
   autotunes, times the dispatch and attention choices, warms the caches and that stream's cuBLAS workspace, so
   capture sees no host synchronisation and allocates nothing that outlives it.
3. The second call captures ``fn`` on static copies of the inputs (on the one capture stream; a pool shared by
   every block of the process: their temporaries reuse one region), then replays.
4. Later calls copy the inputs into the static inputs, replay, and return copies of the static outputs (a caller
   that keeps an output across steps never sees it overwritten).
The weights are released (ComfyUI's uncast) after the replay is queued, as the eager layers release theirs.
A capture that fails (an operation CUDA graphs cannot record) turns graphs off for that block, logged once; the
block then runs eagerly as without the switch. Graphs are not used under torch.compile, inside another capture or
off CUDA.
"""
from __future__ import annotations

import gc
import logging
from typing import Callable

import torch
from torch import nn

from . import kernel_module, linear

config = kernel_module("config")
log = logging.getLogger("int8_fused")

_POOLS: dict = {}    # device -> graph memory pool shared by every captured block (their temporaries alias)
_STREAMS: dict = {}  # device -> the one stream every capture and warm-up of the process runs on


def _pool(device: torch.device):
    if device not in _POOLS:
        _POOLS[device] = torch.cuda.graph_pool_handle()
    return _POOLS[device]


def _stream(device: torch.device) -> torch.cuda.Stream:
    """The capture stream. One for every capture, with the warm-up calls on it too: cuBLAS keeps a workspace per
    stream, and a workspace first made inside a capture and freed outside it aborts the process under the
    cudaMallocAsync allocator ComfyUI selects (bench/graph_probe.py on the H200: a new side stream per capture
    aborts at the second capture; one warmed stream captures and replays bit-exactly)."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device=device)
    return _STREAMS[device]


def _on_capture_stream(device: torch.device, fn: Callable, inputs: tuple):
    """``fn(*inputs)`` eagerly on the capture stream, ordered after and before the current stream's work."""
    main, side = torch.cuda.current_stream(device), _stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn(*inputs)
    main.wait_stream(side)
    return out


def _flat(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _like(out, tensors):
    return type(out)(tensors) if isinstance(out, (tuple, list)) else tensors[0]


class _Fetched:
    """The block's weights held for one call: addresses, and the releases to run after the kernels are queued."""
    __slots__ = ("ptrs", "releases")

    def __init__(self):
        self.ptrs: list = []
        self.releases: list = []

    def release(self) -> None:
        for r in self.releases:
            r()
        self.releases.clear()


def fetch(block: nn.Module, device: torch.device) -> _Fetched | None:
    """Every weight of ``block`` on ``device`` for this call (see module doc), or None when the block cannot be
    graphed now: a weight or bias function (LoRA applied on the fly), a tensor on another device."""
    held = _Fetched()
    cast = linear.comfy_cast()
    try:
        for m in block.modules():
            d = m.__dict__
            if d.get("weight_function") or d.get("bias_function") or d.get("weight_lowvram_function") \
                    or d.get("bias_lowvram_function"):
                held.release()
                return None
            managed = d.get("comfy_cast_weights", getattr(type(m), "comfy_cast_weights", False))
            w = m._parameters.get("weight")
            if managed and cast is not None and w is not None:
                w, b, release = cast(m, device)
                held.releases.append(release)
                held.ptrs += [w.data_ptr(), None if b is None else b.data_ptr()]
                skip = ("weight", "bias")
            else:
                skip = ()
            for name, t in list(m._parameters.items()) + list(m._buffers.items()):
                if t is None or name in skip:
                    continue
                if t.device != device:
                    held.release()
                    return None
                held.ptrs.append(t.data_ptr())
    except BaseException:
        held.release()
        raise
    return held


class _Captured:
    __slots__ = ("graph", "inputs", "outputs", "ptrs")

    def __init__(self, graph, inputs, outputs, ptrs):
        self.graph, self.inputs, self.outputs, self.ptrs = graph, inputs, outputs, ptrs


class BlockGraphs:
    """The captured graphs of one block, one per input signature (module doc)."""

    def __init__(self, name: str = ""):
        self.name = name
        self._graphs: dict = {}
        self._seen: set = set()
        self.off: str | None = None   # why graphs are off for this block (capture failed)
        self.replays = 0              # counters for tests and the bench log
        self.captures = 0

    def run(self, block: nn.Module, fn: Callable, inputs: tuple, extra_key=()):
        """``fn(*inputs)`` (tensors, outputs a tensor or a tuple of tensors), replayed from a graph where it can be."""
        x0 = inputs[0]
        if (self.off is not None or x0.device.type != "cuda" or torch.compiler.is_compiling()
                or torch.cuda.is_current_stream_capturing()):
            return fn(*inputs)
        key = (extra_key,) + tuple((t.shape, t.dtype, t.stride(), t.device) for t in inputs)
        held = fetch(block, x0.device)
        if held is None:
            return fn(*inputs)
        try:
            ptrs = tuple(held.ptrs)
            cap = self._graphs.get(key)
            if cap is not None and cap.ptrs == ptrs:
                for s, t in zip(cap.inputs, inputs):
                    s.copy_(t)
                cap.graph.replay()
                self.replays += 1
                return _like(cap.outputs, [o.clone() for o in _flat(cap.outputs)])
            if key not in self._seen:  # first call of this signature: eager on the capture stream (autotune,
                self._seen.add(key)        # dispatch timing, attention probes, the stream's cuBLAS workspace)
                return _on_capture_stream(x0.device, fn, inputs)
            return self._capture(block, fn, inputs, key, ptrs)
        finally:
            held.release()

    def _capture(self, block, fn, inputs, key, ptrs):
        static = tuple(t.clone() for t in inputs)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=_pool(inputs[0].device), stream=_stream(inputs[0].device)):
                outputs = fn(*static)
                # cyclic garbage made during the capture (closures, frames) is freed here, inside it: the
                # gc.collect() of the next capture would free its tensors outside, which aborts the process
                # under the cudaMallocAsync allocator (run z2 on the H200)
                gc.collect()
        except Exception as e:  # noqa: BLE001 - an op a graph cannot record: this block stays eager
            self.off = f"{type(e).__name__}: {e}"[:300]
            log.warning("INT8 CUDA graphs: block %s cannot be captured (%s); it runs without a graph",
                        self.name or type(block).__name__, self.off)
            self._graphs.clear()
            return fn(*inputs)
        self._graphs[key] = _Captured(graph, static, outputs, ptrs)
        self.captures += 1
        graph.replay()  # capture only records: this call's result comes from the first replay
        return _like(outputs, [o.clone() for o in _flat(outputs)])


def run_block(block: nn.Module, fn: Callable, inputs: tuple, attn_mask, transformer_options, training: bool):
    """``fn(*inputs)`` for a fused block's forward; with INT8_FUSED_CUDA_GRAPHS from the block's ``graphs``
    (a :class:`BlockGraphs`) when the call has no mask and is not training. The graph holds the attention route
    of its capture, so the route object is part of the key."""
    if attn_mask is not None or training or not config.get("INT8_FUSED_CUDA_GRAPHS"):
        return fn(*inputs)
    route = transformer_options.get("optimized_attention_override") if isinstance(transformer_options, dict) \
        else None
    return block.graphs.run(block, fn, inputs, extra_key=id(route))
