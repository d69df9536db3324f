"""Shared fixtures: the pack inside a real ComfyUI.

Fixtures
--------
comfy_inprocess (session)  The pinned ComfyUI 0.3.75 (.runtime/ComfyUI, built by
                           scripts/setup_runtime.sh) first on sys.path, ``comfy.cli_args.args.cpu = True``,
                           ``comfy.sd``, ``comfy.model_management`` and ComfyUI's ``nodes`` imported.
                           Returns the ComfyUI root Path.
pack (session)             The repository imported as ComfyUI imports a custom node pack (module name
                           "comfyui_int8_fused"): ``pack.nodes.apply``, ``pack.quant.backends``, ...
                           Never import our ``nodes`` package as a top-level name: ComfyUI's nodes.py
                           owns that name.
tiny_model (function)      ``tiny_model(arch, seed=0, dtype=torch.float32)`` -> ModelPatcher of the
                           width-128 miniature (scripts/miniature.py, real key layout, built with
                           ComfyUI's classes from an explicit config; in-process, fast).
miniature_models (session) Writes the detectable miniatures (scripts/miniature.py) into the runtime's
                           models/diffusion_models and returns {arch: filename} ("lumina2", "flux").
                           They load with the core UNETLoader and are ~0.4-0.5 B parameters (the
                           pinned ComfyUI fixes their widths), so prefer ``tiny_model`` in-process.
comfy_server (session)     A real ``main.py --cpu`` on 127.0.0.1:<free port> with the pack in
                           custom_nodes; a client (tests/comfy_harness.ComfyServer):
                           ``.object_info(cls=None)``, ``.queue(api) -> prompt_id``,
                           ``.wait(prompt_id, timeout) -> history entry`` (raises ComfyError with the
                           server log tail on error/timeout), ``.run(api)``, ``.events`` (WebSocket
                           messages), ``.prompt_events(pid)``, ``.log_tail()``, ``.url``,
                           ``.output_dir``, ``.output_files(entry)``, ``.get_json(path)``.
                           Stopped at session end, also when tests fail.
comfy_current (session)    Path of the ComfyUI checkout named by COMFYUI_CURRENT (must contain
                           comfy/ldm/ideogram4); skips with a reason naming the variable otherwise.

Two ComfyUIs cannot live in one process (both own the top-level names ``comfy``, ``nodes``,
``folder_paths``, ...). The session may already hold the pinned one (comfy_inprocess), so tests on a
current ComfyUI run their work in a subprocess: ``run_in_current_comfy(script_text)`` (re-exported
here from tests/comfy_harness.py) runs Python (COMFYUI_CURRENT_PYTHON, else this interpreter) with the
checkout first on sys.path, the CPU selected, the repo root importable and ``import_pack()`` defined,
and returns the CompletedProcess; print results (e.g. JSON) and assert on them in the test.

TRITON_INTERPRET=1 is set here at import time (before anything imports Triton), so the Triton
kernels run in the interpreter on this CPU-only machine.

The pack is imported one way (tests/pack_import.py, installed here before any test module is imported): as the
package "comfyui_int8_fused", with ``kernel``, ``quant`` and ``adapters`` as other names of its subpackages, so
``from quant.linear import Int8Linear`` in a test is ``pack.quant.linear.Int8Linear``. A subprocess that imports
them calls ``pack_import.install()`` first (tests/ on its sys.path).
"""
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import pack_import  # noqa: E402

pack_import.install()

import pytest  # noqa: E402

import comfy_harness as H  # noqa: E402
from comfy_harness import run_in_current_comfy  # noqa: E402,F401  (re-exported for tests)

# ----------------------------------------------------------------------------------- markers
# Registered here (pytest --strict-markers knows them; `pytest --markers` lists them). A test file marks its tests
# with these instead of defining its own skip marks.
MARKERS = {
    "interpreter": "runs the pack's Triton kernels: on a machine without a GPU only under TRITON_INTERPRET=1 "
                   "(scripts/test.sh sets it); skipped there otherwise",
    "current_comfy": "needs ComfyUI 0.33.0 (COMFYUI_CURRENT, set up by scripts/setup_runtime.sh from "
                     "../shared/comfyui); skipped, naming the variable, without it. Set on every test that uses a "
                     "current-ComfyUI fixture or helper",
    "browser": "drives the frontend in a real browser (Debian's chromium through playwright)",
    "slow": "takes more than ~20 s on the 2-core CI machine (docs/DEVELOPING.md lists the slowest); "
            "`-m quick` leaves these, current_comfy and browser tests out",
    "quick": "set on every test that is none of slow, current_comfy, browser: `bash scripts/test.sh -m quick`",
    "serial": "shares state that parallel workers would race on: no two serial tests run at once (a file lock "
              "across the pytest-xdist workers, tests/conftest.py _one_at_a_time)",
}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _kernels_run() -> bool:
    """The pack's Triton kernels can run here: in the interpreter, or compiled on a CUDA GPU."""
    if INTERPRET:
        return True
    import torch
    return torch.cuda.is_available()


def pytest_configure(config):
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


