"""The LoRA-in-the-epilogue GEMM (kernel.int8_gemm_lora: kernel/lora.py's down-projection from the int8 codes,
kernel/gemm.py's ``lora_up`` in the epilogue) on the CPU under TRITON_INTERPRET=1, against an fp64 reference built
from the operands by hand; its prepared form; its checks; and (slow) its sm_90 build: the s8 rewrite leaves the
LoRA's bf16 wgmma alone and the epilogue takes no more shared memory than without a LoRA.

Run: TRITON_INTERPRET=1 python -m pytest tests/test_lora_gemm.py -q
"""
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
import kernel  # noqa: E402
from kernel import autotune, gemm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _operands(m, n, k, r, dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    a_q = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    a_s = torch.rand(m, generator=g) * 0.02 + 0.001
    w_q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w_s = torch.rand(n, generator=g) * 0.01 + 0.001
    b = (torch.randn(n, generator=g) * 0.5).to(dtype) if bias else None
    d = (torch.randn(r, k, generator=g) * 0.05).to(dtype)
    u = (torch.randn(n, r, generator=g) * 0.05).to(dtype)
    return a_q, a_s, w_q, w_s, b, d, u


def _reference(a_q, a_s, w_q, w_s, b, d, u, dtype):
    """fp64: h = (a_q d^T) a_s rounded to the output dtype once (what the kernel hands its epilogue), then
    acc a_s w_s + bias + h u^T, unrounded."""
    a = a_q.double()
    h = ((a @ d.double().t()) * a_s.double()[:, None]).to(dtype)
    y = (a @ w_q.double().t()) * a_s.double()[:, None] * w_s.double()[None, :]
    if b is not None:
        y = y + b.double()[None, :]
    return h, y + h.double() @ u.double().t()


def _one_rounding(out, ref, dtype):
    """``out`` is ``ref`` rounded once to ``dtype``: within half an ulp of the output dtype (plus the fp32 sums'
    rounding, far below it)."""
    ulp = torch.finfo(dtype).eps * ref.abs().clamp_min(torch.finfo(dtype).tiny)
    err = (out.double() - ref).abs()
    assert bool((err <= 0.5 * ulp + 1e-6 * ref.abs() + 1e-9).all()), float((err / ulp).max())


@pytest.mark.parametrize("m,n,k,r,dtype,bias", [
    (64, 64, 128, 16, torch.bfloat16, True),
    (37, 72, 80, 48, torch.bfloat16, False),     # row, column and K tails, three 16-wide rank steps
    (150, 48, 96, 32, torch.float16, True),
])
@pytest.mark.parametrize("persist", [False, True])
def test_lora_gemm_adds_the_low_rank_term_before_the_one_rounding(m, n, k, r, dtype, bias, persist):
    ops = _operands(m, n, k, r, dtype, bias=bias)
    h_ref, y_ref = _reference(*ops, dtype)
    a_q, a_s, w_q, w_s, b, d, u = ops
    # the down-projection alone: the codes' sums in fp32 times the token scale, rounded once
    from kernel import lora as klora
    h = klora.launch_lora_down(a_q, a_s, d, torch.empty((m, r), dtype=dtype))
    assert torch.allclose(h.double(), h_ref.double(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    cfg = {**autotune.interpreter_configs()[0], **({"S8": True, "PERSIST": True} if persist else {})}
    out = torch.full((m, n), float("nan"), dtype=dtype)
    from kernel import launch
    with launch.record() as rec:
        gemm.launch_int8_gemm(a_q, a_s, w_q, w_s, b, out, cfg, lora=(h_ref, u))
    assert [ln.jit_fn for ln in rec] == [gemm._int8_gemm_persistent_kernel if persist else gemm._int8_gemm_kernel]
    _one_rounding(out, y_ref, dtype)
    # the entry point: same bits as the launcher with its own h
    y = kernel.int8_gemm_lora(a_q, a_s, w_q, w_s, b, d, u, out_dtype=dtype)
    _, y_own = _reference(a_q, a_s, w_q, w_s, b, d, u, dtype)
    _one_rounding(y, y_own, dtype)
    # without the LoRA the same kernel gives int8_gemm's bits: the LoRA term is all that changed
    plain = kernel.int8_gemm(a_q, a_s, w_q, w_s, b, out_dtype=dtype)
    lora_term = (h_ref.double() @ u.double().t())
    assert not torch.equal(plain, y) and lora_term.abs().max() > 0.01


def test_a_zero_lora_gives_the_plain_gemm_bits():
    a_q, a_s, w_q, w_s, b, d, u = _operands(48, 64, 96, 16, torch.bfloat16)
    y = kernel.int8_gemm_lora(a_q, a_s, w_q, w_s, b, d, torch.zeros_like(u), out_dtype=torch.bfloat16)
    assert torch.equal(y, kernel.int8_gemm(a_q, a_s, w_q, w_s, b, out_dtype=torch.bfloat16))


def test_the_prepared_lora_gemm_repeats_the_checked_call_with_new_operands():
    a_q, a_s, w_q, w_s, b, d, u = _operands(40, 64, 96, 32, torch.bfloat16)
    y, plan = kernel.int8_gemm_lora_planned(a_q, a_s, w_q, w_s, b, d, u, out_dtype=torch.bfloat16)
    assert plan is not None
    a2, s2, _, _, _, d2, u2 = _operands(40, 64, 96, 32, torch.bfloat16, seed=1)
    again = plan(a2, s2, w_q, w_s, b, d2, u2)
    assert torch.equal(again, kernel.int8_gemm_lora(a2, s2, w_q, w_s, b, d2, u2, out_dtype=torch.bfloat16))
    assert not torch.equal(again, y)
    assert plan(a2, s2, w_q, w_s, b, d2[:16].contiguous(), u2[:, :16].contiguous()) is None  # another rank


def test_lora_gemm_refuses_what_it_cannot_run_and_says_how_to_fix_it():
    a_q, a_s, w_q, w_s, b, d, u = _operands(32, 48, 64, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel.int8_gemm_lora(a_q, a_s, w_q, w_s, b, d[:8].contiguous(), u[:, :8].contiguous())
    with pytest.raises(ValueError, match="bf16 or fp16 tensor"):
        kernel.int8_gemm_lora(a_q, a_s, w_q, w_s, b, d.float(), u.float(), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="lora up"):
        kernel.int8_gemm_lora(a_q, a_s, w_q, w_s, b, d, u.t().contiguous().t())   # not contiguous
    with pytest.raises(ValueError, match="down and up of one dtype"):
        kernel.int8_gemm_lora(a_q, a_s, w_q, w_s, b, d.half(), u)                 # another dtype


BUILD = r'''
import inspect, re, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernel.gemm as g
from kernel import s8wgmma
TYPES = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "c_ptr": "*bf16", "as_ptr": "*fp32", "ws_ptr": "*fp32",
         "bias_ptr": "*fp32", "part_ptr": "*i32", "cnt_ptr": "*i32",
         "a_desc": "tensordesc<fp8e4nv[128, 128]>", "w_desc": "tensordesc<fp8e4nv[256, 128]>",
         "c_desc": "tensordesc<bf16[128, 128]>"}
UNIT = {"stride_ak": 1, "stride_wk": 1, "stride_cn": 1, "stride_as": 1, "stride_ws": 1, "stride_bias": 1}
for fn, consts in ((g._int8_gemm_kernel, {"OUT_INT32": False, "EVEN_K": True}), (g._int8_gemm_persistent_kernel, {})):
    shared = {}
    for r in (0, 32, 96):
        lora = {"lh_ptr": "*bf16", "lu_ptr": "*bf16"} if r else {"lh_ptr": "*fp32", "lu_ptr": "*fp32"}
        params = list(inspect.signature(fn.fn).parameters)
        c = {p: v for p, v in {**UNIT, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "INTERPRET": False,
             "HAS_BIAS": True, "SPLIT": 1, "LORA_R": r, "LORA_STEP": g.lora_step(r), **consts}.items() if p in params}
        sig = {p: "constexpr" if p in c else {**TYPES, **lora}.get(p, "i32") for p in params}
        attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
                 if p not in c and "desc" not in p and p != "NUM_PROGS"}
        k8 = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=c, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
        k = s8wgmma.rewritten(k8)
        ins = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+\.\w+\.\w+\.\w+)", k.asm["ptx"])))
        shared[r] = k8.metadata.shared
        print(fn.__name__, r, ins, k8.metadata.shared)
    # the plain kernel holds the LoRA step in registers and the main loop's buffers; the persistent one may stage a
    # whole-rank step beside the next tile's loads: within sm_90's 227 KB a block
    assert all(v <= 232448 for v in shared.values()), shared
    if fn is g._int8_gemm_kernel:
        assert shared[32] == shared[96] == shared[0], shared
'''


@pytest.mark.slow
def test_lora_gemm_kernels_build_for_sm90_with_the_s8_main_loop_and_a_bf16_epilogue_dot(tmp_path):
    """Built for sm_90 from fp8 operand types as ``kernel.s8wgmma`` builds them, without a LoRA and with ranks 32 and
    96 (``lora_step``: one 32-wide step, three): the rewrite turns the main loop's fp8 wgmma into s8 and leaves the
    LoRA's bf16 wgmma (n256, k16) alone, and the LoRA's tile is added in the accumulator's registers: the plain
    kernel takes no shared memory beyond its own, the persistent one stays within sm_90's 227 KB a block. In a
    subprocess without TRITON_INTERPRET."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", BUILD, str(ROOT)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 6, out[-3000:]
    for ln in lines:
        name, rank = ln.split()[:2]
        want = ["'m64n256k32.s32.s8.s8'"] if rank == "0" else ["'m64n256k16.f32.bf16.bf16'", "'m64n256k32.s32.s8.s8'"]
        assert "[" + ", ".join(want) + "]" in ln, ln


@pytest.mark.parametrize("smooth", [False, True])
def test_a_fused_layer_with_a_lora_runs_one_gemm_with_the_lora_in_its_epilogue(smooth, monkeypatch):
    """``quant.blocks.linear`` on a bf16 fused_triton Int8Linear carrying two LoRAs (``Int8Linear.set_lora``): the
    quantizer, the down-projection and the GEMM (three launches, no torch op), and the output is float64's
    ``codes GEMM + bias + sum_i s_i (x_q A_i^T) B_i^T`` on the GEMM's own int8 input x_q, within one bf16 rounding
    of the output plus three of the low-rank term's magnitude ``(|x_q| |A|^T) |s B|^T`` (its down and up weights
    in bf16, h rounded to bf16 once). With a smoothing vector the codes are of ``x / s``: the LoRA still sees
    x_q = codes * step * s."""
    import kernel.gemm as kg
    import kernel.lora as kl
    import kernel.quantize as kq
    from quant import blocks as qb, lora as ql
    from quant.linear import Int8Linear
    g = torch.Generator().manual_seed(4)
    m, n, k = 40, 48, 96
    w, b = torch.randn(n, k, generator=g) / 8, torch.randn(n, generator=g)
    s = torch.rand(k, generator=g) + 0.5 if smooth else None
    layer = Int8Linear.from_float(w, b, smooth=s, backend="fused_triton", name="blk.0.o").to(torch.bfloat16)
    terms = [ql.Term(torch.randn(8, k, generator=g) / 4, torch.randn(n, 8, generator=g) / 4, 0.75),
             ql.Term(torch.randn(4, k, generator=g) / 4, torch.randn(n, 4, generator=g) / 4, -1.5)]
    layer.set_lora(ql.Branches(terms, [], n, k))
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    names = []
    for mod in (kg, kl, kq):  # the launchers each kernel module calls
        monkeypatch.setattr(mod, "launch", lambda fn, *a, _real=mod.launch, **kw: names.append(fn.__name__)
                            or _real(fn, *a, **kw))
    y = qb.linear(layer, x)
    assert names[1:] == ["_lora_down_kernel", "_int8_gemm_kernel"] and "quant" in names[0], names
    # float64 reference, built from the layer's int8 weight and the LoRA's source tensors
    xs = x.double() / (1.0 if s is None else s.double())
    step = xs.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(xs / step).clamp(-127, 127)
    x_q = codes * step * (1.0 if s is None else s.double())            # the input the int8 GEMM reads, unsmoothed
    base = (codes * step) @ (layer.weight.double() * layer.weight_scale.double()[:, None]).t() + layer.bias.double()
    hs = [(x_q @ t.down.double().t()) * t.scale for t in terms]
    ref = base + sum(h @ t.up.double().t() for h, t in zip(hs, terms))
    mag = sum(((x_q.abs() @ t.down.double().abs().t()) * abs(t.scale)) @ t.up.double().abs().t() for t in terms)
    err = (y.double() - ref).abs()
    bound = 2.0 ** -9 * ref.abs() + 3 * 2.0 ** -9 * mag + 1e-5 * base.abs() + 1e-6
    assert bool((err <= bound).all()), float((err / bound).max())
    # the bound is tight enough to see the LoRA: without it (or with another scale) most outputs would fail it
    assert float(((ref - base).abs() > 4 * bound).double().mean()) > 0.5


def test_a_failed_epilogue_build_falls_back_to_the_branch_pair_and_says_so(monkeypatch, caplog):
    """The LoRA epilogue GEMM raising (a build that fails on some GPU / Triton) turns it off for the process with
    one warning naming the error; that call and later ones run the branch pair (``Branches.add_quantized``) on the
    same int8 input, and the state says which ran."""
    from quant import backends, blocks as qb, lora as ql
    from quant.linear import Int8Linear
    monkeypatch.setattr(backends, "_LORA_EPILOGUE_FAILED", None)
    g = torch.Generator().manual_seed(5)
    n, k = 32, 64
    layer = Int8Linear.from_float(torch.randn(n, k, generator=g), None, backend="fused_triton",
                                  name="blk.1.o").to(torch.bfloat16)
    br = ql.Branches([ql.Term(torch.randn(16, k, generator=g), torch.randn(n, 16, generator=g) / 16, 1.0)], [], n, k)
    layer.set_lora(br)
    x = torch.randn(24, k, generator=g).to(torch.bfloat16)
    a_q, a_s = kernel.quantize_per_token(x)
    pair = br.add_quantized(a_q, a_s, kernel.int8_gemm(a_q, a_s, layer.weight, layer.weight_scale,
                                                       out_dtype=torch.bfloat16))
    epi = qb.linear(layer, x)
    assert not torch.equal(epi, pair) and backends.lora_epilogue_state() == "up-projection in the int8 GEMM's epilogue"
    from kernel import config
    with config.override(INT8_FUSED_LORA_EPILOGUE=False):  # the switch: the pair, said so
        assert torch.equal(qb.linear(layer, x), pair)
        assert "INT8_FUSED_LORA_EPILOGUE=0" in backends.lora_epilogue_state()

    def fail(*a):
        raise RuntimeError("out of resource: shared memory, Required: 300000, Hardware limit: 232448")
    monkeypatch.setattr(Int8Linear, "gemm_lora_call", fail)
    with caplog.at_level("WARNING", logger="int8_fused"):
        assert torch.equal(qb.linear(layer, x), pair)
    assert "out of resource" in backends.lora_epilogue_state() and "GEMM pair" in backends.lora_epilogue_state()
    assert sum("LoRA-in-the-epilogue GEMM failed" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(qb.linear(layer, x), pair)  # off for the process: not tried again


@pytest.mark.parametrize("lora_dtype", [torch.float16, torch.bfloat16])
def test_an_fp32_output_takes_a_half_precision_lora(lora_dtype):
    """``kernel.int8_gemm_lora`` with an fp32 output and the LoRA's operands in bf16 / fp16: h rounded to them once,
    the sums in fp32, the output rounded to fp32 once. (``quant.blocks.gemm`` runs an fp32 output's LoRA as the
    branch pair, in fp32: a float32 model's.)"""
    a_q, a_s, w_q, w_s, b, d, u = _operands(48, 40, 96, 32, lora_dtype, seed=2)
    _, y_ref = _reference(a_q, a_s, w_q, w_s, b, d, u, lora_dtype)
    y = kernel.int8_gemm_lora(a_q, a_s, w_q, w_s, b, d, u, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    # fp32 sums of fp32-rounded terms: a few fp32 roundings of the terms' magnitudes (h's own rounding in y_ref)
    h = ((a_q.double() @ d.double().t()) * a_s.double()[:, None]).to(lora_dtype).double()
    mag = ((a_q.double() @ w_q.double().t()) * a_s.double()[:, None] * w_s.double()[None, :]).abs() \
        + b.double().abs()[None, :] + h.abs() @ u.double().abs().t()
    assert bool(((y.double() - y_ref).abs() <= 8 * 2.0 ** -24 * mag + 1e-12).all())


@pytest.mark.parametrize("persist", [False, True])
def test_the_tail_split_adds_the_lora_once_in_the_tile_that_finishes(persist):
    """With the tail split (``kernel.tailsplit``: the last wave's tiles in K pieces, the last piece to finish runs the
    epilogue), the LoRA is added once, in that epilogue: the same bits as the unsplit call."""
    from kernel import tailsplit
    from kernel import launch
    m, n, k = 160, 48, 96  # 10 tiles of 32 x 32 on the interpreter's 4 programs; TMA-able strides (persistent form)
    a_q, a_s, w_q, w_s, b, d, u = _operands(m, n, k, 32, torch.bfloat16, seed=7)
    h = torch.empty((m, 32), dtype=torch.bfloat16)
    from kernel import lora as klora
    klora.launch_lora_down(a_q, a_s, d, h)
    cfg = {**autotune.interpreter_configs()[0], **({"S8": True, "PERSIST": True} if persist else {})}
    tiles = -(-m // 32) * -(-n // 32)
    assert tailsplit.tail_layout(tiles, 4, 2, -(-k // 32))[1] > 1  # the case does split
    whole = gemm.launch_int8_gemm(a_q, a_s, w_q, w_s, b, torch.empty((m, n), dtype=torch.bfloat16), cfg, lora=(h, u))
    with launch.record() as rec:
        split = gemm.launch_int8_gemm(a_q, a_s, w_q, w_s, b, torch.full((m, n), float("nan"), dtype=torch.bfloat16),
                                      {**cfg, "SPLIT": 2}, lora=(h, u))
    assert [ln.jit_fn for ln in rec] == [gemm._int8_gemm_persistent_kernel if persist else gemm._int8_gemm_kernel]
    assert torch.equal(split, whole)
    _, y_ref = _reference(a_q, a_s, w_q, w_s, b, d, u, torch.bfloat16)
    _one_rounding(whole, y_ref, torch.bfloat16)
