"""``all_gather -> matmul(s)`` candidates, and the near misses of Megatron-style f/g operators.

One gathered activation often feeds several matmuls (separate Wq/Wk/Wv; SwiGLU's gate and up
projections). They become ONE ``all_gather_matmul(x, [w_0, w_1, ...])`` (each weight viewed as
``[K, N_i]``): it gathers x once, as the original does, without concatenating the weights, and
its backward is one reduce-scatter for dx, as the original's.

A cast or a reshape between the gather and the matmul moves before the gather: a cast is
elementwise; a reshape keeps each rank's block where `views.map_dim` says so. A gather along a
contracted dimension (x sharded over K) becomes ``all_gather_matmul(x, w,
gather_dimension=x.ndim - 1)``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax._src import core

from jaxoverlap.rewrite import advice, norms, views
from jaxoverlap.rewrite.patterns import (
    COLLECTIVES,
    MAX_BETWEEN,
    ROUNDED,
    SUM_PRIMS,
    Graph,
    Match,
    collective_desc,
    collective_problem,
    eqn_name,
    group_size,
    rounds_back,
    short,
    walkable,
    where,
)

_MOVABLE = ("convert_element_type", "reshape", "transpose")


def match_all_gather(g: Graph, i, manual_axes) -> Match | None:
    coll = g.eqns[i]
    x, v = coll.invars[0], coll.outvars[0]
    if v.aval.ndim < 2:  # a bias or a norm's scale (FSDP): never an x [..., K] of the ops
        return None
    norm = norms.match_norm(g, i)  # x gathered along K into a norm, then the matmul(s)
    if norm is not None:
        norm.reason = collective_problem(coll, manual_axes)
        return norm
    n, d = group_size(coll), coll.params["all_gather_dimension"]
    axes = tuple(coll.params["axis_name"])
    between, blocker = [], None
    for _ in range(MAX_BETWEEN + 1):
        users = g.users.get(v, [])
        dots = [j for j in users if g.eqns[j].primitive.name == "dot_general"]
        if dots:
            break
        if len(users) != 1 or g.uses[v] != 1 or not walkable(g.eqns[users[0]]):
            # (a norm in f32 with its casts is ~5 equations deep)
            return _near_miss_downstream(g, i, v, 2 * MAX_BETWEEN - len(between))
        e = g.eqns[users[0]]
        if blocker is None and not (e.primitive.name in _MOVABLE and len(e.invars) == 1):
            blocker = e
        between.append(users[0])
        v = e.outvars[0]
    else:
        return None
    # v is x where it is the first operand, or the second one when the first is not contracted
    # like an x (einsum puts the weight first when the result starts with weight dims).
    pos = {j: g.eqns[j].invars.index(v) for j in dots}
    as_x = [j for j in dots if g.eqns[j].invars.count(v) == 1
            and pos[j] == views.x_position(g.eqns[j])]  # fmt: skip
    first = min(as_x or dots)
    ws = tuple(g.eqns[j].invars[1 - pos[j]] for j in as_x)
    shown = "".join(f" -> {g.eqns[b].primitive.name}" for b in between)
    m = Match(
        "all_gather_matmul", i, first, frozenset((i, *between, *as_x)), (x, *ws),
        tuple(g.eqns[j].outvars[0] for j in as_x), None,
        detail=f"{collective_desc(coll)} of {short(x)}{shown} -> @ "
        + (", ".join(short(w) for w in ws) or short(g.eqns[dots[0]].invars[1])),
        location=where(g.eqns[first]),
    )  # fmt: skip
    if not as_x:
        m.kind = "out of scope"
        m.reason = "the gathered value is the matmul's weight operand (FSDP; the ops gather x)"
        return m
    casts = [rounds_back(g, j) for j in as_x]  # a wider result cast straight back: the op's
    results = [views.dot_view(g.eqns[j], pos[j], c is not None) for j, c in zip(as_x, casts)]
    m.outs = tuple(g.eqns[c if c is not None else j].outvars[0] for j, c in zip(as_x, casts))
    m.drop |= {c for c in casts if c is not None}
    for (view, _), w in zip(results, ws, strict=True):
        if view is not None and view.describe(w.aval) == "w.T":
            m.detail = m.detail.replace(f"@ {short(w)}", f"@ {short(w)}.T", 1)
    m.reason = next((why for _, why in results if why), None)
    m.reason = m.reason or collective_problem(coll, manual_axes)
    if m.reason is None and (len(dots) != len(as_x) or len(g.users[v]) != len(as_x)
                             or v in g.jaxpr.outvars):  # fmt: skip
        m.reason = "the gathered value is also used elsewhere (the ops do not expose it)"
    if m.reason is None and blocker is not None:
        m.kind = "near miss"
        m.advice, text = advice.before_gather(g, i, set(dots), MAX_BETWEEN)
        m.reason = (f"a {eqn_name(blocker)} ({where(blocker)}) between the all_gather and "
                    f"the matmul: {text}")  # fmt: skip
    if m.reason is not None:
        return m
    vs = [view for view, _ in results]
    if len({(view.lead, view.k_shape) for view in vs}) != 1:
        m.reason = "the matmuls of the gathered value contract different dimensions of it"
        return m
    if not all(g.defined_before(w, first) for w in ws):
        hoist = _hoistable(g, ws, first, i)
        if hoist is None:
            m.reason = "a weight is computed after the first matmul of the gathered value"
            return m
        m.hoist = hoist  # e.g. each projection's w.astype(bf16) just before its own matmul
        notes_hoist = [f"{len(hoist)} equation(s) computing the weights moved before the op"]
    else:
        notes_hoist = []
    steps, notes = [], notes_hoist
    shape = coll.outvars[0].aval.shape
    for b in between:  # casts and reshapes, moved before the gather
        e = g.eqns[b]
        out = e.outvars[0].aval
        if e.primitive.name == "transpose":
            perm = tuple(e.params["permutation"])
            d = perm.index(d)
            steps.append(lambda y, perm=perm: jnp.transpose(y, perm))
        elif e.primitive.name == "reshape":
            d = views.map_dim(shape, out.shape, d, n)
            if d is None:
                m.reason = f"the reshape ({where(e)}) moves the gathered dimension"
                return m
            steps.append(lambda y, s=views.local(out.shape, d, n): y.reshape(s))
        else:
            steps.append(lambda y, dt=out.dtype: lax.convert_element_type(y, dt))
        notes.append(f"{e.primitive.name} moved before the all_gather")
        shape = out.shape
    view = vs[0]
    lead = len(view.lead)
    if d > lead:
        m.reason = (f"the gather is along dimension {d}, a contracted dimension other than the "
                    "first of the contracted block")  # fmt: skip
        return m
    if d == lead:
        notes.append("gathers along K (x is sharded over the contracted dimension)")
    for view, w in zip(vs, ws, strict=True):
        if view.reshaped:
            notes.append(f"matmul as x [..., K] @ {view.describe(w.aval)}")
    if any(c is not None for c in casts):
        notes.append(ROUNDED)
    if vs[0].promote is not None:
        notes.append(views.PROMOTED.format(vs[0].promote))
    if len(as_x) > 1:
        notes.append(f"{len(as_x)} matmuls of one gathered value: one op for all the weights "
                     "(not concatenated)")  # fmt: skip
    gd = d

    def build(op_fn, x, *ws):
        for step in steps:
            x = step(x)
        w2 = [view.w2(w) for view, w in zip(vs, ws, strict=True)]
        ys = op_fn(vs[0].x2(x), w2[0] if len(w2) == 1 else w2, axis_name=axes, gather_dimension=gd)
        ys = [ys] if len(w2) == 1 else ys
        return [view.out(y) for view, y in zip(vs, ys, strict=True)]

    m.build, m.note = build, "; ".join(notes)
    return m


def _hoistable(g: Graph, ws, first, coll) -> tuple[int, ...] | None:
    """The equations after ``first`` that compute the weights ``ws`` (a cast or reshape of each
    parameter just before its own matmul: Flax modules with ``dtype=bf16``), to be moved up to
    ``first``: pure, single-result, from values defined before ``first`` and not from the
    gathered value. None where there are others."""
    need, seen = [w for w in ws if not g.defined_before(w, first)], set()
    while need:
        v = need.pop()
        j = g.producer[v]
        if j in seen:
            continue
        e = g.eqns[j]
        if (j == coll or e.effects or len(e.outvars) != 1 or e.primitive.name in COLLECTIVES
                or not walkable(e) or e.primitive.name.startswith("custom_")):  # fmt: skip
            return None
        seen.add(j)
        for a in e.invars:
            if isinstance(a, core.Var) and not g.defined_before(a, first):
                if a is g.eqns[coll].outvars[0]:
                    return None
                need.append(a)
        if len(seen) > MAX_BETWEEN * len(ws):
            return None
    return tuple(sorted(seen))


def _near_miss_downstream(g: Graph, i, v, depth) -> Match | None:
    """A matmul reached from ``v`` through up to ``depth`` walkable equations (e.g. a norm of
    the gathered value): a near miss naming the first of them. None if there is none."""
    frontier, seen = [(v, None)], set()
    for _ in range(depth):
        nxt = []
        for u, first in frontier:
            for j in g.users.get(u, []):
                e = g.eqns[j]
                if e.primitive.name == "dot_general" and first is not None:
                    f = g.eqns[first]
                    p = e.invars.index(u)
                    m = Match(
                        "all_gather_matmul", i, j, frozenset(), (), (), None,
                        detail=f"{collective_desc(g.eqns[i])} of {short(g.eqns[i].invars[0])} "
                        f"-> {f.primitive.name} ... -> @ {short(e.invars[1 - p])}",
                        location=where(e), kind="near miss",
                    )  # fmt: skip
                    if p != views.x_position(e):  # e.g. an FSDP weight, cast or masked
                        m.kind = "out of scope"
                        m.reason = ("the gathered value is the matmul's weight operand (FSDP; "
                                    "the ops gather x)")  # fmt: skip
                        return m
                    m.advice, text = advice.before_gather(g, i, {j}, MAX_BETWEEN * 4)
                    m.reason = (f"a {eqn_name(f)} ({where(f)}) between the all_gather and the "
                                f"matmul: {text}")  # fmt: skip
                    return m
                if j not in seen and walkable(e):
                    seen.add(j)
                    nxt.append((e.outvars[0], j if first is None else first))
        frontier = nxt
    return None


def custom_vjp_near_misses(g: Graph, i) -> list[Match]:
    """Megatron's g (collective forward, identity backward) applied to a matmul's result, and
    f (identity forward, psum backward) feeding a matmul: listed, with how to write them."""
    e = g.eqns[i]
    body = e.params.get("call_jaxpr") or e.params.get("fun_jaxpr")
    body = getattr(body, "jaxpr", body)
    if body is None:
        return []
    info = getattr(body, "debug_info", None)
    name = e.params.get("name") or getattr(info, "func_name", None) or "custom_vjp"
    found = []
    colls = [b for b in body.eqns if b.primitive.name in (*SUM_PRIMS, "reduce_scatter")]
    for a in e.invars:
        j = g.made_by(a, "dot_general")
        if colls and j is not None:
            op = "matmul_reduce_scatter" if colls[0].primitive.name == "reduce_scatter" else (
                "matmul_all_reduce")  # fmt: skip
            found.append(_near(op, j, i, g, f"{short(a)} -> custom_vjp {name}"
                               f"({collective_desc(colls[0])})",
                               f"the {collective_desc(colls[0])} is inside the jax.custom_vjp "
                               f"function {name!r} (a Megatron-style 'g' operator), which overlap "
                               "does not rewrite across; call the lax collective directly under "
                               "shard_map's check_vma=True (the default), whose transpose "
                               "is the identity/all-gather such an operator defines"))  # fmt: skip
    identity = body.outvars == body.invars and not body.eqns
    for v in e.outvars if identity else ():
        for j in g.users.get(v, []):
            dot = g.eqns[j]
            if dot.primitive.name == "dot_general" and dot.invars[0] is v:
                found.append(_near("matmul_all_reduce", i, j, g,
                                   f"custom_vjp {name}(identity) -> {short(v)} @ "
                                   f"{short(dot.invars[1])}",
                                   f"x comes through the jax.custom_vjp identity {name!r} (a "
                                   "Megatron-style 'f' operator: its psum is in the backward "
                                   "pass, where overlap cannot see it); drop it and let "
                                   "check_vma=True insert the psum as the transpose of x's "
                                   "implicit pvary; overlap applied to the differentiated "
                                   "function (overlap(jax.grad(loss))) then sees the backward's "
                                   "matmul + psum"))  # fmt: skip
    return found


def _near(op, first, last, g: Graph, detail, reason) -> Match:
    return Match(op, first, last, frozenset(), (), (), None, detail=detail,
                 location=where(g.eqns[last]), reason=reason, kind="near miss")  # fmt: skip
