"""Attention routing (quant/attention.py, nodes/attention.py, the Apply node's ``attention`` input) on the CPU, with
the pinned ComfyUI in-process.

* Every argument form ComfyUI's ``attention_pytorch`` takes (3-D or 4-D q/k/v, skip_output_reshape, masks of rank
  2/3/4, float or bool, a scale, GQA with and without a mask) equals a float64 reference
  softmax(Q K^T * scale + mask) V written here, in every mode (on a CPU torch runs its CPU kernels whatever the
  priority: the modes must not crash and must give the same numbers), and equals ComfyUI's own function.
* A call the Router does not know (an unknown keyword) goes to ComfyUI's function unchanged.
* ``auto`` picks the fastest backend of injected fake timings, once per shape key (a new Lq, a mask: a new
  probe), never one that cannot run, and keeps the winner in its cache (a JSON file: a second Router reads it and
  probes nothing). On a CPU, without probing allowed there, ``auto`` is ComfyUI's own function.
* The Apply node installs the override only for choices other than comfy_default; tiny Flux and Lumina 2 give
  ComfyUI's outputs (fp32) with every choice; the timing run reports the attention backend that ran.
"""
import json
import math

import pytest
import torch

MODES_ROUTED = ("math", "efficient", "flash", "cudnn")


@pytest.fixture(scope="module")
def att(pack):
    return pack.quant.attention


@pytest.fixture(scope="module")
def comfy_attention(comfy_inprocess):
    import comfy.ldm.modules.attention as a
    return a


def _ref(q, k, v, mask=None, scale=None):
    """float64 softmax(Q K^T * scale + mask) V on [B, H, L, D]; K/V heads repeated for GQA; bool mask: True
    attends."""
    q, k, v = q.double(), k.double(), v.double()
    if k.shape[1] != q.shape[1]:
        r = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        m = mask
        while m.ndim < 4:
            m = m.unsqueeze(0) if m.ndim == 2 else m.unsqueeze(1)
        s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.double()
    return torch.softmax(s, -1) @ v


def _qkv(b=2, h=4, hk=4, lq=5, lk=7, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, lq, d, generator=g), torch.randn(b, hk, lk, d, generator=g),
            torch.randn(b, hk, lk, d, generator=g))


