"""INT8 W8A8 checkpoint formats: detection, lazy memory-mapped readers, one normalized view.

Three layouts are read (writers live in ``fmt_write``):

``transformerlab``  transformerlab's W8A8 file (both CFG branches in one file). Per quantized linear
    ``<branch>.<p>.wq`` int8 [N, K], ``<branch>.<p>.ws`` scale, optional ``<branch>.<p>.smooth`` [K],
    optional ``<branch>.<p>.bias`` [N]; bf16-protected linears and any other float tensor as plain
    ``<branch>.<p>.weight`` / ``.bias``; norms and embeddings may be absent (a base checkpoint supplies
    them). Branch prefixes ``conditional.`` / ``unconditional.``; the GGUF builds' ``cond.`` / ``uncond.``
    are accepted as aliases (a pure renaming); a file with ``.wq`` keys and no prefix is one branch.
    The layout is known only from a third-party loader; what we assume (see ``docs`` in the README):
      * ``ws`` is the per-output-channel scale: shape [N] or [N, 1]; a scalar / [1] (per-tensor) is
        broadcast to [N]. Dequantized weight = ``wq * ws[:, None]``.
      * ``smooth`` follows the SmoothQuant convention: activations are divided by it and ``wq`` already
        holds ``Q(W * s)`` (so ``y = (x / s) @ (W * s).T``). A header metadata entry
        ``"smooth_direction": "multiply_activation"`` declares the other convention (activations multiplied
        by the stored vector, ``wq = Q(W / v)``); we then invert it. Any other value is rejected.
``comfy_int8``  ComfyUI core ``int8_tensorwise``: ``<p>.weight`` int8 [N, K], ``<p>.weight_scale`` fp32
    scalar / [N] / [N, 1], format given by ``<p>.comfy_quant`` (uint8 JSON) or the header's
    ``_quantization_metadata`` ``{"layers": {p: {"format": ...}}}``. ConvRot-rotated layers
    (``"convrot": true``) carry their group size (``QuantEntry.rotation``, one ``quant.convrot`` runs); other
    formats (fp8, nvfp4, ...) are rejected with a message.
``int8_fused``  this pack's own format (self-describing, see ``fmt_write.write_pack``): metadata
    ``format=int8_fused``, ``format_version``, ``branches``, per-layer ``layers`` (smoothing), ``protected``,
    ``calibration``; tensors ``<p>.qweight``, ``<p>.weight_scale`` [N], ``<p>.smooth`` [K], ``<p>.bias``,
    float layers as ``<p>.weight``; branch prefixes as in the transformerlab file when there are two.

Every reader yields the same normalized view per branch: quantized linears ``name -> QuantEntry`` and
float tensors ``name -> key``; ``Int8Checkpoint.quant_tensors`` returns (qweight int8 [N, K],
weight_scale fp32 [N], bias fp32 [N] | None, smooth fp32 [K] | None) with ``smooth`` always a divisor.
Files are opened with ``safetensors.safe_open`` (memory-mapped); a tensor is read only when asked for,
so one branch is materialized at a time. Pickle files are never opened.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct

import torch

from . import convrot

log = logging.getLogger("int8_fused")

FMT_TRANSFORMERLAB = "transformerlab"
FMT_CORE = "comfy_int8"
FMT_PACK = "int8_fused"
PACK_FORMAT_VERSION = 1

BRANCHES = ("conditional", "unconditional")
_BRANCH_ALIASES = {"conditional.": "conditional", "unconditional.": "unconditional",
                   "cond.": "conditional", "uncond.": "unconditional"}
_PICKLE_EXT = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")
_SAFETENSORS_DTYPES = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL",
                       "F8_E4M3", "F8_E5M2", "U16", "U32", "U64", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"}


ERROR_MODULE = "int8_fused"  # shown by ComfyUI as the exceptions' module (not "<pack folder>.quant.formats")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file, what is wrong and the fix."""


class OutputExistsError(CheckpointError, FileExistsError):
    """A writer's target file exists and overwrite is off (both ``except FileExistsError`` and
    ``except CheckpointError`` catch it)."""


for _cls in (CheckpointError, OutputExistsError):
    _cls.__module__ = ERROR_MODULE


