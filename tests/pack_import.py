"""The one way tests, benchmarks and scripts import the pack: the repository as the package ``comfyui_int8_fused``
(as ComfyUI's loader imports a custom-node folder: ``__init__.py`` with submodule_search_locations), and ``kernel``,
``quant``, ``adapters`` as other names of its subpackages, so ``import quant.linear`` is
``comfyui_int8_fused.quant.linear`` (one module object, one ``Int8Linear`` class, one set of switches):

    sys.path.insert(0, str(ROOT / "tests")); import pack_import; pack_import.install()

``install`` runs before anything imports those names. The pack's ``__init__`` (the nodes, hence ComfyUI) runs
only in :func:`import_pack`; ``nodes`` is never a top-level name (ComfyUI's nodes.py owns it). Standard library only.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACK_MODULE = "comfyui_int8_fused"
ALIASES = ("kernel", "quant", "adapters")


def package(root: Path = ROOT, name: str = PACK_MODULE):
    """The repository as package ``name``; its ``__init__`` is not run here (see :func:`import_pack`)."""
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, Path(root) / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
    return mod


def import_pack(root: Path = ROOT, name: str = PACK_MODULE):
    """The pack with its ``__init__`` run (the nodes imported: ComfyUI must be importable), as ComfyUI imports it."""
    mod = package(root, name)
    if "WEB_DIRECTORY" not in vars(mod):  # its last assignment: not run yet, or it failed before
        mod.__spec__.loader.exec_module(mod)
    return mod


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``kernel``, ``quant``, ``adapters`` and their modules as the pack's own module objects."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in ALIASES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"{PACK_MODULE}.{spec.name}")
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # the import system set the alias's spec: put back the real one


def install() -> None:
    """Make ``kernel``, ``quant`` and ``adapters`` the pack's subpackages (idempotent). Raises when one of them was
    already imported as a package of its own (a second copy of the pack's modules)."""
    if any(isinstance(f, _Aliases) for f in sys.meta_path):
        return
    stray = [n for n in sys.modules if n.partition(".")[0] in ALIASES]
    if stray:
        raise RuntimeError(f"{', '.join(sorted(stray)[:5])} imported before pack_import.install(): call it first")
    package()
    sys.meta_path.insert(0, _Aliases())
