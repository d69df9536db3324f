"""Helpers that run the pack inside a real ComfyUI: the pinned runtime in-process, a real server, and a
current ComfyUI checkout (``COMFYUI_CURRENT``) in a subprocess. The fixtures in conftest.py wrap these;
scripts/demo.py uses the same server client.

Nothing here imports ComfyUI at module import time.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import comfy_fork
from pack_import import PACK_MODULE, ROOT, import_pack  # noqa: F401  (re-exported: the one way to import the pack)

RUNTIME = Path(os.environ.get("INT8_RUNTIME_DIR") or ROOT / ".runtime")
COMFY_DIR = RUNTIME / "ComfyUI"
SETUP_HINT = "run `bash scripts/setup_runtime.sh` (or `bash scripts/test.sh`, which does it first)"


# --------------------------------------------------------------------------- in-process ComfyUI
def check_runtime() -> None:
    if not (COMFY_DIR / "main.py").is_file():
        raise RuntimeError(f"the pinned ComfyUI is missing at {COMFY_DIR}: {SETUP_HINT}")


def import_comfy(comfy_dir: Path = COMFY_DIR):
    """Put ``comfy_dir`` first on sys.path, select the CPU, import comfy.sd / model_management and
    ComfyUI's top-level ``nodes`` module. Returns the ``comfy`` package."""
    comfy_dir = str(comfy_dir)
    loaded = sys.modules.get("comfy")
    if loaded is not None and not str(Path(loaded.__file__).resolve()).startswith(str(Path(comfy_dir).resolve())):
        raise RuntimeError(f"a different ComfyUI is already imported in this process ({loaded.__file__}); "
                           "run work on another ComfyUI in a subprocess (see run_in_current_comfy)")
    nodes_mod = sys.modules.get("nodes")
    if nodes_mod is not None and not hasattr(nodes_mod, "NODE_CLASS_MAPPINGS"):
        raise RuntimeError("a module named `nodes` that is not ComfyUI's nodes.py is imported: tests must "
                           "never import the pack's nodes package as a top-level name (use the `pack` fixture)")
    if comfy_dir in sys.path:
        sys.path.remove(comfy_dir)
    sys.path.insert(0, comfy_dir)  # before the repo root: ComfyUI's nodes.py must win over our nodes/
    import comfy.cli_args
    comfy.cli_args.args.cpu = True
    import comfy.model_management  # noqa: F401
    import comfy.sd  # noqa: F401
    # main.py imports ComfyUI's `utils` package before nodes.py puts comfy/ first on sys.path (after
    # that, `utils` would resolve to comfy/utils.py and `import server` would fail).
    import utils.extra_config  # noqa: F401
    import nodes  # noqa: F401  ComfyUI's own nodes.py, which node code may import
    return comfy


