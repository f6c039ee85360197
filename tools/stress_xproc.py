"""Stress run across processes: ``--processes 2`` of tools/stress.py (one GPU each, or both on
one GPU, where their kernels time-slice: endurance, not speed).

Each process joins ``jax.distributed`` (loopback), builds a 1-D ``tp`` mesh over both processes'
devices and compiles one ``lax.scan`` program per call site -- the three ops, rows / a middle
dimension / the last dimension / K, the chunked, copy-engine and tile schedules, bf16 and f16 --
each step one fused call on that step's operands. The programs run in turn until ``calls`` fused
calls were made. Every execution's shard is compared on the device with (a) a float32 NumPy
reference of the whole problem that this process computes itself, and (b) the bits of the
site's first execution (the fused kernels sum in a fixed order: equal inputs, equal bits).
Device memory in use (cudaMemGetInfo) is sampled after the first round and at the end.

Prints per process ``STRESS-XPROC: PASSED`` or ``FAILED`` with the counts; exit status 0 when
both processes passed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sites(scale=1):
    """[(tag, op, kwargs, Config kwargs, dtype, x global shape, w global shape, x spec, w spec,
    out spec)] -- x shapes without the scan's leading step dimension; sizes of 512 and more
    divided by ``scale`` (the CPU harness)."""
    table = _sites()
    sc = lambda shape: tuple(d // scale if d >= 512 else d for d in shape)  # noqa: E731
    return [(*r[:5], sc(r[5]), sc(r[6]), *r[7:]) for r in table]


def _sites():
    from jax.sharding import PartitionSpec as P

    rows = (P(None, "tp"), P("tp", None))  # x [M, K] sharded over K: RS/AR contract it
    out_rows = P("tp", None)
    t = (P(None, None, "tp"), P("tp", None))  # x [B, S, K]
    return [
        ("rs_rows_bf16", "rs", {}, {}, "bfloat16", (2048, 1024), (1024, 1024), *rows, out_rows),
        ("rs_rows_f16", "rs", {}, {}, "float16", (2048, 1024), (1024, 1024), *rows, out_rows),
        ("rs_ce", "rs", {}, {"comm_sms": 0}, "bfloat16", (2048, 2048), (2048, 512), *rows,
         out_rows),
        ("rs_tile", "rs", {}, {"schedule": "tile"}, "bfloat16", (2048, 1024), (1024, 1024),
         *rows, out_rows),
        ("rs_tile_mid", "rs", {"scatter_dimension": 1}, {"schedule": "tile"}, "bfloat16",
         (2, 1024, 1024), (1024, 512), *t, P(None, "tp", None)),
        ("rs_cols", "rs", {"scatter_dimension": -1}, {}, "bfloat16", (1024, 1024), (1024, 1024),
         *rows, P(None, "tp")),
        ("ag_rows", "ag", {}, {}, "bfloat16", (2048, 1024), (1024, 1024), P("tp", None),
         P(None, "tp"), P(None, "tp")),
        ("ag_rows_f16", "ag", {}, {}, "float16", (1024, 512), (512, 2048), P("tp", None),
         P(None, "tp"), P(None, "tp")),
        ("ag_k", "ag", {"gather_dimension": -1}, {}, "bfloat16", (1024, 1024), (1024, 1024),
         P(None, "tp"), P(None, "tp"), P(None, "tp")),
        ("ar", "ar", {}, {}, "bfloat16", (1024, 1024), (1024, 512), *rows, P()),
    ]  # fmt: skip


def worker(process, nproc, port, gpu, calls, steps, timeout_s, backend):
    import jax

    cpu = backend == "xla"  # the harness on CPU processes (tests): the reference path
    if cpu:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", 1)

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=nproc,
        process_id=process,
        local_device_ids=None if cpu else [gpu],
        initialization_timeout=120,
    )
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxoverlap
    from jaxoverlap import runtime

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    rng = np.random.default_rng(0)  # the same operands in every process
    ops = {
        "rs": jaxoverlap.matmul_reduce_scatter,
        "ag": jaxoverlap.all_gather_matmul,
        "ar": jaxoverlap.matmul_all_reduce,
    }
    built = []
    for tag, kind, kw, ckw, dt, xs, ws, xspec, wspec, ospec in sites(8 if cpu else 1):
        dtype = jnp.dtype(dt)
        x = (rng.standard_normal((steps, *xs), np.float32)).astype(dtype)
        w = (rng.standard_normal(ws, np.float32) / np.sqrt(ws[0])).astype(dtype)
        ref = np.einsum("s...k,kn->s...n", x.astype(np.float32), w.astype(np.float32))
        cfg = jaxoverlap.Config(backend=backend, timeout_s=timeout_s, **ckw)
        op = ops[kind]

        def body(xs_, w_, op=op, kw=kw, cfg=cfg):
            def step(c, x_i):
                return c, op(x_i, w_, "tp", config=cfg, **kw)

            return lax.scan(step, 0, xs_)[1]

        sx = P(None, *xspec)
        so = P(None, *ospec)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(sx, wspec), out_specs=so))

        def arr(a, spec):
            sh = NamedSharding(mesh, spec)
            return jax.make_array_from_callback(a.shape, sh, lambda idx, a=a: a[idx])

        args = (arr(x, sx), arr(w, wspec))
        text = f.lower(*args).compile().as_text()
        if not cpu:
            assert "jaxoverlap_" in text, f"{tag}: no fused custom call in the compiled program"
        y0 = f(*args)
        (shard,) = y0.addressable_shards
        want = jax.device_put(ref[shard.index], shard.device)
        first = shard.data
        scale = float(np.max(np.abs(ref[shard.index]))) + 1e-6

        @jax.jit
        def check(got, first=first, want=want, scale=scale):
            g = got.astype(jnp.float32)
            err = jnp.max(jnp.abs(g - want)) / scale
            err = jnp.where(jnp.all(jnp.isfinite(g)), err, jnp.nan)
            same = jnp.all(
                lax.bitcast_convert_type(got, jnp.uint16)
                == lax.bitcast_convert_type(first, jnp.uint16)
            )
            return err, same

        err0, _ = check(first)
        built.append([tag, f, args, check, float(err0), 0, 0])
    jaxoverlap.check_errors()
    mem0 = 0 if cpu else runtime.memory_in_use(gpu)
    done, t0, bad = steps * len(built), time.time(), []
    for b in built:
        if not b[4] <= 2e-2:
            bad.append(f"{b[0]}: first execution relative error {b[4]:.3g}")
    i = 0
    while done < calls and not bad:
        b = built[i % len(built)]
        i += 1
        y = b[1](*b[2])
        err, same = b[3](y.addressable_shards[0].data)
        err, same = float(err), bool(same)
        done += steps
        b[5] += 1
        b[6] = max(b[6], err) if err == err else float("nan")
        if not err <= 2e-2:
            bad.append(f"{b[0]}: relative error {err:.3g} at fused call {done}")
        if not same:
            bad.append(f"{b[0]}: bits differ from its first execution at fused call {done}")
    jax.effects_barrier()
    dt = time.time() - t0
    mem1 = 0 if cpu else runtime.memory_in_use(gpu)
    try:
        jaxoverlap.check_errors()
        error = None
    except jaxoverlap.FusedCallError as e:
        error = str(e)
    for b in built:
        print(f"site {b[0]}: {b[5] + 1} executions x {steps} calls, max rel err {b[6]:.2e}")
    print(
        f"process {process}: {done} fused calls over {len(built)} call sites in {dt:.1f} s "
        f"({(done - steps * len(built)) / max(dt, 1e-9):.0f} calls/s after set-up); memory in use "
        f"{mem0 / 2**20:.0f} -> {mem1 / 2**20:.0f} MiB; failed calls: {error or 'none'}"
    )
    for m in bad:
        print("MISMATCH", m)
    ok = not bad and error is None and mem1 - mem0 < 64 * 2**20
    print(f"STRESS-XPROC process {process}:", "PASSED" if ok else "FAILED", flush=True)
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier("stress/done", 120_000)
    return 0 if ok else 1


def memory_worker(process, nproc, port, gpu, fresh, sizes, bound_mib=1024, backend="fused"):
    """Issue 25 item 4: device memory as call sites multiply. Phase 1: ``fresh`` new jit
    wrappers (each lowered and compiled anew) over 4 shapes of the fused reduce-scatter: memory
    must stay flat after the first of each shape. Phase 2: ``sizes`` call sites, each a new
    batch size (rows 256 * i): memory must grow by less than ``bound_mib`` MiB (the whole GPU's,
    both processes; docs/workspaces.md: workspaces shared by size class hold ~2 x 112 MiB per
    process at 200 sizes, one workspace per shape would hold ~2 x 2.5 GiB). Every call's shard is
    checked: x filled with a value that changes from site to site, w with ones, so each element
    is K times that value, exactly -- data left by another site's call (sites of other shapes
    share workspaces now) would show. ``backend="xla"``: the harness on CPU processes (tests)."""
    import jax

    cpu = backend == "xla"
    if cpu:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=nproc,
        process_id=process,
        local_device_ids=None if cpu else [gpu],
        initialization_timeout=120,
    )
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxoverlap
    from jaxoverlap import runtime

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    cfg = jaxoverlap.Config(backend=backend, timeout_s=60.0)
    spec_x, spec_w, spec_o = P(None, "tp"), P("tp", None), P("tp", None)
    calls, wrong = 0, []

    def filled(shape, value, spec):
        """The global array of ``shape`` filled with ``value``, built from this process's shards
        only (no collective: jax.device_put of a process-local array to a spanning sharding
        would run one, and NCCL refuses two ranks on one GPU)."""

        def shard(idx):
            dims = [len(range(*i.indices(d))) for i, d in zip(idx, shape, strict=True)]
            return np.full(dims, value, jnp.bfloat16)

        return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), shard)

    def site(m, k, n):
        nonlocal calls
        value = 1.0 + (calls % 8) / 8  # exact in bf16, and so is k * value for k <= 2048
        calls += 1
        x, w = filled((m, k), value, spec_x), filled((k, n), 1.0, spec_w)
        f = jax.jit(
            jax.shard_map(
                lambda a, b: jaxoverlap.matmul_reduce_scatter(a, b, "tp", config=cfg),
                mesh=mesh,
                in_specs=(spec_x, spec_w),
                out_specs=spec_o,
            )
        )
        (shard,) = f(x, w).addressable_shards
        got = np.asarray(shard.data, np.float32)
        if not (got == k * value).all():
            wrong.append((m, k, n, value, float(np.max(np.abs(got - k * value)))))

    def in_use():
        return 0 if cpu else runtime.memory_in_use(gpu)

    shapes = [(1024, 1024, 1024), (2048, 1024, 512), (1024, 2048, 1024), (4096, 512, 512)]
    for s in shapes:
        site(*s)
    mem0 = in_use()
    t0 = time.time()
    for i in range(fresh):
        site(*shapes[i % len(shapes)])
    mem1 = in_use()
    print(f"process {process}: {fresh} fresh call sites over 4 shapes in {time.time() - t0:.0f} s: "
          f"memory {mem0 / 2**20:.0f} -> {mem1 / 2**20:.0f} MiB", flush=True)  # fmt: skip
    t0, marks = time.time(), [(0, mem1)]
    for i in range(1, sizes + 1):
        site(256 * i, 512, 512)
        if i % max(1, sizes // 8) == 0 or i == sizes:
            marks.append((i, in_use()))
    mem2 = marks[-1][1]
    growth = " ".join(f"{i}:{(m - mem1) / 2**20:.0f}" for i, m in marks[1:])
    print(f"process {process}: {sizes} batch sizes (rows 256..{256 * sizes}, K 512, N 512) in "
          f"{time.time() - t0:.0f} s: memory grew {(mem2 - mem1) / 2**20:.0f} MiB "
          f"(call sites:MiB {growth})", flush=True)  # fmt: skip
    jaxoverlap.check_errors()
    flat = mem1 - mem0 < 64 * 2**20
    bounded = mem2 - mem1 < bound_mib * 2**20
    print(f"MEMORY process {process}: {calls} calls, {len(wrong)} wrong {wrong[:3]}; fresh call "
          f"sites {'flat' if flat else 'GREW'}; {sizes} batch sizes "
          f"{'bounded' if bounded else 'GREW'} (bound {bound_mib} MiB)", flush=True)  # fmt: skip
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier("memory/done", 120_000)
    return 0 if flat and bounded and not wrong else 1


def run(nproc, calls, steps, timeout_s, deadline_s, backend="fused", memory=None):
    """Starts ``nproc`` workers (GPU ``p % gpus``) and waits; 0 when all passed."""
    import subprocess as sp

    try:
        listing = sp.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except OSError:
        listing = ""
    gpus = max(1, listing.count("GPU "))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",  # processes may share one GPU
        "NCCL_NVLS_ENABLE": "0",
    }
    if backend == "xla":  # one CPU device per process
        env["XLA_FLAGS"] = " ".join(
            f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f
        )
    if memory is None:
        rest = [str(calls), str(steps), str(timeout_s), backend]
        argv = [sys.executable, os.path.abspath(__file__), "--worker"]
    else:  # the memory probe: FRESH call sites, then SIZES batch sizes[, the bound in MiB]
        rest = [*(str(v) for v in memory), backend]
        argv = [sys.executable, os.path.abspath(__file__), "--memory-worker"]
    procs = [
        subprocess.Popen([*argv, str(p), str(nproc), str(port), str(p % gpus), *rest], env=env)
        for p in range(nproc)
    ]
    t0, rcs = time.time(), []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=max(1.0, deadline_s - (time.time() - t0))))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            print(f"STRESS-XPROC: FAILED (past {deadline_s:.0f} s)", flush=True)
            return 1
    ok = all(rc == 0 for rc in rcs)
    name = "STRESS-XPROC" if memory is None else "MEMORY"
    print(f"{name}:", "PASSED" if ok else f"FAILED (exit codes {rcs})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__" and sys.argv[1:2] in (["--worker"], ["--memory-worker"]):
    a = sys.argv[2:]
    rc = 1
    try:
        if sys.argv[1] == "--worker":
            rc = worker(*map(int, a[:6]), float(a[6]), a[7])
        else:
            rc = memory_worker(*map(int, a[:-1]), backend=a[-1])
    finally:
        sys.stdout.flush()
        os._exit(rc)
