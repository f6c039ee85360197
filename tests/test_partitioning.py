"""`jaxoverlap.matmul` under jit on 8 fake CPU devices, and its partitioning plan.

For the Megatron cases (column-parallel, row-parallel with reduce-scatter or all-reduce result,
sequence-parallel all-gather, replicated) on 1-D and 2-D meshes: values and gradients equal
``x @ w``, the result has the expected sharding, the partition callback picked the expected
jaxoverlap op, and the compiled program holds only that op's collective.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxoverlap  # noqa: E402
from jaxoverlap import partitioning  # noqa: E402
from jaxoverlap.partitioning import matmul, plan  # noqa: E402

TOL = dict(rtol=2e-5, atol=2e-5)
SIZES = {"dp": 2, "tp": 4}

# ----------------------------------------------------------------------------- plan (no compile)

PLANS = [
    # x shape, x spec, w spec, requested result spec -> kind, axes, dim, result spec
    ((16, 32), P(None, "tp"), P("tp", None), P("tp", None),
     "matmul_reduce_scatter", ("tp",), 0, P("tp", None)),
    ((16, 32), P(None, "tp"), P("tp", None), P(None, "tp"),
     "matmul_reduce_scatter", ("tp",), 1, P(None, "tp")),
    ((16, 32), P(None, "tp"), P("tp", None), P(),
     "matmul_all_reduce", ("tp",), None, P()),
    ((16, 32), P(None, "tp"), None, P(),  # w's K follows x's K
     "matmul_all_reduce", ("tp",), None, P()),
    ((16, 32), P("dp", "tp"), P("tp", None), P(("dp", "tp"), None),
     "matmul_reduce_scatter", ("tp",), 0, P(("dp", "tp"), None)),
    ((16, 32), P(None, ("dp", "tp")), P(("dp", "tp"), None), P(("dp", "tp")),
     "matmul_reduce_scatter", ("dp", "tp"), 0, P(("dp", "tp"), None)),
    ((2, 16, 32), P("dp", None, "tp"), P("tp", None), P("dp", "tp"),
     "matmul_reduce_scatter", ("tp",), 1, P("dp", "tp", None)),
    ((16, 32), P("tp", None), P(None, "tp"), P(None, "tp"),
     "all_gather_matmul", ("tp",), 0, P(None, "tp")),
    ((16, 32), P(("dp", "tp"), None), P(None, "tp"), P("dp", "tp"),
     "all_gather_matmul", ("tp",), 0, P("dp", "tp")),
    ((16, 32), P("dp", None), P(None, "tp"), P("dp", "tp"),
     "local", (), None, P("dp", "tp")),
    ((16, 32), P("tp", None), P(None, "tp"), P("tp", None),  # N gives way: w is gathered
     "local", (), None, P("tp", None)),
    ((16, 32), P(), P(), P(), "local", (), None, P()),
    # 4 rows cannot be scattered 8 ways: all-reduce instead (the partitioner slices after).
    ((4, 32), P(None, ("dp", "tp")), P(("dp", "tp"), None), P(("dp", "tp")),
     "matmul_all_reduce", ("dp", "tp"), None, P()),
]  # fmt: skip


def _spec(s, ndim):
    return partitioning._norm(s, ndim)


@pytest.mark.parametrize("case", PLANS, ids=[f"{c[3]}-{c[4]}" for c in PLANS])
def test_plan(case):
    x_shape, xs, ws, outs, kind, axes, dim, result = case
    p = plan(x_shape, (32, 8), xs, ws, outs, SIZES)
    assert (p.kind, p.axes, p.dim) == (kind, axes, dim), p
    assert p.out_spec == _spec(result, len(x_shape)), p
    # Every mesh axis shards at most one dim of each array.
    for spec in (p.x_spec, p.w_spec, p.out_spec):
        used = [a for d in spec for a in d]
        assert len(used) == len(set(used)), p


# ----------------------------------------------------------------------------- compiled


def mesh_of(name):
    if name == "1d":
        return jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


# mesh, x shape, x spec, w spec, constrained result spec (None: leave it to propagation),
# expected op, expected result spec
CASES = {
    "column_1d": ("1d", (16, 32), P(), P(None, "tp"), None, "local", P(None, "tp")),
    "column_dp_2d": ("2d", (16, 32), P("dp"), P(None, "tp"), None, "local", P("dp", "tp")),
    "row_all_reduce_1d": ("1d", (16, 32), P(None, "tp"), P("tp"), None,
                          "matmul_all_reduce", P()),
    "row_all_reduce_2d": ("2d", (16, 32), P("dp", "tp"), P("tp"), None,
                          "matmul_all_reduce", P("dp")),
    "row_reduce_scatter_1d": ("1d", (16, 32), P(None, "tp"), P("tp"), P("tp"),
                              "matmul_reduce_scatter", P("tp")),
    "row_reduce_scatter_2d": ("2d", (16, 32), P("dp", "tp"), P("tp"), P(("dp", "tp")),
                              "matmul_reduce_scatter", P(("dp", "tp"))),
    "row_reduce_scatter_3d_x_2d_mesh": ("2d", (2, 16, 32), P("dp", None, "tp"), P("tp"),
                                        P("dp", "tp"), "matmul_reduce_scatter", P("dp", "tp")),
    "row_reduce_scatter_two_axes": ("2d", (16, 32), P(None, ("dp", "tp")), P(("dp", "tp")),
                                    P(("dp", "tp")), "matmul_reduce_scatter", P(("dp", "tp"))),
    "sequence_all_gather_1d": ("1d", (16, 32), P("tp"), P(None, "tp"), P(None, "tp"),
                               "all_gather_matmul", P(None, "tp")),
    "sequence_all_gather_2d": ("2d", (16, 32), P(("dp", "tp")), P(None, "tp"), P("dp", "tp"),
                               "all_gather_matmul", P("dp", "tp")),
    "replicated_1d": ("1d", (16, 32), P(), P(), None, "local", P()),
    "replicated_2d": ("2d", (16, 32), P(), P(), None, "local", P()),
}  # fmt: skip
HLO_COLLECTIVE = {
    "matmul_reduce_scatter": "reduce-scatter",
    "matmul_all_reduce": "all-reduce",
    "all_gather_matmul": "all-gather",
    "local": None,
}


@pytest.fixture
def picked(monkeypatch):
    """The ops the partition callback picked, in order."""
    kinds = []
    apply = partitioning._apply

    def spy(p, x, w, config):
        kinds.append(p.kind)
        return apply(p, x, w, config)

    monkeypatch.setattr(partitioning, "_apply", spy)
    return kinds


@pytest.mark.parametrize("case", list(CASES))
def test_matmul_under_jit(case, picked):
    mesh_name, x_shape, xs, ws, outs, kind, result = CASES[case]
    mesh = mesh_of(mesh_name)
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.device_put(jax.random.normal(kx, x_shape) / 6, NamedSharding(mesh, xs))
    w = jax.device_put(jax.random.normal(kw, (32, 8)) / 6, NamedSharding(mesh, ws))

    def f(x, w):
        y = matmul(x, w)
        return y if outs is None else jax.lax.with_sharding_constraint(y, NamedSharding(mesh, outs))

    fwd = jax.jit(f).lower(x, w).compile()  # compiled once: run, and its HLO read
    y = fwd(x, w)
    np.testing.assert_allclose(y, np.asarray(x) @ np.asarray(w), **TOL)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, result), y.ndim), y.sharding
    assert picked[0] == kind, picked
    hlo = fwd.as_text()
    found = set(re.findall(r"\b(all-gather|reduce-scatter|all-reduce|all-to-all)\(", hlo))
    assert found == ({HLO_COLLECTIVE[kind]} - {None}), found

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

    got = jax.jit(jax.grad(loss(f), (0, 1)))(x, w)
    want = jax.grad(loss(jnp.matmul), (0, 1))(np.asarray(x), np.asarray(w))
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, **TOL)


def test_backward_of_row_parallel_reduce_scatter_is_all_gather_matmul(picked):
    """Megatron sequence parallelism: dX of a reduce-scattered row-parallel matmul is an
    all-gather matmul of the incoming gradient with w.T."""
    mesh = mesh_of("1d")
    x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P(None, "tp")))
    w = jax.device_put(jnp.ones((32, 8)), NamedSharding(mesh, P("tp")))

    def loss(x, w):
        y = jax.lax.with_sharding_constraint(matmul(x, w), NamedSharding(mesh, P("tp")))
        return jnp.sum(y**2)

    jax.jit(jax.grad(loss)).lower(x, w).compile()
    assert picked == ["matmul_reduce_scatter", "all_gather_matmul"], picked


def test_eager_and_config():
    x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
    np.testing.assert_array_equal(matmul(x, w, config=jaxoverlap.Config(backend="xla")), x @ w)


@pytest.mark.parametrize(
    "args,kwargs,error,match",
    [
        ((jnp.ones((4, 8)), jnp.ones((4, 2))), {}, ValueError, "x \\[..., K\\] and w \\[K, N\\]"),
        ((jnp.ones((4, 8)), jnp.ones((8, 2, 1))), {}, ValueError, "w \\[K, N\\]"),
        ((jnp.ones((4, 8), jnp.int32), jnp.ones((8, 2), jnp.int32)), {}, TypeError, "astype"),
        ((jnp.ones((4, 8)), jnp.ones((8, 2))), {"config": "xla"}, TypeError, "Config"),
    ],
)
def test_validation(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        matmul(*args, **kwargs)


def test_explicit_axes_need_no_mesh_context_and_mixed_axis_types_are_refused():
    """Explicit meshes are tested in test_partitioning_explicit.py; here: no ``jax.set_mesh``
    needed, and a mesh mixing Explicit and Auto axes is refused with advice."""
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P(None, "tp")))
    w = jax.device_put(jnp.ones((32, 8)), NamedSharding(mesh, P("tp")))
    np.testing.assert_allclose(jax.jit(matmul)(x, w), np.full((16, 8), 32.0), **TOL)
    mixed = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(AxisType.Explicit, AxisType.Auto),
                          devices=jax.devices()[:4])  # fmt: skip
    x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mixed, P("dp", None)))
    w = jax.device_put(jnp.ones((32, 8)), NamedSharding(mixed, P()))
    with pytest.raises(ValueError, match="mixes Explicit and other axis types.*shard_map"):
        jax.jit(matmul)(x, w)


def test_inside_a_fully_manual_shard_map_is_a_local_matmul():
    mesh = mesh_of("1d")
    x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P(None, "tp")))
    w = jax.device_put(jnp.ones((32, 8)), NamedSharding(mesh, P("tp")))
    f = jax.shard_map(lambda x, w: jax.lax.psum(matmul(x, w), "tp"), mesh=mesh,
                      in_specs=(P(None, "tp"), P("tp")), out_specs=P())  # fmt: skip
    np.testing.assert_allclose(jax.jit(f)(x, w), np.asarray(x) @ np.asarray(w), **TOL)


def test_vmap(picked):
    """A batched x is one more leading dim (still the op); batched weights go to XLA."""
    mesh = mesh_of("2d")
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.device_put(jax.random.normal(kx, (3, 16, 32)), NamedSharding(mesh, P(None, None, "tp")))
    w = jax.device_put(jax.random.normal(kw, (3, 32, 8)), NamedSharding(mesh, P(None, "tp")))
    xn, wn = np.asarray(x), np.asarray(w)

    y = jax.jit(jax.vmap(matmul, in_axes=(0, None)))(x, w[0])
    np.testing.assert_allclose(y, xn @ wn[0], **TOL)
    assert picked == ["matmul_all_reduce"], picked
    y = jax.jit(jax.vmap(matmul, in_axes=(1, None)))(x, w[0])
    np.testing.assert_allclose(y, np.einsum("bmk,kn->mbn", xn, wn[0]), **TOL)
    y = jax.jit(jax.vmap(matmul))(x, w)
    np.testing.assert_allclose(y, np.einsum("bmk,bkn->bmn", xn, wn), **TOL)
    y = jax.jit(jax.vmap(matmul, in_axes=(None, 0)))(x[0], w)
    np.testing.assert_allclose(y, np.einsum("mk,bkn->bmn", xn[0], wn), **TOL)

    def loss(x, w):
        return jnp.sum(jnp.sin(jax.vmap(matmul, in_axes=(0, None))(x, w)))

    got = jax.jit(jax.grad(loss, (0, 1)))(x, w[0])
    want = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), (0, 1))(xn, wn[0])
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, **TOL)


def test_out_sharding_as_named_sharding_needs_no_context_mesh():
    """``out_sharding=NamedSharding(...)`` carries its mesh: no ``jax.set_mesh`` needed (it
    raised "requires a non-empty mesh in context" before)."""
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    x = jax.device_put(
        jnp.arange(16 * 32, dtype=jnp.float32).reshape(16, 32) / 100,
        NamedSharding(mesh, P(None, "tp")),
    )
    w = jax.device_put(jnp.ones((32, 8), jnp.float32), NamedSharding(mesh, P("tp", None)))
    out = NamedSharding(mesh, P("tp", None))
    y = jax.jit(lambda x, w: matmul(x, w, out_sharding=out))(x, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(w), rtol=1e-5)
    assert y.sharding.spec in (P("tp"), P("tp", None))
