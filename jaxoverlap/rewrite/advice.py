"""Near-miss advice: how to move the equation that keeps a pair from being rewritten -- given only
where the moved program computes the same values, exactly or within rounding (which, it says).

A near miss names the equation between a matmul and its collective. Advice to move it across the
collective is printed only where the move computes the same function, and each piece of advice
is an `Advice` that says exactly which equations move where, so that a test applies it
mechanically (tests/test_explain_idioms.py) and checks the values. The same function is not
always the same bits: a move that reorders a floating-point sum or rounds a product at another
point agrees only within rounding, and the advice says so (`Advice.exact` False); a move of
values only, a negation, or elementwise ops on the block they would see anyway gives the same
bits (``exact``). Two moves are advised:

* ``"after"``: the one equation that feeds a ``psum``/``psum_scatter`` directly, redone on the
  collective's result. The same where it commutes with the sum: for a ``psum`` a linear op of the
  summed value alone -- a slice, transpose, reshape, broadcast (exact: they only move values) or
  a sum over some dimension (within rounding: the same terms summed in another order) -- or a
  scale by a value replicated over the group (within rounding: the product is rounded once,
  after the sum, instead of on each rank); for a ``psum_scatter`` a negation (exact) or a scale
  by a replicated scalar (within rounding; anything shaped would have to be scattered too).
* ``"before"``: the equations between an ``all_gather`` and its matmul, redone on the local
  block before the gather. The same where each acts on the positions along the gathered
  dimension independently -- elementwise ops, sums and maxima over *other* dimensions (a norm
  over the features of a gather of rows), broadcasts -- and combines them only with scalars or
  with values broadcast along the gathered dimension: exact for elementwise ops and broadcasts;
  within rounding once a sum is among them (XLA may order a row's sum differently when it
  compiles it for the smaller block). A norm over the dimension that is gathered (x gathered
  along K) is not the same at all: its statistics need the whole row (`jaxoverlap.rewrite.norms`
  handles that case by reducing the statistics across the group instead).
"""

from __future__ import annotations

import dataclasses

from jax._src import core
from jax._src.config import _check_vma as check_vma
from jax.extend.core import ClosedJaxpr

# Elementwise primitives (operands of equal shape, result of that shape): they act on every
# position independently, so they commute with gathering any dimension.
ELEMENTWISE = frozenset(
    {"add", "sub", "mul", "div", "max", "min", "pow", "integer_pow", "exp", "exp2", "log",
     "log1p", "tanh", "logistic", "rsqrt", "sqrt", "neg", "abs", "sign", "erf", "square",
     "convert_element_type", "sin", "cos", "select_n", "stop_gradient", "copy"}
)  # fmt: skip
# Linear in their one operand and shaped only by their params: commute with a psum.
_LINEAR_UNARY = frozenset(
    {"neg", "reduce_sum", "slice", "squeeze", "broadcast_in_dim", "expand_dims", "rev",
     "reshape", "transpose", "copy"}
)  # fmt: skip
_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
# Of those, the ones that only move values (a psum of their result is bitwise the same).
_MOVES_ONLY = _LINEAR_UNARY - {"neg", "reduce_sum"}
WITHIN_ROUNDING = "the same values within rounding"
EXACTLY = "exactly the same values"


def _same(exact: bool) -> str:
    """How the advised program's values compare with the original's (the advice text says it)."""
    return EXACTLY if exact else WITHIN_ROUNDING


@dataclasses.dataclass(frozen=True)
class Advice:
    """A move that computes the same values: exactly or within rounding (the module docstring).

    Attributes:
      kind: ``"after"`` or ``"before"``.
      coll: the index of the collective in its jaxpr.
      moved: the indices of the equations that move, in jaxpr order.
      dims: ``"before"``: for each moved equation, the position of the gathered dimension in its
        result, whose size there becomes the local block's. A broadcast of a value that is the
        same along it, outside the region, is moved as a local copy (the original stays).
      out_dim: ``"before"``: the dimension to gather the last moved equation's result along.
      operands: ``"after"``: the moved equation's operands, None for the collective's result
        (the others replicated: `origin`).
      exact: the moved program gives the same bits (else the same values within rounding: a
        sum reordered or a product rounded at another point); the advice text says which.
    """

    kind: str
    coll: int
    moved: tuple[int, ...]
    dims: tuple = ()
    out_dim: int | None = None
    operands: tuple = ()
    exact: bool = False


