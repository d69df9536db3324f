"""The three JSON caches (GEMM autotune ``kernel.autotune.ConfigCache``, attention ``quant.attention.disk_cache``,
dispatch ``quant.dispatch.DecisionCache``) and their one file handling (``kernel.jsoncache``, ``kernel.atomic``):
a damaged file of any form is set aside with one warning naming it and tuned again, and processes writing one file
concurrently keep every entry (issue 35 items 3.1, 3.2, 3.8).

Run: bash scripts/test.sh tests/test_caches.py
"""
import json
import logging
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kernel import autotune, config
from quant import attention, dispatch

ROOT = Path(__file__).resolve().parents[1]
GEMM_KEY = autotune.ConfigCache.key(4608, 4608, 4096)
DISPATCH_KEY = "M128_N4608_K4608_nobias_bfloat16"
NOISE = bytes(random.Random(35).getrandbits(8) for _ in range(512))  # 512 random bytes: not UTF-8


def _damaged(section: str) -> dict:
    """name -> bytes of a damaged file of a cache whose entries live under ``section``."""
    forms = {
        "random bytes": NOISE,
        "not json": b"{not json",
        "truncated": b'{"' + section.encode() + b'": {"a": {"BLOCK_M": 12',
        "a list": b"[]",
        "null": b"null",
        "a string": b'"x"',
        "empty object": b"{}",
        "section a list": json.dumps({section: []}).encode(),
        "section a string": json.dumps({section: "x"}).encode(),
        "section a number": json.dumps({section: 3}).encode(),
        "entry a number": json.dumps({section: {"k": 3}}).encode(),
        "entry a list": json.dumps({section: {"k": [1, 2]}}).encode(),
        "entry a string": json.dumps({section: {"k": "x"}}).encode(),
        "deep nesting": b"[" * 100000 + b"]" * 100000,
    }
    if section == "configs":
        forms["tile of strings"] = json.dumps({section: {GEMM_KEY: {**autotune.hopper_configs()[0],
                                                                    "BLOCK_M": "128"}}}).encode()
        forms["tile missing keys"] = json.dumps({section: {GEMM_KEY: {"BLOCK_M": 128}}}).encode()
        forms["split of a float"] = json.dumps({section: {GEMM_KEY + "_T32_split": {"SPLIT": 2.5}}}).encode()
    return forms


GEMM_FORMS, DISPATCH_FORMS = _damaged("configs"), _damaged("decisions")


def _set_aside(path: Path, original: bytes) -> None:
    """``path``'s damaged content sits whole in one ``<name>.bad-<time>`` beside it; no lock or temporary is left."""
    bad = sorted(path.parent.glob(path.name + ".bad-*"))
    assert len(bad) == 1 and bad[0].read_bytes() == original
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def _one_warning(caplog, path: Path) -> None:
    warns = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warns) == 1, [r.getMessage() for r in warns]
    assert str(path) in warns[0].getMessage() and "set aside" in warns[0].getMessage()


# ---------------------------------------------------------------- the GEMM autotune cache
@pytest.mark.parametrize("form", list(GEMM_FORMS))
def test_gemm_cache_damaged_file_is_set_aside_and_retuned(tmp_path, caplog, form):
    with config.override(INT8_FUSED_CACHE_DIR=str(tmp_path)):
        path = autotune.cache_file("NVIDIA H200", "3.6.0")
    path.write_bytes(GEMM_FORMS[form])
    cands = autotune.hopper_configs()[:3]
    timed = []

    def clock(cfg):
        timed.append(cfg)
        return 1.0 if cfg == cands[2] else 2.0
    cache = autotune.ConfigCache(path)
    with caplog.at_level(logging.WARNING, "int8_fused"):
        assert cache.get(GEMM_KEY) is None and cache.get("N1_K1_M16") is None
        assert autotune.pick_config(cache, GEMM_KEY, cands, clock, {"gpu": "NVIDIA H200"}) == cands[2]
        cache.put("N8_K8_M16", cands[0])
    assert timed == cands  # tuned again: every candidate timed (one clear winner, no final rounds)
    _one_warning(caplog, path)
    _set_aside(path, GEMM_FORMS[form])
    data = json.loads(path.read_text())  # the repaired file
    assert data == {"gpu": "NVIDIA H200", "configs": {GEMM_KEY: cands[2], "N8_K8_M16": cands[0]}}
    again = autotune.ConfigCache(path)  # a new process reads the repaired file and times nothing
    assert autotune.pick_config(again, GEMM_KEY, cands, lambda c: pytest.fail("timed a cached shape")) == cands[2]


