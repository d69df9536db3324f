"""bench/roofline.py: hand-derived checks of the roofline model (no GPU, no torch)."""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from bench import roofline as rf  # noqa: E402

NOHOST = dict(k_bf16=0.0, k_pack=0.0, h_bf16=0.0, h_fp8=0.0, h_pack=0.0)
CARD = dict(arch="sm_89", bf16=100.0, fp8=200.0, int8=400.0, bw=1000, vram=24, pcie=25.0)


def toy(m=8192, n=8192, k=8192, params=None):
    q = n * k
    return dict(lins=[rf._lin(m, n, k, 10)], attn=[], blocks=[(m, n, 1)], quant_params=q,
                params=params if params is not None else q)


def test_gemm_bound_ratio_is_rates_times_efficiencies():
    m = toy()
    pk = rf.predict(CARD, m, "pack", NOHOST)["s_per_step"]
    bf = rf.predict(CARD, m, "bf16", NOHOST)["s_per_step"]
    # by hand: 10 GEMMs of 2*8192^3 flops
    flops = 10 * 2 * 8192 ** 3
    assert bf == pytest.approx(flops / (100e12 * rf.EFF["bf16"]), rel=1e-12)
    assert pk == pytest.approx(flops / (400e12 * rf.EFF["int8"]), rel=1e-12)
    assert bf / pk == pytest.approx(4 * rf.EFF["int8"] / rf.EFF["bf16"], rel=1e-12)


def test_fp8_adds_cast_bytes_and_ampere_falls_back_to_bf16():
    m = toy()
    fp8 = rf.predict(CARD, m, "fp8", NOHOST)
    cast = 10 * 7.0 * 8192 * 8192 / (1000e9 * rf.EFF["row"])
    assert fp8["gemm_s"] == pytest.approx(10 * 2 * 8192 ** 3 / (200e12 * rf.EFF["fp8"]), rel=1e-12)
    assert fp8["rows_s"] == pytest.approx(cast, rel=1e-12)
    amp = dict(CARD, fp8=None)
    a = rf.predict(amp, m, "fp8", NOHOST)
    b = rf.predict(amp, m, "bf16", NOHOST)
    assert a["gemm_s"] == pytest.approx(b["gemm_s"], rel=1e-12)  # bf16 compute
    assert a["rows_s"] == pytest.approx(10 * 3.0 * 8192 * 8192 / (1000e9 * rf.EFF["row"]), rel=1e-12)


def test_fp8_weight_passes_and_attention_by_head_dim_on_hopper():
    m = toy()
    f = dict(NOHOST, w_fp8=14.0)
    fp8 = rf.predict(CARD, m, "fp8", f)
    # by hand: 7 bytes an input element + 14 bytes a weight element, per call, 10 calls
    assert fp8["rows_s"] == pytest.approx(10 * (7.0 + 14.0) * 8192 * 8192 / (1000e9 * rf.EFF["row"]), rel=1e-12)
    hop = dict(CARD, arch="sm_90")
    fa = dict(NOHOST, a_cudnn128=0.5, a_flash128=0.25)
    flops = 4 * 2 * 1000 * 1000 * 3  # heads 2, Lq = Lk = 1000, count 3; times head_dim below
    for d, backend, eff in ((128, "cudnn", 0.5), (128, "comfy", 0.25), (256, "cudnn", rf.EFF["attn_cudnn"]),
                            (256, "comfy", rf.EFF["attn_flash_sm90"])):
        mm = dict(lins=[], attn=[(2, 1000, 1000, d, 3)], blocks=[(1, 1, 1)], quant_params=0, params=0)
        got = rf.predict(hop, mm, "pack", fa, attention=backend)["attention_s"]
        assert got == pytest.approx(flops * d / (100e12 * eff), rel=1e-12), (d, backend)


def test_offload_term_when_weights_exceed_vram():
    gib = 1024 ** 3
    # 40 GiB of bf16 weights (20 Gi elements, all quantized): bf16 40 GiB, pack 20 GiB, on a 24 GiB card
    q = 20 * gib
    m = dict(lins=[rf._lin(1, 1, 1, 1)], attn=[], blocks=[(1, 1, 1)], quant_params=q, params=q)
    bf = rf.predict(CARD, m, "bf16", NOHOST)
    pk = rf.predict(CARD, m, "pack", NOHOST)
    spill = 40 * gib - (24 - rf.RESERVE_GIB) * gib
    assert not bf["fits"] and bf["offload_s"] == pytest.approx(spill / 25e9, rel=1e-12)
    assert bf["s_per_step"] == pytest.approx(spill / 25e9, rel=1e-12) and bf["bound"] == "offload"
    assert pk["fits"] and pk["offload_s"] == 0.0


def test_host_floor_and_memory_bound_linear():
    m = dict(lins=[rf._lin(1, 4096, 4096, 3, False)], attn=[(2, 100, 50, 64, 1)], blocks=[(10, 20, 5)],
             quant_params=0, params=4096 * 4096)
    f = dict(NOHOST, k_bf16=4.0, h_bf16=2.0)
    p = rf.predict(CARD, m, "bf16", f)
    assert p["gemm_s"] == pytest.approx(3 * 2 * 4096 * 4096 / (1000e9 * rf.EFF["stream"]), rel=1e-12)
    assert p["attention_s"] == pytest.approx(4 * 2 * 100 * 50 * 64 / (100e12 * rf.EFF["attn_other"]), rel=1e-12)
    assert p["rows_s"] == pytest.approx(4.0 * 2 * 10 * 20 * 5 / (1000e9 * rf.EFF["row"]), rel=1e-12)
    assert p["host_s"] == pytest.approx(2e-3 * 5) and p["s_per_step"] == pytest.approx(1e-2) and p["bound"] == "host"


