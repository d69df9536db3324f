"""One process per (model, path) for bench/e2e_models.py and bench/e2e_sampler.py: ``--cold``, ``--vram-gib``.

Imports neither torch nor ComfyUI at import time: the parent process of an isolated run never does, so each child
starts with the environment its row needs.

- ``--cold``: each child gets a new, empty ``INT8_FUSED_CACHE_DIR`` (the pack's autotune / dispatch cache) and
  ``TRITON_CACHE_DIR`` (compiled kernels), set before it imports torch, removed when it ends: its
  ``first_sample_s`` is a first sample on a machine that never ran the pack.
- ``--vram-gib N[,M...]``: a holder process (``python3 bench/lib/e2e_runs.py --hold``, plain ``cudaMalloc`` through
  torch's native allocator) takes all but N GiB of the GPU before the children start, as another program would;
  ComfyUI in the child then plans its offload for the N GiB it finds free. The holder ends with the parent (its
  stdin closes), and children die with the parent (``PR_SET_PDEATHSIG``).
- ``--cold`` with ``second=True`` (bench/e2e_models.py's cold suite): after each child, a second, fresh child of the
  same unit reuses its cache folders (now warm) and runs only its first sample; its row is folded into the first's
  as ``second_process_first_s`` / ``second_process_pid`` / ``second_process`` (what its cache folders held when it
  started: ``caches_at_start``). The folders are removed after the second child.
- Every child writes its own JSON; the parent merges the rows (tagged ``cold``, ``vram_gib``, ``isolated``) and
  the first child's provenance into ``--out``, after every child. A child that dies leaves a row with
  ``status`` ``oom`` (the log says out of memory), ``killed`` (signal 9: the host's OOM killer or a timeout) or
  ``crashed``.

In a child (and in a plain run) ``host_rss`` reads VmRSS / VmHWM of the process and ``reset_peak_rss`` restarts
VmHWM (``/proc/self/clear_refs``), so a row's host peak leaves out the bench's own state-dict building.
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GIB = 2 ** 30
# flags of the parent that a child does not get, with whether they take a value
PARENT_ONLY = {"--cold": False, "--isolate": False, "--vram-gib": True, "--out": True, "--models": True,
               "--paths": True, "--child-timeout": True, "--no-second-process": False}
OTHERS_ENV = "INT8_BENCH_OTHERS_BYTES"  # device memory other processes hold (the holder), for a child's peak


def logger(tag: str):
    """A ``log(*a)`` that prints its arguments after ``[tag HH:MM:SS]``, flushed (children's lines reach the parent
    as they come)."""
    def log(*a):
        print(f"[{tag} {time.strftime('%H:%M:%S')}]", *a, flush=True)
    return log


log = logger("isolated")


# ----------------------------------------------------------------------------- in a bench process
def host_rss() -> dict:
    """{"host_rss_gib", "host_rss_peak_gib"}: VmRSS and VmHWM of this process (Linux), {} elsewhere."""
    out = {}
    try:
        for ln in Path("/proc/self/status").read_text().splitlines():
            k, _, v = ln.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out["host_rss_gib" if k == "VmRSS" else "host_rss_peak_gib"] = int(v.split()[0]) / 2 ** 20
    except OSError:
        pass
    return out


def reset_peak_rss() -> bool:
    """Restart VmHWM at the current RSS (``echo 5 > /proc/self/clear_refs``); whether the kernel took it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    r = host_rss()
    return bool(r) and r["host_rss_peak_gib"] <= r["host_rss_gib"] + 1 / 1024


def is_oom(e: BaseException) -> bool:
    """A device (or host) out-of-memory error, as torch, ComfyUI or comfy-aimdo raise it."""
    return type(e).__name__ in ("OutOfMemoryError", "MemoryError") or "out of memory" in str(e).lower()


def error_fields(e: BaseException, prefix: str = "") -> dict:
    """A failed row's ``status`` ("oom" / "error") and ``error`` message."""
    return {"status": "oom" if is_oom(e) else "error", "error": f"{prefix}{type(e).__name__}: {e}"[:500]}


