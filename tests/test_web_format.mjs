// Unit tests of web/int8_format.js (node --test tests/test_web_format.mjs; also run by test_web_format.py).
import test from "node:test";
import assert from "node:assert/strict";
import * as f from "../web/int8_format.js";

test("seconds pick ms below 0.1 s and three significant digits", () => {
  assert.equal(f.fmtSeconds(0.0429), "42.9 ms");
  assert.equal(f.fmtSeconds(0.05), "50 ms");
  assert.equal(f.fmtSeconds(0.00123), "1.23 ms");
  assert.equal(f.fmtSeconds(0.2134), "0.213 s");
  assert.equal(f.fmtSeconds(1.5833), "1.58 s");
  assert.equal(f.fmtSeconds(12.34), "12.3 s");
  assert.equal(f.fmtSeconds(1234.5), "1235 s");
  assert.equal(f.fmtPerStep(0.21), "0.21 s/step");
});

test("missing or invalid numbers show a dash, never NaN", () => {
  for (const v of [null, undefined, NaN, -1, Infinity, "0.2"]) {
    assert.equal(f.fmtSeconds(v), "\u2014");
    assert.equal(f.fmtPerStep(v), "\u2014");
  }
  assert.equal(f.fmtRatio(null), "\u2014");
  assert.equal(f.speedup(0, 1), null);
  assert.equal(f.speedup(1, 0), null);
  assert.equal(f.mean([]), null);
  assert.equal(f.median([]), null);
  assert.equal(f.statsText(null), "no run yet");
});

test("ratios are base / this, three significant digits", () => {
  assert.equal(f.fmtRatio(f.speedup(0.3318, 0.21)), "1.58\u00d7");
  assert.equal(f.fmtRatio(f.speedup(0.2, 0.4)), "0.5\u00d7");
  assert.equal(f.fmtRatio(12.04), "12\u00d7");
});

