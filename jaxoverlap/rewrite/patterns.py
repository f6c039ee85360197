"""Which matmul/collective pairs of one jaxpr the jaxoverlap ops can replace, and why not the rest.

A *candidate* is a matmul (``dot_general``) connected to a collective in the same jaxpr:

* ``dot_general -> [between] -> reduce_scatter`` (``lax.psum_scatter``) -> ``matmul_reduce_scatter``
* ``dot_general -> [between] -> psum``           (``lax.psum``)         -> ``matmul_all_reduce``
* ``all_gather -> [between] -> dot_general(s)``  (gathered value is x)  -> ``all_gather_matmul``

"Matmul" is any ``dot_general`` that is a 2-D matmul after reshaping (`views.dot_view`): x
contracted on its trailing dims, N-D weights in any layout. "Between" are up to `MAX_BETWEEN`
single-use equations. A cast, a reshape or a bias add between the pair is moved across the
collective where that keeps the result within dtype tolerance (the rules are in `_move_back`
and `gathers`); anything else makes the pair a *near miss*, listed with the equation in between
and how to move it. Every rule that says no names its reason; `Candidate` carries it to
`jaxoverlap.explain`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jax._src import core, source_info_util
from jax._src.config import _check_vma as check_vma
from jax.extend.core import ClosedJaxpr

from jaxoverlap.rewrite import views

SUM_PRIMS = ("psum_invariant", "psum")  # psum is psum_invariant under check_vma=True
COLLECTIVES = frozenset({*SUM_PRIMS, "reduce_scatter", "all_gather", "all_to_all", "ppermute"})
MAX_BETWEEN = 4  # equations searched between a matmul and its collective

# How to move an equation found between a matmul and its reduction, for near-miss reasons.
HINTS = {
    "mul": "scale after the collective instead (a scale by a replicated value commutes with it)",
    "div": "divide after the collective instead (by a replicated value it commutes with it)",
    "neg": "negate after the collective",
    "pvary": "the matmul's operands are both replicated; make one of them sharded",
}
LINEAR = frozenset({"reduce_sum", "slice", "squeeze", "broadcast_in_dim", "expand_dims", "pad",
                    "dynamic_slice", "rev", "select_n", "concatenate"})  # fmt: skip
OTHER = (
    "the ops compute the collective of x @ w itself, and this does not commute with the sum; "
    "apply it after the collective"
)
GATHER_HINT = (
    "apply it before the all_gather, on the local rows: an elementwise op, or a row-wise one "
    "such as a norm for a gather of rows, commutes with the gather (and costs 1/n there)"
)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One matmul/collective pair found by `jaxoverlap.overlap`, and what became of it.

    Attributes:
      op: the jaxoverlap op that would replace the pair.
      rewritten: whether it was replaced.
      reason: why not (empty when rewritten).
      detail: the pair, e.g. ``f32[64,128] @ f32[128,256] -> psum_scatter(('tp',), dim 0)``.
      location: the user source line of the collective (or of the matmul for all_gather).
      scope: the nesting it was found in, outermost first, e.g. ``jit > shard_map > scan``.
      note: what the rewrite did besides swapping the pair (moved a bias, reshaped a weight...).
      path: for a rewrite, the path the op takes on this machine's GPUs: ``"fused"`` or
        ``"reference: <why>"`` (from `jaxoverlap.fused.unsupported_reason`).
      kind: ``"candidate"``; ``"near miss"`` (something between the pair stops it);
        ``"out of scope"`` (a pattern the ops do not implement, e.g. an FSDP weight gather).
    """

    op: str
    rewritten: bool
    reason: str
    detail: str
    location: str
    scope: str
    note: str = ""
    path: str = ""
    kind: str = "candidate"

    def __str__(self):
        status = "rewritten" if self.rewritten else ("near miss" if self.kind == "near miss"
                                                     else "skipped")  # fmt: skip
        line = f"{status:9} {self.op}: {self.detail}  [{self.scope}; {self.location}]"
        if not self.rewritten:
            return f"{line}\n          why: {self.reason}"
        note = f"\n          does: {self.note}" if self.note else ""
        return f"{line}{note}\n          path: {self.path}"


