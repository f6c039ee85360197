"""Group rules under jax.distributed, on fake topologies: a group inside one process may fuse
(its rows alone go to the custom call), a group that spans processes takes XLA's path with the
reason -- raised under backend="fused", logged once under "auto" -- and every process decides
the same for it. A dp x tp mesh with tp inside a process and dp across processes is the common
case: tp fusable, dp reference."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, fused, runtime, topology
from jaxoverlap.ops import _common

NVLINK = {"access": True, "native_atomics": True, "performance_rank": 0}


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    local_hardware_id: int


@dataclasses.dataclass
class FakeMesh:
    devices: np.ndarray
    axis_names: tuple


def _hosts(processes, per_process, *, distinct_ordinals=False):
    """Devices of ``processes`` processes with ``per_process`` GPUs each. CUDA ordinals repeat
    across processes (several hosts, or CUDA_VISIBLE_DEVICES) unless ``distinct_ordinals``
    (one host, JAX's local_device_ids convention)."""
    return [
        FakeDevice(p * per_process + i, p, (p * per_process if distinct_ordinals else 0) + i)
        for p in range(processes)
        for i in range(per_process)
    ]


def _reason(table, process, **checks):
    return topology.unfusable_reason(table, process_index=process, **checks)


def test_dp_across_processes_tp_inside():
    # 2 hosts x 4 GPUs; mesh rows are hosts.
    mesh = FakeMesh(np.array(_hosts(2, 4)).reshape(2, 4), ("dp", "tp"))
    tp = topology.group_table(mesh, ("tp",))
    for p in (0, 1):
        assert _reason(tp, p, can_access_peer=lambda a, b: True) is None
        local = topology.local_rows(tp, p)
        assert local.ordinals.tolist() == [0, 1, 2, 3]
        assert local.ranks.tolist() == [0, 1, 2, 3]
        assert local.groups.tolist() == [[0, 1, 2, 3]] * 4
    dp = topology.group_table(mesh, ("dp",))
    for p in (0, 1):
        why = _reason(dp, p)
        assert "spans processes 0, 1" in why and "XLA's path" in why
    # Both axes together: one group of 8 over both processes.
    assert "spans processes 0, 1" in _reason(topology.group_table(mesh, ("dp", "tp")), 0)


def test_one_process_per_gpu_and_mixed_layouts():
    per_gpu = FakeMesh(np.array(_hosts(4, 1)).reshape(4), ("tp",))
    why = _reason(topology.group_table(per_gpu, ("tp",)), 2)
    assert "spans processes 0, 1, 2, 3" in why
    # 2 processes x 2 GPUs, mesh (tp=2 inside a process) x (dp=2); permuted device order.
    devs = _hosts(2, 2, distinct_ordinals=True)
    grid = np.array([devs[3], devs[2], devs[0], devs[1]]).reshape(2, 2)  # rows are processes
    mesh = FakeMesh(grid, ("dp", "tp"))
    tp = topology.group_table(mesh, ("tp",))
    assert _reason(tp, 0) is None and _reason(tp, 1) is None
    local = topology.local_rows(tp, 1)
    assert local.ordinals.tolist() == [3, 2] and local.groups.tolist() == [[3, 2], [3, 2]]
    # The same devices with the tp axis across processes: every process refuses.
    cross = FakeMesh(grid.T, ("dp", "tp"))
    table = topology.group_table(cross, ("tp",))
    assert "spans processes" in _reason(table, 0) and "spans processes" in _reason(table, 1)


def test_hardware_checks_see_only_this_process_gpus():
    # One host, local_device_ids convention: process 0 drives GPUs 0,1, process 1 GPUs 2,3.
    mesh = FakeMesh(np.array(_hosts(2, 2, distinct_ordinals=True)).reshape(2, 2), ("dp", "tp"))
    table = topology.group_table(mesh, ("tp",))
    asked = []

    def cc(ordinal):
        asked.append(ordinal)
        return (8, 0) if ordinal == 0 else (9, 0)

    assert "GPU 0 has compute capability 8.0" in _reason(table, 0, compute_capability=cc)
    assert set(asked) <= {0, 1}
    asked.clear()
    assert _reason(table, 1, compute_capability=cc) is None
    assert set(asked) == {2, 3}


@pytest.fixture
def two_fake_processes(monkeypatch):
    """The 4 CPU devices as 2 processes x 2 GPUs with per-process CUDA ordinals 0 and 1, seen
    from process 1; the extension stood in for as in test_fused_logic (lowering only)."""
    monkeypatch.setattr(topology, "_process", lambda d: d.id // 2)
    monkeypatch.setattr(topology, "_ordinal", lambda d: d.id % 2)
    monkeypatch.setattr(topology, "this_process", lambda: 1)
    monkeypatch.setattr(runtime, "native", lambda: object())
    monkeypatch.setattr(runtime, "unavailable_reason", lambda: None)
    monkeypatch.setattr(runtime, "register_targets", lambda: None)
    monkeypatch.setattr(runtime, "compute_capability", lambda o: (9, 0))
    monkeypatch.setattr(runtime, "peer_link", lambda a, b: NVLINK)
    monkeypatch.setattr(runtime, "can_access_peer", lambda a, b: True)
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: None)
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))


def _lower(mesh, axis, backend):
    def body(x, w):
        return jaxoverlap.matmul_reduce_scatter(x, w, axis, config=Config(backend=backend))

    other = "dp" if axis == "tp" else "tp"
    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(other, axis), P(axis, None)), out_specs=P((other, axis))
        )
    )
    # Inside the measured-win rule for backend="auto": M=4096 rows per device, K=4096, N=4096.
    x = jax.ShapeDtypeStruct((2 * 4096, 2 * 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2 * 4096, 4096), jnp.bfloat16)
    return f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()


def test_lowering_tp_inside_process_fuses_with_local_rows(two_fake_processes):
    for backend in ("fused", "auto"):
        text = _lower(two_fake_processes, "tp", backend)
        (call,) = [line for line in text.splitlines() if f"@{fused.GEMM_RS_TARGET}" in line]
        assert "reduce_scatter" not in text
        # Only process 1's devices (ids 2, 3 = its ordinals 0, 1), so ordinals never repeat.
        assert "ordinals = dense<[0, 1]>" in call
        assert "ranks = dense<[0, 1]>" in call
        assert "groups = dense<[0, 1, 0, 1]>" in call


def test_lowering_dp_across_processes_takes_xla(two_fake_processes, caplog, monkeypatch):
    with pytest.raises(ValueError, match="backend='fused' cannot run here: .*spans processes 0, 1"):
        _lower(two_fake_processes, "dp", "fused")
    monkeypatch.setattr(_common, "_logged", set())
    with caplog.at_level(logging.INFO, logger="jaxoverlap"):
        for _ in range(2):
            text = _lower(two_fake_processes, "dp", "auto")
            assert fused.GEMM_RS_TARGET not in text and "reduce_scatter" in text
    said = [r.getMessage() for r in caplog.records if "spans processes" in r.getMessage()]
    assert len(said) == 1 and "reference (XLA) path" in said[0]
