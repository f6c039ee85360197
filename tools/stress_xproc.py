"""Stress run across processes: ``--processes 2`` of tools/stress.py (one GPU each, or both on
one GPU, where their kernels time-slice: endurance, not speed).

Each process joins ``jax.distributed`` (loopback), builds a 1-D ``tp`` mesh over both processes'
devices and compiles one ``lax.scan`` program per call site -- the three ops, rows / a middle
dimension / the last dimension / K, the chunked, copy-engine and tile schedules, bf16 and f16 --
each step one fused call on that step's operands. The programs run in turn until ``calls`` fused
calls were made. Every execution's shard is compared on the device with (a) a float32 NumPy
reference of the whole problem that this process computes itself, and (b) the bits of the
site's first execution (the fused kernels sum in a fixed order: equal inputs, equal bits).
Device memory in use (cudaMemGetInfo, the whole GPU) and jaxoverlap's workspace pool
(`runtime.workspace_pool`: this process's workspaces, which must not change) are sampled after the
first round and at the end.

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
    pool0 = {} if cpu else runtime.workspace_pool()  # jaxoverlap's own: flat after round one
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
    pool1 = {} if cpu else runtime.workspace_pool()
    pool_flat = all(pool1.get(k) == pool0.get(k) for k in ("workspaces", "own_bytes"))
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
        f"{mem0 / 2**20:.0f} -> {mem1 / 2**20:.0f} MiB (jaxoverlap's workspaces "
        f"{pool0.get('own_bytes', 0) / 2**20:.1f} -> {pool1.get('own_bytes', 0) / 2**20:.1f} MiB "
        f"in {pool0.get('workspaces', 0)} -> {pool1.get('workspaces', 0)}); failed calls: "
        f"{error or 'none'}"
    )
    for m in bad:
        print("MISMATCH", m)
    ok = not bad and error is None and mem1 - mem0 < 64 * 2**20 and pool_flat
    print(f"STRESS-XPROC process {process}:", "PASSED" if ok else "FAILED", flush=True)
    _done("stress/done")
    return 0 if ok else 1


def memory_worker(process, nproc, port, gpu, fresh, sizes, bound_mib=0, backend="fused"):
    """Issue 25 item 4: memory as call sites multiply, with jaxoverlap's own share measured
    apart. Phase 1: ``fresh`` new jit wrappers (each lowered and compiled anew) over 4 shapes of
    the fused reduce-scatter. Phase 2: ``sizes`` call sites, each a new batch size (rows 256 * i,
    blocks of 128 KiB * i). At each mark three numbers: the whole GPU's memory in use
    (cudaMemGetInfo: both processes, XLA's buffers included), XLA's allocator in this process
    (``memory_stats``: in use and reserved) and jaxoverlap's workspace pool in this process
    (`runtime.workspace_pool`, counted from its buffers). Verdict on the pool, the quantity
    docs/workspaces.md bounds: phase 1 adds no workspace and no byte; phase 2 adds exactly one
    workspace per size class its blocks touch that the pool did not hold (`runtime.size_class`),
    at exactly the bytes those classes' buffers take, and no more than the documented cap (per
    area, 3.5x the class of the largest block; ``bound_mib`` > 0: also at most that many MiB).
    The whole GPU and XLA are reported, not judged: XLA's allocator grows with the batch's own
    inputs and outputs (rows 51200 x 512 bf16 is 50 MiB). Every call's shard is checked: x filled
    with a value that changes from site to site, w with ones, so each element is K times that
    value, exactly -- data left by another site's call (sites of other shapes share workspaces)
    would show. ``backend="xla"``: the harness on CPU processes (tests; no pool, zeros)."""
    import json

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
    from jax._src import distributed
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxoverlap
    from jaxoverlap import runtime

    kv = distributed.global_state.client
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    # The chunked schedule whatever a tuning cache says: its workspaces are shared by size class
    # (the tile schedule's are one per shape, at most 32: docs/workspaces.md).
    cfg = jaxoverlap.Config(backend=backend, timeout_s=60.0, schedule="chunked")
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

    device = jax.local_devices()[0]
    t_start = time.time()

    def sample(tag):
        """This process's numbers now; process 0 prints both processes' side by side."""
        pool = {} if cpu else runtime.workspace_pool()
        stats = {} if cpu else (device.memory_stats() or {})
        row = {
            "whole": 0 if cpu else runtime.memory_in_use(gpu),
            "xla": stats.get("bytes_in_use", 0),
            "xla_reserved": stats.get("pool_bytes", stats.get("bytes_reserved", 0)),
            "own": pool.get("own_bytes", 0),
            "mapped": pool.get("mapped_bytes", 0),
            "workspaces": pool.get("workspaces", 0),
            "exact": pool.get("exact", 0),
            "flags": pool.get("flags_bytes", 0),
            "classes": sorted(pool.get("block_bytes", [])),
        }
        kv.key_value_set(f"jaxoverlap-memprobe/{tag}/{process}", json.dumps(row))
        if process == 0:
            rows = [row] + [
                json.loads(kv.blocking_key_value_get(f"jaxoverlap-memprobe/{tag}/{p}", 120_000))
                for p in range(1, nproc)
            ]
            mib = lambda v: f"{v / 2**20:.0f}"  # noqa: E731
            per = "  ".join(
                f"p{p}: xla {mib(r['xla'])}/{mib(r['xla_reserved'])} ours {mib(r['own'])} "
                f"(+{mib(r['mapped'])} mapped, {r['workspaces']} ws)"
                for p, r in enumerate(rows)
            )
            t = time.time() - t_start
            print(f"MEM {tag:<11s} {t:5.0f} s  GPU {mib(rows[0]['whole'])} MiB  {per}", flush=True)
        return row

    shapes = [(1024, 1024, 1024), (2048, 1024, 512), (1024, 2048, 1024), (4096, 512, 512)]
    for s in shapes:
        site(*s)
    m0 = sample("start")
    t0 = time.time()
    for i in range(fresh):
        site(*shapes[i % len(shapes)])
        if (i + 1) % max(1, fresh // 4) == 0 and i + 1 < fresh:
            sample(f"fresh:{i + 1}")
    m1 = sample(f"fresh:{fresh}")
    t_fresh = time.time() - t0
    t0 = time.time()
    blocks = []
    for i in range(1, sizes + 1):
        site(256 * i, 512, 512)
        blocks.append(256 * i // nproc * 512 * 2)  # the output's block: rows / n x N bf16
        if i % max(1, sizes // 8) == 0 and i < sizes:
            sample(f"sizes:{i}")
    m2 = sample(f"sizes:{sizes}")
    t_sizes = time.time() - t0
    jaxoverlap.check_errors()
    # The pool's verdict. Phase 2's workspaces: one per new class, each with a staging area and
    # GEMM partials of (n - 1) slots and one flag block (docs/workspaces.md).
    areas, cap_per_area = 2, 3.5
    if cpu:
        new_classes, want, cap = [], 0, 0
    else:
        new_classes = sorted({runtime.size_class(b) for b in blocks} - set(m1["classes"]))
        want = sum(areas * (nproc - 1) * c + m2["flags"] for c in new_classes)
        cap = areas * (nproc - 1) * cap_per_area * runtime.size_class(max(blocks))
        cap += m2["flags"] * len(new_classes)
        if bound_mib:
            cap = min(cap, bound_mib * 2**20)
    per_shape = sum(areas * (nproc - 1) * b for b in blocks)  # one workspace per batch size
    flat = m1["own"] == m0["own"] and m1["workspaces"] == m0["workspaces"]
    grew = m2["own"] - m1["own"]
    added = m2["workspaces"] - m1["workspaces"]
    bounded = grew == want and added == len(new_classes) and grew <= cap and m2["exact"] == 0
    mib = lambda v: v / 2**20  # noqa: E731
    print(f"process {process}: {fresh} fresh call sites over 4 shapes in {t_fresh:.0f} s: "
          f"jaxoverlap's workspaces {mib(m0['own']):.1f} -> {mib(m1['own']):.1f} MiB "
          f"({m0['workspaces']} -> {m1['workspaces']}); XLA in use {mib(m0['xla']):.0f} -> "
          f"{mib(m1['xla']):.0f} MiB; whole GPU {mib(m0['whole']):.0f} -> {mib(m1['whole']):.0f} "
          f"MiB", flush=True)  # fmt: skip
    print(f"process {process}: {sizes} batch sizes (rows 256..{256 * sizes}, K 512, N 512) in "
          f"{t_sizes:.0f} s: jaxoverlap's workspaces grew {mib(grew):.1f} MiB in {added} "
          f"workspaces (size classes predict {mib(want):.1f} MiB in {len(new_classes)}: "
          f"{[c >> 10 for c in new_classes]} KiB; cap {mib(cap):.0f} MiB; one workspace per "
          f"shape would hold {mib(per_shape):.0f} MiB); XLA in use {mib(m1['xla']):.0f} -> "
          f"{mib(m2['xla']):.0f} MiB (reserved {mib(m1['xla_reserved']):.0f} -> "
          f"{mib(m2['xla_reserved']):.0f}); whole GPU grew {mib(m2['whole'] - m1['whole']):.0f} "
          f"MiB (both processes)", flush=True)  # fmt: skip
    print(f"MEMORY process {process}: {calls} calls, {len(wrong)} wrong {wrong[:3]}; fresh call "
          f"sites {'flat' if flat else 'GREW'}; {sizes} batch sizes "
          f"{'bounded' if bounded else 'NOT AS PREDICTED'} (jaxoverlap's own workspaces: "
          f"{mib(grew):.1f} MiB, predicted {mib(want):.1f}, cap {mib(cap):.0f} MiB)",
          flush=True)  # fmt: skip
    _done("memory/done")
    return 0 if flat and bounded and not wrong else 1


def _done(barrier):
    """Every process has its verdict: meet at `barrier`, then leave the group through
    jax.distributed's shutdown, whose own barrier keeps process 0 -- the coordination service's
    host -- alive until every process has disconnected. (A bare os._exit after the barrier let
    process 0 exit first: a peer's error-polling thread then saw the service gone and aborted
    that peer, exit -6, after its work had passed: a CPU test failed that way in CI.)"""
    import jax
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(barrier, 120_000)
    jax.distributed.shutdown()


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
    name = "STRESS-XPROC" if memory is None else "MEMORY"
    for p in procs:
        try:
            rcs.append(p.wait(timeout=max(1.0, deadline_s - (time.time() - t0))))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            print(f"{name}: FAILED (past {deadline_s:.0f} s)", flush=True)
            return 1
    ok = all(rc == 0 for rc in rcs)
    print(f"{name}:", "PASSED" if ok else f"FAILED (exit codes {rcs})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__" and sys.argv[1:2] in (["--worker"], ["--memory-worker"]):
    # The workers share the parent's stdout: one write per line, so that no line of one process
    # lands inside another's (under PYTHONUNBUFFERED print writes the text and the newline
    # separately; a CPU test that reads process 0's table lost a line that way in CI).
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
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