@dataclasses.dataclass
class Match:
    """A candidate inside one jaxpr: which equations it replaces and how to compute them.

    ``build(op_fn, *inputs)`` returns the values replacing ``outs``; the walk traces it in the
    candidate's shard_map context, splices its equations in at ``last`` and drops ``drop``.
    """

    op: str
    first: int  # index of the earliest equation of the pair
    last: int  # where the op's equations go (every input is defined before it)
    drop: frozenset[int]
    inputs: tuple
    outs: tuple
    build: Callable | None
    detail: str
    location: str
    reason: str | None = None
    note: str = ""
    kind: str = "candidate"


class NearMiss(Exception):
    """Something between the pair cannot be moved across the collective; the message says what."""


def short(atom) -> str:
    return atom.aval.str_short(short_dtypes=True)


def where(eqn) -> str:
    return source_info_util.summarize(eqn.source_info)


def hint(eqn) -> str:
    """How to move ``eqn`` out from between a matmul and its reduce-scatter/psum."""
    name = eqn.primitive.name
    if name in LINEAR:
        return (
            f"the ops have no form with a {name} between the matmul and the collective; apply "
            "it after the collective (being linear, after a psum it computes the same)"
        )
    return HINTS.get(name, OTHER)


def group_size(eqn) -> int:
    return int(eqn.params.get("axis_size") or 0) or 1


def collective_problem(eqn, manual_axes) -> str | None:
    """Why this collective is not the one the ops perform over shard_map axes."""
    p = eqn.params
    names = p["axes"] if eqn.primitive.name in SUM_PRIMS else p["axis_name"]
    if p.get("axis_index_groups") is not None:
        return "axis_index_groups is set (the ops communicate over whole mesh axes)"
    if "tiled" in p and not p["tiled"]:
        return "tiled=False (the ops implement the tiled collective)"
    if len(eqn.invars) != 1:
        return "the collective reduces several values at once"
    for name in names:
        if isinstance(name, int):
            return f"the collective also reduces over positional axis {name}"
        if name not in manual_axes:
            return f"axis {name!r} is not a manual shard_map axis here (vmap or pmap axis?)"
    return None


def collective_desc(eqn) -> str:
    p = eqn.params
    if eqn.primitive.name in SUM_PRIMS:
        return f"psum({tuple(p['axes'])})"
    if eqn.primitive.name == "all_gather":
        return f"all_gather({tuple(p['axis_name'])}, dim {p['all_gather_dimension']})"
    return f"psum_scatter({tuple(p['axis_name'])}, dim {p['scatter_dimension']})"


class Graph:
    """Producers and uses of the variables of one jaxpr."""

    def __init__(self, jaxpr: core.Jaxpr):
        self.jaxpr, self.eqns = jaxpr, jaxpr.eqns
        self.producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
        self.uses = Counter(v for e in jaxpr.eqns for v in e.invars if isinstance(v, core.Var))
        self.uses.update(v for v in jaxpr.outvars if isinstance(v, core.Var))
        self.users: dict = {}
        for i, e in enumerate(jaxpr.eqns):
            for v in e.invars:
                if isinstance(v, core.Var):
                    self.users.setdefault(v, []).append(i)

    def made_by(self, v, *names):
        j = self.producer.get(v) if isinstance(v, core.Var) else None
        return j if j is not None and self.eqns[j].primitive.name in names else None

    def defined_before(self, atom, i) -> bool:
        return not isinstance(atom, core.Var) or self.producer.get(atom, -1) < i


def walkable(eqn) -> bool:
    """An equation the search may look through (to list near misses): one result, no
    collective, no sub-jaxprs except a custom_jvp function's (``jax.nn.relu`` is one)."""
    name = eqn.primitive.name
    nested = any(isinstance(v, (core.Jaxpr, ClosedJaxpr)) for v in eqn.params.values())
    if len(eqn.outvars) != 1 or name in COLLECTIVES | {"dot_general"}:
        return False
    return not nested or name == "custom_jvp_call"


