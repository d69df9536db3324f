"""ComfyUI 0.33.0's TorchCompileModel node with backend ``cudagraphs`` and this pack's INT8 layers is refused with a
message that says why and what to do (issue 38 item 4), on the CPU with the real nodes and ComfyUI's sampler.

On the GPU that backend fails inside torch: under ComfyUI's default cudaMallocAsync allocator torch's CUDA graph trees
raise "does not yet support checkPoolLiveAllocations", and with ``--disable-cuda-malloc`` they reject the scratch
buffers the pack's GEMM keeps across calls (bench/RESULTS.md). So:

* the node after Apply: the sampling run stops at its start with ``CUDAGRAPHS_REFUSED`` (nothing is sampled);
* the node before Apply: Apply raises the same message;
* Apply's ``bf16`` control (no INT8 layers) under the node is not refused. Backend ``inductor`` after Apply is not
  refused either: tests/test_torch_compile_current.py samples it (a refusal there fails that test), so it is not
  compiled again here.

Run: bash scripts/test.sh tests/test_torch_compile_cudagraphs_current.py
"""


def test_cudagraphs_backend_is_refused_with_what_to_do(comfy_current):
    from comfy_harness import run_body_in_current_comfy
    res = run_body_in_current_comfy(__file__)
    msg = res["message"]
    assert "cudagraphs" in msg and "backend 'inductor'" in msg and "cudaMallocAsync" in msg, msg
    assert res["after_apply"] == "RuntimeError: INT8 sampling: " + msg, res
    assert res["before_apply"] == "RuntimeError: Apply Fused INT8 GEMM: " + msg, res
    assert res["steps_run_after_apply"] == 0, res
    assert res["bf16_control"] == "applied", res


def body(pack, models) -> dict:
    """Runs inside the current ComfyUI (subprocess)."""
    import sys
    from pathlib import Path

    import comfy_extras.nodes_torch_compile as ntc
    import torch
    sys.path.insert(0, str(Path(__file__).parent))  # noqa: F821 (runpy sets __file__)
    import test_torch_compile_current as tc

    def compile_node(m, backend):
        res = ntc.TorchCompileModel.execute(m, backend)
        return res.result[0] if hasattr(res, "result") else res[0]

    g = torch.Generator().manual_seed(2)
    pos = [[torch.randn(1, 6, 64, generator=g), {"pooled_output": torch.randn(1, 64, generator=g), "guidance": 3.5}]]
    latent = torch.zeros(1, 16, 8, 8)
    steps = []

    def sample(m):
        import comfy.model_base
        orig = comfy.model_base.BaseModel.apply_model

        def counted(self, *a, **k):
            steps.append(1)
            return orig(self, *a, **k)
        comfy.model_base.BaseModel.apply_model = counted
        try:
            return sample_image_only_cfg(m, pos, latent, steps=1, cfg=1.0)  # noqa: F821 (the harness defines it)
        finally:
            comfy.model_base.BaseModel.apply_model = orig

    def outcome(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the message is the result
            return f"{type(e).__name__}: {e}"
        return None

    apply = pack.nodes.apply.ApplyFusedInt8GEMM().apply
    out = {"message": pack.nodes.apply.CUDAGRAPHS_REFUSED}
    torch.manual_seed(0)
    mp = tc._tiny_flux_patcher(torch.bfloat16)
    (applied,) = apply(mp, "torch_int_mm", attention="math")
    out["after_apply"] = outcome(lambda: sample(compile_node(applied, "cudagraphs")))
    out["steps_run_after_apply"] = len(steps)
    out["before_apply"] = outcome(lambda: apply(compile_node(mp, "cudagraphs"), "torch_int_mm", attention="math"))
    out["bf16_control"] = outcome(lambda: apply(compile_node(mp, "cudagraphs"), "bf16", attention="math")) or "applied"
    return out