def caches(pack) -> dict:
    """The cache folders this process uses: the pack's autotune / dispatch cache and Triton's kernel cache."""
    import importlib
    out = {"int8_fused": str(importlib.import_module(pack.__name__ + ".kernel.config").get("INT8_FUSED_CACHE_DIR"))}
    try:
        from triton import knobs
        out["triton"] = str(knobs.cache.dir)
    except ImportError:  # Triton before 3.4
        out["triton"] = os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache")
    return out


CACHE_ENVS = {"int8_fused": "INT8_FUSED_CACHE_DIR", "triton": "TRITON_CACHE_DIR"}
MARKER = "int8-bench-left-by.json"  # what a cold child leaves in its cache folders: its pid


def cache_listing() -> dict:
    """What this process's cache folders (``INT8_FUSED_CACHE_DIR``, ``TRITON_CACHE_DIR`` from the environment) hold
    now: per folder its path, files and bytes (recursive), and the pid in the marker a bench process left there
    (``left_by_pid``; None without one). Read before torch is imported: a child's ``caches_at_start``."""
    out = {}
    for name, var in CACHE_ENVS.items():
        d = os.environ.get(var)
        if not d:
            out[name] = None
            continue
        root = Path(d).expanduser()
        files = [f for f in root.rglob("*") if f.is_file()] if root.is_dir() else []
        left_by = None
        try:
            left_by = json.loads((root / MARKER).read_text()).get("pid")
        except (OSError, ValueError):
            pass
        out[name] = {"dir": str(root), "files": len(files), "bytes": sum(f.stat().st_size for f in files),
                     "left_by_pid": left_by}
    return out


def leave_marker() -> None:
    """Writes ``MARKER`` (this process's pid) into each cache folder of the environment: the next process given the
    same folders can tell it got them (its ``caches_at_start``), whatever the pack and Triton wrote there."""
    for var in CACHE_ENVS.values():
        d = os.environ.get(var)
        if d:
            root = Path(d).expanduser()
            root.mkdir(parents=True, exist_ok=True)
            (root / MARKER).write_text(json.dumps({"pid": os.getpid()}))


def others_bytes() -> int:
    """Device memory held by other processes when this child started (set by the parent), 0 when alone."""
    return int(os.environ.get(OTHERS_ENV, "0") or 0)


# ----------------------------------------------------------------------------- the holder process
def hold_main() -> int:
    """The holder: for each line N on stdin, free what it holds and take all but N GiB of device 0; reply with a
    JSON line. Ends at EOF. Uses torch's native allocator (a plain cudaMalloc per block)."""
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    os.environ.pop("PYTORCH_ALLOC_CONF", None)
    import torch
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    block = None
    for ln in sys.stdin:
        want = float(ln.strip() or 0) * GIB
        block = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        n = int(free - want)
        msg = {"total_gib": total / GIB}
        try:
            if n > 0:
                block = torch.empty(n, dtype=torch.uint8, device=dev)
        except Exception as e:  # noqa: BLE001  (reported to the parent)
            msg["error"] = f"{type(e).__name__}: {e}"[:300]
        free, total = torch.cuda.mem_get_info(dev)
        msg.update(held_gib=0.0 if block is None else block.numel() / GIB, free_gib=free / GIB,
                   others_bytes=total - free)
        print(json.dumps(msg), flush=True)
    return 0


