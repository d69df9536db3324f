// Timing widget of the INT8 Fused pack: on the pack's model nodes, a badge with the backend that ran (and
// the requested one when layers fell back: "torch_int_mm (fallback from fused_triton)") and the device,
// a live per-step time chart, mean / median s/step and total (or the error a failed run ended with), and
// the latest run of every backend side by side ("fused_triton 0.21 s/step, 1.58x bf16"); with the Apply node's
// attention input set, the attention backend that ran next to the GEMM backend ("fused_triton \u00b7 attn cudnn"),
// and runs with another attention compared as their own rows; while kernels are tuned for the GPU, a line saying so
// with the shape and the time so far, then the session's summary and the shipped tuned tables' counts. Data: WebSocket
// events int8_fused.step, int8_fused.summary and int8_fused.tuning, and GET /int8_fused/runs and /int8_fused/tuning on
// setup (nodes/timing.py documents the schema).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import * as fmt from "./int8_format.js";

const NODE_TYPES = new Set(["ApplyFusedInt8GEMM", "LoadIdeogram4Int8"]);
const PACK_MODULE = /int8[-_]fused/i;
const WIDGET = "int8_timing";
const CHART_H = 46;
const MARGIN = 6;
const ROW_H = 16;        // one comparison row on one line
const ROW2_H = 32;       // one row on two lines: name, then numbers (2 px apart from the next)
// Room for a row's text: node width - 2 margins - padding and border (14) - dot and gap (12) - what the
// Vue-rendered nodes take on top (16).
const ROW_INSET = 2 * MARGIN + 14 + 12 + 16;
const TUNE_LINE_H = 14;  // one line of the tuning block
const TUNE_MAX_LINES = 3;  // a longer text ends in an ellipsis (its tooltip has it all)
// Room for a tuning line: as ROW_INSET without the dot, less 4 px so that the browser never wraps to more lines
// than measured.
const TUNE_INSET = 2 * MARGIN + 14 + 16 + 4;
const TUNE_TICK_MS = 500;  // the time shown goes on between events while a task runs
const MAX_RUNS = 256;  // summaries kept in the page (the server keeps its last 64)
const COLORS = {
  fused_triton: "#4caf50", comfy_kitchen: "#26a69a", torch_int_mm: "#42a5f5",
  fp8_rowwise: "#ab47bc", dequant_bf16: "#ffa726", bf16: "#9e9e9e",
};

const state = {
  runs: [],          // finished summaries, oldest first (server ring buffer + live ones)
  views: [],         // state.runs merged per (sampling, UI node): fmt.mergeRuns
  live: new Map(),   // run id -> {run, node, backend, backend_requested, backends, device, steps,
                     //            step_seconds[]} while sampling
  widgets: new Set(),
  tuning: { snap: null, at: 0, last: null, ticker: null },  // the latest int8_fused.tuning snapshot, when it came,
                                                             // the task shown last, the timer of the time shown
};

const color = (backend) => COLORS[backend] ?? "#78909c";

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text != null) e.textContent = text;
  return e;
}

