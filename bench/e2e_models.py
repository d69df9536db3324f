"""Flux.1, Z-Image, Wan 2.1 (1.3B, 14B), Wan 2.2 TI2V 5B, Qwen-Image and Ideogram 4 sampled by ComfyUI's own sampler.

The method of bench/e2e_sampler.py for more architectures: ComfyUI 0.33.0 set up as ``main.py`` does on an
NVIDIA GPU (``e2e_sampler.comfy_setup``: cudaMallocAsync, comfy-aimdo, DynamicVRAM), and per model a FULL-SIZE
backbone with random weights in ComfyUI's real key layout, loaded through
``comfy.sd.load_diffusion_model_state_dict`` (the UNETLoader path).

Weights: no hand-written key lists. The model is built on the meta device from an explicit ``unet_config`` (the
one ComfyUI's detection derives from the real checkpoint: comfy/model_detection.py) through
``model_detection.model_config_from_unet_config(...).get_model({}, device="meta")``; its parameters' names and
shapes are filled with seeded random values made on the device (2-D+ weights N(0, 1/fan_in), modulation
tables N(0, 1/dim), norm weights 1, biases N(0, 0.02²)) and kept on the CPU like a loaded file. Loading that
state dict must detect the same model class and config (asserted). Ideogram 4 uses bench/lib/e2e.py's
``random_state_dict`` (34 layers).

  flux       Flux.1-dev: hidden 3072, 24 heads, 19 double + 38 single blocks, context 4096, pooled 768,
             guidance embedding. 1024x1024: latent [1,16,128,128] = 4096 image tokens; T5 text 512 x 4096,
             pooled 768, guidance 3.5 (FluxGuidance's default)
  zimage     Z-Image (Turbo, 6 B; ComfyUI's ZImage = Lumina 2 family): dim 3840, 30 layers, 30 heads,
             cap_feat_dim 2560 (Qwen3-4B), pad tokens (multiple 32). 1024x1024: 4096 image tokens; caption
             256 tokens (a detailed prompt plus the chat template; ComfyUI does not pad it)
  wan13      Wan 2.1 T2V 1.3B: dim 1536, ffn 8960, 12 heads, 30 layers, in/out 16. 480x832, 33 frames:
             latent [1,16,9,60,104] = 14040 tokens; umT5 text 512 x 4096
  wan14      Wan 2.1 T2V 14B: dim 5120, ffn 13824, 40 heads, 40 layers; the inputs of wan13
  wan22      Wan 2.2 TI2V 5B (ComfyUI's WAN22_T2V / model_base.WAN22, selected by out_dim 48): dim 3072, ffn 14336,
             24 heads, 30 layers, in/out 48 (the Wan 2.2 VAE's latent, 16x spatial). 480x832, 33 frames, image
             to video as Wan22ImageToVideoLatent with a start image: latent [1,48,9,30,52] = 3510 tokens, its
             first frame kept (noise mask 0), so WAN22 gives per-frame timesteps: per-token modulation, e [B,9,6,C];
             umT5 text 512 x 4096
  qwen       Qwen-Image (20 B): 60 blocks, 24 heads x 128 = 3072, joint_attention_dim 3584 (Qwen2.5-VL 7B),
             in_channels 64 (16-channel latent, 2x2 patches); ComfyUI detects image_model, in_channels and
             num_layers, the rest are the model's defaults. 1024x1024: latent [1,16,1,128,128] = 4096 image
             tokens; text 256 tokens of 3584
  ideogram4  Ideogram 4: 34 layers, hidden 4608 (bench/lib/e2e.py). 1024x1024: latent [1,128,64,64]; text 512
             tokens of 53248
  ideogram4_dual  Ideogram 4 as its workflow runs it (bench/e2e_sampler.py's): DualModelGuider with a conditional
             and an unconditional backbone (seeds 0 and 1), cfg 4, negative unconnected: two forwards a step

Dtypes are ComfyUI's UNETLoader defaults (rows say ``compute_dtype``): bf16 for Flux, Z-Image and Ideogram 4;
Wan 2.x lists fp16 first, so on an H200 its "bf16" file computes in fp16 (``--comfy-flag=--bf16-unet`` makes
the bf16 and pack paths compute in bf16; fp8_fast keeps ComfyUI's manual-cast choice).

Paths: bench/e2e_sampler.py's grammar (bf16 | fp8_fast | core_int8 | pack:<backend>, ``~<attention>``), loaded by
its ``SamplerBench.load_path``. ``core_int8`` quantizes every 2-D weight of the repeated blocks (Ideogram 4:
bench/lib/e2e.py's block linears); a process whose only path is core_int8 drops the bf16 state dict before loading,
as a user with the int8 file.

Measurement: as bench/e2e_sampler.py's (first sample, a timed run, two whole samples: ``s_per_step_whole`` is the
headline of the summary, its x bf16 / x fp8_fast and the issue-13 checks), with CFGGuider cfg 1.0 (ComfyUI then skips
the unconditional pass: one model forward a step; ``ideogram4_dual``: DualModelGuider, two). Each (model, path) is
built, measured and unloaded before the next; a failing path records ``status`` "oom" or "error" and the run goes on.
``--cold`` / ``--vram-gib`` / ``--isolate`` as there (bench/lib/e2e_runs.py); rows at a ``--vram-gib`` size get issue
36's checks.

The cold suite (issue 48), ``--cold``: each (model, path) in its own process with new, empty INT8_FUSED_CACHE_DIR and
TRITON_CACHE_DIR. Each row records ``first_sample_s`` (the first whole sample() call of that fresh process), then,
after the warm samples at the main resolution, ``second_res_first_s`` (the first sample at ``--second-res``, the
process warm) and ``second_res_warm_s`` (that resolution's best warm whole sample, in seconds), then
``second_process_first_s``: the first sample of a second fresh process given the first's cache folders (now warm),
which runs nothing else (its pid, and what its cache folders held when it started, under ``second_process``; the
first process leaves a marker with its pid there). ``--second-res``: ``image=768,video=384x672`` with ``--cold``
(768x768 for image models; 384x672, 33 frames, for Wan), ``none`` to skip; on a --tiny run the latent's sides scale
by the same ratio (rounded to even). ``--no-second-process`` skips the second processes. Pack rows get issue 48's
checks (bench/lib/e2e_runs.py ``cold_targets``) on a GPU.

``--device cpu --tiny`` smoke-runs the whole code path on the CPU (legacy patcher, shrunken models that
ComfyUI's detection still recognises: fewer blocks everywhere, narrower Flux and Wan; Ideogram 4 and Qwen-Image
narrowed with ComfyUI's config for them in the process, ``narrow_tiny``; Z-Image and Chroma keep their width, which
their detection fixes, so there pack:fused_triton, too slow in the Triton interpreter at that width, runs as
pack:torch_int_mm and fp8_fast is skipped, said in the rows). No timing claims.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # bench.lib; appended, so the pack's root (its nodes/) never shadows ComfyUI's modules
# nothing there imports torch or ComfyUI at import time
from bench.e2e_sampler import SamplerBench, add_run_args, has_comfy, isolated, start  # noqa: E402
from bench.lib.e2e_runs import logger  # noqa: E402

NOTE = ("s_per_step = one forward through ComfyUI's sampler (CFGGuider, cfg 1.0: ComfyUI skips the "
        "unconditional pass), median of the timed run's steps; euler, 'simple' schedule")


log = logger("models")


# ----------------------------------------------------------------------------- model table
# unet_config: what comfy/model_detection.py derives from the real checkpoint (0.33.0); "tiny" overrides keep
# detection working (Flux: heads = hidden / 128; Wan: heads = dim / 128; Z-Image: dim 3840 is what selects it).
FLUX = {"image_model": "flux", "axes_dim": [16, 56, 56], "num_heads": 24, "mlp_ratio": 4.0, "theta": 10000,
        "out_channels": 16, "qkv_bias": True, "txt_ids_dims": [], "in_channels": 16, "hidden_size": 3072,
        "context_in_dim": 4096, "patch_size": 2, "vec_in_dim": 768, "depth": 19, "depth_single_blocks": 38,
        "guidance_embed": True, "yak_mlp": False, "txt_norm": False}
ZIMAGE = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 3840, "cap_feat_dim": 2560,
          "n_layers": 30, "qk_norm": True, "n_heads": 30, "n_kv_heads": 30, "axes_dims": [32, 48, 48],
          "axes_lens": [1536, 512, 512], "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0,
          "z_image_modulation": True, "time_scale": 1000.0, "pad_tokens_multiple": 32}
WAN13 = {"image_model": "wan2.1", "dim": 1536, "out_dim": 16, "num_heads": 12, "ffn_dim": 8960, "num_layers": 30,
         "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
         "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "model_type": "t2v"}
WAN14 = dict(WAN13, dim=5120, num_heads=40, ffn_dim=13824, num_layers=40)
# Wan 2.2 TI2V 5B: detection reads in_dim from patch_embedding and out_dim from head.head (192 = 48 x 1x2x2)
WAN22 = dict(WAN13, dim=3072, num_heads=24, ffn_dim=14336, num_layers=30, in_dim=48, out_dim=48)
# ComfyUI's Qwen-Image detection reads these three; width (24 heads x 128), joint_attention_dim 3584 and out_channels
# 16 are QwenImageTransformer2DModel's defaults
QWEN = {"image_model": "qwen_image", "in_channels": 64, "num_layers": 60}
# full widths, a third of the depth: the 60-block model (20 B, 41 GB bf16) with four paths does not fit one call
QWEN20 = dict(QWEN, num_layers=20)
# Chroma (Flux.1-schnell widths, modulation from the approximator; detection fixes the width: 3072)
CHROMA = {"image_model": "chroma", "axes_dim": [16, 56, 56], "num_heads": 24, "mlp_ratio": 4.0, "theta": 10000,
          "out_channels": 64, "qkv_bias": True, "txt_ids_dims": [], "in_channels": 64, "hidden_size": 3072,
          "context_in_dim": 4096, "patch_size": 2, "vec_in_dim": None, "depth": 19, "depth_single_blocks": 38,
          "in_dim": 64, "out_dim": 3072, "hidden_dim": 5120, "n_layers": 5}
# Flux.2 [dev] widths (48 heads x 128 = 6144, global modulation, SiLU-gated MLPs, context 3 x 5120), 8 double
# blocks and 16 of the 48 single blocks (the 32 B model does not fit one call with four paths)
FLUX2 = {"image_model": "flux2", "axes_dim": [32, 32, 32, 32], "num_heads": 48, "mlp_ratio": 3.0, "theta": 2000,
         "out_channels": 128, "global_modulation": True, "mlp_silu_act": True, "qkv_bias": False, "ops_bias": False,
         "txt_ids_dims": [3], "in_channels": 128, "hidden_size": 6144, "context_in_dim": 15360, "patch_size": 1,
         "vec_in_dim": None, "depth": 8, "depth_single_blocks": 16, "guidance_embed": True, "yak_mlp": False,
         "txt_norm": False}
WAN_TINY = {"dim": 256, "num_heads": 2, "ffn_dim": 512, "num_layers": 1}


def wan_inputs(tiny: bool) -> dict:
    return {"latent": (1, 16, 2, 8, 8) if tiny else (1, 16, 9, 60, 104),
            "text": (1, 16, 4096) if tiny else (1, 512, 4096),
            "what": "480x832, 33 frames (latent 9x60x104), umT5 512 tokens"}


def wan22_inputs(tiny: bool) -> dict:
    """Wan 2.2 5B image to video: the Wan 2.2 VAE's latent (48 channels, 16x spatial, 4x temporal), its first frame
    the start image's (``first_frame``: a denoise mask 0 there, as Wan22ImageToVideoLatent makes)."""
    return {"latent": (1, 48, 2, 8, 8) if tiny else (1, 48, 9, 30, 52),
            "text": (1, 16, 4096) if tiny else (1, 512, 4096), "first_frame": True,
            "what": "480x832, 33 frames (latent 48x9x30x52), start image in frame 0 (per-token modulation), "
                    "umT5 512 tokens"}


