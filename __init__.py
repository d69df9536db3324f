"""ComfyUI INT8 Fused: real W8A8 INT8 GEMMs (Triton, tensor cores) for diffusion transformers.

ComfyUI imports this file from ``custom_nodes/``. Importing it compiles no kernel and touches no GPU.
"""
if __package__:  # imported as a package: ComfyUI's custom-node loader (and pytest walking up from tests/)
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
else:  # loaded as a plain module outside any package (pytest, when the folder's name is no identifier)
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = {}, {}

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
