"""The first call of each GEMM shape with and without a shipped tuned table (kernel/tuned), each in a fresh process
with empty INT8_FUSED_CACHE_DIR and TRITON_CACHE_DIR (issue 38 item 1).

    python3 bench/tuned_cold.py [--out bench/results/h200-tuned-cold.json] [--shapes N,K,M;...] [--smoke]

Three child processes run ``kernel.int8_linear`` once on each shape (random bf16 activations, random int8 weights),
then a second time:
  tune    shipped tables off (``kernel.tuned.ENABLED = False``): every candidate tile and tail split timed
  seeded  a table built (bench/tuned_tables.py) from the tune child's cache folder, and new, empty cache folders:
          nothing may be timed (``timed`` counts ``triton.testing.do_bench`` calls), one build of each seeded config
  warm    the tune child's folders again (a second process on a machine whose caches hold the shapes)
Per shape: ``first_s`` (the first call, synchronised), ``second_s``, ``timed``, the output's checksum (the three
must agree: same int32 sums, same epilogue). ``--smoke``: a CPU run of the same plumbing (TRITON_INTERPRET=1, tiny
shapes; the interpreter tunes nothing), for tests/test_tuned_tables.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import provenance  # noqa: E402

# Flux.1 at 1024²: 4096 image + 512 text tokens in the single-stream blocks; img/txt linears of the double blocks
FLUX = "9216,3072,4608;3072,3072,4608;21504,3072,4608;3072,15360,4608;12288,3072,4096;3072,12288,4096;3072,3072,512"
SMOKE = "24,40,20"


def child(a) -> dict:
    import torch
    import triton.testing
    import kernel
    import kernel.tuned
    if a.seed_dir:
        kernel.tuned.SEED_DIR = Path(a.seed_dir)
    else:
        kernel.tuned.ENABLED = False
    timed = [0]
    do_bench = triton.testing.do_bench

    def counting(*args, **kw):
        timed[0] += 1
        return do_bench(*args, **kw)
    triton.testing.do_bench = counting
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for shape in a.shapes.split(";"):
        n, k, m = (int(v) for v in shape.split(","))
        g = torch.Generator(device="cpu").manual_seed(n * 7 + k)
        x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
        w_q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(dev)
        w_s = (torch.rand(n, generator=g) * 0.01 + 0.001).to(dev)
        row = {"n": n, "k": k, "m": m}
        before = timed[0]
        for name in ("first_s", "second_s"):
            sync()
            t0 = time.perf_counter()
            y = kernel.int8_linear(x, w_q, w_s)
            sync()
            row[name] = round(time.perf_counter() - t0, 4)
        row["timed"] = timed[0] - before
        row["checksum"] = float(y.double().sum())
        rows.append(row)
        print(f"[{a.child}] N {n} K {k} M {m}: first {row['first_s']:.3f} s, second {row['second_s']:.4f} s, "
              f"{row['timed']} timings", flush=True)
    return {"phase": a.child, "device": str(dev), "rows": rows}


def run_child(phase: str, a, cache: Path, triton_cache: Path, seed_dir: Path | None) -> dict:
    out = cache.parent / f"{phase}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "INT8_FUSED_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(triton_cache)}
    if a.smoke:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", phase, "--shapes", a.shapes, "--out", str(out)]
    cmd += ["--seed-dir", str(seed_dir)] if seed_dir else []
    cmd += ["--smoke"] if a.smoke else []
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, timeout=a.child_timeout)
    doc = json.loads(out.read_text())
    doc["process_s"] = round(time.perf_counter() - t0, 2)
    return doc


def gpu_provenance() -> dict:
    import torch
    import triton
    info = {"torch": torch.__version__, "triton": triton.__version__, "commit": provenance.commit(),
            "dirty": provenance.dirty(), "command": [sys.executable, *sys.argv],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "?"
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/h200-tuned-cold.json")
    ap.add_argument("--shapes", default=None, help=f"N,K,M;... (default: Flux.1 1024² {FLUX}; --smoke: {SMOKE})")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check (TRITON_INTERPRET=1, tiny shapes)")
    ap.add_argument("--child-timeout", type=float, default=400.0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--seed-dir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.shapes = a.shapes or (SMOKE if a.smoke else FLUX)
    if a.child:
        a.out.write_text(json.dumps(child(a)))
        return 0
    from bench import tuned_tables
    work = Path(tempfile.mkdtemp(prefix="tuned_cold_"))
    a_cache, a_triton = work / "a" / "autotune", work / "a" / "triton"
    tune = run_child("tune", a, a_cache, a_triton, None)
    seeds = tuned_tables.build([a_cache]) if a_cache.exists() else {}
    seed_dir = work / "seeds"
    seed_dir.mkdir()
    import kernel.tuned
    for gpu, doc in seeds.items():
        kernel.tuned.seed_path(gpu, seed_dir).write_text(json.dumps(doc))
    seeded = run_child("seeded", a, work / "b" / "autotune", work / "b" / "triton", seed_dir)
    warm = run_child("warm", a, a_cache, a_triton, None)
    phases = {"tune": tune, "seeded": seeded, "warm": warm}
    summary = {}
    for name, doc in phases.items():
        summary[name] = {"first_calls_s": round(sum(r["first_s"] for r in doc["rows"]), 3),
                         "timed": sum(r["timed"] for r in doc["rows"]), "process_s": doc["process_s"]}
    same = all(len({phases[p]["rows"][i]["checksum"] for p in phases}) == 1 for i in range(len(tune["rows"])))
    result = {"provenance": gpu_provenance(), "smoke": a.smoke, "shapes": a.shapes, "summary": summary,
              "outputs_agree": same, "seed_entries": {g: {s: len(d[s]) for s in kernel.tuned.SECTIONS}
                                                       for g, d in seeds.items()},
              "phases": phases}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"summary": summary, "outputs_agree": same, "seed_entries": result["seed_entries"]}, indent=1))
    return 0 if same and (a.smoke or summary["seeded"]["timed"] == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
