"""The benches without PyAV (issue 47 item 3): on the device machine ``import av`` fails, and ComfyUI 0.33.0's
``comfy_api`` (imported by ``comfy_extras.nodes_torch_compile``, the ``^inductor`` paths' TorchCompileModel, and by
``nodes_custom_sampler``) imports PyAV's video types. ``bench/e2e_sampler.comfy_setup`` (every ComfyUI bench's
start, bench/e2e_models.py's too) then serves ``av`` from ``bench/lib/av_standin.py`` and says so in a log line.

On the CPU, as tests/test_bench_e2e.py runs the benches (a subprocess on COMFYUI_CURRENT_PYTHON): PyAV made
unimportable by a ``sys.meta_path`` finder, then the bench's set-up, then ComfyUI's TorchCompileModel node and
DualModelGuider imported; the stand-in's names behave as comfy_api's import needs, and calling one says what is
missing. Where PyAV imports, the bench leaves it alone."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_NO_AV = """
import importlib.abc, json, sys
class NoPyAV(importlib.abc.MetaPathFinder):  # PyAV absent, as on the device machine
    def find_spec(self, name, path=None, target=None):
        if name == "av" or name.startswith("av."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoPyAV())
try:
    import av
    raise SystemExit("PyAV still imports")
except ModuleNotFoundError:
    pass
sys.path.append(ROOT)
from bench import e2e_sampler
e2e_sampler.comfy_setup(COMFY, True, [])
import comfy_extras.nodes_torch_compile as ntc
import comfy_extras.nodes_custom_sampler as ncs
import av
from av.video.reformatter import ColorTrc
out = {"node": ntc.TorchCompileModel.define_schema().node_id, "guider": ncs.Guider_DualModel.__name__,
       "standin": getattr(av, "STANDIN", False), "same_member": ColorTrc.BT709 is ColorTrc.BT709,
       "again": e2e_sampler.av_standin.install_if_missing(print)}
try:
    av.open("x.mp4")
except ModuleNotFoundError as e:
    out["call"] = str(e)
print("RESULT " + json.dumps(out))
"""


def _python():
    return os.environ.get("COMFYUI_CURRENT_PYTHON") or sys.executable


def test_bench_without_pyav_imports_torch_compile_node(comfy_current, tmp_path):
    code = f"ROOT, COMFY = {str(ROOT)!r}, {str(comfy_current)!r}\n" + _NO_AV
    cp = subprocess.run([_python(), "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, TRITON_INTERPRET="1"))
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    (line,) = [ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[len("RESULT "):])
    assert res["node"] == "TorchCompileModel" and res["guider"] == "Guider_DualModel"
    assert res["standin"] is True and res["same_member"] is True and res["again"] is False
    assert "PyAV is not installed" in res["call"] and "av_standin" in res["call"]
    said = [ln for ln in cp.stdout.splitlines() if "stand-in module `av`" in ln]
    assert len(said) == 1 and "No module named 'av'" in said[0], cp.stdout[-3000:]


def test_pyav_that_imports_is_left_alone():
    code = ("import sys; sys.path.append(%r)\n"
            "try:\n    import av\nexcept ImportError:\n    print('NO_PYAV'); raise SystemExit\n"
            "from bench.lib import av_standin\n"
            "said = []\n"
            "print('RESULT', av_standin.install_if_missing(said.append), av_standin.installed(), said,"
            " getattr(sys.modules['av'], 'STANDIN', False))\n") % str(ROOT)
    cp = subprocess.run([_python(), "-c", code], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr[-3000:]
    if "NO_PYAV" in cp.stdout:
        import pytest
        pytest.skip("PyAV does not import in this Python")
    assert "RESULT False False [] False" in cp.stdout, cp.stdout
