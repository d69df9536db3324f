"""The widget while kernels are tuned (tests/test_tuning_widget_browser.py) on ComfyUI 0.33.0's server and its
frontend (comfyui-frontend-package 1.49.6) instead of the pinned 0.3.75 (1.32.9); skipped without COMFYUI_CURRENT.
Screenshots: tests/artifacts/tuning_widget_{active,active_nodes2,done}_1.49.6.png."""
import os

import pytest

import comfy_harness as H
import test_tuning_widget_browser as T
import test_widget_browser as W
from test_tuning_widget_browser import test_widget_shows_tuning_with_progress_then_the_summary  # noqa: F401

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def probe_server(tmp_path_factory):
    path, reason = H.current_comfy_dir()
    if path is None:
        pytest.skip(reason)
    if not (path / "custom_nodes" / "comfyui-int8-fused").exists():
        pytest.skip(f"{path}/custom_nodes has no comfyui-int8-fused (scripts/setup_runtime.sh links it there)")
    yield from T.start_probe_server(tmp_path_factory, path, os.environ.get("COMFYUI_CURRENT_PYTHON") or None)


@pytest.fixture(scope="module")
def page(probe_server):
    yield from W.open_page(probe_server)


def test_current_frontend(page):
    assert page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__ || null") == "1.49.6"
