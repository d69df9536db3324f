"""LoRA loaded AFTER "Apply Fused INT8 GEMM" on the pinned ComfyUI (in-process, CPU): the fused Qwen-Image blocks
(stacked q/k/v) run it, and Save INT8 Model merges it into the file.

* Qwen-Image (tiny, fp32, both blocks fused): a LoRA on to_q, add_v_proj (rows of the stacked q/k/v GEMMs), to_k and
  an MLP layer. A block with a branch runs ComfyUI's own forward with q/k/v as row views of the stacked layer, each
  view carrying its rows of the branch. References and bounds as tests/test_lora_runtime.py derives them (R runtime,
  H per-linear INT8 + float64 hooks, F float with the LoRA, F0 without, M merged then quantized).
* Save INT8 Model on the LoRA clone of an Apply'd tiny Flux: each targeted layer is written as its dequantized
  weight plus the LoRA, quantized again per output channel. Independent reference: W64 = q * scale + s B A in
  float64. The saved weight rounds ComfyUI's fp32 merge (``calculate_weight``: per element at most (r + 4) 2^-24
  (|W| + |s| |B| |A|), the dequantization's rounding included) to the nearest step of its row, so
  |q' scale' - W64| <= scale' / 2 plus that, plus the quantizer's fp32 scale rounding (2^-20 of the row's max);
  scale' = max|row of the merged weight| / 127 within that rounding. Other layers are written bit for bit as
  Apply quantized them, and the model's own int8 weights are not changed.
"""
import pytest
import torch

import test_lora_runtime as tlr
from test_lora_runtime_current import _compare
from test_qwen_image_fused import CONFIG, tiny_qwen

QWEN_TARGETS = ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_v_proj",
                "transformer_blocks.1.attn.to_k", "transformer_blocks.1.img_mlp.net.0.proj")


@pytest.fixture(scope="module")
def env(comfy_inprocess, pack, tmp_path_factory):
    import folder_paths
    d = tmp_path_factory.mktemp("loras")
    folder_paths.add_model_folder_path("loras", str(d))
    return pack, d


def _qwen_patcher():
    import comfy.model_detection
    import comfy.model_patcher
    dm = tiny_qwen(torch.float32)
    sd = dm.state_dict()
    mc = comfy.model_detection.model_config_from_unet_config({"image_model": "qwen_image", **CONFIG}, sd)
    mc.set_inference_dtype(torch.float32, None)
    cpu = torch.device("cpu")
    model = mc.get_model(sd, "", device=cpu)
    model.diffusion_model.load_state_dict(sd, strict=True)
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def test_qwen_image_fused_blocks_run_a_lora_on_stacked_qkv(env):
    import comfy.sample
    pack, folder = env
    mp = _qwen_patcher()
    sd = tlr._lora_file(folder, mp, "qwen.safetensors", QWEN_TARGETS, seed=11)
    g = torch.Generator().manual_seed(1)
    pos = [[torch.randn(1, 6, 48, generator=g), {}]]
    noise, latent = torch.randn(1, 16, 1, 8, 8, generator=g), torch.zeros(1, 16, 1, 8, 8)

    def run(m):
        return comfy.sample.sample(m, noise, 1, 1.0, "euler", "simple", pos, pos, latent, seed=0,
                                   disable_pbar=True).float()

    q, r = _compare(pack, mp, "qwen.safetensors", sd, QWEN_TARGETS, run)
    print(r)
    blocks = {k: type(v).__name__ for k, v in q.object_patches.items() if k.count(".") == 2}
    assert blocks == {f"diffusion_model.transformer_blocks.{i}": "FusedQwenImageBlock" for i in range(2)}, blocks
    assert r["F-F0"] >= 5 * r["H-F"], r
    assert r["R-H"] <= 0.1 * r["H-F"], r
    assert r["R-F"] <= 2 * r["M-F"], r


def test_save_merges_a_lora_loaded_after_apply(env, tiny_model):
    import nodes
    pack, folder = env
    mp = tiny_model("flux")
    sd = tlr._lora_file(folder, mp, "save.safetensors", tlr.TARGETS, rank=4, seed=6)
    q = pack.nodes.apply.ApplyFusedInt8GEMM().apply(mp, "fused_triton")[0]
    layers = pack.nodes.weights.int8_layers(q)
    before = {n: (m.qweight.clone(), m.weight_scale.clone()) for n, m in layers.items()}
    late = nodes.LoraLoaderModelOnly().load_lora_model_only(q, "save.safetensors", 0.8)[0]
    quant, _, _ = pack.nodes.save.collect(late, "int8_fused")
    assert set(tlr.TARGETS) <= set(quant) and set(layers) <= set(quant)
    for name, m in layers.items():
        assert torch.equal(m.qweight, before[name][0]) and torch.equal(m.weight_scale, before[name][1]), name
        got = quant[name]
        if name not in tlr.TARGETS:
            assert torch.equal(got["qweight"], before[name][0]) and torch.equal(got["weight_scale"], before[name][1])
            continue
        p = tlr.PREFIX + name
        down, up = sd[f"{p}.lora_down.weight"].double(), sd[f"{p}.lora_up.weight"].double()
        s = 0.8 * float(sd[f"{p}.alpha"]) / down.shape[0]
        w = before[name][0].double() * before[name][1].double()[:, None]
        w64 = w + s * up @ down
        mag = w.abs() + abs(s) * up.abs() @ down.abs()
        rowmax = w64.abs().amax(1, keepdim=True)
        scale = got["weight_scale"].double()[:, None]
        assert got["smooth"] is None and torch.equal(got["bias"], m.bias.float())
        assert ((scale - rowmax / 127).abs() <= 2.0 ** -20 * rowmax + (down.shape[0] + 4) * 2.0 ** -24 * mag.amax(
            1, keepdim=True) / 127).all(), name
        err = (got["qweight"].double() * scale - w64).abs()
        assert (err <= scale / 2 + (down.shape[0] + 4) * 2.0 ** -24 * mag + 2.0 ** -20 * rowmax).all(), name
        assert (err.max() < (w - w64).abs().max()), name  # the LoRA is in the file, not dropped
