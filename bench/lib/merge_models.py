"""Merge the H200 runs of bench/e2e_models.py (bench/results/models-runs/h200-e2e-models-<run>.json, one device
call each) into bench/results/h200-e2e-models.json: every measured row tagged with its run and commit, the rows
of a run that failed in the bench itself (``error`` without an ``oom`` status: a row that ran out of memory is
a result) kept apart under ``bench_errors``. A run named ``<commit>-cold`` holds the ``--cold`` rows.

Also the VRAM-limited runs (bench/results/vram-runs/h200-vram-limited-<run>.json, from bench/e2e_models.py and
bench/e2e_sampler.py with ``--vram-gib``) into bench/results/h200-vram-limited.json, issue 36's checks computed
again over the merged rows (within a run, model, workflow and size).
Prints the summary of each (the whole-sample s/step first). Run: python3 bench/lib/merge_models.py [--results DIR]
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.lib import e2e_runs  # noqa: E402

KEYS = ("run", "model", "workflow", "resolution", "vram_gib", "cold")


def merge(results: Path, folder: str, prefix: str) -> tuple[dict, list, list]:
    """(run -> document without rows, rows, bench errors) of ``results/<folder>/<prefix><run>.json``."""
    rows, errors, meta = [], [], {}
    for f in sorted((results / folder).glob(f"{prefix}*.json")):
        doc = json.loads(f.read_text())
        run = f.stem[len(prefix):]
        meta[run] = {k: v for k, v in doc.items() if k != "rows"}
        for r in doc["rows"]:
            if r.get("check") in ("issue13", "issue36"):  # their row numbers are the run's: computed again
                continue
            r = dict(r, run=run, commit=doc.get("commit"))
            r.pop("h2d_sources", None)
            (errors if "error" in r and r.get("status") != "oom" else rows).append(r)
    return meta, rows, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="the results folder")
    results = ap.parse_args().results
    meta, rows, errors = merge(results, "models-runs", "h200-e2e-models-")
    out = results / "h200-e2e-models.json"
    out.write_text(json.dumps({"runs": meta, "rows": rows, "bench_errors": errors}, indent=1))
    e2e_runs.summary(rows, ("run", "model", "path"), KEYS)
    print(f"{len(rows)} rows ({len(errors)} bench errors) from runs {', '.join(meta)} -> {out}")
    meta, rows, errors = merge(results, "vram-runs", "h200-vram-limited-")
    if meta:
        rows += e2e_runs.vram_targets(rows, KEYS)
        out = results / "h200-vram-limited.json"
        out.write_text(json.dumps({"runs": meta, "rows": rows, "bench_errors": errors}, indent=1))
        e2e_runs.summary(rows, ("run", "model", "path"), KEYS)
        e2e_runs.print_checks(rows)
        print(f"{len(rows)} rows ({len(errors)} bench errors) from runs {', '.join(meta)} -> {out}")


if __name__ == "__main__":
    main()