MODELS = {
    # name: (ComfyUI supported_models class, unet_config, tiny overrides, inputs(tiny) -> dict)
    "flux": ("Flux", FLUX, {"hidden_size": 256, "num_heads": 2, "context_in_dim": 64, "vec_in_dim": 32,
                            "depth": 1, "depth_single_blocks": 1},
             lambda tiny: {"latent": (1, 16, 8, 8) if tiny else (1, 16, 128, 128),
                           "text": (1, 16, 64) if tiny else (1, 512, 4096),
                           "pooled": (1, 32) if tiny else (1, 768), "guidance": 3.5,
                           "what": "1024x1024, T5 512 tokens + pooled 768, guidance 3.5"}),
    "zimage": ("ZImage", ZIMAGE, {"n_layers": 1, "cap_feat_dim": 64},
               lambda tiny: {"latent": (1, 16, 8, 8) if tiny else (1, 16, 128, 128),
                             "text": (1, 32, 64) if tiny else (1, 256, 2560),
                             "what": "1024x1024, caption 256 tokens of 2560"}),
    "wan13": ("WAN21_T2V", WAN13, WAN_TINY, wan_inputs),
    "wan14": ("WAN21_T2V", WAN14, WAN_TINY, wan_inputs),
    "wan22": ("WAN22_T2V", WAN22, WAN_TINY, wan22_inputs),
    "qwen": ("QwenImage", QWEN, {"num_layers": 1},
             lambda tiny: {"latent": (1, 16, 1, 8, 8) if tiny else (1, 16, 1, 128, 128),
                           "text": (1, 8, _narrow_width("joint_attention_dim")) if tiny else (1, 256, 3584),
                           "what": "1024x1024 (latent 1x128x128), text 256 tokens of 3584"}),
    "qwen20": ("QwenImage", QWEN20, {"num_layers": 1},
               lambda tiny: {"latent": (1, 16, 1, 8, 8) if tiny else (1, 16, 1, 128, 128),
                             "text": (1, 8, _narrow_width("joint_attention_dim")) if tiny else (1, 256, 3584),
                             "what": "1024x1024 (latent 1x128x128), text 256 tokens of 3584; 20 of 60 blocks"}),
    "chroma": ("Chroma", CHROMA, {"context_in_dim": 64, "depth": 1, "depth_single_blocks": 1},
               lambda tiny: {"latent": (1, 16, 8, 8) if tiny else (1, 16, 128, 128),
                             "text": (1, 16, 64) if tiny else (1, 512, 4096),
                             "what": "1024x1024, T5 512 tokens"}),
    "flux2": ("Flux2", FLUX2, {"hidden_size": 256, "num_heads": 2, "context_in_dim": 64, "depth": 1,
                               "depth_single_blocks": 1},
              lambda tiny: {"latent": (1, 128, 4, 4) if tiny else (1, 128, 64, 64),
                            "text": (1, 16, 64) if tiny else (1, 512, 15360), "guidance": 4.0,
                            "what": "1024x1024 (latent 128x64x64), text 512 tokens of 15360; 8 + 16 blocks"}),
    "ideogram4": ("Ideogram4", None, {"layers": 1},
                  lambda tiny: {"latent": (1, 128, 4, 4) if tiny else (1, 128, 64, 64),
                                "text": (1, 8, _narrow_width("llm_features_dim")) if tiny else (1, 512, 53248),
                                "what": "1024x1024, text 512 tokens of 53248"}),
    "ideogram4_dual": ("Ideogram4", None, {"layers": 1},
                       lambda tiny: {"latent": (1, 128, 4, 4) if tiny else (1, 128, 64, 64),
                                     "text": (1, 8, _narrow_width("llm_features_dim")) if tiny else (1, 512, 53248),
                                     "what": "1024x1024, text 512 tokens of 53248; DualModelGuider cfg 4 (two "
                                             "backbones, seeds 0 and 1; negative unconnected)"}),
}
# models sampled with DualModelGuider (two backbones: "cond", "uncond"), as bench/e2e_sampler.py does Ideogram 4
DUAL = {"ideogram4_dual"}
BRANCHES = ("cond", "uncond")
# the cold suite's second resolution (issue 48): pixels (height x width) per kind of model; the main resolution
# is 1024x1024 for image models, 480x832 (33 frames) for video models
VIDEO = {"wan13", "wan14", "wan22"}
MAIN_PIXELS = {"image": (1024, 1024), "video": (480, 832)}
SECOND_RES_AUTO = "image=768,video=384x672"

