"""A ``dot_general`` seen as the 2-D matmul ``x [..., K] @ w [K, N]`` the ops compute.

Real model code contracts N-D weights (Flax ``DenseGeneral``, MaxText: ``w [D, H, Dh]``,
``[H, Dh, D]``, ``[3, D, H, Dh]``), contracts several trailing dims of ``x`` (``x [.., H, Dh]``
with ``w [H, Dh, D]``) and stores weights ``[N, K]``. All of these are one 2-D matmul after
reshaping ``x`` to ``[..., K]`` (a free reshape of its trailing dims) and ``w`` to ``[K, N]``
(a transpose where its contracted dims are not leading, then a reshape), and the result back to
the ``dot_general``'s shape. `DotView` does that; `dot_view` says why a ``dot_general`` is not
such a matmul.

`map_dim` is the rule for moving a reshape across a tiled collective: gathering (or scattering)
dimension ``d`` of one shape equals gathering dimension ``d2`` of a reshaped view when both
have the same number of elements before that dimension (row-major order), because each rank's
block is then the same contiguous part of every "row".
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

PROMOTED = "mixed operand dtypes: both cast to {} first, the dtype jnp.matmul computes in"


@dataclasses.dataclass(frozen=True)
class DotView:
    """How to compute a ``dot_general`` with the ops' ``x2 [..., K] @ w2 [K, N]``."""

    lead: tuple[int, ...]  # x's free (leading) dims; the op's result is [*lead, N]
    k_shape: tuple[int, ...]  # x's contracted trailing dims
    w_perm: tuple[int, ...] | None  # transpose of w putting its contracted dims first (x's order)
    n_shape: tuple[int, ...]  # w's free dims, in order: the dot_general's trailing result dims
    swapped: bool = False  # x is the dot_general's second operand: its result is [*n, *lead]
    promote: object = None  # mixed operand dtypes: both are cast to this one (jnp.matmul's)

    @property
    def reshaped(self) -> bool:
        return (len(self.k_shape) != 1 or len(self.n_shape) != 1 or self.w_perm is not None
                or self.swapped)  # fmt: skip

    def unswapped_dim(self, d: int) -> int:
        """Dim ``d`` of the dot_general's result as a dim of ``[*lead, *n]``."""
        if not self.swapped:
            return d
        return len(self.lead) + d if d < len(self.n_shape) else d - len(self.n_shape)

    def x2(self, x):
        x = x if self.promote is None else x.astype(self.promote)
        return x if len(self.k_shape) == 1 else x.reshape(*x.shape[: len(self.lead)], -1)

    def w2(self, w):
        w = w if self.promote is None else w.astype(self.promote)
        if self.w_perm is not None:
            w = jnp.transpose(w, self.w_perm)
        return w.reshape(math.prod(self.k_shape), math.prod(self.n_shape))

    def out(self, y):
        """The op's result ``[*lead, N]`` (any leading dims) as the dot_general's shape."""
        y = y if len(self.n_shape) == 1 else y.reshape(*y.shape[:-1], *self.n_shape)
        if self.swapped:
            lead = y.ndim - len(self.n_shape)
            y = jnp.transpose(y, (*range(lead, y.ndim), *range(lead)))
        return y

    def out_local(self, y, unswapped_shape):
        """The op's (scattered) result as the dot_general's: reshaped to ``unswapped_shape``
        (``[*lead, *n]`` with the scattered dim divided), transposed when swapped."""
        y = y.reshape(unswapped_shape)
        if self.swapped:
            lead = y.ndim - len(self.n_shape)
            y = jnp.transpose(y, (*range(lead, y.ndim), *range(lead)))
        return y

    def describe(self, w_aval) -> str:
        """What the view does to ``w``, for explain (empty for a plain ``[K, N]`` weight)."""
        k, n = math.prod(self.k_shape), math.prod(self.n_shape)
        if not self.reshaped:
            return ""
        plain = len(self.k_shape) == 1 and len(self.n_shape) == 1
        if self.w_perm == (1, 0) and plain and not self.swapped:
            return "w.T"
        t = f"transpose{self.w_perm} " if self.w_perm else ""
        second = " (x is the 2nd operand)" if self.swapped else ""
        return f"w {w_aval.str_short(short_dtypes=True)} {t}as [{k}, {n}]{second}"


def is_default_precision(precision) -> bool:
    """``None``, ``Precision.DEFAULT`` or a tuple of them: what the ops compute."""
    if precision is None:
        return True
    items = precision if isinstance(precision, (tuple, list)) else (precision,)
    return all(p is None or p == lax.Precision.DEFAULT for p in items)


def trailing_contraction(eqn, pos: int) -> bool:
    """Whether operand ``pos`` is contracted on its trailing dims, after a free leading one."""
    a = eqn.invars[pos].aval
    contracted = eqn.params["dimension_numbers"][0][pos]
    c = len(contracted)
    return 0 < c < a.ndim and tuple(sorted(contracted)) == tuple(range(a.ndim - c, a.ndim))


def x_position(eqn) -> int:
    """Which operand plays x: the first one contracted on its trailing dims (0 if neither)."""
    return 1 if not trailing_contraction(eqn, 0) and trailing_contraction(eqn, 1) else 0