def _masks(b=2, h=4, lq=5, lk=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(b, 1, lq, lk, generator=g) > 0.4
    keep[..., 0] = True  # every query attends to something
    block = torch.zeros(b, 1, lq, lk).masked_fill_(~keep, -torch.finfo(torch.float32).max)  # Ideogram 4's
    return {
        "none": None,
        "2d additive": torch.randn(lq, lk, generator=g),
        "3d additive": torch.randn(b, lq, lk, generator=g),
        "4d per head": torch.randn(b, h, lq, lk, generator=g),
        "4d bool": keep,
        "4d block": block,
    }


def _flat(t):
    """[B, H, L, D] -> ComfyUI's [B, L, H*D]."""
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


@pytest.mark.parametrize("mode", MODES_ROUTED)
def test_router_equals_float64_reference_in_every_argument_form(att, mode):
    router = att.Router(mode)
    never = lambda *a, **k: pytest.fail("ComfyUI's function called for a call the Router takes")  # noqa: E731
    q, k, v = _qkv()
    for name, mask in _masks().items():
        ref = _ref(q, k, v, mask)
        out4 = router(never, q, k, v, 4, mask=mask, skip_reshape=True, skip_output_reshape=True,
                      transformer_options={}, _inside_attn_wrapper=True)
        assert out4.shape == ref.shape and torch.allclose(out4.double(), ref, atol=1e-5, rtol=1e-5), name
        out3 = router(never, _flat(q), _flat(k), _flat(v), 4, mask, None, False, False)  # positional, 3-D
        assert out3.shape == (2, 5, 32) and torch.allclose(out3.double(), _flat(ref), atol=1e-5, rtol=1e-5), name
        out43 = router(never, q, k, v, 4, mask=mask, skip_reshape=True)  # 4-D in, [B, L, H*D] out
        assert torch.allclose(out43.double(), _flat(ref), atol=1e-5, rtol=1e-5), name
    out = router(never, q, k, v, 4, skip_reshape=True, skip_output_reshape=True, scale=0.05)
    assert torch.allclose(out.double(), _ref(q, k, v, scale=0.05), atol=1e-5, rtol=1e-5)
    qg, kg, vg = _qkv(hk=2, seed=3)  # GQA: 4 query heads on 2 K/V heads
    for mask in (None, _masks()["4d bool"]):
        ref = _ref(qg, kg, vg, mask)
        out = router(never, qg, kg, vg, 4, mask=mask, skip_reshape=True, skip_output_reshape=True, enable_gqa=True)
        assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
        out = router(never, _flat(qg), _flat(kg), _flat(vg), 4, mask=mask, enable_gqa=True)
        assert torch.allclose(out.double(), _flat(ref), atol=1e-5, rtol=1e-5)
    ran = dict(router.counts)
    assert sum(ran.values()) == 6 * 3 + 1 + 4 and set(ran) <= {"flash", "math"}  # a CPU has these two
    if mode == "math":
        assert ran == {"math": 23}


def test_router_equals_comfyuis_attention_pytorch(att, comfy_attention):
    """ComfyUI's own SDPA path (the undecorated function, as wrap_attn hands it to an override) on the same calls."""
    func = comfy_attention.attention_pytorch.__wrapped__
    q, k, v = _qkv(seed=5)
    for mode in MODES_ROUTED:
        router = att.Router(mode)
        for name, mask in _masks().items():
            for kw in ({"skip_reshape": True, "skip_output_reshape": True}, {"skip_reshape": True}):
                want = func(q, k, v, 4, mask=mask, **kw)
                got = router(func, q, k, v, 4, mask=mask, **kw)
                assert router.counts["comfy_default"] == 0
                assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (mode, name, kw)


def test_calls_it_cannot_take_go_to_comfyuis_function(att):
    seen = []

    def comfy_fn(*args, **kwargs):
        seen.append((args, kwargs))
        return "comfy"

    router = att.Router("cudnn")
    q, k, v = _qkv()
    assert router(comfy_fn, q, k, v, 4, skip_reshape=True, var_length=[3, 5]) == "comfy"  # unknown keyword
    assert router(comfy_fn, q, k, v, 4) == "comfy"  # 4-D tensors without skip_reshape
    assert len(seen) == 2 and seen[0][1] == {"skip_reshape": True, "var_length": [3, 5]} and seen[0][0][3] == 4
    assert dict(router.counts) == {"comfy_default": 2}


def test_a_call_torch_sends_to_cudnn_runs_its_op_directly(att, monkeypatch):
    """Where torch runs cuDNN for the call's shape (``_which``; forced here, a CPU has no cuDNN attention), the
    Router calls torch's cuDNN op itself (a stand-in computing the float64 reference, as the op's output tuple)
    with the call's q, k, v and scale, and returns its output in ComfyUI's layout, counted as cudnn. A mask, a
    keyword but ``scale``, a tensor that needs a gradient or another device: torch's SDPA under the priority context
    (the stand-in is not called)."""
    calls = []

    def op(q, k, v, bias, lse, dropout, causal, debug, scale=None):
        calls.append((bias, lse, dropout, causal, debug, scale))
        return (_ref(q, k, v, scale=scale).to(q.dtype), None)
    monkeypatch.setattr(att, "_CUDNN_OP", op)
    monkeypatch.setattr(att.Router, "_which", lambda self, *a: "cudnn")
    router = att.Router("cudnn", direct_devices=("cpu",))
    never = lambda *a, **k: pytest.fail("ComfyUI's function called")  # noqa: E731
    q, k, v = _qkv(seed=9)
    out = router(never, _flat(q), _flat(k), _flat(v), 4, None, None, False, False, scale=0.1)
    assert torch.equal(out, _flat(_ref(q, k, v, scale=0.1).float()))
    assert calls == [(None, False, 0.0, False, False, 0.1)] and dict(router.counts) == {"cudnn": 1}
    mask = _masks()["4d bool"]
    qg, kg, vg = _qkv(hk=2, seed=3)  # GQA: 4 query heads on 2 K/V heads, SDPA's enable_gqa keyword
    others = [((q, k, v, 4), {"mask": mask, "skip_reshape": True}),
              ((qg, kg, vg, 4), {"skip_reshape": True, "enable_gqa": True}),
              ((q.clone().requires_grad_(), k, v, 4), {"skip_reshape": True})]
    for args, kw in others:
        with torch.enable_grad():
            got = router(never, *args, **kw)
        assert torch.allclose(got.double(), _flat(_ref(*args[:3], kw.get("mask"))), atol=1e-5, rtol=1e-5)
    assert len(calls) == 1
    assert not att.direct_cudnn_ok(q, k, v, None, {})  # a CPU tensor: default devices are CUDA only
    assert router.counts["cudnn"] == 4
    router(never, q, k, v, 4, skip_reshape=True)
    assert len(calls) == 2


class _MemCache:
    """The ConfigCache interface in memory."""

    def __init__(self):
        self.data = {}

    def get(self, key):
        return self.data.get(key)

    def put(self, key, value, meta=None):
        self.data[key] = value


def test_auto_picks_the_fastest_fake_timing_once_per_shape(att, first_call_tuning):
    calls = []
    fake = {"cudnn": 3.0, "flash": 5.0, "efficient": 4.0}

    def time_fn(name, run):
        calls.append(name)
        return fake[name]

    cache = _MemCache()
    router = att.Router("auto", time_fn=time_fn, cache=cache, probe_devices=("cpu",))
    never = lambda *a, **k: pytest.fail("auto probed on the CPU must not call ComfyUI's function")  # noqa: E731
    q, k, v = _qkv()
    out = router(never, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert torch.allclose(out.double(), _ref(q, k, v), atol=1e-5)
    assert sorted(calls) == ["cudnn", "efficient", "flash"]
    key = att.shape_key(q, k, None)
    assert router.winners == {key: "cudnn"} and router.probes[key] == fake
    assert cache.data[att.key_text(key)]["backend"] == "cudnn"
    fake.update(cudnn=9.0)  # a second probe would now choose efficient: there is none for the same shape
    router(never, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(calls) == 3
    q2, k2, v2 = _qkv(lq=9)  # another shape: probed again
    router(never, q2, k2, v2, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(calls) == 6 and router.winners[att.shape_key(q2, k2, None)] == "efficient"
    mask = _masks()["4d bool"]  # same shape with a mask: its own key
    out = router(never, q, k, v, 4, mask=mask, skip_reshape=True, skip_output_reshape=True)
    assert len(calls) == 9 and torch.allclose(out.double(), _ref(q, k, v, mask), atol=1e-5)
    assert len(router.winners) == 3
    # A new Router (a new process) with the same cache reads the winners and times nothing.
    again = att.Router("auto", time_fn=lambda n, r: pytest.fail("probed a cached shape"), cache=cache,
                       probe_devices=("cpu",))
    again(never, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert again.winners == {key: "cudnn"}


def test_auto_never_picks_a_backend_that_cannot_run_and_persists_to_json(att, pack, tmp_path, first_call_tuning):
    """The timing function runs each backend alone (sdpa_kernel([name])): on a CPU only torch's CPU flash kernel
    runs, so cuDNN and efficient count as unable to run however fast their fake time is."""
    import importlib
    at = importlib.import_module(pack.__name__ + ".kernel.autotune")
    cache = at.ConfigCache(tmp_path / "attention.json")
    fake = {"cudnn": 1.0, "flash": 7.0, "efficient": 2.0}

    def time_fn(name, run):
        out = run()  # raises for a backend that cannot take the call
        assert out.shape == (2, 4, 5, 8)
        return fake[name]

    router = att.Router("auto", time_fn=time_fn, cache=cache, probe_devices=("cpu",))
    q, k, v = _qkv()
    router(None, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    key = att.shape_key(q, k, None)
    assert router.winners[key] == "flash"
    assert router.probes[key]["flash"] == 7.0 and math.isinf(router.probes[key]["cudnn"])
    data = json.loads((tmp_path / "attention.json").read_text())["configs"][att.key_text(key)]
    assert data == {"backend": "flash", "ms": {"cudnn": None, "flash": 7.0, "efficient": None}}
    fresh = att.Router("auto", time_fn=lambda n, r: pytest.fail("probed"), probe_devices=("cpu",),
                       cache=at.ConfigCache(tmp_path / "attention.json"))
    fresh(None, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert fresh.winners[key] == "flash"


def test_auto_on_a_cpu_is_comfyuis_function(att):
    router = att.Router("auto", time_fn=lambda n, r: pytest.fail("probed on a CPU"))
    q, k, v = _qkv()
    assert router(lambda *a, **kw: "comfy", q, k, v, 4, skip_reshape=True) == "comfy"
    assert dict(router.counts) == {"comfy_default": 1} and router.winners == {}


def test_pick_fastest_and_orders(att):
    best, times = att.pick_fastest(["a", "b", "c"], lambda n: {"a": 2.0, "c": 1.5}[n])  # b raises KeyError
    assert best == "c" and math.isinf(times["b"])
    assert att.pick_fastest(["a"], lambda n: 1 / 0) == (None, {"a": math.inf})
    assert att.order("cudnn") == ("cudnn", "flash", "efficient", "math")
    assert att.order("efficient") == ("efficient", "flash", "cudnn", "math")
    assert att.order("math") == ("math",)
    with pytest.raises(ValueError, match="choose one of comfy_default, auto, cudnn.*int8, sage"):
        att.check_mode("xformers")


# ------------------------------------------------------------------------------------ through the Apply node
def _run_model(comfy, mp, arch, seed=1):
    """One denoiser call the way samplers run it: the patcher's transformer_options (with the override) included."""
    comfy.model_management.load_models_gpu([mp])
    g = torch.Generator().manual_seed(seed)
    x, ctx = torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 8, 64, generator=g)
    extra = {"num_tokens": 8} if arch == "lumina2" else {"y": torch.randn(2, 64, generator=g)}
    to = dict(mp.model_options.get("transformer_options", {}))
    with torch.no_grad():
        return mp.model.apply_model(x, torch.tensor([0.6, 0.3]), c_crossattn=ctx, transformer_options=to,
                                    **extra).float()


@pytest.fixture(scope="module")
def comfy(comfy_inprocess):
    import comfy.model_management
    import comfy.sample
    return comfy


def test_apply_installs_the_override_only_when_asked(pack, comfy):
    import comfy_harness
    node = pack.nodes.apply.ApplyFusedInt8GEMM()
    spec = node.INPUT_TYPES()["optional"]["attention"]
    assert spec[0] == ["comfy_default", "auto", "cudnn", "flash", "efficient", "math", "int8"]
    assert spec[1]["default"] == "auto" and "CPU auto is comfy_default" in spec[1]["tooltip"]
    m = comfy_harness.load_tiny("flux")
    for backend in ("bf16", "dequant_bf16"):
        (plain,) = node.apply(m, backend, attention="comfy_default")
        assert "optimized_attention_override" not in plain.model_options.get("transformer_options", {})
        (default,) = node.apply(m, backend)  # the default: auto
        assert default.model_options["transformer_options"]["optimized_attention_override"].mode == "auto"
        (routed,) = node.apply(m, backend, attention="cudnn")
        ov = routed.model_options["transformer_options"]["optimized_attention_override"]
        assert isinstance(ov, pack.quant.attention.Router) and ov.mode == "cudnn"
        assert "optimized_attention_override" not in m.model_options.get("transformer_options", {})
    with pytest.raises(ValueError, match="unknown attention mode 'xformers'"):
        node.apply(m, "bf16", attention="xformers")


@pytest.mark.parametrize("arch", ["flux", "lumina2"])
def test_tiny_models_equal_comfyuis_attention_with_every_choice(pack, comfy, arch):
    import comfy_harness
    node = pack.nodes.apply.ApplyFusedInt8GEMM()
    m = comfy_harness.load_tiny(arch)
    want = _run_model(comfy, node.apply(m, "bf16")[0], arch)
    for mode in MODES_ROUTED + ("auto",):
        (routed,) = node.apply(m, "bf16", attention=mode)
        got = _run_model(comfy, routed, arch)
        err = float((got - want).norm() / want.norm())
        assert err < 1e-5, (mode, err)
        ran = routed.model_options["transformer_options"]["optimized_attention_override"].counts
        assert sum(ran.values()) > 0
        assert set(ran) == ({"comfy_default"} if mode == "auto" else {"math"} if mode == "math" else set(ran))
        assert set(ran) <= {"flash", "math", "comfy_default"}


def test_timing_reports_the_attention_that_ran(pack, comfy, monkeypatch, caplog):
    """Tiny Flux (2 double + 2 single blocks: 4 attention calls per model call), 2 CFG steps, through the node."""
    import comfy_harness
    timing = pack.nodes.timing
    sent = []
    monkeypatch.setattr(timing, "_send", lambda event, data: sent.append((event, data)))
    node = pack.nodes.apply.ApplyFusedInt8GEMM()
    m = comfy_harness.load_tiny("flux", seed=6)
    g = torch.Generator().manual_seed(0)
    cond = lambda: [[torch.randn(1, 4, 64, generator=g), {"pooled_output": torch.randn(1, 64, generator=g)}]]  # noqa
    latent = torch.zeros(1, 16, 8, 8)
    for mode in ("math", "comfy_default"):
        (q,) = node.apply(m, "bf16", attention=mode, unique_id="77")
        with caplog.at_level("INFO", logger="int8_fused"):
            comfy.sample.sample(q, torch.randn(latent.shape, generator=g), 2, 2.0, "euler", "simple", cond(), cond(),
                                latent, disable_pbar=True, seed=0)
    (s_math, s_default) = [d for e, d in sent if e == "int8_fused.summary"]
    steps = [d for e, d in sent if e == "int8_fused.step"]
    assert s_math["calls"] == 2  # cond and uncond batched: one model call per step
    assert (s_math["attention"], s_math["attention_requested"], s_math["attentions"]) == ("math", "math", {"math": 8})
    assert all(s["attention"] == "math" for s in steps[:2])
    assert (s_default["attention"], s_default["attention_requested"], s_default["attentions"]) == (
        "comfy_default", "comfy_default", {})
    logs = [r.getMessage() for r in caplog.records if "node 77 ran" in r.getMessage()]
    assert len(logs) == 2 and "bf16, attn math on cpu" in logs[0] and "attn" not in logs[1]


def test_attention_labels(pack):
    label = pack.nodes.timing.attention_label
    assert label("cudnn", "cudnn", {"cudnn": 68}) == "cudnn"
    assert label("flash", "cudnn", {"flash": 68}) == "flash (requested cudnn)"
    assert label("flash", "auto", {"flash": 68}) == "flash (auto)"
    assert label("cudnn", "auto", {"cudnn": 64, "flash": 4}) == "cudnn (auto; 4 of 68 calls on flash)"
    assert label("efficient", "efficient", {"efficient": 3, "comfy_default": 1}) == \
        "efficient (1 of 4 calls on comfy_default)"


def test_auto_under_torch_compile_reads_no_file_and_breaks_no_graph(att, tmp_path, monkeypatch):
    """Under torch.compile ``auto`` takes a winner an eager call picked, else ComfyUI's function; it never builds or
    reads its JSON cache inside a traced graph (dynamo cannot trace the cache's path handling: on the H200 the first
    compiled Flux.1 call failed there). ``fullgraph=True`` turns any graph break into an error."""
    monkeypatch.setattr(att, "disk_cache", lambda *a, **k: pytest.fail("the JSON cache was reached while tracing"))
    router = att.Router("auto", time_fn=lambda n, r: pytest.fail("probed while tracing"), probe_devices=("cpu",))

    def comfy(q, k, v, heads, skip_reshape=False, skip_output_reshape=False):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v) * 2  # tells its output apart

    q, k, v = _qkv()
    fn = torch.compile(lambda q, k, v: router(comfy, q, k, v, 4, skip_reshape=True, skip_output_reshape=True),
                       backend="eager", fullgraph=True)
    out = fn(q, k, v)
    assert torch.allclose(out.double(), 2 * _ref(q, k, v), atol=1e-5)  # ComfyUI's function ran
    assert router.winners == {}
    # a winner an eager call picked is used in the traced graph: routed SDPA, not ComfyUI's function
    router.winners[att.shape_key(q, k, None)] = "math"
    torch._dynamo.reset()
    out = fn(q, k, v)
    assert torch.allclose(out.double(), _ref(q, k, v), atol=1e-5)


# ------------------------------------------------------------------------------------ the attention the user chose
def _recording(name, calls, scale_out=1.0):
    """A stand-in of one of ComfyUI's attention functions, named as ComfyUI names it (``attention_sage`` is what
    ``--use-sage-attention`` selects): records each call, computes exact SDPA (times ``scale_out``, to tell its
    output apart)."""
    def fn(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
        calls.append(tuple(q.shape))
        assert skip_reshape and skip_output_reshape
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask) * scale_out
    fn.__name__ = name
    return fn


def test_auto_keeps_the_users_attention_unless_an_exact_backend_is_clearly_faster(att, first_call_tuning, caplog):
    """ComfyUI started with --use-sage-attention hands the override ``attention_sage``: auto times it with the exact
    backends and keeps it unless one is at least USER_MARGIN faster; the winner is cached under a key naming it."""
    calls = []
    sage = _recording("attention_sage", calls, scale_out=2.0)
    # on a CPU only torch's flash kernel runs of the exact ones (cudnn / efficient raise: "cannot run")
    fake = {"user": 1.00, "cudnn": 0.5, "flash": 0.97, "efficient": 0.5}  # flash 3 % faster: within the margin

    def time_fn(name, run):
        out = run()
        assert out.shape[:2] == (2, 4)
        return fake[name]

    cache = _MemCache()
    router = att.Router("auto", time_fn=time_fn, cache=cache, probe_devices=("cpu",))
    q, k, v = _qkv()
    with caplog.at_level("INFO", logger="int8_fused"):
        out = router(sage, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert torch.allclose(out.double(), 2 * _ref(q, k, v), atol=1e-5)  # the user's function gave the output
    key = att.shape_key(q, k, None) + ("user:sage",)
    assert router.winners == {key: "user"} and dict(router.counts) == {"sage": 1}
    text = att.key_text(key[:9]) + "_user-sage"
    assert cache.data[text]["backend"] == "user" and cache.data[text]["ms"]["user"] == 1.0
    assert any("your attention (sage) runs" in r.getMessage() for r in caplog.records)
    # another shape where flash is 10 % faster: flash replaces it there, said with both times
    fake.update(flash=0.90)
    q2, k2, v2 = _qkv(lq=9)
    with caplog.at_level("INFO", logger="int8_fused"):
        out = router(sage, q2, k2, v2, 4, skip_reshape=True, skip_output_reshape=True)
    assert torch.allclose(out.double(), _ref(q2, k2, v2), atol=1e-5)
    assert router.counts["sage"] == 1 and sum(router.counts.values()) == 2
    assert any("flash replaces your attention (sage)" in r.getMessage() and "0.900 ms against 1.000 ms"
               in r.getMessage() for r in caplog.records)
    # a user's function that cannot run loses to the fastest exact backend
    fake.update(user=math.inf)
    q3, k3, v3 = _qkv(lk=11)
    router(_recording("attention_sage", [], 2.0), q3, k3, v3, 4, skip_reshape=True, skip_output_reshape=True)
    assert router.winners[att.shape_key(q3, k3, None) + ("user:sage",)] == "flash"
    # a new process reads the winners and times nothing; without a user's choice the same shape is its own key
    again = att.Router("auto", time_fn=lambda n, r: pytest.fail("probed a cached shape"), cache=cache,
                       probe_devices=("cpu",))
    n = len(calls)
    again(sage, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(calls) == n + 1 and dict(again.counts) == {"sage": 1}


def test_keep_user_margin(att):
    assert att.keep_user("cudnn", {"user": 1.0, "cudnn": 0.951}) == "user"
    assert att.keep_user("cudnn", {"user": 1.0, "cudnn": 0.949}) == "cudnn"
    assert att.keep_user("flash", {"user": math.inf, "flash": 2.0, "cudnn": math.inf}) == "flash"
    assert att.keep_user(None, {"user": 3.0, "cudnn": math.inf}) == "user"


def test_auto_in_background_keeps_the_users_attention_and_times_it_for_the_next_process(att, pack, monkeypatch):
    """INT8_FUSED_TUNE=background (the default): the user's attention runs at once; the queued job times it on fresh
    tensors of the call's own argument form next to the exact backends and writes the winner for the next process;
    this process keeps the user's attention."""
    from kernel import config, deferred
    q_ = deferred.Queue(start_worker=False)
    monkeypatch.setattr(deferred, "QUEUE", q_)
    calls = []
    sage = _recording("attention_sage", calls, scale_out=2.0)
    timed = []

    def time_fn(name, run):
        timed.append(name)
        out = run()  # on a CPU cudnn and efficient raise here: "cannot run"
        assert tuple(out.shape) == (2, 4, 5, 8)
        return {"user": 2.0, "flash": 1.5}[name]

    cache = _MemCache()
    router = att.Router("auto", time_fn=time_fn, cache=cache, probe_devices=("cpu",))
    q, k, v = _qkv()
    with config.override(INT8_FUSED_TUNE="background"):
        out = router(sage, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
        assert torch.allclose(out.double(), 2 * _ref(q, k, v), atol=1e-5) and timed == []
        assert len(q_.pending()) == 1 and q_.drain() == 1
    assert timed == ["user", "cudnn", "flash", "efficient"]
    assert len(calls) == 2 and calls[1] == calls[0]  # the call, then the probe on fresh tensors of the same form
    (entry,) = cache.data.values()
    assert entry == {"backend": "flash", "ms": {"user": 2.0, "cudnn": None, "flash": 1.5, "efficient": None}}
    out = router(sage, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)  # this process keeps the user's
    assert torch.allclose(out.double(), 2 * _ref(q, k, v), atol=1e-5) and dict(router.counts) == {"sage": 2}


def test_sage_mode_runs_comfyuis_sage_function_for_the_calls_it_takes(att):
    """``sage``: ComfyUI's SageAttention function (a recording stand-in, allowed on the CPU here) for head_dim
    64/96/128 without a mask; any other call runs on an exact backend, counted under it."""
    calls = []
    sage = _recording("attention_sage", calls, scale_out=2.0)
    with pytest.raises(ValueError, match="sage needs"):
        att.Router("sage")
    router = att.Router("sage", sage_fn=sage, sage_devices=("cpu",))
    never = lambda *a, **k: pytest.fail("ComfyUI's function ran")  # noqa: E731
    q, k, v = _qkv(d=64)
    out = router(never, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert torch.allclose(out.double(), 2 * _ref(q, k, v), atol=1e-5) and len(calls) == 1
    q8, k8, v8 = _qkv(d=8)  # head_dim 8: not SageAttention's
    out = router(never, q8, k8, v8, 4, skip_reshape=True, skip_output_reshape=True)
    assert torch.allclose(out.double(), _ref(q8, k8, v8), atol=1e-5)
    mask = _masks()["4d bool"]  # a mask: an exact backend too
    out = router(never, q, k, v, 4, mask=mask, skip_reshape=True, skip_output_reshape=True)
    assert torch.allclose(out.double(), _ref(q, k, v, mask), atol=1e-5)
    assert len(calls) == 1 and router.counts["sage"] == 1 and sum(router.counts.values()) == 3
    assert set(router.counts) - {"sage"} <= {"flash", "math"}
    # on a device SageAttention does not run on (its default: CUDA only) nothing goes to it
    cpu_router = att.Router("sage", sage_fn=sage)
    cpu_router(never, q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert len(calls) == 1 and "sage" not in cpu_router.counts


def test_an_upstream_override_survives_apply(pack, comfy):
    """An attention node before Apply (an override in transformer_options) is the user's choice: auto keeps it (on
    a CPU every call goes to it, counted under its name); an explicit backend runs in its place and hands it what it
    does not take; comfy_default leaves it; a second Apply keeps the same upstream, not the first Router."""
    import comfy_harness
    att = pack.quant.attention
    node = pack.nodes.apply.ApplyFusedInt8GEMM()
    m = comfy_harness.load_tiny("flux")
    want = _run_model(comfy, node.apply(m, "bf16", attention="comfy_default")[0], "flux")
    calls = []

    def my_override(func, *args, **kwargs):
        calls.append(func.__name__)
        return func(*args, **kwargs)

    up = m.clone()
    up.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = my_override
    (auto,) = node.apply(up, "bf16")  # the default: auto
    router = auto.model_options["transformer_options"]["optimized_attention_override"]
    assert isinstance(router, att.Router) and router.upstream is my_override
    got = _run_model(comfy, auto, "flux")
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert len(calls) > 0 and dict(router.counts) == {"upstream:my_override": len(calls)}
    (again,) = node.apply(auto, "bf16", attention="auto")
    assert again.model_options["transformer_options"]["optimized_attention_override"].upstream is my_override
    n = len(calls)
    (routed,) = node.apply(up, "bf16", attention="math")
    got = _run_model(comfy, routed, "flux")
    assert float((got - want).norm() / want.norm()) < 1e-5 and len(calls) == n
    r = routed.model_options["transformer_options"]["optimized_attention_override"]
    q, k, v = _qkv()
    r(lambda *a, **kw: "comfy", q, k, v, 4, skip_reshape=True, unknown_keyword=1)  # a call math does not take
    assert calls[-1] == "<lambda>" and r.counts["upstream:my_override"] == 1
    (plain,) = node.apply(up, "bf16", attention="comfy_default")
    assert plain.model_options["transformer_options"]["optimized_attention_override"] is my_override


def test_upstream_names(att):
    def optimized_attention_override(_, *args, **kwargs):  # as ModelPatcher.set_model_optimized_attention builds it
        return attention_sage(*args, **kwargs)

    def attention_sage(*a, **k):
        return None
    assert att.upstream_name(optimized_attention_override) == "upstream:sage"
    assert att.upstream_name(lambda f, *a, **k: f(*a, **k)) == "upstream:<lambda>"
    assert att.chosen_name(attention_sage) == "sage" and att.chosen_name(lambda: 0) is None
