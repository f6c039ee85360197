"""Every op equals its lax composition: values and gradients, on every mesh, dtype and shape.

Runs on 8 fake CPU devices. On CPU the ops lower to the reference composition, so these tests
pin down the op *definitions*: shapes, varying-axes typing, the sharding of results, and the
hand-written transposes (d/dx of one op is its sibling op), against JAX's own autodiff of the
composition.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    GRAD_TOL,
    TOL,
    P,
    assert_close,
    axis_size,
    make_mesh,
    normal,
    place,
    random,
    spec_entry,
)

import jaxoverlap
from jaxoverlap import reference

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
MESH_AXES = [
    ("tp2", ("tp",)),
    ("tp4", ("tp",)),
    ("tp8", ("tp",)),
    ("dp2_tp4", ("tp",)),
    ("dp2_tp4", ("dp",)),
    ("tp4_dp2_permuted", ("tp",)),
    ("tp4_dp2_permuted", ("dp",)),
    ("dp2_tp4", ("dp", "tp")),
]


def _spec(ndim, where, axes):
    entries = [None] * ndim
    entries[where] = spec_entry(axes)
    return P(*entries)


# Each case: local x shape, local w shape, the op's dim argument, and where x, w and the
# result are sharded over the op's axes (x/w: the contracted K for reductions; the gathered
# dim of x and N of w for all_gather_matmul).
CASES = {
    "matmul_reduce_scatter": {
        "2d_rows": ((16, 8), (8, 24), 0),
        "2d_cols": ((16, 8), (8, 24), 1),
        "batch_mid": ((3, 16, 8), (8, 12), 1),
        "batch_lead": ((8, 5, 8), (8, 12), 0),
        "batch_cols": ((3, 5, 8), (8, 16), 2),
    },
    "all_gather_matmul": {
        "2d": ((6, 8), (8, 12), 0),
        "batch_mid": ((3, 5, 8), (8, 12), 1),
        "batch_lead": ((2, 5, 8), (8, 12), 0),
    },
    "matmul_all_reduce": {
        "2d": ((6, 8), (8, 12), None),
        "batch": ((3, 5, 8), (8, 12), None),
    },
}


def _problem(op, case, mesh, axes):
    """(op_fn, ref_fn, local shapes, in_specs, out_spec) for one case."""
    xs, ws, d = CASES[op][case]
    out_nd = len(xs)
    if op == "matmul_reduce_scatter":
        kw = dict(scatter_dimension=d)
        in_specs = (_spec(len(xs), -1, axes), _spec(2, 0, axes))
        out_spec = _spec(out_nd, d, axes)
    elif op == "all_gather_matmul":
        kw = dict(gather_dimension=d)
        in_specs = (_spec(len(xs), d, axes), _spec(2, 1, axes))
        out_spec = _spec(out_nd, -1, axes)
    else:
        kw = {}
        in_specs = (_spec(len(xs), -1, axes), _spec(2, 0, axes))
        out_spec = P()
    op_fn = functools.partial(getattr(jaxoverlap, op), axis_name=axes, **kw)
    ref_fn = functools.partial(getattr(reference, op), axis_name=axes, **kw)
    return op_fn, ref_fn, (xs, ws), in_specs, out_spec


def _global_shape(local, spec, mesh):
    return tuple(
        s * (axis_size(mesh, e if isinstance(e, tuple) else (e,)) if e is not None else 1)
        for s, e in zip(local, spec)
    )


def _value_and_grad(mesh, fn, in_specs, out_spec, x, w, ct):
    """Forward value, and grad of <fn(x, w), ct> w.r.t. x and w (traced: call it under jit)."""
    mapped = jax.shard_map(lambda x, w: fn(x, w), mesh=mesh, in_specs=in_specs, out_specs=out_spec)

    def loss(x, w):
        out = mapped(x, w)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    return out, grads


def _run_all(mesh, op_fn, ref_fn, in_specs, out_spec, x, w, ct):
    """The op's value and grads, the reference's in the same dtype, and the reference's grads in
    float32: one jitted program (one compile instead of three; each part is its own shard_map,
    so the op's hand-written transposes are still what its grads run)."""

    def all_three(x, w, ct):
        x32, w32 = (a.astype(jnp.float32) for a in (x, w))
        return (
            _value_and_grad(mesh, op_fn, in_specs, out_spec, x, w, ct),
            _value_and_grad(mesh, ref_fn, in_specs, out_spec, x, w, ct),
            _value_and_grad(mesh, ref_fn, in_specs, out_spec, x32, w32, ct)[1],
        )

    with jax.set_mesh(mesh):
        return jax.jit(all_three)(x, w, ct)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("mesh_name,axes", MESH_AXES, ids=lambda v: str(v))
@pytest.mark.parametrize(
    "op,case", [(op, case) for op in CASES for case in CASES[op]], ids=lambda v: str(v)
)
def test_values_and_grads_match_reference(op, case, mesh_name, axes, dtype):
    mesh = make_mesh(mesh_name)
    op_fn, ref_fn, (xs, ws), in_specs, out_spec = _problem(op, case, mesh, axes)
    seed = zlib.crc32(repr((op, case, mesh_name, axes, jnp.dtype(dtype).name)).encode())
    kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
    x = random(kx, _global_shape(xs, in_specs[0], mesh), dtype)
    w = random(kw, _global_shape(ws, in_specs[1], mesh), dtype)
    x, w = place(mesh, (x, w), in_specs)

    ct = _ct(kc, mesh, ref_fn, in_specs, out_spec, x, w)
    # Gradients are checked against the reference's gradient computed in float32: XLA:CPU's
    # low-precision dots round every partial sum, so the same-dtype reference gradient is itself
    # off by more than the op is.
    # The op may round like the same-dtype reference (it computes what JAX's own autodiff of the
    # reference computes): allowed that reference's own error on top of the tolerance.
    (out, grads), (ref_out, ref_grads_lp), ref_grads = _run_all(
        mesh, op_fn, ref_fn, in_specs, out_spec, x, w, ct
    )

    assert out.dtype == ref_out.dtype == dtype
    assert out.sharding.spec == ref_out.sharding.spec
    assert_close(out, ref_out, TOL[dtype], f"{op} value")
    for name, g, rg, rg_lp in zip(("dx", "dw"), grads, ref_grads, ref_grads_lp):
        assert g.dtype == dtype
        ref_err = float(np.max(np.abs(np.asarray(rg_lp, np.float32) - np.asarray(rg, np.float32))))
        tol = dict(GRAD_TOL[dtype], atol=GRAD_TOL[dtype]["atol"] + ref_err)
        assert_close(g, rg, tol, f"{op} {name}")


def _ct(key, mesh, ref_fn, in_specs, out_spec, x, w):
    shape = jax.eval_shape(
        jax.shard_map(ref_fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec), x, w
    ).shape
    return normal(key, shape)


@pytest.mark.parametrize("op", list(CASES))
def test_reference_equals_unsharded_math(op):
    """The oracle itself: the reference composition equals the unsharded float64 computation."""
    mesh = make_mesh("tp4")
    axes = ("tp",)
    case = next(iter(CASES[op]))
    _, ref_fn, (xs, ws), in_specs, out_spec = _problem(op, case, mesh, axes)
    x = random(jax.random.key(1), _global_shape(xs, in_specs[0], mesh), jnp.float32)
    w = random(jax.random.key(2), _global_shape(ws, in_specs[1], mesh), jnp.float32)
    xg, wg = place(mesh, (x, w), in_specs)
    with jax.set_mesh(mesh):
        out = jax.jit(jax.shard_map(ref_fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec))(
            xg, wg
        )
    xn, wn = np.asarray(x, np.float64), np.asarray(w, np.float64)
    # all_gather_matmul: the gathered x times each device's column block of w; the reductions:
    # the sum over devices of x_k @ w_k. Both are the unsharded product.
    expected = xn @ wn
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-5, atol=1e-5)
