"""Host work of the fused Flux-family blocks (adapters/flux/blocks.py, external_mod.py) and of the LoRA run-start
wrapper (nodes/apply.py ``install_lora``), on the CPU (TRITON_INTERPRET=1), pinned ComfyUI in-process.

1. Outputs. Each fused block of a tiny Chroma (width 128, 2 heads; its modulation passed in as ComfyUI's
   ``ChromaModulationOut`` views of one approximator-shaped tensor) and of a tiny Flux.1 (its own modulation), bf16,
   batch 1 and 2, with Flux's RoPE ``pe`` (so the fused QK norm + RoPE runs), against the block's per-linear INT8 twin:
   the same Int8Linear layers under ComfyUI's own block forward (``INT8_FUSED_FUSION=0``), i.e. ComfyUI's per-linear
   INT8 path. On the CPU they are equal bit for bit: every GEMM gets the same int8 codes and scales (the
   equivalence tests/test_flux_fused.py ``block_activations`` checks), the same GEMM kernel runs, and the fused
   residual / GELU kernels round as torch's ops do; the float glue has no other reduction.
2. Aten ops a fused block dispatches per call (a ``TorchDispatchMode`` counter, warm: the row kernels' and GEMMs'
   prepared launches built), leaving out what runs inside a Triton launch (the interpreter's own tensor handling; on
   a GPU a launch is one C call) and inside ComfyUI's ``optimized_attention`` (SDPA: ComfyUI's, not the block's), at
   most the bound derived by hand in :func:`_bound`.
3. The LoRA OUTER_SAMPLE wrapper: without LoRA patches, and with no INT8 layer left carrying branches, it does not
   walk the model (``original_modules``); after a LoRA clone ran, the base model's run walks once, takes the branches
   off, and its output equals the output before the LoRA bit for bit.

Run: bash scripts/test.sh tests/test_host_ops.py
"""
import collections
import contextlib
import dataclasses

import pytest
import torch

import fused_block_helpers as fbh

BF16 = torch.bfloat16


# ----------------------------------------------------------------------------------------------- op counter
class _Ops:
    """Aten ops dispatched while ``counting``, less those inside Triton launches and ``paused`` callables."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        self.ops, self.paused = collections.Counter(), 0
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not outer.paused:
                    outer.ops[func.__name__] += 1
                return func(*args, **(kwargs or {}))
        self.mode = Mode

    def pause(self, fn):
        def paused(*a, **k):
            self.paused += 1
            try:
                return fn(*a, **k)
            finally:
                self.paused -= 1
        return paused

    @contextlib.contextmanager
    def counting(self):
        self.ops.clear()
        with self.mode():
            yield self.ops


@pytest.fixture
def ops(monkeypatch):
    from triton.runtime import interpreter
    o = _Ops()
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", o.pause(interpreter.InterpretedFunction.run))
    return o


# ----------------------------------------------------------------------------------------------- models, inputs
def _chroma():
    import test_chroma_fused as tc
    return tc.tiny_chroma(BF16).diffusion_model


def _flux():
    import test_flux_fused as tf
    return tf.tiny_flux(BF16)


def _inputs(dm, kind: str, b: int, chroma: bool, seed=5):
    """Keyword arguments of one call of a ``kind`` block of ``dm``: 5 text and 16 image tokens, Flux's RoPE of
    their ids, and the modulation: Chroma's ``ChromaModulationOut`` views of a [B, 12, K] tensor (as
    ``Chroma.get_modulations`` slices the approximator's output), Flux.1's vector."""
    g = torch.Generator().manual_seed(seed)
    k, lt, li = dm.hidden_size, 5, 16
    ids = torch.zeros(b, lt + li, 3)
    ids[:, lt:, 1] = torch.arange(li).float().div(4).floor()
    ids[:, lt:, 2] = torch.arange(li).float().remainder(4)
    pe = dm.pe_embedder(ids)
    if chroma:
        from comfy.ldm.chroma.layers import ChromaModulationOut
        t = (0.3 * torch.randn(b, 12, k, generator=g)).to(BF16)
        m = [ChromaModulationOut.from_offset(t, 3 * i) for i in range(4)]
        vec = ((m[0], m[1]), (m[2], m[3])) if kind == "double" else m[0]
    else:
        vec = torch.randn(b, k, generator=g).to(BF16)
    img, txt = torch.randn(b, li, k, generator=g).to(BF16), torch.randn(b, lt, k, generator=g).to(BF16)
    if kind == "double":
        return {"img": img, "txt": txt, "vec": vec, "pe": pe}
    return {"x": torch.cat((txt, img), 1), "vec": vec, "pe": pe}


def _fresh(kw):
    """``kw`` with fresh copies of the activations (the forwards write them in place)."""
    return {k: v.clone() if k in ("img", "txt", "x") else v for k, v in kw.items()}


def _call(blk, kw):
    """The block's outputs, a tuple."""
    with torch.no_grad():
        out = blk(**kw)
    return out if isinstance(out, tuple) else (out,)