def eqn_name(eqn) -> str:
    """The primitive, with the function's name for a custom_jvp call."""
    name = eqn.primitive.name
    body = eqn.params.get("call_jaxpr")
    func = getattr(getattr(body, "debug_info", None), "func_name", None)
    return f"{name} ({func})" if name.startswith("custom_") and func else name


def find_matches(jaxpr: core.Jaxpr, manual_axes) -> list[Match]:
    """Every candidate of ``jaxpr`` (not of its sub-jaxprs), in equation order.

    ``Match.reason`` is None for those that may be replaced (subject to the op accepting them).
    """
    from jaxoverlap.rewrite import gathers  # its helpers import this module

    g = Graph(jaxpr)
    claimed: set[int] = set()
    matches = []
    for i, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        if name == "all_gather":
            found = [gathers.match_all_gather(g, i, manual_axes)]
        elif name == "reduce_scatter" or name in SUM_PRIMS:
            found = [_match_reduction(g, i, manual_axes)]
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


ROUNDED = "the matmul's wider preferred_element_type, cast straight back, is the op's rounding"


def rounds_back(g: Graph, j) -> int | None:
    """The index of the cast that takes dot ``j``'s wider ``preferred_element_type`` result
    straight back to the operand dtype (its only use), else None."""
    dot, (out,) = g.eqns[j], g.eqns[j].outvars
    xdt = dot.invars[0].aval.dtype
    users = g.users.get(out, [])
    if out.aval.dtype == xdt or len(users) != 1 or g.uses[out] != 1:
        return None
    e = g.eqns[users[0]]
    ok = e.primitive.name == "convert_element_type" and e.outvars[0].aval.dtype == xdt
    return users[0] if ok else None


def _path_back(g: Graph, v, depth):
    """``[(dot index, None), (index, operand on the path), ...]`` from a ``dot_general`` to the
    producer of ``v``, through single-use walkable equations, or None."""
    j = g.producer.get(v) if isinstance(v, core.Var) else None
    if j is None:
        return None
    if g.eqns[j].primitive.name == "dot_general":
        return [(j, None)]
    if depth == 0 or not walkable(g.eqns[j]):
        return None
    for a in g.eqns[j].invars:
        if isinstance(a, core.Var) and g.uses[a] == 1:
            path = _path_back(g, a, depth - 1)
            if path is not None:
                return [*path, (j, a)]
    return None


