"""ComfyUI nodes of the pack: the only code that imports ComfyUI. Each module listed in ``_MODULES``
defines ``NODE_CLASS_MAPPINGS`` and ``NODE_DISPLAY_NAME_MAPPINGS``; they are merged here."""
from . import comfy_cast

comfy_cast.install()  # Int8Linear fetches ComfyUI-managed weights through comfy.ops (nodes/comfy_cast.py)

from . import apply, calibrate, conditioning, dual_gpu, loader, save  # noqa: E402

_MODULES = (apply, calibrate, loader, save, conditioning, dual_gpu)

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

for _mod in _MODULES:
    NODE_CLASS_MAPPINGS.update(getattr(_mod, "NODE_CLASS_MAPPINGS", {}))
    NODE_DISPLAY_NAME_MAPPINGS.update(getattr(_mod, "NODE_DISPLAY_NAME_MAPPINGS", {}))

from .apply import forced_backend  # noqa: E402

forced_backend()  # an unknown INT8_FUSED_BACKEND warns once, when ComfyUI loads the pack