def origin(g, atom):
    """``atom`` without the no-op ``pvary`` and same-dtype casts that made it varying (a
    replicated scale inside shard_map arrives so): the value to use after the collective."""
    for _ in range(4):
        j = g.made_by(atom, "pvary", "convert_element_type")
        if j is None:
            break
        e = g.eqns[j]
        src = e.invars[e.outvars.index(atom)] if e.primitive.name == "pvary" else e.invars[0]
        if src.aval.dtype != atom.aval.dtype or src.aval.shape != atom.aval.shape:
            break
        atom = src
    return atom


def replicated(atom, axes, vma_typed: bool) -> bool:
    """Whether ``atom`` is the same on every rank of ``axes``: a literal, or (under check_vma,
    where replication is typed) a value that does not vary over them."""
    if isinstance(atom, core.Literal):
        return True
    vma = getattr(atom.aval, "vma", None)  # jax 0.11
    if vma is None:  # jax 0.12: the aval's manual-axes type
        vma = getattr(getattr(atom.aval, "mat", None), "varying", None)
    return vma_typed and vma is not None and not set(axes) & set(vma)


# Ops that give every rank the same value from the same inputs (`same_everywhere`).
_SAME_OPS = ("pvary", "convert_element_type", "broadcast_in_dim", "reshape", "squeeze")


def same_everywhere(g, atom, axes, vma_typed: bool, depth=8) -> bool:
    """Whether ``atom`` has one value on every rank of ``axes``: `replicated`, or computed only
    from such values by elementwise ops, casts, broadcasts and pvary (``pvary(1e-6)`` is typed
    varying but is not)."""
    if replicated(atom, axes, vma_typed):
        return True
    j = g.producer.get(atom) if isinstance(atom, core.Var) else None
    if j is None or depth == 0:
        return False
    e = g.eqns[j]
    if e.primitive.name not in _SAME_OPS and e.primitive.name not in ELEMENTWISE:
        return False
    return all(same_everywhere(g, b, axes, vma_typed, depth - 1) for b in e.invars)


def after_collective(g, b, src, coll_index, scatter: bool, axes, vma_typed: bool):
    """``(Advice, text)`` to redo equation ``b`` (whose operand ``src`` is the matmul's
    result) after the collective ``coll_index`` it feeds, or ``(None, why not)``."""
    e = g.eqns[b]
    name = e.primitive.name
    others = [a for a in e.invars if a is not src]
    if g.producer.get(e.outvars[0]) is None or coll_index not in g.users.get(e.outvars[0], []):
        return None, (
            "it does not feed the collective directly (what follows it would have to move too), "
            "so no equal form is suggested"
        )
    nothing = (
        "it does not commute with the sum the collective computes, so no equal form can be "
        "suggested"
    )
    if e.invars.count(src) != 1:
        return None, nothing
    if not scatter and name in _LINEAR_UNARY and not others:
        exact = name != "reduce_sum"
        why = {"neg": "a negation commutes with the sum", "reduce_sum": "being linear, it "
               "commutes with the sum; the same terms are summed in another order"}  # fmt: skip
        why = why.get(name, "it only moves values")
        text = f"apply the {name} after the psum ({why}: {_same(exact)})"
        return Advice("after", coll_index, (b,), operands=(None,), exact=exact), text
    scale = name == "mul" or (name == "div" and e.invars[0] is src)
    operands = tuple(None if a is src else origin(g, a) for a in e.invars)
    if name == "neg" or scale and all(replicated(a, axes, vma_typed) for a in operands if a):
        if not scatter or all(a.aval.ndim == 0 for a in others):
            verb = {"neg": "negate", "mul": "scale", "div": "divide"}[name]
            exact = name == "neg"
            why = "a negation" if exact else f"a {name} by a value that is the same on every rank"
            how = "" if exact else ", rounded once after the sum instead of on each rank"
            text = f"{verb} after the collective instead ({why} commutes with the sum: "
            text += f"{_same(exact)}{how})"
            move = Advice("after", coll_index, (b,), operands=operands, exact=exact)
            return move, text
        return None, (
            f"it is a {name} by a value shaped like the result; after a psum_scatter that value "
            "would have to be scattered too, so no equal form can be suggested"
        )
    if scale:
        return None, (
            f"a {name} by a value that differs across the ranks does not commute with the sum, "
            "so no equal form can be suggested"
        )
    return None, nothing