function injectStyle() {
  if (document.getElementById("int8-fused-style")) return;
  const s = el("style");
  s.id = "int8-fused-style";
  s.textContent = `
.int8-timing{box-sizing:border-box;display:flex;flex-direction:column;gap:3px;padding:4px 6px;
  min-width:0;contain:inline-size;font:11px/1.35 var(--font-sans, sans-serif);color:var(--input-text, #ddd);
  background:var(--comfy-input-bg, #222);border:1px solid var(--border-color, #444);border-radius:6px;
  overflow:hidden;pointer-events:auto}
.int8-timing>*{flex:none}
.int8-timing .int8-head{height:18px;display:flex;align-items:center;gap:6px;min-width:0}
.int8-timing .int8-badge{flex:0 1 auto;min-width:0;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;
  padding:1px 7px;border-radius:9px;font-weight:600;color:#111}
.int8-timing .int8-progress{margin-left:auto;white-space:nowrap;color:var(--descrip-text, #999)}
.int8-timing .int8-tuning{display:flex;flex-direction:column;color:var(--descrip-text, #999)}
.int8-timing .int8-tuning>div{line-height:${TUNE_LINE_H}px;white-space:normal;overflow-wrap:anywhere;overflow:hidden;
  display:-webkit-box;-webkit-box-orient:vertical;-webkit-line-clamp:${TUNE_MAX_LINES}}
.int8-timing .int8-tuning .int8-tune-now{color:#ffb74d}
.int8-timing canvas{width:100%;height:${CHART_H}px;display:block}
.int8-timing .int8-stats{height:16px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.int8-timing .int8-stats.int8-empty{height:32px;white-space:normal;color:var(--descrip-text, #999);font-style:italic}
.int8-timing .int8-stats.int8-error{height:32px;white-space:normal;color:#ef5350;word-break:break-word}
.int8-timing .int8-chart{position:relative}
.int8-timing .int8-max{position:absolute;top:0;right:2px;font-size:9px;color:var(--descrip-text, #999)}
.int8-timing .int8-compare{margin:0;padding:0;list-style:none;border-top:1px solid var(--border-color, #444);
  padding-top:2px}
.int8-timing .int8-compare li{height:${ROW_H}px;display:grid;column-gap:5px;
  grid-template-columns:7px minmax(0,max-content) minmax(0,1fr);align-items:center;white-space:nowrap;min-width:0}
.int8-timing .int8-compare li>span{min-width:0;overflow:hidden;text-overflow:ellipsis}
.int8-timing .int8-compare.int8-two li{height:${ROW2_H}px;grid-template-columns:7px minmax(0,1fr);align-content:center}
.int8-timing .int8-compare.int8-two .int8-nums{grid-column:2}
.int8-timing .int8-compare li.int8-self{font-weight:600}
.int8-timing .int8-dot{width:7px;height:7px;border-radius:50%;flex:none}
.int8-timing details{color:var(--descrip-text, #999)}
.int8-timing details ol{margin:0;padding-left:22px;overflow:auto;columns:2}
.int8-timing details li{height:14px}
.int8-timing details summary{height:16px}
.int8-timing summary{cursor:pointer}`;
  document.head.appendChild(s);
}

function isPackNode(node) {
  return NODE_TYPES.has(node.comfyClass) || NODE_TYPES.has(node.type) || node.constructor?.int8Timing;
}

function backendWidgetValue(node) {
  return node.widgets?.find((w) => w.name === "backend")?.value ?? null;
}

const COMFY_ATTENTION = "comfy_default";

/** The attention backend that ran, as nodes/timing.py's attention_label: "cudnn", "flash (auto)",
 *  "flash (requested cudnn)", "cudnn (auto; 4 of 68 calls on flash)"; null when ComfyUI's own attention ran
 *  and was asked for (runs from before the attention input have no such fields). */
function attentionLabel(run) {
  const req = run?.attention_requested ?? COMFY_ATTENTION;
  const ran = run?.attention ?? COMFY_ATTENTION;
  if (req === COMFY_ATTENTION && ran === COMFY_ATTENTION) return null;
  const notes = [];
  if (req === "auto") notes.push("auto");
  else if (req !== ran) notes.push(`requested ${req}`);
  const entries = Object.entries(run.attentions || {}).filter(([, c]) => c > 0);
  const n = entries.reduce((a, [, c]) => a + c, 0);
  entries.sort(([a, x], [b, y]) => y - x || (a < b ? -1 : a > b ? 1 : 0));
  for (const [name, c] of entries) if (name !== ran) notes.push(`${c} of ${n} calls on ${name}`);
  return notes.length ? `${ran} (${notes.join("; ")})` : ran;
}

/** Runs as the side-by-side comparison sees them: one that ran with a routed attention compares as
 *  "fused_triton \u00b7 attn cudnn", apart from the same GEMM backend on ComfyUI's attention. */
function compareKey(run) {
  return attentionLabel(run) ? `${run.backend} \u00b7 attn ${run.attention ?? COMFY_ATTENTION}` : run.backend;
}

function compareRuns(views) {
  return views.map((r) => (compareKey(r) === r.backend ? r : { ...r, backend: compareKey(r), gemm: r.backend }));
}

/** The attention picked on the node, before any run: null for comfy_default (or no such input). */
function attentionWidgetValue(node) {
  const v = node.widgets?.find((w) => w.name === "attention")?.value ?? null;
  return v && v !== COMFY_ATTENTION ? v : null;
}