def load_tiny(arch: str, seed: int = 0, dtype=None):
    """ModelPatcher of the width-128 miniature ``arch`` (scripts/miniature.py), built in-process with
    ComfyUI's own model classes from the explicit config (detection cannot size tiny models). CPU."""
    import torch
    import comfy.model_detection
    import comfy.model_patcher
    mini = miniature()
    dtype = dtype or torch.float32
    sd = mini.tiny_state_dict(arch, seed, dtype)
    mc = comfy.model_detection.model_config_from_unet_config(dict(mini.TINY_UNET_CONFIG[arch]), sd)
    mc.set_inference_dtype(dtype, None)
    cpu = torch.device("cpu")
    model = mc.get_model(sd, "", device=cpu)
    model.diffusion_model.load_state_dict(sd, strict=True)
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def miniature():
    """scripts/miniature.py as a module."""
    if "int8fused_miniature" in sys.modules:
        return sys.modules["int8fused_miniature"]
    spec = importlib.util.spec_from_file_location("int8fused_miniature", ROOT / "scripts" / "miniature.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["int8fused_miniature"] = mod
    spec.loader.exec_module(mod)
    return mod


def write_miniature_models(comfy_dir: Path = COMFY_DIR, archs=None, seed: int = 0) -> dict[str, str]:
    """Write the detectable miniatures into ``<comfy>/models/diffusion_models`` (kept when already
    there) and return {arch: file name as UNETLoader lists it}."""
    mini = miniature()
    out = {}
    for arch in archs or mini.ARCHS:
        name = mini.default_filename(arch, seed)
        mini.write_miniature(arch, Path(comfy_dir) / "models" / "diffusion_models" / name, seed=seed)
        out[arch] = name
    return out


# --------------------------------------------------------------------------- widths ComfyUI fixes, narrowed
# ComfyUI builds Ideogram 4 at the widths of its model config (18 heads of 256, FFN 12288, adaLN 512, text 53248);
# tests on the current ComfyUI narrow that config first (``narrow_ideogram4``: bench/lib/e2e.py's ``narrow``, 2 heads of
# the real 256). The pack's loader checks a file against the config in use (``nodes.loader.comfy_widths``).
def _e2e():
    """bench/lib/e2e.py as a module (the one already imported, else loaded from its file)."""
    mod = sys.modules.get("bench.lib.e2e") or sys.modules.get("int8fused_bench_e2e")
    if mod is None:
        spec = importlib.util.spec_from_file_location("int8fused_bench_e2e", ROOT / "bench" / "lib" / "e2e.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["int8fused_bench_e2e"] = mod
        spec.loader.exec_module(mod)
    return mod


NARROW_IDEOGRAM4, NARROW_QWEN = _e2e().NARROW, _e2e().QWEN_NARROW


def narrow_ideogram4() -> dict:
    """Inside a process with a current ComfyUI imported: ComfyUI's Ideogram 4 config at ``NARROW_IDEOGRAM4``; the
    widths as ``adapters.ideogram4.layout.widths`` names them (no pack import: the plain processes use it too)."""
    return _e2e().narrow()


def narrow_qwen_image() -> dict:
    """As :func:`narrow_ideogram4`, for Qwen-Image (``NARROW_QWEN``: 1 head of the real 128, text 64)."""
    return _e2e().narrow_qwen()


# --------------------------------------------------------------------------- a real server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyError(RuntimeError):
    """A prompt failed, was rejected or timed out; the message carries the server log tail."""


class ComfyServer:
    """``python main.py --cpu`` (``cpu=False``: on the GPU) of a ComfyUI tree on 127.0.0.1, a WebSocket listener thread, and an
    HTTP client. Use as a context manager or call start()/stop()."""

    def __init__(self, comfy_dir: Path = COMFY_DIR, output_dir: Path | None = None, python: str | None = None,
                 extra_args=(), env: dict | None = None, startup_timeout: float = 300.0, cpu: bool = True):
        self.comfy_dir = Path(comfy_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.output_dir = Path(output_dir or tempfile.mkdtemp(prefix="comfy-out-"))
        self.python = python or sys.executable
        self.extra_args = list(extra_args)
        self.env = env
        self.startup_timeout = startup_timeout
        self.cpu = cpu
        self.client_id = uuid.uuid4().hex
        self.events: list[dict] = []
        self.log_path = self.output_dir.parent / f"comfy-server-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self._ws = None
        self._ws_thread: threading.Thread | None = None

    # -- lifecycle
    def start(self) -> "ComfyServer":
        check_runtime()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env)  # tests: TRITON_INTERPRET=1 from conftest
        env["PYTHONUNBUFFERED"] = "1"
        # a temp folder of its own: main.py empties its temp folder at start, and test workers run servers of one tree
        # side by side
        cmd = [self.python, "main.py", *(["--cpu"] if self.cpu else []), "--listen", "127.0.0.1", "--port", str(self.port),
               "--output-directory", str(self.output_dir), "--temp-directory", str(self.output_dir.parent),
               *self.extra_args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=self.comfy_dir, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        try:
            self._wait_ready()
            self._start_ws()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        import requests
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ComfyError(f"ComfyUI exited with code {self.proc.returncode} while starting:\n"
                                 + self.log_tail())
            try:
                if requests.get(self.url + "/object_info", timeout=10).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise ComfyError(f"ComfyUI did not answer /object_info within {self.startup_timeout:.0f} s:\n"
                         + self.log_tail())

    def _start_ws(self) -> None:
        import websocket
        self._ws = websocket.create_connection(
            f"ws://127.0.0.1:{self.port}/ws?clientId={self.client_id}", timeout=30)
        self._ws.settimeout(None)

        def pump():
            while True:
                try:
                    msg = self._ws.recv()
                except Exception:
                    return
                if isinstance(msg, (bytes, bytearray)):
                    self.events.append({"type": "binary", "size": len(msg)})
                elif msg:
                    try:
                        self.events.append(json.loads(msg))
                    except ValueError:
                        self.events.append({"type": "text", "data": msg})

        self._ws_thread = threading.Thread(target=pump, name="comfy-ws", daemon=True)
        self._ws_thread.start()

    def stop(self) -> None:
        if self._ws is not None:
            try:
                self._ws.close()
            except Exception:
                pass
            self._ws = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- client
    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])

    def object_info(self, node_class: str | None = None) -> dict:
        import requests
        r = requests.get(self.url + "/object_info" + (f"/{node_class}" if node_class else ""), timeout=60)
        r.raise_for_status()
        return r.json()

    def get_json(self, path: str):
        import requests
        r = requests.get(self.url + path, timeout=60)
        r.raise_for_status()
        return r.json()

    def queue(self, api_workflow: dict) -> str:
        """POST an API-format workflow to /prompt; returns the prompt id. A rejected workflow raises
        with ComfyUI's node_errors."""
        import requests
        r = requests.post(self.url + "/prompt", json={"prompt": api_workflow, "client_id": self.client_id},
                          timeout=60)
        if r.status_code != 200:
            raise ComfyError(f"/prompt rejected the workflow (HTTP {r.status_code}): {r.text[:3000]}\n"
                             + self.log_tail(30))
        return r.json()["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 600.0) -> dict:
        """Wait until ``prompt_id`` has finished; returns its /history entry. Raises ComfyError with
        the execution error and the log tail when it failed, or when ``timeout`` passes."""
        import requests
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ComfyError(f"ComfyUI exited (code {self.proc.returncode}) while running {prompt_id}:\n"
                                 + self.log_tail())
            h = requests.get(f"{self.url}/history/{prompt_id}", timeout=60).json()
            entry = h.get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                st = entry["status"]
                if st.get("status_str") == "error" or not st.get("completed"):
                    errs = [m for m in st.get("messages", []) if m[0] == "execution_error"]
                    detail = json.dumps(errs[0][1], indent=1)[:4000] if errs else json.dumps(st)[:2000]
                    raise ComfyError(f"prompt {prompt_id} failed: {detail}\n--- server log tail ---\n"
                                     + self.log_tail())
                return entry
            time.sleep(0.25)
        try:
            requests.post(self.url + "/interrupt", timeout=10)
        except Exception:
            pass
        raise ComfyError(f"prompt {prompt_id} did not finish within {timeout:.0f} s\n--- server log tail ---\n"
                         + self.log_tail())

    def run(self, api_workflow: dict, timeout: float = 600.0) -> dict:
        return self.wait(self.queue(api_workflow), timeout)

    def output_files(self, entry: dict) -> list[Path]:
        """Files a finished prompt saved (images and latents listed by its output nodes)."""
        out = []
        for node_out in entry.get("outputs", {}).values():
            for items in node_out.values():
                if not isinstance(items, list):
                    continue
                for it in items:
                    if isinstance(it, dict) and "filename" in it and it.get("type", "output") == "output":
                        out.append(self.output_dir / it.get("subfolder", "") / it["filename"])
        return out

    def prompt_events(self, prompt_id: str) -> list[dict]:
        return [e for e in list(self.events)
                if isinstance(e.get("data"), dict) and e["data"].get("prompt_id") == prompt_id]


# --------------------------------------------------------------------------- a current ComfyUI
def current_comfy_dir() -> tuple[Path | None, str]:
    """(checkout, "") when COMFYUI_CURRENT names a ComfyUI with comfy/ldm/ideogram4, else (None, reason)."""
    cur = os.environ.get("COMFYUI_CURRENT")
    if not cur:
        return None, ("COMFYUI_CURRENT is not set (point it at a current ComfyUI checkout with "
                      "comfy/ldm/ideogram4 to run this test)")
    p = Path(cur).expanduser().resolve()
    if not (p / "comfy" / "ldm" / "ideogram4").is_dir():
        return None, f"COMFYUI_CURRENT={cur} has no comfy/ldm/ideogram4 (needs a ComfyUI with Ideogram 4)"
    return p, ""


_CURRENT_PRELUDE = """\
import importlib.util, os, sys
sys.path.insert(0, {cur!r})
import comfy.cli_args
comfy.cli_args.args.cpu = True
for _name, _value in {cli!r}.items():  # flags as `main.py --<name>` would set them (run_in_current_comfy's cli)
    setattr(comfy.cli_args.args, _name, _value)
import comfy.model_management, comfy.sd
import utils.extra_config  # before nodes.py puts comfy/ first on sys.path, as main.py does
import nodes as _comfy_nodes
sys.path.insert(1, {root!r})
sys.path.insert(2, {tests!r})
import pack_import
pack_import.install()  # kernel, quant, adapters: the pack's subpackages (tests/pack_import.py)
from pack_import import import_pack

def sample_image_only_cfg(model, positive, latent, steps=2, model_negative=None, cfg=4.0, seed=0):
    # ComfyUI's own sampling (euler, simple schedule) with an image-only negative (Ideogram 4's reference
    # CFG): DualModelGuider's Guider_DualModel when model_negative is given, else a CFGGuider.
    import comfy.samplers
    import comfy_extras.nodes_custom_sampler as ncs
    import torch
    guider = (ncs.Guider_DualModel(model, model_negative) if model_negative is not None
              else comfy.samplers.CFGGuider(model))
    guider.set_conds(positive, [[None, {{}}]])
    guider.set_cfg(cfg)
    sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "simple", steps)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    return guider.sample(noise, latent, comfy.samplers.sampler_object("euler"), sigmas, disable_pbar=True,
                         seed=seed).float()

"""


def run_in_current_comfy(script_text: str, timeout: float = 900.0, check: bool = False,
                         env: dict | None = None, cli: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``script_text`` in a fresh Python with the COMFYUI_CURRENT checkout first on sys.path, the
    CPU selected, comfy.sd and ComfyUI's nodes imported, the repo root on sys.path, ``kernel``, ``quant`` and
    ``adapters`` the pack's subpackages (``pack_import.install()``) and ``import_pack()`` defined (the pack as
    module "comfyui_int8_fused").
    ``cli``: ComfyUI's command-line arguments to set before comfy is imported ({"use_sage_attention": True} is
    ``main.py --use-sage-attention``).
    Python: COMFYUI_CURRENT_PYTHON, else this interpreter. cwd is the checkout. With the default flags and
    environment the script runs in a child forked from a server that has done the imports once (tests/comfy_fork.py:
    the same behaviour, without the 6-10 s start); ``cli`` or ``env`` (or ``INT8_TEST_FORK=0``) start a fresh one.
    Returns the CompletedProcess (text stdout/stderr); ``check=True`` raises with both on failure."""
    cur, reason = current_comfy_dir()
    if cur is None:
        raise RuntimeError(reason)
    code = (_CURRENT_PRELUDE.format(cur=str(cur), root=str(ROOT), tests=str(ROOT / "tests"), cli=dict(cli or {}))
            + textwrap.dedent(script_text))
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("TRITON_INTERPRET", "1")
    python = os.environ.get("COMFYUI_CURRENT_PYTHON") or sys.executable
    cp = None
    if not cli and env is None:  # the default flags and environment: the fork server's child (tests/comfy_fork.py)
        prelude = _CURRENT_PRELUDE.format(cur=str(cur), root=str(ROOT), tests=str(ROOT / "tests"), cli={})
        cp = comfy_fork.run(python, prelude, cur, full_env, textwrap.dedent(script_text), timeout)
    if cp is None:
        cp = subprocess.run([python, "-c", code], cwd=cur, env=full_env, capture_output=True, text=True,
                            timeout=timeout)
    if check and cp.returncode != 0:
        raise RuntimeError(f"script under COMFYUI_CURRENT failed (exit {cp.returncode}):\n"
                           f"--- stdout ---\n{cp.stdout[-4000:]}\n--- stderr ---\n{cp.stderr[-6000:]}")
    return cp


_BODY = """\
import json, runpy, shutil, tempfile
import folder_paths
ns = runpy.run_path({file!r}, init_globals={{"import_pack": import_pack, "sample_image_only_cfg": sample_image_only_cfg}})
models = tempfile.mkdtemp(prefix="int8_current_")
folder_paths.add_model_folder_path("diffusion_models", models, is_default=True)
try:
    res = ns["body"](import_pack(), __import__("pathlib").Path(models))
finally:
    shutil.rmtree(models, ignore_errors=True)
print("RESULT " + json.dumps(res))
"""


def run_body_in_current_comfy(test_file: str, timeout: float = 3000.0) -> dict:
    """Run ``body(pack, models)`` of ``test_file`` inside the current ComfyUI (a subprocess, see
    ``run_in_current_comfy``) with a fresh temporary folder registered as the default ``diffusion_models``
    path (removed afterwards); returns the JSON-able dict it returned. Raises with both outputs on failure."""
    cp = run_in_current_comfy(_BODY.format(file=str(test_file)), timeout=timeout)
    print(cp.stdout[-3000:])
    if cp.returncode != 0:
        raise AssertionError(f"exit {cp.returncode}\n{cp.stdout[-3000:]}\n{cp.stderr[-6000:]}")
    return json.loads(next(ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT "))[7:])
