"""ConvRot: INT8 layers whose weights are rotated along K by a block Hadamard matrix (pure torch, no ComfyUI).

ComfyUI's ``int8_tensorwise`` with ``"convrot": true`` (comfy-kitchen) stores ``Q(W @ B)`` where ``B`` is
block-diagonal with K / G copies of the normalized regular Hadamard matrix ``H`` of order G (the Kronecker power of
``[[1,1,1,-1],[1,1,-1,1],[1,-1,1,1],[-1,1,1,1]]`` over sqrt(G); symmetric and orthogonal, so ``B @ B = I``) and
rotates the activations the same way at run time: ``(x B)(W B)^T = x W^T``. The rotation spreads an outlier
channel over its group of G, so per-token activation quantization loses less to it.

``ConvRotLinear`` is an ``Int8Linear`` holding such a weight (codes and scales as stored). On ``fused_triton`` its
forward rotates and quantizes the input in one kernel (``kernel.hadamard``) and runs the pack's GEMM unchanged; on
the other backends it rotates the input in torch and runs the backend as usual. A fused block whose modulated norm
feeds it (the LayerNorm of Flux, Wan, Qwen-Image; the RMSNorm of Lumina 2, Ideogram 4) rotates and quantizes in the
norm's kernel (``quant.blocks.norm_fusable``, ``kernel.hadamard``); q / k / v or w1 / w3 of one group stack as one
ConvRot layer; every other site calls it with a float input.
"""
from __future__ import annotations

import torch

from ..kernel.checks import CONVROT_GROUPS as GROUPS, convrot_group
from . import backends
from .linear import Int8Linear, check_input
from .quantize import quantize_weight_per_channel

#: ComfyUI's default group size (``convrot_groupsize``); the ones the pack runs: ``GROUPS`` (``kernel.checks``).
DEFAULT_GROUP = 256


def hadamard_order(group) -> bool:
    """Whether ``group`` is the order of a regular Hadamard matrix (a power of 4): what ComfyUI's ConvRot decode
    takes."""
    return isinstance(group, int) and group >= 4 and not group & (group - 1) and (group.bit_length() - 1) % 2 == 0


def check_group(k: int, group: int, name: str = "", runs: bool = True) -> None:
    """Raises ValueError (naming the layer, the group and K) unless ``group`` is a supported ConvRot group size
    dividing K; ``runs=False``: any regular Hadamard order dividing K (what a decode to float takes)."""
    convrot_group(k, group, f"ConvRot layer {name!r}" if name else "ConvRot",
                  hadamard_order(group) and (not runs or group in GROUPS))


def group_for(k: int) -> int | None:
    """The group size Apply rotates a float layer of input width K with: 256 (ComfyUI's default) where it divides
    K, else the largest of 64 / 16 that does; None where none does (the layer stays unrotated)."""
    return next((g for g in (DEFAULT_GROUP, 64, 16) if k > 0 and k % g == 0), None)


