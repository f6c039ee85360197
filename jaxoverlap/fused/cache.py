"""The tuner's cache: what `python -m jaxoverlap.tune` measured, read at trace and lowering time.

One JSON file per fingerprint of what the timings depend on (`runtime.fingerprint`: jaxlib, the
native extension's build, the GPU driver) in `runtime.cache_dir`; an entry per `Key`. The
measuring and the CLI are `jaxoverlap.tune`; the decisions that read the entries,
`jaxoverlap.fused.policy`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile

from jaxoverlap import runtime

log = logging.getLogger("jaxoverlap")
CACHE_VERSION = runtime.CACHE_VERSION


@dataclasses.dataclass(frozen=True)
class Key:
    """What a decision depends on. matmul_reduce_scatter and matmul_all_reduce: x [m, k] (rows
    flattened) and w [k, n] per device; all_gather_matmul: m = gathered rows (x [m / group, k]
    per device), w [k, n]."""

    op: str
    m: int
    k: int
    n: int
    dtype: str
    group: int
    device_kind: str

    def id(self) -> str:
        kind = self.device_kind.replace(" ", "_")
        return f"{self.op}|{kind}|{self.dtype}|tp{self.group}|{self.m}x{self.k}x{self.n}"


_memo: dict[str, tuple[float, dict]] = {}


def cache_path() -> str:
    return os.path.join(runtime.cache_dir(), f"tune-{runtime.fingerprint()}.json")


def load(path: str | None = None) -> dict:
    """The cache's entries (id -> entry); {} when there is none. Re-read when the file changes."""
    path = path or cache_path()
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return {}
    if path in _memo and _memo[path][0] == mtime:
        return _memo[path][1]
    try:
        with open(path) as f:
            entries = json.load(f).get("entries", {})
    except (OSError, ValueError) as e:
        log.warning("jaxoverlap: ignoring the unreadable tuning cache %s (%s)", path, e)
        entries = {}
    _memo[path] = (mtime, entries)
    return entries


def lookup(key: Key, path: str | None = None) -> dict | None:
    return load(path).get(key.id())


def record(key: Key, entry: dict, path: str | None = None) -> None:
    """Adds one entry; written atomically (a reader never sees half a file)."""
    path = path or cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    entries = dict(load(path))
    entries[key.id()] = entry
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
