"""Bad user input handled loudly (issue 35, items 3.5, 3.6, 3.7, 3.9).

* Layer patterns (include / exclude / keep_float): a comma inside ``{m,n}``, ``[...]`` or ``(...)`` belongs to its
  pattern (``refiner\\.[0-9]{1,2}\\.`` used to become two patterns that matched nothing), one pattern per line works
  too, each pattern's matches are logged and a pattern that matches nothing is a warning naming it. Checked through
  Apply on the Lumina 2 miniature (pinned ComfyUI, in-process).
* Str switches with a fixed set of values (``kernel/config.py`` ``choices``): an unknown value warns once, naming
  the switch, the value and the valid values, and means the default, like the bool switches; checked in a fresh
  process whose environment holds the bad values.
* ``INT8_FUSED_BACKEND`` naming no backend: one warning when the pack is imported, and Apply's list and the Ideogram 4
  loader's ``auto`` treat it as unset (current ComfyUI, subprocess).
* A layer whose weight scales are all zero: a warning naming the layer and the file, from the pack's readers (every
  layout) and when Apply adopts core ``int8_tensorwise`` weights.
"""
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quant import formats as F
from quant import select

ROOT = Path(__file__).resolve().parents[1]
REFINER = r"refiner\.[0-9]{1,2}\."  # the issue's pattern: a {m,n} quantifier with a comma


# ---------------------------------------------------------------------------------------------- 3.5 patterns
def test_split_patterns_at_top_level_commas_and_new_lines():
    def sp(text):  # through the API Apply and Calibrate call
        return [p.pattern for p in select.compile_patterns(text)]
    assert sp(REFINER) == [REFINER]
    assert select.split_patterns(r"a{2,1}") == [r"a{2,1}"]
    assert sp("a, b ,,c") == ["a", "b", "c"]
    assert sp(r"(w1|w3,x)\.y, z") == [r"(w1|w3,x)\.y", "z"]
    assert sp(r"[,;]x,y") == [r"[,;]x", "y"]
    assert sp(r"[]a,]q,r") == [r"[]a,]q", "r"]  # "]" first in a class is a literal
    assert sp(r"x\,y,z") == [r"x\,y", "z"]  # an escaped comma stays in its pattern
    assert sp("layers\\.0\\.\n" + REFINER + "\n\n final_layer ") == ["layers\\.0\\.", REFINER, "final_layer"]
    assert sp("x{,y") == ["x{", "y"]  # "{" that starts no quantifier is a literal: the comma splits
    assert sp("x{,2}") == ["x{,2}"]
    assert sp(None) == sp("") == sp(" , \n") == []
    assert re.compile(sp(r"x\,y")[0]).search("x,y")  # \, is a literal comma to re
    with pytest.raises(ValueError, match=r"'a\{2,1\}' is not a valid regular expression"):
        select.compile_patterns("a{2,1}, b")  # used to be split into two valid patterns


@pytest.fixture(scope="module")
def apply_node(pack):
    return pack.nodes.apply.ApplyFusedInt8GEMM()


def _quantized(pack, mp) -> set:
    return set(pack.nodes.weights.int8_layers(mp))


def _linears(mp) -> list:
    return [n for n, m in mp.model.diffusion_model.named_modules() if isinstance(m, torch.nn.Linear)]


def test_apply_exclude_with_a_quantifier_excludes_and_logs(pack, tiny_model, apply_node, caplog):
    mp = tiny_model("lumina2")
    refiners = [n for n in _linears(mp) if re.search(r"refiner\.\d+\.", n)]  # in model order, as logged
    assert len(refiners) >= 4  # noise_refiner.0 and context_refiner.0: attention + feed-forward linears
    base = _quantized(pack, apply_node.apply(mp, "torch_int_mm")[0])
    assert set(refiners) & base  # the blocks preset quantizes the refiners
    with caplog.at_level(logging.INFO, logger="int8_fused"):
        out = apply_node.apply(mp, "torch_int_mm", exclude=REFINER)[0]
    assert _quantized(pack, out) == base - set(refiners)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and repr(REFINER) in r.getMessage()]
    assert len(info) == 1 and f"exclude pattern {REFINER!r} matched {len(refiners)} layer(s)" in info[0]
    assert info[0].endswith(": " + ", ".join(refiners[:4]) + ", ...")  # the first few, in model order
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    # one pattern per line, and a pattern that matches nothing: a warning naming it
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="int8_fused"):
        out = apply_node.apply(mp, "torch_int_mm", exclude=f"{REFINER}\nlayers\\.[0-9]{{1,2}}\\.attention\\.out\n"
                                                           "no_such_layer")[0]
    outs = {n for n in _linears(mp) if re.search(r"^layers\.\d+\.attention\.out$", n)}
    assert outs and _quantized(pack, out) == base - set(refiners) - outs
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "exclude pattern 'no_such_layer' matched no layer" in warned[0]


