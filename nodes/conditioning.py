"""Node "INT8 Test Conditioning": deterministic random conditioning of a given shape.

A developer utility for the pack's miniature models (scripts/miniature.py) and for timing/accuracy
runs without a text encoder: a real text encoder (Gemma, T5, Qwen) weighs gigabytes, and the
comparisons this pack makes (backend against bf16, same seed) only need the same conditioning for
every backend. Not for making pictures: the tensor carries no meaning.
"""
from __future__ import annotations

import torch

from .common import CATEGORY


# Widest text feature of a supported model: Ideogram 4 takes 53248 (adapters.ideogram4.layout.REAL["text"]).
MAX_WIDTH = 65536


class Int8TestConditioning:
    CATEGORY = CATEGORY + "/testing"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    DESCRIPTION = ("Deterministic random conditioning [1, tokens, width] (+ pooled [1, pooled_width]) for "
                   "miniature test models and backend comparisons without a text encoder. Developer "
                   "utility: the values mean nothing.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "tokens": ("INT", {"default": 8, "min": 1, "max": 4096, "tooltip":
                               "Number of text tokens (sequence length of the conditioning)."}),
            "width": ("INT", {"default": 64, "min": 1, "max": MAX_WIDTH, "tooltip":
                              "Feature width of each token: the text-encoder width the model expects. 64 "
                              "the pack's miniatures; 2304 Lumina 2 (Gemma 2); 2560 Z-Image (Qwen3 4B); "
                              "3584 Qwen-Image; 4096 Flux.1 / SD3 / Wan (T5); 15360 Flux.2 dev; "
                              "53248 Ideogram 4."}),
            "pooled_width": ("INT", {"default": 0, "min": 0, "max": 16384, "tooltip":
                                     "Width of the pooled vector Flux-style models need (64 for the flux "
                                     "miniature, 768 for Flux.1); 0 = none."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFF, "tooltip":
                             "Same seed, same tensors, on every machine (CPU generator)."}),
            "scale": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 100.0, "step": 0.01, "tooltip":
                                "Standard deviation of the random values."}),
        }}

    def make(self, tokens, width, pooled_width, seed, scale=1.0):
        g = torch.Generator().manual_seed(int(seed))
        cond = torch.randn(1, tokens, width, generator=g) * scale
        extra = {}
        if pooled_width > 0:
            extra["pooled_output"] = torch.randn(1, pooled_width, generator=g) * scale
        return ([[cond, extra]],)


NODE_CLASS_MAPPINGS = {"Int8TestConditioning": Int8TestConditioning}
NODE_DISPLAY_NAME_MAPPINGS = {"Int8TestConditioning": "INT8 Test Conditioning"}
