"""Merge the H200 sampler-bench runs (bench/results/sampler-runs/h200-e2e-sampler-<run>.json, one device call
each) into bench/results/h200-e2e-sampler.json: every measured row, tagged with its run, plus the issue's
columns {resolution, workflow, path, patcher, s_per_step, h2d_copies_per_step, peak_gib, rel_l2_vs_bf16}.

``h2d_copies_per_step`` counts host->device copies inside the sampling loop, attributed by the profiler's
Python stacks (run d onward): copies made once per sampling run (ComfyUI's load at its start, the sampler's
setup) are counted apart (``h2d_copies_per_run_start``); ``h2d_weight_copies_per_step`` leaves out ComfyUI's
own per-step copy of the conditioning (``model_base._apply_model``). Runs without stacks keep the raw count of
the 2-step profile window (``h2d_copies_per_step_raw``) and null there. A run named ``<commit>-cold`` holds the
``--cold`` rows. Prints the summary (the whole-sample s/step first).
Run: python3 bench/lib/merge_sampler.py [--results DIR]
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.lib import e2e_runs  # noqa: E402

RUN_START = ("patch_weight_to_device", "partially_load", "outer_sample")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="the results folder")
    results = ap.parse_args().results
    rows, meta = [], {}
    for f in sorted((results / "sampler-runs").glob("h200-e2e-sampler-*.json")):
        doc = json.loads(f.read_text())
        run = f.stem[len("h200-e2e-sampler-"):]
        meta[run] = {k: v for k, v in doc.items() if k != "rows"}
        for r in doc["rows"]:
            r = dict(r, run=run)
            src = r.pop("h2d_sources", None)
            if "h2d_copies_per_step" in r and "h2d_copies_per_step_raw" not in r:
                r["h2d_copies_per_step_raw"] = r.pop("h2d_copies_per_step")
                r["h2d_mib_per_step_raw"] = r.pop("h2d_mib_per_step", None)
                r["h2d_pageable_per_step_raw"] = r.pop("h2d_pageable_per_step", None)
            if src and any(" < " in n for n, _, _ in src):  # stacks deep enough to tell copies apart
                loop = [(n, c) for n, c, _ in src if not any(k in n for k in RUN_START)]
                r["h2d_copies_per_step"] = sum(c for _, c in loop)
                r["h2d_weight_copies_per_step"] = sum(c for n, c in loop if "_apply_model" not in n)
                r["h2d_copies_per_run_start"] = 2 * sum(c for n, c, _ in src if any(k in n for k in RUN_START))
                r["h2d_sources"] = src
            elif "h2d_copies_per_step_raw" in r:
                r["h2d_copies_per_step"] = None
            rows.append(r)
    out = results / "h200-e2e-sampler.json"
    out.write_text(json.dumps({"runs": meta, "rows": rows}, indent=1))
    e2e_runs.summary(rows, ("run", "workflow", "resolution", "path"),
                     ("run", "workflow", "resolution", "vram_gib", "cold"))
    print(f"{len(rows)} rows from runs {', '.join(meta)} -> {out}")


if __name__ == "__main__":
    main()
