"""Which matmul/collective pairs of one jaxpr the jaxoverlap ops can replace, and why not the rest.

A *candidate* is a matmul (``dot_general``) directly connected to a collective in the same jaxpr:

* ``dot_general -> reduce_scatter``  (``lax.psum_scatter``)     -> ``matmul_reduce_scatter``
* ``all_gather -> dot_general``      (gathered value is ``x``)  -> ``all_gather_matmul``
* ``dot_general -> psum``            (``lax.psum``)             -> ``matmul_all_reduce``

"Matmul" means a ``dot_general`` contracting the last dimension of ``x [..., K]`` with the first
of a 2-D ``w [K, N]``, or with the last of ``w [N, K]`` (``einsum("mk,nk->mn")``, the layout of
PyTorch-style weights and of backward passes; the op then gets ``w.T``).

A candidate is replaced only when the op computes exactly what the pair computes: the same
operands, the same collective over the same shard_map axes, the same output type. Every rule
below that says no names its reason; `Candidate` carries it to `jaxoverlap.explain`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import jax.numpy as jnp
import numpy as np
from jax._src import core, source_info_util

_SUM_PRIMS = ("psum_invariant", "psum")  # psum is psum_invariant under check_vma=True


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One matmul/collective pair found by `jaxoverlap.overlap`, and what became of it.

    Attributes:
      op: the jaxoverlap op that would replace the pair.
      rewritten: whether it was replaced.
      reason: why not (empty when rewritten).
      detail: the pair, e.g. ``f32[64,128] @ f32[128,256] -> reduce_scatter(('tp',), dim 0)``.
      location: the user source line of the collective (or of the matmul for all_gather).
      scope: the nesting it was found in, outermost first, e.g. ``jit > shard_map > scan``.
    """

    op: str
    rewritten: bool
    reason: str
    detail: str
    location: str
    scope: str

    def __str__(self):
        status = "rewritten" if self.rewritten else "skipped"
        line = f"{status:9} {self.op}: {self.detail}  [{self.scope}; {self.location}]"
        return line if self.rewritten else f"{line}\n          why: {self.reason}"


@dataclasses.dataclass
class Match:
    """A candidate inside one jaxpr: equation indices, the op's operands and keyword arguments."""

    op: str
    first: int  # index of the earlier equation of the pair
    last: int  # index of the later one; the op is spliced in here
    x: core.Atom
    w: core.Atom  # as the matmul takes it: [K, N], or [N, K] when transpose_w
    out: core.Var  # the pair's result, which the op's result replaces
    kwargs: dict
    detail: str
    location: str
    reason: str | None = None
    transpose_w: bool = False  # the matmul is x @ w.T: the op gets jnp.transpose(w)


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)  # includes bfloat16 and float8 (ml_dtypes)


def _short(atom) -> str:
    return atom.aval.str_short(short_dtypes=True)


def _where(eqn) -> str:
    return source_info_util.summarize(eqn.source_info)


def matmul_problem(eqn) -> str | None:
    """Why this ``dot_general`` is not ``jnp.matmul(x [..., K], w [K, N])`` as the ops compute."""
    x, w = (v.aval for v in eqn.invars)
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if lb or rb:
        return "the matmul has batch dimensions (the ops take x [..., K] and a single w [K, N])"
    if w.ndim != 2:
        return f"the weight operand has rank {w.ndim}; the ops take w as [K, N]"
    if tuple(rc) not in ((0,), (1,)):
        return f"the weight is contracted on dimensions {tuple(rc)}"
    if tuple(lc) != (x.ndim - 1,):
        return f"x is contracted on dimension {tuple(lc)}, not on its last one (x must be [..., K])"
    if x.dtype != w.dtype:
        return f"the operands have different dtypes ({x.dtype} and {w.dtype})"
    if not _is_float(x.dtype):
        return f"dtype {x.dtype} is not floating point (the ops are float-only)"
    if eqn.params.get("precision") is not None:
        return (
            f"precision={eqn.params['precision']} (the ops run the matmul at default precision, "
            "which may differ)"
        )
    pet = eqn.params.get("preferred_element_type")
    if pet is not None and np.dtype(pet) != x.dtype:
        return (
            f"preferred_element_type={np.dtype(pet)} differs from the operand dtype {x.dtype} "
            "(the ops return x.dtype)"
        )
    sharding = eqn.params.get("out_sharding")
    if sharding is not None and any(e is not None for e in getattr(sharding, "spec", (0,))):
        # (Backward-pass matmuls inside shard_map carry a fully replicated one: a no-op.)
        return f"the matmul carries an explicit out_sharding {sharding}"
    return None


