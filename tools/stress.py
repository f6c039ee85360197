"""Stress run of the fused path: many fused calls of mixed shapes and ops, every result checked.

Each program is a ``lax.scan`` whose body calls two fused ops (two call sites: a
matmul_reduce_scatter and an all_gather_matmul of different shapes, or two reduce-scatters), so
one execution of a program makes ``2 x steps`` fused calls. Programs of several shapes run in
turn until ``--calls`` fused calls were made; every execution's result is compared with the same
scan built from XLA's compositions (backend="xla") on the same inputs. Device memory in use
(cudaMemGetInfo) is sampled before the first and after the last execution: it must not grow
beyond the workspaces of the distinct ops, and `jaxoverlap.check_errors()` must be clean.

    python tools/stress.py                     # 2 GPUs, 10,000 fused calls
    python tools/stress.py --cpu-smoke         # fake CPU devices, the reference path: the harness
    python tools/stress.py --processes 2       # two processes (one GPU each, or sharing one GPU)
                                               # over 10 call sites: tools/stress_xproc.py

Exit status 0 when every result matched, memory stayed bounded and no fused call failed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

# (op pair, per-device shapes): matmul_reduce_scatter x [M, K_local] w [K_local, N];
# all_gather_matmul x [M / tp, K] w [K, N_local]. Two layers' worth of mixed sizes.
PROGRAMS = [
    (("rs", "ag"), (2048, 1024, 2048), (2048, 2048, 1024)),
    (("rs", "rs"), (4096, 2048, 1024), (1024, 1024, 4096)),
    (("ag", "ag"), (4096, 1024, 2048), (2048, 4096, 512)),
    (("rs", "ag"), (1024, 4096, 4096), (4096, 512, 2048)),
]
SMOKE = [(("rs", "ag"), (64, 32, 64), (64, 64, 32)), (("ag", "rs"), (64, 64, 32), (64, 32, 64))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, help="fused calls in all (default 10000; smoke 40)")
    p.add_argument("--steps", type=int, default=25, help="scan length of one program")
    p.add_argument("--cpu-smoke", action="store_true", help="2 fake CPU devices, tiny shapes")
    p.add_argument("--processes", type=int, default=0, help="a group over this many processes")
    p.add_argument("--timeout-s", type=float, default=60.0, help="Config.timeout_s (processes)")
    p.add_argument("--deadline-s", type=float, default=480.0, help="whole run (processes)")
    p.add_argument(
        "--memory",
        metavar="FRESH,SIZES[,MIB]",
        help="instead: memory over FRESH new jit call sites of 4 shapes, then SIZES call sites "
        "of distinct batch sizes (two processes; issue 25 item 4, docs/workspaces.md): the whole "
        "GPU's, XLA's and jaxoverlap's workspace pool's, the pool judged (flat, then one "
        "workspace per new size class; MIB: also at most that many MiB per process)",
    )
    a = p.parse_args(argv)
    if a.processes:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import stress_xproc

        backend = "xla" if a.cpu_smoke else "fused"
        if a.memory:
            memory = tuple(int(v) for v in a.memory.split(","))
            return stress_xproc.run(
                a.processes, 0, 0, 0, a.deadline_s, backend=backend, memory=memory
            )
        return stress_xproc.run(
            a.processes, a.calls or (200 if a.cpu_smoke else 10_000), a.steps if a.steps != 25
            else 10, a.timeout_s, a.deadline_s, backend=backend,
        )  # fmt: skip
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import jax

    if a.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 2)
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jaxoverlap
    from jaxoverlap import runtime

    calls = a.calls or (40 if a.cpu_smoke else 10_000)
    devices = jax.devices()[:2]
    mesh = Mesh(np.array(devices), ("tp",))
    backend = "xla" if a.cpu_smoke else "fused"
    dtype = jnp.float32 if a.cpu_smoke else jnp.bfloat16
    specs = {
        "rs": (P(None, None, "tp"), P(None, "tp", None)),
        "ag": (P(None, "tp"), P(None, None, "tp")),
    }

    def site(kind, config):
        if kind == "rs":
            return lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=config)
        return lambda x, w: jaxoverlap.all_gather_matmul(x, w, "tp", config=config)

    def program(kinds, config):
        f, g = (site(k, config) for k in kinds)

        def body(carry, xs):
            (x1, w1), (x2, w2) = xs
            return carry + 1, (f(x1, w1), g(x2, w2))

        def run(x1, w1, x2, w2):
            return lax.scan(body, jnp.zeros((), jnp.int32), ((x1, w1), (x2, w2)))

        in_specs = (*specs[kinds[0]], *specs[kinds[1]])
        out = (P(), (P(None, "tp") if kinds[0] == "rs" else P(None, None, "tp"),
                     P(None, "tp") if kinds[1] == "rs" else P(None, None, "tp")))  # fmt: skip
        return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=out))

    def inputs(kind, shape, key):
        m, k, n = shape
        kx, kw = jax.random.split(key)
        # Global operands with the scan's leading step dimension.
        xs, ws = ((a.steps, m, 2 * k), (a.steps, 2 * k, n)) if kind == "rs" else (
            (a.steps, m, k), (a.steps, k, 2 * n))  # fmt: skip
        x = jax.random.normal(kx, xs, jnp.float32).astype(dtype)
        w = (jax.random.normal(kw, ws, jnp.float32) / np.sqrt(ws[1])).astype(dtype)
        return (jax.device_put(x, NamedSharding(mesh, specs[kind][0])),
                jax.device_put(w, NamedSharding(mesh, specs[kind][1])))  # fmt: skip

    @jax.jit
    def check(got, want):
        """Largest relative error of the outputs (NaN if any output has a NaN)."""
        errs = []
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            g, w = g.astype(jnp.float32), w.astype(jnp.float32)
            e = jnp.max(jnp.abs(g - w)) / jnp.maximum(jnp.max(jnp.abs(w)), 1e-6)
            errs.append(jnp.where(jnp.all(jnp.isfinite(g)), e, jnp.nan))
        return jnp.max(jnp.stack(errs))

    table = SMOKE if a.cpu_smoke else PROGRAMS
    built = []
    for i, (kinds, s1, s2) in enumerate(table):
        k1, k2 = jax.random.split(jax.random.key(i))
        args = (*inputs(kinds[0], s1, k1), *inputs(kinds[1], s2, k2))
        fused = program(kinds, jaxoverlap.Config(backend=backend))
        want = program(kinds, jaxoverlap.Config(backend="xla"))(*args)
        built.append((f"{kinds[0]}{s1}+{kinds[1]}{s2}", fused, args, want))

    ordinals = [d.id for d in devices]
    gpu = devices[0].platform == "gpu"
    done, bad, t0 = 0, [], time.time()
    for _, fused, args, _ in built:  # first calls: workspaces, plans and kernels get set up
        jax.block_until_ready(fused(*args))
        done += 2 * a.steps
    mem0 = [runtime.memory_in_use(o) for o in ordinals] if gpu else None
    for name, fused, args, want in itertools.cycle(built):
        if done >= calls:
            break
        got = fused(*args)
        done += 2 * a.steps
        err = float(check(got, want))  # on the devices: only a scalar comes back
        if not err <= 3e-2:  # NaN (a call that gave up) fails too
            bad.append(f"{name}: relative error {err:.3g} after {done} calls")
        if bad:
            break
    jax.effects_barrier()
    mem1 = [runtime.memory_in_use(o) for o in ordinals] if gpu else None
    try:
        jaxoverlap.check_errors()
        error = None
    except jaxoverlap.FusedCallError as e:
        error = str(e)
    grew = [b - a_ for a_, b in zip(mem0, mem1)] if gpu else [0]
    print(f"{done} fused calls ({len(built)} programs x 2 call sites, scan of {a.steps}) in "
          f"{time.time() - t0:.1f} s; memory in use grew by "
          f"{max(grew) / 2**20:.1f} MiB; failed calls: {error or 'none'}")  # fmt: skip
    for b in bad:
        print("MISMATCH", b)
    ok = not bad and error is None and max(grew) < 64 * 2**20
    print("STRESS:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
