"""tests/comfy_fork.py: a script run by the fork server's child behaves as the fresh ``python -c`` process it
replaces (what run_in_current_comfy returned before): the same stdout, stderr and exit status for output, an
uncaught exception, ``sys.exit`` with a code or a message, atexit handlers, the module ``__main__``, the prelude's
names; each script in a process of its own (another pid, nothing left by the one before); a timeout raises
``subprocess.TimeoutExpired`` and the next script still runs; other flags (``cli``) or another environment run in a
fresh process. tests/test_patcher_teardown.py checks the shutdown (``__del__`` at exit) through it."""
import os
import subprocess

import pytest

SCRIPTS = {
    "output": "import sys\nprint('out', 1)\nprint('err', 2, file=sys.stderr)",
    "exception": "raise ValueError('boom')",
    "exit code": "import sys\nprint('before')\nsys.exit(3)",
    "exit message": "import sys\nsys.exit('a message')",
    "atexit": "import atexit\natexit.register(lambda: print('atexit ran', flush=True))\nprint('main')",
    "main and prelude": "import comfy.model_management as mm\nprint(__name__, mm.get_torch_device(), "
                        "callable(import_pack), callable(sample_image_only_cfg))",
}


def _both(script: str):
    """(fork server's CompletedProcess, a fresh process's)."""
    from comfy_harness import run_in_current_comfy
    forked = run_in_current_comfy(script, timeout=300)
    old = os.environ.get("INT8_TEST_FORK")
    os.environ["INT8_TEST_FORK"] = "0"
    try:
        fresh = run_in_current_comfy(script, timeout=300)
    finally:
        if old is None:
            del os.environ["INT8_TEST_FORK"]
        else:
            os.environ["INT8_TEST_FORK"] = old
    return forked, fresh


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_child_behaves_as_a_fresh_process(comfy_current, name):
    import comfy_fork
    forked, fresh = _both(SCRIPTS[name])
    assert any(s.ok for s in comfy_fork._servers.values()), [s.why for s in comfy_fork._servers.values()]
    assert forked.returncode == fresh.returncode, (forked, fresh)
    assert forked.stdout == fresh.stdout, (forked.stdout, fresh.stdout)
    # stderr: the same last line (a traceback's frames name other lines of "<string>": the prelude is not in it)
    assert _last_line(forked.stderr) == _last_line(fresh.stderr), (forked.stderr, fresh.stderr)
    expected = {"output": (0, "out 1\n", "err 2"), "exception": (1, "", "ValueError: boom"),
                "exit code": (3, "before\n", ""), "exit message": (1, "", "a message"),
                "atexit": (0, "main\natexit ran\n", ""), "main and prelude": (0, "__main__ cpu True True\n", "")}
    rc, out, err = expected[name]
    assert (forked.returncode, forked.stdout, _last_line(forked.stderr)) == (rc, out, err)


def test_each_script_a_process_of_its_own_and_timeouts(comfy_current):
    from comfy_harness import run_in_current_comfy
    a = run_in_current_comfy("import os\nLEFT = 1\nprint(os.getpid(), os.getppid())", timeout=300)
    b = run_in_current_comfy("import os\nprint(os.getpid(), os.getppid(), 'LEFT' in globals())", timeout=300)
    (pa, ppa), (pb, ppb, left) = a.stdout.split(), b.stdout.split()
    assert pa != pb and ppa == ppb != str(os.getpid()) and left == "False"  # siblings of one server, clean
    with pytest.raises(subprocess.TimeoutExpired):
        run_in_current_comfy("import time\nprint('started', flush=True)\ntime.sleep(60)", timeout=3)
    c = run_in_current_comfy("import os\nprint(os.getppid())", timeout=300)
    assert c.returncode == 0 and c.stdout.strip() == ppa  # the same server serves the next script


def test_other_flags_or_environment_run_fresh(comfy_current):
    from comfy_harness import run_in_current_comfy
    script = "import os, comfy.cli_args\nprint(os.getppid(), comfy.cli_args.args.use_split_cross_attention, os.environ.get('INT8_X'))"
    server = run_in_current_comfy(script, timeout=300).stdout.split()[0]
    with_cli = run_in_current_comfy(script, timeout=300, cli={"use_split_cross_attention": True}).stdout.split()
    with_env = run_in_current_comfy(script, timeout=300, env=dict(os.environ, INT8_X="1")).stdout.split()
    assert with_cli[1:] == ["True", "None"] and with_cli[0] == str(os.getpid())  # this process's own child
    assert with_env[1:] == ["False", "1"] and with_env[0] == str(os.getpid())
    assert server != str(os.getpid())


def test_a_server_per_environment(comfy_current, monkeypatch):
    """A server started while a test had set its own environment does not take the scripts of another: each
    environment gets a server of its own (the process's default one too), the oldest closed past MAX_SERVERS."""
    import comfy_fork
    from comfy_harness import run_in_current_comfy
    script = "import os\nprint(os.getppid(), os.environ.get('INT8_X'))"
    monkeypatch.setenv("INT8_X", "own")
    own = run_in_current_comfy(script, timeout=300).stdout.split()
    monkeypatch.delenv("INT8_X")
    default = run_in_current_comfy(script, timeout=300).stdout.split()
    again = run_in_current_comfy(script, timeout=300).stdout.split()
    assert own[1] == "own" and default[1] == "None", (own, default)
    assert str(os.getpid()) not in (own[0], default[0])  # both forked from a server, not started by this process
    assert own[0] != default[0] and again == default  # two servers; the default one serves again
    assert len(comfy_fork._servers) <= comfy_fork.MAX_SERVERS
