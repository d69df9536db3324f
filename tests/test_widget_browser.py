"""The timing widget in a real browser: Debian chromium (playwright) on the pinned ComfyUI server.

The miniature example workflow (example_workflows/, the pack's Apply node on a random-weight
miniature model) is loaded into the frontend and queued from the UI (app.queuePrompt) once per
backend, switching the Apply node's backend in between, the way a user compares backends. The
widget must show the backend and device, one time per step, exactly the numbers the server reported
(GET /int8_fused/runs and the int8_fused.step WebSocket events) and the side-by-side comparison;
after a page reload the runs come back from the route. Screenshot: tests/artifacts/timing_widget.png.
"""
import json
from pathlib import Path

import pytest
import requests

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

# The same texts computed by the page's formatting module from the server's numbers.
EXPECT = """([run, all]) => {
  const f = window.__int8Fused.fmt;
  const rows = f.compareRows(f.mergeRuns(all), run.workload);
  return { badge: f.badgeText(run.backend, run.device), stats: f.statsText(run),
           steps: run.step_seconds.map(f.fmtSeconds), compare: rows.map((r) => r.label) };
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


def _example_workflow():
    """The example workflow that runs on the miniature model (the others need real checkpoints)."""
    for p in sorted((ROOT / "example_workflows").glob("*.json")):
        text = p.read_text()
        if f'"{APPLY}"' in text and "int8fused_miniature" in text:
            return p.name, json.loads(text)
    pytest.fail(f"no example workflow with {APPLY} on a miniature model in example_workflows/")


@pytest.fixture(scope="module")
def browser_page(comfy_server):
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
        expect = page.evaluate(EXPECT, [run, runs])
        assert w["badge"] == expect["badge"] == f"{a['backend']} \u00b7 cpu"
        assert w["stats"] == expect["stats"] and w["steps"] == expect["steps"]
        # Side by side: the latest run of each backend, the quantized one as a ratio to bf16.
        assert w["compare"] == expect["compare"] and w["compareShown"]
        assert {c.split(" ")[0] for c in w["compare"]} >= set(CPU_BACKENDS)
        assert any(c.startswith(f"{a['backend']} ") and c.endswith("\u00d7 bf16") for c in w["compare"])

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.evaluate(SHOWCASE, ids[0])
    page.wait_for_timeout(800)
    page.screenshot(path=str(ARTIFACTS / "timing_widget.png"))

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
        page.screenshot(path=str(ARTIFACTS / "timing_widget_nodes2.png"))
    finally:
        page.evaluate("() => app.extensionManager.setting.set('Comfy.VueNodes.Enabled', false)")
    assert [e for e in page.errors if "int8" in e.lower()] == []