# detection selects these models by their width, so --tiny keeps it
WIDTH_FIXED = {"zimage": 3840, "chroma": 3072}


# ComfyUI fixes these widths in a model config, which --tiny narrows in its process (``narrow_tiny``): Ideogram 4's
# and Qwen-Image's (bench/lib/e2e.py ``narrow``, ``narrow_qwen``)
def _narrow_width(name: str) -> int:
    from bench.lib import e2e  # imports torch: only when a --tiny run builds its inputs
    return {**e2e.NARROW, **e2e.QWEN_NARROW}[name]


def narrow_tiny(e2e) -> dict:
    """--tiny: ComfyUI's Ideogram 4 and Qwen-Image configs at narrow widths, in this process (ComfyUI imported)."""
    return {"ideogram4": e2e.narrow(), "qwen": e2e.narrow_qwen()}


# where the repeated blocks' linears live (core_int8 quantizes their 2-D weights)
BLOCKS = {"flux": ("double_blocks.", "single_blocks."), "zimage": ("layers.",), "wan13": ("blocks.",),
          "wan14": ("blocks.",), "wan22": ("blocks.",), "qwen": ("transformer_blocks.",),
          "qwen20": ("transformer_blocks.",), "chroma": ("double_blocks.", "single_blocks."),
          "flux2": ("double_blocks.", "single_blocks.")}

