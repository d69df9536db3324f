"""The timing widget in a real browser: Debian chromium (playwright) on the pinned ComfyUI server.

The miniature example workflow (example_workflows/, the pack's Apply node on a random-weight
miniature model) is loaded into the frontend and queued from the UI (app.queuePrompt) once per
backend, switching the Apply node's backend in between, the way a user compares backends. The
widget must show the backend and device, one time per step, exactly the numbers the server reported
(GET /int8_fused/runs and the int8_fused.step WebSocket events) and the side-by-side comparison;
after a page reload the runs come back from the route. Screenshot: tests/artifacts/timing_widget.png.
The printed texts of those (measured) runs are read back to numbers and checked against the server's
to their 3 significant digits; the exact texts are checked, written out by hand, on runs with known
numbers sent through the widget's event listeners (a fallback backend, a failed run; screenshot
tests/artifacts/timing_widget_error.png). In the classic and the Vue-rendered "Nodes 2.0" design (the user
setting Comfy.VueNodes.Enabled), every side-by-side row (backend, attention once, s/step, ratio to bf16) must lie
within the node's box at its default width, uncut (screenshots tests/artifacts/timing_widget_fit_<design>.png, and
the demo graph's timing_widget.png / timing_widget_nodes2.png; on another frontend than the pinned one, the names
end in _<its version>).
"""
import json
import re
import statistics
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
APPLY = "ApplyFusedInt8GEMM"
STEPS = 2
# Backends a 2-core CPU samples the miniature with in seconds (torch._int_mm is ~10x slower there).
CPU_BACKENDS = ("bf16", "dequant_bf16")

# Makes the loaded workflow CPU-sized and sets every Apply node's backend; returns the Apply nodes.
PREPARE = """(a) => {
  const out = [];
  for (const n of app.graph._nodes) {
    const w = (name) => n.widgets?.find((x) => x.name === name);
    if (w("steps")) w("steps").value = a.steps;
    if (/Latent/.test(n.type) && w("width") && w("height")) { w("width").value = 32; w("height").value = 32; }
    if (n.type === a.apply) { w("backend").value = a.backend; out.push({ id: String(n.id), backend: a.backend }); }
  }
  app.graph.setDirtyCanvas(true, true);
  return out;
}"""

# What every Apply widget shows, as data and as text.
READ = """() => [...document.querySelectorAll(".int8-timing")].map((e) => ({
  node: e.dataset.node, run: e.dataset.run, backend: e.dataset.backend, device: e.dataset.device,
  finished: e.dataset.finished, stepSeconds: JSON.parse(e.dataset.stepSeconds || "[]"),
  badge: e.querySelector(".int8-badge").textContent, stats: e.querySelector(".int8-stats").textContent,
  steps: [...e.querySelectorAll("li.int8-step")].map((li) => li.textContent),
  compare: [...e.querySelectorAll(".int8-compare li")].map((li) => li.textContent),
  compareShown: e.querySelector(".int8-compare").style.display !== "none",
  visible: e.getBoundingClientRect().height > 0,
}))"""