@pytest.mark.parametrize("form", ["a list", "section a list", "section a string", "random bytes"])
def test_gemm_cache_put_first_on_a_damaged_file(tmp_path, caplog, form):
    """``put`` before any ``get`` (``choose_split`` on a shape another call tuned) meets the damage too."""
    path = tmp_path / "gemm-x.json"
    path.write_bytes(GEMM_FORMS[form])
    with caplog.at_level(logging.WARNING, "int8_fused"):
        autotune.ConfigCache(path).put(GEMM_KEY + "_T32_split", {"SPLIT": 2})
    _one_warning(caplog, path)
    _set_aside(path, GEMM_FORMS[form])
    assert json.loads(path.read_text()) == {"configs": {GEMM_KEY + "_T32_split": {"SPLIT": 2}}}


def test_valid_entries_of_a_damaged_file_are_kept(tmp_path, caplog):
    path = tmp_path / "gemm-x.json"
    good = {GEMM_KEY: autotune.hopper_configs()[1], GEMM_KEY + "_T32_split": {"SPLIT": 3},
            "SW_" + GEMM_KEY + "_tilep": {**autotune.s8_configs()[1]}, "XQ_N8_K8_M16": autotune.small_m_configs()[0]}
    original = json.dumps({"gpu": "H200", "configs": {**good, "N1_K1_M16": "x", "N2_K2_M16": {"BLOCK_M": -1}}})
    path.write_text(original)
    cache = autotune.ConfigCache(path)
    with caplog.at_level(logging.WARNING, "int8_fused"):
        for k, v in good.items():
            assert cache.get(k) == v
        assert cache.get("N1_K1_M16") is None and cache.get("N2_K2_M16") is None
    _one_warning(caplog, path)
    assert "2 malformed entries" in caplog.text and "4 valid entries are kept" in caplog.text
    _set_aside(path, original.encode())
    assert json.loads(path.read_text()) == {"gpu": "H200", "configs": good}  # written back at once


def test_an_unreadable_file_warns_once_and_is_left_alone(tmp_path, caplog):
    path = tmp_path / "gemm-x.json"
    path.mkdir()  # reading it raises IsADirectoryError: nothing to set aside
    cache = autotune.ConfigCache(path)
    with caplog.at_level(logging.WARNING, "int8_fused"):
        assert cache.get("k") is None
        cache.put("k", {"BLOCK_M": 1})
        cache.put("k2", {"BLOCK_M": 2})
        assert cache.get("k2") == {"BLOCK_M": 2}  # kept in memory
    warns = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warns) == 1 and str(path) in warns[0] and "IsADirectoryError" in warns[0]
    assert path.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["gemm-x.json"]


# ---------------------------------------------------------------- the attention cache
def _qkv(lq=5):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, n, 8, generator=g) for n in (lq, 6, 6)]


