"""A training step's fused calls on 2 GPUs against XLA's: the all-gather variant that returns
what it gathered, the backward's w.T read in place, and the column-parallel backward that
reduce-scatters dx beside dW's GEMM (ffi/handlers/dgrad_rs_wgrad.cc)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoverlap import Config, fused
from jaxoverlap.fused import backward as fused_backward

from .scripts import run_script
from .test_ag_gemm_gpu import assert_w_transposes_are_free
from .training_models import grads, mlp_step, scanned_train

pytestmark = pytest.mark.gpu

FUSED = Config(backend="fused")
XLA = Config(backend="xla")
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 2e-3}


def _close(got, want, dtype, what=""):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    assert got.shape == want.shape, what
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
    assert err < TOL[dtype], f"{what}: max error {err:.3g} of max |ref|"


def _put(mesh, a, spec):
    return jax.device_put(a, NamedSharding(mesh, spec))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows", [(2 * 1536,), (2, 384)])
def test_column_parallel_backward(gpus, dtype, rows):
    """d/dx and d/dW of all_gather_matmul in one call: the dgrad reduce-scatter beside dW's GEMM,
    reading w.T in place; x 2-D, or 3-D gathered over its first dimension."""
    mesh = Mesh(np.array(gpus), ("tp",))
    k, n_local = 640, 1280  # every GEMM's m, n, k distinct: a swapped dimension fails
    kx, kw = jax.random.split(jax.random.key(3))
    x = _put(mesh, jax.random.normal(kx, (*rows, k)).astype(dtype), P("tp"))
    w = _put(mesh, (jax.random.normal(kw, (k, 2 * n_local)) / 32).astype(dtype), P(None, "tp"))
    out_spec = P(*([None] * len(rows)), "tp")
    fused_grads = grads(mesh, "ag", FUSED, P("tp"), P(None, "tp"), out_spec)
    hlo = fused_grads.lower(x, w).compile().as_text()
    assert hlo.count(f'custom_call_target="{fused.emitted(fused_backward.TARGET)}"') == 1
    assert hlo.count(f'custom_call_target="{fused.emitted(fused.AG_GEMM_KEEP_TARGET)}"') == 1
    assert "reduce-scatter" not in hlo and "all-gather" not in hlo
    assert_w_transposes_are_free(hlo, expected=1)
    want = grads(mesh, "ag", XLA, P("tp"), P(None, "tp"), out_spec)(x, w)
    got = fused_grads(x, w)
    for name, a, b in zip(("dx", "dW"), got, want, strict=True):
        _close(a, b, dtype, name)
    again = fused_grads(x, w)
    for a, b in zip(got, again, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))  # deterministic


def test_batch_by_sequence_split_over_sequence(gpus):
    """x [B, S, D] split over S with B > 1 (sequence parallelism as model code writes it): the
    fused calls take the S-major layout, so the same kernels run; forward values and every
    gradient of an all_gather_matmul -> matmul_reduce_scatter MLP against XLA's."""
    mesh = Mesh(np.array(gpus), ("tp",))
    b, s_local, d, f_local = 4, 384, 640, 1280
    keys = jax.random.split(jax.random.key(6), 3)
    x = _put(
        mesh, jax.random.normal(keys[0], (b, 2 * s_local, d)).astype(jnp.bfloat16), P(None, "tp")
    )
    w1 = _put(
        mesh,
        (jax.random.normal(keys[1], (d, 2 * f_local)) / 25).astype(jnp.bfloat16),
        P(None, "tp"),
    )
    w2 = _put(
        mesh, (jax.random.normal(keys[2], (2 * f_local, d)) / 50).astype(jnp.bfloat16), P("tp")
    )

    fused_step = mlp_step(mesh, FUSED)
    hlo = fused_step.lower(x, w1, w2).compile().as_text()
    assert "all-gather" not in hlo and "reduce-scatter" not in hlo
    (l1, g1), (l2, g2) = fused_step(x, w1, w2), mlp_step(mesh, XLA)(x, w1, w2)
    assert abs(float(l1) - float(l2)) <= 3e-2 * abs(float(l2)) + 1e-3
    for name, a, b_ in zip(("dx", "dW1", "dW2"), g1, g2, strict=True):
        _close(a, b_, jnp.bfloat16, name)


