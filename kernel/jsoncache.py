"""A dict of JSON entries kept in memory and mirrored to one file that several processes share: the file handling
of the GEMM autotune cache (``kernel.autotune.ConfigCache``), the attention cache and the dispatch decision cache.

The file is ``{<meta>..., <section>: {key: entry}}``. A damaged file (unreadable bytes, not JSON, not of that shape,
or entries that ``valid`` rejects) is set aside as ``<name>.bad-<time>`` with one warning naming it; its valid
entries are kept (written back), and whatever it lacked is tuned again. A file that cannot be read at all (no
permission) is ignored with one warning. Writes merge: under an exclusive lock (``atomic.locked``) the file is read
again, this process's entries are laid over it, and the whole is replaced atomically (``atomic.atomic_write``), so
two processes writing one file keep both's entries. No torch here.

A cache may have a ``seed`` (``kernel.tuned.Seed``: the pack's shipped table for this GPU): ``get`` falls back to
it for a key the file lacks; its entries pass ``valid`` too, are never written to the file, and the file's win.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from . import atomic

log = logging.getLogger("int8_fused")


def any_dict(key: str, entry) -> bool:
    return isinstance(entry, dict)


class JsonCache:
    """Entries of one file (module doc). ``what`` names the cache in the warning (``"<who>: ignoring the
    unreadable <what> <path> ..."``); ``valid(key, entry)`` says whether a read entry may be used; ``seed``: an
    object whose ``get(key)`` gives a shipped entry or None (module doc)."""

    def __init__(self, path, section: str, what: str = "cache", who: str = "INT8",
                 valid: Callable[[str, object], bool] = any_dict, seed=None):
        self.path = Path(path)
        self.section, self.what, self.who, self.valid = section, what, who, valid
        self.seed = seed
        self._refused: set = set()   # seed keys whose entry failed (``refuse_seed``)
        self._seeded: set = set()    # seed keys served
        self._seed_failed = False    # whether a seed entry failed (``kernel.autotune.seed_entry`` warns once)
        self._lock = threading.Lock()
        self._mem: dict | None = None
        self._mine: dict = {}        # entries this process put: laid over the file on every write
        self._warned_stuck = False

    # ------------------------------------------------------------------ reading
    def _ok(self, key, entry) -> bool:
        try:
            return bool(self.valid(key, entry))
        except Exception:  # noqa: BLE001 - a validator tripping over odd JSON means the entry is bad
            return False

    def _load(self) -> tuple[dict, dict, str | None, bool]:
        """(meta, valid entries, what is wrong or None, whether the file itself is damaged)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}, {}, None, False
        except OSError as e:
            return {}, {}, f"{type(e).__name__}: {e}", False
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            return {}, {}, f"{type(e).__name__}: {str(e)[:200]}", True
        if not isinstance(data, dict):
            return {}, {}, f"a JSON {type(data).__name__}, not an object", True
        entries = data.get(self.section)
        meta = {k: v for k, v in data.items() if k != self.section}
        if not isinstance(entries, dict):
            return meta, {}, f"{self.section!r} is {'missing' if entries is None else type(entries).__name__}", True
        good = {k: v for k, v in entries.items() if self._ok(k, v)}
        bad = len(entries) - len(good)
        return meta, good, (f"{bad} malformed entr{'y' if bad == 1 else 'ies'}" if bad else None), bool(bad)

    def _read_locked(self) -> tuple[dict, dict, bool]:
        """(meta, entries, whether the file was set aside) while holding ``atomic.locked(self.path)``."""
        meta, entries, problem, damaged = self._load()
        if problem is None:
            return meta, entries, False
        dest = self._set_aside() if damaged else None
        if dest is None:  # unreadable (permissions), or a folder where nothing can be renamed: warned once
            if not self._warned_stuck:
                self._warned_stuck = True
                log.warning("%s: ignoring the unreadable %s %s (%s)%s; its entries are tuned again", self.who,
                            self.what, self.path, problem, ", which could not be set aside" if damaged else "")
            return meta, entries, False
        kept = f"; its {len(entries)} valid entries are kept" if entries else ""
        log.warning("%s: ignoring the unreadable %s %s (%s): set aside as %s%s; what it lacked is tuned again",
                    self.who, self.what, self.path, problem, dest.name, kept)
        return meta, entries, True

    def _set_aside(self) -> Path | None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest = self.path.with_name(f"{self.path.name}.bad-{stamp}")
        n = 1
        while dest.exists():
            dest, n = self.path.with_name(f"{self.path.name}.bad-{stamp}-{n}"), n + 1
        try:
            os.replace(self.path, dest)
        except OSError:
            return None
        return dest

    def _write(self, meta: dict, entries: dict) -> None:
        text = json.dumps({**meta, self.section: entries}, indent=1, sort_keys=True)
        try:
            atomic.atomic_write(self.path, lambda tmp: Path(tmp).write_text(text))
        except OSError as e:  # a read-only home: the next process tunes these entries again
            log.debug("%s: could not write %s: %s", self.who, self.path, e)

    # ------------------------------------------------------------------ the interface
    def get(self, key: str, seed: bool = True):
        """The entry of ``key``: the file's, else (``seed``) the seed's, else None; the first call reads the file
        (repairing a damaged one)."""
        own = self._get(key)
        return own if own is not None or not seed else self.seed_get(key)

    def seed_get(self, key: str):
        """The seed's entry of ``key`` (a copy), or None: no seed, no entry, an entry ``valid`` rejects, or one
        refused."""
        if self.seed is None or key in self._refused:
            return None
        try:
            entry = self.seed.get(key)
        except Exception as e:  # noqa: BLE001 - a broken table must not stop a call: it is tuned instead
            log.debug("%s: seed lookup of %s failed: %s", self.who, key, e)
            return None
        if entry is None or not self._ok(key, entry):
            return None
        if key not in self._seeded:
            self._seeded.add(key)
            from .tuned import progress
            progress.seed_hit(getattr(self.seed, "section", self.section))
        return entry

    def refuse_seed(self, key: str) -> None:
        """Stop serving the seed's entry of ``key`` (it failed to build or run): the key is tuned."""
        self._refused.add(key)

    def _get(self, key: str):
        with self._lock:
            if self._mem is None:
                _, entries, problem, _ = self._load()
                if problem is not None:  # look again under the lock: another process may be repairing it
                    with atomic.locked(self.path):
                        meta, entries, aside = self._read_locked()
                        if aside and entries:
                            self._write(meta, entries)
                self._mem = {**entries, **self._mine}
            return self._mem.get(key)

    def put(self, key: str, entry, meta: dict | None = None) -> None:
        """Store ``entry`` under ``key`` and write the file: the file's entries (read again under the lock), then
        every entry this process put, ``meta`` over the file's own top-level keys. Raises what ``json`` raises for
        a value it cannot hold, before anything is changed."""
        with self._lock:
            json.dumps(entry)
            self._mine[key] = entry
            with atomic.locked(self.path):
                disk_meta, entries, _ = self._read_locked()
                merged = {**entries, **self._mine}
                self._write({**disk_meta, **(meta or {})}, merged)
            self._mem = merged
