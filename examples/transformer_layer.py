"""A tensor-parallel transformer, written the way model authors write it, trained for a few steps.

Megatron-style sequence parallelism in plain JAX under ``jax.shard_map``: activations between
layers are sharded over tokens; each layer all-gathers them before the column-parallel
projections (Q, K, V; SwiGLU gate and up) and reduce-scatters after the row-parallel ones
(attention output, MLP down). Layers run under ``lax.scan``; RMSNorm, residuals, causal
``jax.nn.dot_product_attention``, a hand-written AdamW. No jaxoverlap call appears in the model.

    python examples/transformer_layer.py                       # 8 fake CPU devices, no GPU
    python examples/transformer_layer.py --mode overlap        # jaxoverlap.overlap(model)
    python examples/transformer_layer.py --mode all --d-model 4096 --heads 32 --ffn 14336 \\
        --seq 8192 --layers 2 --dtype bfloat16                 # on GPUs

``--mode plain`` trains the model as written, ``overlap`` trains ``jaxoverlap.overlap(model)``;
``jit`` and ``matmul`` train the same model written as global-view ``jit`` code (sharding
constraints), with plain ``@`` or with `jaxoverlap.matmul`; ``all`` trains every variant from the
same initial state and checks that their losses agree. The
overlapped model's ops take the fused GPU path where it is supported (NVLink-connected Hopper
GPUs) and XLA's composition elsewhere, so on CPU the two runs compute the same thing.

``benchmarks/transformer_layer.py`` times this layer's train step against its no-communication
bound.
"""

from __future__ import annotations

import argparse
import os
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Harmless on GPU machines (it only affects the CPU platform).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from overlap_mlp import count_ops  # noqa: E402  (examples/ is on sys.path)

import jaxoverlap  # noqa: E402

AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class Dims:
    d_model: int
    heads: int
    ffn: int
    seq: int  # tokens per sequence
    batch: int = 1
    layers: int = 1
    attention: str | None = None  # jax.nn.dot_product_attention's implementation (None: JAX's pick)
    # One [D, 3, D] Q/K/V weight and one [D, 2, F] gate/up weight (as many models store them)
    # instead of separate ones; shard_map variants only.
    fused_proj: bool = False

    @property
    def head_dim(self):
        return self.d_model // self.heads

    @property
    def tokens(self):
        return self.batch * self.seq


# The communication the layer does, as functions of the per-device block. `PLAIN` is what the
# model author writes; `no_comm` (benchmarks) swaps in local stand-ins of the same shapes.
def all_gather(x):
    return lax.all_gather(x, AXIS, axis=0, tiled=True)


def reduce_scatter(y):
    return lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True)


PLAIN = (all_gather, reduce_scatter)


def rms_norm(x, g, eps=1e-6):
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * g).astype(x.dtype)


def layer(dims: Dims, x, p, comm=PLAIN):
    """One layer on per-device blocks: x [tokens / tp, D] -> the same.

    ``p`` holds this device's weight shards: wq/wk/wv [D, H_local * Dh], wo [H_local * Dh, D],
    wg/wu [D, F_local], wd [F_local, D], norms g1/g2 [D].
    """
    gather, scatter = comm
    b, s, dh = dims.batch, dims.seq, dims.head_dim
    h = gather(rms_norm(x, p["g1"]))  # [T, D]
    if dims.fused_proj:  # wqkv [D, 3, H_local * Dh]: one matmul, split after
        qkv = (h @ p["wqkv"].reshape(h.shape[-1], -1)).reshape(b * s, 3, -1)
        q, k, v = (qkv[:, i].reshape(b, s, -1, dh) for i in range(3))
    else:
        q, k, v = (
            (h @ p[name]).reshape(b, s, -1, dh) for name in ("wq", "wk", "wv")
        )  # [B, S, H_local, Dh]
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=dims.attention)
    a = a.reshape(b * s, -1)
    x = x + scatter(a @ p["wo"])
    h = gather(rms_norm(x, p["g2"]))
    if dims.fused_proj:  # wgu [D, 2, F_local]
        gu = (h @ p["wgu"].reshape(h.shape[-1], -1)).reshape(h.shape[0], 2, -1)
        m = jax.nn.silu(gu[:, 0]) * gu[:, 1]
    else:
        m = jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])
    return x + scatter(m @ p["wd"])


