"""A tensor-parallel transformer MLP block with jaxoverlap, forward and backward.

Sequence-parallel layout (Megatron style): activations are split over the sequence across the
``tp`` axis; the block all-gathers them into the first matmul and reduce-scatters the second:

    y = matmul_reduce_scatter(gelu(all_gather_matmul(x, w1)), w2)

Runs on whatever devices exist: the GPUs (fused kernels where supported) or, with no
accelerator, 8 fake CPU devices (the reference path). Checks the result against the unsharded
computation and prints the backend used, the max error and the step time.

    python examples/quickstart.py
"""

import os
import time

# Only affects the CPU platform: 8 fake devices when there is no accelerator.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxoverlap  # noqa: E402


def main():
    devices = jax.devices()
    on_gpu = devices[0].platform == "gpu"
    tp = len(devices)
    mesh = jax.make_mesh((tp,), ("tp",), axis_types=(AxisType.Auto,))
    # Sequence, model and hidden sizes: transformer-like on GPUs, small on CPU.
    seq, d_model, d_ff = (8192, 4096, 16384) if on_gpu else (256 * tp // 2, 256, 1024)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32

    kx, k1, k2 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (seq, d_model), dtype)
    w1 = (jax.random.normal(k1, (d_model, d_ff)) / np.sqrt(d_model)).astype(dtype)
    w2 = (jax.random.normal(k2, (d_ff, d_model)) / np.sqrt(d_ff)).astype(dtype)
    specs = (P("tp", None), P(None, "tp"), P("tp", None))  # x rows, w1 columns, w2 rows
    x, w1, w2 = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w1, w2), specs))

    def block(x, w1, w2):
        h = jax.nn.gelu(jaxoverlap.all_gather_matmul(x, w1, "tp"))
        return jaxoverlap.matmul_reduce_scatter(h, w2, "tp")

    sharded_block = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=P("tp", None))

    def loss(fn, x, w1, w2):
        return jnp.mean(fn(x, w1, w2).astype(jnp.float32) ** 2)

    def unsharded_block(x, w1, w2):
        f32 = [a.astype(jnp.float32) for a in (x, w1, w2)]
        return (jax.nn.gelu(f32[0] @ f32[1]) @ f32[2]).astype(dtype)

    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(lambda *a: loss(sharded_block, *a), argnums=(0, 1, 2)))
        ref_step = jax.jit(
            jax.value_and_grad(lambda *a: loss(unsharded_block, *a), argnums=(0, 1, 2))
        )
        hlo = step.lower(x, w1, w2).compile().as_text()
        (val, grads) = step(x, w1, w2)
        (ref_val, ref_grads) = ref_step(x, w1, w2)
        out = jax.jit(sharded_block)(x, w1, w2)
        ref_out = jax.jit(unsharded_block)(x, w1, w2)

        jax.block_until_ready(step(x, w1, w2))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(step(x, w1, w2))
            times.append(time.perf_counter() - t0)

    def err(a, b):
        a, b = (np.asarray(jnp.asarray(v, jnp.float32)) for v in (a, b))
        return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))

    errors = {"output": err(out, ref_out), "loss": err(val, ref_val)}
    errors.update({f"d{n}": err(g, r) for n, g, r in zip(("x", "w1", "w2"), grads, ref_grads)})
    fused = "jaxoverlap_" in hlo
    backend = "fused jaxoverlap kernels" if fused else "reference (XLA GEMM + collectives)"
    tol = 5e-2 if dtype == jnp.bfloat16 else 1e-4

    print(f"devices      : {tp} x {devices[0].device_kind} ({devices[0].platform})")
    print(f"shapes       : x [{seq}, {d_model}], w1 [{d_model}, {d_ff}], w2 [{d_ff}, {d_model}]")
    print(f"dtype        : {jnp.dtype(dtype).name}")
    print(f"backend      : {backend}")
    for name, e in errors.items():
        print(f"max rel err  : {name:6s} {e:.2e}  (tolerance {tol:.0e})")
    print(f"step time    : {np.median(times) * 1e3:.2f} ms (forward + backward, median of 5)")
    bad = {k: v for k, v in errors.items() if not v <= tol}
    if bad:
        raise SystemExit(f"FAILED: error above tolerance: {bad}")
    print("OK")


if __name__ == "__main__":
    main()