def _die_with_parent():
    """preexec_fn: SIGKILL this child when the parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    except OSError:
        pass


class VramHolder:
    """The holder process (``hold_main``); ``hold(gib)`` -> its reply."""

    def __init__(self):
        self.p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--hold"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)

    def hold(self, gib: float) -> dict:
        self.p.stdin.write(f"{gib}\n")
        self.p.stdin.flush()
        ln = self.p.stdout.readline()
        if not ln:
            raise RuntimeError(f"the VRAM holder ended (exit {self.p.wait()})")
        return json.loads(ln)

    def close(self):
        if self.p.poll() is None:
            self.p.stdin.close()
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()


# ----------------------------------------------------------------------------- the parent
def child_argv(argv: list[str]) -> list[str]:
    """``argv`` (a bench's arguments) without the flags only the parent reads (``PARENT_ONLY``)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        name = x.split("=", 1)[0]
        if name in PARENT_ONLY:
            skip = PARENT_ONLY[name] and "=" not in x
            continue
        out.append(x)
    return out


def vram_sizes(spec: str) -> list[float | None]:
    """``--vram-gib`` "24,16,12" -> [24.0, 16.0, 12.0]; "" -> [None] (the whole GPU)."""
    return [float(x) for x in spec.split(",") if x.strip()] or [None]


def run_isolated(script: Path, argv: list[str], units: list[dict], out: str, cold: bool, vram: str, device: str,
                 child_timeout: float, table=None, finish=None, second: bool = False) -> int:
    """Each unit ({"models": m, "paths": p} for e2e_models, {"paths": p} for e2e_sampler) at each ``vram`` size
    in its own child process of ``script``; rows merged into ``out``. ``finish(rows, doc)`` gives rows to add at the
    end (target checks; ``doc`` has the provenance, e.g. ``gpu``), ``table(rows)`` prints the summary. ``second``
    (with ``cold``): each unit's second process on the first's warm caches (module doc)."""
    base = child_argv(argv)
    from bench.lib import provenance
    doc: dict = {"rows": [], "isolated": True, "cold": cold, "second_process": bool(second and cold),
                 "command": provenance.command()}
    sizes = vram_sizes(vram)
    cpu = device == "cpu"
    holder = VramHolder() if sizes != [None] and not cpu else None
    t0 = time.perf_counter()

    def write():
        doc["wall_s"] = time.perf_counter() - t0
        doc["parent_imported_torch"] = "torch" in sys.modules  # must stay False: children set their caches first
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=1))

    def on_term(signum, frame):  # a timeout: keep what was measured, end the holder
        write()
        if holder is not None:
            holder.close()
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
    try:
        for gib in sizes:
            held = {}
            if gib is not None and holder is not None:
                held = holder.hold(gib)
                log(f"VRAM held for a {gib:g} GiB card: {json.dumps(held)}")
            for unit in units:
                rows, meta = run_child(script, base, unit, cold, gib, held, cpu, child_timeout, second=second)
                for k in ("gpu", "driver", "date", "torch", "triton", "commit", "comfyui", "dynamic_vram", "steps",
                          "tiny", "note"):
                    if k in meta:
                        doc.setdefault(k, meta[k])
                doc.setdefault("models", {}).update(meta.get("models", {}))
                doc["rows"].extend(rows)
                write()
    finally:
        if holder is not None:
            holder.close()
    if finish is not None:
        doc["rows"].extend(finish(doc["rows"], doc))
    write()
    if table is not None:
        table(doc["rows"])
    log(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


def _spawn(args: list[str], env: dict, timeout: float) -> tuple[int | None, bool, str, float]:
    """Runs one child (its output passed through); (exit code, whether the watchdog ended it, its last 40 lines,
    wall seconds)."""
    tail: collections.deque = collections.deque(maxlen=40)
    t0, rc = time.perf_counter(), None
    p = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=_die_with_parent)
    watchdog = threading.Timer(timeout, p.kill)  # the child's output is read to its end: a timer ends a hung one
    watchdog.start()
    try:
        for ln in p.stdout:
            sys.stdout.write(ln)
            tail.append(ln.rstrip())
        rc = p.wait()
    finally:
        timed_out = not watchdog.is_alive() and rc == -signal.SIGKILL
        watchdog.cancel()
        sys.stdout.flush()
    return rc, timed_out, "\n".join(tail), time.perf_counter() - t0