@pytest.mark.parametrize("form", list(GEMM_FORMS))
def test_attention_cache_damaged_file_is_set_aside_and_reprobed(tmp_path, caplog, form, first_call_tuning):
    with config.override(INT8_FUSED_CACHE_DIR=str(tmp_path)):
        cache = attention.disk_cache(torch.device("cpu"))
    path = cache.path
    assert path.parent == tmp_path and path.name.startswith("attention-")
    path.write_bytes(GEMM_FORMS[form])
    probed = []
    fake = {"cudnn": 3.0, "flash": 1.0, "efficient": 2.0}

    def time_fn(name, run):
        probed.append(name)
        return fake[name]
    router = attention.Router("auto", time_fn=time_fn, cache=cache, probe_devices=("cpu",))
    q, k, v = _qkv()
    with caplog.at_level(logging.WARNING, "int8_fused"):
        out = router(None, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
        router(None, *_qkv(lq=7), 4, skip_reshape=True, skip_output_reshape=True)
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8 ** 0.5, -1) @ v.double()
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert probed == ["cudnn", "flash", "efficient"] * 2  # probed again for both shapes
    _one_warning(caplog, path)
    _set_aside(path, GEMM_FORMS[form])
    data = json.loads(path.read_text())["configs"]
    assert len(data) == 2 and all(e["backend"] == "flash" and e["ms"] == fake for e in data.values())
    fresh = attention.Router("auto", time_fn=lambda n, r: pytest.fail("probed a cached shape"),
                             cache=autotune.ConfigCache(path, valid=attention.valid_entry), probe_devices=("cpu",))
    fresh(None, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert list(fresh.winners.values()) == ["flash"]


def test_attention_cache_entry_of_an_unknown_backend_is_damage(tmp_path, caplog):
    path = tmp_path / "attention-cpu.json"
    original = json.dumps({"configs": {"a": {"backend": "flash", "ms": {}}, "b": {"backend": "bogus"},
                                       "c": {"backend": "cudnn", "ms": 3}}})
    path.write_text(original)
    cache = autotune.ConfigCache(path, valid=attention.valid_entry, what="attention cache")
    with caplog.at_level(logging.WARNING, "int8_fused"):
        assert cache.get("a") == {"backend": "flash", "ms": {}} and cache.get("b") is None and cache.get("c") is None
    _one_warning(caplog, path)
    _set_aside(path, original.encode())


# ---------------------------------------------------------------- the dispatch decision cache
@pytest.mark.parametrize("form", list(DISPATCH_FORMS))
def test_dispatch_cache_damaged_file_is_set_aside_and_rewritten(tmp_path, caplog, form):
    with config.override(INT8_FUSED_CACHE_DIR=str(tmp_path)):
        path = dispatch.cache_path("NVIDIA H200", "2.11.0", "3.6.0")
    path.write_bytes(DISPATCH_FORMS[form])
    cache = dispatch.DecisionCache(path)
    entry = {"path": "float", "int8_ms": 0.05, "float_ms": 0.02, "m": 77}
    with caplog.at_level(logging.WARNING, "int8_fused"):
        assert cache.get(DISPATCH_KEY) is None and cache.get("k") is None
        cache.put(DISPATCH_KEY, entry, {"gpu": "NVIDIA H200"})
        assert cache.get(DISPATCH_KEY) == entry
    _one_warning(caplog, path)
    assert "decision cache" in caplog.text
    _set_aside(path, DISPATCH_FORMS[form])
    assert json.loads(path.read_text()) == {"gpu": "NVIDIA H200", "decisions": {DISPATCH_KEY: entry}}
    assert dispatch.DecisionCache(path).get(DISPATCH_KEY) == entry


def test_dispatch_uses_the_autotune_caches_file_handling():
    from kernel import jsoncache
    assert issubclass(dispatch.DecisionCache, jsoncache.JsonCache)
    assert issubclass(autotune.ConfigCache, jsoncache.JsonCache)


# ---------------------------------------------------------------- processes writing one file
WRITER = r"""
import os, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]; import pack_import; pack_import.install()
kind, folder, who, n, trials = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
if kind == "gemm":
    from kernel import autotune
    make = autotune.ConfigCache
    entry = lambda i: {**autotune.hopper_configs()[0], "BLOCK_M": 64 + i}
    key = lambda i: autotune.ConfigCache.key(who + 1, i + 1, 4096)
else:
    from quant import dispatch
    make = dispatch.DecisionCache
    entry = lambda i: {"path": "int8", "m": i}
    key = lambda i: f"M{i}_N{who}_K8_nobias_bfloat16"
for t in range(trials):
    cache = make(os.path.join(folder, f"t{t}", kind + ".json"))
    print("ready", flush=True)
    while not os.path.exists(os.path.join(folder, f"go{t}")):
        time.sleep(0.001)
    for i in range(n):
        cache.get(key(i))
        cache.put(key(i), entry(i), {"writer": who})
"""


@pytest.mark.parametrize("kind", ["gemm", "dispatch"])
def test_processes_writing_one_cache_keep_every_entry(tmp_path, kind):
    """Writers started together (one trial a file) each put ``n`` entries into one cache file."""
    writers, n, trials = 3, 120, 3
    for t in range(trials):
        (tmp_path / f"t{t}").mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(ROOT), kind, str(tmp_path), str(w), str(n),
                               str(trials)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for w in range(writers)]
    for t in range(trials):
        for p in procs:  # every writer is ready for this trial: start them together
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        (tmp_path / f"go{t}").touch()
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    lost = {}
    for t in range(trials):
        folder = tmp_path / f"t{t}"
        path = folder / f"{kind}.json"
        section = json.loads(path.read_text())["configs" if kind == "gemm" else "decisions"]
        per = [sum(1 for k in section if (f"N{w + 1}_" in k if kind == "gemm" else f"_N{w}_" in k))
               for w in range(writers)]
        if per != [n] * writers:
            lost[t] = per
        assert sorted(p.name for p in folder.iterdir()) == [path.name]  # no lock file, temporary or set-aside file
    assert not lost, f"entries kept per writer, by trial (each should be {n}): {lost}"


def test_lock_excludes_other_processes(tmp_path):
    """``atomic.locked``: a second process waits until the holder leaves the block."""
    from kernel import atomic
    target, log_file = tmp_path / "c.json", tmp_path / "order"
    script = ("import sys\nsys.path.insert(0, sys.argv[1])\nfrom kernel import atomic\nprint('trying', flush=True)\n"
              "with atomic.locked(sys.argv[2]):\n    open(sys.argv[3], 'a').write('child\\n')\n")
    with atomic.locked(target):
        child = subprocess.Popen([sys.executable, "-c", script, str(ROOT), str(target), str(log_file)],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "trying"
        time.sleep(0.5)  # without the lock the child would have written by now
        assert not log_file.exists()
        log_file.write_text("parent\n")
    assert child.wait(timeout=60) == 0
    assert log_file.read_text() == "parent\nchild\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["order"]
