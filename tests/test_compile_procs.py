"""kernel/procs.py + kernel/compile_worker.py: a dry run's compiles in worker processes. Without a GPU: the scripts
run in a subprocess without the Triton interpreter (real ``@triton.jit`` functions of the pack), with Triton's
active driver replaced by one naming sm_80 (nothing is launched; the dry run never launches), real worker
processes and real compiles (Triton's compiler and ptxas), into a fresh Triton cache."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import json, os, sys, time
import torch, triton
from triton.backends.compiler import GPUTarget
import compile_targets as ct
from kernel import ahead, launch, procs

class Sm80:
    def is_active(self): return True
    def get_current_device(self): return 0
    def get_current_stream(self, d=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 80, 32)
    def get_active_torch_device(self): return torch.device("cpu")

triton.runtime.driver.set_active(Sm80())
EVENTS = []   # (kernel, cache hit) of every compile in this process
triton.knobs.compilation.listener = lambda **kw: EVENTS.append((kw["src"].fn.__name__, kw["cache_hit"]))
CUDA = torch.device("cuda", 0)

def launches(specs):
    import importlib
    out = []
    for spec in specs:
        fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        runtime = [p.name for p in fn.params if not p.is_constexpr]
        out.append((fn, (1,), tuple(ct._materialize(spec["args"][n]) for n in runtime), dict(spec["consts"]),
                    spec["warps"], spec["stages"]))
    return out

SPECS = [s for s in ct.row_jobs(80) if s["kernel"] in ("_rmsnorm_modulate_quant_kernel", "_gated_residual_kernel")][:2]
"""


def _run(body: str, tmp_path, timeout=600) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(tmp_path)])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    r = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_dry_run_compiles_in_worker_processes_and_this_process_loads_them_from_the_cache(tmp_path):
    got = _run("""
pool = procs.Pool(2)
todo = launches(SPECS)
with ahead.compiling(procs=pool) as a:
    for fn, grid, args, consts, w, s in todo:
        launch.launch(fn, grid, args, consts, w, s, CUDA)
first = dict(errors=a.errors, remote=a.remote, events=list(EVENTS))
# in this process' JIT cache now: a second dry run captures nothing and sends nothing
with ahead.compiling(procs=pool) as b:
    for fn, grid, args, consts, w, s in todo:
        launch.launch(fn, grid, args, consts, w, s, CUDA)
pids = sorted(p.pid for p in pool.procs)
pool.close()
print(json.dumps(dict(first, again=b.remote, again_seen=len(b.seen), pids=pids, me=os.getpid(),
                      names=[t[0].fn.__name__ for t in todo],
                      cached=[len(t[0].device_caches[0][0]) for t in todo])))
""", tmp_path)
    assert got["errors"] == []
    assert sorted(r["name"] for r in got["remote"]) == sorted(got["names"]) and len(got["names"]) == 2
    for r in got["remote"]:
        assert r["error"] is None and r["hit"] is True and r["s"] > 0, r
    # every compile this process ran was a hit on what a worker wrote: the same cache key
    assert sorted(got["events"]) == sorted([n, True] for n in got["names"])
    assert got["cached"] == [1, 1]
    assert got["again"] == [] and got["again_seen"] == 2
    assert got["me"] not in got["pids"] and len(set(got["pids"])) == 2


def test_dead_workers_leave_the_compile_to_this_process(tmp_path):
    got = _run("""
pool = procs.Pool(1)
pool.procs[0].kill(); pool.procs[0].wait()
todo = launches(SPECS[:1])
with ahead.compiling(procs=pool) as a:
    for fn, grid, args, consts, w, s in todo:
        launch.launch(fn, grid, args, consts, w, s, CUDA)
print(json.dumps(dict(errors=a.errors, remote=a.remote, events=EVENTS, closed=pool.closed,
                      cached=len(todo[0][0].device_caches[0][0]))))
""", tmp_path)
    assert got["errors"] == [] and got["cached"] == 1
    (r,) = got["remote"]
    assert r["error"].startswith("compile worker ") and r["hit"] is False
    assert [e[1] for e in got["events"]] == [False]     # compiled here, in full
    assert got["closed"] is True


BAD_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def needs_positive(x_ptr, N: tl.constexpr):
    tl.static_assert(N > 0, "N must be positive")
    tl.store(x_ptr + tl.arange(0, 16), tl.zeros((16,), tl.float32))
"""


def test_a_compile_that_fails_in_a_worker_fails_here_too(tmp_path):
    """A kernel whose static_assert refuses the constexpr: the worker reports the error; this process' own compile
    raises it and the dry run counts it as failed (``first_call`` then forgets the chosen configs)."""
    (tmp_path / "bad_kernels.py").write_text(BAD_KERNEL)
    got = _run("""