def test_keep_float_with_a_quantifier(pack, tiny_model, apply_node, caplog):
    mp = tiny_model("lumina2")
    pat = r"layers\.[0-9]{1,2}\.feed_forward\.w[23]"
    want = {n for n in _linears(mp) if re.fullmatch(r"layers\.\d+\.feed_forward\.w[23]", n)}
    assert len(want) == 4
    with caplog.at_level(logging.INFO, logger="int8_fused"):
        out = apply_node.apply(mp, "torch_int_mm", keep_float=pat + ", final_layer\\.nothing")[0]
    assert set(out.int8_report.kept_float) == want and not want & _quantized(pack, out)
    msgs = [r.getMessage() for r in caplog.records]
    assert any(f"keep_float pattern {pat!r} matched 4 layer(s)" in m for m in msgs)
    assert any("keep_float pattern 'final_layer\\\\.nothing' matched no layer" in m for m in msgs)


def test_tooltips_say_how_patterns_are_separated(pack):
    req = pack.nodes.apply.ApplyFusedInt8GEMM.INPUT_TYPES()["required"]
    for k in ("include", "exclude", "keep_float"):
        tip = req[k][1]["tooltip"]
        assert "per line" in tip and "{m,n}" in tip and "matches none is a warning" in tip, k
    creq = pack.nodes.calibrate.Int8Calibrate.INPUT_TYPES()["required"]
    assert all("per line" in creq[k][1]["tooltip"] for k in ("include", "exclude"))


# ---------------------------------------------------------------------------------------------- 3.6 switches
PROBE = """
import json, logging, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]; import pack_import; pack_import.install()
logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")
from kernel import config
from quant import dispatch
from adapters.base import pad_elision_enabled
names = json.loads(sys.argv[2])
first = {n: config.get(n) for n in names}
again = {n: config.get(n) for n in names}  # read once: no second warning
print(json.dumps({"values": first, "same": first == again,
                  "dispatch": dispatch.mode(),
                  "pad_elision": {b: pad_elision_enabled(b) for b in ("fused_triton", "torch_int_mm")}}))
"""
STR_SWITCHES = ("INT8_FUSED_PAD_ELISION", "INT8_FUSED_DISPATCH", "INT8_FUSED_TUNE")


def _probe(env: dict) -> tuple[dict, list]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("INT8_FUSED_", "TRITON_INTERPRET"))}
    r = subprocess.run([sys.executable, "-c", PROBE, str(ROOT), json.dumps(STR_SWITCHES)],
                       env={**base, "TRITON_INTERPRET": "1", **env}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), [ln for ln in r.stderr.splitlines() if ln.startswith("LOG")]


def test_str_switches_declare_their_values():
    from kernel import config
    assert {n for n, s in config.SWITCHES.items() if s.choices} == set(STR_SWITCHES)
    # the free-form ones: a path, backend names (checked by the nodes, which know the registry), and a count
    # (`auto` or a number: kernel.procs.count warns about anything else and takes `auto`, test_compile_procs.py)
    assert {n for n, s in config.SWITCHES.items() if s.type is str and not s.choices} == {
        "INT8_FUSED_BACKEND", "INT8_FUSED_CACHE_DIR", "INT8_FUSED_COMPILE_PROCS"}
    table = config.markdown_table()
    row = next(ln for ln in table.splitlines() if ln.startswith("| `INT8_FUSED_PAD_ELISION` |"))
    assert "Values: `auto`, `0`, `1`" in row
    for n in STR_SWITCHES:
        s = config.SWITCHES[n]
        line = next(ln for ln in table.splitlines() if ln.startswith(f"| `{n}` |"))
        assert all(f"`{c}`" in line.split("Values:")[1] for c in s.choices), n


