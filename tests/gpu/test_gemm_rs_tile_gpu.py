"""The tile schedule of the fused GEMM + reduce-scatter (Config(schedule="tile"),
jaxoverlap/fused/tile.py) on 2 GPUs of one process, against XLA's matmul + psum_scatter. Its
stalled-peer and failed-rank cases are in test_gemm_rs_gpu.py (kernel "gemm_rs_tile"); with two
processes sharing one GPU in test_xproc_gpu.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, fused

from .test_gemm_rs_gpu import XLA, _close, _fn, _inputs, _mesh

pytestmark = pytest.mark.gpu

TILE = Config(backend="fused", schedule="tile")


@pytest.mark.parametrize(
    "m,k_local,n",
    [
        (1024, 512, 768),
        (1536, 384, 1000),  # N not a multiple of the 256-column tile, K of the 64-deep step
        (512, 1032, 512),  # one tile row per rank
        (4096, 4096, 4096),
        (2048, 8192, 8192),
        (8192, 2048, 4096),
    ],
)
def test_values_and_hlo(gpus, m, k_local, n):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, m, k_local, n, jnp.bfloat16)
    f = _fn(mesh, TILE)
    _close(f(x, w), _fn(mesh, XLA)(x, w), jnp.bfloat16)
    hlo = f.lower(x, w).compile().as_text()
    assert f'custom_call_target="{fused.emitted(fused.GEMM_RS_TILE_TARGET)}"' in hlo
    assert "reduce-scatter" not in hlo and f'"{fused.emitted(fused.GEMM_RS_TARGET)}"' not in hlo


def test_middle_dimension_batch_and_permuted_2d_mesh(gpus):
    """[B, S, D] scattered over S (the custom call's S-major layout), on a (dp=1, tp=2) mesh
    whose tp order is reversed."""
    mesh = _mesh(gpus, order=(1, 0), shape=(1, 2), names=("dp", "tp"))
    x, w = _inputs(mesh, 512, 512, 640, jnp.bfloat16, batch=(4,), x_spec=P("dp", "tp"))
    spec = dict(x_spec=P(None, "dp", "tp"), out_spec=P(None, ("dp", "tp")), scatter_dimension=1)
    _close(_fn(mesh, TILE, **spec)(x, w), _fn(mesh, XLA, **spec)(x, w), jnp.bfloat16)


def test_bitwise_repeatable_over_1000_calls(gpus):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 2048, 1024, 1024, jnp.bfloat16, seed=3)
    f = _fn(mesh, TILE)
    first = f(x, w)
    _close(first, _fn(mesh, XLA)(x, w), jnp.bfloat16)
    outs = [f(x, w) for _ in range(1000)]
    same = jax.jit(lambda a, bs: jnp.stack([jnp.array_equal(a, b) for b in bs]))
    assert np.asarray(same(first, outs)).all()


def test_inside_scan_and_two_sites_sharing_a_workspace(gpus):
    """Calls back to back (epochs, double-buffered staging, claim counters alternate), two call
    sites of one shape (one workspace), inside lax.scan."""
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 1024, 512, 1024, jnp.bfloat16)

    def body(x, w):
        def step(h, _):
            a = jaxoverlap.matmul_reduce_scatter(h, w, "tp", config=TILE)
            b = jaxoverlap.matmul_reduce_scatter(h * 2, w, "tp", config=TILE)
            return h, a + b

        return lax.scan(step, x, None, length=6)[1]

    def ref(x, w):
        y = lax.psum_scatter(x @ w, "tp", scatter_dimension=0, tiled=True)
        return jnp.stack([y + lax.psum_scatter((x * 2) @ w, "tp", tiled=True)] * 6)

    wrap = lambda fn: jax.jit(  # noqa: E731
        jax.shard_map(
            fn, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P(None, "tp")
        )
    )
    _close(wrap(body)(x, w), wrap(ref)(x, w), jnp.bfloat16)


def test_transposed_weight_of_the_backward(gpus):
    """d/dx of all_gather_matmul is matmul_reduce_scatter(ct, w.T) with w read column-major in
    place: the tile kernel's column-major-B instantiation."""
    mesh = _mesh(gpus)
    kx, kw = jax.random.split(jax.random.key(5))
    x = jax.random.normal(kx, (2048, 512), jnp.bfloat16)
    w = jax.random.normal(kw, (512, 2 * 384), jnp.bfloat16) / 24

    def loss(config):
        def body(x, w):
            return jaxoverlap.all_gather_matmul(x, w, "tp", config=config)

        specs = dict(in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"))
        f = jax.shard_map(body, mesh=mesh, **specs)
        return jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x, w).astype(jnp.float32)))))

    got = loss(TILE)(x)
    _close(got, loss(XLA)(x), jnp.bfloat16)
    hlo = loss(TILE).lower(x).compile().as_text()
    assert f'custom_call_target="{fused.emitted(fused.GEMM_RS_TILE_TARGET)}"' in hlo
