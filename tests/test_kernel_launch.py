"""kernel/launch.py: when the direct re-launch of a compiled kernel is taken, with the real ``triton.knobs``.

The fast path itself needs a CUDA device (a compiled kernel and a stream), so here the compiled kernel is a
recording stand-in: these tests check the launcher's decisions (which path each call dispatches to, with
which arguments), not the GPU launch. bench/kernels.py checks the direct launch's results on the GPU.

Run: TRITON_INTERPRET=1 python -m pytest tests/test_kernel_launch.py -q
"""
import pytest
import torch

triton = pytest.importorskip("triton")
from kernel import launch as kl  # noqa: E402
from launch_standins import Jit as _Jit  # noqa: E402

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def fast(monkeypatch):
    """The launcher as on a CUDA machine without TRITON_INTERPRET (a stand-in stream), with an empty cache."""
    monkeypatch.setattr(kl, "_USE_FAST", True)
    monkeypatch.setattr(kl, "_COMPILED", {})
    monkeypatch.setattr(kl, "_SAME_CALL", None)  # decided from the installed Triton's source
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 4242, raising=False)
    return kl


def _go(jit, x, n=100, block=64):
    kl.launch(jit, (3,), (x, n), dict(BLOCK=block, SINGLE=True), 4, 1, CUDA0)


def test_this_tritons_launcher_call_is_the_one_repeated():
    """The installed Triton's JITFunction.run hands its compiled kernel to the launcher exactly as launch() does
    (read from its source); the fast path depends on it."""
    import inspect

    from triton.runtime.jit import JITFunction
    kl._SAME_CALL = None
    assert kl.same_launcher_call()
    assert "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata" in \
        inspect.getsource(JITFunction.run)


def test_a_triton_with_another_launcher_call_gets_tritons_path(fast, monkeypatch, caplog):
    """A Triton whose run() launches differently: every call goes through Triton, with one log line."""
    monkeypatch.setattr(kl, "_SAME_CALL", None)
    monkeypatch.setattr(kl, "_TRITON_CALL", "kernel.run(grid, stream, a_future_signature)")
    with caplog.at_level("INFO", logger="int8_fused"):
        jit, x = _Jit(), torch.zeros(8)
        for _ in range(3):
            _go(jit, x)
    assert len(jit.slow) == 3 and jit.compiled.runs == []
    assert sum("launches kernels differently" in r.getMessage() for r in caplog.records) == 1


def test_no_hooks_installed_in_this_process():
    """The precondition of the tests below: nothing (a profiler) has hooked Triton's launches."""
    assert not kl.launch_hooked(triton.knobs.runtime)


def test_second_launch_takes_the_direct_path(fast):
    jit, x = _Jit(), torch.zeros(8)
    _go(jit, x)
    assert len(jit.slow) == 1 and jit.compiled.runs == []          # first call: compiles through Triton
    _go(jit, x)
    _go(jit, x)
    assert len(jit.slow) == 1 and len(jit.compiled.runs) == 2      # then: the cached kernel, directly
    c = jit.compiled
    # grid, stream, function, metadata, no launch metadata / hooks, runtime args, then the constexpr tail
    assert c.runs[0] == (3, 1, 1, 4242, c.function, c.packed_metadata, None, None, None, x, 100, 64, True)


@pytest.mark.parametrize("grid", [(3, 9), (3, 9, 2)])
def test_direct_path_keeps_every_grid_dimension(fast, grid):
    """A 2-D / 3-D grid (the QK kernel's (tokens, head groups)) reaches the launcher whole, not as (grid[0], 1, 1)."""
    jit, x = _Jit(), torch.zeros(8)
    for _ in range(2):
        kl.launch(jit, grid, (x, 100), dict(BLOCK=64, SINGLE=True), 4, 1, CUDA0)
    assert jit.slow[0][0] == grid and len(jit.compiled.runs) == 1
    assert jit.compiled.runs[0][:3] == (grid + (1,))[:3]


