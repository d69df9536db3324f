"""The example workflows (example_workflows/*.json) against ComfyUI 0.33.0 with the pack installed, through a real
server (``comfy_server_current``; skipped, naming COMFYUI_CURRENT, without it).

Each workflow is fetched the way the template browser fetches it (listed by ``/workflow_templates`` under the pack's
folder name, served from ``/api/workflow_templates/<pack>/<name>.json``) and checked against the server's
``/object_info``: every node type exists (frontend-only notes aside); links are consistent (both ends exist and name
each other, the link's type is the source output's and the target input's type in the node definitions); widget
values are valid (counts as the node takes them: scripts/workflow.py; combos one of the options, where a model-file
list accepts any ``.safetensors`` name since the test server holds no models; numbers within min / max; booleans and
strings of their type); and the model workflows put the pack's Apply node between a core loader and the sampler.
"""
import json

import requests

import comfy_harness as H

PACK = "comfyui-int8-fused"
MODEL_WORKFLOWS = {  # the model workflows: (loader, its model file, the sampler the Apply output reaches)
    "flux1_int8": ("UNETLoader", "flux1-dev.safetensors", "KSampler"),
    "z_image_int8": ("UNETLoader", "z_image_turbo_bf16.safetensors", "KSampler"),
    "wan21_t2v_int8": ("UNETLoader", "wan2.1_t2v_1.3B_fp16.safetensors", "KSampler"),
    "qwen_image_int8": ("UNETLoader", "qwen_image_fp8_e4m3fn.safetensors", "KSampler"),
    "flux2_int8": ("UNETLoader", "flux2_dev_fp8mixed.safetensors", "BasicGuider"),
    "chroma_int8": ("UNETLoader", "Chroma1-HD.safetensors", "KSampler"),
    "wan22_ti2v_int8": ("UNETLoader", "wan2.2_ti2v_5B_fp16.safetensors", "KSampler"),
}
FILE_INPUTS = ("unet_name", "clip_name", "clip_name1", "clip_name2", "vae_name", "ckpt_name", "int8_checkpoint",
               "base_checkpoint", "base_checkpoint_unconditional")


def _workflow_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("int8fused_workflow", H.ROOT / "scripts" / "workflow.py")
    W = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(W)
    return W


def _options(spec) -> list | None:
    """A combo input's options (old style ``[[...], {}]`` or V3 ``["COMBO", {"options": [...]}]``), else None."""
    if isinstance(spec[0], list):
        return spec[0]
    if spec[0] == "COMBO":
        return (spec[1] if len(spec) > 1 else {}).get("options", [])
    return None


def widget_problems(api: dict, info: dict) -> list[str]:
    """Widget values of an API-format workflow that the node definitions in ``info`` do not accept."""
    bad = []
    for nid, node in api.items():
        spec = info[node["class_type"]]["input"]
        specs = {**spec.get("required", {}), **spec.get("optional", {})}
        for name, v in node["inputs"].items():
            if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], int):
                continue  # a link
            s = specs[name]
            opts, cfg = _options(s), (s[1] if len(s) > 1 and isinstance(s[1], dict) else {})
            where = f"node {nid} ({node['class_type']}) {name}={v!r}"
            if opts is not None:
                files = name in FILE_INPUTS and all(o in ("none", "pixel_space") or "." in str(o) for o in opts)
                if v not in opts and not (files and str(v).endswith(".safetensors")):
                    bad.append(f"{where}: not one of {opts[:12]}")
            elif s[0] in ("INT", "FLOAT"):
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (s[0] == "FLOAT" or v == int(v))
                if not ok or v < cfg.get("min", float("-inf")) or v > cfg.get("max", float("inf")):
                    bad.append(f"{where}: not a {s[0]} in [{cfg.get('min')}, {cfg.get('max')}]")
            elif s[0] == "BOOLEAN" and not isinstance(v, bool) or s[0] == "STRING" and not isinstance(v, str):
                bad.append(f"{where}: not a {s[0]}")
    return bad


