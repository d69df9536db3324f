"""Node help pages (web/docs/<NodeClass>.md): every node of the pack has one, and ComfyUI 0.33.0 serves it at the URL
its frontend (comfyui-frontend-package 1.49.6) fetches for a custom node's help: ``/extensions/<pack>/docs/<name>.md``,
<pack> being the second part of the node's ``python_module`` (``custom_nodes.<folder>``) up to an ``@``."""
import re
from pathlib import Path

import pytest
import requests

import comfy_harness as H

DOCS = H.ROOT / "web" / "docs"


def _frontend_bundle_text() -> str | None:
    """The installed frontend's JavaScript (.runtime/venv-current), or None without it."""
    for site in sorted((H.RUNTIME / "venv-current" / "lib").glob("python3*/site-packages")):
        assets = site / "comfyui_frontend_package" / "static" / "assets"
        if assets.is_dir():
            return "".join(p.read_text(errors="replace") for p in assets.glob("*.js"))
    return None


def test_frontend_fetches_custom_node_help_from_extensions_docs():
    """The URL this file's server test requests is the one the frontend's NodeHelpService builds."""
    text = _frontend_bundle_text()
    if text is None:
        pytest.skip("no comfyui_frontend_package in .runtime/venv-current (scripts/setup_runtime.sh builds it)")
    assert re.search(r"`/extensions/\$\{\w+\}/docs/\$\{\w+\.name\}\.md`", text), "frontend help URL changed"


def test_every_node_has_a_help_page_served_by_current_comfy(comfy_server_current):
    info = comfy_server_current.object_info()
    ours = {name: d for name, d in info.items() if d.get("python_module", "").endswith("comfyui-int8-fused")}
    assert len(ours) >= 7, sorted(ours)
    pages = {p.stem for p in DOCS.glob("*.md")}
    assert pages == set(ours), (sorted(pages ^ set(ours)))
    for name, d in ours.items():
        pack_id = d["python_module"].split(".")[1].split("@")[0]
        r = requests.get(f"{comfy_server_current.url}/extensions/{pack_id}/docs/{name}.md", timeout=30)
        assert r.status_code == 200, (name, r.status_code, r.url, r.headers, r.text[:300])
        assert "text/html" not in r.headers.get("content-type", ""), (name, r.headers)
        body = r.content.decode("utf-8")
        assert body == (DOCS / f"{name}.md").read_text(), name
        assert body.startswith(f"# {d['display_name']}\n"), (name, body[:80])
