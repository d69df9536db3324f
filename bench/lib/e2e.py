"""Ideogram 4's full-size backbone for the benches that run it through ComfyUI (bench/e2e_sampler.py,
bench/e2e_models.py, bench/convrot.py):
its ComfyUI state-dict layout (34 layers, hidden 4608) with deterministic random weights, ComfyUI core's
``int8_tensorwise`` layout of it, the pack imported as ComfyUI imports it, the pack's Apply node with its defaults,
a run's provenance and the relative L2 the benches report. Imports torch; ComfyUI only through the pack (the caller
has put ComfyUI on ``sys.path``).
"""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, FFN, HEADS, ADALN, TEXT_DIM, IN_CH = 4608, 12288, 18, 512, 53248, 128
BLOCK_LINEARS = ["attention.qkv", "attention.o", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]


# Narrow widths for CPU runs (tests, smoke runs): ComfyUI builds Ideogram 4 at the widths of its model config
# (``supported_models.Ideogram4.unet_extra_config``; its detection reads only the depth and channels from a file), so
# ``narrow`` sets that config and this module's widths together. 2 heads of the real 256 (the RoPE sections and head
# size stay), FFN 1024, adaLN 128, text 256: a layer ~1/1000 of a real one's weights, the same classes and code.
NARROW = {"num_attention_heads": 2, "intermediate_size": 1024, "adaln_dim": 128, "llm_features_dim": 256}


def narrow() -> dict:
    """ComfyUI's Ideogram 4 config (ComfyUI imported) and this module's widths at ``NARROW``, for this process.
    Returns the widths as ``adapters.ideogram4.layout.widths`` names them. Never on a bench's GPU run."""
    global HIDDEN, FFN, HEADS, ADALN, TEXT_DIM
    import comfy.supported_models as sm
    sm.Ideogram4.unet_extra_config = {**sm.Ideogram4.unet_extra_config, **NARROW}
    c = sm.Ideogram4.unet_extra_config
    HEADS, head = c["num_attention_heads"], c["attention_head_dim"]
    HIDDEN, FFN, ADALN, TEXT_DIM = HEADS * head, c["intermediate_size"], c["adaln_dim"], c["llm_features_dim"]
    return dict(hidden=HIDDEN, heads=HEADS, head=head, ffn=FFN, adaln=ADALN, text=TEXT_DIM, channels=IN_CH)


# Qwen-Image's widths are its model class's defaults (24 heads of 128, text 3584), which ComfyUI's model config
# overrides where it names them (``supported_models.QwenImage.unet_extra_config``, empty in 0.33.0): 1 head of the real
# 128 (its RoPE axes), text 64.
QWEN_NARROW = {"num_attention_heads": 1, "joint_attention_dim": 64}


def narrow_qwen() -> dict:
    """ComfyUI's Qwen-Image config (ComfyUI imported) at ``QWEN_NARROW``, for this process; returns it."""
    import comfy.supported_models as sm
    sm.QwenImage.unet_extra_config = {**sm.QwenImage.unet_extra_config, **QWEN_NARROW}
    return dict(QWEN_NARROW)


# ----------------------------------------------------------------------------- model construction
def ideogram4_shapes(layers: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Key -> (shape, is_linear_weight) of one Ideogram 4 backbone (ComfyUI key names)."""
    s: dict[str, tuple[tuple[int, ...], bool]] = {}

    def lin(p, i, o, bias=True):
        s[f"{p}.weight"] = ((o, i), True)
        if bias:
            s[f"{p}.bias"] = ((o,), False)

    lin("input_proj", IN_CH, HIDDEN)
    s["llm_cond_norm.weight"] = ((TEXT_DIM,), False)
    lin("llm_cond_proj", TEXT_DIM, HIDDEN)
    lin("t_embedding.mlp_in", HIDDEN, HIDDEN)
    lin("t_embedding.mlp_out", HIDDEN, HIDDEN)
    lin("adaln_proj", HIDDEN, ADALN)
    s["embed_image_indicator.weight"] = ((2, HIDDEN), False)
    for i in range(layers):
        p = f"layers.{i}"
        lin(f"{p}.attention.qkv", HIDDEN, 3 * HIDDEN, bias=False)
        lin(f"{p}.attention.o", HIDDEN, HIDDEN, bias=False)
        s[f"{p}.attention.norm_q.weight"] = ((HIDDEN // HEADS,), False)
        s[f"{p}.attention.norm_k.weight"] = ((HIDDEN // HEADS,), False)
        lin(f"{p}.feed_forward.w1", HIDDEN, FFN, bias=False)
        lin(f"{p}.feed_forward.w3", HIDDEN, FFN, bias=False)
        lin(f"{p}.feed_forward.w2", FFN, HIDDEN, bias=False)
        for n in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
            s[f"{p}.{n}.weight"] = ((HIDDEN,), False)
        lin(f"{p}.adaln_modulation", ADALN, 4 * HIDDEN)
    lin("final_layer.linear", HIDDEN, IN_CH)
    lin("final_layer.adaln_modulation", ADALN, HIDDEN)
    return s


def random_layout(layers: int) -> list:
    """[(key, shape, bf16)] of an Ideogram 4 backbone of ``layers`` layers, in ``random_tensors``' order."""
    return [(k, tuple(shape), torch.bfloat16) for k, (shape, _) in ideogram4_shapes(layers).items()]


def random_tensors(layers: int, device, seed: int = 0):
    """(key, deterministic random bf16 tensor on the CPU) of each parameter: N(0, 1/in) linears (unit-gain), norms
    near 1, small biases; made on ``device`` one at a time."""
    g = torch.Generator(device=device).manual_seed(seed)
    for k, (shape, is_w) in ideogram4_shapes(layers).items():
        if is_w:
            t = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16) * (shape[1] ** -0.5)
        elif "norm" in k:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        else:
            t = 0.02 * torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        yield k, t.to("cpu")


