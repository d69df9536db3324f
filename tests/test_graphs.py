"""quant/graphs.py (INT8_FUSED_CUDA_GRAPHS) on the CPU: what decides whether a captured graph may replay.

A graph replays only when every address its kernels read is the one it was captured with: ``fetch`` collects the
weights ComfyUI manages (through the installed cast, released after the call) and every other parameter and buffer
of the block, and refuses blocks with weight functions (LoRA on the fly) or tensors on another device. Capture and
replay themselves need CUDA: bench/e2e_models.py runs them on the H200 (rows ``%INT8_FUSED_CUDA_GRAPHS=1``, their
output compared bit for bit with the eager pack row). Off CUDA a block runs eagerly, every call. The CPU stands in
for the call's device here.
"""
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import quant.linear as L  # noqa: E402
from quant import graphs  # noqa: E402
from quant.linear import Int8Linear  # noqa: E402

DEV = torch.device("cpu")


def _block():
    blk = nn.Module()
    blk.qkv = Int8Linear.from_float(torch.randn(24, 16), torch.randn(24), name="blk.qkv")
    blk.norm = nn.LayerNorm(16)
    blk.qkv.comfy_cast_weights = True  # ComfyUI manages this one (DynamicVRAM marks every comfy op layer)
    return blk


@pytest.fixture
def cast():
    calls, released = [], []

    def fn(layer, device):
        calls.append(layer.name)
        w = torch.empty(layer.weight.shape, dtype=layer.weight.dtype, device=device)  # ComfyUI's view of it
        return w, None, lambda: released.append(layer.name)

    L.set_comfy_cast(fn)
    yield calls, released
    L.set_comfy_cast(None)


def test_fetch_reads_every_address_and_releases_the_managed_weights(cast):
    calls, released = cast
    blk = _block()
    held = graphs.fetch(blk, DEV)
    assert calls == ["blk.qkv"] and released == []
    # the managed weight through the cast (weight, no bias returned), then qkv's other tensors and the norm's
    own = [t for n, t in blk.qkv._parameters.items() if n not in ("weight", "bias")]
    assert len(held.ptrs) == 2 + len(own) + 2 and held.ptrs[1] is None
    held.release()
    assert released == ["blk.qkv"]
    held.release()                      # idempotent: nothing released twice
    assert released == ["blk.qkv"]


def test_a_replaced_tensor_changes_the_addresses(cast):
    blk = _block()
    a = graphs.fetch(blk, DEV)
    a.release()
    b = graphs.fetch(blk, DEV)
    b.release()
    norm_ptrs = a.ptrs[-2:]
    assert b.ptrs[-2:] == norm_ptrs     # unchanged tensors: same addresses
    blk.norm.weight = nn.Parameter(torch.ones(16))  # ComfyUI swapped a parameter
    c = graphs.fetch(blk, DEV)
    c.release()
    assert c.ptrs[-2] != norm_ptrs[0]


def test_blocks_that_cannot_replay_are_refused(cast):
    calls, released = cast
    blk = _block()
    blk.qkv.weight_function = [lambda w: w]  # a LoRA applied on the fly: its result is not in the graph
    assert graphs.fetch(blk, DEV) is None
    blk.qkv.weight_function = []
    blk.norm.to("meta")                       # a tensor on another device than the call's
    assert graphs.fetch(blk, DEV) is None
    assert released == calls                  # whatever was fetched before refusing is released


def test_off_cuda_every_call_runs_eagerly():
    blk = nn.Linear(4, 4)
    g = graphs.BlockGraphs("blk")
    calls = []

    def fn(x):
        calls.append(1)
        return blk(x)

    x = torch.randn(2, 4)
    for _ in range(3):
        assert torch.equal(g.run(blk, fn, (x,)), blk(x))
    assert len(calls) == 3 and g.captures == 0 and g.replays == 0