def _match_reduction(g: Graph, i, manual_axes) -> Match | None:
    coll = g.eqns[i]
    path = _path_back(g, coll.invars[0], MAX_BETWEEN)
    if path is None:
        return None
    (j, _), between = path[0], path[1:]
    dot = g.eqns[j]
    x_pos = views.x_position(dot)
    x, w = dot.invars[x_pos], dot.invars[1 - x_pos]
    rs = coll.primitive.name == "reduce_scatter"
    op = "matmul_reduce_scatter" if rs else "matmul_all_reduce"
    axes = tuple(coll.params["axis_name"] if rs else coll.params["axes"])
    shown = "".join(f" -> {g.eqns[b].primitive.name}" for b, _ in between)
    m = Match(
        op, j, i, frozenset((j, *(b for b, _ in between), i)), (x, w), (coll.outvars[0],), None,
        detail=f"{short(x)} @ {short(w)}{shown} -> {collective_desc(coll)}",
        location=where(coll),
    )  # fmt: skip
    rounded = bool(between) and between[0][0] == rounds_back(g, j)
    view, m.reason = views.dot_view(dot, x_pos, rounded)
    if view is not None and view.describe(w.aval) == "w.T":
        m.detail = m.detail.replace(f"@ {short(w)}", f"@ {short(w)}.T", 1)
    m.reason = m.reason or collective_problem(coll, manual_axes)
    if m.reason is None and g.uses[dot.outvars[0]] != 1:
        m.reason = "the matmul result is also used elsewhere (the ops do not expose it)"
    if m.reason is not None:
        return m
    n = group_size(coll) if rs else 1
    d = coll.params["scatter_dimension"] if rs else None
    rest = between[1:] if rounded else between
    pair = None if rounded else _added_matmul(g, rest, j, view)
    if pair is not None:  # x1 @ w1 + x2 @ w2 (a parallel block): one op over [x1, x2] along K
        k2, view2 = pair
        x2, w2 = g.eqns[k2].invars[int(view2.swapped)], g.eqns[k2].invars[1 - int(view2.swapped)]
        m.inputs, m.drop, rest = (x, w, x2, w2), m.drop | {k2}, rest[1:]
    try:
        steps, extras, notes, d = _move_back(g, rest, d, n, axes)
    except NearMiss as e:
        m.kind, m.reason = "near miss", str(e)
        return m
    op_shape = (*view.lead, math.prod(view.n_shape))
    unswapped = (*view.lead, *view.n_shape)
    kwargs = dict(axis_name=axes)
    du = None if d is None else view.unswapped_dim(d)
    if rs:
        d_op = views.map_dim(unswapped, op_shape, du, n)
        if d_op is None:
            m.reason = (f"it scatters result dimension {d}, a weight dimension other than the "
                        "first, which is not a block of the flattened [K, N] matmul")  # fmt: skip
            return m
        kwargs["scatter_dimension"] = d_op
    local_unswapped = views.local(unswapped, du, n)
    if view.reshaped:
        notes.insert(0, f"matmul as x [..., K] @ {view.describe(w.aval)}")
    if rounded:
        notes.insert(0, ROUNDED)

    if pair is not None:
        notes.insert(0, "the sum of two matmuls is one op over x and w concatenated along K")
    npair = len(m.inputs)

    def build(op_fn, *args):
        (x, w, *xw2), extra = args[:npair], args[npair:]
        x, w = view.x2(x), view.w2(w)
        if xw2:
            x = jnp.concatenate([x, pair[1].x2(xw2[0])], axis=-1)
            w = jnp.concatenate([w, pair[1].w2(xw2[1])], axis=0)
        y = view.out_local(op_fn(x, w, **kwargs), local_unswapped)
        for step in steps:
            y = step(y, extra)
        return [y]

    m.inputs, m.build, m.note = (*m.inputs, *extras), build, "; ".join(notes)
    return m


def _added_matmul(g: Graph, between, j, view):
    """``(index, view)`` of a second matmul whose result the first equation of ``between`` adds
    to dot ``j``'s (same result layout, single use), else None."""
    if not between or g.eqns[between[0][0]].primitive.name != "add":
        return None
    e = g.eqns[between[0][0]]
    other = e.invars[1] if e.invars[0] is between[0][1] else e.invars[0]
    k = g.made_by(other, "dot_general")
    if k is None or k == j or g.uses[other] != 1:
        return None
    view2, why = views.dot_view(g.eqns[k])
    same = view2 is not None and (view2.lead, view2.n_shape, view2.swapped) == (
        view.lead, view.n_shape, view.swapped)  # fmt: skip
    dtypes = {a.aval.dtype for a in (*g.eqns[j].invars, *g.eqns[k].invars)}
    return (k, view2) if same and not why and len(dtypes) == 1 else None


