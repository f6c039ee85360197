"""Fused groups that span processes, on CPU: the local rows a custom call gets (members of other
processes as -1 - global id), the group rules from published facts (one decision everywhere),
the lowering's workspace exchange (the same key-value names in every process, the handler's
sizes), and the exchange through a real jax.distributed key-value store between two processes,
with a missing peer named within the bound. The GPU side: tests/gpu/test_xproc_gpu.py."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fake_processes import FakeKV, as_process, two_processes
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, fused, runtime, topology, xproc

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Dev:
    id: int
    process_index: int
    local_hardware_id: int


def _per_gpu(processes):
    return [Dev(p, p, 0) for p in range(processes)]


def _facts(bus_by_id, *, host="h/1", cc=(9, 0), nvlink=True):
    """facts[process] with one GPU per process (device id == process), every GPU visible."""
    out = {}
    for i, bus in bus_by_id.items():
        links = {b: nvlink for j, b in bus_by_id.items() if j != i}
        out[i] = {
            "host": host(i) if callable(host) else host,
            "devices": {str(i): {"bus": bus, "cc": list(cc)}},
            "links": {bus: links},
        }
    return out


def test_local_rows_name_other_processes_members_by_global_id():
    mesh = type("M", (), {})()
    mesh.devices, mesh.axis_names = np.array(_per_gpu(4)), ("tp",)
    table = topology.group_table(mesh, ("tp",))
    for p in range(4):
        local = topology.local_rows(table, p)
        assert local.ordinals.tolist() == [0] and local.ranks.tolist() == [p]
        want = [0 if q == p else -1 - q for q in range(4)]
        assert local.groups.tolist() == [want]
        assert topology.spans_processes(local)
    assert topology.spanning_groups(table) == [((0, 1, 2, 3), (0, 1, 2, 3))]


def test_group_rules_from_facts():
    groups = [((0, 1), (0, 1))]
    buses = {0: "0000:18:00.0", 1: "0000:2a:00.0"}
    assert topology.cross_process_reason(groups, _facts(buses)) is None
    assert "spans hosts" in topology.cross_process_reason(
        groups, _facts(buses, host=lambda i: f"node{i}/x")
    )
    assert "not joined by NVLink" in topology.cross_process_reason(
        groups, _facts(buses, nvlink=False)
    )
    assert "compute capability 8.0" in topology.cross_process_reason(
        groups, _facts(buses, cc=(8, 0))
    )
    # CUDA_VISIBLE_DEVICES per process: no process sees the other's GPU; taken as NVLink.
    hidden = _facts(buses)
    for f in hidden.values():
        f["links"] = {b: {} for b in f["links"]}
    assert topology.cross_process_reason(groups, hidden) is None
    # Two processes sharing one GPU (tests on a one-GPU machine): no link to check.
    assert topology.cross_process_reason(groups, _facts({0: "x", 1: "x"}, nvlink=False)) is None
    # Two members in one process of a spanning group: not fused.
    assert "several of its GPUs in one process" in topology.cross_process_reason(
        [((0, 1, 2), (0, 0, 1))], {}
    )


def test_unfusable_reason_asks_the_cross_process_rule():
    mesh = type("M", (), {})()
    mesh.devices, mesh.axis_names = np.array(_per_gpu(2)), ("tp",)
    table = topology.group_table(mesh, ("tp",))
    seen = []
    ok = topology.unfusable_reason(
        table,
        process_index=1,
        cross_process=lambda g: seen.append(g),
        compute_capability=lambda o: (9, 0),
        can_access_peer=lambda a, b: pytest.fail("no local pair to check"),
    )
    assert ok is None and seen == [[((0, 1), (0, 1))]]
    why = topology.unfusable_reason(table, process_index=0, cross_process=lambda g: "nope")
    assert why == "nope"
    assert "no jax.distributed" in topology.unfusable_reason(table, process_index=0)


@pytest.fixture
def spanning(monkeypatch):
    """4 CPU devices as 2 processes x 2 GPUs where ``tp`` pairs one GPU of each process: ids
    0, 2 in process 0 and 1, 3 in process 1 (ordinals 0, 1 in each); mesh [[0, 1], [2, 3]]."""
    mesh = two_processes(monkeypatch)
    monkeypatch.setattr(runtime, "unavailable_reason", lambda: None)
    monkeypatch.setattr(runtime, "register_targets", lambda: None)
    monkeypatch.setattr(runtime, "compute_capability", lambda o: (9, 0))
    monkeypatch.setattr(runtime, "peer_link", lambda a, b: {"access": True, "native_atomics": True})
    monkeypatch.setattr(runtime, "can_access_peer", lambda a, b: True)
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: None)
    return mesh, lambda p: as_process(monkeypatch, p)


def _lower(mesh, config=None):
    config = config or Config(backend="fused")

    def body(x, w):
        return jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=config)

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None)), out_specs=P(("dp", "tp"))
        )
    )
    x = jax.ShapeDtypeStruct((2 * 2048, 2 * 1024), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2 * 1024, 1536), jnp.bfloat16)
    return f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()


def test_lowering_maps_the_workspace_with_the_same_names_in_every_process(spanning):
    mesh, as_process = spanning
    published, asked, sites = {}, {}, {}
    for p in (1, 0):
        native, kv = as_process(p)
        text = _lower(mesh)
        (call,) = [ln for ln in text.splitlines() if f"@{fused.GEMM_RS_TARGET}" in ln]
        assert "reduce_scatter" not in text
        # This process's devices only; the other process's member by -1 - its global id.
        assert "ordinals = dense<[0, 1]>" in call and f"ranks = dense<{p}>" in call
        sites[p] = re.search(r"site = (-?\d+)", call).group(1)
        groups = [[0, -2], [1, -4]] if p == 0 else [[-1, 0], [-3, 1]]
        assert f"groups = dense<{[v for g in groups for v in g]}>".replace(" ", "") in call.replace(
            " ", ""
        )
        # The handler's workspace: one rank's block of the output, with partials.
        block = 2048 // 2 * 1536 * 2
        assert sorted(native.exports) == sorted((g, block, True, False, p) for g in groups)
        assert sorted(i[:5] for i in native.imports) == sorted(
            (g, block, True, False, 1 - p) for g in groups
        )
        assert all(h == bytes([0xAB]) for *_, h in native.imports)
        published[p] = {k for k in kv.store if "/ws/" in k}
        asked[p] = {k for k in kv.asked if "/ws/" in k}
        assert f"{xproc.PREFIX}/facts/{1 - p}" in kv.asked
        # Lowered again (a fresh jit wrapper): mapped already, nothing exchanged.
        n_exports = len(native.exports)
        _lower(mesh)
        assert len(native.exports) == n_exports
    # The workspace key is the same in both processes (their local rows differ).
    assert sites[0] == sites[1]
    # What process 1 waited for is what process 0 published, and the other way round.
    assert {k.rsplit("/", 1)[0] for k in published[0]} == {k.rsplit("/", 1)[0] for k in asked[1]}
    assert all(k.endswith("/0") for k in published[0]) and all(k.endswith("/0") for k in asked[1])
    assert {k.rsplit("/", 1)[0] for k in published[1]} == {k.rsplit("/", 1)[0] for k in asked[0]}


def test_the_tile_schedule_maps_an_exact_workspace_the_others_one_by_size_class(spanning):
    """Both sides of a spanning workspace pick the same pool entry (ffi/runtime/ws_class.h): the
    handler shares the workspace by size class unless its Spec is exact (the tile schedule), and
    the lowering must map it with the same flag, or the processes would pair different buffers."""
    mesh, as_process = spanning
    native, _ = as_process(0)
    _lower(mesh)
    assert native.exact and all(v == {False} for v in native.exact.values())
    native.exact.clear()
    text = _lower(mesh, Config(backend="fused", schedule="tile"))
    assert f"@{fused.GEMM_RS_TILE_TARGET}" in text
    assert native.exact and all(v == {True} for v in native.exact.values())


def test_a_pcie_pair_across_processes_takes_xla(spanning, monkeypatch):
    mesh, as_process = spanning
    native, kv = as_process(1)
    peer = json.loads(kv.store[f"{xproc.PREFIX}/facts/0"])
    peer["links"] = {"bus0": {"bus1": False}}
    kv.store[f"{xproc.PREFIX}/facts/0"] = json.dumps(peer)
    with pytest.raises(Exception, match="not joined by NVLink"):
        _lower(mesh)
    assert native.exports == []


# Two real processes (2 fake CPU devices each) exchange through jax.distributed's store.
EXCHANGE = r"""
import os, sys
from jaxoverlap import launch, xproc, topology
launch.initialize()
import jax
import numpy as np
me = jax.process_index()

