// Pure formatting and comparison logic of the timing widget (no DOM, no ComfyUI imports), so that
// node's test runner can check it (tests/test_web_format.mjs). Run summaries have the shape sent by
// nodes/timing.py: {run, node, backend (what ran), backend_requested, backends {name: INT8 layers},
// device, workload, status ("ok" | "interrupted" | "error"), error, steps, step_seconds, mean, median,
// total, started}.

// Backends whose latest run serves as "1.00x", most preferred first: the unquantized control, then
// the dequantize-to-bf16 baseline.
export const BASELINES = ["bf16", "dequant_bf16"];

const DASH = "\u2014";
const TIMES = "\u00d7";

const isNum = (v) => typeof v === "number" && Number.isFinite(v);

/** 0.0429 -> "42.9 ms", 0.213 -> "0.213 s", 12.34 -> "12.3 s", 1234.5 -> "1235 s". */
export function fmtSeconds(s) {
  if (!isNum(s) || s < 0) return DASH;
  if (s < 0.1) return `${Number((s * 1000).toPrecision(3))} ms`;
  if (s >= 1000) return `${Math.round(s)} s`;
  return `${Number(s.toPrecision(3))} s`;
}

/** 0.213 -> "0.213 s/step". */
export function fmtPerStep(s) {
  return isNum(s) && s >= 0 ? `${fmtSeconds(s)}/step` : DASH;
}

/** How many times faster `mean` is than `baseMean` (null when either is missing or zero). */
export function speedup(baseMean, mean) {
  if (!isNum(baseMean) || !isNum(mean) || baseMean <= 0 || mean <= 0) return null;
  return baseMean / mean;
}

/** 1.5833 -> "1.58x", 0.6 -> "0.6x", 12.04 -> "12x" (three significant digits, trailing zeros cut). */
export function fmtRatio(r) {
  if (!isNum(r) || r <= 0) return DASH;
  return `${Number(r.toPrecision(3))}${TIMES}`;
}

export function mean(xs) {
  const v = (xs || []).filter(isNum);
  return v.length ? v.reduce((a, b) => a + b, 0) / v.length : null;
}