# Known runs sent through the widget's WebSocket listeners (int8_fused.step / int8_fused.summary,
# dispatched on the page's api object), read back after each event.
KNOWN = """([id, other]) => {
  const api = window.comfyAPI.api.api;
  const send = (type, detail) => api.dispatchEvent(new CustomEvent(type, { detail }));
  const read = () => {
    const e = document.querySelector(`.int8-timing[data-node="${id}"]`);
    return { backend: e.dataset.backend, requested: e.dataset.backendRequested,
             badge: e.querySelector(".int8-badge").textContent,
             progress: e.querySelector(".int8-progress").textContent,
             stats: e.querySelector(".int8-stats").textContent,
             steps: [...e.querySelectorAll("li.int8-step")].map((li) => li.textContent),
             compare: [...e.querySelectorAll(".int8-compare li")].map((li) => li.textContent),
             chart: e.querySelector(".int8-chart").style.display };
  };
  const fell = { node: id, backend: "torch_int_mm", backend_requested: "fused_triton",
                 backends: { torch_int_mm: 3, dequant_bf16: 1 }, device: "cpu" };
  const out = {};
  send("int8_fused.step", { run: "known-1", group: "known-1", ...fell, step: 0, steps: 3, seconds: 0.05,
                            branches: { "cond+uncond": 0.05 }, calls: 1 });
  out.live = read();
  send("int8_fused.summary", { run: "known-0", group: "known-0", node: other, backend: "bf16",
    backend_requested: "bf16", backends: {}, device: "cpu", workload: "known 1x16x4x4", status: "ok",
    error: null, timer: "perf_counter", steps: 3, step_seconds: [1.5, 1.5, 1.5], mean: 1.5, median: 1.5,
    total: 4.5, calls: 3, started: 1 });
  send("int8_fused.summary", { run: "known-1", group: "known-1", ...fell, workload: "known 1x16x4x4",
    status: "ok", error: null, timer: "perf_counter", steps: 3, step_seconds: [0.05, 0.25, 1.5], mean: 0.6,
    median: 0.25, total: 1.8, calls: 3, started: 2 });
  out.done = read();
  send("int8_fused.summary", { run: "known-2", group: "known-2", node: id, backend: "fused_triton",
    backend_requested: "fused_triton", backends: { fused_triton: 120, torch_int_mm: 4 }, device: "NVIDIA H200",
    workload: "known 1x16x4x4", status: "error", error: "RuntimeError: CUDA out of memory", timer: "cuda_events",
    steps: 0, step_seconds: [], mean: null, median: null, total: 0, calls: 0, started: 3 });
  out.failed = read();
  return out;
}"""


# For the screenshot: per-step list open, nodes the grown Apply node now covers moved below it.
SHOWCASE = """(id) => {
  const n = app.graph.getNodeById(Number(id));
  n.widgets.find((w) => w.name === "int8_timing").element.querySelector("details").open = true;
  window.__int8Fused.renderAll();
  const [x, y] = n.pos, [w, h] = n.size;
  for (const o of app.graph._nodes) {
    if (o === n) continue;
    const [ox, oy] = o.pos, [ow, oh] = o.size;
    if (ox < x + w && ox + ow > x && oy < y + h + 40 && oy + oh > y) o.pos = [ox, y + h + 60];
  }
  app.canvas.ds.scale = 1;
  app.canvas.ds.offset = [-x + 520, -y + 140];
  app.graph.setDirtyCanvas(true, true);
}"""


PINNED_FRONTEND = "1.32.9"


def _shot(page, name):
    """Screenshot tests/artifacts/<name>.png; on a frontend other than the pinned one <name>_<version>.png."""
    version = page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__ || null")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / (f"{name}.png" if version in (None, PINNED_FRONTEND) else f"{name}_{version}.png")
    page.screenshot(path=str(path))
    return path


def _example_workflow():
    """The example workflow that runs on the miniature model (the others need real checkpoints)."""
    for p in sorted((ROOT / "example_workflows").glob("*.json")):
        text = p.read_text()
        if f'"{APPLY}"' in text and "int8fused_miniature" in text:
            return p.name, json.loads(text)
    pytest.fail(f"no example workflow with {APPLY} on a miniature model in example_workflows/")


@pytest.fixture(scope="module")
def browser_page(comfy_server):
    yield from open_page(comfy_server)


