"""``all_gather_matmul(x, w, gather_dimension=x.ndim - 1)``: x sharded over the contracted K.

Equals ``all_gather(x, axis=-1, tiled=True) @ w`` with w the whole ``[K, N]``: values, gradients
(d/dx is a ``matmul_reduce_scatter`` over the last dimension), vmap, on fake CPU devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from harness import GRAD_TOL, TOL, P, assert_close, make_mesh, place, random
from jax import lax

import jaxoverlap
from jaxoverlap import reference


def _fns(mesh, x_ndim):
    x_spec = P(*([None] * (x_ndim - 1)), "tp")
    out = x_spec  # w's N is sharded too (column-parallel): each rank has its own columns

    def op(x, w):
        return jaxoverlap.all_gather_matmul(x, w, "tp", gather_dimension=x.ndim - 1)

    def ref(x, w):
        return reference.all_gather_matmul(x, w, "tp", gather_dimension=x.ndim - 1)

    def sm(f):
        return jax.shard_map(f, mesh=mesh, in_specs=(x_spec, P(None, "tp")), out_specs=out)

    return sm(op), sm(ref), x_spec


@pytest.mark.parametrize("x_shape,dtype", [((8, 32), jnp.float32), ((2, 6, 32), jnp.bfloat16)])
def test_values_and_gradients(x_shape, dtype):
    mesh = make_mesh("tp4")
    op, ref, x_spec = _fns(mesh, len(x_shape))
    kx, kw = jax.random.split(jax.random.key(1))
    x, w = place(mesh, [random(kx, x_shape, dtype), random(kw, (32, 16), dtype)],
                 [x_spec, P(None, "tp")])  # fmt: skip
    with jax.set_mesh(mesh):
        assert_close(jax.jit(op)(x, w), jax.jit(ref)(x, w), TOL[dtype])
        assert_close(jax.jit(op)(x, w), jnp.matmul(x, w), TOL[dtype], "vs the global matmul")

        def loss(f):
            return lambda x, w: jnp.sum(jnp.sin(f(x, w).astype(jnp.float32)))

        got = jax.jit(jax.grad(loss(op), (0, 1)))(x, w)
        want = jax.jit(jax.grad(loss(ref), (0, 1)))(x, w)
        for a, b in zip(got, want, strict=True):
            assert_close(a, b, GRAD_TOL[dtype])
        jaxpr = jax.make_jaxpr(jax.grad(loss(op), (0, 1)))(x, w)
        assert "matmul_reduce_scatter" in str(jaxpr)  # d/dx is the sibling op, over the last dim


def test_vmap():
    mesh = make_mesh("tp4")
    kx, kw = jax.random.split(jax.random.key(2))
    x = random(kx, (3, 8, 32), jnp.float32)
    w = random(kw, (3, 32, 16), jnp.float32)

    def body(x, w):
        ag = lambda x, w: jaxoverlap.all_gather_matmul(x, w, "tp", gather_dimension=1)  # noqa: E731
        return jax.vmap(ag)(x, w), jax.vmap(ag, (0, None))(x, w[0])

    def ref(x, w):
        g = lax.all_gather(x, "tp", axis=2, tiled=True)
        return jnp.einsum("bmk,bkn->bmn", g, w), g @ w[0]

    specs = dict(mesh=mesh, in_specs=(P(None, None, "tp"), P(None, None, "tp")),
                 out_specs=(P(None, None, "tp"), P(None, None, "tp")))  # fmt: skip
    x, w = place(mesh, [x, w], [P(None, None, "tp"), P(None, None, "tp")])
    with jax.set_mesh(mesh):
        got = jax.jit(jax.shard_map(body, **specs))(x, w)
        want = jax.jit(jax.shard_map(ref, **specs))(x, w)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, TOL[jnp.float32])


def test_the_variant_returning_x_is_refused_along_k_by_the_decision():
    """Along K the all-gather that also returns x (a trained weight's forward) has no fused
    kernel: the one decision function says so at trace time, so explain, the tuner and lowering
    agree (before, only lowering refused it, and explain named the K-gather kernel)."""
    import jax
    import jax.numpy as jnp

    from jaxoverlap import Config
    from jaxoverlap.fused import dispatch

    x = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)
    for backend in ("auto", "fused"):
        params = {"config": Config(backend=backend), "gather_dimension": 1}
        why = dispatch.unsupported_reason("all_gather_matmul", x, w, params, 2, keep_gathered=True)
        assert why and "along K" in why and "returns x" in why, why
        plain = dispatch.unsupported_reason("all_gather_matmul", x, w, params, 2)
        assert not plain or "returns x" not in plain, plain  # the plain K-gather: its own rules
