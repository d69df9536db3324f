"""The widget while kernels are tuned, in a real browser (Debian chromium, playwright) on the pinned ComfyUI server.

Nothing tunes on a CPU (the GEMM autotune, tail splits and dispatch timings need CUDA), so a test-only custom node,
written here into a folder the server loads through ``--extra-model-paths-config`` (``custom_nodes``), tunes the
way the pack's GEMMs do: on the model's first call in the sampling thread, through the pack's own
``kernel.tuned.progress`` (three shapes after ``expect(3)``, three entries taken from the shipped tables). Each shape
waits for a gate file that the test writes once the browser shows that shape, so every state is seen without timing.
The miniature demo workflow is queued from the UI with that node between Apply and KSampler, and an Ideogram 4 loader
node added to the graph. The widget of both nodes must show "Tuning INT8 kernels for this GPU (first run only): shape
i/3 <kind> <label>, <time> s" for each shape, the time going on, then the session's summary and the shipped tables'
counts, also after a reload (GET /int8_fused/tuning); the server log has the same shapes and summary. Every tuning
line lies within the node, not cut, in the classic and the Nodes 2.0 design; a label too long for three lines ends in
an ellipsis with the whole text in its tooltip. Screenshots: tests/artifacts/tuning_widget_{active,active_nodes2,done}.png.
"""
import re
import textwrap
from pathlib import Path

import pytest

import comfy_harness as H
import test_widget_browser as W

pytestmark = pytest.mark.browser
PROBE = "Int8FusedTuningProbe"
LOADER = "LoadIdeogram4Int8"
HEAD = "Tuning INT8 kernels for this GPU (first run only): "
# (kind, cache key, detail) of the probe's shapes; the labels are progress.gemm_label of the keys, written out here
SHAPES = [("GEMM", "N=3072 K=3072 M<=4096 s8p", "12 candidates"),
          ("tail split", "N=3072 K=12288 M<=4096 s8p T32 split", "3 variants"),
          ("GEMM", "N=12288 K=3072 M<=4096 s8p", "12 candidates")]
SEEDED = "shipped tuned table: 2 gemm / 1 dispatch / 0 attention"

PROBE_SOURCE = '''
"""Test-only node (tests/test_tuning_widget_browser.py): a MODEL that tunes on its first call, as the pack's GEMMs do,
through the pack's kernel.tuned.progress; shape i waits for the file <gate>/<i>."""
import os
import sys
import time

SHAPES = [("GEMM", "N3072_K3072_M4096_s8p", "12 candidates"), ("tail split", "N3072_K12288_M4096_s8p_T32_split",
          "3 variants"), ("GEMM", "N12288_K3072_M4096_s8p", "12 candidates")]


def _progress():
    for name, mod in list(sys.modules.items()):
        if name.endswith(".kernel.tuned.progress") and hasattr(mod, "PROGRESS"):
            return mod
    raise RuntimeError("the pack's kernel.tuned.progress is not loaded")


def _wait(path, timeout=600.0):
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"no gate file {path}")
        time.sleep(0.05)


class Int8FusedTuningProbe:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "gate": ("STRING", {"default": ""})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "probe"
    CATEGORY = "testing"

    def probe(self, model, gate):
        import comfy.patcher_extension as pe
        m, done = model.clone(), []

        def first_call(executor, *args, **kwargs):
            if not done:
                done.append(True)
                p = _progress()
                for section in ("gemm", "gemm", "dispatch"):
                    p.seed_hit(section)
                p.expect(len(SHAPES))
                for i, (kind, key, detail) in enumerate(SHAPES, 1):
                    with p.task(kind, p.gemm_label(key), detail, os.path.join(gate, "cache.json")):
                        _wait(os.path.join(gate, str(i)))
            return executor(*args, **kwargs)

        m.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, "int8_fused_test.tuning_probe", first_call)
        return (m,)


NODE_CLASS_MAPPINGS = {"Int8FusedTuningProbe": Int8FusedTuningProbe}
'''


