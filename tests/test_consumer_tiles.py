"""The consumer tile set's bench (bench/checks/consumer_tiles.py, issue 36 item 2) in the interpreter on tiny shapes: every
tile Ampere / Ada / sm_120 may pick run explicitly, int32 bit-exact against an int64 matmul, the INT8 linear through
the forced generation's pick within one bf16 rounding of the dequantized exact product; and the bench hook
(``kernel.gemm.forced_generation``): the switches carry the forced capability (so no prepared call crosses it), the
s8 wgmma path is off, the tile set is that generation's at its shared-memory limit, and it all resets on leaving."""
from __future__ import annotations

import json

import pytest
import torch

import kernel
from kernel import autotune, config

pytestmark = pytest.mark.interpreter


def test_forced_generation_hook():
    from kernel import gemm, s8wgmma
    base = kernel.gemm_switches()
    assert base[:2] == (config.get("INT8_FUSED_S8_WGMMA"), None)
    with gemm.forced_generation((8, 9)):
        sw = kernel.gemm_switches()
        assert sw[:2] == (base[0], (8, 9))
        assert gemm._generation(torch.device("cpu"), sw[1]) == ((8, 9), None)
        assert not s8wgmma.usable(torch.device("cuda", 0))
        cands = autotune.candidates(*gemm._generation(torch.device("cpu"), sw[1]), 4096)
        assert cands == autotune.target_candidates((8, 9))["large"]
        assert not any(c.get("S8") for c in cands)
    assert kernel.gemm_switches() == base


def test_consumer_tiles_cpu_smoke(tmp_path):
    from bench.checks import consumer_tiles
    out = tmp_path / "consumer.json"
    assert consumer_tiles.main(["--cpu-smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["capability"] == [8, 9] and res["all_int32_exact"] is True
    assert set(res["same_set_on"]) == {"sm_86", "sm_89", "sm_120"}
    ran = {t["tile"] for t in res["tiles"]}
    every = {consumer_tiles._tile_text(c) for cs in autotune.target_candidates((8, 9)).values() for c in cs}
    assert ran == every  # every tile of the set, run on a shape of its bucket
    assert all(t["int32_exact"] for t in res["tiles"])
    for r in res["rows"]:
        assert r["int32_exact"] and r["bf16_max_err_ulps"] <= 1.0, r  # one bf16 rounding
    assert [r["M"] for r in res["rows"]] == [1, 3, 33, 200]
