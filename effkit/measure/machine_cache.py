"""Figures measured once per machine and kept: `machine_cached(name, key, measure)` stores `measure()`'s result in
`<cache>/<name>.json`, keyed by `machine_id` (host and CPU flags) and the caller's key, with when and where it was
measured; an entry older than MAX_AGE_DAYS, or any entry under $EFFKIT_REMEASURE (REMEASURE_ENV, `effkit
--remeasure`), is measured again; `cache_note` says where and when a cached value was measured. Each look-up with
a `measure` is logged in `CONSULTED` (warm or filled now, and the seconds filling took, also kept in the entry as
`fill_s`): the run's estimate prices a cold cache by what filling it cost (`effkit.pipeline.cache_fills`)."""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from effkit.data.tokenizer import cache_dir
from effkit.measure import hardware

MAX_AGE_DAYS = 30  # a cached measurement older than this is measured again (machines and their loads change)
REMEASURE_ENV = "EFFKIT_REMEASURE"  # set (`effkit --remeasure ...`): every cached measurement is taken again


def machine_id() -> str:
    """This machine, as the caches key it: its systemd machine id (or host name) and the CPU's flags, hashed, so
    that a cache shared between hosts (a common $EFFKIT_CACHE) never hands one host's figure to another, nor to
    the same host after its CPU changed."""
    import hashlib
    import socket

    ident = ""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            ident = Path(path).read_text().strip()
            break
        except OSError:
            continue
    ident = ident or socket.gethostname()
    flags = " ".join(sorted(hardware.cpu_flags()))
    return hashlib.sha256(f"{ident}|{flags}".encode()).hexdigest()[:12]


def _cache_key(key: str) -> str:
    return f"machine {machine_id()}|{key}"


def machine_cached(name: str, key: str, measure: Callable[[], Any] | None) -> tuple[Any, bool]:
    """`measure()`'s result, measured once per machine (`machine_id`: host and CPU flags) and `key` (versions,
    shape) and kept in `<cache>/<name>.json` with the time it was measured (written atomically; a corrupt file is
    measured again); (result, whether it came from the cache). An entry older than MAX_AGE_DAYS, or any entry
    while $EFFKIT_REMEASURE is set (`effkit --remeasure`), is measured again. With no `measure`, only a look-up:
    (None, False) when the key is not there. `cache_note` says where and when a cached value was measured."""
    path = cache_dir() / f"{name}.json"
    full = _cache_key(key)

    def read() -> dict[str, Any]:
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except (json.JSONDecodeError, OSError, UnicodeDecodeError):
            return {}

    entry = read().get(full)
    if isinstance(entry, dict) and "value" in entry and not _stale(entry, (name, full)):
        if measure is not None:
            CONSULTED.append({"cache": name, "key": key, "warm": True})
        return entry["value"], True
    if measure is None:
        return None, False
    start = time.perf_counter()
    value = measure()
    fill_s = time.perf_counter() - start
    keep(name, key, value, fill_s=fill_s)
    _REMEASURED.add((name, full))
    CONSULTED.append({"cache": name, "key": key, "warm": False, "fill_s": fill_s})
    return value, False


def keep(name: str, key: str, value: Any, **more: Any) -> None:
    """Store `value` (with when and where, and `more`) under this machine and `key` in `<cache>/<name>.json`,
    replacing what was there (atomically; what others wrote meanwhile stays)."""
    entry = {"value": value, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_id(),
             "host": platform.node(), **more}
    path = cache_dir() / f"{name}.json"
    try:
        cache = json.loads(path.read_text()) if path.is_file() else {}
    except (json.JSONDecodeError, OSError, UnicodeDecodeError):
        cache = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    # two processes (or threads) measuring at once never share a temporary
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({**cache, _cache_key(key): entry}, indent=1))
    tmp.replace(path)


def entry_of(name: str, key: str) -> dict[str, Any]:
    """The stored entry of `key` on this machine ({} when none)."""
    try:
        entry = json.loads((cache_dir() / f"{name}.json").read_text()).get(_cache_key(key), {})
    except (json.JSONDecodeError, OSError, UnicodeDecodeError, AttributeError):
        entry = {}
    return entry if isinstance(entry, dict) else {}


# every look-up with a measure this process made, in order: {"cache", "key", "warm", "fill_s" (when filled now)}
CONSULTED: list[dict[str, Any]] = []


_REMEASURED: set[tuple[str, str]] = set()  # what this process measured again under $EFFKIT_REMEASURE


def _stale(entry: dict[str, Any], which: tuple[str, str]) -> bool:
    if os.environ.get(REMEASURE_ENV) and which not in _REMEASURED:  # once per process, then the new value
        return True
    try:
        measured = time.mktime(time.strptime(entry["measured_at"][:19], "%Y-%m-%dT%H:%M:%S"))
    except (KeyError, ValueError, TypeError):
        return True
    return time.time() - measured > MAX_AGE_DAYS * 86400


def cache_note(name: str, key: str) -> str:
    """`measured 2026-11-25T13:40:02+0000 on host h (machine 3f2a...; cached, kept 30 days)`: where and when the
    cached value of `key` was measured, for the report beside it."""
    entry = entry_of(name, key)
    if "measured_at" not in entry:
        return "not cached"
    return (f"measured {entry['measured_at']} on host {entry.get('host', '?')} (machine {entry.get('machine', '?')}; "
            f"cached, kept {MAX_AGE_DAYS} days; `effkit --remeasure` measures again)")