def _transposed(dot) -> bool:
    """``x @ w.T``: the weight is stored ``[N, K]`` and contracted on its last dimension."""
    (_, rc), _ = dot.params["dimension_numbers"]
    return dot.invars[1].aval.ndim == 2 and tuple(rc) == (1,)


def collective_problem(eqn, manual_axes) -> str | None:
    """Why this collective is not the one the ops perform over shard_map axes."""
    p = eqn.params
    names = p["axes"] if eqn.primitive.name in _SUM_PRIMS else p["axis_name"]
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


def _collective_desc(eqn) -> str:
    p = eqn.params
    if eqn.primitive.name in _SUM_PRIMS:
        return f"psum({tuple(p['axes'])})"
    if eqn.primitive.name == "all_gather":
        return f"all_gather({tuple(p['axis_name'])}, dim {p['all_gather_dimension']})"
    return f"psum_scatter({tuple(p['axis_name'])}, dim {p['scatter_dimension']})"


def find_matches(jaxpr: core.Jaxpr, manual_axes) -> list[Match]:
    """Every candidate of ``jaxpr`` (not of its sub-jaxprs), in equation order.

    ``Match.reason`` is None for those that may be replaced (subject to the op accepting them).
    """
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    uses = Counter(v for e in jaxpr.eqns for v in e.invars if isinstance(v, core.Var))
    uses.update(v for v in jaxpr.outvars if isinstance(v, core.Var))
    claimed: set[int] = set()
    matches = []
    for i, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        if name == "all_gather":
            m = _match_all_gather(jaxpr, i, uses, manual_axes)
        elif name == "reduce_scatter" or name in _SUM_PRIMS:
            m = _match_reduction(jaxpr, i, producer, uses, manual_axes)
        else:
            continue
        if m is None:
            continue
        if m.reason is None and (m.first in claimed or m.last in claimed):
            m.reason = "its matmul is already being fused with another collective"
        if m.reason is None:
            claimed.update((m.first, m.last))
        matches.append(m)
    return matches


def _match_reduction(jaxpr, i, producer, uses, manual_axes) -> Match | None:
    coll = jaxpr.eqns[i]
    src = coll.invars[0]
    j = producer.get(src) if isinstance(src, core.Var) else None
    if j is None or jaxpr.eqns[j].primitive.name != "dot_general":
        return None
    dot = jaxpr.eqns[j]
    x, w = dot.invars
    if coll.primitive.name == "reduce_scatter":
        op = "matmul_reduce_scatter"
        kwargs = dict(
            axis_name=tuple(coll.params["axis_name"]),
            scatter_dimension=coll.params["scatter_dimension"],
        )
    else:
        op = "matmul_all_reduce"
        kwargs = dict(axis_name=tuple(coll.params["axes"]))
    t = _transposed(dot)
    m = Match(
        op, j, i, x, w, coll.outvars[0], kwargs,
        detail=f"{_short(x)} @ {_short(w)}{'.T' if t else ''} -> {_collective_desc(coll)}",
        location=_where(coll), transpose_w=t,
    )  # fmt: skip
    m.reason = matmul_problem(dot) or collective_problem(coll, manual_axes)
    if m.reason is None and uses[src] != 1:
        m.reason = "the matmul result is also used elsewhere (the ops do not expose it)"
    return m


def _match_all_gather(jaxpr, i, uses, manual_axes) -> Match | None:
    coll = jaxpr.eqns[i]
    g = coll.outvars[0]
    consumers = [
        (j, e) for j, e in enumerate(jaxpr.eqns[i + 1 :], i + 1)
        if e.primitive.name == "dot_general" and g in e.invars
    ]  # fmt: skip
    if not consumers:
        return None
    j, dot = consumers[0]
    x, w = dot.invars
    t = _transposed(dot)
    m = Match(
        "all_gather_matmul", i, j, coll.invars[0], w, dot.outvars[0],
        dict(axis_name=tuple(coll.params["axis_name"]),
             gather_dimension=coll.params["all_gather_dimension"]),
        detail=f"{_collective_desc(coll)} of {_short(coll.invars[0])} -> @ {_short(w)}"
        f"{'.T' if t else ''}",
        location=_where(dot), transpose_w=t,
    )  # fmt: skip
    if x is not g:
        m.reason = "the gathered value is the matmul's weight operand (the ops gather x)"
    else:
        m.reason = matmul_problem(dot) or collective_problem(coll, manual_axes)
    if m.reason is None and coll.params["all_gather_dimension"] == g.aval.ndim - 1:
        m.reason = "the gather is along K, which the matmul contracts (the ops gather a row dim)"
    if m.reason is None and uses[g] != 1:
        m.reason = "the gathered value is also used elsewhere (the ops do not expose it)"
    return m
