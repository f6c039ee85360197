"""`matmul`: a global-view ``x @ w`` that partitions itself onto the jaxoverlap ops under ``jit``.

``jaxoverlap.matmul(x, w)`` is registered with ``jax.experimental.custom_partitioning`` and a
Shardy sharding rule (``... k, k n -> ... n``, ``k`` a reduction factor). When XLA partitions the
jitted program, the callback `plan` looks at the operand shardings and the sharding requested for
the result and picks, per device:

* ``x [.., K/t]`` and ``w [K/t, N]``, result sharded on ``t`` along a dim -> matmul_reduce_scatter
* the same, result not sharded on ``t`` -> matmul_all_reduce (row-parallel)
* ``x [S/t, K]`` and result ``[S, ..]`` gathered on that dim -> all_gather_matmul (column-parallel
  with a sequence-sharded input)
* otherwise a local matmul (column-parallel ``w [K, N/t]``, data-parallel ``x``, replicated)

On meshes with Explicit axes the operands' types carry their shardings: `plan` runs at trace time
on them and ``out_sharding``, and the op runs in a ``jax.shard_map`` (`_explicit_matmul`).

Caveats (also in docs/automatic-overlap.md): custom_partitioning is experimental in JAX; the
compiled program embeds a Python callback, which defeats the persistent compilation cache; Shardy
cannot infer that a reduce-scatter changes the result's sharding, so constrain the result
(``jax.lax.with_sharding_constraint`` or ``out_shardings``) to get matmul_reduce_scatter. Under
``vmap`` a batched ``x`` is one more leading dimension; batched weights fall back to XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec, use_abstract_mesh

from jaxoverlap import ops
from jaxoverlap.config import Config

__all__ = ["Plan", "matmul", "plan"]

Spec = tuple[tuple[str, ...], ...]  # one tuple of mesh axes per array dimension


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one device computes its block of ``x @ w``.

    Attributes:
      kind: ``"matmul_reduce_scatter"``, ``"matmul_all_reduce"``, ``"all_gather_matmul"`` or
        ``"local"``.
      x_spec, w_spec: the operand shardings the op needs (the partitioner reshards to them).
      out_spec: the sharding of the result it produces.
      axes: the mesh axes of the collective (empty for ``"local"``).
      dim: the scattered/gathered dimension (``None`` for all-reduce and local).
    """

    kind: str
    x_spec: Spec
    w_spec: Spec
    out_spec: Spec
    axes: tuple[str, ...] = ()
    dim: int | None = None


def _norm(spec, ndim) -> Spec:
    """A PartitionSpec as one tuple of axis names per dimension (unconstrained = unsharded)."""
    entries = tuple(spec) if spec is not None else ()
    out = []
    for i in range(ndim):
        e = entries[i] if i < len(entries) else None
        if isinstance(e, str):
            out.append((e,))
        elif isinstance(e, tuple):
            out.append(tuple(a for a in e if isinstance(a, str)))
        else:
            out.append(())
    return tuple(out)


def plan(x_shape, w_shape, x_spec, w_spec, out_spec, axis_sizes) -> Plan:
    """Choose the op and shardings for ``x @ w`` from operand and requested result shardings.

    ``*_spec`` are PartitionSpecs (or `Spec` tuples); ``axis_sizes`` maps mesh axis -> size.
    Pure: it only decides, so it can be tested without compiling.
    """
    lead_n = len(x_shape) - 1
    xs, ws = _norm(x_spec, len(x_shape)), _norm(w_spec, 2)
    outs = _norm(out_spec, lead_n + 1)
    size = lambda axes: math.prod(axis_sizes[a] for a in axes)  # noqa: E731
    out_shape = (*x_shape[:-1], w_shape[1])

    k = xs[lead_n] or ws[0]  # the contraction is sharded like x's K (or, failing that, w's)
    lead = [tuple(a for a in d if a not in k) for d in xs[:lead_n]]
    n = tuple(a for a in ws[1] if a not in k)

    if not k:
        # Gather a leading dim of x when the result wants it less sharded (e.g. sequence
        # parallel: x [S/t, K] -> result [S, N/t]). The gathered axes are the minor ones.
        for d in range(lead_n):
            keep = outs[d]
            if len(keep) >= len(lead[d]) or lead[d][: len(keep)] != keep:
                continue
            gather = lead[d][len(keep) :]
            lead[d] = keep
            lead, n = _resolve(lead, n, outs[lead_n])
            x_in = tuple(lead[i] + gather if i == d else lead[i] for i in range(lead_n))
            return Plan("all_gather_matmul", (*x_in, ()), ((), n), (*lead, n), gather, d)
        lead, n = _resolve(lead, n, outs[lead_n])
        return Plan("local", (*lead, ()), ((), n), (*lead, n))

    lead, n = _resolve(lead, n, outs[lead_n])
    base = (*lead, n)
    x_new, w_new = (*lead, k), (k, n)
    for d in range(lead_n + 1):
        local = out_shape[d] // size(base[d])
        if outs[d] == base[d] + k and local % size(k) == 0:
            out = tuple(base[i] + k if i == d else base[i] for i in range(lead_n + 1))
            return Plan("matmul_reduce_scatter", x_new, w_new, out, k, d)
    return Plan("matmul_all_reduce", x_new, w_new, base, k)


