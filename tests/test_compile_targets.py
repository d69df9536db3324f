"""Every kernel the pack can launch compiles for sm_80 / 86 / 89 / 90 / 120 (issue 36 item 1), with Triton's own
target compilation and ptxas, no GPU (tests/compile_targets.py does the compiling, in a subprocess: this
process runs the Triton interpreter). Each target: no failed compile, shared memory within the target's opt-in limit (a GEMM
also within ``autotune.smem_bytes``, the estimate its candidates are filtered by), no register spills
(``compile_targets.SPILL_BOUND`` bytes); every candidate tile of that generation among the compiled ones; sm_90's s8
tiles built through the PTX rewrite. Then the candidate filter itself, a tile past the limit caught by the check,
and sm_90's GEMMs with the oldest and newest Triton requirements.txt admits (3.4.0, 3.9.0 from .runtime/)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

import compile_targets as ct  # noqa: E402
from kernel import autotune  # noqa: E402


pytestmark = pytest.mark.slow  # compiles every kernel for five GPU targets: ~6 min of CPU with an empty Triton cache


def _compile(args: list[str], pythonpath: str | None = None, timeout: int = 1500) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, str(ROOT)) if p)
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "compile_targets.py"), *args, "--json-stdout"],
                       capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _tile(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


_TABLES: dict[int, dict] = {}


def _table(arch: int) -> dict:
    """compile_targets' result for sm_``arch`` (compiled once per test session)."""
    if arch not in _TABLES:
        _TABLES[arch] = _compile(["--targets", str(arch), "--workers", "2"])
    return _TABLES[arch]


def _attn_default(r: dict) -> bool:
    return r["kernel"] == "_attn_int8_kernel" and "(default)" in r["label"]


@pytest.mark.parametrize("arch", sorted(ct.TARGETS))
def test_every_kernel_compiles_for_target(arch):
    """Every kernel for sm_``arch``: compiled, within shared memory, no spills, every candidate tile; then the
    attention's untuned default tile (:func:`_check_attention_default_tile`). One test per target on one compile:
    pytest-xdist gives two tests of a target to two workers, which compiled the same table twice (tests/conftest.py
    ``_one_at_a_time``: its groups do not work with this pytest)."""
    res = _table(arch)
    t = res["targets"][f"sm_{arch}"]
    cap = ct.TARGETS[arch]
    limit = autotune.SMEM_OPTIN[cap]
    rows = t["kernels"]
    failed = [f"{r['label']}: {r['error']}" for r in rows if r.get("error")]
    assert not failed, failed
    for r in rows:
        assert r["regs"] > 0 and r["local_bytes"] <= ct.SPILL_BOUND, f"{r['label']}: {r}"
        assert r["shared"] + r["static_shared"] <= limit, r
        if r["kind"] == "gemm" and "tail split" not in r["label"]:  # the bound the candidates are filtered by
            assert r["shared"] <= autotune.smem_bytes(r["config"]) + autotune.SMEM_HEADROOM, r
    assert res["problems"] == []
    # every tile this generation's autotune may time was compiled as the plain GEMM (the persistent form for those)
    plain = {_tile(r["config"]) for r in rows if r["kernel"] in ("_int8_gemm_kernel", "_int8_gemm_persistent_kernel")}
    for bucket, cfgs in autotune.target_candidates(cap).items():
        for c in cfgs:
            assert _tile(c) in plain, (bucket, c)
    kinds = {r["kernel"] for r in rows}
    assert {"_gemm_swiglu_kernel", "_w8a8_small_m_kernel", "_quant_rows_seg_kernel", "_quant_rows_loop_kernel",
            "_quant_rows_kernel", "_attn_int8_kernel", "_quant_blocks_kernel", "_rmsnorm_modulate_quant_kernel",
            "_layernorm_modulate_quant_kernel", "_swiglu_quant_kernel", "_gated_residual_kernel",
            "_residual_layernorm_kernel", "_concat_gelu_quant_kernel", "_qk_norm_rope_kernel",
            "_hadamard_quant_kernel", "_norm_mod_hadamard_quant_kernel"} <= kinds
    labels = {r["label"] for r in rows}  # ConvRot's rotation alone, after a SwiGLU, after a GELU (+ concatenation)
    assert {f"{w} G{g}" for w in ("hadamard_quantize", "swiglu_hadamard_quantize", "concat_gelu_hadamard_quantize")
            for g in (64, 256)} <= labels
    s8 = [r for r in rows if r.get("config", {}).get("S8")]
    if arch == 90:  # the pack's Triton (3.6): the s8 wgmma rewrite assembles, no fallback
        assert s8 and all(r["s8_rewrite"] for r in s8), [r.get("s8_error") for r in s8]
    else:
        assert not s8
    _check_attention_default_tile(res, arch)


