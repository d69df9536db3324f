"""One fetch of a fused block's ComfyUI-managed weights per block call (``quant.blocks.FetchedBlock``,
``nodes/comfy_cast.fetch_block``).

On the CPU: the block's contract with the installed fetch (called once per call with the device of the block's
first tensor argument, released after the forward, also when the forward raises; a plain call when there is
nothing to fetch), every fused block class of the adapters built on it, and, in ComfyUI 0.33.0, the two ComfyUI
functions ``fetch_block`` calls with the parameters it passes, and that it fetches nothing where DynamicVRAM does
not manage the weights (an Apply'd Ideogram 4 loaded on the CPU). DynamicVRAM itself needs a GPU: the
H200 rows of bench/RESULTS.md compare the pack with per-layer fetches bit for bit and count the modules fetched per
step.

Run: .runtime/venv/bin/python -m pytest tests/test_block_fetch.py -q
"""
import importlib

import pytest
import torch
from torch import nn

from quant import blocks as qf
from quant import linear as L


class _Block(qf.FetchedBlock):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x, scale=1.0, fail=False):
        if fail:
            raise RuntimeError("forward failed")
        return self.lin(x) * scale


@pytest.fixture
def recorder():
    calls = []

    def fetch(block, device):
        calls.append(("fetch", block, device))
        return lambda: calls.append(("release", block, device))
    prev = L.block_fetch()  # the pack's nodes may have installed ComfyUI's (one quant.linear in the session)
    L.set_block_fetch(fetch)
    try:
        yield calls
    finally:
        L.set_block_fetch(prev)


def test_fetch_once_per_call_and_release_after_the_forward(recorder):
    blk = _Block()
    x = torch.randn(3, 8)
    seen = []
    blk.register_forward_hook(lambda m, a, y: seen.append(len(recorder)))  # inside the fetch / release pair
    y = blk(x, 2.0)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, blk.lin.weight, blk.lin.bias) * 2.0,
                               rtol=0, atol=0)
    assert [c[0] for c in recorder] == ["fetch", "release"] and seen == [1]
    assert all(c[1] is blk and c[2] == x.device for c in recorder)
    blk(x=x)  # the first tensor of the keywords when there are no positional arguments
    assert [c[0] for c in recorder[2:]] == ["fetch", "release"]


def test_release_runs_when_the_forward_raises(recorder):
    with pytest.raises(RuntimeError, match="forward failed"):
        _Block()(torch.randn(2, 8), fail=True)
    assert [c[0] for c in recorder] == ["fetch", "release"]


def test_plain_call_without_a_fetch():
    blk = _Block()
    x = torch.randn(2, 8)
    ref = blk.lin(x)
    calls = []
    prev = L.block_fetch()
    L.set_block_fetch(lambda b, d: calls.append(d))  # returns None: nothing fetched, nothing to release
    try:
        torch.testing.assert_close(blk(x), ref, rtol=0, atol=0)
        L.set_block_fetch(None)
        torch.testing.assert_close(blk(x), ref, rtol=0, atol=0)  # none installed (plain torch)
    finally:
        L.set_block_fetch(prev)
    assert calls == [x.device]


def test_every_fused_block_is_a_fetched_block():
    from adapters import ideogram4
    from adapters import flux, lumina2, wan
    for cls in (ideogram4.FusedIdeogram4Block, flux.FusedFluxDoubleBlock, flux.FusedFluxSingleBlock,
                lumina2.FusedLumina2Block, wan.FusedWanBlock):
        assert issubclass(cls, qf.FetchedBlock), cls


def test_fetch_block_in_current_comfy(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    assert res["cast_all_params"] == ["comfy_modules", "dtype", "device", "bias_dtype", "non_blocking",
                                      "return_faulted"]
    assert res["cleanup_params"] == ["module", "comfy_modules"]
    assert res["installed"] and res["fused_blocks"] == 1 and res["managed_modules"] >= 4
    assert res["fetched"] == {"cpu": False, "meta": False} and res["stats"] == {"blocks": 0, "modules": 0}


def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    import inspect

    import comfy.model_prefetch
    import comfy.ops
    import comfy.sd
    i4 = importlib.import_module("comfyui_int8_fused.adapters.ideogram4.layout")
    lin = importlib.import_module("comfyui_int8_fused.quant.linear")
    fused = importlib.import_module("comfyui_int8_fused.quant.blocks")
    cc = pack.nodes.comfy_cast
    from comfy_harness import narrow_ideogram4
    model = comfy.sd.load_diffusion_model_state_dict(i4.random_state_dict(1, narrow_ideogram4(), seed=3),
                                                     {"dtype": torch.bfloat16})
    (q,) = pack.nodes.apply.ApplyFusedInt8GEMM().apply(model, "fused_triton")
    q.patch_model(torch.device("cpu"))
    blocks = [m for m in q.model.diffusion_model.modules() if isinstance(m, fused.FetchedBlock)]
    managed = [m for b in blocks for m in b.modules() if hasattr(m, "comfy_cast_weights")]
    # no DynamicVRAM on the CPU (no module has ComfyUI's vbar ``_v``): nothing to fetch on any device
    fetched = {d: cc.fetch_block(blocks[0], torch.device(d)) is not None for d in ("cpu", "meta")}
    return {"cast_all_params": list(inspect.signature(comfy.ops.cast_modules_with_vbar).parameters),
            "cleanup_params": list(inspect.signature(comfy.model_prefetch.cleanup_prefetched_modules).parameters),
            "installed": lin.block_fetch() is cc.fetch_block, "fused_blocks": len(blocks),
            "managed_modules": len(managed), "fetched": fetched, "stats": dict(cc.stats)}