test("mean and median agree with a direct computation on random data", () => {
  for (let trial = 0; trial < 20; trial++) {
    const n = 1 + Math.floor(Math.random() * 30);
    const xs = Array.from({ length: n }, () => Math.random() * 2);
    const sorted = [...xs].sort((a, b) => a - b);
    const want = n % 2 ? sorted[(n - 1) / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
    assert.equal(f.median(xs), want);
    let s = 0;
    for (const x of xs) s += x;
    assert.ok(Math.abs(f.mean(xs) - s / n) < 1e-12);
  }
});

test("badge and stats labels", () => {
  assert.equal(f.badgeText("fused_triton", "NVIDIA H200"), "fused_triton \u00b7 NVIDIA H200");
  assert.equal(f.badgeText("bf16", null), "bf16");
  assert.equal(f.badgeText(null, null), "no backend");
  const run = { steps: 4, mean: 0.2134, median: 0.2, total: 0.8536 };
  assert.equal(f.statsText(run),
    "mean 0.213 s/step \u00b7 median 0.2 s/step \u00b7 total 0.854 s");
  assert.equal(f.progressText(3, 20, false), "step 3/20");
  assert.equal(f.progressText(1, 1, true), "1 step");
  assert.equal(f.progressText(20, 20, true), "20 steps");
});

const run = (backend, mean, started, extra = {}) =>
  ({ backend, device: "cpu", mean, started, steps: 4, status: "ok", workload: "Flux 1x16x8x8", ...extra });

test("comparison takes the latest finished run of each backend against bf16", () => {
  const runs = [
    run("bf16", 0.9, 1), run("bf16", 0.3318, 5), run("fused_triton", 0.5, 2),
    run("fused_triton", 0.21, 6), run("torch_int_mm", 0.1, 7, { status: "interrupted" }),
    run("torch_int_mm", 0.25, 3), run("dequant_bf16", 0.05, 8, { workload: "other" }),
  ];
  const rows = f.compareRows(runs, "Flux 1x16x8x8");
  assert.deepEqual(rows.map((r) => r.label), [
    "fused_triton 0.21 s/step, 1.58\u00d7 bf16",
    "torch_int_mm 0.25 s/step, 1.33\u00d7 bf16",
    "bf16 0.332 s/step (baseline)",
  ]);
  assert.equal(rows[0].ratio, 0.3318 / 0.21);
});

test("without bf16 the dequant baseline is used; without either, no ratios", () => {
  const rows = f.compareRows([run("dequant_bf16", 0.4, 1), run("fused_triton", 0.2, 2)]);
  assert.equal(rows[0].label, "fused_triton 0.2 s/step, 2\u00d7 dequant_bf16");
  const solo = f.compareRows([run("fused_triton", 0.2, 2)]);
  assert.deepEqual(solo.map((r) => [r.label, r.ratio]), [["fused_triton 0.2 s/step", null]]);
  assert.deepEqual(f.compareRows([]), []);
  assert.deepEqual(f.compareRows(null), []);
});

test("runs compared under a routed attention take a bf16 run of any attention as baseline", () => {
  // as compareRuns in int8_fused.js hands them over: the compare key in backend, the GEMM backend in gemm
  const routed = (gemm, attn, mean, started) =>
    run(`${gemm} \u00b7 attn ${attn}`, mean, started, { gemm, attention: attn });
  const rows = f.compareRows([routed("bf16", "cudnn", 0.3, 1), routed("bf16", "flash", 0.36, 2),
                              routed("fused_triton", "cudnn", 0.2, 3), run("dequant_bf16", 0.6, 4)]);
  assert.deepEqual(rows.map((r) => r.label), [
    "fused_triton \u00b7 attn cudnn 0.2 s/step, 1.8\u00d7 bf16 \u00b7 attn flash",
    "bf16 \u00b7 attn cudnn 0.3 s/step, 1.2\u00d7 bf16 \u00b7 attn flash",
    "bf16 \u00b7 attn flash 0.36 s/step (baseline)",
    "dequant_bf16 0.6 s/step, 0.6\u00d7 bf16 \u00b7 attn flash",
  ]);
  // a plain bf16 run still wins over routed ones
  const plain = f.compareRows([routed("bf16", "cudnn", 0.3, 5), run("bf16", 0.4, 1)]);
  assert.equal(plain[0].label, "bf16 \u00b7 attn cudnn 0.3 s/step, 1.33\u00d7 bf16");
});

test("a row names its attention once: a baseline that ran the same attention is named by its GEMM backend", () => {
  // the miniature demo graph: attention auto, which on a CPU runs ComfyUI's own, so every run is keyed
  // "<backend> \u00b7 attn comfy_default" (ratios 0.2516 / 0.139 = 1.81, 0.2516 / 0.93 = 0.271)
  const auto = (gemm, mean, started) => run(`${gemm} \u00b7 attn comfy_default`, mean, started,
    { gemm, attention: "comfy_default", attention_requested: "auto" });
  const rows = f.compareRows([auto("bf16", 0.2516, 1), auto("dequant_bf16", 0.93, 2),
                              auto("torch_int_mm", 0.139, 3)]);
  assert.deepEqual(rows.map((r) => r.label), [
    "torch_int_mm \u00b7 attn comfy_default 0.139 s/step, 1.81\u00d7 bf16",
    "bf16 \u00b7 attn comfy_default 0.252 s/step (baseline)",
    "dequant_bf16 \u00b7 attn comfy_default 0.93 s/step, 0.271\u00d7 bf16",
  ]);
  assert.deepEqual(rows.map((r) => [r.name, r.numbers]), [
    ["torch_int_mm \u00b7 attn comfy_default", "0.139 s/step, 1.81\u00d7 bf16"],
    ["bf16 \u00b7 attn comfy_default", "0.252 s/step (baseline)"],
    ["dequant_bf16 \u00b7 attn comfy_default", "0.93 s/step, 0.271\u00d7 bf16"],
  ]);
  for (const r of rows) assert.equal(r.label.split("attn").length, 2, r.label);  // "attn" exactly once
  // a plain run (ComfyUI's attention, asked for) against that baseline: the same attention ran, no label
  const mixed = f.compareRows([auto("bf16", 0.3, 1), run("fused_triton", 0.2, 2)]);
  assert.equal(mixed[0].label, "fused_triton 0.2 s/step, 1.5\u00d7 bf16");
  // another attention on the baseline is still named: it is not the row's
  const other = f.compareRows([auto("bf16", 0.3, 1),
    run("fused_triton \u00b7 attn cudnn", 0.2, 2, { gemm: "fused_triton", attention: "cudnn" })]);
  assert.equal(other[0].label,
    "fused_triton \u00b7 attn cudnn 0.2 s/step, 1.5\u00d7 bf16 \u00b7 attn comfy_default");
  assert.equal(f.baselineName({ backend: "x" }, { backend: "bf16" }), "bf16");  // runs without attention fields
});

test("runs of one sampling by one node's two models are summed per step", () => {
  const cond = { run: "12:conditional-1", group: "12:conditional-1", node: "12:conditional", backend: "fused_triton",
    status: "ok", steps: 2, step_seconds: [0.5, 0.25], mean: 0.375, median: 0.375, total: 0.75, calls: 2 };
  const uncond = { ...cond, run: "12:unconditional-2", node: "12:unconditional", step_seconds: [0.125, 0.0625], calls: 2 };
  const other = { ...cond, run: "7-3", group: "7-3", node: "7", step_seconds: [1, 3], mean: 2, median: 2, total: 4 };
  const [m, o] = f.mergeRuns([cond, uncond, other]);
  assert.equal(m.node, "12");
  assert.deepEqual(m.parts, ["12:conditional", "12:unconditional"]);
  assert.deepEqual(m.step_seconds, [0.625, 0.3125]);
  assert.equal(m.total, 0.9375);
  assert.equal(m.mean, 0.46875);
  assert.equal(m.calls, 4);
  assert.deepEqual([o.node, o.step_seconds, o.mean, o.total], ["7", [1, 3], 2, 4]);
  assert.equal(f.mergeRuns([{ ...uncond, status: "interrupted" }, cond])[0].status, "interrupted");
  assert.equal(f.nodeKey("12:conditional"), "12");
  assert.equal(f.nodeKey(7), "7");
});

test("the badge names the backend that ran, with the requested one when it fell back", () => {
  const r = (backend, backend_requested, backends) => ({ backend, backend_requested, backends });
  assert.equal(f.backendLabel(r("fused_triton", "fused_triton", { fused_triton: 12 })), "fused_triton");
  assert.equal(f.backendLabel(r("torch_int_mm", "fused_triton", { torch_int_mm: 12 })),
    "torch_int_mm (fallback from fused_triton)");
  assert.equal(f.backendLabel(r("fused_triton", "fused_triton", { torch_int_mm: 4, fused_triton: 120 })),
    "fused_triton (4 of 124 layers on torch_int_mm)");
  assert.equal(f.backendLabel(r("torch_int_mm", "fused_triton", { torch_int_mm: 3, dequant_bf16: 1 })),
    "torch_int_mm (fallback from fused_triton; 1 of 4 layers on dequant_bf16)");
  assert.equal(f.backendLabel(r("fused_triton", "bf16", { fused_triton: 7 })), "fused_triton (requested bf16)");
  assert.equal(f.backendLabel(r("bf16", "bf16", {})), "bf16");
  assert.equal(f.backendLabel({ backend: "dequant_bf16" }), "dequant_bf16");  // a run from an older server
  assert.equal(f.backendLabel(null), null);
  assert.equal(f.ranBackend({ torch_int_mm: 3, dequant_bf16: 1 }), "torch_int_mm");
  assert.equal(f.ranBackend({ torch_int_mm: 2, dequant_bf16: 2 }), "dequant_bf16");  // a tie: by name
  assert.equal(f.ranBackend({}), null);
});

test("a failed run shows its error; ok and interrupted runs have none", () => {
  assert.equal(f.errorText({ status: "error", error: "RuntimeError: CUDA out of memory" }),
    "error: RuntimeError: CUDA out of memory");
  assert.equal(f.errorText({ status: "error", error: null }), "error: unknown error");
  assert.equal(f.errorText({ status: "interrupted", error: null }), null);
  assert.equal(f.errorText({ status: "ok" }), null);
  assert.equal(f.errorText(null), null);
});

test("merging a dual-model run sums its backends and keeps an error", () => {
  const a = { run: "5:conditional-1", group: "5:conditional-1", node: "5:conditional", backend: "torch_int_mm",
    backend_requested: "fused_triton", backends: { torch_int_mm: 3 }, status: "ok", error: null,
    steps: 1, step_seconds: [0.5], mean: 0.5, median: 0.5, total: 0.5, calls: 1 };
  const b = { ...a, run: "5:unconditional-2", node: "5:unconditional", backend: "dequant_bf16",
    backends: { dequant_bf16: 2, torch_int_mm: 2 }, status: "error", error: "ValueError: bad" };
  const [m] = f.mergeRuns([a, b]);
  assert.deepEqual(m.backends, { torch_int_mm: 5, dequant_bf16: 2 });
  assert.equal(m.backend, "torch_int_mm");
  assert.equal(f.backendLabel(m), "torch_int_mm (fallback from fused_triton; 2 of 7 layers on dequant_bf16)");
  assert.equal(m.status, "error");
  assert.equal(m.error, "ValueError: bad");
  const [i] = f.mergeRuns([a, { ...b, status: "interrupted", error: null }]);
  assert.deepEqual([i.status, i.error], ["interrupted", null]);
});
