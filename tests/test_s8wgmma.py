"""The s8 wgmma n256 path (kernel/s8wgmma.py) on the CPU: the PTX rewrite, the pack's GEMM kernels built for sm_90
with fp8 operand types and rewritten to s8 n256 (Triton ships ptxas), the first-call check, and the fallback that
runs Triton's int8 build wherever the path cannot run (here: the interpreter), exact against ``torch._int_mm``.
Whether a rewritten binary computes the right sums is the GPU's to say: the H200 runs, bench/RESULTS.md.

Run: TRITON_INTERPRET=1 python -m pytest tests/test_s8wgmma.py -q
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
import kernel  # noqa: E402
from kernel import autotune, gemm, s8wgmma, tailsplit  # noqa: E402
from quant.quantize import int8_matmul_ref  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# the form Triton 3.6 prints an fp8 wgmma in (accumulator list shortened), and its s8 form written out by hand
FP8_LINE = ("wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {%f1, %f2, %f3}, %rd10, %rd11, p, 1, 1;")
S8_LINE = ("wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 {%f1, %f2, %f3}, %rd10, %rd11, p;")


def test_rewrite_ptx_turns_each_fp8_wgmma_into_s8_and_keeps_the_rest():
    ptx = f"\t// begin\n\t{FP8_LINE}\n\twgmma.commit_group.sync.aligned;\n\t{FP8_LINE.replace('p,', '1,')}\n"
    out, n = s8wgmma.rewrite_ptx(ptx)
    assert n == 2
    assert out == (f"\t// begin\n\t{S8_LINE}\n\twgmma.commit_group.sync.aligned;\n\t{S8_LINE.replace('p;', '1;')}\n")


def test_rewrite_ptx_refuses_a_kernel_it_cannot_fully_rewrite():
    with pytest.raises(RuntimeError, match="no fp8 wgmma"):
        s8wgmma.rewrite_ptx("\tmma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%r1}, {%r2}, {%r3}, {%r4};\n")
    # an fp8 wgmma with operand scales other than 1 (not of the form rewritten) leaves e4m3 in the PTX
    with pytest.raises(RuntimeError, match="e4m3"):
        s8wgmma.rewrite_ptx(f"{FP8_LINE}\n{FP8_LINE.replace('1, 1;', '1, -1;')}\n")
    with pytest.raises(RuntimeError, match="e4m3"):
        s8wgmma.rewrite_ptx(f"{FP8_LINE}\ncvt.rn.satfinite.e4m3x2.f32 %rs1, %f1, %f2;\n")


def test_first_call_keeps_matching_bits_and_replaces_a_wrong_result():
    ref = torch.tensor([[1.5, float("nan")], [-0.0, 3.0]], dtype=torch.bfloat16)
    out = torch.empty_like(ref)

    def run_ref(scratch):
        scratch.copy_(ref)
    assert s8wgmma.first_call(out, lambda: out.copy_(ref), run_ref)  # NaN bits equal: the same result
    assert s8wgmma.same_bits(out, ref)
    wrong = ref.clone()
    wrong[1, 0] = 0.0  # +0.0 against the reference's -0.0: equal as numbers, different bits
    assert not s8wgmma.first_call(out, lambda: out.copy_(wrong), run_ref)
    assert s8wgmma.same_bits(out, ref)  # the reference's result is what the call returns
    # a strided output (a view of a wider buffer): the check's scratch is laid out like it
    wide = torch.zeros((2, 4), dtype=torch.int32)
    view = wide[:, 1:3]
    seen = []
    assert s8wgmma.first_call(view, lambda: view.copy_(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)),
                              lambda s: (seen.append(s.stride()), s.copy_(torch.tensor([[1, 2], [3, 4]]))))
    assert seen == [view.stride()] and wide[:, 0].eq(0).all() and wide[:, 3].eq(0).all()


def test_the_path_is_not_usable_off_sm90_and_says_why_when_turned_off(monkeypatch):
    monkeypatch.setattr(s8wgmma, "_OFF", None)
    monkeypatch.setattr(s8wgmma, "_CHECKED", set())
    monkeypatch.setattr(s8wgmma, "_PENDING", set())
    assert not s8wgmma.usable(torch.device("cpu"))
    assert s8wgmma.state() is None  # neither used nor turned off
    s8wgmma._PENDING.update({"a", "b"})
    assert s8wgmma.state() == ("2 s8 builds waiting for the idle time between samples (Triton's int8 builds of "
                               "those tiles run meanwhile)")
    s8wgmma._CHECKED.add(1)
    assert s8wgmma.state().startswith("s8 wgmma n256: 1 kernels, each checked bit for bit") and "; 2 s8 builds" in \
        s8wgmma.state()
    s8wgmma.turn_off("ptxas failed")
    s8wgmma.turn_off("a later reason")  # the first reason is kept
    assert s8wgmma.state() == "s8 wgmma n256 off: ptxas failed"


def test_candidates_hold_the_s8_tile_on_sm90_only_when_asked():
    big = 227 * 1024
    tile = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "S8": True}
    assert [c for c in autotune.candidates((9, 0), big, 4096, s8=True) if c.get("S8")] == [tile]
    assert [c for c in autotune.candidates((9, 0), big, 4096, s8=True, persist=True) if c.get("S8")] == [
        tile, {**tile, "PERSIST": True}]
    assert not any(c.get("S8") for c in autotune.candidates((9, 0), big, 4096))
    assert not any(c.get("S8") for c in autotune.candidates((8, 9), big, 4096, s8=True))
    assert not any(c.get("S8") for c in autotune.candidates((9, 0), big, 16, s8=True))  # GEMV tiles only
    # tunings with and without them are kept apart (INT8_FUSED_S8_WGMMA=0 gets the winner of its own candidates)
    assert autotune.ConfigCache.key(4608, 4608, 4096, True) == "N4608_K4608_M4096_s8"
    assert autotune.ConfigCache.key(4608, 4608, 4096, True, True) == "N4608_K4608_M4096_s8p"
    assert autotune.ConfigCache.key(4608, 4608, 4096) == "N4608_K4608_M4096"


@pytest.mark.parametrize("bias,out_dtype", [(False, torch.int32), (True, torch.bfloat16)])
def test_an_s8_config_runs_the_int8_build_where_the_path_cannot_run(bias, out_dtype):
    """The interpreter is such a place: an ``S8`` config launches Triton's int8 build of the same tile, whose sums
    equal torch._int_mm's (an independent reference) and whose epilogue matches the float64 one."""
    torch.manual_seed(3)
    m, n, k = 37, 48, 80  # row, column and K tails of the 32 x 32 x 32 interpreter tile
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    a_s, w_s = torch.rand(m) + 0.1, torch.rand(n) + 0.1
    b = torch.randn(n) if bias else None
    cfg = {**autotune.interpreter_configs()[0], "S8": True}
    out = torch.empty((m, n), dtype=out_dtype)
    gemm.launch_int8_gemm(a, a_s, w, w_s, b, out, cfg)
    acc = int8_matmul_ref(a, w)
    if out_dtype == torch.int32:
        assert torch.equal(out, acc) and torch.equal(acc, torch._int_mm(a, w.t()).to(acc.dtype))
    else:
        ref = acc.double() * a_s.double()[:, None] * w_s.double()[None, :] + b.double()[None, :]
        err = (out.double() - ref).abs() / (ref.abs() + 1e-30)
        assert err.max() <= 2.0 ** -8 + 1e-6


