"""The fused all-gather + GEMM on 2 GPUs against XLA's all_gather + matmul."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, fused

pytestmark = pytest.mark.gpu

FUSED = Config(backend="fused")
XLA = Config(backend="xla")
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 2e-3}  # relative to the result's max magnitude
W_SPEC = P(None, "tp")  # w [K, N_local] per device


def _mesh(gpus, order=(0, 1), shape=(2,), names=("tp",)):
    return Mesh(np.array([gpus[i] for i in order]).reshape(shape), names)


def _fn(mesh, config, x_spec=P("tp"), out_spec=P(None, "tp"), axis="tp", **kw):
    def body(x, w):
        return jaxoverlap.all_gather_matmul(x, w, axis, config=config, **kw)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, W_SPEC), out_specs=out_spec))


def _inputs(mesh, m_local, k, n_local, dtype, seed=0, x_spec=P("tp"), rest=()):
    """x [2 * m_local, *rest, K] split over its first dimension, w [K, 2 * n_local] over N."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (2 * m_local, *rest, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, 2 * n_local), jnp.float32) / np.sqrt(k)).astype(dtype)
    return (
        jax.device_put(x, NamedSharding(mesh, x_spec)),
        jax.device_put(w, NamedSharding(mesh, W_SPEC)),
    )


def _close(got, want, dtype):
    got = np.asarray(got.astype(jnp.float32))
    want = np.asarray(want.astype(jnp.float32))
    assert got.shape == want.shape
    scale = max(np.abs(want).max(), 1e-6)
    err = np.abs(got - want).max() / scale
    assert err < TOL[dtype], f"max error {err:.3g} of max |ref| {scale:.3g}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "m_local,k,n_local",
    [(512, 512, 768), (768, 384, 640), (384, 1152, 1280), (2048, 4096, 4096), (1024, 8192, 8192)],
)
def test_values(gpus, m_local, k, n_local, dtype):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, m_local, k, n_local, dtype)
    _close(_fn(mesh, FUSED)(x, w), _fn(mesh, XLA)(x, w), dtype)


def test_3d_x_and_chunk_counts(gpus):
    # x [B, S, K] per device [2, 384, 512]: gathering dimension 0 gives [4, 384, N_local]
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 2, 512, 512, jnp.bfloat16, rest=(384,))
    spec = dict(out_spec=P(None, None, "tp"))
    ref = _fn(mesh, XLA, **spec)(x, w)
    for chunks in (1, 2, 4):
        got = _fn(mesh, Config(backend="fused", chunks=chunks), **spec)(x, w)
        _close(got, ref, jnp.bfloat16)


def test_permuted_devices_and_2d_mesh(gpus):
    # tp over both GPUs in reversed order, inside a (dp=1, tp=2) mesh
    mesh = _mesh(gpus, order=(1, 0), shape=(1, 2), names=("dp", "tp"))
    x, w = _inputs(mesh, 512, 256, 512, jnp.bfloat16, x_spec=P("tp", "dp"))
    spec = dict(x_spec=P("tp", "dp"), out_spec=P("dp", "tp"))
    _close(_fn(mesh, FUSED, **spec)(x, w), _fn(mesh, XLA, **spec)(x, w), jnp.bfloat16)


def test_bitwise_deterministic_and_1000_calls(gpus):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 1024, 1024, 1024, jnp.bfloat16, seed=3)
    f = _fn(mesh, FUSED)
    first = f(x, w)
    _close(first, _fn(mesh, XLA)(x, w), jnp.bfloat16)
    outs = [f(x, w) for _ in range(1000)]
    same = jax.jit(lambda a, bs: jnp.stack([jnp.array_equal(a, b) for b in bs]))
    for i in range(0, 1000, 100):
        ok = np.asarray(same(first, outs[i : i + 100]))
        assert ok.all(), f"calls {i + np.flatnonzero(~ok)} differ bitwise from the first call"


def test_two_call_sites_of_different_shapes_and_hlo(gpus):
    """The case that hung the earlier copy-engine attempt: further fused call sites (each a new
    workspace; one with a new GEMM shape) right behind the first, in one program, called back to
    back."""
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 512, 512, 768, jnp.bfloat16, seed=7)
    w3 = jax.device_put(
        (jax.random.normal(jax.random.key(8), (512, 2 * 384)) / 23).astype(jnp.bfloat16),
        NamedSharding(mesh, W_SPEC),
    )

    def program(config):
        def body(x, w, w3):
            y1 = jaxoverlap.all_gather_matmul(x, w, "tp", config=config)
            y2 = jaxoverlap.all_gather_matmul(2 * x, w, "tp", config=config)
            y3 = jaxoverlap.all_gather_matmul(x[:256] - 1, w3, "tp", config=config)
            return y1, y2, y3

        return jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P("tp"), W_SPEC, W_SPEC), out_specs=(P(None, "tp"),) * 3
            )
        )

    f = program(FUSED)
    hlo = f.lower(x, w, w3).compile().as_text()
    assert hlo.count(f'custom_call_target="{fused.AG_GEMM_TARGET}"') == 3
    assert "all-gather" not in hlo
    want = program(XLA)(x, w, w3)
    for _ in range(20):  # back to back: every site's epochs and slots advance together
        got = f(x, w, w3)
    for g, r in zip(got, want, strict=True):
        _close(g, r, jnp.bfloat16)


