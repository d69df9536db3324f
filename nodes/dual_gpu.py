"""Node "Dual Model Guider (two GPUs)": ComfyUI's DualModelGuider with the unconditional backbone on a second device,
run at the same time as the conditional one (issue 51 item 2).

Ideogram 4's CFG runs two separate-weight backbones a step. ComfyUI's ``Guider_DualModel`` runs them one after the
other on one GPU (its own TODO says so). ``Guider_DualModelTwoDevices`` is that guider with three changes: the
unconditional MODEL is a clone loaded on ``uncond_device``; its conditioning is prepared on that device; each step
submits the unconditional call to a worker thread of that device (``comfy.multigpu.MultiGPUThreadPool``, the pool
MultiGPU CFG Split uses) before the conditional call runs here, then brings its output back and combines the two
with ComfyUI's ``cfg_function`` as ``Guider_DualModel`` does. The same calls with the same inputs on the same kernels:
the same output bits as the one-GPU guider (tests/test_dual_gpu_current.py, with the CPU standing in for both
devices). At cfg 1, without a negative model, or with one device, it is ``Guider_DualModel`` unchanged.
"""
from __future__ import annotations

import logging
import math

import torch

from .common import CATEGORY

log = logging.getLogger("int8_fused")
SAME = "same as model"


def guider_class():
    """``Guider_DualModelTwoDevices`` (module doc), built on this ComfyUI's ``Guider_DualModel``."""
    import comfy.multigpu
    import comfy.samplers
    try:
        from comfy_extras.nodes_custom_sampler import Guider_DualModel
    except ImportError as e:
        raise RuntimeError("Dual Model Guider (two GPUs) needs a ComfyUI with DualModelGuider (0.33.0 or newer); "
                           "update ComfyUI") from e

    class Guider_DualModelTwoDevices(Guider_DualModel):
        """``concurrent``: run the unconditional call in the device's worker thread (default: when
        ``uncond_device`` is another device than the model's; tests set it with the CPU standing in for both)."""

        def __init__(self, model_patcher, uncond_model_patcher, uncond_device: torch.device | None,
                     concurrent: bool | None = None):
            other = uncond_device is not None and uncond_device != model_patcher.load_device
            if other:
                uncond_model_patcher = uncond_model_patcher.clone()
                uncond_model_patcher.load_device = uncond_device
                if hasattr(uncond_model_patcher, "register_load_device"):  # DynamicVRAM's per-device bookkeeping
                    uncond_model_patcher.register_load_device(uncond_device)
            super().__init__(model_patcher, uncond_model_patcher)
            self.concurrent = other if concurrent is None else concurrent
            self.uncond_device = uncond_device if self.concurrent else None
            self._pool = None

        def outer_sample(self, noise, latent_image, sampler, sigmas, denoise_mask=None, callback=None,
                         disable_pbar=False, seed=None, latent_shapes=None):
            if self.uncond_device is not None and not math.isclose(self.cfg, 1.0):
                self._pool = comfy.multigpu.MultiGPUThreadPool([self.uncond_device])
            try:
                return super().outer_sample(noise, latent_image, sampler, sigmas, denoise_mask, callback,
                                            disable_pbar, seed, latent_shapes=latent_shapes)
            finally:
                if self._pool is not None:
                    self._pool.shutdown()
                    self._pool = None

        def inner_sample(self, noise, latent_image, device, sampler, sigmas, denoise_mask, callback, disable_pbar,
                         seed, latent_shapes=None):
            if self.uncond_inner is None or self._pool is None:
                return super().inner_sample(noise, latent_image, device, sampler, sigmas, denoise_mask, callback,
                                            disable_pbar, seed, latent_shapes=latent_shapes)
            # Guider_DualModel's preparation of the negative conditioning, on the unconditional model's device
            d = self.uncond_device
            li = latent_image
            if li is not None and torch.count_nonzero(li) > 0:
                li = self.uncond_inner.process_latent_in(li)
            self._uncond_conds = comfy.samplers.process_conds(
                self.uncond_inner, noise.to(d), {"negative": self._uncond_neg}, d,
                None if li is None else li.to(d), None if denoise_mask is None else denoise_mask.to(d), seed,
                latent_shapes=latent_shapes)["negative"]
            return comfy.samplers.CFGGuider.inner_sample(self, noise, latent_image, device, sampler, sigmas,
                                                         denoise_mask, callback, disable_pbar, seed,
                                                         latent_shapes=latent_shapes)

        def predict_noise(self, x, timestep, model_options={}, seed=None):  # noqa: B006 (ComfyUI's signature)
            if self._pool is None or self.uncond_inner is None or (
                    math.isclose(self.cfg, 1.0) and not model_options.get("disable_cfg1_optimization", False)):
                return super().predict_noise(x, timestep, model_options, seed)
            d = self.uncond_device
            positive = self.conds.get("positive", None)
            options = {k: v for k, v in model_options.items() if k not in ("multigpu_clones", "multigpu_thread_pool")}
            self._pool.submit(d, comfy.samplers.calc_cond_batch, self.uncond_inner, [self._uncond_conds], x.to(d),
                              timestep.to(d), options)
            try:
                cond = comfy.samplers.calc_cond_batch(self.inner_model, [positive], x, timestep, model_options)[0]
            finally:
                result, error = self._pool.get_result(d)  # always collected: the worker is free for the next step
            if error is not None:
                raise error
            uncond = result[0].to(x.device)
            return comfy.samplers.cfg_function(self.inner_model, cond, uncond, self.cfg, x, timestep,
                                               model_options=model_options, cond=positive, uncond=self._uncond_conds)

    return Guider_DualModelTwoDevices


