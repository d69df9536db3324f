"""ComfyUI nodes of the pack: the only code that imports ComfyUI. Each module listed in ``_MODULES``
defines ``NODE_CLASS_MAPPINGS`` and ``NODE_DISPLAY_NAME_MAPPINGS``; they are merged here."""
import importlib

from . import comfy_cast

comfy_cast.install()  # Int8Linear fetches ComfyUI-managed weights through comfy.ops (nodes/comfy_cast.py)

_MODULES = ["apply", "calibrate", "loader", "save", "conditioning"]  # e.g. "apply", "calibrate", "loader", "save", "timing"

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

for _name in _MODULES:
    _mod = importlib.import_module(f".{_name}", __name__)
    NODE_CLASS_MAPPINGS.update(getattr(_mod, "NODE_CLASS_MAPPINGS", {}))
    NODE_DISPLAY_NAME_MAPPINGS.update(getattr(_mod, "NODE_DISPLAY_NAME_MAPPINGS", {}))

from .apply import forced_backend  # noqa: E402

forced_backend()  # an unknown INT8_FUSED_BACKEND warns once, when ComfyUI loads the pack