import bad_kernels
pool = procs.Pool(1)
x = torch.zeros(16)
with ahead.compiling(procs=pool) as a:
    launch.launch(bad_kernels.needs_positive, (1,), (x,), {"N": -1}, 4, 1, CUDA)
    launch.launch(bad_kernels.needs_positive, (1,), (x,), {"N": 2}, 4, 1, CUDA)
pool.close()
print(json.dumps(dict(errors=a.errors, remote=sorted(a.remote, key=lambda r: r["error"] is None),
                      cached=len(bad_kernels.needs_positive.device_caches[0][0]))))
""", tmp_path)
    assert len(got["errors"]) == 1 and "N must be positive" in got["errors"][0], got
    bad, good = got["remote"]
    assert "N must be positive" in bad["error"] and bad["hit"] is False
    assert good["error"] is None and good["hit"] is True
    assert got["cached"] == 1      # the good one


def test_the_worker_protocol_keeps_replies_clean_of_what_imports_print(tmp_path):
    """A module the worker imports prints to stdout; the replies still parse, one a request, in order. The setup's
    target gets a warm-up compile first."""
    (tmp_path / "noisy.py").write_text("print('hello from an import')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path)])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    setup = {"packages": [], "modules": ["noisy"], "target": ["cuda", 80, 32]}
    reqs = [{"module": "noisy", "qualname": "missing", "spec": "{}", "target": ["cuda", 80, 32]},
            {"module": "no_such_module", "qualname": "k", "spec": "{}", "target": ["cuda", 80, 32]}]
    text = "".join(json.dumps(x) + "\n" for x in [setup, *reqs])
    r = subprocess.run([sys.executable, str(ROOT / "kernel" / "compile_worker.py")], input=text,
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    replies = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(replies) == 2
    assert "AttributeError" in replies[0]["error"] and "ModuleNotFoundError" in replies[1]["error"]
    assert "hello from an import" in r.stderr and "hello" not in r.stdout
    # the warm-up compile for the setup's target, before the first request
    assert list((tmp_path / "cache").rglob("_zero.cubin")), sorted(p.name for p in (tmp_path / "cache").rglob("*"))


def test_worker_count_switch(monkeypatch):
    from kernel import config, procs
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    with config.override(INT8_FUSED_COMPILE_PROCS="auto"):
        assert procs.count() == 15
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    with config.override(INT8_FUSED_COMPILE_PROCS="auto"):
        assert procs.count() == 3
    with config.override(INT8_FUSED_COMPILE_PROCS="2"):
        assert procs.count() == 2
    with config.override(INT8_FUSED_COMPILE_PROCS="0"):
        assert procs.count() == 0 and procs.pool() is None
    with config.override(INT8_FUSED_COMPILE_PROCS="lots"):  # the default's threads, with one warning
        assert procs.count() == 0
    with config.override(INT8_FUSED_COMPILE_PROCS=config.SWITCHES["INT8_FUSED_COMPILE_PROCS"].default):
        assert procs.count() == 0 and procs.pool() is None  # by default no worker: threads unless asked


def test_no_workers_on_the_cpu_or_under_the_interpreter():
    import torch

    from kernel import ahead, procs
    ahead.prestart(torch.device("cpu"))
    ahead.prestart(torch.device("cuda", 0))     # the interpreter runs here: no dry run, so no workers
    assert procs.pool() is None and procs._POOL[0] is None


@pytest.mark.parametrize("kernel", ["_int8_gemm_kernel", "_int8_gemm_persistent_kernel",
                                    "_gemm_swiglu_persistent_kernel"])
def test_a_deferred_s8_build_compiled_from_its_capture_is_what_the_call_finds(tmp_path, kernel):
    """kernel.s8wgmma's deferred build, for real on an sm_90 target (no GPU): a dry run's s8 launch of the pack's
    128 x 256 GEMM (plain, and the persistent TMA forms) compiles the int8 build and captures the fp8 one; the queued
    job compiles the capture in this process (``compile_worker.compile_kernel``), rewrites and assembles it; then
    the call's own build of the same launch (``_build``: Triton's ``warmup`` of the fp8 operands) is a Triton cache
    hit under the same hash and takes the kept s8 kernel, compiling nothing."""
    got = _run("""
import kernel.gemm, kernel.swiglu  # noqa: F401
from kernel import config, deferred, s8wgmma
class Sm90(Sm80):
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
triton.runtime.driver.set_active(Sm90())
deferred.QUEUE = deferred.Queue(start_worker=False)
s8wgmma.usable = lambda dev: True
NAME = """ + repr(kernel) + """
(spec,) = [s for s in ct.gemm_jobs(90) if s["s8"] and s["kernel"] == NAME and s["cfg"]["BLOCK_N"] == 256
           and "split" not in s["label"] and ("PERSIST" in s["cfg"]) == ("persistent" in NAME)]