def start_probe_server(tmp_path_factory, comfy_dir=None, python=None):
    """A real ``main.py --cpu`` of ``comfy_dir`` (the pinned ComfyUI by default) with the pack and, from a folder of
    its own, the probe node; stopped when the generator is closed."""
    base = tmp_path_factory.mktemp("tuning_probe")
    node_dir = base / "nodes" / "tuning_probe"  # a module name the widget does not take for the pack's
    node_dir.mkdir(parents=True)
    (node_dir / "__init__.py").write_text(PROBE_SOURCE)
    cfg = base / "extra_paths.yaml"
    cfg.write_text(f"tuning_probe:\n  custom_nodes: {base / 'nodes'}\n")
    try:
        H.check_runtime()
    except RuntimeError as e:
        pytest.fail(str(e))
    server = H.ComfyServer(comfy_dir or H.COMFY_DIR, output_dir=base / "output", python=python,
                           extra_args=["--extra-model-paths-config", str(cfg)])
    server.start()
    try:
        assert PROBE in server.object_info(), server.log_tail()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def probe_server(tmp_path_factory):
    yield from start_probe_server(tmp_path_factory)


@pytest.fixture(scope="module")
def page(probe_server):
    yield from W.open_page(probe_server)


# The demo graph (CPU-sized, bf16) with the probe between Apply and KSampler and an unconnected Ideogram 4 loader
# below Apply (its note moved out of the way).
BUILD = """(a) => {
  const apply = app.graph._nodes.find((n) => n.type === a.apply);
  const sampler = app.graph._nodes.find((n) => n.type === "KSampler");
  for (const n of app.graph._nodes) if (n.type === "MarkdownNote") n.pos = [apply.pos[0] - 1500, apply.pos[1] + 1500];
  const probe = LiteGraph.createNode(a.probe);
  probe.pos = [sampler.pos[0], sampler.pos[1] + 450];
  app.graph.add(probe);
  probe.widgets.find((w) => w.name === "gate").value = a.gate;
  apply.connect(0, probe, 0);
  probe.connect(0, sampler, 0);
  const loader = LiteGraph.createNode(a.loader);
  loader.pos = [apply.pos[0], apply.pos[1] + 560];
  app.graph.add(loader);
  return [String(apply.id), String(loader.id)];
}"""

# The tuning block of a node's widget: each line's text, tooltip, box, whether cut; the node's box as ROW_BOXES has it.
TUNING = """(id) => {
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
  const lines = [...e.querySelectorAll(".int8-tuning > div")].map((d) => ({
    cls: d.className, text: d.textContent, title: d.title, box: box(d.getBoundingClientRect()),
    height: d.clientHeight, clamp: getComputedStyle(d).webkitLineClamp,
    clipped: d.scrollHeight > d.clientHeight + 1 || d.scrollWidth > d.clientWidth + 1 }));
  return { state: e.dataset.tuning, vue: !!vue, node, widget: box(e.getBoundingClientRect()), lines };
}"""

FOCUS = """(id) => { const n = app.graph.getNodeById(Number(id)); const [x, y] = n.pos;
  app.canvas.ds.scale = 1; app.canvas.ds.offset = [-x + 400, -y + 100]; app.graph.setDirtyCanvas(true, true); }"""

_NOW = re.compile(r"^" + re.escape(HEAD) + r"shape (\d+)/3 (.+), (\d+\.\d) s$")


def _tuning(page, node_id):
    return page.evaluate(TUNING, node_id)


def _assert_fits(got, cut_ok=False):
    """Every tuning line within the widget, the widget within the node; no line cut (``cut_ok``: clamped)."""
    assert got["lines"], got
    assert not W._outside(got["widget"], got["node"]), (got["widget"], got["node"])
    for line in got["lines"]:
        assert not W._outside(line["box"], got["node"]), (line["text"], got)
        assert not W._outside(line["box"], got["widget"]), (line["text"], got)
        assert cut_ok or not line["clipped"], line


