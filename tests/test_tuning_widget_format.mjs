// Unit tests of the tuning texts of web/int8_format.js (run by tests/test_tuning_widget.py; node --test <this file>).
// Snapshots have the shape of kernel.tuned.progress.snapshot(); the expected texts are written out by hand.
import test from "node:test";
import assert from "node:assert/strict";
import * as f from "../web/int8_format.js";

const HEAD = "Tuning INT8 kernels for this GPU (first run only): ";
const gemm = { kind: "GEMM", label: "N=3072 K=3072 M<=4096 s8p", detail: "12 candidates", shape: 3, elapsed_s: 1.25 };
const snap = (over) => ({ active: false, current: null, shapes: 0, total: null, seconds: 0, kinds: {}, files: [],
                          seeded: {}, last_summary: null, ...over });

test("the tuning line: shape n/total, the task, the session's tuning time going on while it runs", () => {
  const s = snap({ active: true, current: gemm, shapes: 3, total: 12, seconds: 2.5 });
  assert.equal(f.tuningText(s), `${HEAD}shape 3/12 GEMM N=3072 K=3072 M<=4096 s8p, 3.8 s`);  // 2.5 + 1.25
  assert.equal(f.tuningText(s, 2), `${HEAD}shape 3/12 GEMM N=3072 K=3072 M<=4096 s8p, 5.8 s`);
  assert.equal(f.tuningText({ ...s, total: null }), `${HEAD}shape 3 GEMM N=3072 K=3072 M<=4096 s8p, 3.8 s`);
  assert.equal(f.tuningText({ ...s, total: 2 }), `${HEAD}shape 3 GEMM N=3072 K=3072 M<=4096 s8p, 3.8 s`);  // stale total
});

test("between two tasks: the shapes so far, the last task named, the time standing", () => {
  const s = snap({ shapes: 4, total: 12, seconds: 7.04 });
  assert.equal(f.tuningText(s, 3, gemm), `${HEAD}shape 4/12 GEMM N=3072 K=3072 M<=4096 s8p, 7.0 s`);
  assert.equal(f.tuningText(s, 3), `${HEAD}shape 4/12, 7.0 s`);
  assert.equal(f.tuningOpen(s), true);
});

test("no session open: no tuning line; the last summary without its prefix and cache files", () => {
  const line = "INT8 autotune: tuned 12 shapes in 14.2 s (9 GEMM, 3 dispatch); cached in /c/a.json, /c/b.json";
  const s = snap({ last_summary: line });
  assert.equal(f.tuningOpen(s), false);
  assert.equal(f.tuningText(s, 1, gemm), null);
  assert.equal(f.tuningSummary(s), "tuned 12 shapes in 14.2 s (9 GEMM, 3 dispatch)");
  assert.equal(f.tuningSummary(snap({ last_summary: "INT8 autotune: tuned 1 shape in 0.3 s (1 GEMM)" })),
               "tuned 1 shape in 0.3 s (1 GEMM)");
  assert.equal(f.tuningSummary(snap({})), null);
  assert.equal(f.tuningSummary(null), null);
  assert.equal(f.tuningText(null), null);
});

test("the shipped tables' counts: every section, in the tables' order; none used, no line", () => {
  assert.equal(f.seededText(snap({ seeded: { dispatch: 12, gemm: 40, attention: 3 } })),
               "shipped tuned table: 40 gemm / 12 dispatch / 3 attention");
  assert.equal(f.seededText(snap({ seeded: { gemm: 2 } })), "shipped tuned table: 2 gemm / 0 dispatch / 0 attention");
  assert.equal(f.seededText(snap({ seeded: {} })), null);
  assert.equal(f.seededText(snap({ seeded: { gemm: 0 } })), null);
  assert.equal(f.seededText(null), null);
});

test("wrapped lines, as the browser wraps words (one char = 6 px, the space too)", () => {
  const w = (s) => 6 * s.length;
  assert.equal(f.wrappedLines("", 60, w), 0);
  assert.equal(f.wrappedLines("aaaa bbbb", 60, w), 1);       // 54 px
  assert.equal(f.wrappedLines("aaaa bbbbb", 60, w), 1);      // 60 px: exactly the room
  assert.equal(f.wrappedLines("aaaa bbbbbb", 60, w), 2);     // 66 px
  assert.equal(f.wrappedLines("aaaa bbbb cccc dddd", 60, w), 2);
  assert.equal(f.wrappedLines("a".repeat(25), 60, w), 3);    // 150 px broken anywhere: 60 + 60 + 30
  assert.equal(f.wrappedLines(`x ${"a".repeat(25)} bb`, 60, w), 4);  // x / 60 / 60 / 30 + " bb" = 48
  assert.equal(f.wrappedLines(`x ${"a".repeat(25)} bbbbb`, 60, w), 5);
});
