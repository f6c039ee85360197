"""Visit every jaxpr nested in a traced function and splice the jaxoverlap ops in.

Only the bodies of higher-order primitives whose semantics are "run this jaxpr" are visited
(jit, closed calls, scan, while, cond, remat, shard_map); the bodies of ``custom_jvp`` and
``custom_vjp`` functions are visited for `explain` but never changed (their derivative rules would
keep differentiating the original), and other primitives that hold jaxprs (e.g. ``pallas_call``)
are left alone.

Each replacement is traced by calling the op's public function on the candidate's operand types,
inside the same shard_map context (bound axes, manual abstract mesh, ``check_vma``) as the
candidate, so the op validates its arguments and computes its own varying-axes types exactly as if
the user had called it there. The result type must equal the replaced value's type, or the
candidate is skipped.

This module uses JAX internals (``jax._src``): jaxpr surgery has no public API. They are pinned by
the package's ``jax>=0.11.2,<0.13`` requirement and exercised by tests/test_overlap.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

from jax._src import api_util, core
from jax._src import config as jax_config
from jax._src import linear_util as lu
from jax._src import shard_map as shard_map_lib
from jax._src.interpreters import partial_eval as pe
from jax._src.mesh import Mesh, get_abstract_mesh, use_abstract_mesh
from jax.extend.core import ClosedJaxpr  # public alias; jax 0.12 merged it into Jaxpr

from jaxoverlap import fused, ops
from jaxoverlap.rewrite import gathers, patterns, reductions
from jaxoverlap.rewrite.patterns import Candidate, Match
from jaxoverlap.target import tracing_for

# Primitives whose jaxpr-valued parameters are run as they are: safe to rewrite inside.
_TRANSPARENT = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "scan", "while", "cond", "checkpoint", "remat2",
     "shard_map"}
)  # fmt: skip
# Visited for reporting only; the reason is given to every candidate inside.
_OPAQUE = {
    "custom_jvp_call": "inside a jax.custom_jvp function (its JVP rule would still use the "
    "original, so the body is left as written)",
    "custom_vjp_call": "inside a jax.custom_vjp function (its fwd/bwd rules would still use the "
    "original, so the body is left as written)",
}

_LABELS = {"remat2": "checkpoint"}


class _Rejected(Exception):
    """The op refused a candidate, or its result type differs from the replaced value's."""


@dataclasses.dataclass
class _State:
    config: object
    candidates: list[Candidate]
    scope: tuple[str, ...] = ()
    blocked: str | None = None
    target: object = None  # explain: the `jaxoverlap.target.Target` the paths are decided for
    mesh: object = None  # the innermost shard_map's mesh

    def enter(self, label: str, blocked: str | None) -> _State:
        return dataclasses.replace(
            self, scope=(*self.scope, label), blocked=self.blocked or blocked
        )


def rewrite_closed_jaxpr(closed: ClosedJaxpr, config=None, target=None):
    """``closed`` with the jaxoverlap ops spliced in, and the list of `Candidate` found.

    Must run in the context the jaxpr was traced in (inside the same shard_map trace if it was
    traced inside one), since ops at the top level are traced in the current context.
    ``target``: the `jaxoverlap.target.Target` each candidate's GPU path is decided for (None:
    this machine, without the lowering-time check of the group's devices).
    """
    state = _State(config=config, candidates=[], target=target)
    jaxpr = _rewrite_jaxpr(closed.jaxpr, state)
    if jaxpr is not closed.jaxpr:
        closed = ClosedJaxpr(jaxpr, closed.consts)
    return closed, state.candidates


def find_matches(jaxpr: core.Jaxpr, manual_axes) -> list[Match]:
    """Every candidate of ``jaxpr`` (not of its sub-jaxprs), in equation order.

    ``Match.reason`` is None for those that may be replaced (subject to the op accepting them).
    """
    g = patterns.Graph(jaxpr)
    claimed: set[int] = set()
    matches = []
    for i, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        if name == "all_gather":
            found = [gathers.match_all_gather(g, i, manual_axes)]
        elif name == "reduce_scatter" or name in patterns.SUM_PRIMS:
            found = [reductions.match_reduction(g, i, manual_axes)]
        elif name.startswith("custom_vjp_call"):
            found = gathers.custom_vjp_near_misses(g, i)
        else:
            continue
        for m in found:
            if m is None:
                continue
            if m.reason is None and (claimed & m.drop):
                m.reason = "its matmul is already being fused with another collective"
            if m.reason is None:
                claimed.update(m.drop)
            matches.append(m)
    return matches


def _order_effects(eqns, have) -> frozenset:
    """The fused ops' effects (`fused.FUSED_EFFECTS`: the order of a device's fused calls) that
    ``eqns`` have and ``have`` lacks. Spliced-in ops bring them; every enclosing jaxpr and
    equation must declare them too, since JAX threads the order token only where declared."""
    return frozenset(f for e in eqns for f in e.effects if f in fused.FUSED_EFFECTS) - have