def dot_view(
    eqn, x_pos: int | None = None, rounded: bool = False
) -> tuple[DotView | None, str | None]:
    """``(view, None)`` when the ``dot_general`` is an op's matmul with operand ``x_pos`` (default
    `x_position`) as x, else ``(None, why not)``. ``rounded``: its result is cast straight back
    to the operand dtype, so a wider ``preferred_element_type`` is what the ops compute."""
    x_pos = x_position(eqn) if x_pos is None else x_pos
    xa, wa = eqn.invars[x_pos].aval, eqn.invars[1 - x_pos].aval
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if x_pos:
        lc, rc = rc, lc
    lc, rc = tuple(lc), tuple(rc)
    if lb or rb:
        return None, "the matmul has batch dimensions (the ops take x [..., K] and a single w)"
    c = len(lc)
    if not c:
        return None, "the matmul contracts no dimension (an outer product)"
    if not trailing_contraction(eqn, x_pos):
        return None, (
            f"x is contracted on dimensions {lc} of {xa.str_short(short_dtypes=True)}, not on "
            "its last one(s) after a leading one (x must be [..., K...]); transpose x so the "
            "contracted dims come last"
        )
    if wa.ndim == c:
        return None, "the weight has no free dimension (a matrix-vector product)"
    # w's contracted dims in the order of x's, then its free dims in order.
    pairs = dict(zip(lc, rc, strict=True))
    order = tuple(pairs[d] for d in range(xa.ndim - c, xa.ndim))
    free = tuple(d for d in range(wa.ndim) if d not in rc)
    perm = order + free
    problem = dtype_problem(eqn, rounded)
    if problem:
        return None, problem
    promote = eqn.params.get("preferred_element_type") if xa.dtype != wa.dtype else None
    view = DotView(
        lead=tuple(xa.shape[: xa.ndim - c]),
        k_shape=tuple(xa.shape[xa.ndim - c :]),
        w_perm=None if perm == tuple(range(wa.ndim)) else perm,
        n_shape=tuple(wa.shape[d] for d in free),
        swapped=bool(x_pos),
        promote=None if promote is None else np.dtype(promote),
    )
    return view, None


def dtype_problem(eqn, rounded: bool = False) -> str | None:
    """Why the matmul's dtypes, precision or sharding differ from what the ops compute.

    ``rounded``: the result is cast back to the operand dtype right away. A wider
    ``preferred_element_type`` then only says "accumulate in it and round once", which is what
    the ops do (f32 accumulation, a result in the operand dtype)."""
    xa, wa = (v.aval for v in eqn.invars)
    pet = eqn.params.get("preferred_element_type")
    if xa.dtype != wa.dtype:
        # jnp.matmul of mixed float dtypes: a dot_general of the promoted dtype, which casting
        # both operands to it (exactly: a widening cast) computes the same.
        promoted = jnp.promote_types(xa.dtype, wa.dtype)
        floats = all(jnp.issubdtype(a.dtype, jnp.floating) for a in (xa, wa))
        if not floats or pet is None or np.dtype(pet) != promoted:
            return (f"the operands have different dtypes ({xa.dtype} and {wa.dtype}) and the "
                    "result is not their promoted dtype")  # fmt: skip
        xa = xa.update(dtype=promoted)  # the checks below are the promoted matmul's
    if not jnp.issubdtype(xa.dtype, jnp.floating):
        return f"dtype {xa.dtype} is not floating point (the ops are float-only)"
    if not is_default_precision(eqn.params.get("precision")):
        return (
            f"precision={eqn.params['precision']} (the ops run the matmul at default precision, "
            "which may differ); drop precision= to let overlap rewrite it"
        )
    if pet is not None and np.dtype(pet) != xa.dtype and not rounded:
        return (
            f"preferred_element_type={np.dtype(pet)} with {xa.dtype} operands: the ops return "
            f"{xa.dtype} and communicate {xa.dtype} partials, so an {np.dtype(pet)} result would "
            "lose the precision it asks for; cast the matmul's result back to "
            f"{xa.dtype} before the collective (or drop preferred_element_type: the ops "
            "accumulate in f32 and round once) if that is acceptable"
        )
    sharding = eqn.params.get("out_sharding")
    if sharding is not None and any(e is not None for e in getattr(sharding, "spec", (0,))):
        # (Backward-pass matmuls inside shard_map carry a fully replicated one: a no-op.)
        return f"the matmul carries an explicit out_sharding {sharding}"
    return None


def map_dim(src, dst, d, n) -> int | None:
    """The dim of shape ``dst`` whose tiled split over ``n`` ranks equals splitting dim ``d`` of
    ``src`` (``src`` and ``dst`` hold the same elements, row-major), or None."""
    prefix = math.prod(src[:d])
    for d2 in range(len(dst)):
        if math.prod(dst[:d2]) == prefix and dst[d2] % n == 0 and dst[d2] > 0:
            return d2
        if math.prod(dst[:d2]) > prefix:
            break
    return None


def local(shape, d, n) -> tuple[int, ...]:
    """``shape`` with dim ``d`` divided by ``n`` (None: unchanged)."""
    if d is None:
        return tuple(shape)
    return tuple(s // n if i == d else s for i, s in enumerate(shape))