def hadamard(group: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """The normalized regular Hadamard matrix of order ``group`` (a power of 4): entry (i, j) is
    (-1)^(number of base-4 digits d with i_d + j_d = 3) / sqrt(group)."""
    if not hadamard_order(group):
        raise ValueError(f"a regular Hadamard matrix needs a power of 4, got {group}")
    i = torch.arange(group, device=device)
    neg = torch.zeros(group, group, dtype=torch.int64, device=device)
    for d in range(0, group.bit_length() - 1, 2):
        neg += (((i[:, None] >> d) & 3) + ((i[None, :] >> d) & 3)) == 3
    return torch.where(neg % 2 == 1, -1.0, 1.0).to(dtype) / (group ** 0.5)


def rotate(t: torch.Tensor, group: int, dtype=torch.float32) -> torch.Tensor:
    """``t @ B`` (B: the block Hadamard of order ``group`` along the last dimension) computed in ``dtype``; the
    rotation of activations and (B symmetric) of weights [N, K]. Its own inverse."""
    check_group(t.shape[-1], group)
    return _product(t, hadamard(group, dtype, t.device))


#: The float64 temporaries of one chunk of :func:`rotate_weight` at most, in bytes (and at most half the layer's
#: fp32 size): a weight is rotated a chunk of its output rows at a time.
CHUNK_BYTES = 64 << 20


def chunk_rows(n: int, k: int, chunk_bytes: int | None = None) -> int:
    """Rows of a [n, k] weight :func:`rotate_weight` rotates at once: their float64 temporaries (a copy and the
    product, 16 bytes an element) within ``chunk_bytes`` (default: :data:`CHUNK_BYTES` and half the layer's fp32
    size, 2 n k bytes); at least one row."""
    budget = min(CHUNK_BYTES, 2 * n * k) if chunk_bytes is None else chunk_bytes
    return max(1, min(n, budget // (16 * max(k, 1))))


def rotate_weight(weight: torch.Tensor, group: int, out: torch.Tensor | None = None,
                  chunk_bytes: int | None = None) -> torch.Tensor:
    """``weight @ B`` [N, K] in fp32: every element the float64 product rounded once to fp32, as ``rotate(weight,
    group, torch.float64).float()`` computes it, but a chunk of output rows at a time (:func:`chunk_rows`), so the
    float64 temporaries stay within half the layer's fp32 size instead of four times it. ``out``: the fp32 [N, K]
    to write (``weight`` itself when it is fp32 and may be overwritten: no other copy then).

    Equal to the one-piece result bit for bit: each row's product is the same GEMM over the same length-G dot
    products (the rows of [N K / G, G] @ H, entries +-2^-m), and their float64 sums are exact, so no summation
    order of a BLAS can change them, wherever the nonzero inputs of a group span less than 2^(53 - log2 G - p) in
    magnitude (p: the input's significand bits; at G = 256: 2^37 for bf16, 2^21 for fp32). Elsewhere two orders
    differ by at most (G - 1) 2^-53 times the sum of the group's magnitudes, which moves the fp32 rounding (by one
    ulp, a code by at most one) only for a value that close to an fp32 rounding midpoint."""
    n, k = weight.shape
    check_group(k, group)
    if out is None:
        out = torch.empty(n, k, dtype=torch.float32, device=weight.device)
    h = hadamard(group, torch.float64, weight.device)
    c = chunk_rows(n, k, chunk_bytes)
    for a in range(0, n, c):
        out[a:a + c] = _product(weight[a:a + c].detach(), h)  # rounded to fp32 as .float() rounds
    return out


def _product(rows: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``rows @ B`` in ``h``'s dtype (B: the block Hadamard of ``h``'s order along the last dimension)."""
    k, group = rows.shape[-1], h.shape[0]
    return (rows.to(h.dtype).reshape(-1, k // group, group) @ h).reshape(rows.shape)


def stored_convrot(weight) -> int | None:
    """The ConvRot group size of a ComfyUI ``QuantizedTensor`` weight stored as rotated ``int8_tensorwise``,
    else None."""
    if type(weight).__name__ != "QuantizedTensor" or getattr(weight, "_layout_cls", None) != "TensorWiseINT8Layout":
        return None
    p = getattr(weight, "_params", None)
    return int(getattr(p, "convrot_groupsize", DEFAULT_GROUP)) if getattr(p, "convrot", False) else None


def rotate_quantize(x2: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], fp32 [M]) of ``x2 @ B`` (block Hadamard of order ``group``) quantized per token, in one kernel
    (``kernel.hadamard.hadamard_quantize``, its launches prepared per argument key by ``kernel.plan.call`` as the
    other row kernels'; its custom op under torch.compile)."""
    if torch.compiler.is_compiling():
        return torch.ops.int8_fused.hadamard_quant(x2, group)
    from ..kernel import hadamard, ops, plan  # imports triton
    return plan.call(hadamard.hadamard_quantize, x2, group, salt=ops.tunables())


class ConvRotLinear(Int8Linear):
    """An ``Int8Linear`` whose int8 weight is ConvRot-rotated with group size ``rotation`` (module doc)."""

    rotation: int = DEFAULT_GROUP

    @classmethod
    def from_stored(cls, qweight: torch.Tensor, weight_scale: torch.Tensor, group: int,
                    bias: torch.Tensor | None = None, backend: str = "dequant_bf16", name: str = "") -> "ConvRotLinear":
        """A layer holding rotated int8 weights as they are (a scalar scale becomes the per-channel vector of
        that value, what the GEMM epilogue takes)."""
        check_group(qweight.shape[-1], group, name)
        m = cls.from_quantized(qweight, weight_scale, bias, None, backend=backend, name=name)
        m.rotation = group
        from ..kernel import ops
        ops.register_ops()  # the custom op of the rotation, for torch.compile
        return m

    @classmethod
    def rotate_float(cls, weight: torch.Tensor, group: int = DEFAULT_GROUP, bias: torch.Tensor | None = None,
                     backend: str = "dequant_bf16", name: str = "") -> "ConvRotLinear":
        """Rotate a float weight [N, K] (in float64, rounded to fp32: :func:`rotate_weight`) and quantize it per
        output channel, a chunk of rows at a time: besides the int8 codes, temporaries of at most the layer's fp32
        size."""
        check_group(weight.shape[-1], group, name)
        n, k = weight.shape
        qw = torch.empty(n, k, dtype=torch.int8, device=weight.device)
        ws = torch.empty(n, dtype=torch.float32, device=weight.device)
        h = hadamard(group, torch.float64, weight.device)
        c = chunk_rows(n, k, min(CHUNK_BYTES, n * k))  # float64 product, its fp32 rounding, the quantizer's
        for a in range(0, n, c):
            try:
                qw[a:a + c], ws[a:a + c] = quantize_weight_per_channel(_product(weight[a:a + c].detach(), h))
            except ValueError:  # NaN / Inf: the message names the rows of the whole weight
                quantize_weight_per_channel(weight.detach())
                raise
        return cls.from_stored(qw, ws, group, bias, backend=backend, name=name)

    @classmethod
    def of(cls, layer: Int8Linear, group: int) -> "ConvRotLinear":
        """``layer`` (an Int8Linear built from rotated weights, no smoothing) as a ConvRotLinear: same tensors."""
        if layer.smooth is not None:
            raise ValueError(f"ConvRot layer {layer.name!r}: SmoothQuant smoothing and ConvRot rotation do not mix")
        return cls.from_stored(layer.weight, layer.weight_scale, group, layer.bias, backend=layer.backend,
                               name=layer.name)

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K] weight applied to the unrotated input (the stored weight rotated back)."""
        return rotate(super().dequantized_weight(), self.rotation)

    def rotate_quantize(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 [M, K], fp32 [M]) of the rotated input, in one kernel (:func:`rotate_quantize`)."""
        return rotate_quantize(x2, self.rotation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self)
        if not backends.capabilities(self.backend).feeds_fused:  # the pack's kernels cannot take a rotated int8 input
            return super().forward(rotate(x, self.rotation, x.dtype))
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        a_q, a_s = self.rotate_quantize(x2)
        self.dispatch_calls["int8"] += 1
        if torch.compiler.is_compiling():
            with self.operands(x.device) as t:
                y = torch.ops.int8_fused.gemm_dequant(a_q, a_s, t.qweight, t.weight_scale, t.bias, x.dtype)
        else:
            y = self.gemm_call(a_q, a_s, x.dtype)
        return y.reshape(*lead, self.out_features)

    int8_call = forward

    def rows(self, start: int, stop: int, name: str = "") -> "ConvRotLinear":
        return ConvRotLinear.from_stored(self.weight[start:stop], self.weight_scale[start:stop], self.rotation,
                                         None if self.bias is None else self.bias[start:stop],
                                         backend=self.backend, name=name)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, convrot={self.rotation}"


class DropSmoothing:
    """A calibration (``for_layer``) whose entries keep their protection but lose their smoothing for the layers
    ``rotated(name, K)`` says are rotated: rotation and SmoothQuant do not combine here."""

    def __init__(self, calibration, rotated):
        self.calibration, self.rotated, self.dropped = calibration, rotated, []

    def __getattr__(self, name):
        return getattr(self.calibration, name)

    def for_layer(self, name: str, n: int, k: int):
        e = self.calibration.for_layer(name, n, k)
        if e is None or getattr(e, "smooth", None) is None or not self.rotated(name, k):
            return e
        self.dropped.append(name)
        return _Entry(None, getattr(e, "protected", False))


class _Entry:
    def __init__(self, smooth, protected):
        self.smooth, self.protected = smooth, protected