def _child_rows(child_out: Path, unit: dict, rc, timed_out: bool, text: str) -> tuple[list[dict], dict]:
    """(rows, document without rows) a child wrote; for a child that failed, a row for each path it did not get to
    (``status`` timeout / oom / killed / crashed)."""
    rows, meta = [], {}
    if child_out.exists():
        meta = json.loads(child_out.read_text())
        rows = meta.pop("rows", [])
    done = {r["path"] for r in rows if "path" in r and "check" not in r}
    if rc != 0:
        status = ("timeout" if timed_out else "oom" if "out of memory" in text.lower()
                  else "killed" if rc in (-9, 137) else "crashed")
        for path in unit["paths"].split(","):
            if path not in done:
                rows.append({**({"model": unit["models"]} if "models" in unit else {}), "path": path,
                             "status": status, "exit_code": rc, "error": text[-1500:]})
    return rows, meta


def fold_second(rows: list[dict], rows2: list[dict], meta2: dict, wall2: float) -> None:
    """Each measured row of the first child gets its second process's first sample (same model and path):
    ``second_process_first_s``, ``second_process_pid``, and ``second_process`` (status, error, what its cache
    folders held at its start, wall time)."""
    for r in rows:
        if "path" not in r or "check" in r:
            continue
        r2 = next((x for x in rows2 if x.get("path") == r["path"] and x.get("model") == r.get("model")
                   and "check" not in x), None) or \
            next((x for x in rows2 if x.get("requested_path", x.get("path")) == r.get("requested_path", r["path"])
                  and x.get("model") == r.get("model") and "check" not in x), None)
        info = {"pid": (r2 or {}).get("pid", meta2.get("pid")), "status": (r2 or {}).get("status", "missing"),
                "caches_at_start": meta2.get("caches_at_start"), "wall_s": wall2}
        if r2 is not None:
            for k in ("error", "build_s", "host_rss_peak_gib", "peak_gib"):
                if k in r2:
                    info[k] = r2[k]
        r.update(second_process_first_s=(r2 or {}).get("first_sample_s"), second_process_pid=info["pid"],
                 second_process=info)


KEEP_ENV = "BENCH_KEEP_CACHES"   # a folder: each cold child's INT8_FUSED_CACHE_DIR files are copied there


def keep_caches(src: Path, dest: Path, unit: dict) -> str | None:
    """Copies the JSON files a cold child left in its ``INT8_FUSED_CACHE_DIR`` (``src``: tile picks, dispatch
    decisions, attention backends, after its background timing settled) into ``dest/<unit>/`` before the folder is
    removed: the seeds of a shipped table (bench/checks/tuned_tables.py). Returns that folder, or None where the child
    left no file."""
    files = sorted(src.glob("*.json")) if src.is_dir() else []
    if not files:
        return None
    sub = dest / "-".join(str(v).replace(":", "_").replace(",", "+") for v in unit.values())
    sub.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy2(f, sub / f.name)
    return str(sub)


