"""A stand-in for PyAV (``av``) in a bench process that has none (the device machine: no PyAV, no network).

ComfyUI 0.33.0's ``comfy_api`` imports PyAV's video types when it is imported (``comfy_api/latest/_input_impl/
video_types.py``: ``av.container.InputContainer``, ``av.subtitles.stream.SubtitleStream``,
``av.video.reformatter.ColorPrimaries`` / ``ColorRange`` / ``ColorTrc``, whose members key dicts at import; ``import
av`` in ``_ui.py`` and ``_input/video_types.py``), and the ``comfy_extras`` node modules the benches use import
``comfy_api``: ``nodes_torch_compile`` (TorchCompileModel, the ``^inductor`` / ``^cudagraphs`` paths) and
``nodes_custom_sampler`` (the guiders). Without PyAV those imports raise ``ModuleNotFoundError: No module named
'av'``.

:func:`install_if_missing` (called by ``bench/e2e_sampler.comfy_setup``, so only in a bench process, and only where
``import av`` fails) puts a finder first on ``sys.meta_path`` that serves ``av`` and every ``av.<name>`` module.
Any other name in one of them is a placeholder class, and so is any attribute of a placeholder: one object per
name, so they work as dict keys, in annotations and in ``isinstance``. Calling one raises ModuleNotFoundError
naming this stand-in, so a video node run by mistake says what is missing. Nothing in the benches touches video.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

NAME = "av"


class _Placeholder(type):
    """A name of PyAV: a class whose attributes are placeholders too; calling it raises."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Placeholder(name, (), {"__module__": cls.__module__, "__qualname__": f"{cls.__qualname__}.{name}"})
        setattr(cls, name, sub)
        return sub

    def __call__(cls, *args, **kwargs):
        raise ModuleNotFoundError(f"PyAV is not installed: {cls.__module__}.{cls.__qualname__} is the bench's "
                                  "stand-in (bench/lib/av_standin.py)", name=NAME)


class _Module(types.ModuleType):
    """``av`` or ``av.<name>``: every other name in it is a placeholder."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Placeholder(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME and not fullname.startswith(NAME + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)  # av.x.y imports under any name

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.STANDIN = True


def installed() -> bool:
    """Whether this process's ``av`` is the stand-in."""
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def install_if_missing(log=print) -> bool:
    """Where ``import av`` fails, serve ``av`` from the stand-in (module doc) and say so through ``log``; returns
    whether it did. A PyAV that imports is left alone."""
    try:
        import av  # noqa: F401
        return False
    except ImportError as e:
        why = f"{type(e).__name__}: {e}"
    sys.meta_path.insert(0, _Finder())
    log(f"PyAV is not importable ({why}): a stand-in module `av` serves ComfyUI's comfy_api import of its video "
        "types (bench/lib/av_standin.py); no video node can run in this process")
    return True
