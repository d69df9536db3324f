"""ComfyUI INT8 Fused: real W8A8 INT8 GEMMs (Triton, tensor cores) for diffusion transformers.

ComfyUI imports this file from ``custom_nodes/``. Importing it compiles no kernel and touches no GPU.
"""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