def link_problems(ui: dict, info: dict, skip=()) -> list[str]:
    """Links of a UI-format workflow that are inconsistent with its nodes or with the node definitions."""
    nodes = {n["id"]: n for n in ui["nodes"]}
    bad = [] if len(nodes) == len(ui["nodes"]) else ["duplicate node ids"]
    links = {lk[0]: lk for lk in ui["links"]}
    if len(links) != len(ui["links"]):
        bad.append("duplicate link ids")
    if ui.get("last_node_id", 0) < max(nodes) or ui.get("last_link_id", 0) < max(links, default=0):
        bad.append("last_node_id / last_link_id below an id in use")
    for lid, a, sa, b, sb, t in ui["links"]:
        if a not in nodes or b not in nodes:
            bad.append(f"link {lid}: node {a if a not in nodes else b} does not exist")
            continue
        out, inp = nodes[a]["outputs"][sa], nodes[b]["inputs"][sb]
        if lid not in (out.get("links") or []) or inp.get("link") != lid:
            bad.append(f"link {lid}: {a}:{sa} -> {b}:{sb} not recorded on both ends")
        if not out["type"] == inp["type"] == t:
            bad.append(f"link {lid}: types {out['type']} -> {inp['type']} (link says {t})")
        if nodes[a]["type"] not in skip and info[nodes[a]["type"]]["output"][sa] != t:
            bad.append(f"link {lid}: {nodes[a]['type']} output {sa} is {info[nodes[a]['type']]['output'][sa]}, not {t}")
        if nodes[b]["type"] not in skip:
            spec = info[nodes[b]["type"]]["input"]
            s = {**spec.get("required", {}), **spec.get("optional", {})}.get(inp["name"])
            if s is None or (s[0] != t and not (_options(s) is not None and t == "COMBO") and s[0] != "*"):
                bad.append(f"link {lid}: {nodes[b]['type']} has no {t} input {inp['name']!r}")
    for n in ui["nodes"]:
        bad += [f"node {n['id']} input {i['name']}: link {i['link']} missing" for i in n.get("inputs", [])
                if i.get("link") is not None and i["link"] not in links]
        bad += [f"node {n['id']} output {o['name']}: link {x} missing" for o in n.get("outputs", [])
                for x in o.get("links") or [] if x not in links]
    return bad


def test_example_workflows_validate_on_current_comfyui(comfy_server_current):
    W = _workflow_module()
    srv = comfy_server_current
    info = srv.object_info()
    listed = srv.get_json("/workflow_templates").get(PACK, [])
    files = sorted(p.stem for p in (H.ROOT / "example_workflows").glob("*.json"))
    assert sorted(listed) == files and set(MODEL_WORKFLOWS) <= set(files), (listed, files)
    problems = {}
    for name in files:
        r = requests.get(f"{srv.url}/api/workflow_templates/{PACK}/{name}.json", timeout=60)
        r.raise_for_status()
        ui = r.json()
        assert ui == json.loads((H.ROOT / "example_workflows" / f"{name}.json").read_text())
        assert "nodes" in ui and "links" in ui, f"{name} is not in UI (litegraph) format"
        missing = {n["type"] for n in ui["nodes"]} - set(info) - W.SKIP_TYPES
        assert not missing, f"{name}: node types not in ComfyUI 0.33.0 + the pack: {missing}"
        api = W.ui_to_api(ui, info)
        problems[name] = link_problems(ui, info, W.SKIP_TYPES) + widget_problems(api, info)
    assert problems == {n: [] for n in files}, json.dumps(problems, indent=1)


def test_model_workflows_apply_int8_between_core_loader_and_sampler(comfy_server_current):
    """Flux.1, Flux.2, Z-Image, Qwen-Image, Chroma, Wan 2.1 / 2.2: core loader (a model file of ComfyUI's examples)
    -> Apply Fused INT8 GEMM (fused_triton) -> (model sampling) -> sampler (Flux.2: the guider); the Apply node's
    MODEL reaches the sampler and no other MODEL does."""
    W = _workflow_module()
    info = comfy_server_current.object_info()
    for name, (loader_type, file, sampler_type) in MODEL_WORKFLOWS.items():
        api = W.ui_to_api(json.loads((H.ROOT / "example_workflows" / f"{name}.json").read_text()), info)
        (apply,) = W.find_nodes(api, "ApplyFusedInt8GEMM")
        (loader,) = W.find_nodes(api, loader_type)
        (sampler,) = W.find_nodes(api, sampler_type)
        assert api[apply]["inputs"]["model"] == [loader, 0] and api[loader]["inputs"]["unet_name"] == file, name
        assert api[apply]["inputs"]["backend"] == "fused_triton", name
        chain, cur = [], api[sampler]["inputs"]["model"][0]
        while cur != loader:
            chain.append(api[cur]["class_type"])
            cur = api[cur]["inputs"]["model"][0]
        assert chain[-1] == "ApplyFusedInt8GEMM" and all(c.startswith("ModelSampling") for c in chain[:-1]), (name,
                                                                                                            chain)
        readers = [k for k, v in api.items() for x in v["inputs"].values() if x == [loader, 0]]
        assert readers == [apply], (name, readers)  # the float model reaches nothing but the Apply node


def test_model_workflows_pass_the_servers_own_prompt_validation(comfy_server_current):
    """POST /prompt runs ComfyUI's own validation (types, links, combos, ranges) on each model workflow: the only
    errors are the model files the test server does not hold, so the prompt is rejected before anything runs."""
    W = _workflow_module()
    srv = comfy_server_current
    info = srv.object_info()
    for name in MODEL_WORKFLOWS:
        api = W.ui_to_api(json.loads((H.ROOT / "example_workflows" / f"{name}.json").read_text()), info)
        r = requests.post(f"{srv.url}/prompt", json={"prompt": api}, timeout=60)
        body = r.json()
        errors = [(nid, e["type"], e.get("extra_info", {}).get("input_name"))
                  for nid, ne in body.get("node_errors", {}).items() for e in ne["errors"]]
        assert r.status_code == 400 and errors, (name, body)
        assert all(t == "value_not_in_list" and i in FILE_INPUTS for _, t, i in errors), (name, errors)