def test_unknown_str_switch_values_warn_once_and_mean_the_default():
    got, logs = _probe({n: "bogus" for n in STR_SWITCHES})
    assert got["values"] == {"INT8_FUSED_PAD_ELISION": None, "INT8_FUSED_DISPATCH": "auto",
                             "INT8_FUSED_TUNE": "background"} and got["same"]
    assert got["dispatch"] == "auto" and got["pad_elision"] == {"fused_triton": True, "torch_int_mm": False}
    valid = {"INT8_FUSED_PAD_ELISION": "auto|0|1", "INT8_FUSED_DISPATCH": "auto|int8|float",
             "INT8_FUSED_TUNE": "background|first_call|off"}
    for n in STR_SWITCHES:
        mine = [ln for ln in logs if f"{n}='bogus'" in ln]
        assert len(mine) == 1 and mine[0].startswith("LOG WARNING") and valid[n] in mine[0], (n, logs)
    assert len(logs) == len(STR_SWITCHES), logs


def test_str_switch_spellings():
    got, logs = _probe({"INT8_FUSED_PAD_ELISION": "on", "INT8_FUSED_DISPATCH": "Float", "INT8_FUSED_TUNE": "OFF"})
    assert not logs
    assert got["values"] == {"INT8_FUSED_PAD_ELISION": "1", "INT8_FUSED_DISPATCH": "float", "INT8_FUSED_TUNE": "off"}
    assert got["dispatch"] == "float" and got["pad_elision"] == {"fused_triton": True, "torch_int_mm": True}
    # an off word means 0 where 0 is a choice; an on word without a 1 among the choices means the default
    got, logs = _probe({"INT8_FUSED_PAD_ELISION": " OFF ", "INT8_FUSED_DISPATCH": "yes"})
    assert not logs and got["values"] == {"INT8_FUSED_PAD_ELISION": "0", "INT8_FUSED_DISPATCH": "auto",
                                          "INT8_FUSED_TUNE": "background"}
    assert got["pad_elision"] == {"fused_triton": False, "torch_int_mm": False}


def test_override_reads_a_value_as_the_environment_does(caplog):
    from kernel import config
    with caplog.at_level(logging.WARNING, logger="int8_fused"):
        with config.override(INT8_FUSED_PAD_ELISION="bogus", INT8_FUSED_DISPATCH="INT8"):
            assert config.get("INT8_FUSED_PAD_ELISION") is None and config.get("INT8_FUSED_DISPATCH") == "int8"
        with config.override(INT8_FUSED_PAD_ELISION="none"):
            assert config.get("INT8_FUSED_PAD_ELISION") == "0"
    assert "INT8_FUSED_PAD_ELISION='bogus' is not one of auto|0|1" in caplog.text