# Fixtures and helpers that need ComfyUI 0.33.0: a test using one is a current_comfy test. A test using the pinned
# server or the detectable miniatures (0.4-0.5 B parameters, ~2 GB written once) is a slow one.
_CURRENT_FIXTURES = {"comfy_current", "comfy_server_current"}
_SLOW_FIXTURES = {"comfy_server", "miniature_models"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    kernels = None
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if _CURRENT_FIXTURES & fixtures:
            item.add_marker(pytest.mark.current_comfy)
        if _SLOW_FIXTURES & fixtures:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("interpreter"):
            kernels = _kernels_run() if kernels is None else kernels
            if not kernels:
                item.add_marker(pytest.mark.skip(reason="runs the Triton kernels: needs TRITON_INTERPRET=1 on a "
                                                        "machine without a GPU (scripts/test.sh sets it)"))
        if not any(item.get_closest_marker(m) for m in ("slow", "current_comfy", "browser")):
            item.add_marker(pytest.mark.quick)
    # the long tests first (a stable sort: the same order in every xdist worker), so that the workers' queues end
    # on short ones instead of one worker finishing a long test while the other idles
    items.sort(key=lambda it: 0 if it.get_closest_marker("slow") else 1 if it.get_closest_marker("current_comfy")
               else 2)


_TIMELINE = os.environ.get("INT8_TEST_TIMELINE")  # scripts/test.sh: which tests ran when (the disk peak's)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With INT8_TEST_TIMELINE set: a line per test start and end (epoch seconds) appended to that file, written
    where the test runs (each xdist worker), so that scripts/test.sh can name the tests running at its disk peak."""
    if _TIMELINE:
        with open(_TIMELINE, "a") as f:
            f.write(f"{time.time():.1f} start {item.nodeid}\n")
    yield
    if _TIMELINE:
        with open(_TIMELINE, "a") as f:
            f.write(f"{time.time():.1f} end {item.nodeid}\n")


@pytest.fixture(autouse=True)
def _one_at_a_time(request):
    """``serial`` tests hold an exclusive file lock (in the temporary folder every worker shares) while they run:
    pytest-xdist's own groups (``--dist loadgroup``) do not work with this pytest (xdist 3.8 tags a grouped test by
    setting ``item._nodeid``, which pytest 9.2's ``nodeid`` no longer reads)."""
    import fcntl
    import tempfile
    names = [m for m in ("serial",) if request.node.get_closest_marker(m)]
    locks = []
    try:
        for name in names:
            f = open(os.path.join(tempfile.gettempdir(), f"int8_fused_tests_{name}.lock"), "w")
            fcntl.flock(f, fcntl.LOCK_EX)
            locks.append(f)
        yield
    finally:
        for f in reversed(locks):
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()


@pytest.fixture(autouse=True)
def _no_shipped_tuned_tables(monkeypatch):
    """Tests tune and cache as on a GPU without a shipped tuned table (kernel/tuned); tests/test_tuned_tables.py
    turns the tables on with a folder of its own."""
    import kernel.tuned
    monkeypatch.setattr(kernel.tuned, "ENABLED", False)


@pytest.fixture
def first_call_tuning():
    """INT8_FUSED_TUNE=first_call inside the test: what it checks is the first-call timing (the candidates timed on
    the shape's first call), not the default's predicted config and background job (tests/test_background_tuning.py)."""
    from kernel import config
    with config.override(INT8_FUSED_TUNE="first_call"):
        yield


@pytest.fixture(scope="session")
def comfy_inprocess():
    try:
        H.check_runtime()
    except RuntimeError as e:
        pytest.fail(str(e))
    H.import_comfy(H.COMFY_DIR)
    return H.COMFY_DIR


@pytest.fixture(scope="session")
def pack(comfy_inprocess):
    return H.import_pack()


@pytest.fixture
def tiny_model(comfy_inprocess):
    return H.load_tiny


@pytest.fixture(scope="session")
def miniature_models():
    try:
        H.check_runtime()
    except RuntimeError as e:
        pytest.fail(str(e))
    return H.write_miniature_models(H.COMFY_DIR)


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory):
    out = tmp_path_factory.mktemp("comfy_server") / "output"
    try:
        H.check_runtime()
    except RuntimeError as e:
        pytest.fail(str(e))
    server = H.ComfyServer(H.COMFY_DIR, output_dir=out)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def comfy_server_current(tmp_path_factory):
    """A real ``main.py --cpu`` of the current ComfyUI (COMFYUI_CURRENT, its Python COMFYUI_CURRENT_PYTHON)
    with the pack in its custom_nodes (scripts/setup_runtime.sh links it into .runtime/ComfyUI-current);
    skipped, with the reason, without one."""
    path, reason = H.current_comfy_dir()
    if path is None:
        pytest.skip(reason)
    if not (path / "custom_nodes" / "comfyui-int8-fused").exists():
        pytest.skip(f"{path}/custom_nodes has no comfyui-int8-fused (scripts/setup_runtime.sh links it there)")
    server = H.ComfyServer(path, output_dir=tmp_path_factory.mktemp("comfy_current") / "output",
                           python=os.environ.get("COMFYUI_CURRENT_PYTHON") or None)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def comfy_current():
    path, reason = H.current_comfy_dir()
    if path is None:
        pytest.skip(reason)
    return path