def open_page(comfy_server):
    """The server's frontend in Debian chromium, ready (the pack's widget module loaded)."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/setup_runtime.sh (apt-get install chromium)")
    from playwright.sync_api import sync_playwright
    # The first-run template browser would cover the canvas; start in the classic (LiteGraph) nodes.
    requests.post(comfy_server.url + "/settings/Comfy.TutorialCompleted", json=True, timeout=30)
    requests.post(comfy_server.url + "/settings/Comfy.VueNodes.Enabled", json=False, timeout=30)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.errors = []
        page.on("pageerror", lambda e: page.errors.append(str(e)))
        page.goto(comfy_server.url)
        page.wait_for_function("() => window.app?.graph && window.__int8Fused", timeout=120_000)
        yield page
        browser.close()


def _listen_for_prompts(page):
    page.evaluate("""() => { window.__pids = [];
      window.comfyAPI.api.api.addEventListener("execution_start", (e) => window.__pids.push(e.detail.prompt_id)); }""")


def test_widget_shows_a_clean_empty_state(browser_page):
    page = browser_page
    info = page.evaluate(f"""() => {{
      const n = LiteGraph.createNode("{APPLY}"); n.pos = [100, 100]; app.graph.add(n);
      const e = n.widgets.find((w) => w.name === "int8_timing").element;
      window.__int8Fused.state.runs = window.__int8Fused.state.runs.filter((r) => r.node !== String(n.id));
      window.__int8Fused.renderAll();
      const out = {{ text: e.innerText, backend: e.dataset.backend,
                    chart: e.querySelector(".int8-chart").style.display }};
      app.graph.remove(n);
      return out;
    }}""")
    assert info["text"].startswith(info["backend"]) and info["backend"]
    assert "No run yet" in info["text"] and "NaN" not in info["text"] and "undefined" not in info["text"]
    assert info["chart"] == "none"


def test_widget_shows_known_runs_as_hand_written_text(browser_page):
    """Runs with known numbers, sent as the server sends them: the widget's texts are written out here
    by hand (fmt's rules: 3 significant digits, ms below 0.1 s; ratio = baseline mean / mean)."""
    page = browser_page
    node_id = page.evaluate(f"""() => {{
      const n = LiteGraph.createNode("{APPLY}"); n.pos = [100, 700]; app.graph.add(n); return String(n.id); }}""")
    try:
        got = page.evaluate(KNOWN, [node_id, "known-other"])
        page.evaluate("""(id) => { const [x, y] = app.graph.getNodeById(Number(id)).pos;
          app.canvas.ds.scale = 1; app.canvas.ds.offset = [-x + 520, -y + 140];
          app.graph.setDirtyCanvas(true, true); }""", node_id)
        page.wait_for_timeout(500)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "timing_widget_error.png"))
    finally:
        page.evaluate("""(id) => {
          const s = window.__int8Fused.state;
          s.runs = s.runs.filter((r) => !String(r.run).startsWith("known-"));
          s.live.delete("known-1");
          app.graph.remove(app.graph.getNodeById(Number(id)));
          window.__int8Fused.renderAll(); }""", node_id)
    fell = "torch_int_mm (fallback from fused_triton; 1 of 4 layers on dequant_bf16) \u00b7 cpu"
    live, done, failed = got["live"], got["done"], got["failed"]
    assert (live["backend"], live["requested"], live["badge"]) == ("torch_int_mm", "fused_triton", fell)
    assert live["progress"] == "step 1/3"
    assert live["stats"] == "mean 50 ms/step \u00b7 median 50 ms/step \u00b7 total 50 ms"
    assert live["steps"] == ["50 ms"]
    assert (done["backend"], done["badge"], done["progress"]) == ("torch_int_mm", fell, "3 steps")
    assert done["stats"] == "mean 0.6 s/step \u00b7 median 0.25 s/step \u00b7 total 1.8 s"
    assert done["steps"] == ["50 ms", "0.25 s", "1.5 s"]
    # Compared under the backend that ran (1.5 / 0.6 = 2.5), never under the requested fused_triton.
    assert done["compare"] == ["torch_int_mm 0.6 s/step, 2.5\u00d7 bf16", "bf16 1.5 s/step (baseline)"]
    assert failed["badge"] == "fused_triton (4 of 124 layers on torch_int_mm) \u00b7 NVIDIA H200"
    assert failed["stats"] == "error: RuntimeError: CUDA out of memory"
    assert failed["progress"] == "0 steps" and failed["steps"] == []
    assert (done["chart"], failed["chart"]) == ("", "none")  # no empty chart for a run without steps
    assert failed["compare"] == done["compare"]  # a failed run is not a timing to compare


