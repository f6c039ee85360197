"""The quickstart's tensor-parallel MLP on a dp x tp mesh over several processes.

Every process drives its local devices; the mesh holds all processes' devices (``jax.devices()``
is global once ``jax.distributed`` is initialised). ``tp`` is the devices of one process, ``dp``
runs across processes, so the block's collectives over ``tp`` stay inside a process (fused on
GPUs where supported) and the gradient's reduction over ``dp`` crosses processes (XLA). With one
device per process, ``tp`` spans the processes: on GPUs of one host joined by NVLink it fuses
too (one GPU per process; the workspace is mapped across the processes by CUDA IPC).

    y = matmul_reduce_scatter(gelu(all_gather_matmul(x, w1, "tp")), w2, "tp")

Each process computes the unsharded forward and backward itself from the same deterministic
inputs, checks its own shards of the output and gradients against it, prints the errors and
exits non-zero on a mismatch. Start it with the launcher (2 processes x 2 fake CPU devices on a
machine without GPUs; ``--devices-per-process`` GPUs each on a GPU machine)::

    python -m jaxoverlap.launch -n 2 --devices-per-process 2 examples/multihost.py

Across hosts, start one process per host with SLURM / Open MPI / Kubernetes and pass
``--cluster``: ``jax.distributed.initialize()`` then reads the scheduler's environment.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import launch


def mesh_over_processes(tp):
    """dp x tp: the rows are processes when ``tp`` is the per-process device count."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devices) % tp:
        raise SystemExit(f"--tp {tp} does not divide the {len(devices)} devices")
    return Mesh(np.array(devices).reshape(len(devices) // tp, tp), ("dp", "tp"))


def block(x, w1, w2):
    h = jax.nn.gelu(jaxoverlap.all_gather_matmul(x, w1, "tp"))
    return jaxoverlap.matmul_reduce_scatter(h, w2, "tp")


def unsharded_block(x, w1, w2):
    f32 = [a.astype(jnp.float32) for a in (x, w1, w2)]
    return (jax.nn.gelu(f32[0] @ f32[1]) @ f32[2]).astype(x.dtype)


def loss(fn, x, w1, w2):
    return jnp.mean(fn(x, w1, w2).astype(jnp.float32) ** 2)


def err(a, b):
    a, b = (np.asarray(v, np.float32) for v in (a, b))
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=None, help="default: devices per process")
    parser.add_argument("--cluster", action="store_true", help="SLURM/MPI/k8s auto-detection")
    parser.add_argument("--expect-fused", action="store_true", help="fail unless an op ran fused")
    args = parser.parse_args()
    # Before anything touches a device: with several processes, jax.devices() is then global.
    if args.cluster:
        jax.distributed.initialize()
    else:
        launch.initialize()  # a no-op unless started by python -m jaxoverlap.launch
    rank, local = jax.process_index(), jax.local_devices()
    on_gpu = local[0].platform == "gpu"
    tp = args.tp or (len(local) if len(local) > 1 else jax.device_count())
    mesh = mesh_over_processes(tp)
    dp = mesh.shape["dp"]
    rows, d_model, d_ff = (8192, 4096, 16384) if on_gpu else (64, 128, 256)  # per dp replica
    dtype = jnp.bfloat16 if on_gpu else jnp.float32

    # The same inputs in every process, so each can compute the unsharded reference.
    rng = np.random.default_rng(0)
    host = [
        rng.standard_normal((dp * rows, d_model)).astype(dtype),
        (rng.standard_normal((d_model, d_ff)) / np.sqrt(d_model)).astype(dtype),
        (rng.standard_normal((d_ff, d_model)) / np.sqrt(d_ff)).astype(dtype),
    ]
    specs = (P(("dp", "tp"), None), P(None, "tp"), P("tp", None))
    x, w1, w2 = (
        jax.make_array_from_callback(a.shape, NamedSharding(mesh, s), lambda i, a=a: a[i])
        for a, s in zip(host, specs, strict=True)
    )
    sharded = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=specs[0])
    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(lambda *a: loss(sharded, *a), argnums=(0, 1, 2)))
        hlo = step.lower(x, w1, w2).compile().as_text()
        val, grads = step(x, w1, w2)
        out = jax.jit(sharded)(x, w1, w2)

    # The unsharded reference, on this process's first device only (no collectives).
    ref_in = [jax.device_put(a, local[0]) for a in host]
    ref_val, ref_grads = jax.jit(
        jax.value_and_grad(lambda *a: loss(unsharded_block, *a), argnums=(0, 1, 2))
    )(*ref_in)
    ref_out = jax.jit(unsharded_block)(*ref_in)

    errors = {"loss": err(val.addressable_data(0), ref_val)}
    for name, got, want in zip(("out", "dx", "dw1", "dw2"), (out, *grads), (ref_out, *ref_grads)):
        want = np.asarray(want)
        errors[name] = max(err(s.data, want[s.index]) for s in got.addressable_shards)
    tol = 5e-2 if dtype == jnp.bfloat16 else 1e-4
    fused = "jaxoverlap_" in hlo
    p = f"process {rank}/{jax.process_count()}:"
    ids = [d.id for d in local]
    print(f"{p} mesh dp={dp} x tp={tp}, local devices {ids} ({local[0].platform})")
    print(f"{p} backend: {'fused jaxoverlap kernels' if fused else 'reference (XLA)'}")
    print(f"{p} errors " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()) + f" (tol {tol})")
    bad = {k: v for k, v in errors.items() if not v <= tol}
    if bad:
        raise SystemExit(f"{p} FAILED: error above tolerance: {bad}")
    if args.expect_fused and not fused:
        raise SystemExit(f"{p} FAILED: --expect-fused, but no jaxoverlap custom call in the HLO")
    print(f"{p} OK")


if __name__ == "__main__":
    main()