/** The run this node shows: its live run if sampling, else its latest finished one (views merge
 *  the two models of a dual-model loader). */
function runFor(node) {
  const id = String(node.id);
  const lives = [...state.live.values()].filter((r) => fmt.nodeKey(r.node) === id);
  if (lives.length) {
    const group = lives.at(-1).group;
    const run = fmt.mergeRuns(lives.filter((r) => r.group === group))[0];
    return { run, finished: false };
  }
  for (let i = state.views.length - 1; i >= 0; i--) {
    if (state.views[i].node === id) return { run: state.views[i], finished: true };
  }
  return { run: null, finished: false };
}

function drawChart(canvas, secs, planned, backend) {
  const w = Math.max(60, Math.round(canvas.clientWidth || 240));
  const dpr = window.devicePixelRatio || 1;
  canvas.width = w * dpr;
  canvas.height = CHART_H * dpr;
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, CHART_H);
  const n = Math.max(planned || 0, secs.length, 1);
  const max = Math.max(...secs, 1e-9);
  const slot = w / n;
  const bar = Math.max(1, slot - Math.min(3, slot * 0.25));
  g.fillStyle = color(backend);
  secs.forEach((s, i) => {
    const h = Math.max(1, (s / max) * (CHART_H - 10));
    g.fillRect(i * slot, CHART_H - h, bar, h);
  });
  const m = fmt.median(secs);
  if (m != null) {  // median line
    const y = CHART_H - (m / max) * (CHART_H - 10);
    g.strokeStyle = "rgba(255,255,255,0.55)";
    g.setLineDash([3, 3]);
    g.beginPath(); g.moveTo(0, y); g.lineTo(w, y); g.stroke();
  }
}

/** The tuning block's lines: the tuning line while a session is open, else the last session's summary; then the
 *  shipped tables' counts. Each wraps to at most TUNE_MAX_LINES lines (measured as oneLineFit measures), then ends in
 *  an ellipsis; its tooltip holds the whole text. Returns the block's height (0: hidden). */
function renderTuning(w) {
  const { node, root, tuning } = w;
  const t = state.tuning, snap = t.snap;
  const lines = [];
  const now = fmt.tuningText(snap, (performance.now() - t.at) / 1000, t.last);
  if (now) {
    const detail = (snap.active ? snap.current : t.last)?.detail;
    lines.push(["int8-tune-now", now, `${now}${detail ? ` (${detail})` : ""}\nTimed once per GPU and kept in the cache `
      + "folder: later runs start at once"]);
  } else if (fmt.tuningSummary(snap)) {
    lines.push(["int8-tune-sum", fmt.tuningSummary(snap), snap.last_summary]);
  }
  const seeded = fmt.seededText(snap);
  if (seeded) lines.push(["int8-tune-seed", seeded, `${seeded}\nEntries taken from the tuned tables shipped for this GPU `
    + "(kernel/tuned) instead of timing them, since the server started"]);
  root.dataset.tuning = now ? "active" : lines.length ? "done" : "";
  tuning.style.display = lines.length ? "" : "none";
  if (!lines.length) {
    tuning.replaceChildren();
    return 0;
  }
  measureCtx ??= document.createElement("canvas").getContext("2d");
  measureCtx.font = `11px ${getComputedStyle(root).fontFamily || "sans-serif"}`;
  const room = Math.max(60, (node.size?.[0] ?? 320) - TUNE_INSET);
  const width = (s) => measureCtx.measureText(s).width;
  let h = 0;
  tuning.replaceChildren(...lines.map(([cls, text, title]) => {
    const d = el("div", cls, text);
    const n = Math.min(TUNE_MAX_LINES, fmt.wrappedLines(text, room, width));
    d.style.height = `${n * TUNE_LINE_H}px`;
    d.title = title;
    h += n * TUNE_LINE_H;
    return d;
  }));
  return h;
}

