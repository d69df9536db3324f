"""Merge the H200 runs of the sampler benches (one device call, one file each) into the files bench/RESULTS.md cites:

  sampler-runs/h200-e2e-sampler-<run>.json   -> h200-e2e-sampler.json   (bench/e2e_sampler.py)
  models-runs/h200-e2e-models-<run>.json     -> h200-e2e-models.json    (bench/e2e_models.py)
  vram-runs/h200-vram-limited-<run>.json     -> h200-vram-limited.json  (either bench with ``--vram-gib``)
  cold-runs/<gpu>-cold-<run>.json            -> <gpu>-cold.json          (bench/h200.sh cold: bench/e2e_models.py
                                                                          --cold; gpu h100, h200)

Every measured row is tagged with its run and commit; the rows of a run that failed in the bench itself (``error``
without an ``oom`` status: a row that ran out of memory is a result) are kept apart under ``bench_errors``. The runs'
own target checks are dropped: their row numbers are the run's, so issue 36's checks are computed again over the
merged VRAM-limited rows (within a run, model, workflow and size), and issue 48's over the cold rows (within a run,
with the run's GPU). A run named ``<commit>-cold`` holds the ``--cold``
rows. A kind with no run files is left alone. Prints the summary of each (the whole-sample s/step first).

Run: python3 bench/lib/merge.py [--results DIR]
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.lib import e2e_runs  # noqa: E402

KEYS = ("run", "model", "workflow", "resolution", "vram_gib", "cold")
# (run folder, file prefix, merged file, summary's lead columns)
KINDS = (("sampler-runs", "h200-e2e-sampler-", "h200-e2e-sampler.json", ("run", "workflow", "resolution", "path")),
         ("models-runs", "h200-e2e-models-", "h200-e2e-models.json", ("run", "model", "path")),
         ("vram-runs", "h200-vram-limited-", "h200-vram-limited.json", ("run", "model", "path")),
         ("cold-runs", "h100-cold-", "h100-cold.json", ("run", "model", "path")),
         ("cold-runs", "h200-cold-", "h200-cold.json", ("run", "model", "path")))


def merge(results: Path, folder: str, prefix: str) -> tuple[dict, list, list]:
    """(run -> document without rows, rows, bench errors) of ``results/<folder>/<prefix><run>.json``."""
    rows, errors, meta = [], [], {}
    for f in sorted((results / folder).glob(f"{prefix}*.json")):
        doc = json.loads(f.read_text())
        run = f.stem[len(prefix):]
        meta[run] = {k: v for k, v in doc.items() if k != "rows"}
        for r in doc["rows"]:
            if r.get("check") in ("issue13", "issue36", "issue48"):
                continue
            r = dict(r, run=run, commit=doc.get("commit"))
            r.pop("h2d_sources", None)
            (errors if "error" in r and r.get("status") != "oom" else rows).append(r)
    return meta, rows, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="the results folder")
    results = ap.parse_args().results
    for folder, prefix, name, lead in KINDS:
        meta, rows, errors = merge(results, folder, prefix)
        if not meta:
            continue
        if folder == "vram-runs":
            rows += e2e_runs.vram_targets(rows, KEYS)
        if folder == "cold-runs":  # each run against its own bf16 rows, with its GPU's allowance
            checks = []
            for run, m in meta.items():
                mine = [i for i, r in enumerate(rows) if r.get("run") == run]
                checks += [dict(c, run=run, row=mine[c["row"]])
                           for c in e2e_runs.cold_targets([rows[i] for i in mine], m.get("gpu"), KEYS)]
            rows += checks
        out = results / name
        out.write_text(json.dumps({"runs": meta, "rows": rows, "bench_errors": errors}, indent=1))
        e2e_runs.summary(rows, lead, KEYS)
        e2e_runs.cold_summary(rows, lead)
        e2e_runs.print_checks(rows)
        print(f"{len(rows)} rows ({len(errors)} bench errors) from runs {', '.join(meta)} -> {out}")


if __name__ == "__main__":
    main()
