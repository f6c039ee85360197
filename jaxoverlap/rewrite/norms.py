"""A norm between an all-gather along K and its matmul(s): its statistics reduced across the group.

seqax and the JAX shard_map tutorial keep activations sharded over the features (K) and gather
them right before a norm and the next matmul::

    h = all_gather(x, axis=-1, tiled=True)         # x [..., K / n] -> [..., K]
    h = h * rsqrt(mean(h * h, -1) + eps) * scale    # RMSNorm (or a LayerNorm) over K
    y = h @ w                                       # w [K, N]

The norm needs the whole row, so it cannot move before the gather as it is; but a sum over the
gathered dimension is the psum of the sums over the local blocks. The rewrite recomputes the
norm on the local block -- every sum (max, min) along the gathered dimension becomes the local
one followed by a ``psum`` (``pmax``, ``pmin``) over the group, every value broadcast along it is
broadcast to the local block, and a vector along it (the scale, the bias) is sliced to this
rank's block (or taken before its own all_gather, where it is gathered too) -- and then gathers
the normalized block into the matmul: ``all_gather_matmul(norm_local(x), w,
gather_dimension=-1)``.

Re-association: the statistics are summed as n partial sums (one per rank) plus their psum,
where the original sums the gathered row at once; both are the same sum in another order, equal
within the dtype's rounding (f32 statistics, as a norm usually computes them, are far inside
the bf16 tolerance). Everything else is computed by the same equations on the same values. The
extra psum is one value per row: tiny next to the gather it lets fuse. So it is applied only
where the all_gather_matmul along K it creates runs fused on the target (walk checks the path);
elsewhere the program is left as written, with the reason.
"""

from __future__ import annotations

from jax import lax
from jax._src import core
from jax._src.config import _check_vma as check_vma
from jax.extend.core import ClosedJaxpr

from jaxoverlap.rewrite import views
from jaxoverlap.rewrite.advice import ELEMENTWISE, same_everywhere
from jaxoverlap.rewrite.patterns import Match, collective_desc, group_size, short, where

_CROSS = {"reduce_sum": lax.psum, "reduce_max": lax.pmax, "reduce_min": lax.pmin}
MAX_NORM = 24  # equations of a norm (a LayerNorm in f32 with casts is ~16)
NOTE = ("norm across K: its statistics reduced across the group (psum of the local partial "
        "sums), then the normalized local block gathered into the matmul")  # fmt: skip