def _resolve(lead, n, out_n):
    """An axis may not shard both a leading dim and N of the result: keep what the result wants."""
    clash = {a for d in lead for a in d} & set(n)
    if not clash:
        return list(lead), n
    if any(a in out_n for a in clash):  # result wants N sharded: x's leading dim gets gathered
        return [tuple(a for a in d if a not in clash) for d in lead], n
    return list(lead), tuple(a for a in n if a not in clash)  # else w's N gets gathered


# ----------------------------------------------------------------------------- custom_partitioning


def _local(x, w, config):
    del config
    return jnp.matmul(x, w)


def _apply(p: Plan, x, w, config):
    if p.kind == "matmul_reduce_scatter":
        return ops.matmul_reduce_scatter(x, w, p.axes, scatter_dimension=p.dim, config=config)
    if p.kind == "matmul_all_reduce":
        return ops.matmul_all_reduce(x, w, p.axes, config=config)
    if p.kind == "all_gather_matmul":
        return ops.all_gather_matmul(x, w, p.axes, gather_dimension=p.dim, config=config)
    return jnp.matmul(x, w)


def _partition(config, mesh, arg_shapes, result_shape):
    x, w = arg_shapes
    specs = [getattr(a.sharding, "spec", None) for a in (x, w, result_shape)]
    p = plan(x.shape, w.shape, *specs, dict(mesh.shape))
    manual = mesh.abstract_mesh.update_axis_types({a: AxisType.Manual for a in mesh.axis_names})

    def lower_fn(x, w):
        # custom_partitioning binds the mesh axes but leaves the abstract mesh as it was; the ops
        # check that their axes are manual shard_map axes, which they are here.
        with use_abstract_mesh(manual):
            return _apply(p, x, w, config)

    named = lambda s: NamedSharding(mesh, PartitionSpec(*(e or None for e in s)))  # noqa: E731
    return mesh, lower_fn, named(p.out_spec), (named(p.x_spec), named(p.w_spec))


_cp_matmul = custom_partitioning(_local, static_argnums=(2,))
_cp_matmul.def_partition(
    partition=_partition, sharding_rule="... k, k n -> ... n", reduction_factors=("k",)
)


@functools.cache
def _batchable(config):
    """``_cp_matmul`` with a vmap rule (custom_partitioning has none), one per config."""

    @jax.custom_batching.custom_vmap
    def mm(x, w):
        return _cp_matmul(x, w, config)

    @mm.def_vmap
    def _rule(axis_size, in_batched, x, w):
        x_batched, w_batched = in_batched  # batch dims are moved to the front
        if not w_batched:  # one weight: the batch is one more leading dim of x
            return mm(x, w), True
        if not x_batched:
            x = jnp.broadcast_to(x, (axis_size, *x.shape))
        # A weight per batch element is no single GEMM: leave it to XLA.
        return jnp.einsum("b...k,bkn->b...n", x, w), True

    return mm


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, w, config):
    return _batchable(config)(x, w)


def _matmul_fwd(x, w, config):
    return _batchable(config)(x, w), (x, w)