def run_child(script: Path, base: list[str], unit: dict, cold: bool, gib, held: dict, cpu: bool,
              timeout: float, second: bool = False) -> tuple[list[dict], dict]:
    """One child run of ``script`` for ``unit``: (its rows, tagged; its document's top-level fields). With ``cold``
    and ``second``, then a second child on the same (now warm) cache folders, folded in (``fold_second``)."""
    env = dict(os.environ)
    tmp = Path(tempfile.mkdtemp(prefix="int8_bench_"))
    tag = {"isolated": True, "cold": cold, "vram_gib": gib}
    if gib is not None:
        tag.update(held_gib=held.get("held_gib"), free_gib_at_start=held.get("free_gib"))
        if cpu:
            tag["vram_gib_note"] = "not applicable on the CPU (nothing held)"
        if held.get("error"):
            tag["held_error"] = held["error"]
        env[OTHERS_ENV] = str(held.get("others_bytes", 0))
    if cold:
        for k in ("INT8_FUSED_CACHE_DIR", "TRITON_CACHE_DIR"):
            env[k] = tag[k.lower()] = str(tmp / k.lower())
    child_out = tmp / "rows.json"
    args = [sys.executable, str(script), *base, "--child", "--out", str(child_out)]
    for k, v in unit.items():
        args += [f"--{k}", v]
    if gib is not None:
        args += ["--vram-gib", f"{gib:g}"]
    if cold:
        args.append("--cold")
    log(f"child: {' '.join(f'{k}={v}' for k, v in unit.items())}" + (f", {gib:g} GiB" if gib is not None else "")
        + (", cold caches" if cold else ""))
    try:
        rc, timed_out, text, wall = _spawn(args, env, timeout)
        rows, meta = _child_rows(child_out, unit, rc, timed_out, text)
        if cold and second and any(r.get("status") == "ok" for r in rows):
            log(f"child: {' '.join(f'{k}={v}' for k, v in unit.items())}, second process on the first's caches")
            out2 = tmp / "rows2.json"
            args2 = [*args[:args.index("--out") + 1], str(out2), *args[args.index("--out") + 2:], "--second-process"]
            rc2, timed_out2, text2, wall2 = _spawn(args2, env, timeout)
            rows2, meta2 = _child_rows(out2, unit, rc2, timed_out2, text2)
            fold_second(rows, rows2, meta2, wall2)
    finally:
        if cold and os.environ.get(KEEP_ENV):
            tag["kept_caches"] = keep_caches(tmp / "int8_fused_cache_dir", Path(os.environ[KEEP_ENV]), unit)
        shutil.rmtree(tmp, ignore_errors=True)
    if meta.get("caches"):
        tag["child_caches"] = meta["caches"]
    if meta.get("caches_at_start"):
        tag["caches_at_start"] = meta["caches_at_start"]
    for r in rows:
        r.update(tag)
        r.setdefault("child_wall_s", wall)
    return rows, meta


# ----------------------------------------------------------------------------- the summary
def baseline(rows: list[dict], r: dict, prefix: str, keys: tuple) -> dict | None:
    """The row of path ``prefix`` (exactly, else the first ``prefix~...``) measured like ``r`` (same ``keys``)."""
    same = [x for x in rows if "path" in x and "check" not in x and all(x.get(k) == r.get(k) for k in keys)]
    exact = [x for x in same if x["path"] == prefix]
    near = [x for x in same if x["path"].split("~")[0] == prefix]
    return (exact or near or [None])[0]


def headline(r: dict | None) -> float | None:
    """A row's headline s/step: the whole sample's (``s_per_step_whole``), else the median step's."""
    if not r:
        return None
    return r.get("s_per_step_whole") or r.get("s_per_step")


def speedups(rows: list[dict], r: dict, keys: tuple) -> tuple[float | None, float | None]:
    """(x bf16, x fp8_fast) of ``r`` on the headline figure."""
    s = headline(r)
    out = []
    for base in ("bf16", "fp8_fast"):
        ref = headline(baseline(rows, r, base, keys))
        out.append(ref / s if ref and s else None)
    return out[0], out[1]


def vram_targets(rows: list[dict], keys: tuple) -> list[dict]:
    """Issue 36's targets per (model, --vram-gib size): the pack >= 1.3x fp8_fast; >= 2x bf16 where bf16's
    weights (2 bytes a parameter) exceed the size and int8's (1 byte) do not; no OOM where core INT8 samples;
    peak host RAM (from the load on) no higher than core INT8's. Rows compare within ``keys``."""
    out = []
    for i, r in enumerate(rows):
        if r.get("vram_gib") is None or not r.get("path", "").startswith("pack:") or "check" in r:
            continue
        xb, xf = speedups(rows, r, keys)
        core = baseline(rows, r, "core_int8", keys)
        params = r.get("params")
        checks = {}
        if xf is not None:
            checks["x_fp8_fast>=1.3"] = xf >= 1.3
        if params and params * 2 / 2 ** 30 > r["vram_gib"] >= params / 2 ** 30 and xb is not None:
            checks["x_bf16>=2 (int8 fits, bf16 not)"] = xb >= 2.0
        if core is not None and core.get("status") == "ok":
            checks["no OOM where core samples"] = r.get("status") == "ok"
            mine, theirs = r.get("host_rss_peak_row_gib"), core.get("host_rss_peak_row_gib")
            if mine is not None and theirs is not None:
                checks["host RAM <= core's"] = mine <= theirs * 1.02
        out.append({"check": "issue36", "model": r.get("model"), "vram_gib": r["vram_gib"], "path": r["path"], "row": i,
                    **{k: r[k] for k in keys if k in r}, "x_bf16": xb, "x_fp8_fast": xf,
                    "checks": checks, "pass": all(checks.values()) if checks else None})
    return out