def before_gather(g, coll_index, dots, limit: int):
    """``(Advice, text)`` to compute the equations between the ``all_gather`` at ``coll_index``
    and the matmuls ``dots`` on the local block, before the gather, or ``(None, why not)``.

    The region is every equation reached from the gathered value before a matmul (at most
    ``limit``); the gathered dimension is followed through it."""
    coll = g.eqns[coll_index]
    d0 = coll.params["all_gather_dimension"]
    group_axes = tuple(coll.params["axis_name"])
    pos = {coll.outvars[0]: d0}  # var of the region -> position of the gathered dim
    region, frontier, dots = set(), [coll.outvars[0]], set(dots)
    while frontier:
        v = frontier.pop()
        for j in g.users.get(v, []):
            if g.eqns[j].primitive.name == "dot_general":
                dots.add(j)  # (every matmul of the normed value: gate and up projections)
            if j in dots or j in region:
                continue
            region.add(j)
            if len(region) > limit:
                return None, "too many equations between the all_gather and the matmul"
            frontier.extend(g.eqns[j].outvars)
    if not region:
        return None, "nothing is between them"
    dims = {}  # moved equation -> position of the gathered dim in its result
    for j in sorted(region):
        e = g.eqns[j]
        name = e.primitive.name
        ins = [a for a in e.invars if isinstance(a, core.Var) and a in pos]
        outside = [a for a in e.invars if not (isinstance(a, core.Var) and a in pos)]
        for out in e.outvars:
            users = g.users.get(out, [])
            if out in g.jaxpr.outvars or any(u not in region and u not in dots for u in users):
                return None, (
                    f"the {name} result is also used elsewhere, so moving it before the "
                    "all_gather would need the gathered value there too"
                )
        nested = any(isinstance(v, (core.Jaxpr, ClosedJaxpr)) for v in e.params.values())
        if len(e.outvars) != 1 or nested:
            return None, f"a {name} cannot be moved before the all_gather mechanically"
        p = pos[ins[0]] if ins else None
        if any(pos[a] != p for a in ins):
            return None, "the gathered dimension does not stay in one place"
        if name in ELEMENTWISE:
            for a in outside:
                if not same_everywhere(g, a, group_axes, bool(check_vma.value)):
                    return None, (
                        f"the {name} combines the gathered value with a value that may differ "
                        "across the ranks: before the all_gather each rank would apply its own "
                        "to its block, so no equal form is suggested"
                    )
                if not a.aval.ndim:
                    continue
                b, casts = g.broadcast_of(a)  # (and its pvary on jax 0.11, moved with it)
                if b is not None and p not in g.eqns[b].params["broadcast_dimensions"]:
                    for j2 in (b, *casts):  # constant along p: broadcast to the local block
                        dims[j2] = p
                else:
                    return None, (
                        f"the {name} combines the gathered value with a value that varies along "
                        f"the gathered dimension {p}: moving it before the all_gather would need "
                        "that value's local block too, so no equal form is suggested"
                    )
            out_p = p
        elif name in _REDUCE:
            axes = tuple(e.params["axes"])
            if p in axes:
                k = " (K, which the matmul contracts)" if p == ins[0].aval.ndim - 1 else ""
                return None, (
                    f"the {name} reduces along the gathered dimension {p}{k} -- a norm's "
                    "statistics over the whole row, which each rank holds only 1/n of -- so it "
                    "does not commute with the all_gather and no equal form is suggested"
                )
            out_p = p - sum(a < p for a in axes)
        elif name == "broadcast_in_dim":
            bd = e.params["broadcast_dimensions"]
            out_p = bd[p]
        else:
            return None, (
                f"a {name} is not an elementwise or row-wise op, so moving it before the "
                "all_gather is not known to compute the same; no equal form is suggested"
            )
        pos[e.outvars[0]] = out_p
        dims[j] = out_p
    last = [g.eqns[j].invars for j in dots]
    feeds = {pos[a] for ins in last for a in ins if isinstance(a, core.Var) and a in pos}
    if len(feeds) != 1 or None in feeds:
        return None, "the matmul's operand does not keep the gathered dimension"
    what = "it acts" if len(region) == 1 else f"the {len(region)} equations from the gather act"
    exact = not any(g.eqns[j].primitive.name == "reduce_sum" for j in region)
    same = _same(exact) + ("" if exact else " (XLA may order a row's sum differently)")
    text = (
        f"{what} on each position along the gathered dimension independently (elementwise, or "
        "a norm over the other dimensions), so apply them before the all_gather, on the local "
        f"block (where they cost 1/n): {same}"
    )
    moved = tuple(sorted(dims))
    dims_moved = tuple(dims[j] for j in moved)
    return Advice("before", coll_index, moved, dims_moved, feeds.pop(), exact=exact), text
