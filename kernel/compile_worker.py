"""One compile worker process of ``kernel.procs`` (run as a script by it: ``python compile_worker.py``).

It compiles Triton kernels for an explicit target into Triton's on-disk cache (``TRITON_CACHE_DIR``, set by the
parent), so that the parent's own compile of the same kernel is a cache hit. It never touches a GPU: the target
comes with the request and ``CUDA_VISIBLE_DEVICES`` is empty.

Protocol: one JSON object a line on stdin, one JSON reply a line on stdout (Python's own stdout is moved to stderr,
so that nothing printed by an import or a compiler pass reaches the parent as a reply).
- ``{"packages": [[name, [path, ...]], ...], "modules": [...], "target": [...]}`` (first line, no reply): the
  parent's packages of the kernel modules, registered without running their ``__init__``, the modules to import at
  once, and the target to warm the compiler up for (one trivial compile).
- ``{"module", "qualname", "spec", "target"}``: compile the ``@triton.jit`` function ``module.qualname`` as Triton's
  ``specialization_data`` JSON ``spec`` describes it (what ``JITFunction.preload`` reads), for ``target``
  ([backend, arch, warp_size]). Reply ``{"hash", "s", "pid"}`` or ``{"error", "pid"}``.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
import types


def register_packages(packages) -> None:
    """Makes ``name`` importable as a package over ``path`` without running its ``__init__`` (the pack's top
    package imports ComfyUI; only its ``kernel`` modules are wanted here)."""
    for name, path in packages:
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = list(path)
            m.__package__ = name
            sys.modules[name] = m


def resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj if hasattr(obj, "params") else obj.fn   # a JITFunction, or a wrapper of one (Triton's autotuner)


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def compile_request(req: dict) -> str:
    """Compiles one request (module doc); returns the compiled kernel's hash (its cache key)."""
    return compile_kernel(req).hash


def compile_kernel(req: dict):
    """The CompiledKernel (not loaded on any GPU) of one request, from Triton's on-disk cache where it is there:
    what ``triton.compile`` returns, with the hash the parent's own ``warmup`` of the same launch gives."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    fn = resolve(req["module"], req["qualname"])
    d = json.loads(req["spec"])
    constexprs = {tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
                  tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
                  for k, v in zip(d["constant_keys"], d["constant_vals"])}
    attrs = dict(zip(map(tuple, d["attrs_keys"]), d["attrs_vals"]))
    signature = {k: _tuples(v) for k, v in d["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items()}
    target = GPUTarget(*req["target"])
    backend = make_backend(target)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options=backend.parse_options(options).__dict__)


def warm_up(target) -> None:
    """One trivial compile for ``target``: a process' first compile also loads Triton's backend, LLVM and ptxas
    (~0.8 s), which the first real request would otherwise pay."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    @triton.jit
    def _zero(x_ptr):
        tl.store(x_ptr + tl.arange(0, 16), tl.zeros((16,), tl.float32))
    t = GPUTarget(*target)
    triton.compile(ASTSource(_zero, {"x_ptr": "*fp32"}, {}, {}), target=t,
                   options=make_backend(t).parse_options({}).__dict__)


def main() -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                          # stray prints go to stderr, never into a reply
    sys.stdout = sys.stderr
    pid = os.getpid()
    first = sys.stdin.readline()
    if not first:
        return 0
    setup = json.loads(first)
    register_packages(setup.get("packages", ()))
    for m in setup.get("modules", ()):
        try:
            importlib.import_module(m)
        except Exception:  # noqa: BLE001 - the request naming it reports the error
            pass
    if setup.get("target"):
        try:
            warm_up(setup["target"])
        except Exception:  # noqa: BLE001 - the first request pays the start instead
            pass
    for line in sys.stdin:
        if not line.strip():
            continue
        t0 = time.perf_counter()
        start = time.time()
        try:
            reply = {"hash": compile_request(json.loads(line))}
        except Exception as e:  # noqa: BLE001 - the parent compiles it itself and raises there
            reply = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        reply.update(s=round(time.perf_counter() - t0, 3), pid=pid, start=start)
        out.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
