"""The timing widget shows the attention backend next to the GEMM backend (web/int8_fused.js), in a real browser on
the pinned ComfyUI server (the page and server of tests/test_widget_browser.py). Runs with known attention fields are
sent through the widget's WebSocket listeners, as nodes/timing.py sends them; the texts are written out by hand, and
every comparison row lies within its node in the classic and the Nodes 2.0 design (screenshots
tests/artifacts/timing_widget_attention_{classic,nodes2}.png)."""
import pytest

from test_widget_browser import APPLY, ARTIFACTS, _set_nodes2, assert_rows_fit, open_page

pytestmark = pytest.mark.browser
MID = "\u00b7"


@pytest.fixture(scope="module")
def page(comfy_server):
    yield from open_page(comfy_server)


SEND = """([id, other]) => {
  const api = window.comfyAPI.api.api;
  const send = (type, detail) => api.dispatchEvent(new CustomEvent(type, { detail }));
  const read = (nid) => {
    const e = document.querySelector(`.int8-timing[data-node="${nid}"]`);
    return { badge: e.querySelector(".int8-badge").textContent, attention: e.dataset.attention,
             compare: [...e.querySelectorAll(".int8-compare li")].map((li) => li.textContent),
             self: [...e.querySelectorAll(".int8-compare li.int8-self")].map((li) => li.textContent) };
  };
  const n = app.graph.getNodeById(Number(id));
  const aw = n.widgets.find((w) => w.name === "attention");
  const out = { widgetDefault: aw.value, backendWidget: n.widgets.find((w) => w.name === "backend").value };
  aw.value = "cudnn"; aw.callback?.(aw.value);
  out.picked = read(id);
  const base = { workload: "attn-known 1x128x4x4", status: "ok", error: null, timer: "cuda_events", calls: 4,
                 device: "NVIDIA H200" };
  send("int8_fused.step", { run: "attn-known-2", group: "attn-known-2", node: id, backend: "fused_triton",
    backend_requested: "fused_triton", backends: { fused_triton: 124 }, attention: "flash",
    attention_requested: "cudnn", attentions: { flash: 68 }, device: "NVIDIA H200", step: 0, steps: 2,
    seconds: 0.2, branches: { cond: 0.2 }, calls: 2 });
  out.live = read(id);
  send("int8_fused.summary", { ...base, run: "attn-known-0", group: "attn-known-0", node: other, backend: "bf16",
    backend_requested: "bf16", backends: {}, steps: 2, step_seconds: [1, 1], mean: 1, median: 1, total: 2,
    started: 1 });
  send("int8_fused.summary", { ...base, run: "attn-known-1", group: "attn-known-1", node: other,
    backend: "fused_triton", backend_requested: "fused_triton", backends: { fused_triton: 124 },
    attention: "comfy_default", attention_requested: "comfy_default", attentions: {}, steps: 2,
    step_seconds: [0.25, 0.25], mean: 0.25, median: 0.25, total: 0.5, started: 2 });
  send("int8_fused.summary", { ...base, run: "attn-known-2", group: "attn-known-2", node: id,
    backend: "fused_triton", backend_requested: "fused_triton", backends: { fused_triton: 124 },
    attention: "cudnn", attention_requested: "auto", attentions: { cudnn: 64, flash: 4 }, steps: 2,
    step_seconds: [0.2, 0.2], mean: 0.2, median: 0.2, total: 0.4, started: 3 });
  out.done = read(id);
  out.other = read(other);
  return out;
}"""


def test_badge_and_comparison_show_the_attention_that_ran(page):
    ids = page.evaluate(f"""() => [0, 1].map((i) => {{
      const n = LiteGraph.createNode("{APPLY}"); n.pos = [100 + 400 * i, 1400]; app.graph.add(n);
      return String(n.id); }})""")
    fits = {}
    try:
        got = page.evaluate(SEND, ids)
        for design in ("classic", "nodes2"):  # each node's rows within its box, at the default width
            _set_nodes2(page, design == "nodes2")
            page.evaluate("""(id) => { const [x, y] = app.graph.getNodeById(Number(id)).pos;
              app.canvas.ds.scale = 1; app.canvas.ds.offset = [-x + 300, -y + 140];
              app.graph.setDirtyCanvas(true, true); }""", ids[0])
            page.wait_for_function("""([ids, vue]) => ids.every((id) => {
                const e = document.querySelector(`.int8-timing[data-node="${id}"]`);
                return e && e.getBoundingClientRect().height > 0 && !!e.closest("[data-node-id]") === vue; })""",
                                   arg=[ids, design == "nodes2"], timeout=60_000)
            page.wait_for_timeout(500)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"timing_widget_attention_{design}.png"))
            fits[design] = [assert_rows_fit(page, i)["vue"] for i in ids]
    finally:
        _set_nodes2(page, False)
        page.evaluate("""(ids) => {
          const s = window.__int8Fused.state;
          s.runs = s.runs.filter((r) => !String(r.run).startsWith("attn-known-"));
          s.live.delete("attn-known-2");
          for (const id of ids) app.graph.remove(app.graph.getNodeById(Number(id)));
          window.__int8Fused.renderAll(); }""", ids)
    assert got["widgetDefault"] == "auto"
    assert got["picked"]["badge"] == f"{got['backendWidget']} {MID} attn cudnn"  # before a run: the node's choice
    assert got["picked"]["attention"] == "cudnn"
    assert got["live"]["badge"] == f"fused_triton {MID} attn flash (requested cudnn) {MID} NVIDIA H200"
    assert got["done"]["badge"] == (f"fused_triton {MID} attn cudnn (auto; 4 of 68 calls on flash) {MID} "
                                    "NVIDIA H200")
    assert got["done"]["attention"] == "cudnn"
    # ComfyUI's own attention: no attention in the badge, as before the attention input existed.
    assert got["other"]["badge"] == f"fused_triton {MID} NVIDIA H200" and got["other"]["attention"] == "comfy_default"
    # The same GEMM backend with another attention is its own row (ratios to bf16: 1 / 0.2, 1 / 0.25).
    rows = [f"fused_triton {MID} attn cudnn 0.2 s/step, 5\u00d7 bf16", "fused_triton 0.25 s/step, 4\u00d7 bf16",
            "bf16 1 s/step (baseline)"]
    assert got["done"]["compare"] == rows and got["done"]["self"] == rows[:1]
    assert got["other"]["compare"] == rows and got["other"]["self"] == rows[1:2]
    assert fits == {"classic": [False, False], "nodes2": [True, True]}
    assert [e for e in page.errors if "int8" in e.lower()] == []
