"""A fused call's attributes: the group table of its mesh (`_group_table`, which also decides
whether the devices can run the fused kernels at all), the workspace key (`site_key`), the call
tag (`_call_tag`), the attributes every custom call carries (`_table_attrs`, which maps a
workspace across processes where the group spans them: `jaxoverlap/xproc.py`). Split from
`jaxoverlap.fused`, which re-exports these names."""

from __future__ import annotations

import hashlib

from jaxoverlap import runtime, topology, xproc
from jaxoverlap._knobs import _profile, _stall_rank, _stall_target


class FusedUnavailable(Exception):
    """The fused path cannot run for this call; the message says why."""


def _group_table(ctx, axis_name):
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if mesh is None:
        raise FusedUnavailable("not lowered inside shard_map (no mesh in the lowering context)")
    table, why = group_decision(mesh, axis_name)
    if why:
        raise FusedUnavailable(why)
    return table


def group_decision(mesh, axis_name, target=None):
    """``(this process's rows of the group table, None)`` when the devices of ``mesh`` can run
    the fused kernels over ``axis_name``, else ``(None, why not)``. ``target``: a
    `jaxoverlap.target.Target` whose facts to decide from (None: this machine's; explain)."""
    from jaxoverlap import target as targets

    facts = targets.live() if target is None else target
    try:
        table = topology.group_table(mesh, axis_name)
    except topology.TopologyError as e:
        return None, str(e)
    if target is None and runtime.native() is None:
        return None, runtime.unavailable_reason()
    if target is not None and not target.native_loaded():
        return None, target.native_reason()
    if target is not None and target.predicted and mesh.devices.size > target.gpus:
        return None, (
            f"the mesh has {mesh.devices.size} devices; the target {target.name} has "
            f"{target.gpus} GPUs in one process"
        )
    process = 0 if target is not None and target.predicted else topology.this_process()
    why = topology.unfusable_reason(table, process_index=process, **facts.facts())
    if why:
        return None, why
    return topology.local_rows(table, process), None  # ordinals are per process


def site_key(table, comm_sms, chunks, kind):
    """The workspace key of a call (the ``site`` attribute): a hash of what every rank and every
    process knows identically -- the group table, the settings and ``kind`` (the op's target,
    operand shapes and dtype, ...) -- never a per-process counter. Calls with equal keys share
    one workspace (ffi/runtime.h: fresh jit wrappers, unrolled layers of one op); different ops
    and shapes never do. Two programs that contain the same op and shapes (a train and an eval
    step) share it too. Every rank must then issue their calls in one order: XLA launches
    programs from several Python threads in one order on every GPU today, and each call is
    checked (`_call_tag`, ffi/call_order.h): calls paired out of order are given up on every
    rank (NaN outputs) and reported like a timeout (`check_errors`, or the next fused call
    raises), never run on each other's data (docs/call-order.md)."""
    # A table with members in other processes: the whole mesh's groups (global ids), so that every
    # process derives the same key for the same workspace (jaxoverlap/xproc.py names it by it).
    groups = table.whole if topology.spans_processes(table) else table.groups.tolist()
    text = repr((groups, int(comm_sms), int(chunks), _profile.get()) + tuple(kind))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _call_tag(ctx, site):
    """Which fused call of its program this is (the ``call_tag`` attribute; with XLA's run id of
    the launch it names the logical call that ffi/call_order.h compares across ranks): a hash of
    the module's name and how many calls with the same workspace key were lowered before it in
    that module. The same on every device (one lowering per program) and in every process (no
    counter, so compilation caches still hit)."""
    if ctx is None:
        return 0
    module = ctx.module_context
    try:
        name = str(module.module.operation.attributes["sym_name"])
        counts = module.cached_primitive_lowerings.setdefault(("jaxoverlap", "call_tags"), {})
    except (AttributeError, KeyError):  # another jax's lowering context: run ids alone
        return 0
    nth = counts.get(site, 0)
    counts[site] = nth + 1
    text = repr((name, int(site), nth))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _table_attrs(table, comm_sms, chunks, timeout_s, kind=(), ctx=None, spec=None):
    """The attributes of a fused call. ``spec``: its workspace as the handler sizes it,
    (block_bytes, partials, gather area), which a group spanning processes maps now
    (`xproc.prepare`)."""
    site = site_key(table, comm_sms, chunks, kind)
    if topology.spans_processes(table):
        if spec is None:
            raise FusedUnavailable(f"{kind[:1]} has no workspace across processes")
        xproc.prepare(table, site, spec, (*kind, int(comm_sms), int(chunks), _profile.get()))
    return dict(
        site=site,
        call_tag=_call_tag(ctx, site),
        ordinals=table.ordinals,
        ranks=table.ranks,
        groups=table.groups.reshape(-1),
        n=int(table.n),
        comm_sms=int(comm_sms),
        chunks=int(chunks),
        timeout_s=float(timeout_s),
        stall_rank=int(_stall_rank.get()) if _stall_target.get() in (None, *kind[:1]) else -1,
    )


def _operands_kind(x_aval, w_aval, params):
    """What of the operands goes into the workspace key: shapes, dtype and w's layout (its GEMM
    plans differ, and a workspace's warm-up loads the GEMM kernels of its calls only)."""
    return (tuple(x_aval.shape), tuple(w_aval.shape), str(x_aval.dtype), bool(params["w_colmajor"]))