export function median(xs) {
  const v = (xs || []).filter(isNum).sort((a, b) => a - b);
  if (!v.length) return null;
  const m = v.length >> 1;
  return v.length % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

/** Badge text: "fused_triton · NVIDIA H200"; just the backend when the device is unknown. */
export function badgeText(backend, device) {
  const b = backend || "no backend";
  return device ? `${b} \u00b7 ${device}` : b;
}

/** The backend most INT8 layers ran, from {name: layer count} (ties: alphabetical); null if none. */
export function ranBackend(backends) {
  const entries = Object.entries(backends || {}).filter(([, c]) => c > 0);
  if (!entries.length) return null;
  entries.sort(([a, x], [b, y]) => y - x || (a < b ? -1 : a > b ? 1 : 0));
  return entries[0][0];
}

/** What ran, as nodes/timing.py's backend_label: "torch_int_mm (fallback from fused_triton)",
 *  "fused_triton (4 of 124 layers on torch_int_mm)", "fused_triton (requested bf16)"; null without a run. */
export function backendLabel(run) {
  if (!run || !run.backend) return null;
  const { backend, backend_requested: req } = run;
  const notes = [];
  if (req && req !== backend) notes.push(req === "bf16" ? `requested ${req}` : `fallback from ${req}`);
  const entries = Object.entries(run.backends || {}).filter(([, c]) => c > 0);
  const n = entries.reduce((a, [, c]) => a + c, 0);
  entries.sort(([a, x], [b, y]) => y - x || (a < b ? -1 : a > b ? 1 : 0));
  for (const [name, c] of entries) if (name !== backend) notes.push(`${c} of ${n} layers on ${name}`);
  return notes.length ? `${backend} (${notes.join("; ")})` : backend;
}

/** "error: RuntimeError: CUDA out of memory" for a run that failed, else null. */
export function errorText(run) {
  return run?.status === "error" ? `error: ${run.error || "unknown error"}` : null;
}

/** "mean 0.213 s/step · median 0.21 s/step · total 4.26 s". */
export function statsText(run) {
  if (!run || !run.steps) return "no run yet";
  return `mean ${fmtPerStep(run.mean)} \u00b7 median ${fmtPerStep(run.median)} \u00b7 total ${fmtSeconds(run.total)}`;
}

/** The latest finished run of each backend, optionally only those of one workload (model + latent). */
export function latestByBackend(runs, workload = null) {
  const latest = new Map();
  for (const r of runs || []) {
    if (!r || r.status !== "ok" || !r.steps || !isNum(r.mean)) continue;
    if (workload && r.workload !== workload) continue;
    const prev = latest.get(r.backend);
    if (!prev || (r.started ?? 0) >= (prev.started ?? 0)) latest.set(r.backend, r);
  }
  return latest;
}

/** The baseline run among the latest per backend (see BASELINES, in that order), or null. For each name a plain
 *  run first, else the latest run of that GEMM backend compared under a routed attention ("bf16 \u00b7 attn cudnn",
 *  its GEMM backend in ``gemm``, the attention that ran in ``attention``). */
export function pickBaseline(latest) {
  for (const name of BASELINES) {
    if (latest.has(name)) return latest.get(name);
    let best = null;
    for (const r of latest.values()) {
      if (r.gemm === name && (!best || (r.started ?? 0) >= (best.started ?? 0))) best = r;
    }
    if (best) return best;
  }
  return null;
}

// The attention a run ran when its summary names none (runs from before the attention input).
const DEFAULT_ATTENTION = "comfy_default";

/** The baseline as a row names it: its GEMM backend alone ("bf16") when it ran the row's attention, else its
 *  compare key ("bf16 \u00b7 attn flash"), so a row never repeats its own attention label. */
export function baselineName(run, baseline) {
  const same = (run.attention ?? DEFAULT_ATTENTION) === (baseline.attention ?? DEFAULT_ATTENTION);
  return same && baseline.gemm ? baseline.gemm : baseline.backend;
}

/** The numbers of one comparison row: "0.21 s/step, 1.58\u00d7 bf16" (or "(baseline)", or no ratio). */
export function compareNumbers(run, baseline) {
  const head = fmtPerStep(run.mean);
  if (!baseline) return head;
  if (baseline === run) return `${head} (baseline)`;
  return `${head}, ${fmtRatio(speedup(baseline.mean, run.mean))} ${baselineName(run, baseline)}`;
}

/** One comparison line: "fused_triton 0.21 s/step, 1.58\u00d7 bf16" (or "(baseline)", or no ratio). */
export function compareLabel(run, baseline) {
  return `${run.backend} ${compareNumbers(run, baseline)}`;
}

/** Rows of the side-by-side comparison, fastest first: [{backend, device, mean, ratio, name, numbers, label}];
 *  ``name`` is the compare key (backend, and attention where routed), ``numbers`` the rest of the label. */
export function compareRows(runs, workload = null) {
  const latest = latestByBackend(runs, workload);
  const base = pickBaseline(latest);
  return [...latest.values()]
    .sort((a, b) => a.mean - b.mean)
    .map((r) => ({
      backend: r.backend,
      device: r.device,
      mean: r.mean,
      ratio: base ? speedup(base.mean, r.mean) : null,
      name: r.backend,
      numbers: compareNumbers(r, base),
      label: compareLabel(r, base),
    }));
}

/** "3/20" while sampling, "20 steps" when done. */
export function progressText(done, planned, finished) {
  if (finished) return `${done} step${done === 1 ? "" : "s"}`;
  return planned ? `step ${done}/${planned}` : `step ${done}`;
}

/** The UI node a run belongs to: the loader tags its two models "12:conditional" / "12:unconditional". */
export function nodeKey(node) {
  return String(node ?? "").split(":")[0];
}

/** One view per (sampling, UI node): runs of one sampling made by one node's models (a dual-model
 *  loader) are summed step by step; a single run is passed through with its numbers unchanged. */
export function mergeRuns(runs) {
  const out = [];
  const index = new Map();
  for (const r of runs || []) {
    if (!r) continue;
    const key = `${r.group ?? r.run}|${nodeKey(r.node)}`;
    if (!index.has(key)) {
      index.set(key, out.length);
      out.push({ ...r, node: nodeKey(r.node), parts: [r.node] });
      continue;
    }
    const m = out[index.get(key)];
    const a = m.step_seconds || [], b = r.step_seconds || [];
    const n = Math.max(a.length, b.length);
    m.step_seconds = Array.from({ length: n }, (_, i) => (a[i] ?? 0) + (b[i] ?? 0));
    m.steps = n;
    m.total = m.step_seconds.reduce((x, y) => x + y, 0);
    m.mean = n ? m.total / n : null;
    m.median = median(m.step_seconds);
    m.calls = (m.calls ?? 0) + (r.calls ?? 0);
    const used = { ...(m.backends || {}) };
    for (const [name, c] of Object.entries(r.backends || {})) used[name] = (used[name] ?? 0) + c;
    m.backends = used;
    m.backend = ranBackend(used) ?? m.backend;
    if (m.status !== "error" && r.status === "error") m.error = r.error;
    m.status = [m.status, r.status].includes("error") ? "error"
      : m.status === "ok" && r.status === "ok" ? "ok" : "interrupted";
    m.parts.push(r.node);
  }
  return out;
}

// ---------------------------------------------------------------- kernel tuning (nodes/timing.py int8_fused.tuning)
// A snapshot is kernel.tuned.progress.snapshot(): {active, current {kind, label, detail, shape, elapsed_s} or null,
// shapes, total, seconds, kinds, files, seeded {section: entries}, last_summary}.

const SEED_SECTIONS = ["gemm", "dispatch", "attention"];

/** Whether a tuning session is open: a task runs, or shapes were tuned and the summary is still to come. */
export function tuningOpen(snap) {
  return !!snap && (!!snap.active || (snap.shapes ?? 0) > 0);
}

/** "Tuning INT8 kernels for this GPU (first run only): shape 3/12 GEMM N=3072 K=3072 M<=4096 s8p, 4.2 s" while a
 *  session is open, else null. ``since``: seconds since the snapshot came (the running task's time goes on);
 *  ``last``: the task shown before, named between two tasks (when the snapshot has none running). The time is the
 *  session's tuning time: its finished tasks' and the running one's. */
export function tuningText(snap, since = 0, last = null) {
  if (!tuningOpen(snap)) return null;
  const cur = snap.active ? snap.current : null;
  const task = cur ?? last;
  const n = cur ? cur.shape : snap.shapes;
  const total = isNum(snap.total) && snap.total >= n ? `/${snap.total}` : "";
  const what = task ? ` ${task.kind} ${task.label}` : "";
  let secs = isNum(snap.seconds) ? snap.seconds : 0;
  if (cur && isNum(cur.elapsed_s)) secs += cur.elapsed_s + Math.max(0, since || 0);
  return `Tuning INT8 kernels for this GPU (first run only): shape ${n}${total}${what}, ${secs.toFixed(1)} s`;
}

/** The last session's summary as the widget shows it: "tuned 12 shapes in 14.2 s (9 GEMM, 3 dispatch)" (the log
 *  line without its prefix and its cache files; the whole line is the tooltip); null before any. */
export function tuningSummary(snap) {
  const line = snap?.last_summary;
  if (!line) return null;
  return line.replace(/^INT8 autotune:\s*/, "").split("; ")[0];
}

/** "shipped tuned table: 40 gemm / 12 dispatch / 3 attention": entries this server took from the shipped tuned
 *  tables (kernel/tuned/<GPU>.json) instead of timing them; null when none. */
export function seededText(snap) {
  const seeded = snap?.seeded ?? {};
  const names = [...SEED_SECTIONS, ...Object.keys(seeded).filter((k) => !SEED_SECTIONS.includes(k)).sort()];
  if (!names.some((k) => (seeded[k] ?? 0) > 0)) return null;
  return `shipped tuned table: ${names.map((k) => `${seeded[k] ?? 0} ${k}`).join(" / ")}`;
}

/** How many lines ``text`` takes wrapped at ``room`` px, words broken only where one alone is wider (as CSS
 *  ``overflow-wrap:anywhere`` does); ``width(s)``: a string's width in px. */
export function wrappedLines(text, room, width) {
  if (!text) return 0;
  const space = width(" ");
  let lines = 1, used = 0;
  for (const word of String(text).split(" ")) {
    const w = width(word);
    if (used > 0 && used + space + w <= room) { used += space + w; continue; }
    if (used > 0) lines += 1;
    const extra = Math.max(0, Math.ceil(w / room) - 1);  // a word wider than the line
    lines += extra;
    used = w - extra * room;
  }
  return lines;
}
