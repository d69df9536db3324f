"""Atomic file writes: the one helper behind every file the pack writes (models, calibrations, autotune cache).

``atomic_write(path, write)`` has ``write(tmp)`` fill a temporary ``<dir>/.<name>.<pid>.tmp`` beside the target
(``.<hash of name><ext>.<pid>.tmp`` where that would pass the folder's name limit) and renames it over the target
with ``os.replace`` (atomic on one filesystem): a reader sees the old file or the new one, never half of one, and
a crash leaves the target untouched. A process killed while writing leaves
its temporary behind; every write removes the stale temporaries of this naming in its folder
(``clean_stale``).

``locked(path)`` holds an exclusive lock for ``path`` across processes (a read-modify-write of a shared file, e.g.
the JSON caches of ``kernel/jsoncache.py``): ``fcntl.flock`` on a sidecar ``.<name>.lock``, which its holder removes
again. Where ``fcntl`` is missing (Windows) or the lock file cannot be made (a read-only folder) it locks nothing.

It lives in ``kernel/`` (which imports nothing else of the pack) so that the autotune cache
(``kernel/autotune.py``) and the checkpoint writers (``quant/fmt_write.py``) share it; no torch here.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import threading
import time
from typing import Callable

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

# Temporaries of atomic_write (".<name>.<pid>.tmp" for the file types the pack writes) and of the calibration
# writer of earlier versions (tempfile ".tmp-XXXXXXXX.safetensors").
_TMP = re.compile(r"^\.(?:.+\.(?:safetensors|json)\.(\d+)\.tmp|tmp-[a-z0-9_]{8}\.safetensors)$")
STALE_AGE_S = 24 * 3600
_LOCKS: dict[str, threading.Lock] = {}  # per target: the temporary is named after the process, not the thread
_LOCKS_GUARD = threading.Lock()


def _pid_alive(pid: int) -> bool | None:
    """Whether process ``pid`` runs (POSIX); None when that cannot be told (Windows)."""
    if pid == os.getpid():
        return True
    if os.name != "posix":
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def clean_stale(folder: str) -> list[str]:
    """Remove leftover temporaries of this module's naming in ``folder`` (not recursive): those whose
    writer process is gone, and any older than ``STALE_AGE_S``. Returns the removed paths."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    now = time.time()
    for n in names:
        m = _TMP.match(n)
        if m is None:
            continue
        p = os.path.join(folder, n)
        try:
            old = now - os.path.getmtime(p) > STALE_AGE_S
            if old or (m.group(1) is not None and _pid_alive(int(m.group(1))) is False):
                os.remove(p)
                removed.append(p)
        except OSError:
            continue
    return removed


def name_max(folder: str) -> int:
    """The longest file name, in bytes, that ``folder`` (an existing folder) takes; 255 where it cannot be told."""
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (AttributeError, OSError, ValueError, TypeError):
        return 255


def _tmp_name(folder: str, base: str) -> str:
    """``.<base>.<pid>.tmp``, or a short ``.<hash><ext>.<pid>.tmp`` when that is longer than ``folder`` allows
    (a target name near the limit must still save); both match ``_TMP``."""
    tmp = f".{base}.{os.getpid()}.tmp"
    if len(os.fsencode(tmp)) <= name_max(folder):
        return tmp
    ext = os.path.splitext(base)[1]
    ext = ext if len(ext) <= 16 else ""
    return f".{hashlib.sha1(os.fsencode(base)).hexdigest()[:16]}{ext}.{os.getpid()}.tmp"


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], overwrite: bool = True) -> str:
    """Create ``path`` from ``write(tmp)``, which writes the whole content to the path ``tmp``; returns ``path``.

    Raises ValueError for a name holding NUL, FileExistsError when ``overwrite`` is off and ``path`` exists
    by the time the content is written, and whatever ``write`` raises; the target is untouched and the
    temporary removed in every such case. Threads of one process writing the same target take turns."""
    path = os.fspath(path)
    if "\x00" in path:
        raise ValueError(f"invalid file name {path!r}: it contains a NUL character")
    d, base = os.path.split(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    clean_stale(d)
    tmp = os.path.join(d, _tmp_name(d, base))
    with _LOCKS_GUARD:
        lock = _LOCKS.setdefault(tmp, threading.Lock())
    with lock:
        try:
            write(tmp)
            if not overwrite and os.path.exists(path):
                raise FileExistsError(errno.EEXIST, "appeared while writing; not overwritten", path)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return path


@contextlib.contextmanager
def locked(path: str | os.PathLike):
    """Hold an exclusive lock for ``path`` (module doc) for the ``with`` block; makes ``path``'s folder.

    The holder unlinks ``.<name>.lock`` before it unlocks, so no lock file stays behind; a waiter that then holds
    the lock of an unlinked (or since replaced) lock file opens the current one and waits again."""
    d, base = os.path.split(os.path.abspath(os.fspath(path)))
    lock, fd = os.path.join(d, f".{base}.lock"), None
    while fcntl is not None:
        try:
            os.makedirs(d, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            fd = None  # a read-only folder: nothing to lock, nothing will be written either
            break
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(lock)
            os.close(fd)
