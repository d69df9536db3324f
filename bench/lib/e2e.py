"""Ideogram 4's full-size backbone for the benches that run it through ComfyUI (bench/e2e_sampler.py,
bench/e2e_models.py, bench/calibrate_e2e.py, bench/lora.py, bench/convrot.py):
its ComfyUI state-dict layout (34 layers, hidden 4608) with deterministic random weights, ComfyUI core's
``int8_tensorwise`` layout of it, the pack imported as ComfyUI imports it, the pack's Apply node with its defaults,
and a run's provenance. Imports torch; ComfyUI only through the pack (the caller has put ComfyUI on ``sys.path``).
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HIDDEN, FFN, HEADS, ADALN, TEXT_DIM, IN_CH = 4608, 12288, 18, 512, 53248, 128
BLOCK_LINEARS = ["attention.qkv", "attention.o", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]


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


def random_state_dict(layers: int, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random bf16 weights: N(0, 1/in) linears (unit-gain), norms near 1, small biases."""
    g = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for k, (shape, is_w) in ideogram4_shapes(layers).items():
        if is_w:
            t = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16) * (shape[1] ** -0.5)
        elif k.endswith("norm_q.weight") or k.endswith("norm_k.weight") or "norm" in k:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        else:
            t = 0.02 * torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        sd[k] = t.to("cpu")
    return sd


def core_int8_state_dict(sd: dict[str, torch.Tensor], device, linear=None) -> dict[str, torch.Tensor]:
    """``sd`` with the linears ``linear(name, weight)`` picks (default: Ideogram 4's block linears) in ComfyUI core's
    ``int8_tensorwise`` layout (int8 weight, per-output-channel ``weight_scale`` = absmax / 127, ``comfy_quant``),
    quantized on ``device`` and returned on the CPU."""
    if linear is None:
        linear = lambda p, w: any(p.endswith(n) for n in BLOCK_LINEARS)  # noqa: E731
    conf = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
    out = {}
    for k, v in sd.items():
        p = k[: -len(".weight")]
        if k.endswith(".weight") and linear(p, v):
            w = v.to(device).float()
            scale = w.abs().amax(1).clamp(min=1e-12) / 127.0
            out[k] = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8).cpu()
            out[f"{p}.weight_scale"] = scale.cpu()
            out[f"{p}.comfy_quant"] = conf.clone()
        else:
            out[k] = v
    return out


def load_pack():
    """Import this repository as the ComfyUI custom-node package ``comfyui_int8_fused``, the one way tests do
    (tests/pack_import.py: ``kernel``, ``quant``, ``adapters`` are its subpackages)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.append(str(ROOT / "tests"))
    import pack_import
    pack_import.install()
    return pack_import.import_pack()


def pack_apply(pack, patcher, backend: str, **inputs):
    """Run the pack's "Apply Fused INT8 GEMM" node on ``patcher`` with its default settings (``inputs``
    override named inputs, e.g. ``attention="cudnn"``)."""
    cls = pack.NODE_CLASS_MAPPINGS["ApplyFusedInt8GEMM"]
    spec = cls.INPUT_TYPES()
    kw = {}
    for name, (typ, *opt) in spec["required"].items():
        if name == "model":
            continue
        if isinstance(typ, list):
            kw[name] = (opt[0] if opt else {}).get("default", typ[0])
        else:
            kw[name] = (opt[0] if opt else {}).get("default")
    kw["backend"] = backend
    kw.update(inputs)
    hidden = {k: "e2e" for k in spec.get("hidden", {})}
    out = getattr(cls(), cls.FUNCTION)(model=patcher, **kw, **hidden)
    return out[0] if isinstance(out, tuple) else out["result"][0]


def provenance(dev) -> dict:
    """GPU, driver, date, torch / Triton versions and commit ($BENCH_COMMIT, else git) of a bench run."""
    # by file: bench/ may not be importable as a package here, and the pack's root must not shadow ComfyUI's modules
    spec = importlib.util.spec_from_file_location("bench_provenance", HERE / "provenance.py")
    prov = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prov)
    commit = prov.commit(short=True)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    driver = None
    if dev.type == "cuda":
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke run)", "driver": driver,
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton_version,
            "commit": commit}
