"""Helpers and model fragments shared by the `jaxoverlap.overlap` tests."""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import collections  # noqa: E402

import jax  # noqa: E402
import jax.extend  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxoverlap.overlap import overlap  # noqa: E402

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
COLLECTIVE = {
    "matmul_reduce_scatter": "reduce_scatter",
    "all_gather_matmul": "all_gather",
    "matmul_all_reduce": "psum_invariant",
}


def mesh_2d():
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


# Internal variants counted as the op they implement: all_gather_matmul with several weights is
# the variant that returns the gathered x (one per gather).
VARIANT_OF = {"all_gather_matmul_keep": "all_gather_matmul"}


def prims(closed) -> collections.Counter:
    """Primitive names in a jaxpr and every jaxpr nested in it (variants as their op)."""
    out = collections.Counter()

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            out[VARIANT_OF.get(eqn.primitive.name, eqn.primitive.name)] += 1
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        visit(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        visit(sub)

    visit(closed.jaxpr)
    return out


def inputs(mesh, shapes_specs, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), len(shapes_specs))
    return [
        jax.device_put(
            (jax.random.normal(k, shape) / np.sqrt(shape[-1])).astype(dtype),
            NamedSharding(mesh, spec),
        )
        for k, (shape, spec) in zip(keys, shapes_specs)
    ]


def loss_of(fn):
    def loss(*args):
        return sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in jax.tree.leaves(fn(*args)))

    return loss


def assert_tree_close(a, b, tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), **tol)


def check_rewrite(fn, args, ops, dtype=jnp.float32, grad=True):
    """overlap(fn) has each op in ``ops`` (and not the collectives they replace), equal values
    and gradients."""
    new = overlap(fn)
    before, after = prims(jax.make_jaxpr(fn)(*args)), prims(jax.make_jaxpr(new)(*args))
    for op in ops:
        assert after[op] == before[COLLECTIVE[op]] > 0, (op, before, after)
        assert after[COLLECTIVE[op]] == 0, (op, after)
    argnums = tuple(range(len(args)))

    def both(*args):  # one compile for the four: values and gradients of the rewrite and of fn
        values = new(*args), fn(*args)
        if not grad:
            return values
        return values + (
            jax.grad(loss_of(new), argnums)(*args),
            jax.grad(loss_of(fn), argnums)(*args),
        )

    got, want, *grads = jax.jit(both)(*args)
    assert_tree_close(got, want, TOL[dtype])
    if grad:
        assert_tree_close(*grads, TOL[dtype])
    return new


def mesh_1d():
    return jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])


# ----------------------------------------------------------------------------- the three patterns


def rs_case(axes=("tp",), dtype=jnp.float32):
    """Row-parallel linear, result scattered along the sequence dim of x [B, S, K]."""
    mesh = mesh_2d()
    spec = axes[0] if len(axes) == 1 else axes
    x, w = inputs(mesh, [((2, 16, 64), P(None, None, spec)), ((64, 24), P(spec, None))], dtype)

    def body(x, w):
        return lax.psum_scatter(x @ w, axes, scatter_dimension=1, tiled=True)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, None, spec), P(spec, None)),
                      out_specs=P(None, spec, None))  # fmt: skip
    return f, (x, w)


def ag_case():
    """Sequence-parallel column linear: gather x [S/t, K], multiply by w [K, N/t]."""
    mesh = mesh_2d()
    x, w = inputs(mesh, [((32, 16), P("tp", None)), ((16, 48), P(None, "tp"))])

    def body(x, w):
        return jnp.matmul(lax.all_gather(x, "tp", axis=0, tiled=True), w)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                      out_specs=P(None, "tp"))  # fmt: skip
    return f, (x, w)


def ar_case():
    mesh = mesh_2d()
    x, w = inputs(mesh, [((8, 64), P("dp", "tp")), ((64, 16), P("tp", None))])

    def body(x, w):
        return lax.psum(jnp.dot(x, w), "tp")

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None)),
                      out_specs=P("dp", None))  # fmt: skip
    return f, (x, w)


def sp_layers():
    """A stack of sequence-parallel MLP layers: x [S/t, D] -> AG @ w1 -> gelu -> @ w2 -> RS."""
    mesh = mesh_2d()
    specs = (P("tp", None), P(None, None, "tp"), P(None, "tp", None))
    args = inputs(mesh, [((32, 16), specs[0]), ((3, 16, 32), specs[1]), ((3, 32, 16), specs[2])])

    def layer(x, w1, w2):
        h = jax.nn.gelu(jnp.matmul(lax.all_gather(x, "tp", axis=0, tiled=True), w1))
        return lax.psum_scatter(h @ w2, "tp", scatter_dimension=0, tiled=True)

    def mapped(body):
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp", None))

    return mesh, layer, mapped, args