def json_metadata(name: str, meta: dict, key: str, kind: type, default=None, required: bool = False):
    """``json.loads(meta[key])`` checked to be a ``kind`` (dict or list); ``default`` when absent.

    Raises CheckpointError naming the file and the entry when it is missing (``required``), not JSON or
    of another type: the file is damaged."""
    raw = meta.get(key)
    if raw is None:
        if required:
            raise CheckpointError(f"{name}: metadata entry {key!r} is missing from its header; the file is "
                                  "damaged or was not written by this pack. Make or download it again")
        return default
    try:
        value = json.loads(raw)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{name}: metadata entry {key!r} is not valid JSON ({e}); the file is damaged. "
                              "Make or download it again") from None
    if not isinstance(value, kind):
        want = {dict: "an object", list: "a list"}.get(kind, kind.__name__)
        raise CheckpointError(f"{name}: metadata entry {key!r} should be {want} but is "
                              f"{type(value).__name__} {str(value)[:60]!r}; the file is damaged. Make or "
                              "download it again")
    return value


# --------------------------------------------------------------------------- stored weight scales
def check_scale_shape(shape, n: int, where: str) -> None:
    """A stored weight scale must be [N] or [N, 1] (per output channel) or a scalar (per tensor); else
    CheckpointError, ``where`` naming the file and the layer. This pack's readers and Apply's adoption of ComfyUI
    core ``int8_tensorwise`` layers (``nodes/apply.check_core_int8``) share it."""
    if tuple(shape) not in ((), (1,), (n,), (n, 1), (1, 1)):
        raise CheckpointError(f"{where}: scale has shape {list(shape)}; expected [{n}] or [{n}, 1] (per output "
                              "channel) or a scalar (per tensor). The file is damaged: download or save it again")


def check_scale_values(s: torch.Tensor, where: str, what: str = "weight scale") -> None:
    """The values of a stored weight scale (fp32, flattened): NaN/Inf or a negative value raises CheckpointError
    (``where`` names the file and the layer, ``what`` the tensor); every value zero warns (one zero is legal: an
    all-zero weight row quantizes to scale 0). Shared as ``check_scale_shape``."""
    if not torch.isfinite(s).all():
        bad = (~torch.isfinite(s)).nonzero().flatten()
        raise CheckpointError(f"{where}: {what} holds NaN/Inf ({bad.numel()} of {s.numel()} values, e.g. channel "
                              f"{int(bad[0])}: {float(s[bad[0]])}); the file is damaged. Download or save it again")
    if (s < 0).any():
        neg = (s < 0).nonzero().flatten()
        raise CheckpointError(f"{where}: {what} holds {neg.numel()} negative values (e.g. channel {int(neg[0])}: "
                              f"{float(s[neg[0]]):.4g}); scales are max|row| / 127 >= 0, so the file is damaged. "
                              "Download or save it again")
    if not s.any():  # one zero row is legal; a whole layer of them is not a model anyone trained
        log.warning("%s: every %s (%d channels) is zero, so the layer outputs only its bias: almost surely a "
                    "damaged file. Download or save it again", where, what, s.numel())


@dataclasses.dataclass
class QuantEntry:
    """One quantized linear of a branch: file keys of its tensors and its shape [N, K]."""
    name: str
    out_features: int
    in_features: int
    qweight: str
    scale: str
    bias: str | None = None
    smooth: str | None = None
    rotation: int | None = None                 # ConvRot group size (core int8_tensorwise "convrot"), else None


@dataclasses.dataclass
class Branch:
    name: str                                   # "conditional", "unconditional" or "" (single model)
    quant: dict[str, QuantEntry]
    floats: dict[str, str]                      # tensor name (relative to the model) -> file key