def _persist_cfg():
    return {**autotune.interpreter_configs()[0], "S8": True, "PERSIST": True}  # 32 x 32 x 32, 4 programs


@pytest.mark.parametrize("m,n,k,bias,out_dtype", [
    (150, 72, 96, True, torch.bfloat16),     # row / column tails, 15 tiles over 4 programs
    (37, 48, 80, False, torch.float16),      # K tail (80 = 2.5 K steps): TMA reads past K as zero
    (64, 64, 64, True, torch.float16),       # whole tiles
])
def test_the_persistent_kernel_gives_the_plain_kernels_bits(m, n, k, bias, out_dtype):
    """The persistent TMA kernel (here Triton's int8 build on the interpreter; on sm_90 its s8 rewrite) against the
    plain kernel of the same tile, bit for bit, and the int32 sums of both against torch._int_mm; the output starts
    poisoned (NaN), so an unwritten or a spilled-over tile shows."""
    from kernel import launch
    torch.manual_seed(5)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    a_s, w_s = torch.rand(m) * 1e-2, torch.rand(n) * 1e-2
    b = torch.randn(n).to(out_dtype) if bias else None
    cfg = _persist_cfg()
    plain = gemm.launch_int8_gemm(a, a_s, w, w_s, b, torch.empty((m, n), dtype=out_dtype),
                                  autotune.interpreter_configs()[0])
    out = torch.full((m + 3, n + 8), float("nan"), dtype=out_dtype)[:m, :n]  # a strided output: rows 16-byte aligned
    with launch.record() as rec:
        gemm.launch_int8_gemm(a, a_s, w, w_s, b, out, cfg)
    assert [ln.jit_fn for ln in rec] == [gemm._int8_gemm_persistent_kernel]
    assert s8wgmma.same_bits(out.contiguous(), plain)
    acc = int8_matmul_ref(a, w)
    assert torch.equal(acc, torch._int_mm(a, w.t()).to(acc.dtype))
    i32 = torch.empty((m, n), dtype=torch.int32)
    assert torch.equal(gemm.launch_int8_gemm(a, a_s, w, w_s, None, i32, cfg), acc.to(torch.int32))  # plain kernel


