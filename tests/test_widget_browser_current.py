"""The timing widget in the current frontend: the same browser checks as tests/test_widget_browser.py (empty
state; known runs, written out by hand; the miniature demo graph sampled from the UI; the side-by-side rows within
the node in the classic and the Nodes 2.0 design), on ComfyUI 0.33.0's server and its frontend
(comfyui-frontend-package 1.49.6) instead of the pinned 0.3.75 (1.32.9). Screenshots: tests/artifacts/
timing_widget_error.png is overwritten by the later of the two; this one also writes timing_widget_current.png,
timing_widget_1.49.6.png, timing_widget_nodes2_1.49.6.png and timing_widget_fit_{classic,nodes2}_1.49.6.png."""
import pytest

import test_widget_browser as W
from test_widget_browser import (test_comparison_rows_fit_the_node_in_both_designs,  # noqa: F401  (run here too)
                                 test_widget_shows_a_clean_empty_state,
                                 test_widget_shows_backend_and_the_servers_per_step_times,
                                 test_widget_shows_known_runs_as_hand_written_text)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def comfy_server(comfy_server_current):
    """The tests imported from test_widget_browser.py talk to the current server."""
    return comfy_server_current


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