def _with_eqns(jaxpr: core.Jaxpr, eqns) -> core.Jaxpr:
    return jaxpr.replace(eqns=eqns, effects=jaxpr.effects | _order_effects(eqns, jaxpr.effects))


def _rewrite_jaxpr(jaxpr: core.Jaxpr, state: _State) -> core.Jaxpr:
    eqns = [_rewrite_eqn(e, state) for e in jaxpr.eqns]
    if any(a is not b for a, b in zip(eqns, jaxpr.eqns, strict=True)):
        jaxpr = _with_eqns(jaxpr, eqns)

    splices: dict[int, list[core.JaxprEqn]] = {}
    dropped: set[int] = set()
    for m in find_matches(jaxpr, frozenset(get_abstract_mesh().manual_axes)):
        if m.reason is None and state.blocked:
            m.reason = state.blocked
        path = kernel = ""
        if m.reason is None:
            try:
                eqns, (path, kernel) = _op_eqns(m, state, jaxpr.eqns[m.last])
                if m.only_if_fused and not path.startswith("fused"):
                    raise _Rejected(
                        "left as written: the norm is computed per block only where the "
                        f"all_gather_matmul along K it makes runs fused, and here {path}"
                    )
                splices[m.last] = [*(jaxpr.eqns[h] for h in m.hoist), *eqns]
                dropped.update(m.drop, m.hoist)
            except _Rejected as e:
                m.reason = str(e)
        state.candidates.append(
            Candidate(
                op=m.op, rewritten=m.reason is None, reason=m.reason or "", detail=m.detail,
                location=m.location, scope=" > ".join(state.scope) or "top level",
                note=m.note, path=path, kind=m.kind, kernel=kernel,
            )
        )  # fmt: skip
    if not splices:
        return jaxpr
    new_eqns = []
    for i, eqn in enumerate(jaxpr.eqns):
        if i in splices:
            new_eqns.extend(splices[i])
        if i not in dropped:
            new_eqns.append(eqn)
    return _with_eqns(jaxpr, new_eqns)


def _rewrite_eqn(eqn: core.JaxprEqn, state: _State) -> core.JaxprEqn:
    name = eqn.primitive.name
    if name not in _TRANSPARENT and name not in _OPAQUE:
        return eqn
    label = f"jit({eqn.params['name']})" if name in ("jit", "pjit") else _LABELS.get(name, name)
    inner = state.enter(label, _OPAQUE.get(name))
    if name == "shard_map":
        inner = dataclasses.replace(inner, mesh=eqn.params["mesh"])
    context = _shard_map_context(eqn.params) if name == "shard_map" else contextlib.nullcontext()
    with context:
        params = {k: _rewrite_param(v, inner) for k, v in eqn.params.items()}
    if all(params[k] is eqn.params[k] for k in params):
        return eqn
    inner_jaxprs = [
        j
        for v in params.values()
        for j in (v if isinstance(v, (tuple, list)) else (v,))
        if isinstance(j, (core.Jaxpr, ClosedJaxpr))
    ]
    added = frozenset().union(*(j.effects for j in inner_jaxprs)) & fused.FUSED_EFFECTS
    return eqn.replace(params=params, effects=eqn.effects | (added - eqn.effects))


def _rewrite_param(value, state: _State):
    if isinstance(value, core.Jaxpr):
        return _rewrite_jaxpr(value, state)
    if isinstance(value, ClosedJaxpr):
        jaxpr = _rewrite_jaxpr(value.jaxpr, state)
        return value if jaxpr is value.jaxpr else ClosedJaxpr(jaxpr, value.consts)
    if isinstance(value, (tuple, list)) and any(
        isinstance(v, (core.Jaxpr, ClosedJaxpr)) for v in value
    ):
        new = [_rewrite_param(v, state) for v in value]
        if all(a is b for a, b in zip(new, value, strict=True)):
            return value
        return type(value)(new)
    return value


@contextlib.contextmanager
def _shard_map_context(params):
    """The context shard_map traces its body in: bound axes, manual mesh, ``check_vma``."""
    mesh, manual = params["mesh"], params["newly_manual_axes"]
    with (
        shard_map_lib._extend_axis_env(mesh, manual),
        use_abstract_mesh(shard_map_lib._as_manual_mesh(mesh, manual)),
        jax_config._check_vma(params["check_vma"]),
    ):
        yield


def _op_fn(op: str):
    return getattr(ops, op)