def _blocks(pack, dm):
    """({name: fused block}, {name: per-linear INT8 twin}) of double_blocks.0 and single_blocks.0."""
    A, cfg = pack.adapters, pack.quant.blocks.config
    layers = fbh.int8_layers(pack, dm)
    patches = A.object_patches(dm, layers)
    with cfg.override(INT8_FUSED_FUSION=False):
        plain = A.object_patches(dm, layers)
    names = ("double_blocks.0", "single_blocks.0")
    twins = {n: fbh.swapped(dm.get_submodule(n), {k[len(n) + 1:]: v for k, v in plain.items()
                                                    if k.startswith(n + ".")}) for n in names}
    return {n: patches[n] for n in names}, twins


# ----------------------------------------------------------------------------------------------- the bound
def _bound(kind: str, b: int) -> int:
    """Aten ops a warm fused block must dispatch per call, every linear INT8 on fused_triton, batch ``b``, derived
    from what it computes. A prepared launch allocates its outputs (one ``empty`` each) and nothing else; a kernel
    reads a 3-D activation as [B L, K] rows (one ``view``); ComfyUI's attention call is not the block's. Per call:

    double block, per stream (img, txt):
      qkv    x as rows (view); LayerNorm * (1 + scale) + shift + quantization: codes, scales (2 empty); the GEMM's
             output (1 empty) as [B, L, 3K] for the QK kernel (view)                                        5
      proj   its attention rows: quantization (codes, scales) and GEMM (at most 3 empty; one small-M launch
             needs 1); with b > 1 the stream's rows are not one stride apart: one copy (clone)          3 (+1)
      tails  x and proj as rows (2 views); residual + LayerNorm * (1 + scale) + shift + quantization (2 empty,
             the sum written into x); mlp.0 GEMM (1 empty); GELU + quantization (2 empty); mlp.2 GEMM (1
             empty); the last residual written into x (nothing)                                            8
    per block: q, k, v buffers [B, L_all, H, D] seen as [B, H, L_all, D] (3 empty, 3 transpose); the attention
      output's txt and img rows (2 slice)                                                                  8
    -> 2 * (5 + 3 + 8) + 8 = 40, 42 with b > 1

    single block: x as rows (view); LayerNorm * mod + quantization (2 empty); linear1 GEMM (1 empty); its output
    split into qkv / mlp (1 split), qkv as [B, L, 3K] for the QK kernel (view); q, k, v buffers (3 empty, 3
    transpose); the attention output as rows (view); concatenation + GELU + quantization (2 empty); linear2 GEMM
    (1 empty); x as rows for the residual written into it (view)                                          -> 17

    Modulation is not in it: Chroma's arrives as views made by ComfyUI's model (no op in the block), Flux.1's own
    Modulation modules are ComfyUI's (left out of the count)."""
    return {"double": 40 + (2 if b > 1 else 0), "single": 17}[kind]


