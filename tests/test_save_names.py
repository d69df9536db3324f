"""File names for Save INT8 Model and Save INT8 Calibration (issue 35, items 3.3 and 3.4), through the nodes in the
pinned ComfyUI (in-process, CPU), with real files on this machine's file system.

* Any name the file system takes must save: a 248-byte final name (``h4/`` + 236 x ``L`` + ``.safetensors``) and
  80 CJK characters (240 bytes in UTF-8) used to fail with safetensors' bare "File name too long", because the
  temporary beside the target was ``.<name>.<pid>.tmp``, 11+ bytes longer than the name. A name longer than the
  file system's ``NAME_MAX`` (255 bytes here) gets the pack's message, before anything is written.
* A name ending in ``/`` (``h4/trail/``) used to write the hidden file ``h4/trail/.safetensors``: refused, as is a
  bare extension or any final name starting with ``.``.
* A writer killed while writing to a long name leaves a (short) temporary that the next save removes.
"""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel.atomic import atomic_write, name_max

ROOT = Path(__file__).resolve().parents[1]
CJK = "量子化模型保存試験" * 10  # 3 bytes each in UTF-8


@pytest.fixture
def unet(comfy_inprocess, tmp_path, monkeypatch):
    import folder_paths
    d = tmp_path / "unet"
    d.mkdir()
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "diffusion_models", ([str(d)], {".safetensors"}))
    assert name_max(str(d)) == 255  # the names below are sized for it
    return d


@pytest.fixture
def float_model(tiny_model):
    return tiny_model("lumina2")


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _content(path: Path):
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


def _same(a: Path, b: Path) -> bool:
    (ma, ta), (mb, tb) = _content(a), _content(b)
    return ma == mb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize("fmt", ["int8_fused", "comfy_int8_tensorwise"])
def test_names_up_to_the_limit_save(pack, unet, float_model, fmt):
    node = pack.nodes.save.SaveInt8Model()
    ref = unet / "ref.safetensors"
    node.save(float_model, "ref", fmt, False, "blocks")
    for name in ("h4/" + "L" * 236, "h4/" + CJK[:80], "L" * 243):
        last = (name.rsplit("/", 1)[-1] + ".safetensors").encode()
        assert len(last) in (248, 252, 255)
        (path,) = node.save(float_model, name, fmt, False, "blocks")["result"]
        assert path == str(unet / (name + ".safetensors"))
        assert _same(Path(path), ref)
    assert _files(unet) == sorted(["h4", "h4/" + "L" * 236 + ".safetensors", "h4/" + CJK[:80] + ".safetensors",
                                   "L" * 243 + ".safetensors", "ref.safetensors"])  # no temporary left


def test_names_over_the_limit_get_the_packs_message(pack, unet, float_model):
    node = pack.nodes.save.SaveInt8Model()
    for name, n in (("L" * 244, 256), ("h4/" + CJK[:82], 258), ("M" * 256 + "/x", 256)):
        with pytest.raises(ValueError, match=rf"^Save INT8 Model: invalid file name .* is {n} bytes long \(UTF-8\); "
                                             r"the file system of .* takes at most 255 bytes") as e:
            node.save(float_model, name, "int8_fused", False, "blocks")
        assert type(e.value).__module__ == "int8_fused"
    assert _files(unet) == []


@pytest.mark.parametrize("name", ["h4/trail/", "h4/trail//", "h4/", "h4/ ", ".safetensors", "h4/.safetensors",
                                  "h4/.hidden", "/"])
def test_a_name_without_a_file_name_is_refused(pack, unet, float_model, name):
    node = pack.nodes.save.SaveInt8Model()
    with pytest.raises(ValueError, match="invalid file name"):
        node.save(float_model, name, "int8_fused", False, "blocks")
    assert _files(unet) == []  # no hidden ".safetensors", no folder


def _calibration():
    from quant.calibrate import Calibration, LayerCalibration
    g = torch.Generator().manual_seed(0)
    layer = LayerCalibration("layers.0.attention.qkv", 8, 24, torch.rand(8, generator=g) + 0.5, 0.5, False,
                             0.02, 0.01)
    return Calibration({layer.name: layer}, {"arch": "test"})


def test_calibration_names_up_to_the_limit_save(pack, comfy_inprocess, tmp_path, monkeypatch):
    import folder_paths
    from quant.calibrate import Calibration
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "int8_calibration", ([str(tmp_path)], {".safetensors"}))
    node, cal = pack.nodes.calibrate.SaveInt8Calibration(), _calibration()
    for name in ("L" * 236, CJK[:80], "L" * 243):
        node.save(cal, name, overwrite=False)
        back = Calibration.load(tmp_path / (name + ".safetensors"))
        assert torch.equal(back.layers["layers.0.attention.qkv"].smooth, cal.layers["layers.0.attention.qkv"].smooth)
    with pytest.raises(ValueError, match=r"is 256 bytes long \(UTF-8\); the file system of .* takes at most 255"):
        node.save(cal, "L" * 244, overwrite=False)
    assert _files(tmp_path) == sorted(n + ".safetensors" for n in ("L" * 236, CJK[:80], "L" * 243))


def test_a_killed_writer_of_a_long_name_leaves_a_temporary_the_next_write_removes(tmp_path):
    target = tmp_path / ("L" * 250 + ".json")
    script = ("import sys, time\nsys.path.insert(0, sys.argv[1])\nfrom kernel.atomic import atomic_write\n"
              "def hang(tmp):\n"
              "    open(tmp, 'w').write('{'); print(tmp, flush=True); time.sleep(600)\n"
              "atomic_write(sys.argv[2], hang)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(ROOT), str(target)], stdout=subprocess.PIPE, text=True)
    try:
        tmp = Path(proc.stdout.readline().strip())
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert tmp.parent == tmp_path and tmp.name.endswith(f".json.{proc.pid}.tmp") and len(tmp.name) <= 255
    assert [p.name for p in tmp_path.iterdir()] == [tmp.name]
    atomic_write(target, lambda t: Path(t).write_text("{}"))
    assert [p.name for p in tmp_path.iterdir()] == [target.name] and target.read_text() == "{}"
