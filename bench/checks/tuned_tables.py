"""Builds the pack's shipped tuned tables (``kernel/tuned/<gpu slug>.json``, see ``kernel/tuned/__init__.py``) from
the cache folders of bench runs.

    python3 bench/checks/tuned_tables.py CACHE_DIR [CACHE_DIR ...] [--out kernel/tuned] [--gpu NAME]
                                         [--triton V] [--torch V] [--replace] [--dry-run]
    python3 bench/checks/tuned_tables.py --show [SEED.json ...]

A CACHE_DIR is an ``INT8_FUSED_CACHE_DIR`` a run wrote (bench/h200.sh brings its files back in ``$OUT/cache``): its
``gemm-<gpu>-triton-<v>.json`` (tile configs, tail splits, SwiGLU tiles), ``dispatch-<version>-<gpu>-torch-<v>-
triton-<v>.json`` (int8-vs-float decisions; other decision versions are skipped) and ``attention-<gpu>-torch-<v>.json``
(SDPA backends). Per GPU named in the files (``gpu`` in a file's meta, else the file name matched against the GPU
names the other files give; ``--gpu`` adds a name), each section takes the entries its cache would accept (the
caches' own validators), with attention keys' device index dropped (``kernel.tuned.attention_key``) and decisions
cut to their path and timings. One Triton / torch version a section: a folder holding several needs ``--triton`` /
``--torch``. Forced-generation files (``NVIDIA H200 as sm_89``, bench/checks/consumer_tiles.py) and set-aside files
(``*.bad-*``) are skipped.

The seed of each GPU is merged into ``--out``'s existing file: a section measured with the same versions keeps its
old keys and takes the new values; one measured with other versions is replaced (``--replace``: start empty). Run on
any machine (no GPU; torch is imported for the validators).
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))
import pack_import  # noqa: E402
pack_import.install()  # kernel, quant, adapters: the pack's subpackages, imported one way (tests/pack_import.py)
from bench.lib import provenance  # noqa: E402
from kernel import autotune, tuned  # noqa: E402
from quant import attention, dispatch  # noqa: E402

DECISION_FIELDS = ("path", "int8_ms", "float_ms", "int8_gpu_ms", "float_gpu_ms", "m")
_FILES = {  # section -> (file name pattern: slug, versions; the section inside the file)
    "gemm": (re.compile(r"^gemm-(?P<slug>.+?)-triton-(?P<triton>.+)\.json$"), "configs"),
    "dispatch": (re.compile(r"^dispatch-(?P<decisions>v\d+)-(?P<slug>.+?)-torch-(?P<torch>.+?)-triton-(?P<triton>.+)"
                            r"\.json$"), "decisions"),
    "attention": (re.compile(r"^attention-(?P<slug>.+?)-torch-(?P<torch>.+)\.json$"), "configs"),
}
VERSION_FIELDS = {"gemm": ("triton",), "dispatch": ("decisions", "torch", "triton"), "attention": ("torch",)}


def _gemm_entry(key: str, e):
    return e if autotune._GEMM_KEY.match(key) and autotune.valid_entry(key, e) else None


def _decision_entry(key: str, e):
    if not dispatch._valid_decision(key, e):
        return None
    return {f: e[f] for f in DECISION_FIELDS if f in e}


def _attention_entry(key: str, e):
    if not attention.valid_entry(key, e) or autotune._GEMM_KEY.match(key):
        return None
    return {"backend": e["backend"], "ms": e.get("ms", {})}


NORMALISE = {"gemm": (lambda k: k, _gemm_entry), "dispatch": (lambda k: k, _decision_entry),
             "attention": (tuned.attention_key, _attention_entry)}


def read_folder(folder: Path, notes: list) -> list[dict]:
    """Every cache file of ``folder`` as {"section", "path", "gpu" (from its meta, or None), "slug", "versions",
    "entries" (normalised, valid)}."""
    found = []
    for path in sorted(folder.glob("*.json")):
        for section, (pattern, inner) in _FILES.items():
            m = pattern.match(path.name)
            if m is None:
                continue
            if section == "dispatch" and m["decisions"] != dispatch.DECISIONS_VERSION:
                notes.append(f"{path.name}: decisions {m['decisions']}, not {dispatch.DECISIONS_VERSION}: skipped")
                break
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                raw = data[inner]
                assert isinstance(raw, dict)
            except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
                notes.append(f"{path.name}: unreadable ({type(e).__name__}): skipped")
                break
            key_fn, entry_fn = NORMALISE[section]
            entries, dropped = {}, 0
            for k in sorted(raw):
                e = entry_fn(k, raw[k])
                if e is None:
                    dropped += 1
                    continue
                entries.setdefault(key_fn(k), e)  # the first device index of a shape (sorted keys)
            if dropped:
                notes.append(f"{path.name}: {dropped} entries the cache would not use: left out")
            gpu = data.get("gpu") if isinstance(data.get("gpu"), str) and data.get("gpu") != "cpu" else None
            versions = {f: m[f] for f in VERSION_FIELDS[section]}  # the meta's spelling where it has one
            versions.update({f: data[f] for f in ("torch", "triton") if f in versions and isinstance(data.get(f), str)})
            found.append({"section": section, "path": path, "gpu": gpu, "slug": m["slug"], "versions": versions,
                          "entries": entries})
            break
    return found


def build(folders: list[Path], gpus: tuple[str, ...] = (), pins: dict | None = None,
          notes: list | None = None) -> dict[str, dict]:
    """{GPU name: seed document} from the cache files of ``folders`` (module doc). ``gpus``: names for files whose
    meta lacks one; ``pins``: {"triton": v, "torch": v} choosing among several versions."""
    notes = [] if notes is None else notes
    files = [f for d in folders for f in read_folder(Path(d), notes)]
    names = {f["gpu"] for f in files if f["gpu"]} | set(gpus)
    by_slug = {}
    for n in names:
        by_slug.setdefault(tuned.slug(n), set()).add(n)
    for f in files:
        if f["gpu"] is None:
            cands = by_slug.get(f["slug"], set())
            if len(cands) == 1:
                f["gpu"] = next(iter(cands))
            else:
                notes.append(f"{f['path'].name}: no GPU name for slug {f['slug']!r} (pass --gpu): skipped")
    seeds: dict[str, dict] = {}
    for gpu in sorted({f["gpu"] for f in files if f["gpu"]}):
        if " as sm_" in gpu:
            notes.append(f"{gpu}: a forced tile generation (bench/checks/consumer_tiles.py): skipped")
            continue
        if gpus and gpu not in gpus:
            continue
        doc = {"format": tuned.FORMAT, "gpu": gpu, "measured_with": {}, "sources": []}
        for section in tuned.SECTIONS:
            mine = [f for f in files if f["gpu"] == gpu and f["section"] == section
                    and all(f["versions"].get(k) == v for k, v in (pins or {}).items() if v and k in f["versions"])]
            vers = {tuple(sorted(f["versions"].items())) for f in mine}
            if len(vers) > 1:
                raise SystemExit(f"{gpu} {section}: cache files of several versions "
                                 f"({'; '.join(str(dict(v)) for v in sorted(vers))}): pass --triton / --torch")
            doc[section] = {}
            for f in mine:
                doc[section].update(f["entries"])
                doc["sources"].append(f"{f['path'].parent.name}/{f['path'].name}: {len(f['entries'])} {section}")
            if mine:
                doc["measured_with"][section] = dict(mine[0]["versions"])
        seeds[gpu] = doc
    return seeds


def merge(old: dict | None, new: dict, notes: list) -> dict:
    """``new`` laid over the seed ``old`` of the same GPU (module doc)."""
    if not old or old.get("gpu") != new["gpu"] or old.get("format") != tuned.FORMAT:
        return new
    out = {**new, "measured_with": dict(old.get("measured_with", {})), "sources": list(old.get("sources", []))}
    for s in tuned.SECTIONS:
        was, now = old.get("measured_with", {}).get(s), new["measured_with"].get(s)
        if now is None:
            out[s] = dict(old.get(s, {}))
            continue
        if was == now:
            out[s] = {**old.get(s, {}), **new[s]}
        else:
            out[s] = dict(new[s])
            if old.get(s):
                notes.append(f"{new['gpu']} {s}: the old table was measured with {was}, the new with {now}: replaced")
        out["measured_with"][s] = now
    out["sources"] += [x for x in new["sources"] if x not in out["sources"]]
    return out


def summary(doc: dict) -> str:
    return (f"{doc['gpu']}: " + ", ".join(f"{len(doc.get(s, {}))} {s}" for s in tuned.SECTIONS)
            + " (" + "; ".join(f"{s} {v}" for s, v in doc.get("measured_with", {}).items()) + ")")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("folders", nargs="*", type=Path, help="INT8_FUSED_CACHE_DIR folders of bench runs")
    ap.add_argument("--out", type=Path, default=tuned.SEED_DIR, help="folder of the seed files (default: %(default)s)")
    ap.add_argument("--gpu", action="append", default=[], help="a GPU name for files whose meta lacks one; also "
                    "limits the build to the GPUs named")
    ap.add_argument("--triton", help="take only cache files of this Triton version")
    ap.add_argument("--torch", help="take only cache files of this torch version")
    ap.add_argument("--replace", action="store_true", help="do not merge with the existing seed files")
    ap.add_argument("--dry-run", action="store_true", help="print what would be written, write nothing")
    ap.add_argument("--show", nargs="*", type=Path, help="print a summary of seed files (default: every one in --out)")
    a = ap.parse_args(argv)
    if a.show is not None:
        for p in a.show or sorted(a.out.glob("*.json")):
            data = tuned.read(Path(p))
            print(f"{p}: " + (summary(data) if data else "not a seed file"))
        return 0
    if not a.folders:
        ap.error("name at least one cache folder (or --show)")
    notes: list = []
    seeds = build(a.folders, tuple(a.gpu), {"triton": a.triton, "torch": a.torch}, notes)
    for gpu, doc in seeds.items():
        path = tuned.seed_path(gpu, a.out)
        old = None if a.replace else (tuned.read(path) if path.exists() else None)
        doc = merge(old, doc, notes)
        doc["built"] = {"at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                        "commit": provenance.commit(), "command": provenance.command()}
        print(("would write " if a.dry_run else "wrote ") + f"{path}: {summary(doc)}")
        if not a.dry_run:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    for n in notes:
        print("note:", n)
    if not seeds:
        print("no cache files with a GPU name found", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
