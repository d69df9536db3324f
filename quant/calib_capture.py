"""Activation capture for calibration: forward pre-hooks on the chosen linears while real steps run.

Per linear (input [..., K]) and per timestep bucket, the capture keeps running statistics only:

* per-input-channel absmax ``max_t |X[t, j]|``              fp32 [B, K] (B = number of buckets)
* per-token absmax statistics ``a_t = max_j |X[t, j]|``   count, sum and max per bucket (scalars)
* a reservoir sample of at most ``row_cap`` activation rows, uniform over every row seen (all steps,
  all CFG branches), kept on the CPU in the activation's dtype: at most ``row_cap * K * itemsize``
  bytes per layer (128 rows: 1.2 MB for K = 4608 in bf16, 3.1 MB for K = 12288). It is what the
  W8A8 error of each layer is measured on.

Nothing else is stored, so memory does not grow with steps or resolution. Statistics stay on the
activation's device (no host sync per call) apart from the few sampled rows.
"""
from __future__ import annotations

import math
import zlib

import torch
from torch import nn

DEFAULT_ROW_CAP = 128


class LayerStats:
    """Running statistics of one linear's input; see the module docstring."""

    def __init__(self, name: str, in_features: int, out_features: int, n_buckets: int = 1,
                 row_cap: int = DEFAULT_ROW_CAP, generator: torch.Generator | None = None):
        if n_buckets < 1 or row_cap < 1:
            raise ValueError(f"n_buckets and row_cap must be >= 1 (got {n_buckets}, {row_cap})")
        self.name, self.in_features, self.out_features = name, in_features, out_features
        self.n_buckets, self.row_cap = n_buckets, row_cap
        self.gen = generator or torch.Generator().manual_seed(0)
        self.chan_absmax: torch.Tensor | None = None  # fp32 [B, K], on the activation device
        self.tok_count = [0] * n_buckets
        self.tok_sum: torch.Tensor | None = None      # fp32 [B]
        self.tok_max: torch.Tensor | None = None      # fp32 [B]
        self.nonfinite: torch.Tensor | None = None    # int64 scalar: rows holding NaN/Inf
        self.sample: torch.Tensor | None = None       # [<= row_cap, K] on the CPU
        self.rows_seen = 0

    # ------------------------------------------------------------------ capture
    def observe(self, x: torch.Tensor, bucket: int = 0) -> None:
        """Add the rows of ``x`` [..., K] to the statistics of ``bucket``."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"calibration hook on {self.name}: input has {x.shape[-1]} features, "
                             f"the layer has in_features={self.in_features}")
        x2 = x.detach().reshape(-1, self.in_features)
        M = x2.shape[0]
        if M == 0:
            return
        if self.chan_absmax is None:
            dev = x2.device
            self.chan_absmax = torch.zeros(self.n_buckets, self.in_features, device=dev)
            self.tok_sum = torch.zeros(self.n_buckets, device=dev)
            self.tok_max = torch.zeros(self.n_buckets, device=dev)
            self.nonfinite = torch.zeros((), dtype=torch.int64, device=dev)
        xa = x2.abs()  # in the activation dtype: abs and max are exact there, and no fp32 copy is made
        tok = xa.amax(dim=1).float()
        self.nonfinite += (~torch.isfinite(tok)).sum()
        b = min(max(int(bucket), 0), self.n_buckets - 1)
        dev = self.chan_absmax.device
        torch.maximum(self.chan_absmax[b], xa.amax(dim=0).to(dev, torch.float32), out=self.chan_absmax[b])
        self.tok_sum[b] += tok.sum().to(dev)
        self.tok_max[b] = torch.maximum(self.tok_max[b], tok.max().to(dev))
        self.tok_count[b] += M
        self._reservoir(x2)

    def _reservoir(self, x2: torch.Tensor) -> None:
        """Algorithm R over rows, vectorised per call: row g (0-based, global) replaces slot
        ``randint(0, g]`` when that slot is < row_cap; deterministic for a given seed."""
        M, n0, cap = x2.shape[0], self.rows_seen, self.row_cap
        keep = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        if self.sample is None:
            self.sample = torch.empty(0, self.in_features, dtype=keep)
        fill = min(max(cap - self.sample.shape[0], 0), M)
        if fill:
            self.sample = torch.cat([self.sample, x2[:fill].to("cpu", keep)])
        if fill < M:
            g = torch.arange(n0 + fill, n0 + M, dtype=torch.float64)
            slot = torch.floor(torch.rand(g.shape, generator=self.gen, dtype=torch.float64) * (g + 1)).long()
            hit = (slot < cap).nonzero().flatten()
            if hit.numel():
                # the last row aimed at a slot wins (an index_put with repeated slots is not deterministic)
                last = torch.full((cap,), -1, dtype=torch.long).scatter_reduce(
                    0, slot[hit], torch.arange(hit.numel()), "amax")
                slots = (last >= 0).nonzero().flatten()
                src = hit[last[slots]] + fill
                self.sample[slots] = x2[src.to(x2.device)].to("cpu", keep)
        self.rows_seen += M

    # ------------------------------------------------------------------ results
    @property
    def tokens(self) -> int:
        return sum(self.tok_count)

    def check_finite(self) -> None:
        if self.nonfinite is not None and int(self.nonfinite) > 0:
            raise ValueError(f"layer {self.name} received {int(self.nonfinite)} activation rows holding "
                             f"NaN/Inf during calibration: the float model itself produces non-finite "
                             f"values (check the model dtype, LoRAs and the conditioning)")

    def act_absmax(self) -> torch.Tensor:
        """fp32 [K] per-input-channel absmax over every bucket, on the CPU."""
        return self.chan_absmax.amax(dim=0).cpu()

    def bucket_absmax(self) -> torch.Tensor:
        """fp32 [B, K] per-bucket per-channel absmax, on the CPU (rows of unreached buckets are 0)."""
        return self.chan_absmax.cpu()

    def same_input(self, other: "LayerStats") -> bool:
        """Whether ``other`` saw the very activations this layer saw: the same width, rows per bucket and
        bit-identical per-bucket channel absmax and token statistics over the whole run (two layers called on one
        tensor, as SwiGLU's w1 and w3 are; distinct activations never agree on every channel's maximum)."""
        if self.chan_absmax is None or other.chan_absmax is None:
            return False
        return (self.in_features == other.in_features and self.tok_count == other.tok_count
                and all(torch.equal(a, b.to(a.device)) for a, b in ((self.chan_absmax, other.chan_absmax),
                                                                    (self.tok_sum, other.tok_sum),
                                                                    (self.tok_max, other.tok_max))))

    def token_summary(self) -> dict:
        """Per-token absmax statistics over all buckets: tokens, mean and max."""
        n = self.tokens
        s = float(self.tok_sum.sum()) if n else 0.0
        return {"tokens": n, "mean": s / n if n else math.nan,
                "max": float(self.tok_max.max()) if n else math.nan}


def shared_input_groups(stats: dict) -> list[list[str]]:
    """Groups (2 or more names, model order) of layers under one parent module that read one activation
    (:meth:`LayerStats.same_input`): SwiGLU's w1 / w3, separate q / k / v projections. A fused kernel quantizes
    such an input once, so the layers need one smoothing vector (``quant.blocks.merge_int8``)."""
    by_parent: dict = {}
    for n, st in stats.items():
        if st.tokens:
            by_parent.setdefault((n.rpartition(".")[0], st.in_features), []).append(n)
    groups = []
    for names in by_parent.values():
        while names:
            same = [names[0]] + [n for n in names[1:] if stats[names[0]].same_input(stats[n])]
            if len(same) > 1:
                groups.append(same)
            names = [n for n in names if n not in same]
    order = {n: i for i, n in enumerate(stats)}
    return sorted(groups, key=lambda g: order[g[0]])


class ActivationCapture:
    """Forward pre-hooks on ``named_linears`` [(name, module)] that fill one :class:`LayerStats` each.

    Use as a context manager (hooks are removed on exit, also on error or interrupt), and call
    :meth:`set_bucket` from the sampling loop when collecting per-timestep-bucket statistics.
    """

    def __init__(self, named_linears, n_buckets: int = 1, row_cap: int = DEFAULT_ROW_CAP, seed: int = 0):
        self.modules: dict[str, nn.Module] = dict(named_linears)
        # one generator per layer, seeded from (seed, name): a layer's sample does not depend on
        # which other layers are captured
        self.stats = {n: LayerStats(n, m.in_features, m.out_features, n_buckets, row_cap,
                                    torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(n.encode()))
                                                                  & 0xFFFF_FFFF_FFFF))
                      for n, m in self.modules.items()}
        self.n_buckets, self.row_cap = n_buckets, row_cap
        self.bucket = 0
        self._handles: list = []

    def set_bucket(self, bucket: int) -> None:
        self.bucket = int(bucket)

    def _hook(self, name: str):
        st = self.stats[name]

        def pre_hook(module, args):
            if args and torch.is_tensor(args[0]):
                st.observe(args[0], self.bucket)
        return pre_hook

    def install(self) -> "ActivationCapture":
        if self._handles:
            raise RuntimeError("calibration hooks are already installed")
        for name, m in self.modules.items():
            self._handles.append(m.register_forward_pre_hook(self._hook(name)))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def __enter__(self) -> "ActivationCapture":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()