def device_choices() -> list[str]:
    import comfy.model_management as mm
    return [SAME] + [str(d) for d in mm.get_all_torch_devices()]


class DualModelGuiderTwoGPUs:
    """DualModelGuider with model_negative on a second GPU, both backbones running at once."""

    @classmethod
    def INPUT_TYPES(cls):
        devices = device_choices()
        return {"required": {
            "model": ("MODEL", {"tooltip": "The conditional backbone (runs on its own device, as loaded)."}),
            "model_negative": ("MODEL", {"tooltip": "The unconditional backbone (Ideogram 4: the second MODEL of Load "
                                                    "Ideogram 4.0 INT8)."}),
            "positive": ("CONDITIONING",),
            "cfg": ("FLOAT", {"default": 4.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01}),
            "negative_device": (devices, {
                "default": devices[2] if len(devices) > 2 else SAME,
                "tooltip": "Where model_negative runs: a second GPU runs it at the same time as model (the same "
                           "output as DualModelGuider on one GPU). 'same as model': DualModelGuider unchanged."}),
        }, "optional": {
            "negative": ("CONDITIONING", {"tooltip": "Negative conditioning; unconnected: the unconditional backbone "
                                                     "runs image tokens only (Ideogram 4's CFG)."}),
        }}

    RETURN_TYPES = ("GUIDER",)
    FUNCTION = "get_guider"
    CATEGORY = CATEGORY
    DESCRIPTION = ("DualModelGuider (two backbones, CFG) with the negative model on a second GPU: both backbones run "
                   "at once, the output is the one-GPU guider's.")

    def get_guider(self, model, model_negative, positive, cfg, negative_device=SAME, negative=None):
        import comfy.model_management as mm
        dev = None
        if negative_device != SAME:
            dev = torch.device(negative_device)
            if dev not in mm.get_all_torch_devices():
                raise ValueError(f"Dual Model Guider (two GPUs): device {negative_device!r} is not one of this "
                                 f"machine's ({', '.join(device_choices()[1:])}); choose another or '{SAME}'")
            if dev == model.load_device:
                log.info("Dual Model Guider (two GPUs): %s is the model's own device: the backbones run one after "
                         "the other, as DualModelGuider runs them", dev)
        guider = guider_class()(model, model_negative, dev)
        guider.set_conds(positive, negative if negative is not None else [[None, {}]])
        guider.set_cfg(cfg)
        return (guider,)


NODE_CLASS_MAPPINGS = {"DualModelGuiderTwoGPUs": DualModelGuiderTwoGPUs}
NODE_DISPLAY_NAME_MAPPINGS = {"DualModelGuiderTwoGPUs": "Dual Model Guider (two GPUs)"}