def match_norm(g, i) -> Match | None:
    """The candidate replacing ``all_gather(x, K) -> norm -> matmul(s)``, or None when the region
    between them is not a norm over the gathered dimension that can be computed per block."""
    coll = g.eqns[i]
    v = coll.outvars[0]
    d0, axes = coll.params["all_gather_dimension"], tuple(coll.params["axis_name"])
    if d0 != v.aval.ndim - 1 or coll.params.get("axis_index_groups") is not None:
        return None
    pos, region, frontier, dots = {v: d0}, set(), [v], set()
    while frontier:
        u = frontier.pop()
        for j in g.users.get(u, []):
            if g.eqns[j].primitive.name == "dot_general":
                dots.add(j)
                continue
            if j not in region:
                region.add(j)
                frontier.extend(g.eqns[j].outvars)
        if len(region) > MAX_NORM:
            return None
    if not region or not dots:
        return None
    n = group_size(coll)
    plan, crossed, sources, unused, shared = [], False, [], set(), []

    def source(atom, same_on_every_rank=True):
        # Rank j computes block j with its own copy of the operand, where the original used the
        # gathering rank's for every block: equal only if the operand is the same on every rank
        # (checked below), or is this rank's block of a gathered vector (its own, before the
        # gather).
        sources.append(atom)
        if same_on_every_rank:
            shared.append(atom)
        return len(sources) - 1

    for j in sorted(region):
        e = g.eqns[j]
        name = e.primitive.name
        nested = any(isinstance(q, (core.Jaxpr, ClosedJaxpr)) for q in e.params.values())
        if len(e.outvars) != 1 or nested:
            return None
        out = e.outvars[0]
        if out in g.jaxpr.outvars or any(
            u not in region and u not in dots for u in g.users.get(out, [])
        ):
            return None
        ins = [a for a in e.invars if isinstance(a, core.Var) and a in pos]
        shaped = {pos[a] for a in ins if pos[a] is not None} or {None}
        if len(shaped) != 1:
            return None
        p = shaped.pop()
        if p is not None and any(
            pos[a] is None and a.aval.ndim and a.aval.shape[p] != 1 for a in ins
        ):  # (K-free values broadcast along size-1 dims)
            return None
        how = []
        if name in ELEMENTWISE:
            for a in e.invars:
                if isinstance(a, core.Var) and a in pos:
                    how.append(("region", a))
                elif isinstance(a, core.Literal):
                    how.append(("literal", a.val))
                elif p is None or not a.aval.ndim or a.aval.shape[p] == 1:
                    how.append(("input", source(a)))
                else:
                    b, _ = g.broadcast_of(a)  # (through jax 0.11's pvary of the broadcast)
                    if b is None:
                        return None  # a full-size operand along K: not a norm's
                    bd = g.eqns[b].params["broadcast_dimensions"]
                    src = g.eqns[b].invars[0]
                    if p not in bd or src.aval.shape[bd.index(p)] == 1:  # constant along K
                        how.append(("broadcast", b, None, source(src)))
                        continue
                    q = bd.index(p)  # a vector along K (the scale, a bias): this rank's block
                    ag = g.made_by(src, "all_gather")
                    c = g.eqns[ag] if ag is not None else None
                    if (
                        c is not None
                        and tuple(c.params["axis_name"]) == axes
                        and c.params["all_gather_dimension"] == q
                        and c.params["tiled"]
                    ):
                        how.append(("broadcast", b, None, source(c.invars[0], False)))
                        if g.uses[a] == 1 and g.uses[src] == 1:  # (its gather is then dead)
                            unused.update((b, ag))
                    else:
                        how.append(("broadcast", b, q, source(src)))
            pos[out] = p
        elif name in _CROSS:
            red = tuple(e.params["axes"])
            how.append(("region", ins[0]))
            if p is not None and p in red:
                crossed = True
                how.append(("cross", name))
                pos[out] = None
            else:
                pos[out] = None if p is None else p - sum(a < p for a in red)
        elif name == "broadcast_in_dim" and p is None:  # a statistic, back along K
            how.append(("region", ins[0]))
            bd, src = e.params["broadcast_dimensions"], ins[0].aval.shape
            grown = [k for k, size in enumerate(out.aval.shape)
                     if (k not in bd or src[bd.index(k)] == 1) and size != 1]  # fmt: skip
            pos[out] = grown[0] if len(grown) == 1 else None
            if len(grown) > 1 or (grown and out.aval.shape[grown[0]] != v.aval.shape[d0]):
                return None
        elif name == "broadcast_in_dim":
            how.append(("region", ins[0]))
            pos[out] = e.params["broadcast_dimensions"][p]
        else:
            return None
        plan.append((j, how, pos[out]))
    if not crossed:
        return None

    if not all(same_everywhere(g, a, axes, bool(check_vma.value)) for a in shared):
        return None  # an operand that may differ across ranks (or untyped: check_vma off)
    dots = sorted(dots)
    feed = [a for j in dots for a in g.eqns[j].invars if isinstance(a, core.Var) and a in pos]
    if len(feed) != len(dots) or len(set(feed)) != 1:
        return None
    u = feed[0]
    if pos[u] != u.aval.ndim - 1:
        return None
    results, ws = [], []
    for j in dots:
        dot = g.eqns[j]
        xp = dot.invars.index(u)
        if xp != views.x_position(dot):
            return None
        view, _ = views.dot_view(dot, xp)
        if view is None or len(view.k_shape) != 1:
            return None
        results.append(view)
        ws.append(dot.invars[1 - xp])
    first = dots[0]
    if not all(g.defined_before(w, first) for w in ws):
        return None
    x = coll.invars[0]
    m = Match(
        "all_gather_matmul", i, first, frozenset((i, *region, *dots, *unused)),
        (x, *sources, *ws),
        tuple(g.eqns[j].outvars[0] for j in dots), None,
        detail=f"{collective_desc(coll)} of {short(x)} -> norm ({len(region)} equations) -> @ "
        + ", ".join(short(w) for w in ws),
        location=where(g.eqns[first]), note=NOTE, only_if_fused=True,
    )  # fmt: skip
    nsrc, eqns = len(sources), g.eqns

    full = v.aval.shape[d0]

    def local(shape, p):  # the shape with K (at p, where full-size) the local block's
        return tuple(s // n if k == p and s == full else s for k, s in enumerate(shape))

    def build(op_fn, x, *rest):
        srcs, wts = rest[:nsrc], rest[nsrc:]
        env = {v: x}
        for j, how, p in plan:
            e = eqns[j]
            args, cross = [], None
            for item in how:
                kind = item[0]
                if kind == "region":
                    args.append(env[item[1]])
                elif kind == "literal":
                    args.append(item[1])
                elif kind == "input":
                    args.append(srcs[item[1]])
                elif kind == "cross":
                    cross = item[1]
                else:  # a broadcast operand, to the local block
                    _, b, q, k = item
                    be, src = eqns[b], srcs[k]
                    if q is not None:  # this rank's block of a vector along K
                        size = src.shape[q] // n
                        src = lax.dynamic_slice_in_dim(src, lax.axis_index(axes) * size, size, q)
                    shape = local(be.outvars[0].aval.shape, p)
                    dims = be.params["broadcast_dimensions"]
                    args.append(lax.broadcast_in_dim(src, shape, dims))
            params = dict(e.params)
            if "shape" in params:  # a broadcast within the norm: to the local block
                params["shape"] = local(e.outvars[0].aval.shape, p)
            y = e.primitive.bind(*args, **params)
            if cross is not None:  # the sum over the whole row: the psum of the local sums
                y = _CROSS[cross](y, axes)
                y = core.pvary(y, axes) if check_vma.value else y
            env[e.outvars[0]] = y
        h = env[u]
        w2 = [view.w2(w) for view, w in zip(results, wts, strict=True)]
        ys = op_fn(results[0].x2(h), w2[0] if len(w2) == 1 else w2, axis_name=axes,
                   gather_dimension=h.ndim - 1)  # fmt: skip
        ys = [ys] if len(w2) == 1 else ys
        return [view.out(y) for view, y in zip(results, ys, strict=True)]

    m.build = build
    return m