fn = getattr(kernel.gemm if hasattr(kernel.gemm, NAME) else kernel.swiglu, NAME)
runtime = [p.name for p in fn.params if not p.is_constexpr]
def int8(v):  # the launch's own operands are int8 (the fp8 view is the build's)
    if isinstance(v, ct.P) and v.dtype == torch.float8_e4m3fn:
        return torch.empty(64, dtype=torch.int8)
    if isinstance(v, ct.D) and v.dtype == torch.float8_e4m3fn:
        from triton.tools.tensor_descriptor import TensorDescriptor
        return TensorDescriptor(torch.empty(64, dtype=torch.int8), v.shape, v.strides, v.block)
    return ct._materialize(v)
args = tuple(int8(spec["args"][n]) for n in runtime)
out_pos = runtime.index("c_desc" if "c_desc" in runtime else "h_desc" if "h_desc" in runtime else "c_ptr")
with config.override(INT8_FUSED_TUNE="background"):
    with ahead.compiling(workers=2) as a:
        s8wgmma.launch_s8(fn, (1,), args, dict(spec["consts"]), spec["warps"], spec["stages"], CUDA, out_pos)
    dry = list(EVENTS)
    pending = len(s8wgmma._PENDING)
    ran = deferred.QUEUE.drain()
    job = list(EVENTS[len(dry):])
    (k,) = s8wgmma._BY_HASH.values()
    hit = s8wgmma._build(fn, (1,), args, dict(spec["consts"]), spec["warps"], spec["stages"])
print(json.dumps(dict(errors=a.errors, jobs=a.job_s, dry=dry, pending=pending, ran=ran, job=job,
                      call=EVENTS[len(dry) + len(job):], same=hit is not None and hit[0] is k,
                      s8="m64n256k32.s32.s8.s8" in k.asm["ptx"] and "e4m3" not in k.asm["ptx"],
                      off=s8wgmma._OFF, left=len(s8wgmma._PENDING))))
""", tmp_path)
    assert got["errors"] == [] and got["jobs"] == [] and got["off"] is None
    assert got["dry"] == [[kernel, False]]                 # the int8 build only, in the dry run
    assert got["pending"] == 1 and got["ran"] == 1 and got["left"] == 0
    assert got["job"] == [[kernel, False]]                 # the fp8 build, compiled by the job
    assert got["call"] == [[kernel, True]]                 # the call's build: a cache hit, same key
    assert got["same"] and got["s8"]


def test_a_new_token_count_compiles_nothing_new(tmp_path):
    """The token counts of two resolutions (Wan 2.1 at 480x832: 14040, not a multiple of 16; at 384x672: 9072, one)
    reach the pack's kernels as the row-count arguments (M, tiles, tokens per batch, L), which the kernels keep out of
    Triton's specialization: the second resolution's launches of the GEMMs, the fused row kernels and QK norm + RoPE
    are in-memory hits of the first's kernels (no compile), on an sm_90 target without a GPU."""
    got = _run("""
import kernel.gemm  # noqa: F401
class Sm90(Sm80):
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
triton.runtime.driver.set_active(Sm90())
jobs = ct.gemm_jobs(90) + ct.row_jobs(90)
want = {"_int8_gemm_kernel": "128x256x128 w8 s3 g8", "_gemm_swiglu_kernel": "128x256x128 w8 s3 g8 swiglu",
        "_rmsnorm_modulate_quant_kernel": "rmsnorm_modulate_quantize K1536",
        "_gated_residual_kernel": "gated_residual_rmsnorm K1536", "_qk_norm_rope_kernel": "qk_norm_rope wan2.1-1.3b 12x128"}
specs = [s for s in jobs if want.get(s["kernel"]) == s["label"]]
ROWS = {"M": None, "DP_TILES": lambda m: -(-m // 128) * 12, "tokens_per_batch": None, "L": None}
counts = []
for m in (14040, 9072):
    before = len(EVENTS)
    todo = []
    for s in specs:
        s = dict(s, args={k: (m if ROWS[k] is None else ROWS[k](m)) if k in ROWS else v for k, v in s["args"].items()})
        todo += launches([s])
    with ahead.compiling(workers=2) as a:
        for fn, grid, args, consts, w, st in todo:
            launch.launch(fn, grid, args, consts, w, st, CUDA)
    counts.append([a.errors, sorted(e[0] for e in EVENTS[before:]), len(a.seen)])
print(json.dumps(dict(counts=counts, names=sorted(s["kernel"] for s in specs))))
""", tmp_path)
    (e1, first, seen1), (e2, second, seen2) = got["counts"]
    assert len(got["names"]) == 5 and e1 == e2 == []
    assert first == got["names"]            # each kernel compiled once at the first token count
    assert second == [] and seen2 == 5      # the second: launched (new launch keys), nothing compiled
