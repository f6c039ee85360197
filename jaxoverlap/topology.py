"""Mesh + reduced axes -> for every device, its group and its rank in that group.

The fused kernels set up cross-GPU memory on the host, before any device value exists, so the
rank of a device must come from the mesh, never from ``lax.axis_index``. The rule is the one
``lax.psum_scatter`` uses (``jax._src.interpreters.pxla.axis_groups``): a group is the set of
devices that differ only in the reduced axes; inside it, the rank is the row-major index over
the reduced axes *in the order given* (first name most significant). Block ``j`` of the
scattered result belongs to the device of rank ``j``.

Several processes (``jax.distributed``): the table covers every device of the mesh, in every
process alike. A group whose devices are all in one process fuses with the one-process
workspace. A group that spans processes fuses when it has one device in each of its processes,
all on one host and joined by NVLink (`cross_process_reason`, from facts every process publishes
through the ``jax.distributed`` key-value store: jaxoverlap/xproc.py); its workspace is mapped
across the processes by CUDA IPC. Every process sees the same table and the same facts, so
every process takes the same decision for a group. The custom call gets only this process's
rows (`local_rows`): CUDA ordinals are per-process and repeat across hosts, so a member in
another process is sent as ``-1 - its global device id``.
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
      group_ids: ``[rows, n]``: the global device id (``jax.Device.id``) of each member of each
        device's group, by rank; None in hand-built tables.
      whole: the groups of the whole mesh in global ids (a tuple, the same in every process; kept
        by `local_rows`): what a workspace key of a group spanning processes is derived from.
    """

    n: int
    ordinals: np.ndarray
    ranks: np.ndarray
    groups: np.ndarray
    processes: np.ndarray
    group_processes: np.ndarray | None = None
    group_ids: np.ndarray | None = None
    whole: tuple | None = None


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
    group_ids = np.empty((rows, n), np.int32)
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
            group_ids[i] = [int(m.id) for m in members]
    return GroupTable(
        n=n,
        ordinals=ordinals,
        ranks=ranks,
        groups=groups,
        processes=processes,
        group_processes=group_processes,
        group_ids=group_ids,
        whole=tuple(tuple(r) for r in group_ids.tolist()),
    )


def local_rows(table: GroupTable, process_index: int) -> GroupTable:
    """The rows of the devices of process ``process_index`` (what its custom calls get); in
    ``groups``, a member in another process is ``-1 - its global device id``."""
    mine = table.processes == process_index
    gp = table.group_processes
    groups = table.groups[mine]
    if gp is not None and table.group_ids is not None:
        groups = np.where(gp[mine] == process_index, groups, -1 - table.group_ids[mine])
    return GroupTable(
        n=table.n,
        ordinals=table.ordinals[mine],
        ranks=table.ranks[mine],
        groups=groups.astype(np.int32),
        processes=table.processes[mine],
        group_processes=None if gp is None else gp[mine],
        group_ids=None if table.group_ids is None else table.group_ids[mine],
        whole=table.whole,
    )


def spans_processes(table: GroupTable) -> bool:
    """Whether a (local-rows) table's groups have members in other processes."""
    return bool((table.groups < 0).any())


def spanning_groups(table: GroupTable):
    """``[(ids, processes)]``: each group of ``table`` that spans processes (once), its members'
    global device ids and processes by rank."""
    gp, ids = table.group_processes, table.group_ids
    if gp is None or ids is None:
        return []
    out = {}
    for row in np.flatnonzero(gp.min(axis=1) != gp.max(axis=1)):
        out[tuple(ids[row].tolist())] = tuple(gp[row].tolist())
    return sorted(out.items())


