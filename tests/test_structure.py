"""The pack's import structure, read from the source with ``ast`` (nothing is imported):

* no import cycle among the pack's modules, counting module-level and function-level imports alike (a cycle
  hidden by an import inside a function is still a cycle). A module's import of a name its own package's
  ``__init__`` defines (``from . import name`` in ``kernel/ops.py``, ``from .. import name``) is an edge to that
  ``__init__`` like any other: a package whose ``__init__`` reaches a module that takes names back from it is a
  cycle, whichever side imports inside a function. ``from . import sub`` of a submodule is an edge to ``sub`` only
  (Python runs the package's ``__init__`` before any of its modules: that order is no import of the module's);
* the pack's code reaches its own modules by plain relative imports: no ``importlib.import_module``, no
  ``kernel_module`` / ``pack_module`` helper, no absolute ``import kernel`` / ``quant`` / ``adapters``;
* ``kernel/`` imports nothing else of the pack (it runs with torch and Triton alone);
* outside ``quant/backends.py`` no code decides by a backend's name: no comparison (``==``, ``in``, ...), subscript
  or ``get`` with a backend's name or a constant bound to one (``FUSED_BACKEND``, defined once, in
  ``quant/backends.py``); callers ask the backend's record what it can do (``backends.capabilities``);
* no module takes another pack module's private (underscore-prefixed) name, by ``from .x import _name`` or by
  reading ``x._name`` of a module it imported: what several modules share is public where it lives (the row
  kernels' shared ``@triton.jit`` helpers in ``kernel/rowtile.py``, the input checks in ``kernel/checks.py``).
  The cycle and layering checks above see only which modules import which, never the names taken: this one does.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernel", "quant", "adapters", "nodes")
HELPERS = ("kernel_module", "pack_module")
# importlib.import_module of a module that is not the pack's, named by data: (file, function) -> why
EXTERNAL_IMPORTS = {("adapters/base.py", "_resolve"): "an adapter's ComfyUI model class path",
                    ("kernel/compile_worker.py", "resolve"): "a compile worker process: the kernel a request names",
                    ("kernel/compile_worker.py", "main"): "a compile worker process: the kernel modules it preloads"}


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """{dotted name ("" for the pack's own __init__): file} of every module of the pack."""
    mods = {"": root / "__init__.py"}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _imports(name: str, path: Path, mods: dict) -> list[tuple[str, int]]:
    """(pack module imported, line) for every relative import in the module, wherever it sits."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package.split(".") if package else []
        base = ".".join(base[:len(base) - (node.level - 1)])
        target = _join(base, node.module or "")
        for alias in node.names:
            sub = _join(target, alias.name)
            out.append((sub if sub in mods else target, node.lineno))
    return out


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """{module: {module it imports: line}} over the pack's modules, imports of names from a module's own packages'
    ``__init__`` included (module doc)."""
    mods = _modules(root)
    graph = {}
    for name, path in mods.items():
        edges = graph[name] = {}
        for dep, line in _imports(name, path, mods):
            if dep in mods and dep != name:
                edges.setdefault(dep, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def _describe(comp: list[str], graph) -> str:
    inside = set(comp)
    return "; ".join(f"{a or '<pack>'} -> {b or '<pack>'} (line {line})" for a in comp
                     for b, line in sorted(graph[a].items()) if b in inside)


def indirect_imports(root: Path = ROOT) -> list[str]:
    """Every ``importlib.import_module``, ``kernel_module``, ``pack_module`` and absolute import of the pack's
    top-level names in the pack's packages (``file:line what``), bar ``EXTERNAL_IMPORTS``."""
    found = []
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            tree = ast.parse(f.read_text(), str(f))
            funcs = {id(n): fn.name for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                     for n in ast.walk(fn)}
            for node in ast.walk(tree):
                what = None
                if isinstance(node, ast.Call):
                    fn = node.func
                    fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                    if fname == "import_module" and (rel, funcs.get(id(node))) not in EXTERNAL_IMPORTS:
                        what = "importlib.import_module"
                    elif fname in HELPERS:
                        what = f"{fname}()"
                elif isinstance(node, ast.FunctionDef) and node.name in HELPERS:
                    what = f"def {node.name}"
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    if (node.module or "").split(".")[0] in ("kernel", "quant", "adapters"):
                        what = f"from {node.module} import"
                    elif any(a.name in HELPERS for a in node.names):
                        what = "imports " + ", ".join(a.name for a in node.names if a.name in HELPERS)
                elif isinstance(node, ast.ImportFrom) and any(a.name in HELPERS for a in node.names):
                    what = "imports " + ", ".join(a.name for a in node.names if a.name in HELPERS)
                elif isinstance(node, ast.Import):
                    bad = [a.name for a in node.names if a.name.split(".")[0] in ("kernel", "quant", "adapters")]
                    what = f"import {', '.join(bad)}" if bad else None
                if what:
                    found.append(f"{rel}:{node.lineno} {what}")
    return found


BACKENDS_FILE = "quant/backends.py"
# comparisons with a backend's name allowed outside quant/backends.py: (file, what is compared) -> why
NAME_COMPARISONS_ALLOWED = {
    ("nodes/timing.py", "FLOAT"): "the run report's label of the float model (web/int8_format.js writes the same)",
}


def backend_names() -> set[str]:
    """The registry's backend names, read from ``quant/backends.py`` (the first argument of each ``Backend(...)``,
    a string or a module constant bound to one)."""
    tree = ast.parse((ROOT / BACKENDS_FILE).read_text())
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
              for t in n.targets if isinstance(t, ast.Name)}
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Backend" and n.args:
            a = n.args[0]
            names.add(a.value if isinstance(a, ast.Constant) else consts.get(getattr(a, "id", None)))
    return names - {None, ""}


def name_decisions(root: Path = ROOT, names: set | None = None) -> list[str]:
    """``file:line what`` for every comparison (``==``, ``!=``, ``in``, ``not in``, ``is``, a ``case``), subscript
    and ``.get(...)`` in the pack's packages, outside ``quant/backends.py``, that involves a backend's name: the string
    itself, in a literal tuple / list / set, or a module constant bound to one (``X = "fused_triton"``, used as ``X``
    or ``mod.X``), bar ``NAME_COMPARISONS_ALLOWED``."""
    names = backend_names() if names is None else names
    files = [f for pkg in PACKAGES for f in sorted((root / pkg).rglob("*.py"))]
    trees = {f.relative_to(root).as_posix(): ast.parse(f.read_text(), str(f)) for f in files}

    def stem(rel: str) -> str:  # how other modules name a module: quant/backends.py -> backends
        p = Path(rel)
        return p.parent.name if p.stem == "__init__" else p.stem
    defined: dict[str, set] = {}  # module stem -> its constants bound to a backend's name
    for rel, tree in trees.items():
        defined.setdefault(stem(rel), set()).update(
            t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
            and isinstance(n.value, ast.Constant) and n.value.value in names
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name))

    found = []
    for rel, tree in trees.items():
        if rel == BACKENDS_FILE:
            continue
        local = set(defined.get(stem(rel), ())) | {  # and those imported by name (from .backends import X)
            a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            for a in n.names if a.name in defined.get((n.module or "").rpartition(".")[2], ())}

        def named(node) -> str | None:
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                return repr(node.value)
            if isinstance(node, ast.Name) and node.id in local:
                return node.id
            if isinstance(node, ast.Attribute) and node.attr in defined.get(getattr(node.value, "id", None), ()):
                return node.attr  # backends.FUSED_BACKEND
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                return next((w for w in map(named, node.elts) if w), None)
            return None

        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                parts = [node.left, *node.comparators]
            elif isinstance(node, ast.Subscript):
                parts = [node.slice]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get":
                parts = node.args[:1]
            elif isinstance(node, ast.MatchValue):
                parts = [node.value]
            else:
                continue
            what = next((w for w in map(named, parts) if w), None)
            if what and (rel, what) not in NAME_COMPARISONS_ALLOWED:
                found.append(f"{rel}:{node.lineno} {type(node).__name__.lower()} with {what}")
    return found