@pytest.mark.parametrize("case", ["K not 16-aligned", "fp32 out", "int32 out", "A column stride"])
def test_the_persistent_config_runs_the_plain_kernel_where_tma_cannot(case):
    """Operands a TMA descriptor cannot describe (a row stride not a multiple of 16 bytes, a strided K) or an output
    that is not 2-byte: the same tile runs as the plain kernel; same bits as the plain config."""
    from kernel import launch
    m, n, k = 40, 48, 100 if case == "K not 16-aligned" else 64
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    if case == "A column stride":
        a = torch.randint(-127, 128, (m, 2 * k), dtype=torch.int8)[:, ::2]
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    dt = {"fp32 out": torch.float32, "int32 out": torch.int32}.get(case, torch.bfloat16)
    a_s, w_s = torch.rand(m), torch.rand(n)
    assert not gemm.persistent_ok(a, w, torch.empty((m, n), dtype=dt))
    with launch.record() as rec:
        out = gemm.launch_int8_gemm(a, a_s, w, w_s, None, torch.empty((m, n), dtype=dt), _persist_cfg())
    assert [ln.jit_fn for ln in rec] == [gemm._int8_gemm_kernel]
    ref = gemm.launch_int8_gemm(a, a_s, w, w_s, None, torch.empty((m, n), dtype=dt), autotune.interpreter_configs()[0])
    assert s8wgmma.same_bits(out, ref)


def test_a_plan_of_the_persistent_kernel_makes_its_descriptors_over_the_new_tensors(monkeypatch):
    """A plan records the persistent launch with TMA descriptors of the call's tensors; a later call with other
    activations must read and write those (a descriptor kept from the recorded call would read stale rows)."""
    monkeypatch.setattr(gemm, "select_config", lambda *a, **kw: _persist_cfg())
    m, n, k = 70, 48, 64
    w, w_s = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)
    a1, s1 = torch.randint(-127, 128, (m, k), dtype=torch.int8), torch.rand(m)
    y1, p = kernel.int8_gemm_planned(a1, s1, w, w_s, None, torch.bfloat16)
    assert p is not None and any(st[0] is gemm._int8_gemm_persistent_kernel for st in p._steps)
    a2, s2 = torch.randint(-127, 128, (m, k), dtype=torch.int8), torch.rand(m)
    y2 = p(a2, s2, w, w_s, None)
    ref = gemm.launch_int8_gemm(a2, s2, w, w_s, None, torch.empty((m, n), dtype=torch.bfloat16),
                                autotune.interpreter_configs()[0])
    assert y2 is not y1 and s8wgmma.same_bits(y2, ref) and not s8wgmma.same_bits(y1, y2)