def _matmul_bwd(config, res, g):
    x, w = res
    dx = _batchable(config)(g, jnp.transpose(w))  # column- and row-parallel swap roles
    lead = tuple(range(x.ndim - 1))
    dw = lax.dot_general(x, g, ((lead, lead), ((), ())))
    return dx, dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x, w, *, out_sharding=None, config: Config | None = None):
    """``x @ w`` for global-view ``jit`` code, partitioned onto the jaxoverlap ops.

    Args:
      x: ``[..., K]`` global array; leading dims may be sharded (data/sequence parallel), and K
        (row-parallel).
      w: ``[K, N]`` global weight, sharded on N (column-parallel) or K (row-parallel).
      out_sharding: the result's sharding, a ``PartitionSpec`` or ``NamedSharding`` (as for
        ``jnp.matmul(..., out_sharding=)``); ``None``: x's leading dims and w's N as they are.
        A dim sharded over the K axes asks for a reduce-scatter.
      config: a `jaxoverlap.Config` for the ops it picks (``None``: defaults).

    Returns:
      ``x @ w`` (``[..., N]``, in the dtype ``jnp.matmul`` promotes ``x`` and ``w`` to: mixed
      dtypes are cast to it first, exactly, as a widening cast). On meshes with Explicit axes
      (``jax.make_mesh``'s default in jax 0.12) the operands' types say how they are sharded,
      and the op is chosen at trace time (`plan`) and run in a ``jax.shard_map``. On Auto axes
      it is chosen when XLA partitions the program (custom_partitioning); ``out_sharding`` is
      then a sharding constraint on the result (without it, a row-parallel result is an
      all-reduce).
    """
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"jaxoverlap.matmul: config must be a jaxoverlap.Config, got {config!r}.")
    xs, ws = jnp.shape(x), jnp.shape(w)
    if len(ws) != 2 or len(xs) < 1 or xs[-1] != ws[0]:
        raise ValueError(
            f"jaxoverlap.matmul: expected x [..., K] and w [K, N], got x {xs} and w {ws}."
        )
    dtype = jnp.result_type(x, w)  # mixed dtypes: promoted as jnp.matmul promotes them
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"jaxoverlap.matmul: x has dtype {jnp.result_type(x)} and w {jnp.result_type(w)}; "
            "the ops compute in a float dtype: cast them with .astype(jnp.float32) or bf16."
        )
    x, w = (a if jnp.result_type(a) == dtype else a.astype(dtype) for a in (x, w))
    out_spec = getattr(out_sharding, "spec", out_sharding)
    mesh = _explicit_mesh(x, w)
    if mesh is not None:
        return _explicit_matmul(mesh, x, w, out_spec, config)
    y = _matmul(x, w, config)
    # A NamedSharding carries its mesh; a bare PartitionSpec needs the context mesh.
    return y if out_sharding is None else lax.with_sharding_constraint(y, out_sharding)


def _explicit_mesh(x, w):
    """The abstract mesh when an operand's type carries an Explicit sharding, else None."""
    meshes = []
    for name, a in (("x", x), ("w", w)):
        sharding = jax.typeof(a).sharding
        if any(e is not None for e in getattr(sharding, "spec", ())):
            meshes.append((name, sharding.mesh))
    if not meshes:
        return None
    (name, mesh), *others = meshes
    if any(m != mesh for _, m in others):
        raise ValueError("jaxoverlap.matmul: x and w are sharded over different meshes.")
    if not all(t == AxisType.Explicit for t in mesh.axis_types):
        raise ValueError(
            f"jaxoverlap.matmul: {name} is sharded over a mesh that mixes Explicit and other "
            f"axis types ({dict(zip(mesh.axis_names, mesh.axis_types, strict=True))}); use a "
            "mesh whose axes are all Explicit or all Auto, or call the jaxoverlap ops inside "
            "jax.shard_map."
        )
    return mesh


def _explicit_matmul(mesh, x, w, out_spec, config):
    """Explicit axes: pick the op from the operands' types and run it in a shard_map."""
    x_spec, w_spec = (jax.typeof(a).sharding.spec for a in (x, w))
    xn, wn = _norm(x_spec, x.ndim), _norm(w_spec, 2)
    if out_spec is None:  # what jnp.matmul gives: x's leading dims, w's N (K reduced away)
        k = set(xn[-1] or wn[0])
        out_spec = (*(tuple(a for a in d if a not in k) for d in xn[:-1]),
                    tuple(a for a in wn[1] if a not in k))  # fmt: skip
    p = plan(x.shape, w.shape, x_spec, w_spec, out_spec, dict(mesh.shape))
    spec = lambda s: PartitionSpec(*(e or None for e in s))  # noqa: E731
    body = functools.partial(_apply, p, config=config)
    with use_abstract_mesh(mesh):  # (PartitionSpecs below refer to the operands' mesh)
        x = jax.sharding.reshard(x, spec(p.x_spec))
        w = jax.sharding.reshard(w, spec(p.w_spec))
        y = jax.shard_map(body, mesh=mesh, in_specs=(spec(p.x_spec), spec(p.w_spec)),
                          out_specs=spec(p.out_spec))(x, w)  # fmt: skip
        want = spec(_norm(out_spec, y.ndim))
        return y if want == spec(p.out_spec) else jax.sharding.reshard(y, want)