# issue 13: (min x bf16, min x fp8_fast, max s/step) for the pack's paths
TARGETS = {"flux": (1.5, 1.3, 0.115), "zimage": (1.5, 1.2, None), "wan13": (1.5, 1.2, None),
           "ideogram4": (1.0, None, None)}


def unet_config(name: str, tiny: bool) -> dict:
    cfg = dict(MODELS[name][1])
    if tiny:
        cfg.update(MODELS[name][2])
    return cfg


def second_res_of(spec: str, name: str) -> tuple[int, int] | None:
    """The second resolution (height, width in pixels) ``spec`` gives model ``name``: entries ``key=HxW`` or
    ``key=N`` (N x N), ``key`` a model name, ``image`` or ``video`` (the kind of model), or none (any model); the
    model's own entry first. None: no second resolution ("" / "none")."""
    entries: dict = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item or item == "none":
            continue
        key, _, val = item.rpartition("=")
        h, _, w = val.partition("x")
        entries[key or "*"] = (int(h), int(w or h))
    return entries.get(name) or entries.get("video" if name in VIDEO else "image") or entries.get("*")


def second_latent(name: str, latent: tuple, hw: tuple[int, int], tiny: bool) -> tuple:
    """The latent shape of ``name`` at ``hw`` pixels: the main latent's last two sides scaled by ``hw`` over the
    main resolution (MAIN_PIXELS); exact at full size (a side that does not divide is an error), rounded to even
    (at least 2) on a --tiny run, whose latents are not tied to the main resolution."""
    main = MAIN_PIXELS["video" if name in VIDEO else "image"]
    sides = []
    for side, want, have in zip(latent[-2:], hw, main):
        v = side * want / have
        if tiny:
            v = max(2, round(v / 2) * 2)
        elif v != int(v):
            raise ValueError(f"{name}: {hw[0]}x{hw[1]} is no whole latent (side {side} x {want} / {have})")
        sides.append(int(v))
    return (*latent[:-2], *sides)


def random_layout(name: str, cfg: dict) -> tuple[list, str]:
    """([(key, shape, bf16)] of every parameter of the ComfyUI model for ``cfg``, built on the meta device; the name
    of the supported_models class the config selects)."""
    import torch
    import comfy.model_detection
    mc = comfy.model_detection.model_config_from_unet_config(cfg)
    if mc is None:
        raise RuntimeError(f"{name}: ComfyUI matches no model to {cfg}")
    # With comfy-aimdo on (DynamicVRAM), ComfyUI's Linear defers its weight to load time and has no parameter to
    # list: build the layout with that switched off.
    import comfy.memory_management as mm
    aimdo, mm.aimdo_enabled = mm.aimdo_enabled, False
    try:
        dm = mc.get_model({}, device=torch.device("meta")).diffusion_model
    finally:
        mm.aimdo_enabled = aimdo
    # parameters only: buffers are built by the model, not loaded
    layout = [(k, tuple(p.shape), torch.bfloat16) for k, p in dm.named_parameters()]
    del dm
    if not layout:
        raise RuntimeError(f"{name}: the ComfyUI model built for {cfg} lists no parameters")
    return layout, type(mc).__name__


def random_tensors(layout: list, gen_device, seed: int = 0):
    """(key, seeded random bf16 tensor made on ``gen_device``, returned on the CPU) for each entry of ``layout``, in
    its order: linears N(0, 1/fan-in), Wan's modulation tables N(0, 1/dim), small biases, norms 1."""
    import torch
    g = torch.Generator(device=gen_device).manual_seed(seed)
    for k, shape, _ in layout:
        if "modulation" in k.rsplit(".", 1)[-1] and len(shape) == 3:  # Wan's modulation tables [1, n, dim]
            t = torch.randn(shape, generator=g, device=gen_device, dtype=torch.bfloat16) * shape[-1] ** -0.5
        elif len(shape) >= 2:
            t = torch.randn(shape, generator=g, device=gen_device, dtype=torch.bfloat16) * \
                (math.prod(shape[1:]) ** -0.5)
        elif k.endswith("bias"):
            t = 0.02 * torch.randn(shape, generator=g, device=gen_device, dtype=torch.bfloat16)
        else:  # norm weights / scales
            t = torch.ones(shape, device=gen_device, dtype=torch.bfloat16)
        yield k, t.to("cpu")


def random_state_dict(name: str, cfg: dict, gen_device, seed: int = 0) -> tuple[dict, str]:
    """Full key layout of the ComfyUI model for ``cfg`` with ``random_tensors``' values, on the CPU; and the name of
    the supported_models class the config selects."""
    layout, cls = random_layout(name, cfg)
    return dict(random_tensors(layout, gen_device, seed)), cls


