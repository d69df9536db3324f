"""Miniature diffusion transformers: deterministic random weights in the real key layouts.

Two sizes per architecture:

* ``miniature_state_dict(arch, seed)`` — the smallest model that ComfyUI 0.3.75's
  ``comfy/model_detection.py`` recognises from the weights alone. Detection hard-codes the head count
  of these architectures (Lumina 2: 24 heads of 96 -> width 2304; Flux.1: 24 heads of 128 -> width
  3072), so the width is the real one and only the depth is cut: Lumina 2 with its 2 + 2 refiner
  blocks and 1 main layer (~420 M parameters), Flux.1 with 1 double and 1 single block (~520 M).
  Text/pooled widths are free (64), so conditioning stays tiny. These load through the core
  ``UNETLoader`` of a real server; with a 32x32 image a float sampling step takes seconds on 2 CPU
  cores (writing a file takes ~10 s once; it is kept and reused).
* ``tiny_state_dict(arch, seed)`` + ``TINY_UNET_CONFIG[arch]`` — the same layouts at width 128 for
  in-process tests (``tests/comfy_harness.load_tiny``). Detection cannot size them (it would build the
  hard-coded width), so they are built from the explicit config with ComfyUI's own model classes.

Architectures: ``lumina2`` (Lumina 2 / Z-Image family; its ``feed_forward.w1/w2/w3`` SwiGLU is the
FeedForward Ideogram 4 uses) and ``flux`` (Flux.1 schnell-style: no guidance embedder).

Weights are N(0, gain^2 / fan_in) so activations keep unit scale through the blocks; modulation
projections get a small gain so shift/scale/gate stay O(0.1); norms are 1, biases small. Outputs of
a few sampling steps are finite and not constant. Everything is generated from ``seed`` with a CPU
``torch.Generator`` (same tensors on every machine) and stored as bf16.

Command line: ``python scripts/miniature.py lumina2 out.safetensors [--seed 0] [--tiny]``.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

VERSION = 1  # bump when a layout or the init changes; files carry it in their metadata
ARCHS = ("lumina2", "flux")
MOD_GAIN = 0.1   # modulation (adaLN) projections: keep shift/scale/gate small
OUT_GAIN = 0.5   # final projection


# --------------------------------------------------------------------------- layouts
# Each layout is a list of (key, shape, kind); kind picks the init (see _init).
def _lumina2_block(p: str, dim: int, heads: int, kv_heads: int, ffn: int, t_dim: int, modulation: bool):
    hd = dim // heads
    out = [
        (f"{p}.attention.qkv.weight", (dim + 2 * kv_heads * hd, dim), "linear"),
        (f"{p}.attention.out.weight", (dim, dim), "linear"),
        (f"{p}.attention.q_norm.weight", (hd,), "norm"),
        (f"{p}.attention.k_norm.weight", (hd,), "norm"),
        (f"{p}.feed_forward.w1.weight", (ffn, dim), "linear"),
        (f"{p}.feed_forward.w2.weight", (dim, ffn), "linear"),
        (f"{p}.feed_forward.w3.weight", (ffn, dim), "linear"),
    ]
    out += [(f"{p}.{n}.weight", (dim,), "norm")
            for n in ("attention_norm1", "ffn_norm1", "attention_norm2", "ffn_norm2")]
    if modulation:
        out += [(f"{p}.adaLN_modulation.1.weight", (4 * dim, t_dim), "mod"),
                (f"{p}.adaLN_modulation.1.bias", (4 * dim,), "bias")]
    return out


def lumina2_layout(dim=2304, heads=24, kv_heads=8, ffn=9216, layers=1, refiners=2, cap_dim=64,
                   in_channels=16, patch=2):
    t_dim = min(dim, 1024)
    lay = [("x_embedder.weight", (dim, patch * patch * in_channels), "linear"),
           ("x_embedder.bias", (dim,), "bias")]
    for i in range(refiners):
        lay += _lumina2_block(f"noise_refiner.{i}", dim, heads, kv_heads, ffn, t_dim, True)
    for i in range(refiners):
        lay += _lumina2_block(f"context_refiner.{i}", dim, heads, kv_heads, ffn, t_dim, False)
    lay += [("t_embedder.mlp.0.weight", (t_dim, 256), "linear"), ("t_embedder.mlp.0.bias", (t_dim,), "bias"),
            ("t_embedder.mlp.2.weight", (t_dim, t_dim), "linear"), ("t_embedder.mlp.2.bias", (t_dim,), "bias"),
            ("cap_embedder.0.weight", (cap_dim,), "norm"),
            ("cap_embedder.1.weight", (dim, cap_dim), "linear"), ("cap_embedder.1.bias", (dim,), "bias")]
    for i in range(layers):
        lay += _lumina2_block(f"layers.{i}", dim, heads, kv_heads, ffn, t_dim, True)
    lay += [("norm_final.weight", (dim,), "norm"),
            ("final_layer.linear.weight", (patch * patch * in_channels, dim), "out"),
            ("final_layer.linear.bias", (patch * patch * in_channels,), "bias"),
            ("final_layer.adaLN_modulation.1.weight", (dim, t_dim), "mod"),
            ("final_layer.adaLN_modulation.1.bias", (dim,), "bias")]
    return lay


def _flux_stream(p: str, h: int, hd: int, mlp: int):
    return [(f"{p}_mod.lin.weight", (6 * h, h), "mod"), (f"{p}_mod.lin.bias", (6 * h,), "bias"),
            (f"{p}_attn.qkv.weight", (3 * h, h), "linear"), (f"{p}_attn.qkv.bias", (3 * h,), "bias"),
            (f"{p}_attn.norm.query_norm.scale", (hd,), "norm"),
            (f"{p}_attn.norm.key_norm.scale", (hd,), "norm"),
            (f"{p}_attn.proj.weight", (h, h), "linear"), (f"{p}_attn.proj.bias", (h,), "bias"),
            (f"{p}_mlp.0.weight", (mlp, h), "linear"), (f"{p}_mlp.0.bias", (mlp,), "bias"),
            (f"{p}_mlp.2.weight", (h, mlp), "linear"), (f"{p}_mlp.2.bias", (h,), "bias")]


def flux_layout(hidden=3072, heads=24, double=1, single=1, ctx_dim=64, vec_dim=64, in_channels=16,
                patch=2, mlp_ratio=4.0):
    h, hd, mlp = hidden, hidden // heads, int(hidden * mlp_ratio)
    pin = patch * patch * in_channels
    lay = [("img_in.weight", (h, pin), "linear"), ("img_in.bias", (h,), "bias"),
           ("time_in.in_layer.weight", (h, 256), "linear"), ("time_in.in_layer.bias", (h,), "bias"),
           ("time_in.out_layer.weight", (h, h), "linear"), ("time_in.out_layer.bias", (h,), "bias"),
           ("vector_in.in_layer.weight", (h, vec_dim), "linear"), ("vector_in.in_layer.bias", (h,), "bias"),
           ("vector_in.out_layer.weight", (h, h), "linear"), ("vector_in.out_layer.bias", (h,), "bias"),
           ("txt_in.weight", (h, ctx_dim), "linear"), ("txt_in.bias", (h,), "bias")]
    for i in range(double):
        lay += _flux_stream(f"double_blocks.{i}.img", h, hd, mlp)
        lay += _flux_stream(f"double_blocks.{i}.txt", h, hd, mlp)
    for i in range(single):
        p = f"single_blocks.{i}"
        lay += [(f"{p}.linear1.weight", (3 * h + mlp, h), "linear"), (f"{p}.linear1.bias", (3 * h + mlp,), "bias"),
                (f"{p}.linear2.weight", (h, h + mlp), "linear"), (f"{p}.linear2.bias", (h,), "bias"),
                (f"{p}.norm.query_norm.scale", (hd,), "norm"), (f"{p}.norm.key_norm.scale", (hd,), "norm"),
                (f"{p}.modulation.lin.weight", (3 * h, h), "mod"), (f"{p}.modulation.lin.bias", (3 * h,), "bias")]
    lay += [("final_layer.linear.weight", (pin, h), "out"), ("final_layer.linear.bias", (pin,), "bias"),
            ("final_layer.adaLN_modulation.1.weight", (2 * h, h), "mod"),
            ("final_layer.adaLN_modulation.1.bias", (2 * h,), "bias")]
    return lay


# Detectable sizes (what 0.3.75 builds from the weights) and tiny sizes (explicit config).
DETECTABLE = {"lumina2": dict(), "flux": dict()}
TINY = {"lumina2": dict(dim=128, heads=4, kv_heads=2, ffn=512, layers=2, refiners=1),
        "flux": dict(hidden=128, heads=2, double=2, single=2)}
_LAYOUTS = {"lumina2": lumina2_layout, "flux": flux_layout}

# ComfyUI unet_config for the tiny sizes (keys as comfy/model_detection.py would produce them).
TINY_UNET_CONFIG = {
    "lumina2": {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 128,
                "cap_feat_dim": 64, "n_layers": 2, "n_refiner_layers": 1, "qk_norm": True,
                "n_heads": 4, "n_kv_heads": 2, "axes_dims": [8, 12, 12], "axes_lens": [300, 512, 512],
                "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0, "multiple_of": 16},
    "flux": {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 64,
             "context_in_dim": 64, "hidden_size": 128, "mlp_ratio": 4.0, "num_heads": 2, "depth": 2,
             "depth_single_blocks": 2, "axes_dim": [8, 28, 28], "theta": 10000, "qkv_bias": True,
             "guidance_embed": False, "patch_size": 2},
}

# Shapes of the conditioning each model takes: (text tokens width, pooled width or 0).
CONDITIONING = {"lumina2": (64, 0), "flux": (64, 64)}


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown miniature architecture {arch!r}; choose one of {', '.join(ARCHS)}")


def layout(arch: str, tiny: bool = False) -> list[tuple[str, tuple, str]]:
    _check_arch(arch)
    return _LAYOUTS[arch](**(TINY if tiny else DETECTABLE)[arch])


def _init(shape: tuple, kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "norm":
        return torch.ones(shape)
    if kind == "bias":
        return torch.randn(shape, generator=g) * 0.02
    gain = {"linear": 1.0, "mod": MOD_GAIN, "out": OUT_GAIN}[kind]
    return torch.randn(shape, generator=g).mul_(gain / shape[1] ** 0.5)


def _state_dict(arch: str, seed: int, tiny: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: _init(shape, kind, g).to(dtype) for k, shape, kind in layout(arch, tiny)}


def miniature_state_dict(arch: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The smallest state dict of ``arch`` that ComfyUI 0.3.75 detects (see module docstring)."""
    return _state_dict(arch, seed, False, dtype)


