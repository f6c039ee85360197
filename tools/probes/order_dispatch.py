"""What the order (issue 26 R2, `JAXOVERLAP_ORDER_CALLS=1`) costs a jitted step's dispatch.

    python tools/probes/order_dispatch.py single          # one process, one device
    python tools/probes/order_form_worker.py P 2 PORT GPU dispatch dispatch   # two processes

A program with the order has JAX effects (`FusedOrder`, `FusedDispatch`), so ``jax.jit``
dispatches it in Python and passes a runtime token per device, where a program without them
takes JAX's C++ fast path. Per case, ``N`` calls issued without
blocking (async dispatch): ``issue`` is the host time per call to enqueue them, ``wall`` the time
per call until all finished. The order is read once, at import (``JAXOVERLAP_ORDER_CALLS``):
JAX caches a primitive's abstract evaluation, effects included, so one process measures one
setting; run it with the variable unset and set to 1. ``single``: one device, the ops'
reference (XLA) path -- the effect is declared whether or not the call fuses, so this is the
order's dispatch cost alone, no time-slicing of a shared GPU. ``pair``: two processes on the
GPUs (one GPU: shared), the fused calls. Prints ``dispatch <case> <shape> order=<0|1>
issue_us=... wall_us=...`` lines."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

N = int(os.environ.get("DISPATCH_N", "500"))
SHAPES = {"small": (256, 1024, 256), "large": (4096, 4096, 4096)}  # M, K, N of x @ w
if os.environ.get("DISPATCH_SHAPES") == "small":
    SHAPES = {"small": SHAPES["small"]}


def measure(mesh, arr, sync=lambda name: None, tag="single"):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxoverlap
    from jaxoverlap import Config
    from jaxoverlap.fused import call

    cfg = Config(backend="fused" if mesh.devices.size > 1 else "auto", timeout_s=30.0)
    rng = np.random.default_rng(0)
    rows = []
    for name, (m, k, n) in SHAPES.items():
        host = [
            (rng.standard_normal((m, k), np.float32) / 32).astype(jnp.bfloat16),
            (rng.standard_normal((k, n), np.float32) / 32).astype(jnp.bfloat16),
        ]
        args = [arr(host[0], P(None, "tp")), arr(host[1], P("tp", None))]
        for order in (call.ORDER_CALLS,):

            def body(x, w):
                return jaxoverlap.matmul_reduce_scatter(jnp.tanh(x), w, "tp", config=cfg)

            f = jax.jit(
                jax.shard_map(
                    body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp")
                )
            )
            effects = sorted(str(e) for e in jax.make_jaxpr(f)(*args).effects)
            jax.block_until_ready([f(*args) for _ in range(20)])  # compiled, warm
            jaxoverlap.check_errors()
            sync(f"{name}.{order}")
            t0 = time.perf_counter()
            outs = [f(*args) for _ in range(N)]
            t1 = time.perf_counter()
            jax.block_until_ready(outs)
            t2 = time.perf_counter()
            jaxoverlap.check_errors()
            issue, wall = (t1 - t0) / N * 1e6, (t2 - t0) / N * 1e6
            rows.append((name, int(order), issue, wall))
            print(
                f"dispatch {tag} {name} order={int(order)} effects={effects} "
                f"issue_us={issue:.1f} wall_us={wall:.1f} n={N}",
                flush=True,
            )
    return rows


def pair(mesh, arr, process):
    from jax._src import distributed

    client = distributed.global_state.client
    measure(mesh, arr, lambda name: client.wait_at_barrier(f"dispatch/{name}", 120_000), "pair")
    client.wait_at_barrier("dispatch/done", 120_000)


def single():
    import jax
    from jax.sharding import Mesh, NamedSharding

    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))

    def arr(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    measure(mesh, arr)


if __name__ == "__main__":
    if sys.argv[1:] == ["single"]:
        single()
