"""A plain-JAX tensor-parallel MLP stack, given the jaxoverlap ops by one `jaxoverlap.overlap` call.

The model is written as anyone would write Megatron-style sequence parallelism with
``jax.shard_map``: each layer all-gathers the sequence-sharded activations, multiplies by the
column-parallel ``w1``, applies gelu, multiplies by the row-parallel ``w2`` and reduce-scatters
the result back to sequence shards. No jaxoverlap call appears in the model. ``overlap(model)``
rewrites both matmul/collective pairs of every layer (inside ``lax.scan``) into
``all_gather_matmul`` and ``matmul_reduce_scatter``, and ``jax.grad`` of the result runs the
ops' own backward rules.

    python examples/overlap_mlp.py               # 8 fake CPU devices if there is no GPU
    python examples/overlap_mlp.py --seq 8192 --d-model 4096 --dtype bfloat16   # on GPUs

On CPU both versions run the same XLA collectives (the ops' reference path), so there is nothing
to gain and the step times differ only by noise: there the example shows only that the rewrite
is exact (f32: bit-identical; bf16: within rounding, as the ops' backward groups the math
differently). On NVLink-connected
Hopper GPUs the ops take the fused path where it is supported, which is where the time goes down.
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxoverlap  # noqa: E402

SPECS = (P("tp", None), P(None, None, "tp"), P(None, "tp", None))  # x, w1 stack, w2 stack


def layer(x, w1, w2):
    """One sequence-parallel MLP layer on per-device blocks: x [S/t, D] -> [S/t, D]."""
    h = jax.nn.gelu(lax.all_gather(x, "tp", axis=0, tiled=True) @ w1)  # [S, F/t]
    return x + lax.psum_scatter(h @ w2, "tp", scatter_dimension=0, tiled=True)


def make_model(mesh):
    def model(x, w1, w2):
        return lax.scan(lambda x, ws: (layer(x, *ws), None), x, (w1, w2))[0]

    return jax.shard_map(model, mesh=mesh, in_specs=SPECS, out_specs=SPECS[0])


def make_step(model):
    def step(x, w1, w2):
        """Loss and gradients w.r.t. the weights: one training step without the update."""
        return jax.value_and_grad(lambda w1, w2: jnp.mean(model(x, w1, w2) ** 2), (0, 1))(w1, w2)

    return step


def count_ops(fn, *args):
    """How many times each jaxoverlap op appears in ``fn``'s jaxpr, at any depth -- with the
    internal ones a training step binds: the all-gather that also returns what it gathered
    (``_keep``) and the column-parallel backward (``all_gather_matmul_backward``)."""
    names = ("all_gather_matmul", "all_gather_matmul_keep", "matmul_reduce_scatter")
    names += ("all_gather_matmul_backward", "matmul_all_reduce")
    counts = dict.fromkeys(names, 0)

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in counts:
                counts[eqn.primitive.name] += 1
            for sub in jax.tree.leaves(eqn.params, is_leaf=lambda v: hasattr(v, "eqns")):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    visit(getattr(sub, "jaxpr", sub))

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts


def timed(fns, args, iters):
    """Best-of-``iters`` wall time of each function, run alternately so drift hits both alike."""
    for fn in fns:
        jax.block_until_ready(fn(*args))  # compile and warm up
    best = [float("inf")] * len(fns)
    for _ in range(iters):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()

    devices = jax.devices()
    mesh = jax.make_mesh(
        (len(devices),), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices
    )
    dtype = jnp.dtype(args.dtype)
    k = jax.random.split(jax.random.key(0), 3)
    shapes = [
        (args.seq, args.d_model),
        (args.layers, args.d_model, args.ffn),
        (args.layers, args.ffn, args.d_model),
    ]
    x, w1, w2 = (
        jax.device_put(
            (jax.random.normal(key, s) / np.sqrt(s[-2] if len(s) == 3 else 1)).astype(dtype),
            NamedSharding(mesh, spec),
        )
        for key, s, spec in zip(k, shapes, SPECS)
    )

    model = make_model(mesh)
    print(f"{len(devices)} x {devices[0].device_kind}, {args.layers} layers, x {shapes[0]} {dtype}")
    jaxoverlap.explain(model, x, w1, w2)

    # The one change: overlap the forward model, then differentiate. The ops' derivative rules
    # keep the communication of JAX's own backward pass (one gather per layer and direction,
    # shared by dx and dW) and run fused what can: in training the reduce-scatters, forward and
    # in the backward of the gathers (the gathered activations are kept for dW, as in plain JAX).
    plain, fused = jax.jit(make_step(model)), jax.jit(make_step(jaxoverlap.overlap(model)))
    print("ops in the overlapped training step:", count_ops(fused, x, w1, w2))
    (loss0, grads0), (loss1, grads1) = plain(x, w1, w2), fused(x, w1, w2)
    err = max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        for a, b in zip((loss0, *grads0), (loss1, *grads1))
    )
    print(f"max |difference| in loss and gradients: {err:.3g}")

    t_plain, t_fused = timed((plain, fused), (x, w1, w2), args.iters)
    print(f"step time, plain JAX:          {t_plain * 1e3:8.3f} ms")
    print(f"step time, jaxoverlap.overlap: {t_fused * 1e3:8.3f} ms  ({t_plain / t_fused:.2f}x)")
    if devices[0].platform != "gpu":
        print(
            "On CPU both run XLA's own collectives (the ops' reference path), so there is no "
            "overlap to gain: any difference above is noise or a slightly different backward "
            "graph. The fused path needs NVLink-connected Hopper GPUs."
        )


if __name__ == "__main__":
    main()