def _move_back(g: Graph, between, d, n, axes):
    """Steps that redo ``between`` after the collective, walking back from it.

    Returns ``(steps, extra inputs, notes, d at the matmul's result)``, ``d`` the scattered
    dimension (None for psum), or raises `NearMiss`. A cast, transpose or reshape moves across
    unchanged (the sum then runs in the matmul's dtype: within the tolerance of the narrower
    dtype). A bias ``c`` added on every rank adds ``psum(c)`` after the collective (``n * c``
    for a replicated bias): it must be constant along the scattered dimension.
    """
    steps, extras, notes = [], [], []
    for b, src in reversed(between):
        e = g.eqns[b]
        name, (out,) = e.primitive.name, e.outvars
        after = views.local(out.aval.shape, d, n)
        why = f"a {eqn_name(e)} ({where(e)}) between the matmul and the collective: "
        if name == "convert_element_type" and jnp.issubdtype(out.aval.dtype, jnp.floating):
            dt = out.aval.dtype
            steps.append(lambda y, _, dt=dt: lax.convert_element_type(y, dt))
            notes.append(f"cast to {dt} moved after the collective")
        elif name == "transpose":
            perm = tuple(e.params["permutation"])
            d = None if d is None else perm[d]
            steps.append(lambda y, _, perm=perm: jnp.transpose(y, perm))
            notes.append("transpose moved after the collective")
        elif name == "reshape" and e.params.get("dimensions") is None:
            if d is not None:
                d = views.map_dim(out.aval.shape, src.aval.shape, d, n)
                if d is None:
                    raise NearMiss(why + "it moves the scattered dimension; scatter first")
            steps.append(lambda y, _, s=after: y.reshape(s))
            notes.append("reshape moved after the collective")
        elif name in ("add", "sub"):
            other = e.invars[1] if e.invars[0] is src else e.invars[0]
            bias, keep = _bias_source(g, other, out.aval.ndim)
            if bias is None or (d is not None and keep and keep[d] != 1):
                raise NearMiss(why + "the added value varies along the scattered dimension (or "
                               "is not a broadcast bias); add it after the collective")  # fmt: skip
            k = len(extras)
            extras.append(bias)
            op = "rsub" if (name == "sub" and e.invars[1] is src) else name
            lit = isinstance(bias, core.Literal)
            steps.append(lambda y, ex, k=k, keep=keep, op=op, lit=lit:
                         _add_bias(y, ex[k], keep, axes, op, lit))  # fmt: skip
            notes.append(f"{name} of a bias moved after the collective (as its psum over {axes})")
        else:
            raise NearMiss(why + hint(e))
    return steps[::-1], extras, notes[::-1], d


def _bias_source(g: Graph, atom, ndim):
    """The value a broadcast addend comes from, and its shape with the broadcast dims as 1
    (``()`` for a scalar): through ``pvary`` and one ``broadcast_in_dim``."""
    keep = None
    for _ in range(4):
        j = g.made_by(atom, "pvary", "broadcast_in_dim", "convert_element_type")
        if j is None:
            break
        e = g.eqns[j]
        if e.primitive.name == "convert_element_type":  # (_add_bias casts to y's dtype)
            atom = e.invars[0]
            continue
        if e.primitive.name == "pvary":
            atom = e.invars[e.outvars.index(atom)]
            continue
        if keep is not None:
            break
        dims = e.params["broadcast_dimensions"]
        src = e.invars[0]
        keep = tuple(src.aval.shape[dims.index(i)] if i in dims else 1 for i in range(ndim))
        atom = src
    shape = tuple(atom.aval.shape)
    if keep is None:
        keep = shape if len(shape) == ndim else (() if not shape else None)
    if keep is None or (keep and all(s != 1 for s in keep)):
        return None, None  # a full-size addend: moving it costs a full-size collective
    return atom, keep


def _add_bias(y, c, keep, axes, op, literal):
    # A replicated bias (typed so under check_vma, or a literal): its psum is n * c.
    if literal or check_vma.value and not set(axes) & set(core.typeof(c).mat.varying):
        c = c * math.prod(core.get_axis_env().axis_size(a) for a in axes)
    else:  # (without check_vma, replication is not typed: a psum of the small bias)
        c = lax.psum(c, axes)
    c = lax.convert_element_type(c.reshape(keep) if keep else c, y.dtype)
    return {"add": lambda: y + c, "sub": lambda: y - c, "rsub": lambda: c - y}[op]()