def _op_eqns(m: Match, state: _State, anchor: core.JaxprEqn):
    """The equations computing ``m.build`` into ``m.outs``, traced in the current context, and
    the path the op takes on the target's GPUs with its kernel (`_gpu_path`)."""
    config = state.config
    fn = functools.partial(_op_fn(m.op), config=config)
    in_avals = [a.aval for a in m.inputs]

    def call(*args):
        return list(m.build(fn, *args))

    dbg = api_util.debug_info("jaxoverlap.overlap", call, in_avals, {})
    try:
        with tracing_for(state.target):
            tiny, out_avals, consts = pe.trace_to_jaxpr_dynamic(
                lu.wrap_init(call, debug_info=dbg), in_avals
            )
    except (TypeError, ValueError, NotImplementedError) as e:
        raise _Rejected(f"jaxoverlap.{m.op} does not accept it: {_first_line(e)}") from None
    for new, out in zip(out_avals, m.outs, strict=True):
        old = out.aval
        if (new.shape, new.dtype, new.mat) != (old.shape, old.dtype, old.mat):
            raise _Rejected(
                f"jaxoverlap.{m.op} would return {new.str_short()} where the original has "
                f"{old.str_short()} (a different varying-axes type); left as written"
            )
    # (A collective's named-axis effect is one the replaced collective had too; the fused ops'
    # own effects are declared up the enclosing jaxprs, `_order_effects`.)
    named = getattr(core, "NamedAxisEffect", ())
    effects = {
        f
        for e in tiny.eqns
        for f in e.effects
        if not isinstance(f, named) and f not in fused.FUSED_EFFECTS
    }
    if consts or tiny.constvars or effects:
        raise _Rejected(f"jaxoverlap.{m.op} traced to equations with constants or effects")
    env = dict(zip(tiny.invars, m.inputs, strict=True))
    env.update(zip(tiny.outvars, m.outs, strict=True))
    sub = lambda vs: [env.get(v, v) if isinstance(v, core.Var) else v for v in vs]  # noqa: E731
    eqns = [
        e.replace(invars=sub(e.invars), outvars=sub(e.outvars), source_info=anchor.source_info)
        for e in tiny.eqns
    ]
    return eqns, _gpu_path(m.op, tiny, state)


def _gpu_path(op: str, tiny: core.Jaxpr, state: _State) -> tuple[str, str]:
    """``(path, kernel)``. The path, ``"fused..."`` or ``"reference: <why>"``: what the op's CUDA
    lowering decides for its own avals and params (`jaxoverlap.fused.unsupported_reason`, the
    function the lowering calls) and, for a target and a concrete mesh, the check of the group's
    devices that lowering makes (`jaxoverlap.fused.call.group_decision`). The kernel, for explain
    where the path is fused: the custom call lowering emits (`jaxoverlap.fused.dispatch.kernel`),
    else ``""``."""
    # several weights of one gathered x: the all_gather_matmul variant that returns x
    eqn = next((e for e in tiny.eqns if e.primitive.name in (op, op + "_keep")), None)
    if eqn is None or eqn.params["config"].backend == "xla":  # (several weights: plain ops)
        return "reference: backend='xla'", ""
    params, target = eqn.params, state.target
    n = math.prod(core.get_axis_env().axis_size(a) for a in params["axis_name"])
    x, w = (v.aval for v in eqn.invars)
    looked = target.lookups if target is not None else None
    if looked is not None:
        looked.clear()
    keep = eqn.primitive.name.endswith("_keep")
    reason = fused.unsupported_reason(op, x, w, params, n, keep_gathered=keep, target=target)
    if reason is None and target is not None:
        if isinstance(state.mesh, Mesh):
            _, reason = fused.group_decision(state.mesh, params["axis_name"], target)
            if reason is not None and params["config"].backend == "fused":
                return f"error at lowering: backend='fused' cannot run here: {reason}", ""
        elif not target.predicted:
            path = "fused, unless the group's devices are not NVLink peers (checked at lowering)"
            return path, _kernel(op, x, w, params, n, keep, target)
        elif n > target.gpus:  # (explain called inside a shard_map body: no concrete mesh)
            reason = f"the group has {n} devices; the target {target.name} has {target.gpus} GPUs"
    if reason is not None:
        return f"reference: {reason}", ""
    entry = next((e for e in (looked or ()) if e), None)
    if params["config"].backend == "fused":
        path = "fused (backend='fused')"
    elif entry is not None:
        path = (f"fused (tuned: {entry['ms_fused']:.3f} ms fused vs {entry['ms_xla']:.3f} ms "
                "XLA)")  # fmt: skip
    else:
        path = "fused (untuned: inside the conservative rule for backend='auto')"
    return path, _kernel(op, x, w, params, n, keep, target)


def _kernel(op, x, w, params, n, keep, target) -> str:
    """explain's (``target`` set): the custom call lowering emits for a fused path, named."""
    if target is None:  # (overlap: nothing prints it)
        return ""
    name, how = fused.dispatch.kernel(op, x, w, params, n, keep, target)
    return f"{name} ({how})"


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
