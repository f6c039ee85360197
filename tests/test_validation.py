"""Bad input fails at trace time with a message that names the op, the shapes/axis and the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from harness import P, make_mesh
from jax.sharding import NamedSharding

import jaxoverlap


def _trace(
    fn, x_shape, w_shape, in_specs, dtype=jnp.float32, w_dtype=None, out_specs=P(), lower=False
):
    mesh = make_mesh("tp4")
    x = jax.ShapeDtypeStruct(x_shape, dtype, sharding=NamedSharding(mesh, in_specs[0]))
    w = jax.ShapeDtypeStruct(w_shape, w_dtype or dtype, sharding=NamedSharding(mesh, in_specs[1]))
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    with jax.set_mesh(mesh):
        traced = jax.jit(mapped).trace(x, w)
        if lower:
            traced.lower()


K_SHARDED = (P(None, "tp"), P("tp", None))


def test_not_divisible():
    f = lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "tp")  # noqa: E731
    with pytest.raises(
        ValueError,
        match=r"matmul_reduce_scatter: result dimension 0 \(size 6.*"
        r"not divisible by the size 4 of axis \('tp',\).*Pad",
    ):
        _trace(f, (6, 32), (32, 8), K_SHARDED)


def test_contracting_dims_differ():
    f = lambda x, w: jaxoverlap.matmul_all_reduce(x, w, "tp")  # noqa: E731
    with pytest.raises(
        ValueError,
        match=r"matmul_all_reduce: contracting dimensions differ: x "
        r"has shape \(8, 4\) \(K=4\) but w has shape \(8, 8\)",
    ):
        _trace(f, (8, 16), (32, 8), K_SHARDED)


def test_w_rank():
    f = lambda x, w: jaxoverlap.all_gather_matmul(x, w.reshape(-1), "tp")  # noqa: E731
    with pytest.raises(ValueError, match=r"all_gather_matmul: w must have rank 2 .* \(64,\)"):
        _trace(f, (8, 8), (8, 32), (P("tp", None), P(None, "tp")))


def test_unknown_axis_name():
    f = lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "model")  # noqa: E731
    with pytest.raises(ValueError, match=r"unknown axis name 'model'.*bound here are \('tp',\)"):
        _trace(f, (8, 32), (32, 8), K_SHARDED)


def test_outside_shard_map():
    x = jnp.ones((8, 4))
    with pytest.raises(ValueError, match=r"matmul_reduce_scatter: called outside jax.shard_map"):
        jaxoverlap.matmul_reduce_scatter(x, jnp.ones((4, 4)), "tp")
    with pytest.raises(ValueError, match=r"all_gather_matmul: called outside jax.shard_map"):
        jax.jit(lambda x: jaxoverlap.all_gather_matmul(x, x.T, "tp"))(x)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8])
def test_integer_dtypes(dtype):
    f = lambda x, w: jaxoverlap.matmul_all_reduce(x, w, "tp")  # noqa: E731
    with pytest.raises(TypeError, match=r"matmul_all_reduce: x has dtype int.*Cast integer"):
        _trace(f, (8, 32), (32, 8), K_SHARDED, dtype=dtype)


def test_mixed_dtypes():
    f = lambda x, w: jaxoverlap.matmul_all_reduce(x, w, "tp")  # noqa: E731
    with pytest.raises(TypeError, match=r"x has dtype bfloat16 but w has dtype float32.*astype"):
        _trace(f, (8, 32), (32, 8), K_SHARDED, dtype=jnp.bfloat16, w_dtype=jnp.float32)


def test_gather_along_k_needs_the_whole_k():
    """gather_dimension = the last dim of x (x sharded over K) takes w with the whole K."""
    f = lambda x, w: jaxoverlap.all_gather_matmul(x, w, "tp", gather_dimension=-1)  # noqa: E731
    with pytest.raises(ValueError, match=r"x has shape \(8, 2\) \(K=2\) but w has shape \(2, 8\)"
                       r".*x times the group size 4 \(x is gathered along K\)"):  # fmt: skip
        _trace(f, (8, 8), (8, 8), K_SHARDED)
    g = lambda x, w: jaxoverlap.all_gather_matmul(x, w, "tp", gather_dimension=2)  # noqa: E731
    with pytest.raises(ValueError, match=r"gather_dimension=2 is out of range.*\[0, 1\]"):
        _trace(g, (8, 8), (8, 32), (P(None, "tp"), P(None, "tp")))


def test_scatter_dimension_out_of_range():
    f = lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "tp", scatter_dimension=2)  # noqa: E731
    with pytest.raises(ValueError, match=r"scatter_dimension=2 is out of range for shape \(8, 8\)"):
        _trace(f, (8, 32), (32, 8), K_SHARDED)


def test_backend_fused_unavailable_on_cpu_says_why():
    cfg = jaxoverlap.Config(backend="fused")
    f = lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg)  # noqa: E731
    with pytest.raises(
        ValueError,
        match=r"matmul_reduce_scatter: backend='fused' cannot run "
        r"here: .+",
    ):
        _trace(f, (8, 32), (32, 8), K_SHARDED, dtype=jnp.bfloat16, lower=True)


def test_auto_and_xla_backends_run_on_cpu():
    for backend in ("auto", "xla"):
        cfg = jaxoverlap.Config(backend=backend)
        f = lambda x, w, cfg=cfg: jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg)  # noqa: E731
        _trace(f, (8, 32), (32, 8), K_SHARDED, lower=True)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(backend="gpu"), r"backend='gpu' is not one of"),
        (dict(comm_sms=-1), r"comm_sms=-1 must be an int >= 0"),
        (dict(chunks=-1), r"chunks=-1 must be a positive int"),
        (dict(timeout_s=0), r"timeout_s=0 must be a finite number of seconds"),
        (dict(deterministic=1), r"deterministic=1 must be a bool"),
        (dict(schedule="tiles"), r"schedule='tiles' is not one of"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxoverlap.Config(**kwargs)


def test_config_is_frozen_and_hashable():
    cfg = jaxoverlap.Config(comm_sms=8)
    assert hash(cfg) == hash(jaxoverlap.Config(comm_sms=8))
    with pytest.raises(AttributeError):
        cfg.comm_sms = 16


def test_config_type_checked():
    f = lambda x, w: jaxoverlap.matmul_all_reduce(x, w, "tp", config={"backend": "xla"})  # noqa: E731
    with pytest.raises(TypeError, match=r"config must be a jaxoverlap.Config"):
        _trace(f, (8, 32), (32, 8), K_SHARDED)