# ----------------------------------------------------------------------------------------------- 1 + 2
@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("model", ["chroma", "flux"])
def test_fused_blocks_equal_per_linear_and_bounded_ops(pack, ops, model):
    dm = (_chroma if model == "chroma" else _flux)()
    fused, twins = _blocks(pack, dm)
    for name, blk in fused.items():
        kind = name.split("_")[0]
        fn = blk.fn
        blk.fn = dataclasses.replace(fn, optimized_attention=ops.pause(fn.optimized_attention),
                                     attention=ops.pause(fn.attention))
        if model == "flux":  # Flux.1's own Modulation modules: ComfyUI's ops, not the fused block's
            own = "modulations" if kind == "double" else "modulation_of"
            setattr(blk, own, ops.pause(getattr(blk, own)))
        for b in (1, 2):
            kw = _inputs(dm, kind, b, model == "chroma")
            ref = _call(twins[name], _fresh(kw))
            got = [_call(blk, _fresh(kw)) for _ in range(3)][-1]
            fresh = _fresh(kw)
            with ops.counting() as counted:
                again = _call(blk, fresh)
            print(model, name, b, sum(counted.values()), dict(counted))
            assert all(torch.equal(a, r) for a, r in zip(got, ref)), (name, b)
            assert all(torch.equal(a, r) for a, r in zip(again, ref)), (name, b)
            assert sum(counted.values()) <= _bound(kind, b), (name, b, dict(counted))


@pytest.mark.slow
@pytest.mark.interpreter
def test_tiny_chroma_model_equals_per_linear(pack):
    """The whole tiny Chroma through the Apply node and ComfyUI's ModelPatcher, batch 2 (a CFG batch), fused vs
    ``INT8_FUSED_FUSION=0``: ``apply_model`` outputs equal bit for bit (the modulation as the model slices it)."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import test_chroma_fused as tc
    cpu = torch.device("cpu")
    mp = comfy.model_patcher.ModelPatcher(tc.tiny_chroma(BF16), load_device=cpu, offload_device=cpu)
    apply = pack.nodes.apply.ApplyFusedInt8GEMM()
    (fused,) = apply.apply(mp, "fused_triton")
    with pack.quant.blocks.config.override(INT8_FUSED_FUSION=False):
        (plain,) = apply.apply(mp, "fused_triton")
    x, sigma, ctx, guidance = tc._inputs(False)

    def run(m):
        mm.load_models_gpu([m])
        with torch.no_grad():
            return [m.model.apply_model(x, sigma, c_crossattn=ctx, guidance=guidance) for _ in range(2)]
    try:
        got, ref = run(fused), run(plain)
    finally:
        mm.unload_all_models()
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[0])  # the second call: prepared launches


# ----------------------------------------------------------------------------------------------- 3
def test_lora_wrapper_walks_the_model_only_when_it_has_work(pack, tiny_model, monkeypatch):
    import weakref

    import comfy.sample
    from comfy.weight_adapter.lora import LoRAAdapter
    apply, lora = pack.nodes.apply, pack.quant.lora
    monkeypatch.setattr(lora, "_CARRYING", weakref.WeakSet())  # branches other tests' layers may still carry
    q = apply.ApplyFusedInt8GEMM().apply(tiny_model("flux"), "torch_int_mm")[0]
    walks, real = [], apply.original_modules
    monkeypatch.setattr(apply, "original_modules", lambda p: (walks.append(p), real(p))[1])
    g = torch.Generator().manual_seed(1)
    ctx, y = torch.randn(1, 8, 64, generator=g), torch.randn(1, 64, generator=g)
    latent, noise = torch.zeros(1, 16, 8, 8), torch.randn(1, 16, 8, 8, generator=g)
    pos = [[ctx, {"pooled_output": y}]]

    def sample(m):
        return comfy.sample.sample(m, noise, 1, 1.0, "euler", "simple", pos, pos, latent, seed=0,
                                   disable_pbar=True).float()

    base = sample(q)
    assert walks == []                            # no LoRA anywhere: the wrapper returns at once
    lq = q.clone()
    key = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
    up, down = torch.randn(384, 4, generator=g) * 0.3, torch.randn(4, 128, generator=g) / 128 ** 0.5
    assert lq.add_patches({key: LoRAAdapter(set(), (up, down, 4.0, None, None, None))}, 1.0) == [key]
    with_lora = sample(lq)
    assert len(walks) == 1 and not torch.equal(with_lora, base)
    assert lora.any_branches()
    again = sample(q)                             # the base model after its LoRA clone: walks, takes them off
    assert len(walks) == 2 and torch.equal(again, base) and not lora.any_branches()
    assert torch.equal(sample(q), base) and len(walks) == 2
