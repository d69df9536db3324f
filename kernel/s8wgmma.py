"""The INT8 GEMM's 128 x 256 tiles on sm_90 as s8 wgmma n256, an instruction shape Triton does not emit.

Why: Triton 3.6's ``tl.dot`` issues int8 wgmma at n128 at most; the pack's 128 x 128 tiles then run at the rate
their L2 reads allow (128 int ops a byte). A 128 x 256 tile reads 171 ops a byte, but issued as two n128 halves
it loses what it gains (math-only: 1749 TOP/s against 1926 for n256 on the H200, bench/RESULTS.md). Measured on the
H200: the s8 n256 GEMM ran 1.08-1.22x the pack's on Ideogram 4 / Flux.1 block shapes, bit-exact against
``torch._int_mm``, and beside cuBLAS FP8 on every block shape timed.

How: the kernel is built for the operands' bytes viewed as fp8 (e4m3): Triton then issues its dot as
``wgmma ... m64n256k32.f32.e4m3.e4m3`` with the shared-memory layout that s8 wgmma reads too (8-bit, K-major). The
PTX's wgmma instructions are rewritten to ``.s32.s8.s8`` (integer wgmma has no operand-scale immediates), ptxas
(Triton's own) assembles them, and the accumulator registers hold int32 sums, which the kernel's fp8 branch reads
back with a bitcast (``kernel.gemm.acc_tile``). The launcher only passes pointers, so the int8 tensors are passed
as they are (and TMA descriptors of them: the persistent kernels' operands, built for fp8 descriptors).

When: a dry run of ``kernel.ahead`` (a model call's first run) with ``INT8_FUSED_TUNE=background`` leaves the s8 builds
out of the first sample: each is queued in ``kernel.deferred`` (its fp8 build compiled, rewritten and assembled
between samples), and until it is there the calls run Triton's int8 build of the same tile, which the dry run
compiles anyway because the check below needs it; the output bits are the same. In the other tuning modes, and
where no dry run ran, the first call builds it.

Safety: each rewritten binary is checked on its first call: its output against the int8 build's of the same tile
config on the same operands, bit for bit. A failed build or check turns the path off for this process (logged,
``state()`` says why) and that call's result is the int8 build's; so are all calls while a launch hook (a
profiler) is set, the interpreter runs, or ``INT8_FUSED_S8_WGMMA=0``. Nothing here runs at import.
"""
from __future__ import annotations

import copy
import itertools
import logging
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from . import ahead, config, launch
from .config import gemm_switches

log = logging.getLogger("int8_fused")

# fp8 wgmma as Triton 3.6 prints it: d, a-desc, b-desc, scale-d, imm-scale-a, imm-scale-b
WGMMA_FP8 = re.compile(r"(wgmma\.mma_async\.sync\.aligned\.m64n\d+k32)\.f32\.e4m3\.e4m3 (\{[^}]*\}), ([^,]+), ([^,]+), "
                       r"([^,]+), 1, 1;")

_OFF: str | None = None             # why the path is off in this process (a failed build or check), else None
_BUILT: dict[tuple, tuple] = {}     # launch key -> (rewritten CompiledKernel, constexpr tail)
_BY_HASH: dict[str, object] = {}    # fp8 build's hash -> its rewritten kernel (checked or not yet)
_CHECKED: set[int] = set()          # id() of rewritten kernels whose first call matched the int8 build
_PENDING: set = set()               # specializations whose s8 build waits in kernel.deferred (``_defer``)
_SEQ = itertools.count()
_CAPABILITY: dict[int, tuple] = {}  # device index -> compute capability
_MAX_ENTRIES = 4096


