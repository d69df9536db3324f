"""Helpers shared by tests/test_kernel_launch.py, test_plan.py and test_dispatch.py: recording stand-ins for a
compiled Triton kernel and a ``@triton.jit`` function (the direct re-launch needs a CUDA device, so these check
which path a launch takes and with which arguments), and a small fused_triton ``Int8Linear``."""
import torch


class Compiled:
    """A compiled kernel as ``JITFunction.run`` returns it: ``run``, ``function``, ``packed_metadata``."""

    def __init__(self):
        self.function, self.packed_metadata, self.runs = object(), object(), []

    def run(self, *a):
        self.runs.append(a)


class Jit:
    """``jit_fn[grid](*args, **kw)``, counted: the normal Triton path."""

    def __init__(self, arg_names=("x_ptr", "n", "BLOCK", "SINGLE")):
        self.arg_names = list(arg_names)
        self.compiled, self.slow = Compiled(), []

    def __getitem__(self, grid):
        def call(*args, **kw):
            self.slow.append((grid, args, kw))
            return self.compiled
        return call


def int8_layer(n=40, k=72, bias=True, smooth=True, seed=0):
    """A fused_triton Int8Linear [n, k] with uneven row magnitudes, optional bias and SmoothQuant vector."""
    from quant.linear import Int8Linear
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.2, 3.0, n)[:, None]
    b = torch.randn(n, generator=g) if bias else None
    s = (torch.rand(k, generator=g) + 0.5) if smooth else None
    return Int8Linear.from_float(w, b, smooth=s, backend="fused_triton", name="blk.0.proj")