def test_new_specialization_goes_through_triton(fast):
    jit = _Jit()
    _go(jit, torch.zeros(8))
    _go(jit, torch.zeros(8, dtype=torch.float16))    # another dtype
    _go(jit, torch.zeros(8), n=1)                    # an integer Triton specializes (== 1)
    _go(jit, torch.zeros(8), block=128)              # another constexpr
    assert len(jit.slow) == 4 and jit.compiled.runs == []
    _go(jit, torch.zeros(8), n=1)
    assert len(jit.slow) == 4 and len(jit.compiled.runs) == 1


@pytest.mark.parametrize("which", ["launch_enter_hook", "launch_exit_hook"])
def test_installed_hook_takes_tritons_path(fast, which):
    """A profiler's launch hook (added the way triton.profiler does, to the real knobs) must see every
    launch, so the direct path is skipped while one is installed, and used again once it is removed."""
    jit, x = _Jit(), torch.zeros(8)
    _go(jit, x)
    chain = getattr(triton.knobs.runtime, which)

    def hook(metadata):
        pass

    chain.add(hook)
    try:
        assert kl.launch_hooked(triton.knobs.runtime)
        _go(jit, x)
        assert len(jit.slow) == 2 and jit.compiled.runs == []
    finally:
        chain.remove(hook)
    _go(jit, x)
    assert len(jit.slow) == 2 and len(jit.compiled.runs) == 1


def test_triton_34_hook_slots(fast, monkeypatch):
    """Triton 3.4's knobs: ``Optional[LaunchHook]``, None when unhooked, a bare function when hooked."""
    jit, x = _Jit(), torch.zeros(8)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", None)
    _go(jit, x)
    _go(jit, x)
    assert len(jit.slow) == 1 and len(jit.compiled.runs) == 1
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", lambda metadata: None)
    _go(jit, x)
    assert len(jit.slow) == 2 and len(jit.compiled.runs) == 1


def test_hook_forms():
    """What a hook knob may hold across Triton versions: a HookChain (3.5+, empty when unhooked), None (the
    unhooked value of a plain callable slot), or a bare callable."""
    from triton.knobs import HookChain
    chain = HookChain()
    assert not kl._hook_set(None) and not kl._hook_set(chain)
    chain.add(print)
    assert kl._hook_set(chain)
    chain.remove(print)
    assert not kl._hook_set(chain)
    assert kl._hook_set(print)

    class Sized:  # a chain that only reports its length
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __call__(self, *a):
            pass

    assert not kl._hook_set(Sized(0)) and kl._hook_set(Sized(1))


def test_interpreter_and_cpu_take_tritons_path(monkeypatch):
    monkeypatch.setattr(kl, "_COMPILED", {})
    jit, x = _Jit(), torch.zeros(8)
    for _ in range(2):
        kl.launch(jit, (3,), (x, 100), dict(BLOCK=64, SINGLE=True), 4, 1, torch.device("cpu"))
    assert len(jit.slow) == 2 and jit.compiled.runs == [] and kl._COMPILED == {}


def test_tma_descriptors_are_keyed_and_remade_over_another_tensor():
    """A TMA descriptor argument is keyed by its tensor's dtype, block and padding (what Triton specializes on), not
    by its tensor; ``on_base`` makes the same descriptor over another tensor of that layout, equal to the checked
    constructor's (a prepared call's replay), and leaves other arguments to the new tensor itself."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    a, b = torch.zeros(64, 48, dtype=torch.int8), torch.ones(64, 48, dtype=torch.int8)
    da = TensorDescriptor(a, [64, 48], [48, 1], [32, 16])
    assert kl.is_descriptor(da) and not kl.is_descriptor(a) and kl.base_of(da) is a and kl.base_of(a) is a
    db = kl.on_base(da, b)
    assert db == TensorDescriptor(b, [64, 48], [48, 1], [32, 16]) and db.base is b and da.base is a
    assert kl.arg_key(da) == kl.arg_key(db) == ("desc", torch.int8, (32, 16), "zero")
    assert kl.arg_key(TensorDescriptor(a, [64, 48], [48, 1], [32, 32])) != kl.arg_key(da)   # another block
    assert kl.arg_key(kl.on_base(da, b.view(torch.float8_e4m3fn))) != kl.arg_key(da)        # another dtype
    assert kl.on_base(a, b) is b
