"""The models of the training-path GPU tests, shared by the one-process test
(tests/gpu/test_training_gpu.py, against XLA's collectives) and the two-process one
(tests/gpu/xproc_training.py, against the unsharded model): each builder takes the mesh and the
Config. ``with_loss=False`` leaves the loss values out (their sum is an XLA all-reduce, which two
processes sharing one GPU cannot run: NCCL refuses two ranks on one GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxoverlap


def grads(mesh, op, config, x_spec, w_spec, out_spec):
    """d/dx and d/dW of sum(sin(op(x, w))), op = all_gather_matmul ("ag") or
    matmul_reduce_scatter ("rs")."""

    def body(x, w):
        if op == "ag":
            return jaxoverlap.all_gather_matmul(x, w, "tp", config=config)
        return jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=config)

    f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
    return jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w).astype(jnp.float32))), (0, 1)))


def mlp_step(mesh, config, with_loss=True):
    """(loss,) grads of an all_gather_matmul -> gelu -> matmul_reduce_scatter MLP on x [B, S, D]
    split over S (sequence parallelism with a batch), w1 [D, F] and w2 [F, D] split over F."""

    def mlp(x, w1, w2):
        h = jaxoverlap.all_gather_matmul(x, w1, "tp", gather_dimension=1, config=config)
        return jaxoverlap.matmul_reduce_scatter(
            jax.nn.gelu(h), w2, "tp", scatter_dimension=1, config=config
        )

    specs = (P(None, "tp"), P(None, "tp"), P("tp"))
    f = jax.shard_map(mlp, mesh=mesh, in_specs=specs, out_specs=P(None, "tp"))
    loss = lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))  # noqa: E731
    grad = jax.value_and_grad if with_loss else jax.grad
    return jax.jit(grad(loss, argnums=(0, 1, 2)))


def scanned_train(mesh, config, with_loss=True):
    """Three SGD steps (lax.scan) of a residual two-layer MLP, itself a lax.scan over stacked
    weights w1 [L, D, F], w2 [L, F, D] split over F; x [T, D] split over T. Returns
    fn(x, w1, w2) -> ((w1, w2), losses) (or just (w1, w2) without the losses)."""

    def model(x, w1, w2):
        def layer(h, ws):
            u = jaxoverlap.all_gather_matmul(h, ws[0], "tp", config=config)
            return h + jaxoverlap.matmul_reduce_scatter(
                jax.nn.gelu(u), ws[1], "tp", config=config
            ), None

        return lax.scan(layer, x, (w1, w2))[0]

    specs = (P("tp"), P(None, None, "tp"), P(None, "tp"))
    f = jax.shard_map(model, mesh=mesh, in_specs=specs, out_specs=P("tp"))

    def run(x, w1, w2):
        def step(ws, _):
            loss = lambda ws: jnp.mean(jnp.square(f(x, *ws).astype(jnp.float32)))  # noqa: E731
            if with_loss:
                value, g = jax.value_and_grad(loss)(ws)
            else:
                value, g = None, jax.grad(loss)(ws)
            return jax.tree.map(lambda p, g: p - 0.5 * g.astype(p.dtype), ws, g), value

        ws, losses = lax.scan(step, (w1, w2), None, length=3)
        return (ws, losses) if with_loss else ws

    return jax.jit(run)