function render(w) {
  const { node, root, badge, progress, chart, canvas, maxLabel, stats, steps, compare } = w;
  w.tuneH = renderTuning(w);
  const { run, finished } = runFor(node);
  const backend = run?.backend ?? backendWidgetValue(node);
  const attention = run ? attentionLabel(run) : attentionWidgetValue(node);
  const gemm = fmt.backendLabel(run) ?? backend;
  badge.textContent = fmt.badgeText(attention ? `${gemm} \u00b7 attn ${attention}` : gemm, run?.device ?? null);
  const ranAttention = attention ? " \u00b7 attention backend that ran" : "";
  badge.title = run ? `${badge.textContent}\nINT8 backend that ran${ranAttention} \u00b7 device of the latest run`
    : `INT8 backend${attention ? " and attention" : ""} picked on the node (no run yet)`;
  badge.style.background = color(backend);
  root.dataset.node = String(node.id);
  root.dataset.run = run?.run ?? "";
  root.dataset.backend = backend ?? "";
  root.dataset.backendRequested = run?.backend_requested ?? "";
  root.dataset.attention = run ? (run.attention ?? COMFY_ATTENTION) : (attentionWidgetValue(node) ?? "");
  root.dataset.device = run?.device ?? "";
  root.dataset.finished = String(finished);
  const secs = run?.step_seconds ?? [];
  root.dataset.stepSeconds = JSON.stringify(secs);

  if (!run) {
    progress.textContent = "";
    chart.style.display = "none";
    steps.style.display = "none";
    stats.className = "int8-stats int8-empty";
    stats.textContent = "No run yet \u2014 queue the workflow to time each sampling step here.";
  } else {
    progress.textContent = fmt.progressText(secs.length, run.steps_planned ?? run.steps, finished);
    chart.style.display = chartShown(run, finished) ? "" : "none";
    drawChart(canvas, secs, finished ? secs.length : run.steps_planned, backend);
    maxLabel.textContent = secs.length ? `max ${fmt.fmtSeconds(Math.max(...secs))}` : "";
    const shown = finished ? run
      : { steps: secs.length, mean: fmt.mean(secs), median: fmt.median(secs), total: secs.reduce((a, b) => a + b, 0) };
    const error = finished ? fmt.errorText(run) : null;
    stats.className = error ? "int8-stats int8-error" : "int8-stats";
    stats.textContent = error ?? (secs.length ? fmt.statsText(shown) : "waiting for the first step\u2026");
    stats.title = error ?? (run.workload ? `${run.workload} \u00b7 timer: ${run.timer ?? "live"}` : "");
    steps.style.display = secs.length ? "" : "none";
    const list = steps.querySelector("ol");
    list.style.height = `${listHeight(run)}px`;
    list.replaceChildren(...secs.map((s) => el("li", "int8-step", fmt.fmtSeconds(s))));
    steps.querySelector("summary").textContent = `seconds per step (${secs.length})`;
  }

  const rows = fmt.compareRows(compareRuns(state.views), finished ? run.workload : latestWorkload(node));
  const selfKey = run ? compareKey(run) : backend;
  compare.replaceChildren(...rows.map((r) => {
    const li = el("li", r.backend === selfKey ? "int8-self" : "");
    li.dataset.backend = r.backend;
    const dot = el("span", "int8-dot");
    dot.style.background = color(r.backend.split(" ")[0]);
    // the space keeps the row's text its label; a grid drops it from the layout
    li.append(dot, el("span", "int8-name", r.name), " ", el("span", "int8-nums", r.numbers));
    li.title = `${r.label}\n${r.backend} on ${r.device}`;
    return li;
  }));
  const fits = oneLineFit(root, node);
  const two = rows.some((r) => !fits(r));
  compare.classList.toggle("int8-two", two);
  compare.style.display = rows.length > 1 ? "" : "none";
  relayout(w, rows.length > 1 ? rows.length * (two ? ROW2_H : ROW_H) : 0);
}

let measureCtx = null;

/** row -> whether its name and numbers fit side by side at the node's width (measured in the widget's font, bold
 *  as the node's own row; from the node's size, so the same whether or not the widget is laid out yet). When one
 *  row does not, every row puts its numbers on a second line: the contain:inline-size root never widens the node
 *  (the Vue-rendered nodes would otherwise size to the rows). */
function oneLineFit(root, node) {
  measureCtx ??= document.createElement("canvas").getContext("2d");
  measureCtx.font = `600 11px ${getComputedStyle(root).fontFamily || "sans-serif"}`;
  const room = (node.size?.[0] ?? 320) - ROW_INSET;
  return (row) => measureCtx.measureText(row.name).width + 5 + measureCtx.measureText(row.numbers).width <= room;
}