def tiny_state_dict(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Width-128 state dict of ``arch``; build it with ``TINY_UNET_CONFIG[arch]`` (not detectable)."""
    return _state_dict(arch, seed, True, dtype)


def _metadata(arch: str, seed: int, tiny: bool) -> dict[str, str]:
    return {"int8_fused_miniature": json.dumps({"arch": arch, "seed": seed, "tiny": tiny,
                                                 "version": VERSION})}


def write_miniature(arch: str, path, seed: int = 0, tiny: bool = False) -> Path:
    """Write the miniature ``arch`` to ``path`` (safetensors, bf16). A file already there with the
    same arch/seed/version is kept, so calling this again costs nothing."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    meta = _metadata(arch, seed, tiny)
    if path.exists():
        try:
            with safe_open(str(path), "pt") as f:
                if (f.metadata() or {}).get("int8_fused_miniature") == meta["int8_fused_miniature"]:
                    return path
        except Exception:  # a truncated or foreign file: write it again
            pass
    sd = _state_dict(arch, seed, tiny, torch.bfloat16)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(sd, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


def default_filename(arch: str, seed: int = 0) -> str:
    return f"int8fused_miniature_{arch}_s{seed}.safetensors"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("arch", choices=ARCHS)
    ap.add_argument("path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="width-128 variant (not detectable by ComfyUI)")
    a = ap.parse_args()
    p = write_miniature(a.arch, a.path, a.seed, a.tiny)
    n = sum(torch.Size(s).numel() for _, s, _ in layout(a.arch, a.tiny))
    print(f"{p}: {a.arch}{' (tiny)' if a.tiny else ''}, {n / 1e6:.1f} M parameters")


if __name__ == "__main__":
    main()