# Where each comparison row's parts are on screen, and the box of the node the widget sits in: the node's DOM
# element in the Vue-rendered nodes ("Nodes 2.0"), else its LiteGraph box (title bar included) on the canvas.
ROW_BOXES = """(id) => {
  const e = document.querySelector(`.int8-timing[data-node="${id}"]`);
  const box = (r) => ({ left: r.left, top: r.top, right: r.right, bottom: r.bottom });
  const vue = e.closest("[data-node-id]");
  let node;
  if (vue) node = box(vue.getBoundingClientRect());
  else {
    const n = app.graph.getNodeById(Number(id)), ds = app.canvas.ds;
    const c = app.canvas.canvas.getBoundingClientRect(), th = LiteGraph.NODE_TITLE_HEIGHT;
    const left = c.left + (n.pos[0] + ds.offset[0]) * ds.scale, top = c.top + (n.pos[1] - th + ds.offset[1]) * ds.scale;
    node = { left, top, right: left + n.size[0] * ds.scale, bottom: top + (n.size[1] + th) * ds.scale };
  }
  const rows = [...e.querySelectorAll(".int8-compare li")].map((li) => ({
    text: li.textContent, box: box(li.getBoundingClientRect()),
    parts: [...li.querySelectorAll("*")].map((p) => ({ text: p.textContent, box: box(p.getBoundingClientRect()),
      clipped: p.scrollWidth > p.clientWidth + 1 || p.scrollHeight > p.clientHeight + 1 })),
  }));
  return { vue: !!vue, node, widget: box(e.getBoundingClientRect()), rows,
           rowsClass: e.querySelector(".int8-compare").className };
}"""


def _outside(inner, outer, tol=0.5):
    """How far ``inner`` reaches past ``outer`` on each side (px), only the sides where it does."""
    past = {"left": outer["left"] - inner["left"], "top": outer["top"] - inner["top"],
            "right": inner["right"] - outer["right"], "bottom": inner["bottom"] - outer["bottom"]}
    return {k: round(v, 1) for k, v in past.items() if v > tol}


def assert_rows_fit(page, node_id, got=None):
    """Every comparison row, and every part of it, lies within the widget and the widget within the node;
    no part's text is cut (ellipsis or clipped). Returns what was measured (``got``: measured before)."""
    got = got or page.evaluate(ROW_BOXES, node_id)
    assert got["rows"], got
    assert not _outside(got["widget"], got["node"]), (got["widget"], got["node"])
    for row in got["rows"]:
        for item in [row] + row["parts"]:
            assert not _outside(item["box"], got["node"]), (item["text"], _outside(item["box"], got["node"]), got)
            assert not _outside(item["box"], got["widget"]), (item["text"], _outside(item["box"], got["widget"]))
        assert not [p["text"] for p in row["parts"] if p["clipped"]], row
    return got


# Runs as the miniature demo graph makes them (attention auto, which on a CPU runs ComfyUI's own), with known
# means: bf16 0.2516 s, torch_int_mm 0.139 s (1.81x), dequant_bf16 0.93 s (0.271x).
DEMO_RUNS = """([id, other]) => {
  const api = window.comfyAPI.api.api;
  const send = (detail) => api.dispatchEvent(new CustomEvent("int8_fused.summary", { detail }));
  const base = { device: "cpu", workload: "fit 1x16x4x4", status: "ok", error: null, timer: "perf_counter",
                 attention: "comfy_default", attention_requested: "auto", attentions: {}, steps: 2, calls: 2 };
  const run = (i, node, backend, mean) => send({ ...base, run: `fit-${i}`, group: `fit-${i}`, node, backend,
    backend_requested: backend, backends: backend === "bf16" ? {} : { [backend]: 12 },
    step_seconds: [mean, mean], mean, median: mean, total: 2 * mean, started: i });
  run(1, other, "bf16", 0.2516);
  run(2, other, "dequant_bf16", 0.93);
  run(3, id, "torch_int_mm", 0.139);
}"""

DEMO_ROWS = [  # written out by hand: backend, attention once, s/step, ratio to bf16's mean
    "torch_int_mm \u00b7 attn comfy_default 0.139 s/step, 1.81\u00d7 bf16",
    "bf16 \u00b7 attn comfy_default 0.252 s/step (baseline)",
    "dequant_bf16 \u00b7 attn comfy_default 0.93 s/step, 0.271\u00d7 bf16",
]


