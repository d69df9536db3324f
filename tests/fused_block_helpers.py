"""Helpers shared by the fused-block tests (test_flux_fused, test_wan_fused, test_lumina2_fused): the model's INT8
layers as Apply selects them, a copy of a module with patches swapped in, and relative L2 error."""
import copy

import torch


def int8_layers(pack, dm, backend="fused_triton") -> dict:
    """{name: Int8Linear} of ``dm``'s block linears (its adapter's presets), quantized on ``backend``."""
    A = pack.adapters
    pairs = pack.quant.select.select_linears(dm, "blocks", rules=A.block_rules(dm))
    return pack.quant.patch.build_int8_layers(pairs, backend)[0]


def swapped(module, patches: dict):
    """A deep copy of ``module`` with ``patches`` ({dotted name: module}) set in place; ``module`` is untouched."""
    import comfy.utils
    m = copy.deepcopy(module)
    for name, sub in patches.items():
        comfy.utils.set_attr(m, name, sub)
    return m


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