def test_check_computes_errors_on_hand_made_rows():
    rows = [dict(model="a", path="pack", s_per_step=0.10), dict(model="a", path="bf16", s_per_step=0.20),
            dict(model="a", path="fp8", s_per_step=0.25)]
    pred = {"pack": 0.11, "bf16": 0.20, "fp8": 0.22}
    c = rf.check(rows, lambda r: pred[r["path"]])
    errs = {s["path"]: s["err"] for s in c["steps"]}
    assert errs["pack"] == pytest.approx(0.10) and errs["bf16"] == pytest.approx(0.0)
    assert errs["fp8"] == pytest.approx(-0.12)
    rat = {s["ratio"]: s for s in c["ratios"]}
    assert rat["x bf16"]["measured"] == pytest.approx(2.0) and rat["x bf16"]["predicted"] == pytest.approx(0.2 / 0.11)
    assert rat["x bf16"]["err"] == pytest.approx((0.2 / 0.11) / 2.0 - 1)
    assert rat["x fp8"]["err"] == pytest.approx((0.22 / 0.11) / 2.5 - 1)
    assert c["worst_abs_err"] == pytest.approx(max(0.12, 1 - (0.22 / 0.11) / 2.5, 1 - (0.2 / 0.11) / 2.0))
    assert c["within"] is (c["worst_abs_err"] <= 0.15)


def test_h200_rows_read_at_the_commit_and_script_writes_json(tmp_path):
    rows = rf.h200_rows(ROOT / "bench/results/h200-e2e-models.json", ROOT / "bench/results/h200-e2e-sampler.json",
                        commit="822c06c")
    got = {(r["model"], r["path"]): r["s_per_step"] for r in rows}
    assert len(got) == 12
    assert got[("flux", "bf16")] == pytest.approx(0.17417, abs=1e-4)
    assert got[("ideogram4", "pack")] == pytest.approx((0.1650 + 0.1647) / 2, abs=2e-4)
    out = tmp_path / "r.json"
    assert rf.main(["--out", str(out), "--no-fit", "--quiet"]) == 0
    d = json.loads(out.read_text())
    assert len(d["rows"]) == len(rf.CARDS) * len(rf.MODELS) and d["what"].startswith("PREDICTION")
    assert d["markdown"].count("\n") == len(d["rows"]) + 1
    assert all(c.get("src") for c in d["cards"].values())


def test_sage_attention_by_head_dim_on_geforce_only():
    """``attention="sage"``: attn_other x attn_sage_x where SageAttention runs the head size (64/96/128), SDPA's rate
    at head_dim 256 (ComfyUI falls back there); refused on a card whose bf16 runs at over a quarter of its INT8 rate
    (datacenter cards: no measured sage rate)."""
    flops = 4 * 2 * 1000 * 1000 * 3
    for d, x in ((128, rf.EFF["attn_sage_x"]), (64, rf.EFF["attn_sage_x"]), (256, 1.0)):
        mm = dict(lins=[], attn=[(2, 1000, 1000, d, 3)], blocks=[(1, 1, 1)], quant_params=0, params=0)
        got = rf.predict(CARD, mm, "bf16", NOHOST, attention="sage")["attention_s"]
        assert got == pytest.approx(flops * d / (100e12 * rf.EFF["attn_other"] * x), rel=1e-12), d
    mm = dict(lins=[], attn=[(2, 1000, 1000, 128, 3)], blocks=[(1, 1, 1)], quant_params=0, params=0)
    with pytest.raises(ValueError, match="GeForce"):
        rf.predict(dict(CARD, int8=200.0), mm, "pack", NOHOST, attention="sage")
    with pytest.raises(ValueError, match="GeForce"):
        rf.predict(rf.CARDS["H100 SXM"], mm, "pack", NOHOST, attention="sage")


def test_sage_table_rows_follow_predict():
    fitv = dict(rf.FIT_DEFAULT)
    rows, md = rf.sage_table(fitv)
    assert [r["card"] for r in rows] == [c for c in rf.GEFORCE for _ in rf.MODELS]
    for r in rows:
        card, model = rf.CARDS[r["card"]], rf.MODELS[r["model"]]
        ps = rf.predict(card, model, "pack", fitv, attention="sage")["s_per_step"]
        bs = rf.predict(card, model, "bf16", fitv, attention="sage")["s_per_step"]
        assert r["pack_sage_s"] == ps and r["x_bf16_sage"] == pytest.approx(bs / ps, rel=1e-12)
        # Ideogram 4's head_dim 256: SageAttention does not run, bf16 + sage is bf16
        assert r["sage_runs"] == (r["model"] != "ideogram4")
        if r["model"] == "ideogram4":
            assert r["bf16_sage_s"] == r["bf16_s"]
        else:
            assert r["bf16_sage_s"] < r["bf16_s"]
    assert md.count("\n") == len(rows) + 1