# The node's width (node.size), and in Nodes 2.0 its element's width with and without the widget shown.
NODE_WIDTHS = """(id) => {
  const e = document.querySelector(`.int8-timing[data-node="${id}"]`), vue = e.closest("[data-node-id]");
  const out = { size: app.graph.getNodeById(Number(id)).size[0] };
  if (vue) {
    out.with = vue.getBoundingClientRect().width;
    e.style.display = "none";
    out.without = vue.getBoundingClientRect().width;
    e.style.display = "";
  }
  return out;
}"""


def _set_nodes2(page, on):
    """Switch the frontend between its classic (LiteGraph-drawn) nodes and the Vue-rendered "Nodes 2.0"
    (the user setting Comfy.VueNodes.Enabled)."""
    page.evaluate("(on) => app.extensionManager.setting.set('Comfy.VueNodes.Enabled', on)", on)


def test_comparison_rows_fit_the_node_in_both_designs(browser_page):
    """At the Apply node's default width, the side-by-side rows of the demo graph's runs show backend,
    attention (once), s/step and the ratio to bf16 inside the node, in the classic and the Nodes 2.0 design."""
    page = browser_page
    ids = page.evaluate(f"""() => [0, 1].map((i) => {{
      const n = LiteGraph.createNode("{APPLY}"); n.pos = [100 + 700 * i, 2600]; app.graph.add(n);
      return String(n.id); }})""")
    measured = {}
    try:
        default_width = page.evaluate("(id) => app.graph.getNodeById(Number(id)).size[0]", ids[0])
        page.evaluate(DEMO_RUNS, ids)
        for design in ("classic", "nodes2"):
            _set_nodes2(page, design == "nodes2")
            page.evaluate("""(id) => { const n = app.graph.getNodeById(Number(id)); const [x, y] = n.pos;
              app.canvas.ds.scale = 1; app.canvas.ds.offset = [-x + 400, -y + 140];
              app.graph.setDirtyCanvas(true, true); }""", ids[0])
            page.wait_for_function("""([id, vue]) => {
                const e = document.querySelector(`.int8-timing[data-node="${id}"]`);
                return e && e.getBoundingClientRect().height > 0 && !!e.closest("[data-node-id]") === vue; }""",
                                   arg=[ids[0], design == "nodes2"], timeout=60_000)
            page.wait_for_timeout(800)
            _shot(page, f"timing_widget_fit_{design}")
            measured[design] = (page.evaluate(NODE_WIDTHS, ids[0]), page.evaluate(ROW_BOXES, ids[0]))
        # A node widened by the user: each row back on one line, still within the node.
        _set_nodes2(page, False)
        wide = page.evaluate("""(id) => { const n = app.graph.getNodeById(Number(id)); n.setSize([620, n.size[1]]);
          app.canvas.ds.scale = 1; app.canvas.ds.offset = [-n.pos[0] + 400, -n.pos[1] + 140];
          app.graph.setDirtyCanvas(true, true);
          return document.querySelector(`.int8-timing[data-node="${id}"] .int8-compare`).className; }""", ids[0])
        page.wait_for_timeout(500)
        wide_rows = page.evaluate(ROW_BOXES, ids[0])
    finally:
        _set_nodes2(page, False)
        page.evaluate("""(ids) => {
          const s = window.__int8Fused.state;
          s.runs = s.runs.filter((r) => !String(r.run).startsWith("fit-"));
          for (const id of ids) app.graph.remove(app.graph.getNodeById(Number(id)));
          window.__int8Fused.renderAll(); }""", ids)
    for design, (width, got) in measured.items():  # both designs measured (and shot) before either is judged
        assert got["vue"] == (design == "nodes2")
        assert [r["text"] for r in got["rows"]] == DEMO_ROWS, design
        assert_rows_fit(page, ids[0], got)
        # not widened to make room: the classic node keeps its default width; a Vue node is as wide without the
        # widget as with it (the frontend's own minimum width applies there)
        assert width["size"] == default_width if design == "classic" else width["with"] == width["without"], width
    assert "int8-two" in measured["classic"][1]["rowsClass"] and wide == "int8-compare"
    assert_rows_fit(page, ids[0], wide_rows)
    assert all(r["box"]["bottom"] - r["box"]["top"] <= 17 for r in wide_rows["rows"]), wide_rows  # one line each
    assert [e for e in page.errors if "int8" in e.lower()] == []


_SECONDS = re.compile(r"^(\d+(?:\.\d+)?) (ms|s)$")


