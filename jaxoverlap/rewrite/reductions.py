"""``matmul -> [between] -> reduce_scatter / psum`` candidates.

What may sit between the matmul and its reduction and still be rewritten (`_move_back`): a cast,
a transpose or a reshape (redone after the collective), a bias added on every rank (its psum is
added after the collective), and, right after the matmul, the cast back of a wider
``preferred_element_type`` (the op's own rounding) or the sum with a second matmul of the same
result layout (`_added_matmul`: one op over both, concatenated along K). Anything else is a near
miss, with the equation and how to move it.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax._src import core
from jax._src.config import _check_vma as check_vma

from jaxoverlap.rewrite import advice, views
from jaxoverlap.rewrite.patterns import (
    MAX_BETWEEN,
    ROUNDED,
    Graph,
    Match,
    NearMiss,
    collective_desc,
    collective_problem,
    eqn_name,
    group_size,
    rounds_back,
    short,
    walkable,
    where,
)


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


def match_reduction(g: Graph, i, manual_axes) -> Match | None:
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
        steps, extras, notes, d = _move_back(g, rest, d, n, axes, i)
    except NearMiss as e:
        m.kind, m.reason, m.advice = "near miss", str(e), e.advice
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
    if view.promote is not None:
        notes.insert(0, views.PROMOTED.format(view.promote))

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


def _move_back(g: Graph, between, d, n, axes, coll_index):
    """Steps that redo ``between`` after the collective, walking back from it.

    Returns ``(steps, extra inputs, notes, d at the matmul's result)``, ``d`` the scattered
    dimension (None for psum), or raises `NearMiss`. A cast, transpose or reshape moves across
    unchanged (the sum then runs in the matmul's dtype: within the tolerance of the narrower
    dtype). A bias ``c`` added on every rank adds ``psum(c)`` after the collective (``n * c``
    for a replicated bias); one that varies along the scattered dimension (a bias over N when N
    is scattered: GPT-J, the shard_map tutorial) adds its scattered block: ``n * c[block]``, or
    ``psum_scatter(c)`` for a bias that differs across the ranks.
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
            if bias is None:
                raise NearMiss(why + "the added value is not a broadcast bias but a full-size "
                               "addend, which would be summed by the collective too; the ops "
                               "have no form with it and no equal form is suggested")  # fmt: skip
            along = d is not None and bool(keep) and keep[d] != 1  # varies along the scatter
            k = len(extras)
            extras.append(bias)
            op = "rsub" if (name == "sub" and e.invars[1] is src) else name
            lit = isinstance(bias, core.Literal)
            sd = d if along else None
            steps.append(lambda y, ex, k=k, keep=keep, op=op, lit=lit, sd=sd:
                         _add_bias(y, ex[k], keep, axes, op, lit, sd))  # fmt: skip
            how = "its scattered block of the psum" if along else "its psum"
            notes.append(f"{name} of a bias moved after the collective (as {how} over {axes})")
        else:
            scatter = g.eqns[coll_index].primitive.name == "reduce_scatter"
            move, text = advice.after_collective(g, b, src, coll_index, scatter, axes,
                                                 bool(check_vma.value))  # fmt: skip
            raise NearMiss(why + text, move)
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


def _add_bias(y, c, keep, axes, op, literal, scattered=None):
    """``y`` plus (or minus) the sum over the ranks of the bias ``c`` each rank added; where
    ``scattered`` is a dimension of ``keep`` along which c varies, only this rank's block."""
    n = math.prod(core.get_axis_env().axis_size(a) for a in axes)
    c = c.reshape(keep) if keep else c
    # A replicated bias (typed so under check_vma, or a literal): its psum is n * c.
    if literal or check_vma.value and not set(axes) & set(core.typeof(c).mat.varying):
        c = c * n
        if scattered is not None:
            size = c.shape[scattered] // n
            c = lax.dynamic_slice_in_dim(c, lax.axis_index(axes) * size, size, scattered)
    elif scattered is not None:
        c = lax.psum_scatter(c, axes, scatter_dimension=scattered, tiled=True)
    else:  # (without check_vma, replication is not typed: a psum of the small bias)
        c = lax.psum(c, axes)
    c = lax.convert_element_type(c, y.dtype)
    return {"add": lambda: y + c, "sub": lambda: y - c, "rsub": lambda: c - y}[op]()