def test_inside_scan_and_fori_loop(gpus):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 512, 512, 1024, jnp.bfloat16, seed=5)

    def looped(config):
        def body(x, w):
            def step(i, acc):
                xi = x * (1.0 + i.astype(x.dtype) / 8)
                y = jaxoverlap.all_gather_matmul(xi, w, "tp", config=config)
                return acc + y.astype(jnp.float32)

            acc0 = lax.pcast(jnp.zeros((1024, 1024), jnp.float32), ("tp",), to="varying")
            acc = lax.fori_loop(0, 6, step, acc0)

            def sstep(c, xs):
                return c, jaxoverlap.all_gather_matmul(xs, w, "tp", config=config)

            _, ys = lax.scan(sstep, 0, jnp.stack([x, -x, 2 * x]))
            return acc, ys

        return jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P("tp"), W_SPEC),
                out_specs=(P(None, "tp"), P(None, None, "tp")),
            )
        )

    (a1, s1), (a2, s2) = looped(FUSED)(x, w), looped(XLA)(x, w)
    _close(a1, a2, jnp.bfloat16)
    _close(s1, s2, jnp.bfloat16)


def test_mlp_values_and_gradients(gpus):
    """A sequence-parallel MLP: fused all_gather_matmul then fused matmul_reduce_scatter; the
    backward runs both fused ops again (d/dx of one is the other)."""
    mesh = _mesh(gpus)
    kx, k1, k2 = jax.random.split(jax.random.key(11), 3)
    d, f_local = 512, 768
    x = jax.device_put(
        jax.random.normal(kx, (2 * 1024, d)).astype(jnp.bfloat16), NamedSharding(mesh, P("tp"))
    )
    w1 = jax.device_put(
        (jax.random.normal(k1, (d, 2 * f_local)) / np.sqrt(d)).astype(jnp.bfloat16),
        NamedSharding(mesh, P(None, "tp")),
    )
    w2 = jax.device_put(
        (jax.random.normal(k2, (2 * f_local, d)) / np.sqrt(2 * f_local)).astype(jnp.bfloat16),
        NamedSharding(mesh, P("tp", None)),
    )

    def loss(config):
        def layer(x, w1, w2):
            h = jaxoverlap.all_gather_matmul(x, w1, "tp", config=config)
            return jaxoverlap.matmul_reduce_scatter(h, w2, "tp", config=config)

        def f(x, w1, w2):
            y = jax.shard_map(
                layer,
                mesh=mesh,
                in_specs=(P("tp"), P(None, "tp"), P("tp", None)),
                out_specs=P("tp"),
            )(x, w1, w2)
            return jnp.sum(jnp.square(y.astype(jnp.float32))), y

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    g_fused = loss(FUSED)
    hlo = g_fused.lower(x, w1, w2).compile().as_text()
    assert hlo.count(f'custom_call_target="{fused.AG_GEMM_TARGET}"') == 2
    assert hlo.count(f'custom_call_target="{fused.GEMM_RS_TARGET}"') == 2
    (l1, y1), grads1 = g_fused(x, w1, w2)
    (l2, y2), grads2 = loss(XLA)(x, w1, w2)
    _close(y1, y2, jnp.bfloat16)
    assert abs(float(l1) - float(l2)) <= 3e-2 * abs(float(l2))
    for a, b in zip(grads1, grads2, strict=True):
        _close(a, b, jnp.bfloat16)


_STALL_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, sys
    from jax.sharding import Mesh, PartitionSpec as P
    import jaxoverlap
    from jaxoverlap import fused, runtime
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    cfg = jaxoverlap.Config(backend="fused", timeout_s=1.0)
    f = lambda x, w: jaxoverlap.all_gather_matmul(x, w, "tp", config=cfg)
    x = jax.random.normal(jax.random.key(0), (1024, 512), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (512, 1024), jnp.bfloat16)
    with fused._stalled_rank_for_tests(1):
        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                  out_specs=P(None, "tp")))
        g.lower(x, w)  # lowered with the stall knob
        try:
            jax.block_until_ready(g(x, w))
            print("NO ERROR")
        except Exception as e:
            print("RAISED", type(e).__name__, str(e)[:300])
    print("RECORD", runtime.pending_error())
    sys.stdout.flush()
    """
)


def test_stalled_peer_errors_instead_of_hanging(gpus):
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-c", _STALL_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    out = p.stdout + p.stderr
    assert time.time() - t0 < 120
    assert "NO ERROR" not in out, out[-3000:]
    assert "RAISED" in out or p.returncode != 0, out[-3000:]
    assert "jaxoverlap.all_gather_matmul timed out" in out, out[-3000:]
    assert "(rank 0)" in out and "peer rank 1" in out and "block of x" in out, out[-3000:]