def _wait_shape(page, node_id, i):
    page.wait_for_function("""([id, i]) => {
        const e = document.querySelector(`.int8-timing[data-node="${id}"]`);
        const t = e?.querySelector(".int8-tune-now")?.textContent ?? "";
        return e?.dataset.tuning === "active" && t.includes(`shape ${i}/3 `); }""",
                           arg=[node_id, i], timeout=300_000, polling=100)


def _seconds_shown(page, node_id):
    return float(_NOW.match(_tuning(page, node_id)["lines"][0]["text"]).group(3))


def test_widget_shows_tuning_with_progress_then_the_summary(page, probe_server, miniature_models, tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    W._listen_for_prompts(page)
    _, workflow = W._example_workflow()
    page.evaluate("(w) => app.loadGraphData(w)", workflow)
    page.evaluate(W.PREPARE, {"steps": W.STEPS, "apply": W.APPLY, "backend": "bf16"})
    apply_id, loader_id = page.evaluate(BUILD, {"apply": W.APPLY, "probe": PROBE, "loader": LOADER, "gate": str(gate)})
    assert page.evaluate("(id) => document.querySelector(`.int8-timing[data-node=\"${id}\"]`).dataset.tuning",
                         apply_id) == ""  # nothing tuned in this server yet
    page.evaluate("() => { window.__pids = []; return app.queuePrompt(0, 1); }")
    page.wait_for_function("() => window.__pids.length > 0", timeout=120_000)
    pid = page.evaluate("() => window.__pids[0]")
    page.evaluate(FOCUS, apply_id)
    seen = {}
    for i, (kind, label, detail) in enumerate(SHAPES, 1):
        _wait_shape(page, apply_id, i)
        if i == 1:  # the time goes on while the task runs, with no event from the server
            first = _seconds_shown(page, apply_id)
            page.wait_for_function("""([id, s]) => { const t = document.querySelector(
                `.int8-timing[data-node="${id}"] .int8-tune-now`).textContent;
                return parseFloat(t.match(/, (\\d+\\.\\d) s$/)[1]) > s; }""", arg=[apply_id, first], timeout=60_000)
            page.wait_for_timeout(300)
            W._shot(page, "tuning_widget_active")
        if i == 2:  # the same in the Vue-rendered nodes
            W._set_nodes2(page, True)
            try:
                page.wait_for_function("""(id) => { const e = document.querySelector(`.int8-timing[data-node="${id}"]`);
                    return e && !!e.closest("[data-node-id]") && e.getBoundingClientRect().height > 0; }""",
                                       arg=apply_id, timeout=60_000)
                page.evaluate(FOCUS, apply_id)
                page.wait_for_timeout(800)
                W._shot(page, "tuning_widget_active_nodes2")
                seen["nodes2"] = _tuning(page, apply_id)
            finally:
                W._set_nodes2(page, False)
            page.evaluate(FOCUS, apply_id)
            page.wait_for_timeout(500)
        seen[i] = {n: _tuning(page, n) for n in (apply_id, loader_id)}
        (gate / str(i)).write_text("go")

    probe_server.wait(pid, timeout=600)
    page.wait_for_function("""(ids) => ids.every((id) =>
        document.querySelector(`.int8-timing[data-node="${id}"]`)?.dataset.tuning === "done")""",
                           arg=[apply_id, loader_id], timeout=60_000)
    page.evaluate(FOCUS, apply_id)
    page.wait_for_timeout(500)
    W._shot(page, "tuning_widget_done")
    done = {n: _tuning(page, n) for n in (apply_id, loader_id)}
    snap = probe_server.get_json("/int8_fused/tuning")
    events = [e["data"] for e in probe_server.events if e.get("type") == "int8_fused.tuning"]
    log = Path(probe_server.log_path).read_text(errors="replace")

    for i, (kind, label, detail) in enumerate(SHAPES, 1):
        for n in (apply_id, loader_id):  # both pack nodes say so, the same
            got = seen[i][n]
            assert got["state"] == "active" and [x["cls"] for x in got["lines"]] == ["int8-tune-now", "int8-tune-seed"]
            now, seed = got["lines"]
            shape, what, secs = _NOW.match(now["text"]).groups()
            assert (int(shape), what) == (i, f"{kind} {label}") and float(secs) >= 0
            assert now["title"].startswith(f"{now['text']} ({detail})")
            assert seed["text"] == SEEDED
        _assert_fits(seen[i][apply_id])
        assert f"INT8 autotune: shape {i}/3 {kind} {label}: {detail}" in log
    _assert_fits(seen["nodes2"])
    assert seen["nodes2"]["vue"] and _NOW.match(seen["nodes2"]["lines"][0]["text"]).group(1) == "2"

    # the summary: the server's line without its prefix and cache file (all of it in the tooltip), and the seeds
    line = snap["last_summary"]
    m = re.match(r"^INT8 autotune: (tuned 3 shapes in \d+\.\d s \(2 GEMM, 1 tail split\)); cached in (.+); "
                 r"taken from the shipped tables so far: 1 dispatch, 2 gemm$", line)
    assert m and m.group(2) == str(gate / "cache.json") and not snap["active"] and snap["shapes"] == 0, line
    assert line in log
    for n in (apply_id, loader_id):
        got = done[n]
        assert [(x["cls"], x["text"]) for x in got["lines"]] == [("int8-tune-sum", m.group(1)),
                                                                 ("int8-tune-seed", SEEDED)]
        assert got["lines"][0]["title"] == line
    _assert_fits(done[apply_id])
    # what the server sent: each shape's start, shapes in order, ending with that summary
    starts = [e["current"]["shape"] for e in events if e["active"] and e["current"]]
    assert sorted(set(starts)) == [1, 2, 3] and starts == sorted(starts), events
    assert events[-1]["last_summary"] == line and events[-1]["seeded"] == {"gemm": 2, "dispatch": 1}

    # a label too long for three lines: an ellipsis, the whole text in the tooltip, still within the node
    long_label = " ".join(f"N={1000 + i} K={2000 + i}" for i in range(30))
    clamped = page.evaluate("""([id, label]) => {
      window.__int8Fused.setTuning({ active: true, shapes: 1, total: null, seconds: 0, kinds: {}, files: [],
        seeded: {}, last_summary: null, current: { kind: "GEMM", label, detail: "", shape: 1, elapsed_s: 0 } });
      const d = document.querySelector(`.int8-timing[data-node="${id}"] .int8-tune-now`);
      return { title: d.title, height: d.clientHeight, clamp: getComputedStyle(d).webkitLineClamp }; }""",
                            [apply_id, long_label])
    page.wait_for_timeout(300)
    long_got = _tuning(page, apply_id)
    assert clamped["title"].startswith(f"{HEAD}shape 1 GEMM {long_label}, ") and clamped["clamp"] == "3"
    assert clamped["height"] == 3 * 14 and long_got["lines"][0]["clipped"]
    _assert_fits(long_got, cut_ok=True)

    # a reloaded page asks the server (GET /int8_fused/tuning): the summary again
    graph = page.evaluate("() => JSON.stringify(app.graph.serialize())")
    page.reload()
    page.wait_for_function("() => window.app?.graph && window.__int8Fused", timeout=120_000)
    page.evaluate("(g) => app.loadGraphData(JSON.parse(g))", graph)
    page.wait_for_function("""(id) => document.querySelector(`.int8-timing[data-node="${id}"]`)?.dataset.tuning
        === "done" """, arg=apply_id, timeout=60_000)
    again = _tuning(page, apply_id)
    assert [x["text"] for x in again["lines"]] == [m.group(1), SEEDED]
    assert [e for e in page.errors if "int8" in e.lower()] == []
