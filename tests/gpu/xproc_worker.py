"""One process of a fused group that spans processes (tests/gpu/test_xproc_gpu.py starts two).

    python tests/gpu/xproc_worker.py PROCESS NPROC PORT GPU MODE

Joins ``jax.distributed`` with ``local_device_ids=[GPU]`` (on a one-GPU machine both processes
share GPU 0: the fused kernels then time-slice, slowly but correctly), builds a 1-D ``tp`` mesh
over every process's device and runs, with ``backend="fused"``, each fused op on random bf16
inputs (the same seed in every process), checking its shard against a float32 NumPy reference
and that the fused custom call is in the compiled HLO. Prints ``<tag> OK ...`` or
``<tag> FAILED ...`` per case. MODE ``ops``: the ops. MODE ``stall``: process 1 compiles but never
runs the op; process 0 must get NaN and a timeout naming peer rank 1 within the timeout, then a
refusal of its next fused call, while plain XLA work still runs (XPROC_CASE: which op, by its
tag; default the reduce-scatter). MODE ``stall_many``: the same
with 16 fused calls launched ahead: all given up within a few timeouts, not one each. MODE
``killed``: as ``stall``, but process 1 kills itself (SIGKILL) after compiling. MODE
``train``: the training path's fused calls (tests/gpu/xproc_training.py). MODE ``rerecord``: command
buffers re-recorded in process 1 only (tests/gpu/xproc_rerecord.py). MODE ``absent``:
process 1 never lowers the op; process 0's lowering must fail naming process 1
(JAXOVERLAP_SETUP_TIMEOUT_S).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import traceback

import numpy as np


def join(process, nproc, port, gpu):
    """Joins ``jax.distributed`` with ``local_device_ids=[gpu]`` (every thread's stack dumped
    after $XPROC_STACKS_AFTER_S, if still running); returns the 1-D ``tp`` mesh over every
    process's device and ``arr(a, spec)``, the global array of ``a`` sharded by ``spec``."""
    if os.environ.get("XPROC_STACKS_AFTER_S"):  # every thread's stack, if still running then
        faulthandler.dump_traceback_later(float(os.environ["XPROC_STACKS_AFTER_S"]))
    import jax

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=nproc,
        process_id=process,
        local_device_ids=[gpu],
        initialization_timeout=120,
    )
    from jax.sharding import Mesh, NamedSharding

    mesh = Mesh(np.array(jax.devices()), ("tp",))

    def arr(a, spec):
        sh = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(a.shape, sh, lambda idx: a[idx])

    return mesh, arr