# --------------------------------------------------------------------------- header checks
def read_header(path: str) -> tuple[dict, dict]:
    """(tensor entries, metadata) of a safetensors file, checked against the file size.

    Raises CheckpointError for pickle files, non-safetensors files, a corrupt header or a truncated file.
    """
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    if path.lower().endswith(_PICKLE_EXT):
        raise CheckpointError(f"{name}: only .safetensors files are accepted (pickle checkpoints such as "
                              ".ckpt/.pt/.pth can run code when loaded). Convert it with a trusted tool "
                              "to safetensors first")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if head[:4] == b"PK\x03\x04":
            raise CheckpointError(f"{name}: this is a pickle/zip (torch.save) file, not safetensors; only "
                                  "safetensors files are accepted. Convert it to safetensors first")
        if len(head) < 8:
            raise CheckpointError(f"{name}: file is {size} bytes, too short for a safetensors file "
                                  "(truncated download?); download it again")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
                raise CheckpointError(f"{name}: this is a pickle file, not safetensors; only safetensors "
                                      "files are accepted. Convert it to safetensors first")
            raise CheckpointError(f"{name}: header claims {n} bytes but the file has {size}: the file is "
                                  "truncated or not a safetensors file; download it again")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{name}: corrupt safetensors header ({e}); the file is damaged or not a "
                              "safetensors file; download it again") from None
    meta = header.pop("__metadata__", None) or {}
    end = 0
    for k, v in header.items():
        if not isinstance(v, dict) or v.get("dtype") not in _SAFETENSORS_DTYPES or "data_offsets" not in v:
            raise CheckpointError(f"{name}: corrupt safetensors header entry for {k!r}; download it again")
        end = max(end, int(v["data_offsets"][1]))
    if 8 + n + end > size:
        raise CheckpointError(f"{name}: file is truncated: its header needs {8 + n + end} bytes, the file has "
                              f"{size} ({(8 + n + end - size) / 2**20:.1f} MiB missing); download it again")
    return header, meta


def _shape(header: dict, key: str) -> tuple[int, ...]:
    return tuple(header[key]["shape"])


def _dtype(header: dict, key: str) -> str:
    return header[key]["dtype"]


# --------------------------------------------------------------------------- detection
def detect_format(keys, meta: dict) -> str | None:
    """Which layout a file is in, from its keys and metadata; None when it is none of ours."""
    if meta.get("format") == FMT_PACK:
        return FMT_PACK
    keys = list(keys)
    if any(k.endswith(".wq") for k in keys):
        return FMT_TRANSFORMERLAB
    if "_quantization_metadata" in meta or any(k.endswith(".comfy_quant") for k in keys):
        return FMT_CORE
    if any(k.endswith(".qweight") for k in keys):
        return FMT_PACK  # pack tensors without our metadata: reported precisely by the reader
    return None


def _split_branches(keys, name: str, allow_single: bool) -> dict[str, list[tuple[str, str]]]:
    """{branch: [(file key, key without the branch prefix)]}; "" is the single-branch case."""
    out: dict[str, list[tuple[str, str]]] = {}
    unprefixed = []
    seen_prefix: dict[str, str] = {}
    for k in keys:
        for pre, br in _BRANCH_ALIASES.items():
            if k.startswith(pre):
                if seen_prefix.setdefault(br, pre) != pre:
                    raise CheckpointError(f"{name}: mixes branch prefixes {seen_prefix[br]!r} and {pre!r} "
                                          f"for the {br} branch; the file is inconsistent")
                out.setdefault(br, []).append((k, k[len(pre):]))
                break
        else:
            unprefixed.append(k)
    if out and unprefixed:
        raise CheckpointError(f"{name}: has branch-prefixed keys ({', '.join(sorted(out))}) and "
                              f"{len(unprefixed)} keys without a branch prefix, e.g. {unprefixed[:3]}; "
                              "expected every key under 'conditional.' / 'unconditional.'")
    if not out:
        if not allow_single:
            raise CheckpointError(f"{name}: no 'conditional.' / 'unconditional.' key prefix found")
        out[""] = [(k, k) for k in unprefixed]
    return out


