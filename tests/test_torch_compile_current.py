"""ComfyUI 0.33.0's TorchCompileModel node on a MODEL out of "Apply Fused INT8 GEMM" (issue 38 item 4), on the CPU.

A tiny Flux.1 (one double, one single block, bf16) from ComfyUI's own classes goes through Apply, then through the
real ``TorchCompileModel`` node (backend inductor; the node offers inductor and cudagraphs), and samples one euler
step through ComfyUI's sampler. Graph breaks are read from torch's ``graph_breaks`` log with their user stacks; a
break whose stack passes through a fused block's file (adapters/*/blocks.py, quant/blocks.py) is inside a block.

* fused_triton (both fused blocks, kernels in the Triton interpreter): zero graph breaks inside a fused block, the
  traced graphs call the pack's ``int8_fused`` custom ops, and the output matches the uncompiled MODEL within one
  int8 code of a row maximum (1/127 relative). Why that bound: inductor evaluates the bf16 float glue (modulation,
  residual adds, RoPE) in fp32 without the eager intermediate bf16 roundings, so a GEMM input may differ by one bf16
  ulp and its per-token quantization by one code (<= amax / 127) at a rounding tie; the miniature's layers are
  normalised (unit gain), so the output moves by less than that relatively.
* The same compile wrapper (``set_torch_compile_wrapper``, what the node calls) with the ``eager`` backend: dynamo
  traces the same graphs but runs them op by op, so the output must be the same bits as the uncompiled MODEL, for
  fused_triton and for torch_int_mm (per-linear, ``int8_fused.linear`` is not used there: torch._int_mm is traced),
  and with the compile wrapper added before Apply (Apply's object patches land in the module the wrapper compiles).

Attention is routed through SDPA (``attention="math"`` on Apply): on a CPU ComfyUI's own attention is the
sub-quadratic one, which asks psutil for free memory and breaks the graph in every model, fused or not.

Run: bash scripts/test.sh tests/test_torch_compile_current.py
"""
import dataclasses
import logging
import re

import torch

FUSED_FILES = re.compile(r"/(adapters/\w+/blocks|quant/blocks)\.py")


def test_torch_compile_model_node_on_applied_flux(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    print({k: v for k, v in res.items() if k != "breaks"})
    ind = res["fused_triton_inductor"]
    assert ind["fused_breaks"] == [], ind["fused_breaks"]
    assert ind["custom_ops"], "the traced graphs do not call the pack's int8_fused ops"
    assert ind["rel"] <= 1 / 127, ind["rel"]
    for key in ("fused_triton_eager", "torch_int_mm_eager", "fused_triton_eager_before_apply"):
        eag = res[key]
        assert eag["fused_breaks"] == [] and eag["equal"], (key, eag)
    assert res["fused_triton_eager"]["custom_ops"] and res["fused_triton_eager_before_apply"]["custom_ops"]
    assert all(res[k]["breaks"] > 0 for k in ("fused_triton_eager", "torch_int_mm_eager")), res  # the log is read
    assert res["patches"] == ["diffusion_model.double_blocks.0", "diffusion_model.single_blocks.0"]


class _Breaks(logging.Handler):
    """Records torch's graph_breaks log messages and the FX graph code dynamo hands to the backend."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.breaks, self.code = [], []

    def emit(self, record):
        name, msg = record.name, record.getMessage()
        if name.endswith("__graph_breaks"):
            self.breaks.append(msg)
        elif name.endswith("__graph_code"):
            self.code.append(msg)


def _tiny_flux_patcher(dtype):
    import comfy.ldm.flux.model as fm
    import comfy.model_detection
    import comfy.model_patcher
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))  # noqa: F821 (runpy sets __file__)
    import comfy_harness as H
    mini = H.miniature()
    sd = mini.tiny_state_dict("flux", 0, dtype)
    cfg = dict(mini.TINY_UNET_CONFIG["flux"], depth=1, depth_single_blocks=1)
    if "txt_ids_dims" in {f.name for f in dataclasses.fields(fm.FluxParams)}:
        cfg["txt_ids_dims"] = []
    mc = comfy.model_detection.model_config_from_unet_config(cfg, sd)
    mc.set_inference_dtype(dtype, None)
    cpu = torch.device("cpu")
    base = mc.get_model(sd, "", device=cpu)
    dm = base.diffusion_model
    own = dm.state_dict()
    sd = {(k[:-len("scale")] + "weight" if k.endswith("_norm.scale") and k not in own else k): v for k, v in sd.items()}
    missing = dm.load_state_dict({k: v for k, v in sd.items() if k in own and own[k].shape == v.shape},
                                 strict=False).missing_keys
    with torch.no_grad():
        for k in missing:
            dm.get_parameter(k).copy_(torch.randn_like(dm.get_parameter(k)) * 0.05)
    return comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)


def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    import comfy.model_management as mm
    import comfy_extras.nodes_torch_compile as ntc
    import torch._dynamo
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    assert "inductor" in ntc.TorchCompileModel.define_schema().inputs[1].options
    torch.manual_seed(0)
    mp = _tiny_flux_patcher(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    pos = [[torch.randn(1, 6, 64, generator=g), {"pooled_output": torch.randn(1, 64, generator=g), "guidance": 3.5}]]
    latent = torch.zeros(1, 16, 8, 8)

    def sample(m):
        return sample_image_only_cfg(m, pos, latent, steps=1, cfg=1.0)  # noqa: F821 (the harness defines it)

    rec = _Breaks()
    torch._logging.set_logs(graph_breaks=True, graph_code=True)
    import torch._dynamo.symbolic_convert  # noqa: F401  (creates the artifact loggers)
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
               if n.startswith("torch") and n.endswith(("__graph_breaks", "__graph_code"))]
    for lg in loggers:
        lg.addHandler(rec)
    out = {}
    try:
        for back, bk in (("fused_triton", "inductor"), ("fused_triton", "eager"), ("torch_int_mm", "eager"),
                         ("fused_triton", "eager_before_apply")):
            (applied,) = pack.nodes.apply.ApplyFusedInt8GEMM().apply(mp, back, attention="math")
            if back == "fused_triton":
                out["patches"] = sorted(applied.object_patches)
            ref = sample(applied)
            if bk == "inductor":
                res = ntc.TorchCompileModel.execute(applied, bk)
                compiled = res.result[0] if hasattr(res, "result") else res[0]
            elif bk == "eager_before_apply":  # the compile wrapper first, Apply on its output
                torch.manual_seed(0)  # the same weights as ``mp``, in a tree no earlier case has loaded
                first = _tiny_flux_patcher(torch.bfloat16)
                set_torch_compile_wrapper(model=first, backend="eager")
                (compiled,) = pack.nodes.apply.ApplyFusedInt8GEMM().apply(first, back, attention="math")
            else:
                compiled = applied.clone()
                set_torch_compile_wrapper(model=compiled, backend=bk)
            torch._dynamo.reset()
            rec.breaks.clear()
            rec.code.clear()
            got = sample(compiled)
            mm.unload_all_models()
            out[f"{back}_{bk}"] = {
                "fused_breaks": [b[:2000] for b in rec.breaks if FUSED_FILES.search(b)],
                "breaks": len(rec.breaks),
                "custom_ops": sorted({m for c in rec.code for m in re.findall(r"int8_fused\.\w+", c)}),
                "equal": bool(torch.equal(got, ref)),
                "rel": float((got.double() - ref.double()).norm() / ref.double().norm()),
            }
    finally:
        for lg in loggers:
            lg.removeHandler(rec)
        torch._logging.set_logs()
    return out