def main(process, nproc, port, gpu, mode):
    mesh, arr = join(process, nproc, port, gpu)
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxoverlap
    from jaxoverlap import Config

    def mine(y):
        (s,) = y.addressable_shards
        return s.index, np.asarray(s.data, np.float32)

    dump = os.environ.get("XPROC_DUMP")

    def check(tag, f, args, ref, target, host=None):
        try:
            text = f.lower(*args).compile().as_text()
            target = jaxoverlap.fused.emitted(target)
            assert target in text, f"{target} not in the compiled HLO"
            y = f(*args)
            jax.block_until_ready(y)
            jaxoverlap.check_errors()
            idx, got = mine(y)
            if "tile" in tag:  # bitwise repeatable: sums in rank order, whatever the timing
                again = np.asarray(jax.block_until_ready(f(*args)).addressable_shards[0].data)
                first = np.asarray(y.addressable_shards[0].data)
                assert (again.view(np.uint16) == first.view(np.uint16)).all(), "bits differ"
            want = ref[idx]
            err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))
            assert np.isfinite(got).all() and err < 2e-2, f"relative error {err:.2e}"
            if host is not None:
                # Along K, rounded once like XLA's single GEMM over the gathered x: compare the
                # bits with that GEMM on this device (x whole, this rank's columns of w).
                xs, ws_ = host
                local = jax.jit(jnp.matmul)(xs, ws_[:, idx[-1]])
                mine_bits = np.asarray(y.addressable_shards[0].data).view(np.uint16)
                same = float(np.mean(np.asarray(local).view(np.uint16) == mine_bits))
                print(f"{tag}_bits same_as_one_gemm={same:.4f}", flush=True)
                assert same > 0.9, f"only {same:.3f} of the elements equal XLA's single GEMM"
            if dump:  # the raw bits, for the comparison with one process (test_xproc_gpu.py)
                bits = np.asarray(y.addressable_shards[0].data).view(np.uint16)
                np.save(os.path.join(dump, f"{tag}.{process}.npy"), bits)
            print(f"{tag} OK rel_err={err:.1e} process={process}", flush=True)
        except Exception as e:  # report every case
            print(f"{tag} FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
            traceback.print_exc()

    timeout_s = float(os.environ.get("XPROC_TIMEOUT_S", "60"))
    cases = op_cases(mesh, arr, timeout_s)
    _, rs_fn, args_rs, *_ = cases[0]
    rand = np.random.default_rng(1)
    M, K = args_rs[0].shape
    if mode == "absent":
        if process == 0:
            t0 = time.time()
            try:
                rs_fn.lower(*args_rs)
                print("absent FAILED lowering succeeded without the peer", flush=True)
            except Exception as e:
                ok = "process 1" in str(e)
                tag = "OK" if ok else "FAILED"
                print(f"absent {tag} after {time.time() - t0:.1f}s: {str(e)[:300]}", flush=True)
        else:
            time.sleep(float(os.environ["JAXOVERLAP_SETUP_TIMEOUT_S"]) + 10)
        return
    if mode in ("stall", "killed"):
        which = os.environ.get("XPROC_CASE", "matmul_reduce_scatter")
        (f,) = [c[1] for c in op_cases(mesh, arr, 3.0) if c[0] == which]
        c = f.lower(*args_rs).compile()
        if process == 1:
            if mode == "killed":  # its buffers are mapped in process 0: a dead exporter
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(20)  # compiled, never run: process 0's waits must time out
            return
        if mode == "killed":
            time.sleep(3)  # the peer is gone before the call starts
        t0 = time.time()
        y = c(*args_rs)
        jax.block_until_ready(y)
        dt = time.time() - t0
        _, got = mine(y)
        try:
            jaxoverlap.check_errors()
            print("stall FAILED no error reported", flush=True)
        except jaxoverlap.FusedCallError as e:
            named = "peer rank 1" in str(e)
            tag = "OK" if named and np.isnan(got).all() and dt < 30 else "FAILED"
            print(f"stall {tag} in {dt:.1f}s nan={np.isnan(got).all()}: {str(e)[:200]}")
        try:
            jax.block_until_ready(c(*args_rs))
            print("refused FAILED the next call ran", flush=True)
        except Exception as e:
            tag = "OK" if "spans processes" in str(e) else "FAILED"
            print(f"refused {tag}: {str(e)[:200]}", flush=True)
        z = jax.jit(lambda a: a @ a.T)(jnp.ones((256, 256)))
        print(f"xla_after OK {float(z[0, 0])}", flush=True)
        if mode == "killed":  # jax.distributed's shutdown would wait for the dead peer
            os._exit(0)
        return

    if mode == "stall_many":
        # Sixteen fused calls in one program (8 unrolled layers). Run once by both (the first
        # call of a workspace warms it up with a host synchronisation), then again by process 0
        # alone: all sixteen are launched ahead of the GPU, the peer never runs them. Once the
        # first wait times out, every later one must give up at once (Peers::dead) rather than
        # take a timeout each: the error comes within a few timeouts.
        layers = 8
        ws = [(rand.standard_normal((K, K), np.float32) / np.sqrt(K)).astype(jnp.bfloat16)] * layers
        cfg = Config(backend="fused", timeout_s=3.0)

        def layers_fn(h, *w):  # h [M, K/2] -> RS -> [M/2, K] -> AG -> [M, K/2], 8 times
            for w1, w2 in zip(w[:layers], w[layers:], strict=True):
                r = jaxoverlap.matmul_reduce_scatter(h, w1, "tp", config=cfg)
                h = jaxoverlap.all_gather_matmul(r, w2, "tp", config=cfg)
            return h

        specs = (P(None, "tp"), *[P("tp", None)] * layers, *[P(None, "tp")] * layers)
        g = jax.jit(jax.shard_map(layers_fn, mesh=mesh, in_specs=specs, out_specs=P(None, "tp")))
        a = [args_rs[0]] + [arr(w, s) for w, s in zip(ws + ws, specs[1:], strict=True)]
        c = g.lower(*a).compile()
        jax.block_until_ready(c(*a))
        jaxoverlap.check_errors()
        if process == 1:
            time.sleep(60)
            return
        time.sleep(1)  # the peer is past its run
        t0 = time.time()
        try:
            y = c(*a)
            jax.block_until_ready(y)
            nan = bool(np.isnan(mine(y)[1]).all())
            jaxoverlap.check_errors()
            err = None
        except Exception as e:  # the program's own error, or check_errors'
            err, nan = e, locals().get("nan", None)
        dt = time.time() - t0
        named = err is not None and "peer rank 1" in str(err)
        ok = named and nan is not False and dt < 4 * cfg.timeout_s
        tag = "OK" if ok else "FAILED"
        print(
            f"stall_many {tag} {2 * layers} calls, error in {dt:.1f}s (NaN output: {nan}): "
            f"{str(err)[:150]}",
            flush=True,
        )
        return
    if mode == "train":
        from tests.gpu import xproc_training

        xproc_training.run(mesh, arr)
    elif mode == "graphs":
        run_graphs(mesh, arr, process, dump)
    elif mode == "rerecord":
        from tests.gpu import xproc_rerecord

        xproc_rerecord.run(mesh, arr, process)
    else:  # ops: each fused op (forward), every case reported (XPROC_ONLY: these, in this order).
        from tests.gpu.xproc_training import only_cases

        by_tag = {c[0]: c for c in cases}
        for tag in only_cases([*by_tag, "gemm_search"], "ops"):
            if tag == "gemm_search":
                report_gemm_search(gpu)
            else:
                check(*by_tag[tag])
    # Process 0 hosts the coordinator: its exit would stop the others before they report.
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier("xproc/done", 120_000)


def run_counted(f, args, executions):
    """``executions`` runs of ``f(*args)``, checked for errors: (their outputs, host calls of
    the fused handlers meanwhile, how many of them XLA was capturing into a CUDA graph)."""
    import jax

    import jaxoverlap
    from jaxoverlap import runtime

    nat = runtime.native()
    before = nat.handler_calls()
    outs = [f(*args) for _ in range(executions)]
    jax.block_until_ready(outs)
    jaxoverlap.check_errors()
    after = nat.handler_calls()
    return outs, after[0] - before[0], after[1] - before[1]


def run_graphs(mesh, arr, process, dump, executions=5):
    """Fused ops among enough other work for XLA to put them in a command buffer (at least
    xla_gpu_graph_min_graph_size = 5 convertible thunks in a row), plain and as the body of a
    4-step lax.scan; run ``executions`` times. Per program: every execution's bits equal the
    first's, values near a float32 reference, and how often the handlers ran on the host
    (_native.handler_calls): with command buffers on, XLA runs a call once uncaptured (warm-up),
    once under capture, and then replays the graph without us -- far fewer host calls than
    device calls; with them off (XLA_FLAGS), one host call per device call."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import jaxoverlap
    from jaxoverlap import Config, runtime

    cfg = Config(backend="fused", timeout_s=60.0)
    ce = Config(backend="fused", comm_sms=0, timeout_s=60.0)
    rng = np.random.default_rng(7)
    M, K, N, L = 1024, 1024, 512, 4

    def rand(*shape):
        return (rng.standard_normal(shape, np.float32) / np.sqrt(shape[-1])).astype(jnp.bfloat16)

    x, w = rand(L, M, K), rand(K, N)
    u = {N: rand(N, N), N // 2: rand(N // 2, N // 2)}  # after a scatter of rows, of columns
    rs = lambda c: lambda h, b: jaxoverlap.matmul_reduce_scatter(h, b, "tp", config=c)  # noqa: E731
    ag = lambda h, b: jaxoverlap.all_gather_matmul(h, b, "tp", config=cfg)  # noqa: E731

    def layer(op, a, b, v):  # tanh, the fused op, GEMM, sin, GEMM, exp: six thunks
        y = op(jnp.tanh(a), b)
        return jnp.exp(jnp.sin(y @ v) @ v.T * 0.5)

    def ref_layer(a, b, v, block):  # the rank's block of the fused op's result, then local work
        f = lambda t: np.asarray(t, np.float32)  # noqa: E731
        y = (np.tanh(f(a)) @ f(b))[block]
        return np.exp((np.sin(y @ f(v)) @ f(v).T) * 0.5)

    cases = {  # tag: (op, x spec, w spec, out spec, the local work's width)
        "rs": (rs(cfg), P(None, None, "tp"), P("tp", None), P(None, "tp", None), N),
        "rs_ce": (rs(ce), P(None, None, "tp"), P("tp", None), P(None, "tp", None), N),
        "ag": (ag, P(None, "tp", None), P(None, "tp"), P(None, None, "tp"), N // 2),
    }
    for tag, (op, xs, ws, os_, width) in cases.items():
        for scan in (False, True):
            name = f"graphs_{tag}{'_scan' if scan else ''}"
            try:

                def body(a, b, v, op=op, scan=scan):
                    if not scan:
                        return layer(op, a[0], b, v)[None]

                    def step(c, a_i):
                        y = layer(op, a_i, b, v)
                        return c + jnp.sum(y, dtype=jnp.float32), y

                    c0 = 0 * jnp.sum(a[0, :1, :1], dtype=jnp.float32)  # varying over tp
                    _, ys = lax.scan(step, c0, a)
                    return ys

                f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(xs, ws, P()), out_specs=os_))
                args = (arr(x, xs), arr(w, ws), arr(u[width], P()))
                steps = L if scan else 1
                outs, calls, captured = run_counted(f, args, executions)
                (shard,) = outs[0].addressable_shards
                got = np.asarray(shard.data, np.float32)
                bits = [np.asarray(o.addressable_shards[0].data).view(np.uint16) for o in outs]
                same = all(np.array_equal(bits[0], b_) for b_ in bits[1:])
                want = np.stack(
                    [ref_layer(x[i], w, u[width], shard.index[1:]) for i in range(steps)]
                )
                err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))
                ok = same and np.isfinite(got).all() and err < 5e-2
                if dump:
                    np.save(os.path.join(dump, f"{name}.{process}.npy"), bits[0])
                # copy-engine signals the driver refused as stream writes (kernels/ce.h): 0
                ordinal = jax.local_devices()[0].local_hardware_id
                fallbacks = runtime.stream_memop_caps(ordinal)["signal_fallbacks"]
                print(
                    f"{name} {'OK' if ok else 'FAILED'} host_calls={calls} captured={captured} "
                    f"device_calls={executions * steps} repeat_bitwise={same} rel_err={err:.1e} "
                    f"signal_fallbacks={fallbacks}",
                    flush=True,
                )
            except Exception as e:  # report every case
                print(f"{name} FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
                traceback.print_exc()


def report_gemm_search(gpu):
    """The GEMM plans the fused calls made (ffi/runtime/gemm.h): their algorithms chosen by timing
    on the partition streams, or adopted from the shared cache; a note is a failed search."""
    from jaxoverlap import runtime

    plans = runtime.native().gemm_plans(gpu)
    failed = [p for p in plans if p["note"] not in ("", "one candidate")]
    searched = [p for p in plans if p["candidates"] > 1]
    faster = [p["ms_first"] / p["ms_best"] for p in searched if p["ms_best"] > 0]
    tag = "OK" if plans and searched and not failed else "FAILED"
    print(
        f"gemm_search {tag} plans={len(plans)} searched={len(searched)} "
        f"cached={sum(p['cached'] for p in plans)} "
        f"changed={sum(p['chosen'] != 0 for p in plans)} "
        f"max_gain={max(faster, default=1.0):.3f} notes={sorted({p['note'] for p in failed})}",
        flush=True,
    )


# The shapes M, K, N of op_cases: the tests' own, and a second set unlike them (XPROC_SHAPES=other;
# issue 22: every op and variant at shapes the code was not written against).
# "small" (tools/sanitize.py --shapes small): every case's code paths (the tile schedule's rows
# per rank a multiple of 256 included) at 1/32 of the default's GEMM work; lowered on CPU for a
# Hopper target, but on the GPU only in call E of issue 25, under the sanitizers.
SHAPES = {"default": (2048, 2048, 1024), "other": (1536, 1280, 768), "small": (1024, 512, 256)}


def op_cases(mesh, arr, timeout_s, shapes=None):
    """[(tag, jitted fn, args, float32 reference, target[, host x and w])]: each fused op with
    ``backend="fused"`` on random bf16 inputs (seed 0: the same in every process, and in a
    one-process run of a mesh of the same shape). ``arr(a, spec)``: the global array of ``a``.
    ``shapes``: a key of SHAPES (default: $XPROC_SHAPES, else "default")."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxoverlap
    from jaxoverlap import Config, fused
    from jaxoverlap.fused import last_dim as fused_cols
    from jaxoverlap.fused import tma

    rng = np.random.default_rng(0)

    def rand(*shape):
        return (rng.standard_normal(shape, np.float32) / np.sqrt(shape[-1])).astype(jnp.bfloat16)

    def op(fn, in_specs, out_spec):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec))

    cfg = Config(backend="fused", timeout_s=timeout_s)
    ce = Config(backend="fused", comm_sms=0, timeout_s=timeout_s)
    tile = Config(backend="fused", schedule="tile", timeout_s=timeout_s)
    M, K, N = SHAPES[shapes or os.environ.get("XPROC_SHAPES", "default")]
    x, w = rand(M, K), rand(K, N)
    ref = x.astype(np.float32) @ w.astype(np.float32)
    row = (P(None, "tp"), P("tp", None))
    args = (arr(x, row[0]), arr(w, row[1]))

    def rs(c):
        return op(lambda a, b: jaxoverlap.matmul_reduce_scatter(a, b, "tp", config=c), row, row[1])

    xa, wa = rand(M, K), rand(K, N)
    ag = op(
        lambda a, b: jaxoverlap.all_gather_matmul(a, b, "tp", config=cfg),
        (P("tp", None), P(None, "tp")),
        P(None, "tp"),
    )
    ar = op(lambda a, b: jaxoverlap.matmul_all_reduce(a, b, "tp", config=cfg), row, P())
    ag_args = (arr(xa, P("tp", None)), arr(wa, P(None, "tp")))
    ref_ag = xa.astype(np.float32) @ wa.astype(np.float32)

    def cols(spec):  # scatter_dimension=-1: the transposed problem (jaxoverlap/fused/last_dim.py)
        return op(
            lambda a, b: jaxoverlap.matmul_reduce_scatter(
                a, b, "tp", scatter_dimension=-1, config=cfg
            ),
            (spec, P("tp", None)),
            spec,
        )

    x3, spec3 = x.reshape(2, M // 2, K), P(None, None, "tp")
    cols3_args = (arr(x3, spec3), args[1])

    def ag_k(spec):  # gather_dimension=-1: x [..., K / n] gathered along K, a float32 sum
        return op(
            lambda a, b: jaxoverlap.all_gather_matmul(a, b, "tp", gather_dimension=-1, config=cfg),
            (spec, P(None, "tp")),
            spec,
        )

    k_args = (args[0], arr(w, P(None, "tp")))
    k3_args = (cols3_args[0], k_args[1])
    # The tile schedule over a middle dimension: x [2, M / 2, K] scattered over dimension 1.
    mid = op(
        lambda a, b: jaxoverlap.matmul_reduce_scatter(a, b, "tp", scatter_dimension=1, config=tile),
        (spec3, P("tp", None)),
        P(None, "tp"),
    )
    # The standalone TMA reduce-scatter (jaxoverlap_rs_v2, the bandwidth benchmark's): each rank's
    # [M, N] columns of xr summed over the group, rank r keeping row block r. Drawn last, listed
    # last: the other cases' inputs stay those of earlier runs, cases[0] the reduce-scatter.
    xr = rand(M, 2 * N)
    tma_rs = op(lambda a: tma.tma_reduce_scatter(a, "tp", comm_sms=16), (row[0],), row[1])
    ref_tma = xr[:, :N].astype(np.float32) + xr[:, N:].astype(np.float32)
    return [
        ("matmul_reduce_scatter", rs(cfg), args, ref, fused.GEMM_RS_TARGET),
        ("matmul_reduce_scatter_ce", rs(ce), args, ref, fused.GEMM_RS_CE_TARGET),
        ("matmul_reduce_scatter_tile", rs(tile), args, ref, fused.GEMM_RS_TILE_TARGET),
        (
            "matmul_reduce_scatter_tile_3d",
            mid,
            cols3_args,
            ref.reshape(2, M // 2, N),
            fused.GEMM_RS_TILE_TARGET,
        ),
        ("all_gather_matmul", ag, ag_args, ref_ag, fused.AG_GEMM_TARGET),
        ("matmul_all_reduce", ar, args, ref, fused.GEMM_AR_TARGET),
        ("matmul_reduce_scatter_cols", cols(row[0]), args, ref, fused.GEMM_RS_TARGET),
        (
            "matmul_reduce_scatter_cols_3d",
            cols(spec3),
            cols3_args,
            ref.reshape(2, M // 2, N),
            fused.GEMM_RS_TARGET,
        ),
        ("all_gather_matmul_k", ag_k(row[0]), k_args, ref, fused_cols.AG_K_TARGET, (x, w)),
        (
            "all_gather_matmul_k_3d",
            ag_k(spec3),
            k3_args,
            ref.reshape(2, M // 2, N),
            fused_cols.AG_K_TARGET,
            (x3, w),
        ),
        ("tma_reduce_scatter", tma_rs, (arr(xr, row[0]),), ref_tma, tma.RS_TARGET),
    ]


if __name__ == "__main__":
    a = sys.argv[1:]
    try:
        main(int(a[0]), int(a[1]), int(a[2]), int(a[3]), a[4])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no distributed shutdown barrier: a stalled peer may be gone already
