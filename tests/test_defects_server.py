"""Issue 12, item 10 (and 12) through a real server: the pack's exceptions reach ComfyUI's error report as
``int8_fused.CheckpointError`` (not ``<pack folder>.quant.formats.CheckpointError``, a file path when the
pack's folder is named ``comfyui-int8-fused``), with a message naming the damaged file."""
import json
import uuid

import comfy_harness as H


def test_server_reports_the_pack_error_type_and_the_file(comfy_server):
    from safetensors.torch import save_file
    import torch
    folder = H.COMFY_DIR / "models" / "int8_calibration"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"damaged_{uuid.uuid4().hex[:8]}.safetensors"
    path = folder / name
    # a calibration file whose 'layers' header entry is not JSON (e.g. a hand-edited or cut header)
    save_file({"a.smooth": torch.ones(4)}, str(path), metadata={
        "format": "int8_fused_calibration", "version": "1", "meta": "{}", "layers": "{not json"})
    wf = {"load": {"class_type": "LoadInt8Calibration", "inputs": {"calibration_name": name}},
          "save": {"class_type": "SaveInt8Calibration", "inputs": {
              "calibration": ["load", 0], "filename": f"never_{uuid.uuid4().hex[:8]}", "overwrite": False}}}
    try:
        pid = comfy_server.queue(wf)
        try:
            comfy_server.wait(pid, timeout=300)
        except H.ComfyError:
            pass
        else:
            raise AssertionError("the damaged calibration file loaded")
        import requests
        st = requests.get(f"{comfy_server.url}/history/{pid}", timeout=60).json()[pid]["status"]
        err = next(m[1] for m in st["messages"] if m[0] == "execution_error")
        print(json.dumps(err, indent=1)[:2000])
        assert err["node_type"] == "LoadInt8Calibration"
        assert err["exception_type"] == "int8_fused.CheckpointError", err["exception_type"]
        assert name in err["exception_message"] and "'layers' is not valid JSON" in err["exception_message"]
    finally:
        path.unlink(missing_ok=True)
