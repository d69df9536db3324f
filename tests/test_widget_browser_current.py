"""The timing widget in the current frontend: the same browser checks as tests/test_widget_browser.py (empty
state; known runs, written out by hand), on ComfyUI 0.33.0's server and its frontend (comfyui-frontend-package
1.49.6) instead of the pinned 0.3.75 (1.32.9). Screenshot: tests/artifacts/timing_widget_error.png is
overwritten by the later of the two; this one also writes tests/artifacts/timing_widget_current.png."""
import pytest

import test_widget_browser as W
from test_widget_browser import (test_widget_shows_a_clean_empty_state,  # noqa: F401  (run here too)
                                 test_widget_shows_known_runs_as_hand_written_text)


@pytest.fixture(scope="module")
def browser_page(comfy_server_current):
    yield from W.open_page(comfy_server_current)


def test_current_frontend_version_and_no_page_errors(browser_page, comfy_server_current):
    """The page is the current frontend and the pack's extensions loaded without a page error."""
    version = browser_page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__ || null")
    assert version == "1.49.6", version
    assert browser_page.evaluate("() => typeof window.__int8Fused") == "object"
    page = browser_page
    node_id = page.evaluate(f"""() => {{ app.graph.clear();
      const n = LiteGraph.createNode("{W.APPLY}"); n.pos = [100, 100]; app.graph.add(n); return String(n.id); }}""")
    got = page.evaluate(W.KNOWN, [node_id, "known-other"])
    page.evaluate("""(id) => { const n = app.graph.getNodeById(Number(id));
      n.widgets.find((w) => w.name === "int8_timing").element.querySelector("details").open = true;
      window.__int8Fused.renderAll(); app.canvas.ds.scale = 1; app.canvas.ds.offset = [300, 100];
      app.graph.setDirtyCanvas(true, true); }""", node_id)
    page.wait_for_timeout(500)
    W.ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(W.ARTIFACTS / "timing_widget_current.png"))
    assert got["failed"]["stats"] == "error: RuntimeError: CUDA out of memory"
    assert not page.errors, page.errors
