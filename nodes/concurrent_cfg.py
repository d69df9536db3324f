"""Two-backbone CFG on two CUDA streams (``INT8_FUSED_CONCURRENT_CFG``).

ComfyUI's ``Guider_DualModel`` (the DualModelGuider node: Ideogram 4's conditional and unconditional backbones)
runs the conditional pass, then the unconditional one, on one CUDA stream. The two passes share no data until
the guider combines them, so the GPU could run them at once: the memory-bound row kernels and the last partial
wave of each GEMM of one pass then overlap the other pass's work.

Two ComfyUI wrappers do it, both installed with the pack's patches (``nodes/apply.py``):

  PREDICT_NOISE    around the guider's ``predict_noise``: when the guider has a second backbone loaded
                   (``uncond_inner``), the switch is on and x is on a CUDA device, it opens a context for the
                   step and, however the call ends, makes the caller's stream wait for every stream the step
                   used before returning.
  CALC_COND_BATCH  around each ``calc_cond_batch`` inside that context: the first two calls (the conditional
                   and the unconditional pass) each run on their own side stream, which first waits for the
                   caller's stream (the step's inputs are ready there). After the second call the caller's
                   stream waits for both, so the guider's CFG combination reads finished outputs.

Everything a pass allocates is allocated on its side stream (PyTorch's caching allocator keeps per-stream pools),
and the outputs are marked as used by the caller's stream (``record_stream``), so no memory is reused before the
caller's kernels that read it have run. ComfyUI's own weight streaming syncs with ``current_stream``, which is
the pass's side stream inside the context. Results are the same numbers as the sequential passes (the same
kernels on the same inputs); only the order in which the GPU runs them changes.
"""
from __future__ import annotations

import threading

import torch

from ..kernel import config

stats = {"steps": 0, "passes": 0}  # concurrent steps and passes run in this process (tests, bench)

_state = threading.local()
_streams: dict = {}  # device -> (stream, stream)


class _Step:
    """One ``predict_noise`` call: the caller's stream, the side streams, the ones used so far."""
    __slots__ = ("main", "side", "calls", "used")

    def __init__(self, main, side):
        self.main, self.side, self.calls, self.used = main, side, 0, []

    def join(self) -> None:
        for s in self.used:
            self.main.wait_stream(s)
        self.used.clear()


def side_streams(device: torch.device) -> tuple:
    """Two side streams of ``device`` (created once per device and kept)."""
    key = torch.device(device)
    if key not in _streams:
        _streams[key] = (torch.cuda.Stream(key), torch.cuda.Stream(key))
    return _streams[key]


def _applies(guider, x) -> bool:
    return (config.get("INT8_FUSED_CONCURRENT_CFG") and getattr(guider, "uncond_inner", None) is not None
            and torch.is_tensor(x) and x.device.type == "cuda" and not torch.compiler.is_compiling())


def predict_noise_wrapper(executor, x, timestep, model_options={}, seed=None):  # noqa: B006 (ComfyUI's signature)
    """ComfyUI PREDICT_NOISE wrapper: the step's two passes on two streams when they apply (module doc)."""
    if not _applies(executor.class_obj, x) or getattr(_state, "step", None) is not None:
        return executor(x, timestep, model_options, seed)
    step = _Step(torch.cuda.current_stream(x.device), side_streams(x.device))
    _state.step = step
    try:
        return executor(x, timestep, model_options, seed)
    finally:
        _state.step = None
        step.join()


def calc_cond_batch_wrapper(executor, model, conds, x_in, timestep, model_options):
    """ComfyUI CALC_COND_BATCH wrapper: inside a concurrent step, the first two passes each on a side stream."""
    step = getattr(_state, "step", None)
    if step is None or step.calls >= len(step.side):
        return executor(model, conds, x_in, timestep, model_options)
    s = step.side[step.calls]
    step.calls += 1
    s.wait_stream(step.main)
    step.used.append(s)
    with torch.cuda.stream(s):
        out = executor(model, conds, x_in, timestep, model_options)
    for t in out:
        if torch.is_tensor(t):
            t.record_stream(step.main)
    stats["passes"] += 1
    if step.calls == len(step.side):
        stats["steps"] += 1
        step.join()  # the guider combines the two outputs next, on the caller's stream
    return out
