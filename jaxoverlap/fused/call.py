"""One fused custom call, emitted in one place: `emit`.

The schedule modules (`rows`, `last_dim`, `tile`, `backward`, `tma`) decide *what* a call is --
its target, settings, workspace and layouts, from `jaxoverlap.fused.policy` -- and describe it
as a `Spec`; `emit` does *how*, the same way for every target: register the extension's targets,
derive the workspace key (`site_key`) and the call tag (`_call_tag`), map the workspace across
processes where the group spans them (`xproc.prepare`, in `_table_attrs`), add the attributes
every call carries (group table, settings, timeout), thread the device's order token through the
call (`FusedOrder`) and emit the custom call (``jax.ffi.ffi_lowering``): the `_v3` target (no
token) or, in the order's token form, the `_v2` target, each's ``_knobs`` twin when a test-only
or tool-only knob is set (`knob_attrs`; production calls carry none, D17;
`jaxoverlap.fused.targets`). No other module of the package emits one (tests/test_structure.py
checks it).

**Order (issue 26, R2).** Every fused primitive has the `FusedOrder` effect, registered with JAX
as ordered and shardable: JAX threads one token per device through the ordered effects of a
program -- across jit, scan, while, cond, shard_map, remat and custom derivatives -- and `emit`
makes the call depend on it and the next token depend on the call (`ORDER_FORM`: through two
optimization barriers, or as the call's last operand and result). So XLA's schedulers see a
data edge from each fused call of a device to the next, in program order, and every process
runs its fused calls in that order (a reordering of two calls on one GPU against their order on
a peer would wait out the timeout: tile kernels take the whole device). The order is opt-in
(`ORDER_CALLS`). It orders nothing inside CONCURRENT command buffers (no buffer carries it),
which the targets are then kept out of (`jaxoverlap.runtime.register_targets`).

Also here: the group table of a call's mesh (`_group_table`, which also decides whether the
devices can run the fused kernels at all) and the custom call's row layout (`rows_major`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os

import jax
from jax._src import core
from jax._src.lib.mlir.dialects import hlo
from jax.interpreters import mlir

from jaxoverlap import runtime, topology, xproc
from jaxoverlap import target as target_lib
from jaxoverlap.fused import targets
from jaxoverlap.fused.knobs import _profile, _stall_rank, _stall_target

_ALLOWED = (  # where JAX lets an effect through (jax/_src/effects.py)
    "lowerable_effects",
    "control_flow_allowed_effects",
    "remat_allowed_effects",
    "custom_derivatives_allowed_effects",
)
try:  # private in jax 0.11 and 0.12 alike (jax/_src/effects.py); guarded for later versions
    from jax._src import effects as _effects

    _ORDERED_SETS = (_effects.ordered_effects, _effects.shardable_ordered_effects)
    _ALLOWED_SETS = tuple(getattr(_effects, name) for name in _ALLOWED)
    _Effect = _effects.Effect
except (ImportError, AttributeError):  # pragma: no cover - a jax without these sets
    _ORDERED_SETS, _ALLOWED_SETS, _Effect = (), (), object


class FusedOrder(_Effect):
    """The effect of every fused primitive: its calls on a device run in program order (the
    module docstring says how). Ordered and shardable: one token per device."""

    def __repr__(self):
        return "FusedOrder"

    __str__ = __repr__


class FusedDispatch(_Effect):
    """The unordered effect beside `FusedOrder`. It changes no lowering; it only keeps a compiled
    program off JAX's C++ fast path, which -- for ``jit(f).lower(...).compile()`` executables
    (``pxla.MeshExecutable.create_cpp_call``, jax 0.11.2 and 0.12) -- checks for unordered
    effects and host callbacks but not ordered effects, so that from the second call on it would
    run without the order token ("Execution supplied 2 arguments but compiled program expected
    3"). ``jax.jit`` itself already dispatches programs with ordered effects in Python."""

    def __repr__(self):
        return "FusedDispatch"

    __str__ = __repr__


fused_order, fused_dispatch = FusedOrder(), FusedDispatch()
for _set in _ORDERED_SETS + _ALLOWED_SETS:
    _set.add_type(FusedOrder)
for _set in _ALLOWED_SETS:
    _set.add_type(FusedDispatch)
# The order token is opt-in (JAXOVERLAP_ORDER_CALLS=1, read at import): on one H200 on 2026-12-02
# XLA's GPU compiler (jaxlib 0.11.2) crashed in PriorityFusion on a scanned two-layer training
# step with the token threaded through the fused calls (tests/gpu/test_xproc_gpu.py,
# scanned_training), and JAX dispatches any program with an effect in Python (~0.8 ms a call on
# the CPU machine). Off: no token, no effect, the `_v3` targets (the `_v1` contract of before
# issue 26 without the test-only knobs, D17).
ORDER_CALLS = os.environ.get("JAXOVERLAP_ORDER_CALLS", "") == "1"
# The fused primitives' effects when the order is on (empty where this jax lacks the private
# sets: then the calls get a fresh token each, unordered).
FUSED_EFFECTS = frozenset({fused_order, fused_dispatch}) if _ORDERED_SETS else core.no_effects


def fused_effects():
    """The effects a fused primitive's abstract eval declares now: `FUSED_EFFECTS` while
    `ORDER_CALLS` is on, else none."""
    return FUSED_EFFECTS if ORDER_CALLS else core.no_effects


# How `emit` ties a call to the order token while the order is on. "barrier" (the default): the
# `_v3` call, its first operand passed through an optimization barrier with the token, and the
# token through one with its first result after it (`_barrier`): the call waits for the token,
# the next token for the call; XLA keeps the barriers through scheduling and removes them after
# (OptimizationBarrierExpander), so they cost nothing at run time. "token": the token as the
# custom call's last operand and result (the `_v2` targets). jaxlib 0.11.2's XLA cannot compile
# the token form in a loop: its DynamicSliceFusionRewriter wraps a call whose operand is a slice
# of a loop's stacked array (the layer scan's weights) into a custom fusion, token included, and
# PriorityFusion's cost analysis then fails on the token ("Check failed: shape.IsArray() ||
# shape.IsTuple()" in ShapeUtil::ElementsInRecursive from
# GpuHloCostAnalysis::FusionCalculateUtilizations; one H200, 2026-12-02, docs/measurements.md).
# The barrier form's edge lives in the schedule only: once the barriers are removed the compiled
# program has no data edge between the calls, so whatever re-derives concurrency from data
# dependencies afterwards (CONCURRENT command buffers) does not see it -- the fused calls are kept
# out of those graphs for that reason.
ORDER_FORM = "barrier"


def _token_operand():
    """Whether a call lowered now takes the order token as an operand (a `_v2` target)."""
    return bool(fused_effects()) and ORDER_FORM == "token"


def emitted(target):
    """The name a call of ``target`` (a `targets` constant, ``_v2``) lowered now has in the
    compiled HLO (`emit`): ``target`` while the order token is an operand of the call
    (`ORDER_CALLS`, `ORDER_FORM`), else its ``_v3`` twin; the ``_knobs`` twin of that while a
    knob applies to ``target`` (`knob_attrs`). Tests and tools that look for a fused call in HLO
    text look for this name."""
    name = target if _token_operand() else targets.v3(target)
    return targets.with_knobs(name) if knob_attrs(target) else name


def _barrier(values):
    """``values`` through one ``stablehlo.optimization_barrier``: each result depends on all of
    them, and XLA removes the barrier only after scheduling (OptimizationBarrierExpander)."""
    return list(hlo.OptimizationBarrierOp(list(values)).results)


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
    facts = target_lib.live() if target is None else target
    try:
        table = topology.group_table(mesh, axis_name)
    except topology.TopologyError as e:
        return None, str(e)
    if not facts.native_loaded():
        return None, facts.native_reason()
    if facts.predicted and mesh.devices.size > facts.gpus:
        return None, (
            f"the mesh has {mesh.devices.size} devices; the target {facts.name} has "
            f"{facts.gpus} GPUs in one process"
        )
    process = 0 if facts.predicted else topology.this_process()
    why = topology.unfusable_reason(table, process_index=process, **facts.facts())
    if why:
        return None, why
    return topology.local_rows(table, process), None  # ordinals are per process


def site_key(table, comm_sms, chunks, kind):
    """The workspace key of a call (the ``site`` attribute): a hash of what every rank and every
    process knows identically -- the group table, the settings and ``kind`` (the op's target,
    operand shapes and dtype, ...) -- never a per-process counter. Calls with equal keys share
    one workspace (ffi/runtime/runtime.h: fresh jit wrappers, unrolled layers of one op); different
    ops
    and shapes never do. Two programs that contain the same op and shapes (a train and an eval
    step) share it too. Every rank must then issue their calls in one order: XLA launches
    programs from several Python threads in one order on every GPU today, and each call is
    checked (`_call_tag`, ffi/runtime/call_order.h): calls paired out of order are given up on every
    rank (NaN outputs) and reported like a timeout (`check_errors`, or the next fused call
    raises), never run on each other's data (docs/call-order.md)."""
    # A table with members in other processes: the whole mesh's groups (global ids), so that every
    # process derives the same key for the same workspace (jaxoverlap/xproc.py names it by it).
    groups = table.whole if topology.spans_processes(table) else table.groups.tolist()
    text = repr((groups, int(comm_sms), int(chunks), _profile.get()) + tuple(kind))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _call_tag(ctx, site):
    """Which fused call of its program this is (the ``call_tag`` attribute; with XLA's run id of
    the launch it names the logical call that ffi/runtime/call_order.h compares across ranks): a
    hash of
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
    )


def knob_attrs(target):
    """The test-only and tool-only knobs (`jaxoverlap.fused.knobs`) a call of ``target`` lowered
    now carries: {} when none is set -- the production target (`_v3`, or `_v2` in the token
    form), which has no knob attribute (D17) --, else both knobs, for its ``_knobs`` twin."""
    stall = int(_stall_rank.get()) if _stall_target.get() in (None, target) else -1
    profile = int(_profile.get())
    return {} if (stall, profile) == (-1, 0) else dict(stall_rank=stall, profile=profile)


def _thread_token(ctx):
    """The order token this call consumes (the last one of ``ctx``'s rule, or the rule's input)
    and a function that makes the call's token result the rule's output token."""
    tokens = ctx.tokens_out if ctx.tokens_out is not None else ctx.tokens_in
    if fused_order not in tokens.effects():
        raise AssertionError(
            f"internal: {ctx.primitive} lowers a fused call without the FusedOrder effect"
        )

    def set_out(tok):
        out = tokens.update_tokens(mlir.TokenSet({fused_order: tok}))
        if ctx.tokens_out is None:
            ctx.set_tokens_out(out)
        else:  # a second call of the same rule: chain it after the first
            ctx.tokens_out = out

    return tokens.get(fused_order), set_out


def _operands_kind(x_aval, w_aval, params):
    """What of the operands goes into the workspace key: shapes, dtype and w's layout (its GEMM
    plans differ, and a workspace's warm-up loads the GEMM kernels of its calls only)."""
    return (tuple(x_aval.shape), tuple(w_aval.shape), str(x_aval.dtype), bool(params["w_colmajor"]))


def rows_major(shape, dim):
    """The minor-to-major layout that puts dimension ``dim`` of ``shape`` major-most and keeps
    the others in order: the gathered/scattered dimension's blocks are then contiguous rows of
    ``[..., K]``. Row-major where that is already so (``dim`` 0, or only size-1 dimensions
    before it). XLA transposes to and from it where the producer or consumer cannot take it as
    is (an elementwise producer writes any layout for free)."""
    ndim = len(shape)
    if math.prod(shape[:dim]) == 1:
        return tuple(reversed(range(ndim)))
    return tuple(i for i in reversed(range(ndim)) if i != dim) + (dim,)


def row_dim(params):
    """The gathered/scattered dimension of an op's params (0 for the all-reduce)."""
    return params.get("gather_dimension", params.get("scatter_dimension", 0))


def w_layout(params):
    """w's minor-to-major layout: column-major when ``params["w_colmajor"]`` (w is the transpose
    of a row-major array: XLA then passes that array as is, and the kernel reads it as
    cuBLASLt's transposed operand), else row-major."""
    return (0, 1) if params["w_colmajor"] else (1, 0)


def row_layouts(ctx, params):
    """(operand layouts, result layouts) of a call over rows: x and its results with the
    gathered/scattered dimension major-most (`rows_major`; a result of another rank, such as the
    gathered x of a 2-D call, row-major), w as `w_layout` says."""
    x_aval = ctx.avals_in[0]
    d = row_dim(params)
    results = [rows_major(a.shape, d if a.ndim == x_aval.ndim else 0) for a in ctx.avals_out]
    return (rows_major(x_aval.shape, d), w_layout(params)), tuple(results)


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one custom call is. ``kind``: the target and what else names its workspace (operand
    shapes, dtype, layouts; `site_key`); ``workspace``: (block_bytes, partials, gather) as the
    handler sizes it (a group spanning processes maps it at lowering, `xproc.prepare`);
    ``attrs``: the target's own attributes beyond the common ones; ``scratch``: avals of extra
    results the handler uses as scratch (XLA's buffers, dropped after the call)."""

    kind: tuple
    comm_sms: int
    chunks: int
    timeout_s: float
    workspace: tuple
    operand_layouts: tuple
    result_layouts: tuple
    attrs: dict = dataclasses.field(default_factory=dict)
    scratch: tuple = ()

    @property
    def target(self):
        return self.kind[0]


def row_spec(ctx, params, target, comm_sms, chunks, workspace, **attrs):
    """The `Spec` of a call over rows of x (`row_layouts`) with operands (x, w)."""
    x_aval, w_aval = ctx.avals_in
    layouts, result_layouts = row_layouts(ctx, params)
    attrs.update(w_colmajor=int(params["w_colmajor"]))
    if target in (targets.GEMM_RS_TARGET, targets.GEMM_AR_TARGET):  # fused/last_dim.py: 1
        attrs.update(x_colmajor=0)
    return Spec(
        kind=(target, *_operands_kind(x_aval, w_aval, params)),
        comm_sms=comm_sms,
        chunks=chunks,
        timeout_s=params["config"].timeout_s,
        workspace=workspace,
        operand_layouts=layouts,
        result_layouts=result_layouts,
        attrs=attrs,
    )


def emit(ctx, table, spec, *operands):
    """The custom call ``spec`` on ``operands`` for the group ``table`` (`_group_table`);
    returns its results (without the scratch). With the order on (`ORDER_CALLS`), ordered after
    the previous fused call of the device and before the next (``ctx``'s rule outputs a token
    that depends on the call), as `ORDER_FORM` says: the token as the last operand and result
    of the `_v2` target, or the `_v3` call between two optimization barriers with the token (its
    first operand through the one before, its first result through the one after). Off (the
    default), on the `_v3` target, which takes no token. Production calls carry no knob; under
    a knob, the target's ``_knobs`` twin carries both (D17)."""
    runtime.register_targets()
    knobs = knob_attrs(spec.target)
    ordered, token_operand = bool(fused_effects()), _token_operand()
    target = emitted(spec.target)  # the one naming rule: `_v3` or `_v2`, `_knobs` under a knob
    if not token_operand:  # the workspace key names the `_v1` target, as before `_v3`
        spec = dataclasses.replace(spec, kind=(targets.v1(spec.target), *spec.kind[1:]))
    attrs = _table_attrs(
        table, spec.comm_sms, spec.chunks, spec.timeout_s, spec.kind, ctx, spec.workspace
    )
    attrs.update(**knobs, **spec.attrs)
    token = [core.abstract_token] if token_operand else []
    inner = ctx.replace(
        avals_in=[*ctx.avals_in, *token], avals_out=[*ctx.avals_out, *spec.scratch, *token]
    )
    lowering = jax.ffi.ffi_lowering(
        target,
        operand_layouts=[*spec.operand_layouts, *[()] * len(token)],
        result_layouts=[*spec.result_layouts, *[()] * len(token)],
    )
    if not ordered:
        return list(lowering(inner, *operands, **attrs))[: len(ctx.avals_out)]
    tok, set_token_out = _thread_token(ctx)
    if token_operand:
        results = list(lowering(inner, *operands, tok, **attrs))
        set_token_out(results[-1])
    else:
        first, tok = _barrier([operands[0], tok])
        results = list(lowering(inner, first, *operands[1:], **attrs))
        set_token_out(_barrier([tok, results[0]])[0])
    return results[: len(ctx.avals_out)]