class ModelsBench(SamplerBench):

    def __init__(self, a, dynamic: bool, e2e):
        # benches that build this class from their own arguments (bench/convrot.py) lack the cold suite's
        for name, default in (("second_res", None), ("second_process", False), ("no_second_process", False),
                              ("cold", False)):
            if not hasattr(a, name):
                setattr(a, name, default)
        super().__init__(a, dynamic, e2e)
        narrowed = narrow_tiny(e2e) if a.tiny else None
        self.ref = {}  # model -> bf16 final latent
        self._core_models: dict = {}  # (model, backbone or None) -> core int8 state dict
        self.doc_extra = {"note": NOTE, "steps": a.steps, "tiny": a.tiny, "narrowed": narrowed, "models": {},
                          "second_res": a.second_res or None, "second_process": a.second_process,
                          "pid": os.getpid(), "caches_at_start": getattr(a, "caches_at_start", None)}

    # ------------------------------------------------------------------ per model
    def make_sd(self, name: str) -> tuple[dict, str, dict | None]:
        """(state dict, ComfyUI class, unet_config or None); for a DualModelGuider model a dict of both backbones'
        state dicts ("cond" seed 0, "uncond" seed 1, as bench/e2e_sampler.py builds them)."""
        gen = self.dev if self.dev.type == "cuda" else self.torch.device("cpu")
        if getattr(self.a, "from_file", None):
            return self.model_files(name, gen)
        if name in ("ideogram4", *DUAL):
            layers = MODELS[name][2]["layers"] if self.a.tiny else self.a.ideogram_layers
            if name in DUAL:
                return {br: self.e2e.random_state_dict(layers, gen, seed=i) for i, br in enumerate(BRANCHES)}, \
                    "Ideogram4", None
            return self.e2e.random_state_dict(layers, gen, seed=0), "Ideogram4", None
        cfg = unet_config(name, self.a.tiny)
        sd, cls = random_state_dict(name, cfg, gen)
        return sd, cls, cfg

    def model_files(self, name: str, gen) -> tuple:
        """``make_sd`` with ``--from-file``: the model's safetensors file(s) in that folder (Paths where the state
        dicts were), written once with the same values the in-memory state dicts get (bench/lib/model_file.py)."""
        from bench.lib import model_file
        folder = Path(self.a.from_file)
        tag = "tiny" if self.a.tiny else "full"

        def ensure(path: Path, layout, tensors) -> Path:
            if not path.exists():
                t0 = time.perf_counter()
                size = model_file.write(path, layout, tensors)
                log(f"{name}: wrote {path} ({size / 2 ** 30:.2f} GiB) in {time.perf_counter() - t0:.1f} s")
            return path
        if name in ("ideogram4", *DUAL):
            layers = MODELS[name][2]["layers"] if self.a.tiny else self.a.ideogram_layers
            files = {br: ensure(folder / f"ideogram4-{tag}-{layers}l-seed{i}.safetensors",
                                self.e2e.random_layout(layers), self.e2e.random_tensors(layers, gen, seed=i))
                     for i, br in enumerate(BRANCHES)}
            return (files if name in DUAL else files["cond"]), "Ideogram4", None
        cfg = unet_config(name, self.a.tiny)
        layout, cls = random_layout(name, cfg)
        return ensure(folder / f"{name}-{tag}-seed0.safetensors", layout, random_tensors(layout, gen, 0)), cls, cfg

    def smoke_path(self, name: str, path: str) -> str | None:
        """On a CPU --tiny run, on a model that keeps its full width: fused_triton (Triton interpreter) runs as the
        pack's torch_int_mm instead (same Apply node and quantization, torch kernels) and fp8_fast is skipped
        (None). Elsewhere ``path`` as given."""
        if not (self.a.tiny and self.dev.type == "cpu" and name in WIDTH_FIXED):
            return path
        if path.startswith("pack:fused_triton"):
            return "pack:torch_int_mm" + path[len("pack:fused_triton"):]
        return None if path.startswith("fp8_fast") else path

    def check_detection(self, name: str, m, cls: str, cfg: dict | None) -> dict:
        """Loading the state dict must have found the same model class (and, where we built it, the same
        config): the UNETLoader path recognises the random checkpoint as the real one."""
        mc = m.model.model_config
        got = type(mc).__name__
        if got != cls:
            raise AssertionError(f"{name}: ComfyUI detected {got}, expected {cls}")
        for k, v in (cfg or {}).items():
            d = mc.unet_config.get(k)
            if (list(d) if isinstance(d, (tuple, list)) else d) != (list(v) if isinstance(v, (tuple, list)) else v):
                raise AssertionError(f"{name}: detected {k}={d!r}, built with {v!r}")
        # what ComfyUI chose (UNETLoader default): Wan 2.1 lists fp16 first, so its "bf16" path computes in fp16
        # on a GPU that runs fp16 (--comfy-flag=--bf16-unet makes it bf16)
        return {"model_class": got, "dtype": str(m.model.get_dtype()).replace("torch.", ""),
                "compute_dtype": str(m.model.get_dtype_inference()).replace("torch.", "")}

    def conds(self, name: str, latent_shape: tuple | None = None):
        """(text, extra conditioning, latent, noise, spec) of ``name`` (its latent ``latent_shape`` where given: the
        second resolution); sets ``denoise_mask``: None, or for a ``first_frame`` model (Wan 2.2 5B image to video)
        a random start-image latent in frame 0 and the mask Wan22ImageToVideoLatent makes (0 on that frame, 1
        elsewhere)."""
        torch = self.torch
        spec = dict(MODELS[name][3](self.a.tiny))
        if latent_shape is not None:
            spec["latent"] = tuple(latent_shape)
        g = torch.Generator().manual_seed(7)
        ctx = torch.randn(spec["text"], generator=g).to(torch.bfloat16)
        extra = {}
        if "pooled" in spec:
            extra["pooled_output"] = torch.randn(spec["pooled"], generator=g).to(torch.bfloat16)
        if "guidance" in spec:
            extra["guidance"] = spec["guidance"]
        latent = torch.zeros(spec["latent"])
        self.denoise_mask = None
        if spec.get("first_frame"):
            latent[:, :, :1] = torch.randn(latent[:, :, :1].shape, generator=g)
            self.denoise_mask = torch.ones((latent.shape[0], 1, *latent.shape[2:]))
            self.denoise_mask[:, :, :1] = 0.0
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(3))
        return ctx, extra, latent, noise, spec

    def core_sd_for(self, name: str, sd: dict, branch: str | None = None) -> dict:
        """ComfyUI core's ``int8_tensorwise`` state dict of ``name`` (of its ``branch`` backbone for a DualModelGuider
        model; per-channel scales, made on the device, kept on the CPU): Ideogram 4's block linears
        (bench/lib/e2e.py), elsewhere every 2-D weight of the blocks."""
        key = (name, branch)
        if key not in self._core_models and isinstance(sd, Path):  # --from-file: the core file beside the float one
            from bench.lib import model_file
            dst = sd.with_name(sd.name.replace(".safetensors", ".core-int8.safetensors"))
            if not dst.exists():
                pick = ((lambda p, shape: any(p.endswith(n) for n in self.e2e.BLOCK_LINEARS))
                        if name in ("ideogram4", *DUAL) else (lambda p, shape: p.startswith(BLOCKS[name])))
                model_file.core_int8(sd, dst, pick, self.dev)
            self._core_models[key] = dst
        if key not in self._core_models:
            if name in ("ideogram4", *DUAL):
                self._core_models[key] = self.e2e.core_int8_state_dict(sd, self.dev)
            else:
                self._core_models[key] = self.e2e.core_int8_state_dict(
                    sd, self.dev, lambda p, w, blocks=BLOCKS[name]: w.dim() == 2 and p.startswith(blocks))
        return self._core_models[key]

    def run_model(self, name: str):
        t0 = time.perf_counter()
        try:
            sd, cls, cfg = self.make_sd(name)
        except Exception as e:
            row = {"model": name}
            self.row_failed(row, e, "state dict: ")
            self.finish_row(row)
            return
        from bench.lib import model_file
        n_params = sum(model_file.params(d) if isinstance(d, Path) else sum(v.numel() for v in d.values())
                       for d in (sd.values() if name in DUAL else [sd]))
        ctx, extra, latent, noise, spec = self.conds(name)
        self.doc_extra["models"][name] = {"comfy_class": cls, "unet_config": cfg, "params": n_params,
                                          "inputs": spec["what"] if not self.a.tiny else "tiny",
                                          "latent": list(latent.shape), "text": list(ctx.shape),
                                          "denoise_mask": None if self.denoise_mask is None else
                                          "start frame kept (0 on latent frame 0, 1 elsewhere)"}
        log(f"{name}: {cls}, {n_params / 1e9:.3f} B params, state dict in {time.perf_counter() - t0:.1f} s; "
            f"latent {list(latent.shape)}, text {list(ctx.shape)}")
        paths = self.a.paths.split(",")
        if self.a.child and all(p.split("~")[0] == "core_int8" for p in paths):
            # a core INT8 user loads the int8 file alone: no bf16 copy in RAM
            if name in DUAL:
                for br in BRANCHES:
                    self.core_sd_for(name, sd[br], br)
                sd = dict.fromkeys(BRANCHES)
            else:
                self.core_sd_for(name, sd)
                sd = None
        for req in paths:
            self.run_row(name, req, sd, cls, cfg, ctx, extra, latent, noise, drop_sd=self.a.child and len(paths) == 1)
        del sd
        self._core_models = {k: v for k, v in self._core_models.items() if k[0] != name}
        self.ref.pop(name, None)
        self.cleanup()

    def run_row(self, name, req, sd, cls, cfg, ctx, extra, latent, noise, drop_sd=False):
        """One (model, path) row: build, first sample, time, whole samples, compare with bf16;
        errors recorded (``status`` "oom" / "error"). ``drop_sd``: the bench lets go of its state dict once the
        model is loaded (a process of one path: its host RAM is then what a user's ComfyUI holds)."""
        torch = self.torch
        path = self.smoke_path(name, req)
        if path is None:
            why = (f"CPU smoke run: {req} skipped on {name} (full width {WIDTH_FIXED[name]}: ~40 s of fp8 "
                   f"casts on the CPU; the path is exercised on flux and wan13)")
            log(why)
            self.rows.append({"model": name, "path": req, "status": "skipped", "skipped": why})
            return
        row = {"model": name, "path": path, "params": self.doc_extra["models"][name]["params"], "pid": os.getpid(),
               "guider": self.guider_name(name)}
        if self.opt("multigpu", 1) > 1:
            row["multigpu"] = self.opt("multigpu", 1)
        if self.a.second_process:
            row["second_process_row"] = True
        if path != req:
            row["requested_path"] = req
            log(f"{name}: CPU smoke run: {req} -> {path} (the Triton interpreter is too slow at width "
                f"{WIDTH_FIXED[name]}, which ComfyUI's detection fixes; the fused path is exercised on flux/wan13)")
        self.rss_mark()
        t1 = time.perf_counter()
        m = g = ms = None
        first_steps = self.a.steps if self.dev.type == "cuda" else 1
        try:
            log(f"{name}: building {path}")
            if name in DUAL:
                ms = [self.load_path(path, sd[br], core_sd=lambda br=br: self.core_sd_for(name, sd[br], br),
                                     label=f"{name} {path} {br}") for br in BRANCHES]
            else:
                ms = [self.load_path(path, sd, core_sd=lambda: self.core_sd_for(name, sd), label=f"{name} {path}")]
            m = ms[0]
            if drop_sd:
                for d in (*(sd.values() if name in DUAL else [sd]), *self._core_models.values()):
                    if isinstance(d, dict):  # (--from-file: Paths, nothing held)
                        d.clear()
            for x in ms:
                row.update(self.check_detection(name, x, cls, cfg))
            if self.opt("multigpu", 1) > 1:  # MultiGPU CFG Split after everything else, as its help says
                import comfy.multigpu
                n_gpus = self.opt("multigpu", 1)
                ms = [comfy.multigpu.create_multigpu_deepclones(x, n_gpus, reuse_loaded=True) for x in ms]
                m = ms[0]
                row["multigpu_devices"] = [str(x.load_device) for x in
                                           [m, *m.get_additional_models_with_key("multigpu")]]
            row["patcher"] = type(m).__name__
            row["build_s"] = time.perf_counter() - t1
            g = self.guider_for(name, ms, ctx, extra)
            if self.a.second_process:
                # the cold suite's second process: its first sample on the first process's caches, nothing else
                self.first_sample(row, (name, path), g, m, latent, noise, first_steps)
                row["status"] = "ok"
            else:
                # first sample: autotune, compiles, DynamicVRAM faults (a CPU smoke run: one step runs the code
                # path); the bf16 output (with any attention) is the model's reference
                self.sample_row(row, (name, path), g, m, latent, noise, first_steps, name,
                                sets_ref=path.split("~")[0] == "bf16")
                self.second_res_row(row, name, g, m, latent, first_steps)
        except Exception as e:
            self.row_failed(row, e)
        if "first_sample_s" in row:
            row["warmup_s"] = row["first_sample_s"]
        row["total_s"] = time.perf_counter() - t1
        self.finish_row(row)
        m = g = ms = None  # the guider holds the patchers too: drop them all before unloading
        self.cleanup()

    def guider_for(self, name: str, ms: list, ctx, extra: dict):
        """The sampling guider: CFGGuider cfg 1.0 (ComfyUI skips the unconditional pass), or for a DualModelGuider
        model Ideogram 4's workflow (bench/e2e_sampler.py's ``guider``: both backbones, cfg 4, negative
        unconnected)."""
        torch = self.torch
        if name in DUAL:
            if self.opt("negative_device"):  # the pack's two-device guider (nodes/dual_gpu.py)
                import importlib
                dual = importlib.import_module(self.pack.__name__ + ".nodes.dual_gpu")
                g = dual.guider_class()(ms[0], ms[1], torch.device(self.opt("negative_device")))
            else:
                import comfy_extras.nodes_custom_sampler as ncs
                g = ncs.Guider_DualModel(ms[0], ms[1])
            g.set_conds([[ctx, dict(extra)]], [[None, {}]])
            g.set_cfg(4.0)
            return g
        import comfy.samplers
        g = comfy.samplers.CFGGuider(ms[0])
        g.set_conds([[ctx, dict(extra)]], [[torch.zeros_like(ctx), dict(extra)]])
        g.set_cfg(self.opt("cfg", 1.0))
        return g

    def opt(self, name: str, default=None):
        """An option of this bench's command line that a bench built on this one (bench/convrot.py) may not have."""
        return getattr(self.a, name, default)

    def guider_name(self, name: str) -> str:
        neg, cfg = self.opt("negative_device"), self.opt("cfg", 1.0)
        if name in DUAL:
            return "DualModelGuider cfg 4" + (f", negative on {neg}" if neg else "")
        return f"CFGGuider cfg {cfg:g}"

    def second_res_row(self, row: dict, name: str, g, m, latent, first_steps: int) -> None:
        """The cold suite's new resolution, the process warm (after the row's warm samples): the first sample at
        ``--second-res`` (synced: ``second_res_first_s``), then two whole samples there (the best one's seconds:
        ``second_res_warm_s``; and its s/step). Nothing where no second resolution is set for ``name``."""
        hw = second_res_of(self.a.second_res, name)
        if hw is None:
            return
        shape = second_latent(name, tuple(latent.shape), hw, self.a.tiny)
        mask0 = self.denoise_mask
        try:
            _, _, lat2, noise2, _ = self.conds(name, shape)
            row.update(second_res="tiny" if self.a.tiny else f"{hw[0]}x{hw[1]}", second_res_latent=list(shape))
            _, row["second_res_first_s"] = self.synced(lambda: self.sample(g, m, lat2, noise2, first_steps))
            row.update({f"second_res_{k}": v for k, v in self.settle_background().items()})
            w = self.whole(g, m, lat2, noise2)
            row.update(second_res_warm_s=w["s_per_step_whole"] * self.a.steps,
                       second_res_s_per_step_whole=w["s_per_step_whole"],
                       second_res_whole_sample_s=w["whole_sample_s"])
        finally:
            self.denoise_mask = mask0

    def run(self) -> int:
        log(f"DynamicVRAM {'on' if self.dynamic else 'off'}; {NOTE}")
        t0 = time.perf_counter()
        for name in self.a.models.split(","):
            if name not in MODELS:
                self.rows.append({"model": name, "status": "error",
                                  "error": f"unknown model (have {', '.join(MODELS)})"})
                continue
            self.run_model(name)
        if self.dev.type == "cuda" and not self.a.child:  # a CPU smoke run makes no timing claims
            self.rows.extend(targets(self.rows))
        self.doc_extra["wall_s"] = time.perf_counter() - t0
        self.write()
        if self.a.child and self.a.cold:  # the next process given these cache folders can tell it got them
            from bench.lib.e2e_runs import leave_marker
            leave_marker()
        if not self.a.child:  # an isolated run's parent prints the summary of all its children
            table(self.rows)
        log(f"wrote {self.a.out} ({time.perf_counter() - t0:.0f} s)")
        return 0