def param_specs(dims: Dims | None = None):
    """PartitionSpecs of the stacked [layers, ...] parameters over the "tp" axis."""
    col, row, rep = P(None, None, AXIS), P(None, AXIS, None), P(None, None)
    if dims is not None and dims.fused_proj:
        col3 = P(None, None, None, AXIS)  # [L, D, 3 | 2, N]: every device gets its q, k, v
        return dict(wqkv=col3, wo=row, wgu=col3, wd=row, g1=rep, g2=rep)
    return dict(wq=col, wk=col, wv=col, wo=row, wg=col, wu=col, wd=row, g1=rep, g2=rep)


def init_params(dims: Dims, key, dtype):
    d, f, l_ = dims.d_model, dims.ffn, dims.layers
    shapes = dict(wq=(d, d), wk=(d, d), wv=(d, d), wo=(d, d), wg=(d, f), wu=(d, f), wd=(f, d))
    if dims.fused_proj:
        shapes = dict(wqkv=(d, 3, d), wo=(d, d), wgu=(d, 2, f), wd=(f, d))
    keys = jax.random.split(key, len(shapes))
    params = {
        name: (jax.random.normal(k, (l_, *s), jnp.float32) / np.sqrt(s[0])).astype(dtype)
        for k, (name, s) in zip(keys, shapes.items())
    }
    params.update(g1=jnp.ones((l_, d), dtype), g2=jnp.ones((l_, d), dtype))
    return params


def make_model(dims: Dims, mesh, comm=PLAIN):
    """The model over the mesh: (params, x [tokens, D] sharded over tokens) -> same as x."""

    def model(params, x):
        return lax.scan(lambda x, p: (layer(dims, x, p, comm), None), x, params)[0]

    return jax.shard_map(
        model, mesh=mesh, in_specs=(param_specs(dims), P(AXIS, None)), out_specs=P(AXIS, None)
    )


def global_layer(dims: Dims, x, p, mm):
    """The same layer on global arrays under ``jit`` (no shard_map): ``x [tokens, D]`` sharded
    over tokens, weights as `param_specs`; ``mm(a, w, spec)`` multiplies and shards the result
    (features split for Q, K, V, gate and up; tokens split for the output and down projections,
    where XLA -- or `jaxoverlap.matmul` -- reduce-scatters)."""
    b, s, dh = dims.batch, dims.seq, dims.head_dim
    tokens, features = P(AXIS, None), P(None, AXIS)
    h = rms_norm(x, p["g1"])
    q, k, v = (mm(h, p[name], features).reshape(b, s, -1, dh) for name in ("wq", "wk", "wv"))
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=dims.attention)
    x = x + mm(a.reshape(b * s, -1), p["wo"], tokens)
    h = rms_norm(x, p["g2"])
    m = jax.nn.silu(mm(h, p["wg"], features)) * mm(h, p["wu"], features)
    return x + mm(m, p["wd"], tokens)


def make_global_model(dims: Dims, mesh, use_jaxoverlap: bool):
    """The model as global-view ``jit`` code: plain ``@`` with sharding constraints, or
    `jaxoverlap.matmul` with ``out_sharding`` (the partitioner picks the op)."""

    def mm(a, w, spec):
        sharding = NamedSharding(mesh, spec)
        if use_jaxoverlap:
            return jaxoverlap.matmul(a, w, out_sharding=sharding)
        return lax.with_sharding_constraint(a @ w, sharding)

    def model(params, x):
        return lax.scan(lambda x, p: (global_layer(dims, x, p, mm), None), x, params)[0]

    return model


def loss_fn(model):
    def loss(params, x, y):
        out = model(params, x).astype(jnp.float32)
        return jnp.mean((out - y.astype(jnp.float32)) ** 2)

    return loss