/** No chart for a run that ended before its first step (it failed or was cancelled while loading). */
function chartShown(run, finished) {
  return !finished || (run.step_seconds?.length ?? 0) > 0;
}

/** Height of the open per-step list: two columns of 14 px rows, scrolling past 5 rows. */
function listHeight(run) {
  return Math.min(5, Math.ceil((run.step_seconds?.length ?? 0) / 2)) * 14;
}

/** The widget's height from what it shows (``compareH``: the comparison rows' height); grows the node when it
 *  needs more room. */
function relayout(w, compareH) {
  const { run, finished } = runFor(w.node);
  let h = 10 + 18 + 3;  // padding + head
  if (w.tuneH) h += w.tuneH + 3;
  if (!run) h += 32;
  else {
    h += (chartShown(run, finished) ? CHART_H + 3 : 0) + 16 + 3 + 16 + 3 + (w.steps.open ? listHeight(run) : 0);
    if (fmt.errorText(run)) h += 16;  // the error takes two lines
  }
  if (compareH) h += 3 + 3 + compareH;
  if (h === w.height) return;
  const prev = w.height;
  w.height = h;
  const node = w.node;
  // Grow (or shrink) the node by what the widget's content changed; keep the user's width.
  if (prev && node.size) node.setSize([node.size[0], Math.max(node.size[1] + h - prev, node.computeSize?.()[1] ?? 0)]);
}

function latestWorkload(node) {
  for (let i = state.views.length - 1; i >= 0; i--) {
    if (state.views[i].node === String(node.id)) return state.views[i].workload;
  }
  return state.views.at(-1)?.workload ?? null;
}

function renderAll() {
  state.views = fmt.mergeRuns(state.runs);
  for (const w of state.widgets) {
    if (!w.node.graph) continue;  // not (yet) in a graph; removal is handled by onRemoved
    render(w);
  }
  app.graph?.setDirtyCanvas?.(true, true);
}

function attach(node) {
  if (node.widgets?.some((x) => x.name === WIDGET)) return;
  injectStyle();
  const root = el("div", "int8-timing");
  const head = el("div", "int8-head");
  const badge = el("span", "int8-badge");
  const progress = el("span", "int8-progress");
  head.append(badge, progress);
  const tuning = el("div", "int8-tuning");
  const chart = el("div", "int8-chart");
  const canvas = el("canvas");
  const maxLabel = el("span", "int8-max");
  chart.append(canvas, maxLabel);
  const stats = el("div", "int8-stats");
  const steps = el("details", "int8-steps");
  steps.append(el("summary", "", "seconds per step"), el("ol"));
  const compare = el("ul", "int8-compare");
  root.append(head, tuning, chart, stats, steps, compare);

  const w = { node, root, badge, progress, tuning, chart, canvas, maxLabel, stats, steps, compare, height: 0, tuneH: 0 };
  const widget = node.addDOMWidget(WIDGET, "int8_timing", root, {
    serialize: false,
    hideOnZoom: false,
    margin: MARGIN,
    // The frontend sizes the element to (computed height - 2 margins).
    getMinHeight: () => (w.height || 60) + 2 * MARGIN,
    getMaxHeight: () => (w.height || 60) + 2 * MARGIN,
  });
  widget.serialize = false;
  state.widgets.add(w);
  steps.addEventListener("toggle", () => { render(w); app.graph?.setDirtyCanvas?.(true, true); });
  const onRemoved = node.onRemoved;
  node.onRemoved = function () {
    state.widgets.delete(w);
    return onRemoved?.apply(this, arguments);
  };
  const onResize = node.onResize;
  node.onResize = function () {  // a row may now fit on one line, or need two
    const r = onResize?.apply(this, arguments);
    if (this.graph) render(w);
    return r;
  };
  const onAdded = node.onAdded;
  node.onAdded = function () {  // the node gets its id when added to a graph
    const r = onAdded?.apply(this, arguments);
    render(w);
    return r;
  };
  // The badge follows the backend (and attention) picked on the node until a run says what really ran.
  for (const bw of node.widgets?.filter((x) => x.name === "backend" || x.name === "attention") ?? []) {
    const cb = bw.callback;
    bw.callback = function () {
      const r = cb?.apply(this, arguments);
      render(w);
      return r;
    };
  }
  render(w);
  node.setSize?.([Math.max(node.size?.[0] ?? 0, 320), node.computeSize?.()[1] ?? node.size[1]]);
}