def _strip_model_prefix(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Drop ComfyUI's full-checkpoint prefix ``model.diffusion_model.`` when every key has it."""
    pre = "model.diffusion_model."
    if pairs and all(r.startswith(pre) for _, r in pairs):
        return [(k, r[len(pre):]) for k, r in pairs]
    return pairs


# --------------------------------------------------------------------------- the checkpoint
class Int8Checkpoint:
    """An opened INT8 checkpoint: ``format``, ``metadata``, ``branches`` and lazy tensor access.

    Use as a context manager or call ``close()``; tensors are read from the memory map on demand.
    """

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        self.name = os.path.basename(path)
        self.header, self.metadata = read_header(path)
        fmt = detect_format(self.header.keys(), self.metadata)
        if fmt is None:
            raise CheckpointError(
                f"{self.name}: not an INT8 checkpoint this pack reads: no '.wq' (transformerlab), "
                "'.comfy_quant'/'_quantization_metadata' (ComfyUI int8_tensorwise) or 'int8_fused' metadata "
                "(this pack). A float or FP8 model loads with ComfyUI's 'Load Diffusion Model' and is "
                "quantized by 'Apply Fused INT8 GEMM'")
        self.format = fmt
        self.smooth_inverted = False
        self.branches: dict[str, Branch] = {}
        {FMT_TRANSFORMERLAB: self._read_transformerlab, FMT_CORE: self._read_core,
         FMT_PACK: self._read_pack}[fmt]()
        try:
            self._f = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own exception types
            raise CheckpointError(f"{self.name}: safetensors could not open it ({e}); download it again") from e

    # ---------------------------------------------------------------- layout readers
    def _read_transformerlab(self) -> None:
        direction = self.metadata.get("smooth_direction", "divide_activation")
        if direction not in ("divide_activation", "multiply_activation"):
            raise CheckpointError(f"{self.name}: unknown smooth_direction {direction!r} in its metadata; "
                                  "expected 'divide_activation' (SmoothQuant: x / s, wq = Q(W * s)) or "
                                  "'multiply_activation'")
        self.smooth_inverted = direction == "multiply_activation"
        for br, pairs in _split_branches(self.header.keys(), self.name, allow_single=True).items():
            self.branches[br] = self._collect(br, pairs, "wq", "ws")

    def _read_pack(self) -> None:
        m = self.metadata
        if m.get("format") != FMT_PACK:
            raise CheckpointError(f"{self.name}: has '.qweight' tensors but not this pack's metadata "
                                  f"(format={m.get('format')!r}); it was not written by 'Save INT8 Model'")
        try:
            ver = int(m.get("format_version", "0"))
        except ValueError:
            ver = -1
        if ver < 1:
            raise CheckpointError(f"{self.name}: invalid int8_fused format_version {m.get('format_version')!r}")
        if ver > PACK_FORMAT_VERSION:
            raise CheckpointError(f"{self.name}: written by a newer version of this pack (int8_fused format "
                                  f"{ver}, this one reads up to {PACK_FORMAT_VERSION}); update the node pack")
        for br, pairs in _split_branches(self.header.keys(), self.name, allow_single=True).items():
            self.branches[br] = self._collect(br, pairs, "qweight", "weight_scale")
        declared = json_metadata(self.name, m, "branches", list) if m.get("branches") else None
        if declared is not None and sorted(map(str, declared)) != sorted(self.branches):
            raise CheckpointError(f"{self.name}: metadata declares branches {declared} but the tensors hold "
                                  f"{sorted(self.branches)}; the file is inconsistent")
        layers = json_metadata(self.name, m, "layers", dict, default={})
        for br, b in self.branches.items():
            for n, e in b.quant.items():
                entry = layers.get(f"{br}.{n}" if br else n, {})
                if not isinstance(entry, dict):
                    raise CheckpointError(f"{self.name}: metadata 'layers' entry of {n!r} is "
                                          f"{type(entry).__name__}, not an object; the file is damaged")
                want = entry.get("smooth")
                if want is not None and bool(want) != (e.smooth is not None):
                    raise CheckpointError(f"{self.name}: layer {n!r} metadata says smooth={want} but the "
                                          f"file {'lacks' if want else 'has'} '{n}.smooth'; inconsistent file")

    def _read_core(self) -> None:
        qm = json_metadata(self.name, self.metadata, "_quantization_metadata", dict, default={}).get("layers", {})
        if not isinstance(qm, dict):
            raise CheckpointError(f"{self.name}: '_quantization_metadata' holds 'layers' of type "
                                  f"{type(qm).__name__}, not an object; the file is damaged")
        pairs = _strip_model_prefix(_split_branches(self.header.keys(), self.name, allow_single=True).get("", []))
        if not pairs:
            raise CheckpointError(f"{self.name}: a ComfyUI int8_tensorwise file has one model; this one has "
                                  "branch prefixes. Save each branch to its own file")
        rel2key = {r: k for k, r in pairs}
        confs = dict(qm)
        for r, k in rel2key.items():
            if r.endswith(".comfy_quant"):
                raw = self._f_tensor_raw(k)
                try:
                    confs[r[:-len(".comfy_quant")]] = json.loads(raw)
                except ValueError:
                    raise CheckpointError(f"{self.name}: {r} does not hold JSON; the file is damaged") from None
        quant, floats = {}, {}
        used = set()
        for p, conf in confs.items():
            if not isinstance(conf, dict):
                raise CheckpointError(f"{self.name}: the quantization config of layer {p!r} is "
                                      f"{type(conf).__name__} {str(conf)[:60]!r}, not a JSON object; the file "
                                      "is damaged")
            fmt = conf.get("format")
            params = conf.get("params", {}) if isinstance(conf.get("params"), dict) else {}
            if fmt != "int8_tensorwise":
                raise CheckpointError(f"{self.name}: layer {p!r} is in ComfyUI format {fmt!r}; this loader reads "
                                      "int8_tensorwise only. Load the file with 'Load Diffusion Model'")
            wk, sk = rel2key.get(f"{p}.weight"), rel2key.get(f"{p}.weight_scale")
            if wk is None or sk is None:
                raise CheckpointError(f"{self.name}: layer {p!r} is marked int8_tensorwise but "
                                      f"'{p}.{'weight' if wk is None else 'weight_scale'}' is missing")
            quant[p] = self._entry(p, wk, sk, rel2key.get(f"{p}.bias"), None)
            if conf.get("convrot", params.get("convrot", False)):  # read as ComfyUI reads it (comfy/ops.py)
                quant[p].rotation = self._convrot_group(
                    p, conf.get("convrot_groupsize", params.get("convrot_groupsize", 256)), quant[p].in_features)
            used.update(x for x in (wk, sk, rel2key.get(f"{p}.bias"), rel2key.get(f"{p}.comfy_quant")) if x)
        for r, k in rel2key.items():
            if k in used:
                continue
            if r.endswith((".weight_scale", ".input_scale", ".comfy_quant")):
                raise CheckpointError(f"{self.name}: {r!r} has no int8_tensorwise layer metadata; the file "
                                      "mixes formats or is damaged")
            if _dtype(self.header, k) == "I8":
                raise CheckpointError(f"{self.name}: {r!r} is int8 but has no comfy_quant entry")
            floats[r] = k
        self.branches[""] = Branch("", quant, floats)

    def _f_tensor_raw(self, key: str) -> bytes:
        from safetensors import safe_open
        with safe_open(self.path, framework="pt", device="cpu") as f:
            return f.get_tensor(key).numpy().tobytes()

    def _collect(self, br: str, pairs: list[tuple[str, str]], wq: str, ws: str) -> Branch:
        pairs = _strip_model_prefix(pairs)
        rel2key = {r: k for k, r in pairs}
        quant, floats, used = {}, {}, set()
        for r, k in rel2key.items():
            if r.endswith("." + wq):
                p = r[:-len(wq) - 1]
                sk = rel2key.get(f"{p}.{ws}")
                if sk is None:
                    raise CheckpointError(f"{self.name}: {_bn(br)}layer {p!r} has '{r}' but no scale "
                                          f"'{p}.{ws}'; the file is incomplete")
                bk, smk = rel2key.get(f"{p}.bias"), rel2key.get(f"{p}.smooth")
                if f"{p}.weight" in rel2key:
                    raise CheckpointError(f"{self.name}: {_bn(br)}layer {p!r} has both an int8 '{wq}' and a "
                                          "float 'weight'; the file is inconsistent")
                quant[p] = self._entry(p, k, sk, bk, smk, br)
                used.update(x for x in (k, sk, bk, smk) if x)
        for r, k in rel2key.items():
            if k in used:
                continue
            if r.endswith((f".{ws}", ".smooth")):
                raise CheckpointError(f"{self.name}: {_bn(br)}'{r}' belongs to no quantized layer (no "
                                      f"'{r.rsplit('.', 1)[0]}.{wq}'); the file is incomplete")
            floats[r] = k
        return Branch(br, quant, floats)

    def _convrot_group(self, p, raw, k: int) -> int:
        """The ConvRot group size of core layer ``p`` (input width ``k``), one the pack's kernels rotate with; else
        CheckpointError naming the file, the layer, the group and K."""
        try:
            group = int(raw)
        except (TypeError, ValueError):
            raise CheckpointError(f"{self.name}: layer {p!r}: ConvRot group size {raw!r} is not an integer; the "
                                  "file is damaged. Download or save it again") from None
        for runs, fix in ((False, "Neither ComfyUI nor this pack can decode it: the file is damaged. Download it "
                                  "again or quantize the float model again"),
                          (True, "Load it with 'Load Diffusion Model' and run it through 'Apply Fused INT8 GEMM', "
                                 "which decodes such layers to float and quantizes them again")):
            try:
                convrot.check_group(k, group, p, runs=runs)
            except ValueError as e:
                raise CheckpointError(f"{self.name}: {e}. {fix}") from None
        return group

    def _entry(self, p, wk, sk, bk, smk, br="") -> QuantEntry:
        h, where = self.header, f"{self.name}: {_bn(br)}layer {p!r}"
        if _dtype(h, wk) != "I8" or len(_shape(h, wk)) != 2:
            raise CheckpointError(f"{where}: weight must be int8 [N, K], found {_dtype(h, wk)} {list(_shape(h, wk))}")
        N, K = _shape(h, wk)
        check_scale_shape(_shape(h, sk), N, where)
        if _dtype(h, sk) not in ("F32", "F16", "BF16"):
            raise CheckpointError(f"{where}: scale dtype {_dtype(h, sk)} is not a float type")
        if bk is not None and _shape(h, bk) != (N,):
            raise CheckpointError(f"{where}: bias has shape {list(_shape(h, bk))}, expected [{N}]")
        if smk is not None and _shape(h, smk) not in ((K,), (1, K)):
            raise CheckpointError(f"{where}: smooth has shape {list(_shape(h, smk))}, expected [{K}]")
        return QuantEntry(p, N, K, wk, sk, bk, smk)

    # ---------------------------------------------------------------- tensor access
    def tensor(self, key: str) -> torch.Tensor:
        return self._f.get_tensor(key)

    def quant_tensors(self, branch: str, name: str):
        """(qweight int8 [N, K], weight_scale fp32 [N], bias fp32 [N] | None, smooth fp32 [K] | None)."""
        e = self.branches[branch].quant[name]
        q = self.tensor(e.qweight)
        s = self.tensor(e.scale).float().reshape(-1)
        if s.numel() == 1:
            s = s.expand(e.out_features).clone()
        b = None if e.bias is None else self.tensor(e.bias).float()
        sm = None
        if e.smooth is not None:
            sm = self.tensor(e.smooth).float().reshape(-1)
            if not (torch.isfinite(sm).all() and (sm > 0).all()):
                raise CheckpointError(f"{self.name}: {_bn(branch)}layer {name!r}: smooth holds non-positive or "
                                      "non-finite values; the file is damaged")
            if self.smooth_inverted:
                sm = 1.0 / sm
        check_scale_values(s, f"{self.name}: {_bn(branch)}layer {name!r}", f"weight scale {e.scale!r}")
        return q, s, b, sm

    def branch_state_dict(self, branch: str) -> dict[str, torch.Tensor]:
        """The branch in the pack's normalized naming (``p.qweight``, ``p.weight_scale``, ...), read now."""
        b = self.branches[branch]
        out = {n: self.tensor(k) for n, k in b.floats.items()}
        for n in b.quant:
            q, s, bias, sm = self.quant_tensors(branch, n)
            out[f"{n}.qweight"], out[f"{n}.weight_scale"] = q, s
            if bias is not None:
                out[f"{n}.bias"] = bias
            if sm is not None:
                out[f"{n}.smooth"] = sm
        return out

    def describe(self) -> str:
        parts = [f"{_bn(b) or 'model '}{len(x.quant)} int8 + {len(x.floats)} float tensors"
                 for b, x in self.branches.items()]
        return f"{self.name}: {self.format}; " + "; ".join(parts)

    def close(self) -> None:
        self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _bn(branch: str) -> str:
    return f"{branch} branch, " if branch else ""


def open_checkpoint(path: str) -> Int8Checkpoint:
    """Open and validate an INT8 checkpoint (any supported layout); raises CheckpointError otherwise."""
    return Int8Checkpoint(path)