def test_no_backend_name_decides_outside_the_registry():
    names = backend_names()
    assert {"fused_triton", "torch_int_mm", "dequant_bf16", "bf16"} <= names, names
    found = name_decisions(names=names)
    assert not found, ("ask the backend's record what it can do (quant.backends.capabilities) instead of comparing "
                       "its name:\n" + "\n".join(found))


def test_name_check_sees_every_form(tmp_path):
    """The checker itself, on a made-up pack: a literal, a literal tuple, a constant bound to a name (also through a
    module), a subscript and a ``get`` are found; an assignment, a default argument and a call are not."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
    (tmp_path / "quant" / "backends.py").write_text('FUSED = "fast"\nif FUSED == "fast":\n    pass\n')
    (tmp_path / "quant" / "a.py").write_text(
        'from . import backends\nMINE = "fast"\n\n\ndef f(b="slow", d=None):\n    run(b, "fast")\n'
        '    if b == "fast" or b in ("x", "slow") or b != MINE or backends.FUSED is b:\n'
        '        return d["slow"], d.get("fast")\n')
    found = name_decisions(tmp_path, {"fast", "slow"})
    assert found == ["quant/a.py:7 compare with 'fast'", "quant/a.py:7 compare with 'slow'",
                     "quant/a.py:7 compare with MINE", "quant/a.py:7 compare with FUSED",
                     "quant/a.py:8 subscript with 'slow'", "quant/a.py:8 call with 'fast'"], found


def test_fused_backend_is_defined_once():
    """One ``FUSED_BACKEND``: the registry's (``quant/backends.py``)."""
    where = [f"{f.relative_to(ROOT).as_posix()}:{n.lineno}" for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))
             for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Assign)
             and any(getattr(t, "id", None) == "FUSED_BACKEND" for t in n.targets)]
    assert len(where) == 1 and where[0].startswith(BACKENDS_FILE + ":"), where


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(root: Path = ROOT) -> list[str]:
    """Every private name a pack module takes from another (``file:line what``): ``from .x import _name`` (a name,
    not a submodule) and ``m._name`` where ``m`` is a pack module bound by a relative import (under any alias)."""
    mods = _modules(root)
    found = []
    for name, path in mods.items():
        rel = path.relative_to(root).as_posix()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        bound = set()  # names bound to a pack module
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = package.split(".") if package else []
            target = _join(".".join(base[:len(base) - (node.level - 1)]), node.module or "")
            for alias in node.names:
                if _join(target, alias.name) in mods:
                    bound.add(alias.asname or alias.name)
                elif _private(alias.name):
                    found.append(f"{rel}:{node.lineno} from {'.' * node.level}{node.module or ''} import {alias.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                    and _private(node.attr):
                found.append(f"{rel}:{node.lineno} {node.value.id}.{node.attr}")
    return sorted(found)


def test_cycle_finder_sees_a_hidden_cycle(tmp_path):
    """The checker itself, on a made-up pack: a cycle closed by a function-level import is found, with its lines."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "__init__.py").write_text("from .nodes import x\n")
    (tmp_path / "quant" / "a.py").write_text("from . import b\nfrom ..kernel import config\n")
    (tmp_path / "quant" / "b.py").write_text("def f():\n    from .a import g\n")
    (tmp_path / "kernel" / "config.py").write_text("import os\n")
    g = import_graph(tmp_path)
    assert g["quant.a"] == {"quant.b": 1, "kernel.config": 2} and g["quant.b"] == {"quant.a": 2}
    assert g[""] == {"nodes": 1}
    assert cycles(g) == [["quant.a", "quant.b"]]
    (tmp_path / "quant" / "b.py").write_text("from ..kernel import config\n")
    assert cycles(import_graph(tmp_path)) == []


def test_cycle_finder_counts_imports_of_a_modules_own_package(tmp_path):
    """The shape kernel/__init__.py and kernel/ops.py once had: the package's ``__init__`` imports a module inside a
    function, which takes a name back from the ``__init__`` (``from . import name``) inside a function. A cycle; and
    ``from . import sub`` of a submodule is an edge to that submodule, not to the ``__init__``."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "kernel" / "__init__.py").write_text("def impl():\n    pass\n\n\ndef op():\n"
                                                     "    from .ops import run\n    return run()\n")
    (tmp_path / "kernel" / "ops.py").write_text("from . import config\n\n\ndef run():\n"
                                                "    from . import impl\n    return impl()\n")
    (tmp_path / "kernel" / "config.py").write_text("import os\n")
    (tmp_path / "quant" / "a.py").write_text("from .. import kernel\n")
    g = import_graph(tmp_path)
    assert g["kernel.ops"] == {"kernel.config": 1, "kernel": 5} and g["kernel"] == {"kernel.ops": 6}
    assert g["quant.a"] == {"kernel": 1}
    assert cycles(g) == [["kernel", "kernel.ops"]]
    # the implementation in a module of its own, the package's __init__ re-exporting it: no cycle
    (tmp_path / "kernel" / "impl.py").write_text("def impl():\n    pass\n")
    (tmp_path / "kernel" / "__init__.py").write_text("from .impl import impl\nfrom .ops import run\n")
    (tmp_path / "kernel" / "ops.py").write_text("from . import config, impl as _impl\n\n\ndef run():\n"
                                                "    return _impl.impl()\n")
    g = import_graph(tmp_path)
    assert g["kernel.ops"] == {"kernel.config": 1, "kernel.impl": 1} and cycles(g) == []