class Native:
    def __init__(self): self.imports = []
    def ws_export(self, site, group, bb, partials, gather, rank, exact):
        return bytes([10 + me]) * 192
    def ws_import(self, site, group, bb, partials, gather, peer, handles, exact):
        self.imports.append((peer, handles[0]))

native = Native()
table = topology.GroupTable(
    n=2, ordinals=np.array([0]), ranks=np.array([me]),
    groups=np.array([[0, -2] if me == 0 else [-1, 0]]), processes=np.array([me]),
    group_processes=np.array([[0, 1]]), group_ids=np.array([[0, 1]]))
xproc.prepare(table, 7, (4096, True, False), ("op", (8, 8)), native=native)
assert native.imports == [(1 - me, 11 - me)], native.imports
print(f"exchange OK {me}", flush=True)
if me == 0:  # a peer that never publishes: named within the bound
    xproc.SETUP_TIMEOUT_S = 2.0
    import time
    t0 = time.time()
    try:
        xproc.prepare(table, 9, (4096, True, False), ("never", ()), native=native)
    except xproc.CrossProcessError as e:
        assert "process 1 (rank 1" in str(e) and time.time() - t0 < 20, e
        print("absent OK", flush=True)
"""


def test_exchange_through_the_distributed_key_value_store(tmp_path):
    script = tmp_path / "exchange.py"
    script.write_text(EXCHANGE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "jaxoverlap.launch", "-n", "2", "--devices-per-process", "2"]
    cmd += ["--timeout", "100", str(script)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[0] exchange OK 0" in r.stdout and "[1] exchange OK 1" in r.stdout
    assert "[0] absent OK" in r.stdout, r.stdout + r.stderr


class StrictKV(FakeKV):
    """Like jax.distributed's client (checked with jax 0.11.2 and 0.12): a set without
    allow_overwrite raises when the key exists (ALREADY_EXISTS)."""

    def key_value_set(self, key, value, allow_overwrite=False):
        if key in self.store and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists")
        self.store[key] = value


def test_agree_takes_the_first_offer(monkeypatch):
    kv = StrictKV({})
    monkeypatch.setattr(xproc, "_agreed", {})
    assert xproc.agree("tuned/a", {"choice": "fused", "chunks": 2}, kv=kv) == {
        "choice": "fused",
        "chunks": 2,
    }
    monkeypatch.setattr(xproc, "_agreed", {})  # another process, whose cache says otherwise
    assert xproc.agree("tuned/a", {"choice": "xla"}, kv=kv)["choice"] == "fused"
    assert xproc.agree("tuned/b", None, kv=kv) is None  # "not tuned" is a decision too


def test_tuned_entry_is_agreed_across_processes(monkeypatch):
    """With several processes, fused.tuned returns the agreed entry, not this process's own."""
    import jax

    from jaxoverlap import fused, tune

    class Gpu:
        platform = "gpu"
        device_kind = "NVIDIA H200"

    kv = StrictKV({})
    monkeypatch.setattr(xproc, "_agreed", {})
    monkeypatch.setattr(xproc, "client", lambda: kv)
    monkeypatch.setattr(jax, "devices", lambda *a: [Gpu()])
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    mine = {"choice": "xla", "chunks": None, "comm_sms": None}
    theirs = {"choice": "fused", "chunks": 4, "comm_sms": 8}
    monkeypatch.setattr(fused.cache, "lookup", lambda key, path=None: mine)
    key = tune.Key("matmul_reduce_scatter", 8192, 4096, 8192, "bfloat16", 2, "NVIDIA H200")
    kv.store[f"{xproc.PREFIX}/agree/tuned/" + xproc.exchange_key((), (key.id(),))] = json.dumps(
        theirs
    )
    assert fused.tuned("matmul_reduce_scatter", 8192, 4096, 8192, "bfloat16", 2) == theirs
    assert fused.tuned_setting("matmul_reduce_scatter", 8192, 4096, 8192, "bfloat16", 2) == (4, 8)
    monkeypatch.setattr(jax, "process_count", lambda: 1)  # one process: its own cache
    assert fused.tuned("matmul_reduce_scatter", 8192, 4096, 8192, "bfloat16", 2) == mine