def rewrite_ptx(ptx: str) -> tuple[str, int]:
    """``ptx`` with its fp8 wgmma instructions as s8 ones, and how many were rewritten. Raises where nothing was
    rewritten or any e4m3 use is left (the kernel would then compute in fp8)."""
    out, n = WGMMA_FP8.subn(r"\1.s32.s8.s8 \2, \3, \4, \5;", ptx)
    if n == 0:
        raise RuntimeError("no fp8 wgmma of the expected form in the PTX (a Triton version that prints it "
                           "differently)")
    if "e4m3" in out:
        raise RuntimeError("fp8 (e4m3) instructions other than the rewritten wgmma are left in the PTX")
    return out, n


def ptxas_path(arch: int = 90) -> str:
    """The ptxas Triton itself runs for sm_``arch`` (``TRITON_PTXAS_PATH`` when set, as Triton honours): since
    Triton 3.6 a second one (``ptxas-blackwell``, CUDA 13) for newer targets, sm_90 included from 3.9 on, whose PTX
    (ISA 9.x) the older one rejects."""
    try:
        from triton.backends.nvidia import compiler as nv
        try:
            tool = nv.get_ptxas(arch)   # Triton 3.6+
        except TypeError:
            tool = nv.get_ptxas()       # Triton 3.4 / 3.5: one ptxas
        if tool.path:
            return tool.path
    except Exception:  # noqa: BLE001 - older / newer layouts: the knob, else the wheel's copy
        pass
    try:
        import triton
        p = triton.knobs.nvidia.ptxas.path
        if p:
            return p
    except Exception:  # noqa: BLE001
        pass
    import triton
    return os.environ.get("TRITON_PTXAS_PATH") or os.path.join(os.path.dirname(triton.__file__), "backends",
                                                                "nvidia", "bin", "ptxas")


def assemble(ptx: str, arch: int = 90, fp_fusion: bool = True, extra: str | None = None) -> bytes:
    """A cubin of ``ptx`` for sm_``arch`` (``a``: wgmma needs sm_90a), with the ptxas and flags Triton's own build
    uses (``--regAllocOptLevel=2``: Triton 3.9's workaround for CUDA 13's ptxas). Kept on disk
    (``cubin_cache``), so a later process assembles nothing, as Triton's own cache serves its builds."""
    import hashlib
    ptxas = ptxas_path(arch)
    try:
        st = os.stat(ptxas)
        tool = f"{ptxas}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        tool = ptxas
    digest = hashlib.sha256("\0".join((ptx, str(arch), str(fp_fusion), str(extra), str(_regalloc_fix()), tool))
                            .encode()).hexdigest()
    path = cubin_cache() / f"{digest}.cubin"
    try:
        kept = path.read_bytes()
        if kept.startswith(b"\x7fELF"):   # anything else (a damaged file): assembled again, replaced
            return kept
    except OSError:
        pass
    cubin = _assemble(ptx, arch, fp_fusion, extra)
    try:
        from .atomic import atomic_write
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(cubin))
    except OSError as e:  # a read-only cache folder: assembled again next time
        log.debug("s8 wgmma: could not keep the assembled kernel in %s (%s)", path.parent, e)
    return cubin


def cubin_cache() -> Path:
    """Where assembled s8 kernels are kept: ``$INT8_FUSED_CACHE_DIR/s8-cubin`` (named by a hash of the PTX, the
    flags and the ptxas binary)."""
    return Path(config.get("INT8_FUSED_CACHE_DIR")).expanduser() / "s8-cubin"


def _assemble(ptx: str, arch: int, fp_fusion: bool, extra: str | None) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        Path(src).write_text(ptx)
        ptxas = ptxas_path(arch)
        fix = ["--regAllocOptLevel=2"] if _regalloc_fix() else []
        cmd = [ptxas, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), *fix, *(extra.split() if extra else []),
               f"--gpu-name=sm_{arch}a" if arch >= 90 else f"--gpu-name=sm_{arch}", src, "-o", dst]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"ptxas failed on the s8 rewrite ({r.returncode}): {r.stderr.strip()[:500]}")
        return Path(dst).read_bytes()