def test_no_import_cycle():
    g = import_graph()
    assert "quant.linear" in g and g["quant.dispatch"], "the graph misses the pack's modules"
    found = cycles(g)
    assert not found, "import cycles among the pack's modules:\n" + "\n".join(_describe(c, g) for c in found)


def test_pack_modules_imported_directly():
    found = indirect_imports()
    assert not found, "reach the pack's modules by relative imports instead:\n" + "\n".join(found)


def test_kernel_imports_nothing_else_of_the_pack():
    g = import_graph()
    outside = {f"{m} -> {d}" for m, deps in g.items() if m.split(".")[0] == "kernel"
               for d in deps if d.split(".")[0] != "kernel"}
    assert not outside, sorted(outside)


def test_private_name_finder(tmp_path):
    """The checker itself, on a made-up pack: a private name imported, or read through a module (aliased or not), is
    found; public names, a private alias of a module and a module's own private names are not."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "kernel" / "a.py").write_text("X = 1\n\n\ndef _f():\n    return X\n")
    (tmp_path / "kernel" / "b.py").write_text("from . import a as _a\nfrom .a import X, _f\n\n\n"
                                              "def g():\n    return _a._f(), _a.X, _g()\n\n\ndef _g():\n    pass\n")
    (tmp_path / "quant" / "c.py").write_text("def h():\n    from ..kernel import a\n    return a._f()\n")
    assert private_imports(tmp_path) == ["kernel/b.py:2 from .a import _f", "kernel/b.py:6 _a._f",
                                         "quant/c.py:3 a._f"]


def test_no_private_names_across_modules():
    found = private_imports()
    assert not found, ("a private name taken from another pack module: make it public where it lives (shared "
                       "@triton.jit helpers: kernel/rowtile.py):\n" + "\n".join(found))


def test_tests_import_the_pack_one_way():
    """``import kernel`` / ``quant`` / ``adapters`` in a test are the modules of the package ``comfyui_int8_fused``
    (tests/pack_import.py, installed by conftest): one ``Int8Linear`` class, one set of switches."""
    import sys

    import adapters.ideogram4.layout
    import kernel.config
    from quant import linear

    pack = sys.modules["comfyui_int8_fused"]
    assert kernel.config is pack.kernel.config is sys.modules["comfyui_int8_fused.kernel.config"]
    assert linear.__name__ == "comfyui_int8_fused.quant.linear" and linear.__spec__.name == linear.__name__
    assert adapters.ideogram4.layout is pack.adapters.ideogram4.layout
    assert pack.adapters.base.Int8Linear is linear.Int8Linear and pack.quant.dispatch.config is kernel.config


def test_layer_state_is_declared_in_one_place_and_dropped_on_a_move():
    """What dispatch and the backends keep per layer lives in ``Int8Linear.derived`` (no attribute of their own on
    the layer); a move or cast (``_apply``), a state-dict load and a new weight tensor drop the tensors derived from
    the old ones, while decisions, plans and call counts stay."""
    import torch

    from kernel import config
    from quant import backends, dispatch
    from quant.linear import Int8Linear

    g = torch.Generator().manual_seed(0)
    w, b, s = torch.randn(16, 32, generator=g), torch.randn(16, generator=g), torch.rand(32, generator=g) + 0.5
    layer = Int8Linear.from_float(w, b, smooth=s, backend="fused_triton", name="l")
    attrs = set(vars(layer))
    x = torch.randn(5, 32, generator=g)
    with config.override(INT8_FUSED_DISPATCH="float"):
        y = layer(x)
        assert torch.equal(layer(x), y)  # the second call: forward's hot path
    w8, s8 = backends._fp8_weight(layer)
    assert set(vars(layer)) == attrs  # nothing but the layer's declared attributes
    ref = torch.nn.functional.linear(x.double(), layer.dequantized_weight().double(), b.double())
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6  # the float path: weight-only int8
    d = layer.derived
    assert ("dispatch_float", torch.device("cpu"), torch.float32) in d.tensors and "inv_smooth" in d.tensors
    assert d.hot and d.fp8[0] is w8 and w8.dtype == torch.float8_e4m3fn
    assert dict(layer.dispatch_calls) == {"float": 2} and d.float_rows == {(5, True)}
    assert dispatch.counts([layer])["float_shapes"] == ["M<=16 16x32 (forced)"]

    layer.weight = layer.weight.detach().clone()  # ComfyUI swapping the tensor: the hot path lets the old one go
    assert not d.hot and d.tensors
    layer._apply(lambda t: t)  # a move or cast
    assert not d.tensors and not d.hot and d.fp8 is None and dict(layer.dispatch_calls) == {"float": 2}
    layer.inv_smooth  # noqa: B018  (made again)
    layer.load_state_dict(layer.state_dict())
    assert not d.tensors and layer.derived is d
