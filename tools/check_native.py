"""GPU machine check of the carried native extension (run from the repository root).

Checks, in order, and stops at the first failure with a sentence saying what is wrong:
  1. jaxoverlap/_native*.so is present and its shared-library dependencies resolve;
  2. `import jaxoverlap` works and initialises no GPU backend;
  3. jaxoverlap.runtime loads the extension and registers its FFI targets with XLA;
  4. on two GPUs, a small fused matmul_reduce_scatter compiles to a jaxoverlap custom call
     (and no reduce-scatter) and equals the reference; likewise tma.tma_reduce_scatter.

  PYTHONPATH=. python3 tools/check_native.py
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys


def fail(msg: str) -> int:
    print(f"FAIL: {msg}", flush=True)
    return 1


def check_files() -> str | None:
    libs = sorted(glob.glob("jaxoverlap/_native*.so"))
    if not libs:
        return "no jaxoverlap/_native*.so here: build it on the CPU machine and carry it"
    for lib in libs:
        print(f"{lib}: {os.path.getsize(lib)} bytes", flush=True)
        try:
            ldd = subprocess.run(["ldd", lib], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError) as e:
            print(f"  (ldd unavailable: {e})")
            continue
        missing = [ln.strip() for ln in ldd.splitlines() if "not found" in ln]
        # libcublasLt is preloaded by jaxoverlap.runtime from the nvidia-cublas wheel.
        for ln in missing:
            print(f"  unresolved by ldd (may be preloaded at run time): {ln}")
    return None


def main() -> int:
    if err := check_files():
        return fail(err)

    import jax

    import jaxoverlap
    from jaxoverlap import fused, runtime

    backends = getattr(jax._src.xla_bridge, "_backends", None)
    if backends:
        return fail(f"import jaxoverlap initialised JAX backends: {sorted(backends)}")
    print("import jaxoverlap: ok, no backend initialised", flush=True)

    if (why := runtime.unavailable_reason()) is not None:
        return fail(why)
    mod = runtime.native()
    names = sorted(mod.registrations())
    print(f"jaxoverlap._native loaded from {mod.__file__}; FFI targets: {names}", flush=True)
    print(f"ffi api version: {getattr(mod, 'ffi_api_version', '?')}", flush=True)
    runtime.register_targets()
    print("FFI targets registered with XLA (CUDA)", flush=True)

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    print(f"devices: {jax.devices()}", flush=True)
    if len(gpus) < 2:
        return fail(f"need 2 GPUs, JAX sees {len(gpus)}")
    return check_ops(jax, jaxoverlap, fused, gpus[:2])


def check_ops(jax, jaxoverlap, fused, gpus) -> int:
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jaxoverlap.fused import tma

    mesh = Mesh(np.array(gpus), ("tp",))
    gemm_rs_target, rs_target = fused.emitted(fused.GEMM_RS_TARGET), fused.emitted(tma.RS_TARGET)
    m, k, n = 1024, 2048, 1024  # global K; per-device 1024x1024 @ 1024x1024
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    cfg = jaxoverlap.Config(backend="fused")

    def smap(f, in_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=P("tp", None)))

    xw = (P(None, "tp"), P("tp", None))
    ours = smap(lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg), xw)
    ref = smap(lambda x, w: lax.psum_scatter(jnp.matmul(x, w), "tp", tiled=True), xw)
    hlo = ours.lower(x, w).compile().as_text()
    if gemm_rs_target not in hlo or "reduce-scatter" in hlo:
        return fail(
            f"fused matmul_reduce_scatter HLO lacks {gemm_rs_target} or still has a reduce-scatter"
        )
    got, want = (np.asarray(a.astype(jnp.float32)) for a in (ours(x, w), ref(x, w)))
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    print(f"fused matmul_reduce_scatter {m}x{k // 2}x{n} tp=2: rel err {err:.2e}", flush=True)
    if not err < 2e-2:
        return fail("fused matmul_reduce_scatter differs from the reference")

    ag_target = getattr(fused, "AG_GEMM_TARGET", None)
    if ag_target is not None:  # x [m, K/2] split over rows, w [K/2, 2 * n] split over N
        xr, wr = x[:, : k // 2], jnp.tile(w[: k // 2], (1, 2))
        spec = dict(in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
        agm = jax.jit(
            jax.shard_map(
                lambda x, w: jaxoverlap.all_gather_matmul(x, w, "tp", config=cfg), mesh=mesh, **spec
            )
        )
        if fused.emitted(ag_target) not in agm.lower(xr, wr).compile().as_text():
            return fail(f"fused all_gather_matmul HLO lacks {ag_target}")
        got = np.asarray(agm(xr, wr).astype(jnp.float32))
        want = np.asarray(jnp.matmul(xr.astype(jnp.float32), wr.astype(jnp.float32)))
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        print(f"fused all_gather_matmul {m}x{k // 2}x{n} tp=2: rel err {err:.2e}", flush=True)
        if not err < 2e-2:
            return fail("fused all_gather_matmul differs from the reference")

    def all_reduce(x, w):
        return jaxoverlap.matmul_all_reduce(x, w, "tp", config=cfg)

    ar = jax.jit(jax.shard_map(all_reduce, mesh=mesh, in_specs=xw, out_specs=P()))
    if fused.emitted(fused.GEMM_AR_TARGET) not in ar.lower(x, w).compile().as_text():
        return fail(f"fused matmul_all_reduce HLO lacks {fused.GEMM_AR_TARGET}")
    got = [np.asarray(s.data.astype(jnp.float32)) for s in ar(x, w).addressable_shards]
    want = np.asarray(jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32)))
    err = max(float(np.max(np.abs(g - want)) / np.max(np.abs(want))) for g in got)
    print(f"fused matmul_all_reduce {m}x{k // 2}x{n} tp=2: rel err {err:.2e}", flush=True)
    if not err < 2e-2 or not np.array_equal(got[0], got[1]):
        return fail("fused matmul_all_reduce differs from the reference, or between the GPUs")

    y = jax.random.normal(kx, (m, 2 * n), jnp.float32).astype(jnp.bfloat16)
    tma_rs = smap(lambda y: tma.tma_reduce_scatter(y, "tp", comm_sms=8), P(None, "tp"))
    nccl = smap(lambda y: lax.psum_scatter(y, "tp", tiled=True), P(None, "tp"))
    if rs_target not in tma_rs.lower(y).compile().as_text():
        return fail(f"tma_reduce_scatter HLO lacks {rs_target}")
    same = bool(jnp.array_equal(tma_rs(y), nccl(y)))
    print(f"tma_reduce_scatter comm_sms=8: bitwise equal to NCCL: {same}", flush=True)
    if not same:
        got, want = (np.asarray(a.astype(jnp.float32)) for a in (tma_rs(y), nccl(y)))
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        print(f"  rel err {err:.2e}")
        if not err < 1e-2:
            return fail("tma_reduce_scatter differs from lax.psum_scatter")
    if rc := check_new_kernels(jax, jaxoverlap, mesh, x, w, xw):
        return rc
    print("native check: OK", flush=True)
    return 0


def check_new_kernels(jax, jaxoverlap, mesh, x, w, xw) -> int:
    """The copy-engine reduce-scatter (comm_sms=0) and a training step of an all-gather +
    reduce-scatter MLP (the all-gather that returns x, the column-parallel backward, w.T read
    in place) against XLA's."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    def rel(got, want):
        got, want = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (got, want))
        return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))

    def rs(config):
        f = lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=config)  # noqa: E731
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=xw, out_specs=P("tp", None)))

    ce = jaxoverlap.Config(backend="fused", comm_sms=0, chunks=2)
    err = rel(rs(ce)(x, w), rs(jaxoverlap.Config(backend="xla"))(x, w))
    print(f"fused matmul_reduce_scatter, copy engine (comm_sms=0): rel err {err:.2e}", flush=True)
    if not err < 2e-2:
        return fail("the copy-engine matmul_reduce_scatter differs from the reference")

    def grads(config):
        def mlp(h, w1, w2):
            u = jaxoverlap.all_gather_matmul(h, w1, "tp", config=config)
            return jaxoverlap.matmul_reduce_scatter(u, w2, "tp", config=config)

        specs = (P("tp"), P(None, "tp"), P("tp", None))
        f = jax.shard_map(mlp, mesh=mesh, in_specs=specs, out_specs=P("tp"))
        loss = lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    h, w1, w2 = x[:, :768], w[:768, :1280], w[:1280, :768]  # distinct GEMM dimensions
    fused_step = grads(jaxoverlap.Config(backend="fused"))
    hlo = fused_step.lower(h, w1, w2).compile().as_text()
    if "all-gather" in hlo or "reduce-scatter" in hlo:
        return fail("the fused training step still has an XLA all-gather or reduce-scatter")
    got, want = fused_step(h, w1, w2), grads(jaxoverlap.Config(backend="xla"))(h, w1, w2)
    errs = [rel(a, b) for a, b in zip(got, want, strict=True)]
    print("fused training step (dx, dW1, dW2): rel err " + ", ".join(f"{e:.2e}" for e in errs))
    if not max(errs) < 3e-2:
        return fail("the fused training step's gradients differ from XLA's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