def _regalloc_fix() -> bool:
    """Whether the installed Triton passes ``--regAllocOptLevel=2`` to ptxas (read from its source: 3.9 does)."""
    try:
        import inspect

        from triton.backends.nvidia import compiler as nv
        return "regAllocOptLevel=2" in inspect.getsource(nv.CUDABackend.make_cubin)
    except Exception:  # noqa: BLE001 - no source to read: Triton's older default
        return False


def rewritten(fp8_kernel):
    """A copy of the CompiledKernel ``fp8_kernel`` (not yet loaded) whose binary runs its wgmma as s8."""
    ptx, _ = rewrite_ptx(fp8_kernel.asm["ptx"])
    md = fp8_kernel.metadata
    cubin = assemble(ptx, md.target.arch, getattr(md, "enable_fp_fusion", True), getattr(md, "ptx_options", None))
    k = copy.copy(fp8_kernel)
    k.asm = {**fp8_kernel.asm, "ptx": ptx, "cubin": cubin}
    k.kernel = cubin
    k.module = k.function = k._run = None  # loaded from ``kernel`` on first use
    return k


def usable(device: torch.device) -> bool:
    """Whether calls on ``device`` may run the s8 n256 path: an sm_90 GPU, the launch fast path's conventions
    (``kernel.launch``), the switch on, no failed build or check in this process."""
    if _OFF is not None or device.type != "cuda" or not config.get("INT8_FUSED_S8_WGMMA"):
        return False
    if not launch.fast_launch_ok():
        return False
    forced = gemm_switches()[1]
    if forced is not None and forced != (9, 0):  # a bench forces another generation's tile set
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    cap = _CAPABILITY.get(idx)
    if cap is None:
        cap = _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return cap == (9, 0)


def state() -> str | None:
    """A few words for run reports: the s8 n256 kernels running (each checked on its first call) and the builds
    still queued (``_defer``), or why the path was turned off; None when it has not been used or asked for in this
    process."""
    if _OFF is not None:
        return f"s8 wgmma n256 off: {_OFF}"
    waiting = (f"{len(_PENDING)} s8 builds waiting for the idle time between samples (Triton's int8 builds of "
               f"those tiles run meanwhile)") if _PENDING else None
    if _CHECKED:
        done = f"s8 wgmma n256: {len(_CHECKED)} kernels, each checked bit for bit against Triton's int8 build"
        return f"{done}; {waiting}" if waiting else done
    return waiting


def turn_off(why: str) -> None:
    global _OFF
    if _OFF is None:
        log.warning("INT8 GEMM: the s8 wgmma n256 path is off for this process: %s. The same tiles run as Triton "
                    "builds them (n128): same results, slower", why)
        _OFF = why


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (NaN payloads included) of two tensors of one dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() in (1, 2, 4, 8) and a.dtype.is_floating_point:
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(view), b.view(view))
    return torch.equal(a, b)


def first_call(out: torch.Tensor, run_s8, run_ref) -> bool:
    """A rewritten kernel's first call, checked: ``run_ref(scratch)`` writes the int8 build's result into a buffer
    laid out like ``out``, ``run_s8()`` writes into ``out``; True when they are bit-identical. Else ``out`` is given
    the reference's values and False is returned."""
    scratch = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device)
    run_ref(scratch)
    run_s8()
    if same_bits(out, scratch):
        return True
    out.copy_(scratch)
    return False


