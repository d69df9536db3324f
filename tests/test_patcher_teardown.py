"""What the pack runs when ComfyUI tears a ModelPatcher down imports nothing (issue 47, item 1).

``ModelPatcherDynamic.__del__`` (ComfyUI 0.33.0, DynamicVRAM) calls ``detach`` -> ``eject_model`` -> the Apply
clone's injection eject (``nodes/comfy_cast.restore_patched_backups``). At interpreter shutdown ``sys.meta_path``
is None and an import inside that path raised ``ImportError: sys.meta_path is None, Python is likely shutting
down``, printed as "Exception ignored in: ModelPatcherDynamic.__del__" when a process that sampled with the pack
ended.

* static: every function the pack registers on the teardown path (a ``PatcherInjection``'s inject / eject, an
  ``ON_DETACH`` / ``ON_EJECT_MODEL`` / ``ON_CLEANUP`` callback) and every function of the pack it calls, read with
  ``ast``, has no import statement;
* ComfyUI 0.33.0 on the CPU: a dynamic Apply clone, loaded (injected, its backups taken), kept alive until the
  interpreter exits; its ``__del__`` runs the eject at shutdown and nothing is printed on stderr. The stand-ins for
  comfy-aimdo's CUDA-only vbar and pinned buffers are the ones of ``tests/test_dynamic_backups_current.py``.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEARDOWN_CALLBACKS = {"ON_DETACH", "ON_EJECT_MODEL", "ON_CLEANUP"}


class _Pack:
    """The pack's ``nodes/`` and ``adapters/`` sources: top-level functions per file and what each file's relative
    imports bind (a module of the pack, or a function of one)."""

    def __init__(self, root: Path = ROOT):
        self.root = root
        self.trees: dict[Path, ast.Module] = {}
        for pkg in ("nodes", "adapters", "quant"):
            for f in sorted((root / pkg).rglob("*.py")):
                self.trees[f] = ast.parse(f.read_text(), str(f))

    def funcs(self, f: Path) -> dict[str, ast.AST]:
        return {n.name: n for n in self.trees[f].body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def _module_file(self, f: Path, level: int, dotted: str | None) -> Path | None:
        base = f.parent
        for _ in range(level - 1):
            base = base.parent
        p = base.joinpath(*(dotted.split(".") if dotted else ()))
        for cand in (p.with_suffix(".py"), p / "__init__.py"):
            if cand in self.trees:
                return cand
        return None

    def bindings(self, f: Path) -> dict[str, tuple[Path, str | None]]:
        """{name: (file, function name, or None for the module itself)} bound by ``f``'s relative imports."""
        out = {}
        for node in ast.walk(self.trees[f]):
            if isinstance(node, ast.ImportFrom) and node.level:
                for a in node.names:
                    sub = self._module_file(f, node.level, ".".join(filter(None, (node.module, a.name))))
                    if sub is not None:
                        out[a.asname or a.name] = (sub, None)
                    else:
                        mod = self._module_file(f, node.level, node.module)
                        if mod is not None:
                            out[a.asname or a.name] = (mod, a.name)
        return out

    def resolve(self, f: Path, expr: ast.AST):
        """(file, function node) that ``expr`` (a name, ``module.function`` or a lambda) refers to, or None."""
        if isinstance(expr, ast.Lambda):
            return f, expr
        if isinstance(expr, ast.Name):
            if expr.id in self.funcs(f):
                return f, self.funcs(f)[expr.id]
            mod, name = self.bindings(f).get(expr.id, (None, None))
            return (mod, self.funcs(mod).get(name)) if mod is not None and name else None
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            mod, name = self.bindings(f).get(expr.value.id, (None, "?"))
            if mod is not None and name is None and expr.attr in self.funcs(mod):
                return mod, self.funcs(mod)[expr.attr]
        return None

    def teardown_callbacks(self) -> list[tuple[Path, ast.AST, ast.AST]]:
        """(file, call, callback expression) of every teardown-path registration in nodes/ and adapters/."""
        found = []
        for f, tree in self.trees.items():
            if f.relative_to(self.root).parts[0] == "quant":
                continue
            for call in ast.walk(tree):
                if not isinstance(call, ast.Call):
                    continue
                fn = call.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                if name == "PatcherInjection":
                    found += [(f, call, k.value) for k in call.keywords if k.arg in ("inject", "eject")]
                    found += [(f, call, a) for a in call.args]
                elif name in ("add_callback", "add_callback_with_key") and call.args:
                    kind = call.args[0]
                    if isinstance(kind, ast.Attribute) and kind.attr in TEARDOWN_CALLBACKS:
                        found.append((f, call, call.args[-1]))
        return found

    def imports_reachable(self, f: Path, fn: ast.AST) -> tuple[list[str], list[str]]:
        """(import statements, names visited) in ``fn`` and every function of the pack it calls, transitively."""
        bad, seen, todo = [], [], [(f, fn)]
        while todo:
            f, fn = todo.pop()
            if (f, id(fn)) in {(a, b) for a, b, _ in seen}:
                continue
            seen.append((f, id(fn), getattr(fn, "name", "<lambda>")))
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    bad.append(f"{f.relative_to(self.root)}:{node.lineno} {ast.unparse(node)}")
                elif isinstance(node, ast.Call):
                    target = self.resolve(f, node.func)
                    if target is not None and target[1] is not None:
                        todo.append(target)
        return bad, [f"{a.relative_to(self.root)}:{n}" for a, _, n in seen]


