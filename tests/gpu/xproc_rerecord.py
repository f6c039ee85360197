"""MODE ``rerecord`` of tests/gpu/xproc_worker.py (issue 26, R3): XLA's command buffers
re-recorded in one process only (tests/gpu/test_command_buffer_rerecord_gpu.py).

With ``JAXOVERLAP_COMMAND_BUFFERS=1`` both processes run a 4-step ``lax.scan`` whose body holds the
copy-engine reduce-scatter among enough other work to be put in a command buffer, ``STEPS``
times. Between steps process 1 alone compiles a fresh small program with GEMMs (a new command
buffer thunk: XLA evicts every recorded graph of the process, docs/ordering-and-stream-memops.md
section 2) and keeps a new allocation and its outputs alive (its buffers move), so its handler
runs again -- warm-up and re-recording -- while process 0 replays its graph without running the
handler. Every step's bits must equal step 0's, and no error may be reported (the host-side call
numbering of the two processes now differs; nothing may compare it). Then process 0 runs the
program once more alone: its first wait times out once, naming peer rank 1 and the call by its
device epoch (STEPS x 4 + 1), and the rest of that execution gives up at once. Prints
``rerecord OK|FAILED host_calls=... captured=...`` and ``rerecord_stall OK|FAILED ...``."""

from __future__ import annotations

import re
import time
import traceback

import numpy as np

STEPS = 4
SCAN = 4
TIMEOUT_S = 4.0


def run(mesh, arr, process):
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import jaxoverlap
    from jaxoverlap import Config, runtime

    nat = runtime.native()
    ce = Config(backend="fused", comm_sms=0, timeout_s=TIMEOUT_S)
    rng = np.random.default_rng(11)
    M, K, N = 1024, 1024, 512

    def rand(*shape):
        return (rng.standard_normal(shape, np.float32) / np.sqrt(shape[-1])).astype(jnp.bfloat16)

    x, w, v = rand(SCAN, M, K), rand(K, N), rand(N, N)

    def body(a, b, u):
        def step(c, a_i):  # tanh, the fused op, GEMM, sin, GEMM, exp: six thunks
            y = jaxoverlap.matmul_reduce_scatter(jnp.tanh(a_i), b, "tp", config=ce)
            y = jnp.exp(jnp.sin(y @ u) @ u.T * 0.5)
            return c + jnp.sum(y, dtype=jnp.float32), y

        c0 = 0 * jnp.sum(a[0, :1, :1], dtype=jnp.float32)  # varying over tp
        return lax.scan(step, c0, a)[1]

    specs = (P(None, None, "tp"), P("tp", None), P())
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(None, "tp", None)))
    args = [arr(a, s) for a, s in zip((x, w, v), specs, strict=True)]
    kept = []  # process 1: what it allocates between steps stays alive
    try:
        before = nat.handler_calls()
        first, same, finite = None, True, True
        for s in range(STEPS):
            y = f(*args)
            jax.block_until_ready(y)
            data = y.addressable_shards[0].data
            bits = np.asarray(data).view(np.uint16)
            finite &= bool(np.isfinite(np.asarray(data, np.float32)).all())
            first = bits if first is None else first
            same &= np.array_equal(bits, first)
            if process == 1:  # a fresh executable with a command buffer, and moved buffers
                n = 256 + 64 * s
                g = jax.jit(lambda a, k=s: jnp.tanh(jnp.sin(a @ a.T + k) @ a) @ a.T)
                kept += [y, g(jnp.ones((n, n), jnp.bfloat16)), jnp.zeros((1 << 20) * (s + 1))]
            # Process 0 frees the output before the next run, whose output (and temporaries)
            # then land where they were: its recorded graph stays valid and is replayed.
            del y, data
        jaxoverlap.check_errors()
        after = nat.handler_calls()
        ok = same and finite
        print(
            f"rerecord {'OK' if ok else 'FAILED'} host_calls={after[0] - before[0]} "
            f"captured={after[1] - before[1]} device_calls={STEPS * SCAN} same_bits={same} "
            f"finite={finite} process={process}",
            flush=True,
        )
    except Exception as e:
        print(f"rerecord FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
        traceback.print_exc()
        return
    if process == 1:
        return  # never runs the next execution: process 0's waits of it time out
    time.sleep(1)
    t0 = time.time()
    err = None
    try:
        y = f(*args)
        jax.block_until_ready(y)
        jaxoverlap.check_errors()
    except Exception as e:
        err = e
    dt = time.time() - t0
    msg = str(err)
    wanted = re.search(r"wanted (\d+)", msg)
    again = None
    try:
        jaxoverlap.check_errors()  # reported once, not once per call of the execution
    except Exception as e:
        again = e
    expected = STEPS * SCAN + 1
    ok = (
        err is not None
        and "peer rank 1" in msg
        and "different orders" not in msg
        and wanted is not None
        and int(wanted.group(1)) == expected
        and again is None
        and dt < 3 * TIMEOUT_S
    )
    print(
        f"rerecord_stall {'OK' if ok else 'FAILED'} in {dt:.1f}s from={t0:.1f} wanted="
        f"{wanted.group(1) if wanted else None} expected={expected} second_error={again!r}: "
        f"{msg[:300]}",
        flush=True,
    )
