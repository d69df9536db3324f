"""What names the pack in the full-size demo's paste block (scripts/full_size.py ``report``; issue 47 item 2): the
commit the bench recorded, else the pack folder's own git HEAD, else the version in its pyproject.toml, saying so
(``bench/lib/provenance.pack_version``), never "pack ?". On the CPU, with copies of the pack's pyproject.toml in
tmp_path: alone, inside another repository's tree (a ComfyUI clone's custom_nodes), and as a checkout of its own."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import full_size as F  # noqa: E402
from bench.lib import provenance  # noqa: E402

DOC = {"gpu": "NVIDIA H200", "driver": "580.159.04", "torch": "2.11.0+cu130", "triton": "3.6.0", "comfyui": "0.33.0",
       "rows": [], "models": {}}


def _version() -> str:
    """[project] version of the real pyproject.toml, read here independently of provenance.py."""
    text = (ROOT / "pyproject.toml").read_text()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    return re.search(r'^version = "([^"]+)"$', project, re.M).group(1)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


def _pack_line(block: str) -> str:
    (line,) = [ln for ln in block.splitlines() if ln.startswith("GPU: ")]
    return line.rpartition(", pack ")[2]


def test_paste_block_names_a_copy_by_its_pyproject_version(tmp_path):
    copy = tmp_path / "ComfyUI" / "custom_nodes" / "comfyui-int8-fused"
    copy.mkdir(parents=True)
    (copy / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    want = f"{_version()} (pyproject.toml; not a git checkout)"
    assert provenance.pack_version(copy) == want
    for commit in ("?", None):  # what the bench records there / a document without it
        doc = dict(DOC, **({"commit": commit} if commit else {}))
        assert _pack_line(F.report(doc, "flux", 6, 60.0, {}, root=copy)[1]) == want

    _git(tmp_path / "ComfyUI", "init", "-q")  # the copy inside another repository's tree: still no checkout
    _git(tmp_path / "ComfyUI", "commit", "-q", "--allow-empty", "-m", "comfy")
    assert provenance.head(copy) is None and provenance.pack_version(copy) == want

    _git(copy, "init", "-q")  # a checkout of its own: its HEAD, unless the bench recorded a commit
    _git(copy, "add", "pyproject.toml")
    _git(copy, "commit", "-q", "-m", "pack")
    sha = _git(copy, "rev-parse", "HEAD")
    assert provenance.pack_version(copy) == sha
    assert _pack_line(F.report(dict(DOC, commit="?"), "flux", 6, 60.0, {}, root=copy)[1]) == sha
    assert _pack_line(F.report(dict(DOC, commit="abc1234"), "flux", 6, 60.0, {}, root=copy)[1]) == "abc1234"