def first_allowance(gpu: str | None) -> float:
    """Issue 48: seconds the pack's first sample (empty caches) may exceed bf16's: 2 on the H200 (shipped picks),
    3 elsewhere (the H100's target: any user's card)."""
    return 2.0 if "h200" in (gpu or "").lower() else 3.0


def cold_targets(rows: list[dict], gpu: str | None, keys: tuple) -> list[dict]:
    """Issue 48's targets for each cold pack row (rows compared within ``keys``): first sample at most bf16's +
    ``first_allowance(gpu)``; the first sample at the second resolution, the process warm, at most that
    resolution's warm sample + 1 s; the second process's first sample (caches warm) at most bf16's first + 0.5 s."""
    out = []
    allow = first_allowance(gpu)
    for i, r in enumerate(rows):
        if not r.get("cold") or not r.get("path", "").startswith("pack:") or "check" in r or r.get("status") != "ok":
            continue
        bf = baseline(rows, r, "bf16", keys)
        bf_first = (bf or {}).get("first_sample_s") if (bf or {}).get("status") == "ok" else None
        first, checks = r.get("first_sample_s"), {}
        if first is not None and bf_first is not None:
            checks[f"first<=bf16+{allow:g}s"] = first <= bf_first + allow
        if r.get("second_res_first_s") is not None and r.get("second_res_warm_s") is not None:
            checks["second_res_first<=its_warm+1s"] = r["second_res_first_s"] <= r["second_res_warm_s"] + 1.0
        if r.get("second_process_first_s") is not None and bf_first is not None:
            checks["second_process_first<=bf16_first+0.5s"] = r["second_process_first_s"] <= bf_first + 0.5
        out.append({"check": "issue48", "model": r.get("model"), "path": r["path"], "row": i,
                    **{k: r[k] for k in keys if k in r}, "gpu": gpu, "bf16_first_sample_s": bf_first,
                    "first_sample_s": first, "second_res_first_s": r.get("second_res_first_s"),
                    "second_res_warm_s": r.get("second_res_warm_s"),
                    "second_process_first_s": r.get("second_process_first_s"),
                    "checks": checks, "pass": all(checks.values()) if checks else None})
    return out


def cold_summary(rows: list[dict], lead: tuple) -> None:
    """Prints the cold figures of the rows that have them (bench/e2e_models.py's cold suite): first sample in a
    fresh process with empty caches, the first and the warm sample at the second resolution, the second process's
    first sample on the first's caches."""
    cold = [r for r in rows if "path" in r and "check" not in r
            and any(k in r for k in ("second_res_first_s", "second_process_first_s"))]
    if not cold:
        return
    f = lambda v, n=8, d=2: f"{v:{n}.{d}f}" if isinstance(v, (int, float)) else f"{'-':>{n}}"  # noqa: E731
    print("\ncold (seconds, whole sample() calls): first = fresh process, empty caches; res2 first / warm = the "
          "second resolution's first sample (process warm) and its warm sample; proc2 first = a second process on "
          "the first's caches")
    w = {c: 22 if c == "path" else 14 if c == "model" else 10 for c in lead}
    print(" ".join(f"{c:<{w[c]}}" for c in lead) + f" {'res2':>9} {'first':>8} {'res2 1st':>8} {'res2 warm':>9} "
          f"{'proc2 1st':>9}  status")
    for r in cold:
        lc = " ".join(f"{str(r.get(c, '')):<{w[c]}}" for c in lead)
        print(f"{lc} {str(r.get('second_res', '-')):>9} {f(r.get('first_sample_s'))} {f(r.get('second_res_first_s'))} "
              f"{f(r.get('second_res_warm_s'), 9)} {f(r.get('second_process_first_s'), 9)}  {r.get('status', '')}"
              + (f" (proc2 {r['second_process']['status']})" if r.get("second_process", {}).get("status") not in
                 (None, "ok") else ""))


