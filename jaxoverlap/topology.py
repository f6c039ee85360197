"""Mesh + reduced axes -> for every device, its group and its rank in that group.

The fused kernels set up cross-GPU memory on the host, before any device value exists, so the
rank of a device must come from the mesh, never from ``lax.axis_index``. The rule is the one
``lax.psum_scatter`` uses (``jax._src.interpreters.pxla.axis_groups``): a group is the set of
devices that differ only in the reduced axes; inside it, the rank is the row-major index over
the reduced axes *in the order given* (first name most significant). Block ``j`` of the
scattered result belongs to the device of rank ``j``.

Several processes (``jax.distributed``): the table covers every device of the mesh, in every
process alike. A group whose devices are all in one process can fuse (its GPUs are local, so the
one-process workspace serves it); a group that spans processes cannot yet (no cross-process
workspace), and since every process sees the same table, every process takes the same decision
for it. The custom call gets only this process's rows (`local_rows`): CUDA ordinals are
per-process and repeat across hosts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MAX_GROUP = 8  # kMaxRanks in ffi/kernels/common.cuh
BUILT_FOR = (9, 0)  # the extension is compiled for sm_90a only (CMakeLists.txt)


class TopologyError(ValueError):
    """The mesh/axes cannot run the fused kernels; the message says why."""


@dataclasses.dataclass(frozen=True)
class GroupTable:
    """One row per device of the mesh (in ``mesh.devices.flat`` order).

    Attributes:
      n: group size (product of the reduced axes' sizes).
      ordinals: local CUDA ordinal of each device (``local_hardware_id``; ``id`` where none).
      ranks: rank of each device in its group.
      groups: ``[rows, n]``: the ordinals of each device's group, by rank.
      processes: process index of each device.
      group_processes: ``[rows, n]``: the process of each member of each device's group, by
        rank; None in hand-built tables, which then must lie in one process to fuse.
    """

    n: int
    ordinals: np.ndarray
    ranks: np.ndarray
    groups: np.ndarray
    processes: np.ndarray
    group_processes: np.ndarray | None = None


def _ordinal(d):
    h = getattr(d, "local_hardware_id", None)
    return int(h) if h is not None else int(d.id)


def _process(d):
    return int(getattr(d, "process_index", 0))


def this_process():
    """This process's index (``jax.process_index()``; 0 without ``jax.distributed``)."""
    import jax

    return jax.process_index()


def group_table(mesh, axis_names) -> GroupTable:
    """The group table of ``mesh`` for a collective over ``axis_names`` (tuple of names)."""
    try:
        devices = mesh.devices
    except (AttributeError, ValueError):  # AbstractMesh: no devices
        devices = None
    if devices is None or not isinstance(devices, np.ndarray):
        raise TopologyError("the mesh has no concrete devices at lowering time")
    names = tuple(mesh.axis_names)
    try:
        axes = [names.index(a) for a in axis_names]
    except ValueError:
        raise TopologyError(f"axes {axis_names} are not all axes of the mesh {names}") from None
    n = int(np.prod([devices.shape[a] for a in axes]))
    # [n, rest] -> rows are ranks; columns are groups
    by_rank = np.moveaxis(devices, axes, list(range(len(axes)))).reshape(n, -1)
    rows = devices.size
    ordinals = np.empty(rows, np.int32)
    ranks = np.empty(rows, np.int32)
    processes = np.empty(rows, np.int32)
    groups = np.empty((rows, n), np.int32)
    group_processes = np.empty((rows, n), np.int32)
    index = {d: i for i, d in enumerate(devices.flat)}
    for g in range(by_rank.shape[1]):
        members = [by_rank[r, g] for r in range(n)]
        member_ordinals = [_ordinal(d) for d in members]
        member_processes = [_process(d) for d in members]
        for r, d in enumerate(members):
            i = index[d]
            ordinals[i] = _ordinal(d)
            ranks[i] = r
            processes[i] = _process(d)
            groups[i] = member_ordinals
            group_processes[i] = member_processes
    return GroupTable(
        n=n,
        ordinals=ordinals,
        ranks=ranks,
        groups=groups,
        processes=processes,
        group_processes=group_processes,
    )


def local_rows(table: GroupTable, process_index: int) -> GroupTable:
    """The rows of the devices of process ``process_index`` (what its custom calls get)."""
    mine = table.processes == process_index
    gp = table.group_processes
    return GroupTable(
        n=table.n,
        ordinals=table.ordinals[mine],
        ranks=table.ranks[mine],
        groups=table.groups[mine],
        processes=table.processes[mine],
        group_processes=None if gp is None else gp[mine],
    )


def _spanning_reason(table: GroupTable):
    """Why a group of ``table`` spans processes, or None. The same answer in every process."""
    gp = table.group_processes
    if gp is None:
        if len(set(table.processes.tolist())) < 2:
            return None
        return "the group table spans processes but does not say which process each member is in"
    spans = np.flatnonzero(gp.min(axis=1) != gp.max(axis=1))
    if spans.size == 0:
        return None
    members = sorted(set(gp[spans[0]].tolist()))
    return (
        f"a group of {table.n} devices over the reduced axes spans processes "
        f"{', '.join(map(str, members))} (one process per GPU, or several hosts); the fused "
        f"kernels need every GPU of a group in one process for now (the cross-process "
        f"workspace is not built yet), so this collective takes XLA's path"
    )


def unfusable_reason(
    table: GroupTable,
    *,
    process_index: int,
    can_access_peer=None,
    compute_capability=None,
    peer_link=None,
):
    """None when the fused kernels can run on these groups, else a sentence saying why.

    ``compute_capability(ordinal) -> (major, minor)``: the build is sm_90a only, so anything but
    9.0 (A100: 8.0, B200: 10.0) would fail at its first launch. ``peer_link(a, b) -> dict``: the
    group must be NVLink-connected; CUDA reports native peer atomics for NVLink/NVSwitch links
    only, so peer access without them is PCIe, where the fused kernels' fine-grained cross-GPU
    traffic would lose to NCCL. Each callable is skipped when None.
    """
    if table.n < 2:
        return "the group has a single device (nothing to reduce-scatter)"
    if table.n > MAX_GROUP:
        return f"group size {table.n} exceeds the {MAX_GROUP} GPUs of one NVLink node"
    why = _spanning_reason(table)
    if why:
        return why
    # Every group is inside one process: the rest is about this process's GPUs and groups only
    # (other processes check theirs; no group is shared, so they need not agree).
    table = local_rows(table, process_index)
    if len(set(table.ordinals.tolist())) != len(table.ordinals):
        return "two mesh devices share a CUDA ordinal in this process"
    groups = sorted({tuple(g) for g in table.groups.tolist()})
    if compute_capability is not None:
        for ordinal in sorted({o for g in groups for o in g}):
            cc = tuple(compute_capability(ordinal))
            if cc != BUILT_FOR:
                return (
                    f"GPU {ordinal} has compute capability {cc[0]}.{cc[1]}; the fused kernels "
                    f"are built for {BUILT_FOR[0]}.{BUILT_FOR[1]} (sm_90a, Hopper) only"
                )
    if can_access_peer is not None:
        for group in groups:
            for a in group:
                for b in group:
                    if a != b and not can_access_peer(a, b):
                        return f"GPU {a} cannot access GPU {b} directly (no NVLink/P2P access)"
    if peer_link is not None:
        for group in groups:
            for a in group:
                for b in group:
                    link = peer_link(a, b) if a != b else None
                    if link is not None and not (link["access"] and link["native_atomics"]):
                        return (
                            f"GPU {a} reaches GPU {b} without NVLink (CUDA reports peer access "
                            f"{link['access']}, native peer atomics {link['native_atomics']}: "
                            f"PCIe), where the fused kernels would lose to NCCL"
                        )
    return None
