"""`jaxoverlap.matmul` on meshes with Explicit axes (``jax.make_mesh``'s default in jax 0.12):
the op is picked from the operands' sharding types and ``out_sharding``, with no model rewrite.

On 4 fake CPU devices: values and gradients equal ``x @ w``, the result has the sharding asked
for, and the traced program holds the op (and not the collective it replaces).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap

TOL = dict(rtol=1e-5, atol=1e-5)
OPS = ("matmul_reduce_scatter", "matmul_all_reduce", "all_gather_matmul")


def _mesh():
    return jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:4])  # fmt: skip


# x spec, w spec, out_sharding, the op picked, the result's spec
CASES = {
    "row_parallel_reduce_scatter": (P("dp", "tp"), P("tp", None), P(("dp", "tp"), None),
                                    "matmul_reduce_scatter", P(("dp", "tp"), None)),
    "row_parallel_default_all_reduce": (P("dp", "tp"), P("tp", None), None,
                                        "matmul_all_reduce", P("dp", None)),
    "sequence_parallel_gather": (P("tp", None), P(None, "tp"), P(None, "tp"),
                                 "all_gather_matmul", P(None, "tp")),
    "column_parallel_local": (P("dp", None), P(None, "tp"), None, None, P("dp", "tp")),
    "batch_sequence_reduce_scatter": (P("dp", None, "tp"), P("tp", None), P("dp", "tp", None),
                                      "matmul_reduce_scatter", P("dp", "tp", None)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_explicit_mesh(case):
    x_spec, w_spec, out, op, result_spec = CASES[case]
    mesh = _mesh()
    kx, kw = jax.random.split(jax.random.key(3))
    xn = np.asarray(jax.random.normal(kx, (2, 8, 16)[3 - len(x_spec) :]))
    wn = np.asarray(jax.random.normal(kw, (16, 12)) / 4)
    x = jax.device_put(xn, NamedSharding(mesh, x_spec))
    w = jax.device_put(wn, NamedSharding(mesh, w_spec))

    def f(x, w):
        return jaxoverlap.matmul(x, w, out_sharding=out)

    with jax.set_mesh(mesh):
        y = jax.jit(f)(x, w)
        np.testing.assert_allclose(y, xn @ wn, **TOL)
        assert y.sharding.spec == result_spec, y.sharding
        text = str(jax.make_jaxpr(f)(x, w))
        assert [o for o in OPS if o in text] == ([op] if op else []), text

        def loss(x, w):
            return jnp.sum(jnp.sin(f(x, w)))

        got = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), (0, 1))(xn, wn)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, **TOL)


def test_auto_mesh_out_sharding_is_a_constraint():
    """On Auto axes ``out_sharding`` constrains the result: a row-parallel reduce-scatter."""
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, "tp")))
    w = jax.device_put(jnp.ones((16, 12)), NamedSharding(mesh, P("tp", None)))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x, w: jaxoverlap.matmul(x, w, out_sharding=P("tp", None)))(x, w)
    np.testing.assert_allclose(y, np.full((8, 12), 16.0), **TOL)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("tp", None)), 2), y.sharding