def test_teardown_callbacks_import_nothing():
    pack = _Pack()
    regs = pack.teardown_callbacks()
    assert regs, "no PatcherInjection / ON_DETACH / ON_EJECT_MODEL / ON_CLEANUP registration found in nodes/"
    visited, bad = [], []
    for f, call, expr in regs:
        target = pack.resolve(f, expr)
        assert target is not None and target[1] is not None, (
            f"{f.relative_to(ROOT)}:{call.lineno}: cannot resolve the teardown callback {ast.unparse(expr)!r} "
            "to a function of the pack (extend the resolver in this test)")
        b, v = pack.imports_reachable(*target)
        bad += b
        visited += v
    assert "nodes/comfy_cast.py:restore_patched_backups" in visited, visited  # the scanner still sees the eject
    assert not bad, ("imports on the ModelPatcher teardown path (they raise ImportError from __del__ at interpreter "
                     "shutdown; bind the module earlier, as comfy_cast.injection() binds comfy.utils):\n"
                     + "\n".join(sorted(set(bad))))


_SCRIPT = """
import os, torch
import comfy.model_detection, comfy.model_management as mm, comfy.model_patcher as mp
import comfy_harness
pack = import_pack()
mini = comfy_harness.miniature()
cpu, gpu = torch.device("cpu"), torch.device("meta")
sd = mini.tiny_state_dict("lumina2", 0, torch.float32)
mc = comfy.model_detection.model_config_from_unet_config(dict(mini.TINY_UNET_CONFIG["lumina2"]), sd)
mc.set_inference_dtype(torch.float32, None)
model = mc.get_model(sd, "", device=cpu)
model.diffusion_model.load_state_dict(sd, strict=False)
(clone,) = pack.nodes.apply.ApplyFusedInt8GEMM().apply(mp.ModelPatcher(model, load_device=cpu, offload_device=cpu),
                                                       "fused_triton")

class VBar:  # comfy_aimdo.model_vbar.ModelVBAR stand-in (CUDA-only): address ranges, nothing resident
    top = 0
    def prioritize(self): pass
    def alloc(self, size):
        self.top += size
        return (self, self.top - size, size)
    def free_memory(self, size): return 0
    def loaded_size(self): return 0

class HostBuffer:  # comfy_aimdo.host_buffer.HostBuffer stand-in (nothing pinned)
    size = 0

model.dynamic_vbars = {gpu: VBar()}
model.dynamic_pins = {gpu: {k: (HostBuffer(), [], [-1], [0], [0], {})
                            for k in ("weights", "patches", "weights-loaded", "patches-loaded")}}
model.dynamic_pins[gpu].update(hostbufs_initialized=True, failed=False, active=False, current_prompt=False)
clone.__class__, clone.load_device = mp.ModelPatcherDynamic, gpu  # as ComfyUI builds it on a GPU
model.dynamic_patchers = {id(clone), -1}  # -1: another patcher of the model alive (its __del__ keeps the pins)
mm.LoadedModel(clone).model_load(0)
(inj,) = [i for injs in clone.injections.values() for i in injs]

def eject(patcher, _eject=inj.eject, _write=os.write):  # the pack's eject, and a line once it has returned
    freed = _eject(patcher)
    _write(1, f"EJECT RETURNED {freed}\\n".encode())
    return freed

inj.eject = eject
print("LOADED", clone.is_injected, len(clone.backup), flush=True)
KEEP = clone  # alive until the interpreter shuts down: its __del__ detaches it then
"""


def test_dynamic_clone_alive_at_exit_prints_no_exception(comfy_current):
    from comfy_harness import run_in_current_comfy
    cp = run_in_current_comfy(_SCRIPT, timeout=600)
    out, err = cp.stdout, cp.stderr
    assert cp.returncode == 0, f"exit {cp.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    loaded = [ln.split() for ln in out.splitlines() if ln.startswith("LOADED")]
    assert loaded and loaded[0][1] == "True" and int(loaded[0][2]) > 0, out[-2000:]  # injected, backups taken
    assert "Exception ignored" not in err and "ImportError" not in err, err[-4000:]
    assert "EJECT RETURNED" in out, (out[-2000:], err[-2000:])  # the eject did run at shutdown