def launch_s8(jit_fn, grid: tuple, args: tuple, constexprs: dict, num_warps: int, num_stages: int,
              device: torch.device, out_pos: int) -> None:
    """``launch.launch(jit_fn, ...)`` of an INT8 GEMM kernel whose dot reads ``args``' int8 operands (tensors or TMA
    descriptors of them), run as s8 wgmma (its fp8 build, rewritten) where ``usable``; ``args[out_pos]`` is the
    output the first call checks (or a TMA descriptor of it)."""
    import triton
    if not usable(device) or launch.launch_hooked(triton.knobs.runtime):
        launch.launch(jit_fn, grid, args, constexprs, num_warps, num_stages, device)
        return
    key = launch.launch_key(jit_fn, args, constexprs, num_warps, num_stages, device)
    hit = _BUILT.get(key)
    spec = specialization(key) if hit is None else None   # one build per Triton specialization (``_defer``, below)
    if launch.dry_run():  # kernel.ahead: the s8 build and the int8 build its first call checks against, in the compile pool
        if hit is None and not _defer(spec, jit_fn, grid, args, constexprs, num_warps, num_stages):
            a = ahead.active()

            def build():
                # the fp8 build compiled in a worker process first (where there are: kernel.procs)
                a.precompile(jit_fn, _fp8_args(args), grid, constexprs, num_warps, num_stages, device)
                built = _build(jit_fn, grid, args, constexprs, num_warps, num_stages)
                if built is not None:
                    _BUILT[key] = built
            # one build per Triton specialization (integers by their divisibility, not their values): the launches
            # of other shapes find its kernel in the caches when they first run (_BY_HASH), instead of a second
            # rewrite and assembly of the same code in the pool beside the first
            a.submit(("s8", spec), build)
        launch.launch(jit_fn, grid, args, constexprs, num_warps, num_stages, device)
        return
    if hit is None and spec in _PENDING:   # its build waits for the idle time between samples
        launch.launch(jit_fn, grid, args, constexprs, num_warps, num_stages, device)
        return
    if hit is None:
        hit = _build(jit_fn, grid, args, constexprs, num_warps, num_stages)
        if hit is None:  # turned off: the int8 build
            launch.launch(jit_fn, grid, args, constexprs, num_warps, num_stages, device)
            return
        if len(_BUILT) >= _MAX_ENTRIES:
            _BUILT.clear()
        _BUILT[key] = hit
    compiled, tail = hit

    def run_s8():
        launch.run_compiled(compiled, tail, grid, args, device)

    if id(compiled) not in _CHECKED:
        target = args[out_pos]  # the output, or a TMA descriptor of it

        def run_ref(scratch):
            ref_args = list(args)
            ref_args[out_pos] = launch.on_base(target, scratch)
            with launch.not_recorded():
                launch.launch(jit_fn, grid, tuple(ref_args), constexprs, num_warps, num_stages, device)
        try:
            same = first_call(launch.base_of(target), run_s8, run_ref)
            why = f"{jit_fn.__name__}'s s8 build differed from its int8 build on its first call"
        except Exception as e:  # noqa: BLE001 - loading or launching the rewritten binary failed
            same, why = False, f"{jit_fn.__name__}'s s8 build failed to run: {type(e).__name__}: {str(e)[:300]}"
        if not same:
            turn_off(why)
            _BUILT.clear()
            launch.launch(jit_fn, grid, args, constexprs, num_warps, num_stages, device)  # recorded: what runs
            return
        _CHECKED.add(id(compiled))
    else:
        run_s8()
    launch.note(launch.Launch(jit_fn, grid, args, constexprs, num_warps, num_stages, compiled, tail))


