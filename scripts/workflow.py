"""UI-format (litegraph, what ComfyUI's "Save" writes and its template browser reads) workflows to
API format (what POST /prompt takes), using a server's /object_info to map widget values to inputs.

    python scripts/workflow.py example_workflows/x.json --server http://127.0.0.1:8188 > x_api.json

Rules (ComfyUI's frontend does the same when it queues a graph):
* widget values are taken in the order of the node's inputs in /object_info (required, then
  optional), skipping inputs that are not widgets (MODEL, LATENT, ...); an INT widget named seed /
  noise_seed or marked ``control_after_generate`` is followed by its control value ("fixed", ...),
  which is dropped;
* a widget input that is connected by a link takes the link;
* muted nodes (mode 2) and notes are left out; bypassed nodes (mode 4) are not supported (an error
  names them).
"""
from __future__ import annotations

import argparse
import json
import sys

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
SKIP_TYPES = {"Note", "MarkdownNote", "Reroute"}


class WorkflowError(ValueError):
    pass


def _is_widget(spec) -> bool:
    t = spec[0]
    return isinstance(t, list) or t in WIDGET_TYPES


def _has_control(name: str, spec) -> bool:
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    return spec[0] == "INT" and (opts.get("control_after_generate") or name in ("seed", "noise_seed"))


def ui_to_api(ui: dict, object_info: dict) -> dict:
    """API-format dict {node id: {"class_type", "inputs", "_meta"}} of a UI-format workflow."""
    links = {l[0]: l for l in ui.get("links", [])}  # id -> [id, from_node, from_slot, to_node, to_slot, type]
    nodes = {n["id"]: n for n in ui.get("nodes", [])}
    api = {}
    for nid, n in nodes.items():
        ctype = n["type"]
        if ctype in SKIP_TYPES or n.get("mode", 0) == 2:
            continue
        if n.get("mode", 0) == 4:
            raise WorkflowError(f"node {nid} ({ctype}) is bypassed; bypassed nodes are not supported here")
        if ctype not in object_info:
            raise WorkflowError(f"node {nid}: type {ctype!r} is not installed on this server "
                                "(missing custom node pack?)")
        spec = object_info[ctype]["input"]
        ordered = list(spec.get("required", {}).items()) + list(spec.get("optional", {}).items())
        linked = {}
        for inp in n.get("inputs", []):
            if inp.get("link") is not None:
                l = links.get(inp["link"])
                if l is None:
                    raise WorkflowError(f"node {nid} ({ctype}) input {inp['name']!r}: dangling link {inp['link']}")
                if l[1] in nodes and nodes[l[1]].get("mode", 0) == 2:
                    continue
                linked[inp["name"]] = [str(l[1]), l[2]]
        values = list(n.get("widgets_values", []) or [])
        if isinstance(n.get("widgets_values"), dict):  # some nodes save {name: value}
            wv = n["widgets_values"]
            values = None
        inputs = {}
        i = 0
        for name, s in ordered:
            if not _is_widget(s):
                continue
            if values is None:
                if name in wv:
                    inputs[name] = wv[name]
                continue
            if i >= len(values):
                break
            inputs[name] = values[i]
            i += 1
            if _has_control(name, s) and i < len(values) and values[i] in CONTROL_VALUES:
                i += 1
        if values is not None and i != len(values):
            raise WorkflowError(f"node {nid} ({ctype}): {len(values)} widget values but the installed node "
                                f"takes {i}; the workflow was saved for a different version of the node")
        inputs.update(linked)
        missing = [k for k, s in spec.get("required", {}).items() if k not in inputs]
        if missing:
            raise WorkflowError(f"node {nid} ({ctype}): required inputs not set: {', '.join(missing)}")
        api[str(nid)] = {"class_type": ctype, "inputs": inputs, "_meta": {"title": n.get("title") or ctype}}
    return api


def find_nodes(api: dict, class_type: str) -> list[str]:
    return [k for k, v in api.items() if v["class_type"] == class_type]


def main() -> None:
    import requests
    ap = argparse.ArgumentParser(description="UI-format workflow -> API format")
    ap.add_argument("workflow")
    ap.add_argument("--server", default="http://127.0.0.1:8188")
    a = ap.parse_args()
    info = requests.get(a.server + "/object_info", timeout=60).json()
    with open(a.workflow) as f:
        json.dump(ui_to_api(json.load(f), info), sys.stdout, indent=1)


if __name__ == "__main__":
    main()