def print_checks(rows: list[dict]) -> None:
    """The target checks among ``rows`` (issue 13's, issue 36's, issue 48's), PASS / FAIL each."""
    for t in (r for r in rows if r.get("check") in ("issue13", "issue36", "issue48")):
        where = " ".join(str(t[k]) for k in ("model", "workflow", "path") if t.get(k) is not None)
        where += f" @ {t['vram_gib']:g} GiB" if t.get("vram_gib") is not None else ""
        print(f"  {t['check']} {where}: " + (" ".join(f"{k}:{'PASS' if v else 'FAIL'}" for k, v in t["checks"].items())
                                             or "no target measurable"))


def summary(rows: list[dict], lead: tuple, keys: tuple, note: str = "") -> None:
    """Prints the rows: ``lead`` columns (e.g. model, path), then the headline s/step (whole sample), x bf16 and x
    fp8_fast on it, the median step, the first sample, the per-sample tax, peak VRAM / host RAM, status."""
    f = lambda v, n=7, d=2: f"{v:{n}.{d}f}" if isinstance(v, (int, float)) else f"{'-':>{n}}"  # noqa: E731
    print(f"\nwhole = whole sample() / steps (best of 2, synced); x bf16 / x fp8 on it (on the median step where a "
          f"row has no whole figure); step = median step; first = first sample of the path in its process; tax = "
          f"whole sample - its model calls; host / busy = the host's time and the GPU's busy time a step (GPU "
          f"rows), host-paced when host > busy{('; ' + note) if note else ''}")
    w = {c: 22 if c == "path" else 14 if c == "model" else 10 for c in lead}
    print(" ".join(f"{c:<{w[c]}}" for c in lead) + f" {'vram':>5} {'whole':>8} {'x bf16':>7} {'x fp8':>7} {'step':>8} "
          f"{'first s':>7} {'tax s':>6} {'host s':>7} {'busy s':>7} {'VRAM':>6} {'RSS':>6}  status")
    for r in rows:
        if "path" not in r or "check" in r:
            continue
        lc = " ".join(f"{str(r.get(c, '')):<{w[c]}}" for c in lead)
        vr = r.get("vram_gib")
        vs = f"{vr:5g}" if isinstance(vr, (int, float)) else f"{'-':>5}"
        st = r.get("status", "ok")
        if headline(r) is None:
            print(f"{lc} {vs} {st}: {str(r.get('error', r.get('skipped', '')))[:100]}")
            continue
        xb, xf = speedups(rows, r, keys)
        rss = r.get("host_rss_peak_row_gib") or r.get("host_rss_peak_gib")
        print(f"{lc} {vs} {f(r.get('s_per_step_whole'), 8, 4)} {f(xb)} {f(xf)} {f(r.get('s_per_step'), 8, 4)} "
              f"{f(r.get('first_sample_s'), 7, 1)} {f(r.get('per_sample_tax_s'), 6, 3)} "
              f"{f(r.get('host_s_per_step'), 7, 4)} {f(r.get('gpu_busy_s_per_step'), 7, 4)} {f(r.get('peak_gib'), 6, 1)} "
              f"{f(rss, 6, 1)}  {st}" + (" cold" if r.get("cold") else "")
              + (" host-paced" if r.get("paced_by") == "host" else ""))


if __name__ == "__main__":
    if sys.argv[1:] == ["--hold"]:
        sys.exit(hold_main())
    print(__doc__)
    sys.exit(0 if sys.argv[1:] in (["--help"], ["-h"]) else 2)
