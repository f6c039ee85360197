"""Fused calls whose group spans processes (one process per GPU): the decision and the workspace.

Both go through the ``jax.distributed`` key-value store, the coordinator every multi-process JAX
job already has (no MPI, no NVSHMEM, no server of ours):

* **Facts** (`decide`): once per process, what the group rules need about its GPUs -- the host,
  each local device's PCI bus id and compute capability, and which GPUs it sees over NVLink --
  under ``jaxoverlap/v1/facts/<process>``. A spanning group's decision reads its processes'
  facts and is a pure function of them (`topology.cross_process_reason`), so every process
  decides the same.
* **Decisions** (`agree`): where a process's own data could differ from another's (its tuning
  cache), the first value any process offered, adopted by all.
* **Workspace** (`prepare`, at lowering, when the sizes are known): this process allocates its
  member's buffers and exports them by CUDA IPC (``_native.ws_export``), publishes the handles
  under a key that every process derives alike (the op, shapes, settings and the members'
  global device ids; never a per-process counter), and maps each peer's
  (``_native.ws_import``). Done once per workspace and process; later lowerings of the same op
  find it mapped.

Every wait is bounded (`SETUP_TIMEOUT_S`, ``JAXOVERLAP_SETUP_TIMEOUT_S``; compilation on a peer
can take minutes) and names the process it waited for. A program that is not lowered in this
process (a deserialized ``jax.export``) cannot run a spanning call: the handler says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket

import numpy as np

from jaxoverlap import runtime, topology

PREFIX = "jaxoverlap/v1"
SETUP_TIMEOUT_S = float(os.environ.get("JAXOVERLAP_SETUP_TIMEOUT_S", "300"))

_published = False
_facts: dict[int, dict] = {}
_prepared: set = set()
_agreed: dict[str, object] = {}


class CrossProcessError(RuntimeError):
    """A peer process did not publish what a spanning group needs in time, or mapping failed."""


def client():
    """The ``jax.distributed`` key-value client, or None without ``jax.distributed``."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - private module moved
        return None
    return getattr(distributed.global_state, "client", None)


def _host():
    """This machine: the hostname and the kernel's boot id (two containers of one host share
    the boot id and the NVLink domain; two hosts never share both)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def local_facts(local_devices, native=None):
    """What this process publishes about ``local_devices`` (`topology.cross_process_reason`)."""
    native = native or runtime.native()
    visible = [(int(o), str(b)) for o, b in native.devices()]
    bus_of = dict(visible)
    facts = {"host": _host(), "devices": {}, "links": {}}
    for d in local_devices:
        ordinal = topology._ordinal(d)
        bus = bus_of.get(ordinal, f"ordinal-{ordinal}")
        facts["devices"][str(int(d.id))] = {
            "bus": bus,
            "cc": list(runtime.compute_capability(ordinal)),
        }
        links = {}
        for other, other_bus in visible:
            if other != ordinal:
                link = runtime.peer_link(ordinal, other)
                links[other_bus] = bool(link["access"] and link["native_atomics"])
        facts["links"][bus] = links
    return facts


def _get(kv, key, what, timeout_s=None):
    timeout_s = SETUP_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return kv.blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:  # the client raises XlaRuntimeError (DEADLINE_EXCEEDED) on timeout
        raise CrossProcessError(
            f"jaxoverlap: waited {timeout_s:.0f} s for {what} (key-value store key {key!r}) and "
            f"it never came: that process is not lowering the same program, was started late, "
            f"or died. Set JAXOVERLAP_SETUP_TIMEOUT_S to wait longer. ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def _set(kv, key, value):
    try:
        kv.key_value_set(key, value, allow_overwrite=True)
    except TypeError:  # older clients: no allow_overwrite
        kv.key_value_set(key, value)


def decide(groups, *, kv=None, process_index=None, local_devices=None):
    """The reason the spanning ``groups`` (`topology.spanning_groups`) cannot fuse, or None.
    Publishes this process's facts first (once), then reads those of every process involved."""
    global _published
    import jax

    kv = kv or client()
    if kv is None:
        return "no jax.distributed key-value store to map a workspace across processes through"
    me = topology.this_process() if process_index is None else process_index
    if not _published:
        if local_devices is None:  # jax.local_devices(), as the group table sees processes
            local_devices = [d for d in jax.devices() if topology._process(d) == me]
        facts = local_facts(local_devices)
        _set(kv, f"{PREFIX}/facts/{me}", json.dumps(facts))
        _facts[me] = facts
        _published = True
    for p in sorted({p for _, procs in groups for p in procs}):
        if p not in _facts:
            text = _get(kv, f"{PREFIX}/facts/{p}", f"process {p}'s GPU facts")
            _facts[p] = json.loads(text)
    return topology.cross_process_reason(groups, _facts)