def _check_attention_default_tile(res: dict, arch: int) -> None:
    """``attention8.default_config`` at the target's limit (what ``attention_int8`` runs untuned: ``tune=False``,
    under torch.compile) compiles within the target's shared memory, without spills, for every head dim."""
    rows = [r for r in res["targets"][f"sm_{arch}"]["kernels"] if _attn_default(r)]
    assert len(rows) == len(ct.ATTN_HEAD_DIMS), [r["label"] for r in rows]
    limit = autotune.SMEM_OPTIN[ct.TARGETS[arch]]
    from kernel import attention8
    assert [r["config"] for r in rows] == [attention8.default_config(d, limit, interpret=False)
                                           for d in ct.ATTN_HEAD_DIMS]
    for r in rows:
        assert not r.get("error") and r["shared"] + r["static_shared"] <= limit, r
        assert r["local_bytes"] <= ct.SPILL_BOUND, r


def test_candidates_filtered_by_target_shared_memory():
    big = autotune._cfg(128, 128, 128, 8, 3)  # ampere_configs: 96 KB of stages, 2 CTAs an A100 SM
    assert big in autotune.ampere_configs() and autotune.smem_bytes(big) == 98304
    for cap, limit in autotune.SMEM_OPTIN.items():
        for bucket, cfgs in autotune.target_candidates(cap).items():
            assert cfgs, (cap, bucket)
            for c in cfgs:
                assert autotune.smem_bytes(c) <= limit - 4096, (cap, c)
    assert autotune.SMEM_OPTIN == {(8, 0): 166912, (8, 6): 101376, (8, 9): 101376, (9, 0): 232448, (12, 0): 101376}
    assert big in autotune.candidates((8, 0), None, 4096)
    for cap in ((8, 6), (8, 9), (12, 0)):
        assert big not in autotune.candidates(cap, None, 4096)
        # a device reporting more (the H200's figure, as under forced_generation) is still held to the table's
        assert big not in autotune.candidates(cap, 232448, 4096)
    assert autotune.smem_optin((8, 9), 99 * 1024) == 99 * 1024 and autotune.smem_optin((10, 0), 232448) == 232448
    # the consumer generations share one set, without the s8 tiles
    sets = [autotune.target_candidates(c) for c in ((8, 6), (8, 9), (12, 0))]
    assert sets[0] == sets[1] == sets[2]
    assert not any(c.get("S8") for cs in sets[0].values() for c in cs)
    assert any(c.get("S8") for c in autotune.target_candidates((9, 0))["large"])


_OVER = """
import json, sys
import compile_targets as ct
from kernel import autotune
cfg = autotune._cfg(128, 256, 128, 8, 4)
spec = [j for j in ct.gemm_jobs(86) if j["kernel"] == "_int8_gemm_kernel"][-1]
spec = dict(spec, consts=dict(spec["consts"], BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8), warps=8, stages=4,
            cfg=cfg, label="over", opts={})
row = ct.run_spec(spec, 86)
print(json.dumps({"row": row, "problems": ct.problems({"sm_86": {"kernels": [row]}})}))
"""


def test_tile_past_the_limit_is_caught_and_never_offered():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    r = subprocess.run([sys.executable, "-c", _OVER], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    row = got["row"]
    assert row["error"] is None and row["shared"] > autotune.SMEM_OPTIN[(8, 6)], row  # 3 stages of 48 KB resident
    assert any("shared memory" in p for p in got["problems"]), got["problems"]
    cfg = autotune._cfg(128, 256, 128, 8, 4)
    for bucket in (autotune.SMALL_M, autotune.MEDIUM_M, 4096):
        assert cfg not in autotune.candidates((8, 6), None, bucket)


@pytest.mark.parametrize("version", ["3.4.0", "3.9.0"])
def test_sm90_gemms_with_other_triton(version):
    """sm_90's GEMM tiles (the s8 wgmma rewrite included) built with another Triton. Where a Triton cannot build the
    s8 form, ``kernel.s8wgmma._build`` turns the path off and the int8 build of the same tile runs: the row then
    records that build (``s8_rewrite`` False, ``s8_error``), which must compile. With 3.4.0 and 3.9.0 the rewrite
    itself assembles (3.9 emits PTX ISA 9.x for sm_90, which only its CUDA 13 ptxas takes: ``s8wgmma.ptxas_path``)."""
    path = ROOT / ".runtime" / f"triton-{version}"
    if not (path / ".ready").exists():
        pytest.skip(f"{path} missing: scripts/setup_runtime.sh installs it")
    res = _compile(["--targets", "90", "--kinds", "gemm", "--workers", "2"], pythonpath=str(path))
    assert res["info"]["triton"] == version and res["info"]["triton_dir"].startswith(str(path))
    rows = res["targets"]["sm_90"]["kernels"]
    failed = [f"{r['label']}: {r['error']}" for r in rows if r.get("error")]
    assert not failed, failed
    assert res["problems"] == []
    s8 = [r for r in rows if r.get("config", {}).get("S8")]
    assert s8 and all(r["s8_rewrite"] for r in s8), [r.get("s8_error") for r in s8]