def _seconds(text):
    """A time the widget printed ("42.9 ms", "0.213 s") back to seconds."""
    m = _SECONDS.match(text)
    assert m, text
    return float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)


def _shown(text, value):
    """``text`` prints ``value`` seconds to 3 significant digits (so within half a unit of the 3rd)."""
    return _seconds(text) == pytest.approx(value, rel=5.01e-3)


_STATS = re.compile(r"^mean (.+)/step \u00b7 median (.+)/step \u00b7 total (.+)$")
_KEY = r"\S+(?: \u00b7 attn \S+)?"  # a backend, compared under its attention when that was routed
_ROW = re.compile(rf"^({_KEY}) (.+)/step(?:, (\d+(?:\.\d+)?)\u00d7 ({_KEY})| \(baseline\))?$")
ATTN = " \u00b7 attn comfy_default"  # the workflows' attention: the default, auto, which on a CPU runs ComfyUI's


def _expected_rows(runs, workload):
    """The comparison from the server's runs: the latest ok run of each backend, fastest first."""
    latest = {}
    for r in runs:
        if r["status"] == "ok" and r["steps"] and r["workload"] == workload:
            if r["backend"] not in latest or r["started"] >= latest[r["backend"]]["started"]:
                latest[r["backend"]] = r
    return sorted(latest.values(), key=lambda r: r["mean"])


def _queue_and_wait(page, comfy_server, ids, before, watch_live=False):
    page.evaluate("() => { window.__pids = []; return app.queuePrompt(0, 1); }")
    page.wait_for_function("() => window.__pids.length > 0", timeout=120_000)
    if watch_live:  # a slow backend: the chart fills step by step while the sampler runs
        live = page.wait_for_function("""([ids, before]) => ids.map((id) => {
            const e = document.querySelector(`.int8-timing[data-node="${id}"]`);
            if (!e || e.dataset.finished !== "false" || before.includes(e.dataset.run)) return null;
            const n = JSON.parse(e.dataset.stepSeconds).length;
            return n >= 1 ? [n, e.querySelector(".int8-progress").textContent] : null; }).every(Boolean)
            && ids.map((id) => document.querySelector(`.int8-timing[data-node="${id}"] .int8-progress`).textContent)""",
                                      arg=[ids, sorted(before)], timeout=600_000, polling=100).json_value()
        assert all(p.startswith("step ") and p.endswith(f"/{STEPS}") for p in live), live
    comfy_server.wait(page.evaluate("() => window.__pids[0]"), timeout=900)
    page.wait_for_function("""([ids, before]) => ids.every((id) => {
        const e = document.querySelector(`.int8-timing[data-node="${id}"]`);
        return e && e.dataset.finished === "true" && !before.includes(e.dataset.run); })""",
                           arg=[ids, sorted(before)], timeout=60_000)