def test_row_parallel_backward(gpus):
    """d/dx and d/dW of matmul_reduce_scatter: the cotangent gathered once (fused, with w.T read
    in place) for both."""
    mesh = Mesh(np.array(gpus), ("tp",))
    m, k_local, n = 1536, 640, 896  # distinct GEMM dimensions
    kx, kw = jax.random.split(jax.random.key(4))
    x = _put(mesh, jax.random.normal(kx, (m, 2 * k_local)).astype(jnp.bfloat16), P(None, "tp"))
    w = _put(mesh, (jax.random.normal(kw, (2 * k_local, n)) / 45).astype(jnp.bfloat16), P("tp"))
    fused_grads = grads(mesh, "rs", FUSED, P(None, "tp"), P("tp"), P("tp"))
    hlo = fused_grads.lower(x, w).compile().as_text()
    assert hlo.count(f'custom_call_target="{fused.emitted(fused.AG_GEMM_KEEP_TARGET)}"') == 1
    assert "all-gather" not in hlo
    assert_w_transposes_are_free(hlo, expected=1)
    want = grads(mesh, "rs", XLA, P(None, "tp"), P("tp"), P("tp"))(x, w)
    for name, a, b in zip(("dx", "dW"), fused_grads(x, w), want, strict=True):
        _close(a, b, jnp.bfloat16, name)


def test_scanned_mlp_training_steps(gpus):
    """Three SGD steps of a two-layer sequence-parallel MLP under lax.scan: every collective of
    the step fused, the losses and weights those of XLA's step."""
    mesh = Mesh(np.array(gpus), ("tp",))
    d, f_local, layers = 768, 1280, 2
    keys = jax.random.split(jax.random.key(5), 3)
    x = _put(mesh, jax.random.normal(keys[0], (3072, d)).astype(jnp.bfloat16), P("tp"))
    w1 = _put(
        mesh,
        (jax.random.normal(keys[1], (layers, d, 2 * f_local)) / 32).astype(jnp.bfloat16),
        P(None, None, "tp"),
    )
    w2 = _put(
        mesh,
        (jax.random.normal(keys[2], (layers, 2 * f_local, d)) / 64).astype(jnp.bfloat16),
        P(None, "tp"),
    )

    fused_train = scanned_train(mesh, FUSED)
    hlo = fused_train.lower(x, w1, w2).compile().as_text()
    assert "all-gather" not in hlo and "reduce-scatter" not in hlo
    assert f'custom_call_target="{fused.emitted(fused_backward.TARGET)}"' in hlo
    assert_w_transposes_are_free(hlo)  # w sliced from the stacked weights inside the loop
    (fw1, fw2), flosses = fused_train(x, w1, w2)
    (xw1, xw2), xlosses = scanned_train(mesh, XLA)(x, w1, w2)
    np.testing.assert_allclose(np.asarray(flosses), np.asarray(xlosses), rtol=3e-2)
    _close(fw1, xw1, jnp.bfloat16, "w1")
    _close(fw2, xw2, jnp.bfloat16, "w2")


_STALL = """
import jax, jax.numpy as jnp, numpy as np, time
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxoverlap
from jaxoverlap import fused
mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
cfg = jaxoverlap.Config(backend="fused", timeout_s=1.0)
def grads(config):
    f = jax.shard_map(lambda x, w: jaxoverlap.all_gather_matmul(x, w, "tp", config=config),
                      mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
    return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2), (0, 1)))
x = jax.device_put(jax.random.normal(jax.random.key(0), (2048, 1024), jnp.bfloat16),
                   NamedSharding(mesh, P("tp")))
w = jax.device_put(jax.random.normal(jax.random.key(1), (1024, 4096), jnp.bfloat16) / 32,
                   NamedSharding(mesh, P(None, "tp")))
with fused._stalled_rank_for_tests(1, target="jaxoverlap_dgrad_rs_wgrad_v2"):
    g = grads(cfg)
    g.lower(x, w)
t0 = time.time()
dx, dw = g(x, w)
dx = np.asarray(dx, np.float32)
print("STALLED rank0_nan=%s seconds=%.1f" % (bool(np.isnan(dx[:1024]).all()), time.time() - t0))
try:
    jaxoverlap.check_errors()
    print("CHECK none")
except jaxoverlap.FusedCallError as e:
    print("CHECK " + str(e).replace(chr(10), " ")[:2000])
for _ in range(4):
    try:
        jaxoverlap.check_errors()
    except jaxoverlap.FusedCallError:
        pass
want = grads(jaxoverlap.Config(backend="xla"))(x, w)[0]
got = grads(jaxoverlap.Config(backend="fused"))(x, w)[0]
want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
print("AGAIN err=%.3g" % (np.abs(got - want).max() / np.abs(want).max()))
"""


def test_stalled_peer_in_the_backward_is_reported(gpus):
    """Rank 1 never signals its pushes of dx's blocks (test-only knob, 1 s timeout): rank 0
    gives up with NaN in its dx, check_errors() names the op, rank and peer, and the next
    training step on the same GPUs is right."""
    out, lines = run_script(_STALL)
    assert "rank0_nan=True" in lines.get("STALLED", ""), out[-3000:]
    check = lines.get("CHECK", "")
    assert "dgrad reduce-scatter" in check and "(rank 0)" in check, out[-3000:]
    assert "peer rank 1" in check, out[-3000:]
    assert float(lines["AGAIN"].split("err=")[1]) < 2e-2, out[-3000:]
