"""Quick check on 2 GPUs that the native extension loads and both custom calls run and agree
with XLA (one small shape each). Exit status 0 when all is well."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import fused, runtime
from jaxoverlap.fused import tma

print("native:", runtime.unavailable_reason() or "loaded", flush=True)
mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
x = jax.device_put(
    jax.random.normal(jax.random.key(0), (2048, 2048), jnp.bfloat16),
    NamedSharding(mesh, P(None, "tp")),
)
w = jax.device_put(
    jax.random.normal(jax.random.key(1), (2048, 1024), jnp.bfloat16) / 32,
    NamedSharding(mesh, P("tp", None)),
)
ok = True
for backend in ("fused", "xla"):
    cfg = jaxoverlap.Config(backend=backend)
    f = jax.jit(
        jax.shard_map(
            lambda x, w, cfg=cfg: jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg),
            mesh=mesh,
            in_specs=(P(None, "tp"), P("tp", None)),
            out_specs=P("tp", None),
        )
    )
    t = time.time()
    y = jax.block_until_ready(f(x, w))
    print(backend, "first call", round(time.time() - t, 3), "s", flush=True)
    if backend == "fused":
        yf = y
        hlo = f.lower(x, w).compile().as_text()
        print("custom call in HLO:", fused.emitted(fused.GEMM_RS_TARGET) in hlo)
err = float(jnp.max(jnp.abs(yf.astype(jnp.float32) - y.astype(jnp.float32))) / jnp.max(jnp.abs(y)))
print("gemm_rs rel err", err, flush=True)
ok &= err < 2e-2
rs = [
    jax.jit(jax.shard_map(g, mesh=mesh, in_specs=P(None, "tp"), out_specs=P("tp", None)))(x)
    for g in (
        lambda v: tma.tma_reduce_scatter(v, "tp", comm_sms=16),
        lambda v: lax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True),
    )
]
err = float(jnp.max(jnp.abs(rs[0].astype(jnp.float32) - rs[1].astype(jnp.float32))))
print("tma rs abs err", err, flush=True)
ok &= err < 0.1
print("SMOKE", "OK" if ok else "FAILED", runtime.pending_error())
sys.exit(0 if ok else 1)
