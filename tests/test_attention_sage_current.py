"""A ComfyUI started with ``--use-sage-attention`` keeps SageAttention through Apply (issue 50), on ComfyUI 0.33.0
(skipped naming COMFYUI_CURRENT without it), on the CPU.

SageAttention is a CUDA library; here a stand-in ``sageattention`` package (written into the test's folder and put on
the subprocess's path) gives ComfyUI's ``attention_sage`` its ``sageattn``: it records each call and computes exact
SDPA in the layout asked for. ComfyUI's flag is set as ``main.py --use-sage-attention`` sets it, before comfy is
imported, so ComfyUI's own module selection makes ``attention_sage`` the function every attention call runs.

Checked through the Apply node on a tiny Flux.1 (2 double + 2 single blocks):
* Apply's ``attention`` choices list ``sage`` (the package imports) and resolve it to ComfyUI's registered function;
* ``auto`` (the default) keeps the user's SageAttention: every attention call of a model call reaches the stand-in,
  the Router counts them under ``sage``, and the output equals ComfyUI's own (no Apply) bit for bit;
* ``math`` replaces it (the stand-in is not called) with the same output within fp32 rounding;
* ``sage`` on the CPU runs the calls on an exact backend (SageAttention runs on CUDA only), as its tooltip says;
* ``auto`` timing as on a GPU (the Router told to probe on the CPU, a fake clock, ``INT8_FUSED_TUNE=first_call``):
  SageAttention is timed with the exact backends and kept when flash is within 5 % of it, replaced by flash when flash
  is twice as fast.
"""
import json
import os
import textwrap

STAND_IN = '''
import torch

CALLS = []


def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True, **kwargs):
    """Records the call; exact SDPA in ``tensor_layout`` (HND: [B, H, L, D]; NHD: [B, L, H, D])."""
    CALLS.append((tuple(q.shape), tensor_layout))
    if tensor_layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=sm_scale)
    return out.transpose(1, 2) if tensor_layout == "NHD" else out
'''

SCRIPT = '''
import json
import torch
import comfy.ldm.modules.attention as A
import comfy.model_management
import sageattention
import comfy_harness

res = {"selected": A.optimized_attention.__name__}
pack = import_pack()
node = pack.nodes.apply.ApplyFusedInt8GEMM()
res["choices"] = node.INPUT_TYPES()["optional"]["attention"][0]
res["sage_fn_is_comfys"] = pack.nodes.attention.sage_function() is A.attention_sage
import comfy.model_detection, comfy.model_patcher
mini = comfy_harness.miniature()
sd = mini.tiny_state_dict("flux", 0, torch.float32)
# scripts/miniature.py's tiny Flux config; 0.33.0's Flux also takes txt_ids_dims (Flux.1: none) and names QKNorm's
# parameter weight (0.3.75: scale)
mc = comfy.model_detection.model_config_from_unet_config(dict(mini.TINY_UNET_CONFIG["flux"], txt_ids_dims=[]), sd)
mc.set_inference_dtype(torch.float32, None)
model = mc.get_model(sd, "", device=torch.device("cpu"))
sd = {(k[:-len("scale")] + "weight" if k.endswith("_norm.scale") else k): v for k, v in sd.items()}
model.diffusion_model.load_state_dict(sd, strict=True)
m = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def run(mp, seed=1):
    comfy.model_management.load_models_gpu([mp])
    g = torch.Generator().manual_seed(seed)
    x, ctx = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 8, 64, generator=g)
    to = dict(mp.model_options.get("transformer_options", {}))
    with torch.no_grad():
        return mp.model.apply_model(x, torch.tensor([0.6, 0.3]), c_crossattn=ctx, transformer_options=to,
                                    y=torch.randn(2, 64, generator=g)).float()


sageattention.CALLS.clear()
want = run(m)
res["calls_without_apply"] = len(sageattention.CALLS)
for mode in ("auto", "math", "sage"):
    sageattention.CALLS.clear()
    (out,) = node.apply(m, "bf16", attention=mode)
    got = run(out)
    router = out.model_options["transformer_options"]["optimized_attention_override"]
    res[mode] = {"stand_in_calls": len(sageattention.CALLS), "counts": dict(router.counts),
                 "equal": bool(torch.equal(got, want)), "rel": float((got - want).norm() / want.norm())}



class MemCache(dict):
    def put(self, key, value, meta=None):
        self[key] = value


# auto as on a GPU (INT8_FUSED_TUNE=first_call: timed on the first call of a shape), with a fake clock: SageAttention
# 1.0 ms; flash 0.99 ms (within the 5 % margin: sage is kept) or 0.5 ms (flash replaces it)
for name, flash_ms in (("timed_keeps", 0.99), ("timed_replaces", 0.5)):
    sageattention.CALLS.clear()
    (out,) = node.apply(m, "bf16", attention="auto")
    router = out.model_options["transformer_options"]["optimized_attention_override"]
    router.probe_devices, router.cache = ("cpu",), MemCache()
    router.time_fn = lambda n, run, f=flash_ms: (run(), {"user": 1.0, "flash": f}[n])[1]
    got = run(out)
    res[name] = {"stand_in_calls": len(sageattention.CALLS), "counts": dict(router.counts),
                 "winners": sorted(set(router.winners.values())), "shapes": len(router.winners),
                 "rel": float((got - want).norm() / want.norm())}
print("RESULT " + json.dumps(res))
'''


def test_use_sage_attention_survives_apply_with_auto(comfy_current, tmp_path):
    from comfy_harness import run_in_current_comfy
    pkg = tmp_path / "sageattention"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(STAND_IN))
    env = dict(os.environ, INT8_FUSED_TUNE="first_call", PYTHONPATH=os.pathsep.join([str(tmp_path)] + [p for p in
                                                       os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cp = run_in_current_comfy(SCRIPT, env=env, cli={"use_sage_attention": True}, timeout=600)
    assert cp.returncode == 0, cp.stderr[-6000:]
    res = json.loads(next(ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    print(json.dumps(res, indent=1))
    assert res["selected"] == "attention_sage"  # ComfyUI's own selection under the flag
    assert res["choices"][-1] == "sage" and "auto" in res["choices"] and res["sage_fn_is_comfys"]
    n = res["calls_without_apply"]
    assert n == 4  # 2 double + 2 single blocks, one attention call each
    assert res["auto"] == {"stand_in_calls": n, "counts": {"sage": n}, "equal": True, "rel": 0.0}
    assert res["math"]["stand_in_calls"] == 0 and res["math"]["counts"] == {"math": n}
    assert res["math"]["rel"] < 1e-5
    assert res["sage"]["stand_in_calls"] == 0 and sum(res["sage"]["counts"].values()) == n
    assert set(res["sage"]["counts"]) <= {"flash", "math"} and res["sage"]["rel"] < 1e-5
    keeps, replaces = res["timed_keeps"], res["timed_replaces"]
    assert keeps["winners"] == ["user"] and keeps["counts"] == {"sage": n}
    assert keeps["stand_in_calls"] == n + keeps["shapes"] and keeps["rel"] == 0.0  # each shape's probe ran it once
    assert replaces["winners"] == ["flash"] and replaces["counts"] == {"flash": n}
    assert replaces["stand_in_calls"] == replaces["shapes"] and replaces["rel"] < 1e-5  # the probes only
