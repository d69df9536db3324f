"""Random-weight models as files (bench/lib/model_file.py, bench/e2e_models.py ``--from-file``; issue 50: measure host
RAM as ComfyUI loads a checkpoint, not from a state dict built in memory).

* The streamed writer's file is what safetensors' own reader reads back, tensor for tensor, bit for bit, for every
  dtype the benches write; a tensor that does not match the layout stops the write and leaves no file behind (an
  existing file is always whole); ``params`` counts the header's elements.
* The core ``int8_tensorwise`` file of a float file: the picked linears' codes and scales equal a float64 per-channel
  quantization written here (step absmax / 127, round half to even), [N, 1] scales, the ``comfy_quant`` entry; the rest
  as stored.
* ``e2e_models.py --from-file`` on the CPU (tiny Flux.1, under ComfyUI 0.33.0): the bench writes the file once, loads
  every path from it with ComfyUI's loader, and gets the outputs of the in-memory run bit for bit (same weights: every
  row's error against bf16 equal); a second run writes nothing.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.lib import model_file

ROOT = Path(__file__).resolve().parents[1]


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(5, 7, generator=g).bfloat16(),
            "a.bias": torch.randn(5, generator=g).half(),
            "n.scale": torch.randn(3, generator=g),
            "q.codes": torch.randint(-127, 128, (4, 2), generator=g, dtype=torch.int8),
            "q.conf": torch.tensor([1, 2, 250], dtype=torch.uint8)}


def test_written_file_reads_back_bit_for_bit(tmp_path):
    sd = _tensors()
    layout = [(k, tuple(v.shape), v.dtype) for k, v in sd.items()]
    size = model_file.write(tmp_path / "m.safetensors", layout, iter(sd.items()), {"note": "random"})
    back = load_file(str(tmp_path / "m.safetensors"))
    assert list(back) == list(sd) or sorted(back) == sorted(sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    assert size == (tmp_path / "m.safetensors").stat().st_size
    assert model_file.params(tmp_path / "m.safetensors") == sum(v.numel() for v in sd.values())
    # a tensor that does not match its layout entry: an error naming it, and no file (nor part file) left
    bad = dict(sd, **{"a.bias": torch.zeros(6, dtype=torch.float16)})
    with pytest.raises(ValueError, match=r"a\.bias \(6,\)"):
        model_file.write(tmp_path / "bad.safetensors", layout, iter(bad.items()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_core_int8_file_of_a_float_file(tmp_path):
    g = torch.Generator().manual_seed(1)
    sd = {"blocks.0.q.weight": torch.randn(6, 16, generator=g).bfloat16(),
          "blocks.0.q.bias": torch.randn(6, generator=g).bfloat16(),
          "blocks.0.norm.weight": torch.ones(16).bfloat16(),
          "head.weight": torch.randn(4, 16, generator=g).bfloat16()}
    src = tmp_path / "f.safetensors"
    model_file.write(src, [(k, tuple(v.shape), v.dtype) for k, v in sd.items()], iter(sd.items()))
    model_file.core_int8(src, tmp_path / "c.safetensors", lambda p, shape: p.startswith("blocks."), "cpu")
    out = load_file(str(tmp_path / "c.safetensors"))
    w = sd["blocks.0.q.weight"].double()
    step = w.abs().amax(1, keepdim=True) / 127.0
    assert out["blocks.0.q.weight"].dtype == torch.int8
    assert torch.equal(out["blocks.0.q.weight"].double(), torch.round(w / step).clamp(-127, 127))
    assert out["blocks.0.q.weight_scale"].shape == (6, 1)
    assert torch.allclose(out["blocks.0.q.weight_scale"].double(), step, rtol=1e-6)
    assert json.loads(bytes(out["blocks.0.q.comfy_quant"].tolist())) == {"format": "int8_tensorwise"}
    for k in ("blocks.0.q.bias", "blocks.0.norm.weight", "head.weight"):  # not picked / not 2-D weights
        assert torch.equal(out[k], sd[k]), k
    assert "head.weight_scale" not in out and "blocks.0.norm.weight_scale" not in out


def _bench(comfy_current, args, out):
    py = os.environ.get("COMFYUI_CURRENT_PYTHON") or sys.executable
    env = dict(os.environ, TRITON_INTERPRET="1", COMFYUI_CURRENT=str(comfy_current))
    cp = subprocess.run([py, str(ROOT / "bench" / "e2e_models.py"), "--device", "cpu", "--tiny", "--models", "flux",
                         "--paths", "bf16,core_int8,pack:torch_int_mm", "--steps", "1", *args, "--out", str(out)],
                        env=env, capture_output=True, text=True, timeout=900)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"] if "path" in r and "check" not in r}
    return rows, cp.stdout


def test_models_bench_from_file_equals_the_in_memory_run(comfy_current, tmp_path):
    files = tmp_path / "models"
    mem, _ = _bench(comfy_current, [], tmp_path / "mem.json")
    disk, log1 = _bench(comfy_current, ["--from-file", str(files)], tmp_path / "disk.json")
    assert sorted(p.name for p in files.iterdir()) == ["flux-tiny-seed0.core-int8.safetensors",
                                                       "flux-tiny-seed0.safetensors"]
    assert "flux: wrote" in log1
    for path in ("bf16", "core_int8", "pack:torch_int_mm"):
        assert disk[path]["status"] == "ok" and mem[path]["status"] == "ok"
        assert disk[path]["params"] == mem[path]["params"]
        assert disk[path]["rel_l2_vs_bf16"] == mem[path]["rel_l2_vs_bf16"], path  # the same weights, bit for bit
    assert 0 < disk["core_int8"]["rel_l2_vs_bf16"] < 0.05
    again, log2 = _bench(comfy_current, ["--from-file", str(files)], tmp_path / "again.json")
    assert "flux: wrote" not in log2 and again["core_int8"]["rel_l2_vs_bf16"] == disk["core_int8"]["rel_l2_vs_bf16"]