# ---------------------------------------------------------------------------------------------- 3.9 zero scales
def _layers(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = {n: torch.randint(-127, 128, (32, 48), generator=g, dtype=torch.int8) for n in ("blk.a", "blk.b", "blk.c")}
    s = {n: torch.rand(32, generator=g) * 0.01 + 1e-3 for n in q}
    s["blk.a"] = torch.zeros(32)  # the broken layer
    s["blk.b"][3] = 0.0  # one zero row: legal (an all-zero weight row)
    return q, s


def _write(path, layout, q, s):
    conf = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
    t, meta = {"norm.weight": torch.ones(48)}, None
    for n in q:
        if layout == "pack":
            t[f"{n}.qweight"], t[f"{n}.weight_scale"] = q[n], s[n]
            meta = {"format": "int8_fused", "format_version": "1"}
        elif layout == "core":
            t[f"{n}.weight"], t[f"{n}.weight_scale"], t[f"{n}.comfy_quant"] = q[n], s[n], conf.clone()
        else:
            t[f"{n}.wq"], t[f"{n}.ws"] = q[n], s[n][:, None]
    save_file(t, str(path), metadata=meta)


@pytest.mark.parametrize("layout", ["pack", "core", "transformerlab"])
def test_a_layer_of_zero_scales_warns_at_load(tmp_path, caplog, layout):
    q, s = _layers()
    path = tmp_path / f"broken_{layout}.safetensors"
    _write(path, layout, q, s)
    with caplog.at_level(logging.WARNING, logger="int8_fused"), F.open_checkpoint(str(path)) as ck:
        sd = ck.branch_state_dict("")  # what the loader reads
    for n in q:  # read back as written
        assert torch.equal(sd[f"{n}.qweight"], q[n]) and torch.equal(sd[f"{n}.weight_scale"], s[n])
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1, msgs
    assert path.name in msgs[0] and "'blk.a'" in msgs[0] and "every weight scale" in msgs[0]


# ---------------------------------------------------------------------------------------------- on ComfyUI 0.33.0
CURRENT = """
import json, logging, sys
import torch
seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append([record.levelname, record.getMessage()])
logging.getLogger("int8_fused").addHandler(Keep())
logging.getLogger("int8_fused").setLevel(logging.INFO)
pack = import_pack()  # the pack's nodes/__init__ checks INT8_FUSED_BACKEND here
at_start = [m for l, m in seen if "INT8_FUSED_BACKEND" in m]
import atexit, folder_paths, shutil, tempfile
from safetensors.torch import save_file
models = tempfile.mkdtemp(prefix="int8_bad_")
atexit.register(shutil.rmtree, models, True)
folder_paths.add_model_folder_path("diffusion_models", models, is_default=True)
i4 = sys.modules["comfyui_int8_fused.adapters.ideogram4.layout"]
W = sys.modules["comfyui_int8_fused.quant.fmt_write"]
backends = pack.quant.backends
cpu = torch.device("cpu")
res = {"at_start": at_start, "choices": pack.nodes.apply.backend_choices(), "available": backends.available(cpu),
       "default": backends.default_backend(cpu)}
from comfy_harness import narrow_ideogram4
w = narrow_ideogram4()  # ComfyUI's Ideogram 4 config at narrow widths (the loader checks the file against it)
sd = i4.random_state_dict(1, w, seed=0)
O = "layers.0.attention.o"
q, f = i4.quantize_state_dict(sd, [O, "layers.0.attention.qkv"])
q[O]["weight_scale"] = torch.zeros_like(q[O]["weight_scale"])
W.write_transformerlab(models + "/one.safetensors", {"": (q, f)})
del q, f
# the loader's auto: INT8_FUSED_BACKEND=nonexistent counts as unset
cond = None
try:
    cond, _ = pack.nodes.loader.LoadIdeogram4Int8().load("one.safetensors", "auto", "none", "none")
    Int8Linear = sys.modules["comfyui_int8_fused.quant.linear"].Int8Linear
    res["loader_backends"] = sorted({m.backend for m in cond.model.diffusion_model.modules()
                                     if isinstance(m, Int8Linear)})
except Exception as e:
    res["loader_error"] = f"{type(e).__name__}: {e}"
del cond
res["loader_zero"] = [m for l, m in seen if l == "WARNING" and "weight scale" in m]
# core int8_tensorwise adopted by Apply: the attention output projection's scales all zero
conf = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
wt = sd.pop(O + ".weight").float()
sd[O + ".weight"] = torch.round(wt / (wt.abs().amax(1, keepdim=True) / 127)).clamp(-127, 127).to(torch.int8)
sd[O + ".weight_scale"] = torch.zeros(wt.shape[0])
sd[O + ".comfy_quant"] = conf
save_file(sd, models + "/core_zero.safetensors")
del sd, wt
core = comfy.sd.load_diffusion_model(models + "/core_zero.safetensors", model_options={"dtype": torch.bfloat16})
n0 = len(seen)
(out,) = pack.nodes.apply.ApplyFusedInt8GEMM().apply(core, "torch_int_mm", exclude="feed_forward, adaln")
res["adopted"] = out.int8_report.adopted
res["core_zero"] = [m for l, m in seen[n0:] if l == "WARNING" and "weight scale" in m]
res["backend_warnings"] = [m for l, m in seen if "INT8_FUSED_BACKEND" in m]
print("RESULT " + json.dumps(res))
"""


def test_unknown_backend_switch_and_zero_scales_on_current_comfyui(comfy_current):
    from comfy_harness import run_in_current_comfy
    env = {**os.environ, "INT8_FUSED_BACKEND": "nonexistent"}
    cp = run_in_current_comfy(CURRENT, env=env, timeout=1500)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-6000:]
    res = json.loads(next(ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    print(json.dumps(res, indent=1))
    # said once, at start, naming the switch and the valid names
    assert len(res["at_start"]) == 1 and res["backend_warnings"] == res["at_start"]
    assert "INT8_FUSED_BACKEND='nonexistent'" in res["at_start"][0]
    assert all(b in res["at_start"][0] for b in ("fused_triton", "torch_int_mm", "dequant_bf16", "bf16"))
    # treated as unset: Apply's list in its usual order, the loader's auto takes the machine's default
    want = res["available"] if "bf16" in res["available"] else res["available"] + ["bf16"]
    assert res["choices"] == want
    assert "loader_error" not in res, res.get("loader_error")
    assert res["loader_backends"] and set(res["loader_backends"]) <= set(res["available"])
    # all-zero weight scales: named with the layer and the file, by the loader and by Apply's core adoption
    assert len(res["loader_zero"]) == 1 and "one.safetensors" in res["loader_zero"][0]
    assert "'layers.0.attention.o'" in res["loader_zero"][0]
    assert res["adopted"] == 1
    assert len(res["core_zero"]) == 1 and "core_zero.safetensors" in res["core_zero"][0]
    assert "'layers.0.attention.o'" in res["core_zero"][0]


# ---------------------------------------------------------------------------------------------- issue 47 (0.33.0)
# Damaged ComfyUI core int8_tensorwise files (tiny Flux, bench/e2e_models.py's config, which ComfyUI 0.33.0
# detects): one plain layer P and one ConvRot layer R (comfy-kitchen's own ConvRot quantizer), loaded by core,
# then Apply. And the Ideogram 4 loader's branch builder (nodes/loader.build_branch) on the same undamaged file.
ISSUE47 = """
import json, logging, os, shutil, sys, tempfile
import torch
from safetensors.torch import save_file
seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append([record.levelname, record.getMessage()])
logging.getLogger("int8_fused").addHandler(Keep())
pack = import_pack()
import comfy.sd
from comfy_kitchen.backends.eager import quantization as ck
from bench import e2e_models
F = sys.modules["comfyui_int8_fused.quant.formats"]
ConvRotLinear = sys.modules["comfyui_int8_fused.quant.convrot"].ConvRotLinear
sd, _ = e2e_models.random_state_dict("flux", e2e_models.unet_config("flux", True), torch.device("cpu"))
P, R = "double_blocks.0.img_attn.proj", "double_blocks.0.img_mlp.0"  # [256, 256], [1024, 256]
d = tempfile.mkdtemp(prefix="int8_i47_")

def conf(**c):
    return torch.tensor(list(json.dumps({"format": "int8_tensorwise", **c}).encode()), dtype=torch.uint8)

def write(name, p_scale=None, r_scale=None, group=256, quant_group=256):
    out = dict(sd)
    w = sd[P + ".weight"].float()
    s = w.abs().amax(1, keepdim=True) / 127  # [N, 1], as ComfyUI's own per-channel quantizers write it
    out[P + ".weight"] = torch.round(w / s).clamp(-127, 127).to(torch.int8)
    out[P + ".weight_scale"], out[P + ".comfy_quant"] = s if p_scale is None else p_scale(s), conf()
    q, rs = ck.quantize_int8_convrot_weight(sd[R + ".weight"].float(), quant_group)
    out[R + ".weight"], out[R + ".weight_scale"] = q, rs.float() if r_scale is None else r_scale(rs.float())
    out[R + ".comfy_quant"] = conf(convrot=True, convrot_groupsize=group)
    save_file(out, os.path.join(d, name))
    return os.path.join(d, name)

def put(s, i, v):
    s = s.clone()
    s.view(-1)[i] = v
    return s

cases = {"nan": dict(p_scale=lambda s: put(s, 3, float("nan"))),
         "inf_convrot": dict(r_scale=lambda s: put(s, 5, float("inf"))),
         "negative": dict(p_scale=lambda s: -s),
         "shape": dict(p_scale=lambda s: s[1:]),  # [255, 1] for N = 256
         "group_48": dict(group=48), "group_0": dict(group=0), "group_-256": dict(group=-256),
         "group_4096": dict(group=4096),  # a power of 4 past K = 256
         "group_4": dict(group=4, quant_group=4)}  # decodes (comfy-kitchen runs it): quantized again, no error
res = {}
apply = pack.nodes.apply.ApplyFusedInt8GEMM()
for case, kw in cases.items():
    core = comfy.sd.load_diffusion_model(write(case + ".safetensors", **kw))
    n0 = len(seen)
    try:
        (out,) = apply.apply(core, "torch_int_mm")
        res[case] = {"ok": True, "adopted": out.int8_report.adopted,
                     "warnings": [m for l, m in seen[n0:] if l == "WARNING"]}
    except Exception as e:
        res[case] = {"ok": False, "error": f"{type(e).__module__}.{type(e).__name__}: {e}",
                     "input_untouched": not core.object_patches}
    del core

# item C: the loader's branch builder on an undamaged file with a ConvRot layer, against core's decode of it
path = write("good.safetensors")
core = comfy.sd.load_diffusion_model(path)
wr = core.model.diffusion_model.double_blocks[0].img_mlp[0].weight.dequantize().double()  # comfy-kitchen's decode
try:
    with F.open_checkpoint(path) as f:
        m = pack.nodes.loader.build_branch(f, "", "torch_int_mm")
    L = m.model.diffusion_model.double_blocks[0].img_mlp[0]
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y = L(x).double() - L.bias.double()
    ref = x.double() @ wr.T
    res["loader"] = {"convrot": isinstance(L, ConvRotLinear) and L.rotation, "err": float(
        (y - ref).norm() / ref.norm()), "plain": type(m.model.diffusion_model.double_blocks[0].img_attn.proj).__name__}
except Exception as e:
    res["loader"] = {"error": f"{type(e).__name__}: {e}"}
shutil.rmtree(d, True)
print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def issue47(comfy_current):
    from comfy_harness import run_in_current_comfy
    cp = run_in_current_comfy(ISSUE47, timeout=900)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-6000:]
    res = json.loads(next(ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    print(json.dumps(res, indent=1))
    return res


def _refused(res, case, *words):
    r = res[case]
    assert not r["ok"], (case, r)
    assert r["error"].startswith(f"int8_fused.CheckpointError: {case}.safetensors: "), (case, r["error"])
    assert r["input_untouched"], case
    for w in words:
        assert w in r["error"], (case, w, r["error"])


def test_core_int8_damaged_scales_refused_by_apply(issue47):
    """Item A: NaN / +Inf (plain and ConvRot) and negative weight_scale values: Apply used to adopt them (an
    all-NaN or a wrong latent); now refused naming the file and the layer, what is wrong and what to do."""
    P, R = "'double_blocks.0.img_attn.proj'", "'double_blocks.0.img_mlp.0'"
    _refused(issue47, "nan", P, "holds NaN/Inf", "channel 3", "Download or save it again")
    _refused(issue47, "inf_convrot", R, "holds NaN/Inf", "channel 5: inf")
    _refused(issue47, "negative", P, "256 negative values", "Download or save it again")


def test_core_int8_bad_scale_shape_and_group_refused_before_decoding(issue47):
    """Item B: a scale of the wrong shape, and ConvRot group sizes nothing can decode, used to reach comfy-kitchen's
    decode (a bare broadcast error, "in_features 256 not divisible by group_size 4096") after a log line promising a
    decode; now refused first, naming the file, the layer, the group and K. A group ComfyUI decodes (4) still runs."""
    _refused(issue47, "shape", "'double_blocks.0.img_attn.proj'", "scale has shape [255, 1]", "expected [256]")
    for g in (48, 0, -256):
        _refused(issue47, f"group_{g}", "'double_blocks.0.img_mlp.0'", f"group size {g} is not supported",
                 "powers of 4", "K = 256", "the file is damaged")
    _refused(issue47, "group_4096", "'double_blocks.0.img_mlp.0'", "group size 4096 does not divide the input width "
             "K = 256", "the file is damaged")
    ok = issue47["group_4"]
    assert ok["ok"] and ok["adopted"] == 1, ok  # P adopted, R decoded to float and quantized again
    assert any("group size 4" in w and "decoded to float and quantized again" in w for w in ok["warnings"]), ok


def test_ideogram4_loader_builds_convrot_layers(issue47):
    """Item C: the Ideogram 4 loader refused ConvRot core files ("this pack's kernels do not rotate activations");
    its branch builder now makes them ConvRot layers (as Apply adopts them): W8A8 of the stored weights, within
    per-token rounding of core's own decode (an unrotated layer would be off by ~100 %)."""
    lo = issue47["loader"]
    assert "error" not in lo, lo["error"] if "error" in lo else lo
    assert lo["convrot"] == 256 and lo["plain"] == "Int8Linear"
    assert lo["err"] < 0.02, lo
