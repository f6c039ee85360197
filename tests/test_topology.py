"""topology.group_table / unfusable_reason on fake CPU devices (any group size, 2-D meshes,
permuted device orders), checked against the replica groups JAX's own psum_scatter uses."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax._src.interpreters import pxla
from jax.sharding import Mesh

from jaxoverlap import topology


def _mesh(shape, names, order=None):
    devs = jax.devices()[: int(np.prod(shape))]
    if order is not None:
        devs = [devs[i] for i in order]
    return Mesh(np.array(devs).reshape(shape), names)


CASES = [
    ((2,), ("tp",), None, ("tp",)),
    ((8,), ("tp",), (5, 2, 7, 0, 3, 6, 1, 4), ("tp",)),
    ((2, 4), ("dp", "tp"), None, ("tp",)),
    ((2, 4), ("dp", "tp"), (3, 6, 0, 5, 2, 7, 1, 4), ("tp",)),
    ((4, 2), ("tp", "dp"), (3, 6, 0, 5, 2, 7, 1, 4), ("tp",)),
    ((2, 4), ("dp", "tp"), (7, 6, 5, 4, 3, 2, 1, 0), ("dp",)),
    ((2, 2, 2), ("a", "b", "c"), (1, 0, 3, 2, 5, 4, 7, 6), ("c", "a")),
    ((2, 2, 2), ("a", "b", "c"), None, ("a", "c")),
]


@pytest.mark.parametrize("shape,names,order,axes", CASES)
def test_matches_jax_replica_groups(shape, names, order, axes):
    mesh = _mesh(shape, names, order)
    table = topology.group_table(mesh, axes)
    flat = list(mesh.devices.flat)
    # JAX: groups of positions in mesh.devices.flat, each ordered by rank (pxla.axis_groups)
    mesh_axes = tuple(names.index(a) for a in axes)
    groups = pxla._axis_groups(tuple(shape) + (1,), mesh_axes)
    assert table.n == len(groups[0])
    for group in groups:
        ordinals = [flat[i].local_hardware_id for i in group]
        for rank, i in enumerate(group):
            assert table.ordinals[i] == flat[i].local_hardware_id
            assert table.ranks[i] == rank
            assert table.groups[i].tolist() == ordinals


def test_rank_order_follows_axis_name_order():
    mesh = _mesh((2, 2, 2), ("a", "b", "c"))
    ac = topology.group_table(mesh, ("a", "c"))
    ca = topology.group_table(mesh, ("c", "a"))
    # device at a=1, c=0 (flat index 4) is rank 2 over (a, c) and rank 1 over (c, a)
    assert ac.ranks[4] == 2 and ca.ranks[4] == 1


def test_fusable_and_reasons():
    mesh = _mesh((2, 4), ("dp", "tp"))
    table = topology.group_table(mesh, ("tp",))
    assert topology.unfusable_reason(table, process_index=0) is None
    assert (
        topology.unfusable_reason(table, process_index=0, can_access_peer=lambda a, b: True) is None
    )
    why = topology.unfusable_reason(
        table, process_index=0, can_access_peer=lambda a, b: not (a == 1 and b == 2)
    )
    assert "GPU 1 cannot access GPU 2" in why
    multi = topology.GroupTable(
        n=table.n,
        ordinals=table.ordinals,
        ranks=table.ranks,
        groups=table.groups,
        processes=np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32),
    )
    assert "does not say which process" in topology.unfusable_reason(multi, process_index=0)
    single = topology.group_table(_mesh((2, 4), ("dp", "tp")), ("dp",))
    assert single.n == 2
    one = topology.group_table(_mesh((1, 2), ("dp", "tp")), ("dp",))
    assert "single device" in topology.unfusable_reason(one, process_index=0)
    big = topology.GroupTable(
        n=16,
        ordinals=np.arange(16),
        ranks=np.arange(16),
        groups=np.tile(np.arange(16), (16, 1)),
        processes=np.zeros(16, np.int32),
    )
    assert "exceeds" in topology.unfusable_reason(big, process_index=0)


def test_errors():
    mesh = _mesh((2,), ("tp",))
    with pytest.raises(topology.TopologyError, match="not all axes"):
        topology.group_table(mesh, ("dp",))
    with pytest.raises(topology.TopologyError, match="no concrete devices"):
        topology.group_table(mesh.abstract_mesh, ("tp",))