@pytest.mark.parametrize("m,n,k,split,bias,out_dtype", [
    (150, 40, 96, 2, True, torch.bfloat16),   # 5 x 2 tiles on 4 programs: 2 whole waves, a tail of 2 in 2 pieces
    (160, 32, 80, 4, False, torch.float16),   # 5 tiles: a tail of 1 in 3 pieces of 1 K step (K tail: 80 = 2.5 steps)
    (33, 72, 128, 2, True, torch.float16),    # 2 x 3 tiles: row / column tails, a tail of 2 in 2 pieces
])
def test_the_persistent_tail_split_gives_the_plain_kernels_bits(m, n, k, split, bias, out_dtype):
    """The persistent kernel with the tail split (its programs loop over the whole waves, then each runs one K piece
    of a tail tile; the last piece sums the int32 partials): the plain kernel's bits from a poisoned output, twice
    (the first launch leaves its counters at 0), and one launch of the persistent kernel, nothing else."""
    from kernel import launch
    torch.manual_seed(6)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    a_s, w_s = torch.rand(m) * 1e-2, torch.rand(n) * 1e-2
    b = torch.randn(n).to(out_dtype) if bias else None
    tiles = -(-m // 32) * -(-n // 32)
    assert tailsplit.tail_layout(tiles, 4, split, -(-k // 32))[1] > 1  # the case does split
    plain = gemm.launch_int8_gemm(a, a_s, w, w_s, b, torch.empty((m, n), dtype=out_dtype),
                                  autotune.interpreter_configs()[0])
    acc = int8_matmul_ref(a, w).double()
    ref = acc * a_s.double()[:, None] * w_s.double()[None, :] + (b.double()[None, :] if bias else 0)
    assert ((plain.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-6).all()  # the plain kernel, by hand
    for _ in range(2):
        out = torch.full((m, n), float("nan"), dtype=out_dtype)
        with launch.record() as rec:
            gemm.launch_int8_gemm(a, a_s, w, w_s, b, out, {**_persist_cfg(), "SPLIT": split})
        assert [ln.jit_fn for ln in rec] == [gemm._int8_gemm_persistent_kernel]
        assert s8wgmma.same_bits(out, plain)
        assert all(not c.any() for _, c in tailsplit._SCRATCH.values())  # every counter back at 0


def test_a_plan_of_the_persistent_tail_split_repeats_it_with_its_scratch(monkeypatch):
    """A plan of the persistent split GEMM keeps the partials / counters its launch used (``launch.keep``) and
    re-issues the launch over a later call's tensors: that call's bits, as the plain kernel gives them."""
    cfg = {**_persist_cfg(), "SPLIT": 2}
    monkeypatch.setattr(gemm, "select_config", lambda *a, **kw: cfg)
    m, n, k = 150, 40, 96  # 10 tiles on 4 programs: a tail of 2 in 2 pieces
    w, w_s = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)
    _, p = kernel.int8_gemm_planned(torch.randint(-127, 128, (m, k), dtype=torch.int8), torch.rand(m), w, w_s, None,
                                    torch.bfloat16)
    assert p is not None and [st[0] for st in p._steps] == [gemm._int8_gemm_persistent_kernel]
    part = tailsplit._SCRATCH[(None, 0)][0]
    assert any(t is part for st in p._steps for t in st[2])
    a2, s2 = torch.randint(-127, 128, (m, k), dtype=torch.int8), torch.rand(m)
    y = p(a2, s2, w, w_s, None)
    ref = gemm.launch_int8_gemm(a2, s2, w, w_s, None, torch.empty((m, n), dtype=torch.bfloat16),
                                autotune.interpreter_configs()[0])
    assert s8wgmma.same_bits(y, ref)


def test_choose_split_times_a_persistent_config_on_a_program_an_sm(tmp_path):
    """The persistent GEMM's tail: 576 tiles of 128 x 256 (Ideogram 4 o at M 4096) on 132 programs leave 48 tiles
    after 4 whole waves, room for 2 pieces each; the split is kept when it times faster, under its own key."""
    cfg = {**autotune.s8_configs()[1]}
    calls = []

    def clock(c):
        calls.append(c.get("SPLIT", 1))
        return {1: 1.0, 2: 0.9}[c.get("SPLIT", 1)]
    cache = autotune.ConfigCache(tmp_path / "c.json")
    assert tailsplit.tail_layout(576, 132, 4, 36) == (528, 2, 18)
    assert tailsplit.choose_split(cfg, 4096, 4608, 4608, 132, cache, clock) == {**cfg, "SPLIT": 2}
    assert calls == [1, 2] * tailsplit.SPLIT_ROUNDS
    assert json.loads((tmp_path / "c.json").read_text())["configs"]["N4608_K4608_M4096_s8p_T32_split"] == {"SPLIT": 2}


def test_interleaved_medians_takes_medians_and_drops_a_variant_that_fails():
    clock = {"a": [5.0, 1.0, 3.0], "b": [2.0, 9.0, 2.5]}
    order = []

    def time_fn(cfg):
        order.append(cfg["name"])
        if cfg["name"] == "c":
            raise RuntimeError("out of resources")
        return clock[cfg["name"]].pop(0)
    med = autotune.interleaved_medians({n: {"name": n} for n in "abc"}, time_fn)
    assert med == {"a": 3.0, "b": 2.5}
    assert order == ["a", "b", "c", "a", "b", "a", "b"]  # rounds interleave; "c" is not timed again
    with pytest.raises(RuntimeError):
        autotune.interleaved_medians({"c": {"name": "c"}, "a": {"name": "a"}}, time_fn)  # the first one's failure


BUILD_SCRIPT = r'''
import inspect, os, re, subprocess, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernel.swiglu as ksw
import kernel.gemm as g
from kernel import s8wgmma

TYPES = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "c_ptr": "*bf16", "h_ptr": "*bf16", "as_ptr": "*fp32",
         "ws_ptr": "*fp32", "bias_ptr": "*fp32", "part_ptr": "*i32", "cnt_ptr": "*i32", "lh_ptr": "*fp32",
         "lu_ptr": "*fp32",
         "a_desc": "tensordesc<fp8e4nv[128, 128]>", "w_desc": "tensordesc<fp8e4nv[256, 128]>",
         "c_desc": "tensordesc<bf16[128, 128]>"}
# what a launch on Ideogram 4's block shapes specializes on: unit K / column strides are the constant 1 (Triton
# specializes integers equal to 1), pointers and the other integers divisible by 16
UNIT = {"stride_ak": 1, "stride_wk": 1, "stride_cn": 1, "stride_hn": 1, "stride_as": 1, "stride_ws": 1,
        "stride_bias": 1}
TILE = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "INTERPRET": False, "LORA_R": 0,
        "LORA_STEP": 0}
CASES = [
    ("gemm bias bf16", g._int8_gemm_kernel, {"HAS_BIAS": True, "OUT_INT32": False, "EVEN_K": True, "SPLIT": 1}, {}),
    ("gemm int32", g._int8_gemm_kernel, {"HAS_BIAS": False, "OUT_INT32": True, "EVEN_K": True, "SPLIT": 1},
     {"c_ptr": "*i32"}),
    ("gemm K tail", g._int8_gemm_kernel, {"HAS_BIAS": False, "OUT_INT32": False, "EVEN_K": False, "SPLIT": 1}, {}),
    ("gemm split 2", g._int8_gemm_kernel, {"HAS_BIAS": True, "OUT_INT32": False, "EVEN_K": True, "SPLIT": 2}, {}),
    ("swiglu", ksw._gemm_swiglu_kernel, {"HAS_BIAS": False, "EVEN_K": True, "DT": 1, "CLAMP_FP16": False}, {}),
    ("persistent bias bf16", g._int8_gemm_persistent_kernel, {"HAS_BIAS": True, "SPLIT": 1}, {}),
    ("persistent fp16", g._int8_gemm_persistent_kernel, {"HAS_BIAS": False, "SPLIT": 1},
     {"c_desc": "tensordesc<fp16[128, 128]>"}),
    ("persistent split 2", g._int8_gemm_persistent_kernel, {"HAS_BIAS": False, "SPLIT": 2}, {}),
    ("swiglu persistent", ksw._gemm_swiglu_persistent_kernel,
     {"HAS_BIAS": False, "DT": 1, "CLAMP_FP16": False},
     {"w_desc": "tensordesc<fp8e4nv[2, 128, 128]>", "h_desc": "tensordesc<bf16[128, 128]>"}),
]
cuobjdump = os.path.join(os.path.dirname(s8wgmma.ptxas_path()), "cuobjdump")
for name, fn, consts, types in CASES:
    params = list(inspect.signature(fn.fn).parameters)
    consts = {p: v for p, v in {**UNIT, **TILE, **consts}.items() if p in params}
    sig = {p: "constexpr" if p in consts else {**TYPES, **types}.get(p, "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if p not in consts and "desc" not in p and p != "NUM_PROGS"}  # 132 SMs: not a multiple of 16
    k8 = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
    before = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+\.\w+\.\w+\.\w+)", k8.asm["ptx"])))
    k = s8wgmma.rewritten(k8)
    after = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+\.\w+\.\w+\.\w+)", k.asm["ptx"])))
    ok = before == ["m64n256k32.f32.e4m3.e4m3"] and after == ["m64n256k32.s32.s8.s8"]
    ok = ok and k.kernel == k.asm["cubin"] and k.kernel != k8.kernel and k.module is None
    res = ""
    if os.path.exists(cuobjdump):
        with open(os.path.join(sys.argv[2], "k.cubin"), "wb") as f:
            f.write(k.kernel)
        res = subprocess.run([cuobjdump, "-res-usage", os.path.join(sys.argv[2], "k.cubin")], capture_output=True,
                             text=True).stdout
        ok = ok and "STACK:0" in res  # no spills at one CTA an SM
    print(name, "OK" if ok else "BAD", before, after, re.findall(r"REG:\d+ STACK:\d+", res))
'''


@pytest.mark.slow
def test_pack_gemm_kernels_build_for_sm90_as_s8_wgmma_n256(tmp_path):
    """The plain GEMM (bias, int32 out, K tail, tail split), the SwiGLU-epilogue GEMM and the persistent TMA forms
    of both (bf16 with a bias, fp16, tail split; SwiGLU) at 128 x 256 tiles, built
    for sm_90 with fp8 operand types as ``kernel.s8wgmma`` builds them: Triton issues their dots as fp8 n256 wgmma,
    the rewrite leaves only s8 n256 ones, ptxas assembles them, and (where cuobjdump ships) nothing spills. In a
    subprocess without TRITON_INTERPRET."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", BUILD_SCRIPT, str(ROOT), str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 9 and all(" OK " in ln for ln in lines), out[-3000:]



def test_assembled_kernels_are_kept_on_disk_for_the_next_process(tmp_path, monkeypatch):
    """A second process assembles nothing: the cubin is kept under INT8_FUSED_CACHE_DIR/s8-cubin, named by the PTX,
    the flags and the ptxas binary; a damaged file is assembled again and replaced."""
    from kernel import config, s8wgmma
    runs = []

    def fake_assemble(ptx, arch, fp_fusion, extra):
        runs.append((ptx, arch, fp_fusion, extra))
        return b"\x7fELF" + ptx.encode()
    monkeypatch.setattr(s8wgmma, "_assemble", fake_assemble)
    with config.override(INT8_FUSED_CACHE_DIR=str(tmp_path)):
        a = s8wgmma.assemble("ptx one", 90)
        assert s8wgmma.assemble("ptx one", 90) == a == b"\x7fELFptx one" and len(runs) == 1
        s8wgmma.assemble("ptx one", 90, fp_fusion=False)
        assert len(runs) == 2                                          # other flags: another binary
        assert s8wgmma.assemble("ptx two", 90) == b"\x7fELFptx two" and len(runs) == 3
        files = sorted((tmp_path / "s8-cubin").glob("*.cubin"))
        assert len(files) == 3
        for f in files:
            f.write_bytes(b"garbage")
        assert s8wgmma.assemble("ptx one", 90) == a and len(runs) == 4  # damaged: assembled again
        assert s8wgmma.assemble("ptx one", 90) == a and len(runs) == 4  # and replaced
