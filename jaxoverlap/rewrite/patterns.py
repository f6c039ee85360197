"""Which matmul/collective pairs of one jaxpr the jaxoverlap ops can replace, and why not the rest.

A *candidate* is a matmul (``dot_general``) connected to a collective in the same jaxpr:

* ``dot_general -> [between] -> reduce_scatter`` (``lax.psum_scatter``) -> ``matmul_reduce_scatter``
* ``dot_general -> [between] -> psum``           (``lax.psum``)         -> ``matmul_all_reduce``
* ``all_gather -> [between] -> dot_general(s)``  (gathered value is x)  -> ``all_gather_matmul``

"Matmul" is any ``dot_general`` that is a 2-D matmul after reshaping (`views.dot_view`): x
contracted on its trailing dims, N-D weights in any layout. "Between" are up to `MAX_BETWEEN`
single-use equations. A cast, a reshape or a bias add between the pair is moved across the
collective where that keeps the result within dtype tolerance (the rules are in `reductions`
and `gathers`); anything else makes the pair a *near miss*, listed with the equation in between
and how to move it. Every rule that says no names its reason; `Candidate` carries it to
`jaxoverlap.explain`.

This module is the vocabulary the rules share (`Graph`, `Match`, `Candidate`, ...) and imports
none of them; `walk.find_matches` asks each rule module for the candidates of a jaxpr.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

from jax._src import core, source_info_util
from jax.extend.core import ClosedJaxpr

SUM_PRIMS = ("psum_invariant", "psum")  # psum is psum_invariant under check_vma=True
COLLECTIVES = frozenset({*SUM_PRIMS, "reduce_scatter", "all_gather", "all_to_all", "ppermute"})
MAX_BETWEEN = 4  # equations searched between a matmul and its collective


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
      path: for a rewrite, the path the op takes on the target's GPUs: ``"fused (why)"`` or
        ``"reference: <why>"`` (from `jaxoverlap.fused.unsupported_reason`).
      kernel: explain's, where the path is fused: the custom call lowering emits and its
        schedule, e.g. ``"jaxoverlap_gemm_rs_v3 (2 chunk(s) per block, 4 SMs pushing by TMA)"``
        (from `jaxoverlap.fused.dispatch.kernel`).
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
    kernel: str = ""

    def __str__(self):
        status = "rewritten" if self.rewritten else ("near miss" if self.kind == "near miss"
                                                     else "skipped")  # fmt: skip
        line = f"{status:9} {self.op}: {self.detail}  [{self.scope}; {self.location}]"
        if not self.rewritten:
            return f"{line}\n          why: {self.reason}"
        note = f"\n          does: {self.note}" if self.note else ""
        kernel = f"\n          kernel: {self.kernel}" if self.kernel else ""
        return f"{line}{note}\n          path: {self.path}{kernel}"


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
    advice: object = None  # a near miss's `advice.Advice`, where the move computes the same values
    hoist: tuple[int, ...] = ()  # equations moved up to ``last`` (a weight's cast after it)
    only_if_fused: bool = False  # applied only where the op then runs fused (rewrite/norms.py)


class NearMiss(Exception):
    """Something between the pair cannot be moved across the collective; the message says what
    (and ``advice``, an `advice.Advice` or None, how to move it where that computes the same)."""

    def __init__(self, message, advice=None):
        super().__init__(message)
        self.advice = advice


def short(atom) -> str:
    return atom.aval.str_short(short_dtypes=True)


def where(eqn) -> str:
    return source_info_util.summarize(eqn.source_info)


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

    def broadcast_of(self, v):
        """``(b, casts)``: the ``broadcast_in_dim`` equation that made ``v``, looking through
        one single-operand ``pvary`` (a no-op cast of the manual-axes type), and that cast's
        equation if there is one; ``(None, ())`` if ``v`` is not a broadcast. (jax 0.11 types a
        replicated value varying after broadcasting it, jax 0.12 before.)"""
        c = self.made_by(v, "pvary")
        if c is not None and len(self.eqns[c].outvars) == 1:
            b = self.made_by(self.eqns[c].invars[0], "broadcast_in_dim")
            return (b, (c,)) if b is not None else (None, ())
        return self.made_by(v, "broadcast_in_dim"), ()

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
