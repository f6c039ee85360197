"""Mesh + reduced axes -> for every device, its group and its rank in that group.

The fused kernels set up cross-GPU memory on the host, before any device value exists, so the
rank of a device must come from the mesh, never from ``lax.axis_index``. The rule is the one
``lax.psum_scatter`` uses (``jax._src.interpreters.pxla.axis_groups``): a group is the set of
devices that differ only in the reduced axes; inside it, the rank is the row-major index over
the reduced axes *in the order given* (first name most significant). Block ``j`` of the
scattered result belongs to the device of rank ``j``.
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
    """

    n: int
    ordinals: np.ndarray
    ranks: np.ndarray
    groups: np.ndarray
    processes: np.ndarray


def _ordinal(d):
    h = getattr(d, "local_hardware_id", None)
    return int(h) if h is not None else int(d.id)


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
    index = {d: i for i, d in enumerate(devices.flat)}
    for g in range(by_rank.shape[1]):
        members = [by_rank[r, g] for r in range(n)]
        member_ordinals = [_ordinal(d) for d in members]
        for r, d in enumerate(members):
            i = index[d]
            ordinals[i] = _ordinal(d)
            ranks[i] = r
            processes[i] = int(getattr(d, "process_index", 0))
            groups[i] = member_ordinals
    return GroupTable(n=n, ordinals=ordinals, ranks=ranks, groups=groups, processes=processes)


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
    if np.any(table.processes != process_index):
        return (
            "the mesh spans several processes (one process per GPU or several hosts); the "
            "fused kernels need every device of the group in this process for now"
        )
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