def random_state_dict(layers: int, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random bf16 weights (``random_tensors``) as a state dict on the CPU."""
    return dict(random_tensors(layers, device, seed))


def core_int8_state_dict(sd: dict[str, torch.Tensor], device, linear=None) -> dict[str, torch.Tensor]:
    """``sd`` with the linears ``linear(name, weight)`` picks (default: Ideogram 4's block linears) in ComfyUI core's
    ``int8_tensorwise`` layout (int8 weight, per-output-channel ``weight_scale`` = absmax / 127 as [N, 1], the shape
    comfy-kitchen's own quantizer writes, ``comfy_quant``), quantized on ``device`` and returned on the CPU."""
    if linear is None:
        linear = lambda p, w: any(p.endswith(n) for n in BLOCK_LINEARS)  # noqa: E731
    out = {}
    for k, v in sd.items():
        p = k[: -len(".weight")]
        if k.endswith(".weight") and linear(p, v):
            out.update(core_int8_entries(p, v, device))
        else:
            out[k] = v
    return out


CORE_CONF = json.dumps({"format": "int8_tensorwise"}).encode()


def core_int8_entries(prefix: str, weight: torch.Tensor, device):
    """The three core ``int8_tensorwise`` entries of one linear's float ``weight`` [N, K] (quantized on ``device``,
    returned on the CPU): ``<prefix>.weight`` int8 codes, ``.weight_scale`` [N, 1] fp32 (absmax / 127 per output
    channel), ``.comfy_quant`` (the format as JSON bytes), in that order."""
    w = weight.to(device).float()
    scale = w.abs().amax(1).clamp(min=1e-12) / 127.0
    return {f"{prefix}.weight": torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8).cpu(),
            f"{prefix}.weight_scale": scale[:, None].cpu(),
            f"{prefix}.comfy_quant": torch.tensor(list(CORE_CONF), dtype=torch.uint8)}


def load_pack():
    """Import this repository as the ComfyUI custom-node package ``comfyui_int8_fused``, the one way tests do
    (tests/pack_import.py: ``kernel``, ``quant``, ``adapters`` are its subpackages)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.append(str(ROOT / "tests"))
    import pack_import
    pack_import.install()
    return pack_import.import_pack()


def node_inputs(cls, links: dict, widgets: dict | None = None, unique_id: str = "bench") -> dict:
    """The keyword arguments ComfyUI's executor passes to node ``cls``: every widget input (required and optional,
    since the frontend sends each widget's value) at its INPUT_TYPES default unless ``widgets`` sets it, the
    connected inputs ``links``, and the hidden UNIQUE_ID. Unconnected link inputs are left out."""
    spec = cls.INPUT_TYPES()
    kw = {}
    for section in ("required", "optional"):
        for name, (typ, *opt) in spec.get(section, {}).items():
            o = opt[0] if opt else {}
            if name in links:
                kw[name] = links[name]
            elif isinstance(typ, (list, tuple)):
                kw[name] = o.get("default", typ[0])
            elif typ in ("INT", "FLOAT", "BOOLEAN", "STRING"):
                kw[name] = o.get("default", {"INT": 0, "FLOAT": 0.0, "BOOLEAN": False, "STRING": ""}[typ])
    for name, value in (widgets or {}).items():
        if name not in kw:
            raise KeyError(f"{cls.__name__} has no widget input {name!r}")
        kw[name] = value
    for name, what in spec.get("hidden", {}).items():
        if what == "UNIQUE_ID":
            kw[name] = unique_id
    return kw


def run_node(cls, links: dict, widgets: dict | None = None, unique_id: str = "bench"):
    """Node ``cls`` called with ``node_inputs``; its result tuple. (ComfyUI's executor also runs it inside
    ``torch.inference_mode()``: the caller's choice here.)"""
    out = getattr(cls(), cls.FUNCTION)(**node_inputs(cls, links, widgets, unique_id))
    return out["result"] if isinstance(out, dict) else out


def pack_apply(pack, patcher, backend: str, calibration=None, unique_id: str = "e2e", **widgets):
    """The pack's "Apply Fused INT8 GEMM" node on ``patcher`` with its defaults (``widgets`` override them, e.g.
    ``attention="cudnn"``), ``calibration`` connected when given; the patched model."""
    cls = pack.NODE_CLASS_MAPPINGS["ApplyFusedInt8GEMM"]
    links = {"model": patcher} if calibration is None else {"model": patcher, "calibration": calibration}
    return run_node(cls, links, dict(widgets, backend=backend), unique_id)[0]


def provenance(dev) -> dict:
    """GPU, driver, date, torch / Triton versions and commit ($BENCH_COMMIT, else git) of a bench run."""
    from bench.lib import provenance as prov
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke run)",
            "driver": prov.driver() if dev.type == "cuda" else None, "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton_version, "commit": prov.commit(short=True)}


def rel_l2(out, ref, f64: bool = False) -> float:
    """||out - ref|| / ||ref||: in float64 with ``f64``, else in the inputs' dtype (bench/h200.sh's check compares the
    sampler rows' float32 figures to the last digit)."""
    if f64:
        out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())
