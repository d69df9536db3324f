"""Merge the H200 runs of bench/e2e_models.py (bench/results/models-runs/h200-e2e-models-<run>.json, one device
call each) into bench/results/h200-e2e-models.json: every measured row tagged with its run and commit, the rows
of a run that failed in the bench itself (``error``) kept apart under ``bench_errors``.
Run: python3 bench/merge_models.py
"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    rows, errors, meta = [], [], {}
    for f in sorted((HERE / "results" / "models-runs").glob("h200-e2e-models-*.json")):
        doc = json.loads(f.read_text())
        run = f.stem.rsplit("-", 1)[-1]
        meta[run] = {k: v for k, v in doc.items() if k != "rows"}
        for r in doc["rows"]:
            r = dict(r, run=run, commit=doc.get("commit"))
            r.pop("h2d_sources", None)
            (errors if "error" in r else rows).append(r)
    out = HERE / "results" / "h200-e2e-models.json"
    out.write_text(json.dumps({"runs": meta, "rows": rows, "bench_errors": errors}, indent=1))
    print(f"{len(rows)} rows ({len(errors)} bench errors) from runs {', '.join(meta)} -> {out}")


if __name__ == "__main__":
    main()
