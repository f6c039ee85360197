"""Two processes on 4 fake CPU devices, for lowering groups that span processes without them:
ids 0, 2 in process 0 and 1, 3 in process 1 (ordinals 0, 1 in each), a key-value client that
answers for the absent peer, and a native extension that records the workspace exchange."""

from __future__ import annotations

import json

import jax
import numpy as np
from jax.sharding import Mesh

from jaxoverlap import runtime, topology, xproc


def xproc_ipc_bytes():
    return 192  # kIpcBytes in ffi/runtime/runtime.h


class FakeKV:
    """The key-value client: blocking gets of workspace keys answer for the absent peer."""

    def __init__(self, facts):
        self.store = {f"{xproc.PREFIX}/facts/{p}": json.dumps(f) for p, f in facts.items()}
        self.asked = []

    def key_value_set(self, key, value, allow_overwrite=False):
        self.store[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        self.asked.append(key)
        if "/ws/" in key:
            return self.store.get(key, "ab" * xproc_ipc_bytes())
        return self.store[key]


class FakeNative:
    def __init__(self, process):
        self.exports, self.imports = [], []
        self.exact = {}  # site -> the exact flags its exports and imports were made with
        self.process = process

    def devices(self):  # ordinals 0, 1 of process p are global ids p, p + 2
        return [(0, f"bus{self.process}"), (1, f"bus{self.process + 2}")]

    def ws_export(self, site, group, block_bytes, partials, gather, rank, exact):
        self.exports.append((group, block_bytes, partials, gather, rank))
        self.exact.setdefault(site, set()).add(exact)
        return bytes([rank]) * xproc_ipc_bytes()

    def ws_import(self, site, group, block_bytes, partials, gather, peer, handles, exact):
        self.imports.append((group, block_bytes, partials, gather, peer, handles[:1]))
        self.exact.setdefault(site, set()).add(exact)


def two_processes(monkeypatch):
    """The 4 devices as 2 processes x 2 GPUs; the mesh [[0, 1], [2, 3]] over ("dp", "tp"), whose
    ``tp`` pairs one GPU of each process."""
    monkeypatch.setattr(topology, "_process", lambda d: d.id % 2)
    monkeypatch.setattr(topology, "_ordinal", lambda d: d.id // 2)
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))


def as_process(monkeypatch, p):
    """Lower as process ``p``: its peer's GPU facts published, nothing exchanged yet."""
    native = FakeNative(p)
    facts = {q: {"host": xproc._host(), "devices": {}, "links": {}} for q in (0, 1)}
    for i in range(4):
        facts[i % 2]["devices"][str(i)] = {"bus": f"bus{i}", "cc": [9, 0]}
    kv = FakeKV({1 - p: facts[1 - p]})
    monkeypatch.setattr(topology, "this_process", lambda: p)
    monkeypatch.setattr(runtime, "native", lambda: native)
    monkeypatch.setattr(xproc, "client", lambda: kv)
    monkeypatch.setattr(xproc, "_published", False)
    monkeypatch.setattr(xproc, "_facts", {})
    monkeypatch.setattr(xproc, "_prepared", set())
    return native, kv