def cross_process_reason(groups, facts):
    """None when every group of ``groups`` (`spanning_groups`) can fuse across its processes,
    else a sentence saying why. ``facts[process]`` is what that process published
    (jaxoverlap/xproc.py: ``host``, ``devices``: global id -> ``{"bus", "cc"}``, ``links``: bus
    id of its GPU -> {bus id of each GPU it sees -> NVLink or not}). Pure: every process gets
    the same answer from the same facts.

    A group fuses when each of its processes holds one member, all members are Hopper GPUs of
    one host, and every pair is joined by NVLink as far as any process can see (a pair that no
    process sees both GPUs of -- ``CUDA_VISIBLE_DEVICES`` per process -- is taken to be; mapping
    its memory fails loudly at lowering if not).
    """
    for ids, procs in groups:
        if len(set(procs)) != len(procs):
            return (
                f"the group of devices {list(ids)} spans processes {sorted(set(procs))} with "
                f"several of its GPUs in one process; a group that spans processes fuses only "
                f"with one GPU in each (one process per GPU), so it takes XLA's path"
            )
        hosts = {facts[p]["host"] for p in procs}
        if len(hosts) > 1:
            return (
                f"the group of devices {list(ids)} spans hosts ({', '.join(sorted(hosts))}); "
                f"the fused kernels need one NVLink domain, so it takes XLA's path"
            )
        dev = [facts[p]["devices"][str(i)] for i, p in zip(ids, procs)]
        for i, d in zip(ids, dev):
            if tuple(d["cc"]) != BUILT_FOR:
                return (
                    f"GPU of device id {i} has compute capability {d['cc'][0]}.{d['cc'][1]}; "
                    f"the fused kernels are built for {BUILT_FOR[0]}.{BUILT_FOR[1]} only"
                )
        for a in range(len(ids)):
            for b in range(len(ids)):
                bus_a, bus_b = dev[a]["bus"], dev[b]["bus"]
                if a == b or bus_a == bus_b:  # two processes may share a GPU (tests)
                    continue
                seen = [
                    facts[procs[a]]["links"].get(bus_a, {}).get(bus_b),
                    facts[procs[b]]["links"].get(bus_b, {}).get(bus_a),
                ]
                if False in seen:
                    return (
                        f"GPUs {bus_a} and {bus_b} (device ids {ids[a]}, {ids[b]}) are not "
                        f"joined by NVLink; the fused kernels would lose to NCCL there"
                    )
    return None


def _spanning_reason(table: GroupTable, cross_process):
    """Why a group of ``table`` that spans processes cannot fuse, or None (also when none
    spans). ``cross_process(spanning_groups) -> reason or None`` decides for the spanning ones;
    None: they cannot (no ``jax.distributed`` to exchange workspaces through). The same answer
    in every process."""
    gp = table.group_processes
    if gp is None or table.group_ids is None:
        if len(set(table.processes.tolist())) < 2:
            return None
        return "the group table spans processes but does not say which process each member is in"
    spans = spanning_groups(table)
    if not spans:
        return None
    if cross_process is None:
        members = sorted(set(spans[0][1]))
        return (
            f"a group of {table.n} devices over the reduced axes spans processes "
            f"{', '.join(map(str, members))}, and no jax.distributed key-value store is there "
            f"to map its workspace across them, so this collective takes XLA's path"
        )
    return cross_process(spans)


def unfusable_reason(
    table: GroupTable,
    *,
    process_index: int,
    can_access_peer=None,
    compute_capability=None,
    peer_link=None,
    cross_process=None,
):
    """None when the fused kernels can run on these groups, else a sentence saying why.

    ``compute_capability(ordinal) -> (major, minor)``: the build is sm_90a only, so anything but
    9.0 (A100: 8.0, B200: 10.0) would fail at its first launch. ``peer_link(a, b) -> dict``: the
    group must be NVLink-connected; CUDA reports native peer atomics for NVLink/NVSwitch links
    only, so peer access without them is PCIe, where the fused kernels' fine-grained cross-GPU
    traffic would lose to NCCL. Each callable is skipped when None, except ``cross_process``
    (`_spanning_reason`), which decides for groups that span processes.
    """
    if table.n < 2:
        return "the group has a single device (nothing to reduce-scatter)"
    if table.n > MAX_GROUP:
        return f"group size {table.n} exceeds the {MAX_GROUP} GPUs of one NVLink node"
    why = _spanning_reason(table, cross_process)
    if why:
        return why
    # The rest is about this process's GPUs and its groups' members in it (other processes
    # check theirs; spanning groups' hardware was checked alike everywhere above).
    table = local_rows(table, process_index)
    if len(set(table.ordinals.tolist())) != len(table.ordinals):
        return "two mesh devices share a CUDA ordinal in this process"
    groups = sorted({tuple(o for o in g if o >= 0) for g in table.groups.tolist()})
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