def adamw_step(loss, lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    """One jitted train step: (params, opt_state, x, y) -> (params, opt_state, loss)."""

    def step(params, state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        t = state["t"] + 1
        mu = jax.tree.map(
            lambda m, g: b1 * m + (1 - b1) * g.astype(jnp.float32), state["mu"], grads
        )
        nu = jax.tree.map(
            lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(jnp.float32)), state["nu"], grads
        )

        def update(p, m, v):
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            p32 = p.astype(jnp.float32)
            return (p32 - lr * (m_hat / (jnp.sqrt(v_hat) + eps) + wd * p32)).astype(p.dtype)

        params = jax.tree.map(update, params, mu, nu)
        return params, dict(t=t, mu=mu, nu=nu), value

    return jax.jit(step, donate_argnums=(0, 1))


def init_state(params):
    zeros = lambda p: jnp.zeros(p.shape, jnp.float32)  # noqa: E731
    return dict(
        t=jnp.zeros((), jnp.int32), mu=jax.tree.map(zeros, params), nu=jax.tree.map(zeros, params)
    )


def place(mesh, params, x, y, dims: Dims | None = None):
    shard = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))  # noqa: E731
    specs = param_specs(dims)
    return (
        {k: shard(v, specs[k]) for k, v in params.items()},
        shard(x, P(AXIS, None)),
        shard(y, P(AXIS, None)),
    )


def train(dims, mesh, model, steps, dtype, seed=0):
    """Trains ``model`` for ``steps`` steps from a fixed initial state; returns losses, step ms."""
    k_p, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    params = init_params(dims, k_p, dtype)
    x = jax.random.normal(k_x, (dims.tokens, dims.d_model), jnp.float32).astype(dtype)
    y = jax.random.normal(k_y, (dims.tokens, dims.d_model), jnp.float32).astype(dtype)
    params, x, y = place(mesh, params, x, y, dims)
    step = adamw_step(loss_fn(model))
    state = init_state(params)
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))  # syncs
        times.append((time.perf_counter() - t0) * 1e3)
    return losses, times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--mode", default="all", choices=["plain", "overlap", "jit", "matmul", "all"]
    )
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tp", type=int, help="devices in the tp axis (default: all)")
    args = parser.parse_args()

    devices = jax.devices()[: args.tp or len(jax.devices())]
    mesh = jax.make_mesh(
        (len(devices),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices
    )
    dtype = jnp.dtype(args.dtype)
    dims = Dims(args.d_model, args.heads, args.ffn, args.seq, args.batch, args.layers)
    print(f"{len(devices)} x {devices[0].device_kind}, {dims}, {dtype}")

    plain = make_model(dims, mesh)
    runs = {}
    if args.mode in ("plain", "all"):
        runs["plain"] = plain
    if args.mode in ("jit", "all"):
        runs["jit"] = make_global_model(dims, mesh, use_jaxoverlap=False)
    if args.mode in ("matmul", "all"):
        runs["matmul"] = make_global_model(dims, mesh, use_jaxoverlap=True)
    if args.mode in ("overlap", "all"):
        runs["overlap"] = jaxoverlap.overlap(plain)
        k_p, k_x = jax.random.split(jax.random.key(1))
        params = init_params(dims, k_p, dtype)
        x = jax.random.normal(k_x, (dims.tokens, dims.d_model), jnp.float32).astype(dtype)
        params, x, _ = place(mesh, params, x, x, dims)
        jaxoverlap.explain(plain, params, x)
        grad = jax.grad(loss_fn(runs["overlap"]))
        print("ops in the overlapped train step:", count_ops(grad, params, x, x))

    results = {}
    for name, model in runs.items():
        losses, times = train(dims, mesh, model, args.steps, dtype)
        results[name] = losses
        print(
            f"{name:8s} losses {' '.join(f'{v:.5f}' for v in losses)}; "
            f"step ms (after the first) median {np.median(times[1:] or times):.2f}"
        )
    first = next(iter(results))
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    for name in list(results)[1:]:
        a, b = np.array(results[first]), np.array(results[name])
        diff = float(np.max(np.abs(a - b) / np.maximum(np.abs(a), 1e-6)))
        print(f"max relative loss difference {first} vs {name}: {diff:.3g} (tolerance {tol})")
        if diff > tol:
            raise SystemExit(f"FAILED: the {name} model's losses differ from the {first} model's")


if __name__ == "__main__":
    main()