# ----------------------------------------------------------------------------- summary (also of isolated runs)
KEYS = ("model", "vram_gib", "cold")  # rows compared with one another: same model, card size, caches


def targets(rows: list[dict], keys: tuple = KEYS) -> list[dict]:
    """Issue 13's targets for each pack row on the headline figure (whole sample, else median step): x bf16,
    x fp8_fast, s/step (None: no target); and issue 36's for rows at a --vram-gib size (e2e_runs.vram_targets)."""
    from bench.lib.e2e_runs import headline, speedups, vram_targets
    out = []
    for i, r in enumerate(rows):
        if not r.get("path", "").startswith("pack:") or headline(r) is None or "check" in r:
            continue
        xb, xf = speedups(rows, r, keys)
        if r.get("model") in TARGETS and r.get("vram_gib") is None:
            min_bf, min_fp8, max_s = TARGETS[r["model"]]
            checks = {}
            if min_bf is not None and xb is not None:
                checks[f"x_bf16>={min_bf}"] = xb >= min_bf
            if min_fp8 is not None and xf is not None:
                checks[f"x_fp8_fast>={min_fp8}"] = xf >= min_fp8
            if max_s is not None:
                checks[f"s_per_step<={max_s}"] = headline(r) <= max_s
            out.append({"check": "issue13", "model": r["model"], "path": r["path"], "row": i, "x_bf16": xb,
                        "x_fp8_fast": xf, "basis": "s_per_step_whole" if r.get("s_per_step_whole") else "s_per_step",
                        "checks": checks, "pass": all(checks.values()) if checks else None})
    out.extend(vram_targets(rows, keys))
    return out