function onStep({ detail: d }) {
  if (!d || !d.run) return;
  let r = state.live.get(d.run);
  if (!r) {
    r = { run: d.run, group: d.group ?? d.run, node: d.node, backend: d.backend,
          backend_requested: d.backend_requested, backends: d.backends, attention: d.attention,
          attention_requested: d.attention_requested, attentions: d.attentions, device: d.device,
          status: "ok", steps_planned: d.steps, step_seconds: [] };
    state.live.set(d.run, r);
  }
  r.step_seconds[d.step] = d.seconds;
  renderAll();
}

// Nothing left in the queue: a run that never got its summary (server restarted) is not live.
function onStatus({ detail }) {
  if (detail?.exec_info?.queue_remaining === 0 && state.live.size) {
    state.live.clear();
    renderAll();
  }
  // a tuning shown as running with nothing queued: ask the server (it may have restarted meanwhile)
  if (detail?.exec_info?.queue_remaining === 0 && fmt.tuningOpen(state.tuning.snap)) loadTuning(true);
}

function onSummary({ detail: d }) {
  if (!d || !d.run) return;
  state.live.delete(d.run);
  if (!state.runs.some((r) => r.run === d.run)) state.runs.push(d);
  if (state.runs.length > MAX_RUNS) state.runs.splice(0, state.runs.length - MAX_RUNS);
  renderAll();
}

/** A tuning snapshot (nodes/timing.py int8_fused.tuning, GET /int8_fused/tuning): shown on every pack node, the
 *  time going on while a task runs. */
function setTuning(snap) {
  const t = state.tuning;
  if (snap.active && snap.current) t.last = snap.current;
  else if (!fmt.tuningOpen(snap)) t.last = null;
  t.snap = snap;
  t.at = performance.now();
  if (snap.active && !t.ticker) t.ticker = setInterval(tickTuning, TUNE_TICK_MS);
  if (!snap.active && t.ticker) {
    clearInterval(t.ticker);
    t.ticker = null;
  }
  renderAll();
}

function tickTuning() {
  for (const w of state.widgets) {
    if (!w.node.graph) continue;
    if (renderTuning(w) !== w.tuneH) render(w);  // a line more or less: the widget's height changes
  }
}

function onTuning({ detail }) {
  if (detail && typeof detail === "object") setTuning(detail);
}

/** The server's tuning state (``force``: even when an event has come; else that event is newer). */
async function loadTuning(force = false) {
  try {
    const asked = state.tuning.snap;
    const res = await api.fetchApi("/int8_fused/tuning");
    if (res.ok && (force || !state.tuning.snap)) {
      const snap = await res.json();
      if (state.tuning.snap === asked) setTuning(snap);  // not when an event came meanwhile
    }
  } catch (e) {
    console.warn("int8_fused: could not load the tuning state", e);
  }
}

async function loadRuns() {
  try {
    const res = await api.fetchApi("/int8_fused/runs");
    if (!res.ok) return;
    const { runs } = await res.json();
    const known = new Set(state.runs.map((r) => r.run));
    state.runs = [...(runs || []).filter((r) => !known.has(r.run)), ...state.runs];
    renderAll();
  } catch (e) {
    console.warn("int8_fused: could not load past runs", e);
  }
}

app.registerExtension({
  name: "int8_fused.widget",
  async setup() {
    api.addEventListener("int8_fused.step", onStep);
    api.addEventListener("int8_fused.summary", onSummary);
    api.addEventListener("status", onStatus);
    api.addEventListener("int8_fused.tuning", onTuning);
    await Promise.all([loadRuns(), loadTuning()]);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    const ours = NODE_TYPES.has(nodeData.name) ||
      (PACK_MODULE.test(nodeData.python_module ?? "") && (nodeData.output ?? []).includes("MODEL"));
    if (ours) nodeType.int8Timing = true;
  },
  nodeCreated(node) {
    if (isPackNode(node)) attach(node);
  },
});

// For tests and debugging: the widget's data as the page sees it.
window.__int8Fused = { state, renderAll, fmt, attentionLabel, setTuning };