def _defer(spec: tuple, jit_fn, grid, args: tuple, constexprs: dict, num_warps: int, num_stages: int) -> bool:
    """In a dry run with ``INT8_FUSED_TUNE=background``: the s8 build of this specialization leaves the first
    sample's critical path. Its fp8 build is captured (``kernel.procs.capture``: Triton's specialization data, no
    tensor kept) and queued in ``kernel.deferred`` (compiled, rewritten and assembled between samples); until it
    is there, calls run the int8 build of the same tile, which the dry run compiles anyway (the s8 binary's check
    needs it): the same bits, a slower instruction shape. True where deferred (or waiting already); False: build it
    in the dry run's pool (another tuning mode, or Triton has the fp8 build in memory already)."""
    from . import deferred
    if spec in _PENDING:
        return True
    if deferred.mode() != "background" or not config.get("INT8_FUSED_S8_DEFER"):
        return False
    try:
        from . import procs
        req = procs.capture(jit_fn, _fp8_args(args), grid, constexprs, num_warps, num_stages)
    except Exception:  # noqa: BLE001 - built in the pool, as without deferring
        return False
    if req is None:
        return False
    name = jit_fn.__name__

    def job(stop):
        stop()   # a sample is running: queued again, still pending
        try:
            from .compile_worker import compile_kernel
            k8 = compile_kernel(req)
        except Exception as e:  # noqa: BLE001 - the next call builds it itself (as without deferring) and decides
            log.debug("s8 wgmma: the deferred fp8 build of %s failed (%s: %s); its next call builds it", name,
                      type(e).__name__, str(e)[:300])
            k8 = None
        if k8 is not None and k8.hash not in _BY_HASH:
            try:
                k = rewritten(k8)
            except Exception as e:  # noqa: BLE001 - as a failed rewrite in a call: the int8 builds from now on
                turn_off(f"{name}'s s8 build between samples: {type(e).__name__}: {str(e)[:300]}")
            else:
                if len(_BY_HASH) >= _MAX_ENTRIES:
                    _BY_HASH.clear()
                _BY_HASH[k8.hash] = k
        _PENDING.discard(spec)
        config.retune()   # prepared calls recorded on the int8 build re-plan: the next call takes the s8 build
    _PENDING.add(spec)
    if not deferred.submit(f"s8 build {name} #{next(_SEQ)}", job):
        _PENDING.discard(spec)
        return False
    return True


def _int8_operand(a) -> bool:
    """An int8 tensor, or a TMA descriptor of one: the operands the fp8 build reads as fp8."""
    b = launch.base_of(a)
    return isinstance(b, torch.Tensor) and b.dtype == torch.int8


def specialization(key: tuple) -> tuple:
    """``launch.launch_key``'s key with each integer argument replaced by what Triton specializes it on (equal to 1,
    divisible by 16, fits 32 bits; only the last for the kernel's ``do_not_specialize`` arguments, the row counts):
    launches with equal specializations compile to the same kernel."""
    *head, args = key
    free = [p.do_not_specialize for p in getattr(head[0], "params", ()) if not p.is_constexpr]   # runtime order

    def spec(i, a):
        if type(a) is not int:
            return a
        one, by16, fits = launch.arg_key(a)
        return (None, None, fits) if i < len(free) and free[i] else (one, by16, fits)
    return (*head, tuple(spec(i, a) for i, a in enumerate(args)))


def _fp8_args(args: tuple) -> tuple:
    """``args`` with the int8 operands viewed as fp8 (what the fp8 build is compiled for)."""
    return tuple(launch.on_base(a, launch.base_of(a).view(torch.float8_e4m3fn)) if _int8_operand(a) else a
                 for a in args)


def _build(jit_fn, grid, args, constexprs, num_warps, num_stages):
    """(rewritten kernel, constexpr tail) for these arguments, or None after turning the path off."""
    fp8 = _fp8_args(args)
    try:
        k8 = jit_fn.warmup(*fp8, grid=grid, **constexprs, num_warps=num_warps, num_stages=num_stages)
        if hasattr(k8, "result"):  # an asynchronous compile
            k8 = k8.result()
        k = _BY_HASH.get(k8.hash)
        if k is None:
            if len(_BY_HASH) >= _MAX_ENTRIES:
                _BY_HASH.clear()
            k = _BY_HASH[k8.hash] = rewritten(k8)
    except Exception as e:  # noqa: BLE001 - any failure: the int8 build runs, reported by state()
        turn_off(f"{type(e).__name__}: {str(e)[:300]}")
        return None
    return k, tuple(constexprs[name] for name in jit_fn.arg_names[len(args):])