def test_widget_shows_backend_and_the_servers_per_step_times(browser_page, comfy_server, miniature_models):
    page = browser_page
    _listen_for_prompts(page)
    name, workflow = _example_workflow()
    page.evaluate("(w) => app.loadGraphData(w)", workflow)
    start = {r["run"] for r in comfy_server.get_json("/int8_fused/runs")["runs"]}
    for backend in CPU_BACKENDS:  # the same graph, the backend switched between runs
        applies = page.evaluate(PREPARE, {"steps": STEPS, "apply": APPLY, "backend": backend})
        assert applies, f"no {APPLY} node in {name}"
        ids = [a["id"] for a in applies]
        before = {r["run"] for r in comfy_server.get_json("/int8_fused/runs")["runs"]}
        _queue_and_wait(page, comfy_server, ids, before, watch_live=backend != "bf16")

    runs = comfy_server.get_json("/int8_fused/runs")["runs"]
    new = [r for r in runs if r["run"] not in start]
    shown = {w["node"]: w for w in page.evaluate(READ)}
    ws_steps = [e["data"] for e in comfy_server.events if e.get("type") == "int8_fused.step"]
    for a in applies:
        mine = [r for r in new if r["node"] == a["id"]]
        assert [r["backend"] for r in mine] == list(CPU_BACKENDS)
        for r in mine:
            assert r["status"] == "ok" and r["device"] == "cpu" and r["timer"] == "perf_counter"
            assert r["steps"] == STEPS == len(r["step_seconds"]) and all(s > 0 for s in r["step_seconds"])
            assert [e["seconds"] for e in ws_steps if e["run"] == r["run"]] == r["step_seconds"]
        run, w = mine[-1], shown[a["id"]]
        assert w["visible"] and w["finished"] == "true" and w["run"] == run["run"]
        assert w["backend"] == a["backend"] == run["backend"] and w["device"] == "cpu"
        assert w["stepSeconds"] == run["step_seconds"]  # one time per step: the server's numbers
        # the workflows leave attention at the node's default, auto, which on a CPU runs ComfyUI's own
        assert w["badge"] == f"{a['backend']} \u00b7 attn comfy_default (auto) \u00b7 cpu"
        # The texts print the server's numbers (3 significant digits), recomputed here from its steps.
        secs = run["step_seconds"]
        mean_, median_, total_ = _STATS.match(w["stats"]).groups()
        assert _shown(mean_, sum(secs) / len(secs)) and _shown(median_, statistics.median(secs))
        assert _shown(total_, sum(secs))
        assert len(w["steps"]) == len(secs) and all(_shown(t, x) for t, x in zip(w["steps"], secs))
        # Side by side: the latest run of each backend, fastest first, each a ratio to bf16's mean.
        rows = _expected_rows(runs, run["workload"])
        base = next(r for r in rows if r["backend"] == "bf16")
        assert w["compareShown"] and len(w["compare"]) == len(rows)
        for text, r in zip(w["compare"], rows):
            name, mean_, ratio, vs = _ROW.match(text).groups()
            assert name == r["backend"] + ATTN and _shown(mean_, r["mean"])
            if r is base:
                assert text.endswith(" (baseline)")
            else:
                assert vs == "bf16" and float(ratio) == pytest.approx(base["mean"] / r["mean"], rel=5.01e-3)
        assert {c.split(" ")[0] for c in w["compare"]} >= set(CPU_BACKENDS)

    page.evaluate(SHOWCASE, ids[0])
    page.wait_for_timeout(800)
    _shot(page, "timing_widget")
    assert_rows_fit(page, ids[0])

    # A reloaded page gets the runs back from GET /int8_fused/runs.
    graph = json.loads(page.evaluate("() => JSON.stringify(app.graph.serialize())"))
    page.reload()
    page.wait_for_function("() => window.app?.graph && window.__int8Fused", timeout=120_000)
    page.evaluate("(w) => app.loadGraphData(w)", graph)
    page.wait_for_function("""(ids) => ids.every((id) =>
        document.querySelector(`.int8-timing[data-node="${id}"]`)?.dataset.finished === "true")""",
                           arg=ids, timeout=60_000)
    after = {w["node"]: w for w in page.evaluate(READ)}
    for a in applies:
        for key in ("run", "stepSeconds", "badge", "stats", "compare"):
            assert after[a["id"]][key] == shown[a["id"]][key], key

    # The same widget in the frontend's Vue-rendered nodes ("Nodes 2.0"), then back to classic.
    page.evaluate("() => app.extensionManager.setting.set('Comfy.VueNodes.Enabled', true)")
    try:
        page.wait_for_function("""(ids) => ids.every((id) => {
            const e = document.querySelector(`.int8-timing[data-node="${id}"]`);
            return e && e.dataset.finished === "true" && e.getBoundingClientRect().height > 0; })""",
                               arg=ids, timeout=60_000)
        vue = {w["node"]: w for w in page.evaluate(READ)}
        for a in applies:
            for key in ("run", "stepSeconds", "badge", "stats", "compare"):
                assert vue[a["id"]][key] == shown[a["id"]][key], key
        page.evaluate(SHOWCASE, ids[0])
        page.wait_for_timeout(800)
        _shot(page, "timing_widget_nodes2")
        assert assert_rows_fit(page, ids[0])["vue"]
    finally:
        page.evaluate("() => app.extensionManager.setting.set('Comfy.VueNodes.Enabled', false)")
    assert [e for e in page.errors if "int8" in e.lower()] == []