def table(rows: list[dict]) -> None:
    """The summary (e2e_runs.summary: the whole-sample s/step first), then the target checks."""
    from bench.lib.e2e_runs import cold_summary, print_checks, summary
    summary(rows, ("model", "path"), KEYS, NOTE)
    cold_summary(rows, ("model", "path"))
    print_checks(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="flux,zimage,wan13,ideogram4")
    ap.add_argument("--paths", default="bf16,fp8_fast,pack:fused_triton")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ideogram-layers", type=int, default=34)
    ap.add_argument("--tiny", action="store_true", help="shrunken models (smoke runs)")
    ap.add_argument("--second-res", default=None,
                    help=f"the cold suite's second resolution, after the warm samples: 'key=HxW' or 'key=N' entries, "
                         f"key a model, 'image' or 'video'; default with --cold {SECOND_RES_AUTO!r}, else none; "
                         f"'none' skips it")
    ap.add_argument("--no-second-process", action="store_true",
                    help="--cold without the second process on the first's warm caches")
    ap.add_argument("--second-process", action="store_true", help=argparse.SUPPRESS)  # that second process
    add_run_args(ap)
    ap.add_argument("--from-file", default=None, metavar="DIR",
                    help="write each model's random weights once to a safetensors file in DIR (one tensor at a time; "
                         "the core INT8 file beside it for core_int8 paths; kept for later runs) and load every path "
                         "from it as UNETLoader does (comfy.sd.load_diffusion_model): host RAM as a user's ComfyUI "
                         "has it, no state dict in the bench's memory")
    ap.add_argument("--cfg", type=float, default=1.0,
                    help="CFGGuider's cfg for the one-backbone models (default 1.0: ComfyUI skips the unconditional "
                         "pass; > 1: two forwards a step, a zero negative conditioning)")
    ap.add_argument("--multigpu", type=int, default=1, metavar="N",
                    help="N > 1: every path's MODEL through ComfyUI's MultiGPU CFG Split (max_gpus N) before sampling")
    ap.add_argument("--negative-device", default=None, metavar="DEV",
                    help="DualModelGuider models: the unconditional backbone on DEV (e.g. cuda:1) through the "
                         "pack's Dual Model Guider (two GPUs), both backbones at once")
    ap.add_argument("--out", default=str(HERE / "results" / "h200-e2e-models.json"))
    a = ap.parse_args()
    a.second_res = (SECOND_RES_AUTO if a.cold else "") if a.second_res is None else \
        ("" if a.second_res == "none" else a.second_res)
    if not has_comfy(a):
        return 2
    if isolated(a):  # before torch is imported: each child starts with its own caches / free memory
        from bench.lib import e2e_runs
        units = [{"models": m, "paths": p} for m in a.models.split(",") for p in a.paths.split(",")]
        return e2e_runs.run_isolated(
            Path(__file__), sys.argv[1:], units, a.out, a.cold, a.vram_gib, a.device, a.child_timeout, table=table,
            finish=None if a.device == "cpu" else
            lambda rows, doc: targets(rows) + e2e_runs.cold_targets(rows, doc.get("gpu"), KEYS),
            second=a.cold and not a.no_second_process)
    if a.child:  # before torch: what the cache folders this process was given hold (empty on a cold start)
        from bench.lib import e2e_runs
        a.caches_at_start = e2e_runs.cache_listing()
    dynamic = start(a)
    if dynamic is None:
        return 2
    from bench.lib import e2e
    return ModelsBench(a, dynamic, e2e).run()


if __name__ == "__main__":
    sys.exit(main())