def agree(name, value, *, kv=None):
    """The value of ``name`` that every process uses: the first one any process offered.
    Each process offers its own ``value`` (a JSON-able decision, e.g. a tuning entry read from
    its own cache) and adopts whichever the store kept -- a key-value set without overwrite
    fails when the key exists -- so no process ever waits for another, and a decision that
    differed between processes (caches on different disks, one written mid-job) cannot make
    one lower a fused call while the other lowers XLA's collectives. Once agreed, a name keeps
    its value for the job."""
    if name in _agreed:
        return _agreed[name]
    kv = kv or client()
    if kv is None:
        return value
    key = f"{PREFIX}/agree/{name}"
    try:
        kv.key_value_set(key, json.dumps(value))
    except Exception:  # noqa: BLE001 - ALREADY_EXISTS: another process offered first
        pass
    text = _get(kv, key, f"the agreed value of {name}", timeout_s=60)
    _agreed[name] = json.loads(text)
    return _agreed[name]


def exchange_key(ids, what):
    """The key-value store name of a workspace: the same in every process (global ids, op,
    shapes, settings), different for different workspaces."""
    text = repr((tuple(int(i) for i in ids), tuple(what)))
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def prepare(table, site, spec, what, *, kv=None, native=None):
    """Maps the workspace of every local row of ``table`` (local rows; `topology.local_rows`)
    whose group spans processes. ``spec``: (block_bytes, partials, gather[, exact]), as the
    handler derives them from its buffers (exact: not shared by size class; the tile schedule's);
    ``what``: the op, shapes and settings (`exchange_key`). The native side maps every key to its
    pool's workspace (ffi/runtime/ws_class.h: shared by size class unless exact) exactly as the
    handler will, so a second key of a class exports the same buffers and finds its peers mapped."""
    native = native or runtime.native()
    block_bytes, partials, gather = (int(spec[0]), bool(spec[1]), bool(spec[2]))
    exact = bool(spec[3]) if len(spec) > 3 else False
    for i in range(len(table.ordinals)):
        group = [int(v) for v in table.groups[i]]
        if min(group) >= 0:
            continue
        rank = int(table.ranks[i])
        key = (int(site), tuple(group), block_bytes, partials, gather)
        if key in _prepared:
            continue
        kv = kv or client()
        if kv is None:
            raise CrossProcessError("jaxoverlap: a group spans processes without jax.distributed")
        ids = [int(v) for v in table.group_ids[i]]
        procs = [int(p) for p in table.group_processes[i]]
        key_what = (int(site), *what, block_bytes, partials, gather)
        name = f"{PREFIX}/ws/{exchange_key(ids, key_what)}"
        handles = native.ws_export(int(site), group, block_bytes, partials, gather, rank, exact)
        _set(kv, f"{name}/{rank}", bytes(handles).hex())
        for r in range(len(group)):
            if r == rank:
                continue
            what_for = f"process {procs[r]} (rank {r} of the group of device ids {ids})"
            text = _get(kv, f"{name}/{r}", f"the workspace handles of {what_for}")
            try:
                native.ws_import(
                    int(site), group, block_bytes, partials, gather, r, bytes.fromhex(text), exact
                )
            except RuntimeError as e:
                raise CrossProcessError(f"jaxoverlap: {what_for}: {e}") from None
        _prepared.add(key)


def spec_bytes(rows, cols, dtype):
    """Bytes of a ``rows x cols`` block of ``dtype`` (the handlers' block_bytes)."""
    return int(rows) * int(cols) * np.dtype(dtype).itemsize
