"""One process of tests/gpu/test_order_gpu.py (issue 26, R2: the order of two fused calls).

    python tests/gpu/order_worker.py PROCESS NPROC PORT GPU MODE

Joins ``jax.distributed`` with ``local_device_ids=[GPU]`` (on a one-GPU machine both processes
share GPU 0), builds a 1-D ``tp`` mesh over both processes' devices and runs one program with two
independent fused calls -- A, a reduce-scatter (``matmul_reduce_scatter``), and B, an all-gather
(``all_gather_matmul``), of different shapes, so different workspaces -- among XLA work (enough
thunks in a row for XLA to build a command buffer). Prints ``<tag> OK ...`` or ``<tag> FAILED
...`` per check. MODE:

* ``graphs`` (run with ``JAXOVERLAP_COMMAND_BUFFERS=1``, XLA's default LHS scheduling; the
  calls in a 4-step scan body, which XLA graphs and replays, its buffers keeping their addresses):
  the two token-chained calls are recorded into a command buffer and replayed -- host handler
  calls under capture > 0, fewer host calls than device calls, every execution bitwise equal to
  the first, values near a float32 reference. Then the inversion: process ``ORDER_INVERTED``
  runs the program traced with B before A (the test-only inversion: with order tokens, program
  order is execution order, so the inverted order is a program whose calls are written the other
  way round) while the other process runs A-then-B again. Each process's first call waits for
  its peer's copy of the same call, queued behind the peer's other call: the deadlock R2 is
  about. It must end bounded: within a few ``timeout_s`` (3 s here), a NaN output, no wrong
  finite one, and a `jaxoverlap.FusedCallError` naming an op or the peer's give-up
  (`run_inverted`: which process times out first is a race, and both outcomes are right).
* ``concurrent`` (run with ``JAXOVERLAP_COMMAND_BUFFERS=1`` and
  ``--xla_gpu_command_buffer_scheduling_mode=CONCURRENT``): ``ORDER_ITERS`` executions (1,000),
  every one bitwise equal to the first (this process's shards, compared on its GPU), no error,
  values near the reference; the fused calls were kept out of the concurrent graphs (no handler
  call under capture: they ran as ordinary thunks in program order,
  jaxoverlap.runtime.command_buffers). Progress every ``ORDER_EVERY`` (100) executions; both
  processes stop together, failed, before the next batch would pass ``ORDER_BUDGET_S``
  (`run_concurrent`).

``order_phase`` lines say when each process joined, compiled and finished.

Every mode first prints ``hlo_chain``: the token edge from A to B in XLA's optimized HLO (the
token form, jaxoverlap/fused/call.py ORDER_FORM), or A before B in its schedule (the barrier
form: XLA removes the barriers after scheduling).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import numpy as np

M, K, N = 512, 512, 256  # A: x [M, K] (K split), w [K, N] -> rows of x @ w scattered
M2, K2, N2 = 256, 384, 512  # B: x [M2, K2] (rows split), w [K2, N2] (columns split)
# (each with a leading dimension of scan steps)


def _rand(rng, *shape):
    return (rng.standard_normal(shape, np.float32) / np.sqrt(shape[-1])).astype(np.float32)


def main(process, nproc, port, gpu, mode):
    from tests.gpu.xproc_worker import join

    t_start = time.time()
    mesh, arr = join(process, nproc, port, gpu)
    import jax

    def phase(what):  # where the time goes (no " OK"/" FAILED": not a result line)
        print(f"order_phase {what} at {time.time() - t_start:.1f}s", flush=True)

    phase("joined")
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxoverlap
    from jaxoverlap import Config, fused, runtime

    # graphs: then the inversion, bounded; concurrent: a wait that long is a hang, and it must
    # show well inside the test's budget
    timeout_s = 3.0 if mode == "graphs" else 10.0
    # ORDER_BACKEND=auto: the reference path (a smoke run of this script on CPUs)
    cfg = Config(backend=os.environ.get("ORDER_BACKEND", "fused"), timeout_s=timeout_s)
    # graphs: the calls in a 4-step lax.scan body (XLA graphs a loop body and replays it, its
    # buffers keeping their addresses); otherwise one of each per execution.
    steps = 4 if mode == "graphs" else 1
    rng = np.random.default_rng(5)
    host = dict(
        x1=_rand(rng, steps, M, K), w1=_rand(rng, K, N), v=_rand(rng, N, N),
        x2=_rand(rng, steps, M2, K2), w2=_rand(rng, K2, N2),
    )  # fmt: skip
    specs = dict(
        x1=P(None, None, "tp"), w1=P("tp", None), v=P(), x2=P(None, "tp", None), w2=P(None, "tp")
    )
    args = [arr(host[k].astype(jnp.bfloat16), specs[k]) for k in ("x1", "w1", "v", "x2", "w2")]

    def a_call(x1, w1, v):  # tanh, A, GEMM, sin: XLA work around the call
        y = jaxoverlap.matmul_reduce_scatter(jnp.tanh(x1), w1, "tp", config=cfg)
        return jnp.sin(y @ v)

    def b_call(x2, w2):  # exp, B, cos
        return jnp.cos(jaxoverlap.all_gather_matmul(jnp.exp(x2 * 0.5), w2, "tp", config=cfg))

    def program(inverted):
        def step(x1, w1, v, x2, w2):
            if inverted:  # the test-only inversion: B written (so traced, so run) before A
                b = b_call(x2, w2)
                return a_call(x1, w1, v), b
            return a_call(x1, w1, v), b_call(x2, w2)

        def body(x1, w1, v, x2, w2):
            if steps == 1:
                a, b = step(x1[0], w1, v, x2[0], w2)
                return a[None], b[None]
            c0 = 0 * jnp.sum(x1[0, :1, :1], dtype=jnp.float32)  # varying over tp

            def scan_step(c, xs):
                a, b = step(xs[0], w1, v, xs[1], w2)
                return c + jnp.sum(a, dtype=jnp.float32), (a, b)

            return jax.lax.scan(scan_step, c0, (x1, x2))[1]

        out_specs = (P(None, "tp", None), P(None, None, "tp"))
        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=tuple(specs.values()), out_specs=out_specs)
        )

    def bf(a):
        return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)

    want = (
        np.sin(bf(bf(np.tanh(bf(host["x1"]))) @ bf(host["w1"])) @ bf(host["v"])),
        np.cos(bf(np.exp(bf(host["x2"]) * 0.5)) @ bf(host["w2"])),
    )

    def shards(outs):  # [(index, values)] of this process: A's shard, then B's
        return [
            (s.index, np.asarray(s.data, np.float32)) for o in outs for s in o.addressable_shards
        ]

    def rel_err(outs):
        errs = [
            float(np.max(np.abs(got - w[idx])) / (np.max(np.abs(w[idx])) + 1e-6))
            for (idx, got), w in zip(shards(outs), want, strict=True)
        ]
        return max(errs)

    def bits(outs):
        return [np.asarray(s.data).view(np.uint16) for o in outs for s in o.addressable_shards]

    # Compiled ahead of time (no compilation inside the timed runs; `FusedDispatch` keeps the
    # order token on every call), the inverted program too, then a barrier: neither process's
    # first call waits for the other's compilation.
    f = program(False).lower(*args).compile()
    phase("compiled")
    targets = (fused.emitted(fused.GEMM_RS_TARGET), fused.emitted(fused.AG_GEMM_TARGET))
    if targets[0].endswith("_v2"):  # the token through the call: its edge
        hlo_chain(f.as_text())
    else:  # the barrier form: XLA drops the barriers after scheduling; the schedule remains
        hlo_order(f.as_text(), targets)
    inverted = mode == "graphs" and os.environ.get("ORDER_INVERTED") == str(process)
    # Every process compiles the inverted program too: XLA shards a program's autotuning across
    # the processes that compile it (the key-value store), so one compiling alone waits for the
    # others' shares forever (run 57's hang: the inverting process, in XLA's compiler).
    g = program(True).lower(*args).compile() if mode == "graphs" else f
    g = g if inverted else f
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier("order/compiled", 120_000)
    phase("both compiled")
    nat = runtime.native()
    try:
        if mode == "graphs":
            run_graphs(f, args, rel_err, bits, steps)
            distributed.global_state.client.wait_at_barrier("order/graphs", 120_000)
            run_inverted(g, inverted, args, process, shards, want, jaxoverlap, timeout_s)
        elif mode == "concurrent":
            client = distributed.global_state.client
            run_concurrent(f, args, nat, rel_err, jaxoverlap, jnp, jax, client, process)
    except Exception as e:
        print(f"{mode} FAILED {type(e).__name__}: {str(e)[:800]}", flush=True)
        traceback.print_exc()
    phase("done")
    distributed.global_state.client.wait_at_barrier("order/done", 120_000)


def _operand_names(args):
    """The names in an HLO operand list, printed with or without types and ``%``."""
    names, depth, word = [], 0, ""
    for ch in args + ",":
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            names.append(word.split()[-1].lstrip("%") if word.split() else "")
            word = ""
        else:
            word += ch
    return names


def _call_args(rest, op):
    """The operand list of ``op(...)`` in the rest of an HLO line (up to its closing paren)."""
    start = rest.index(op + "(") + len(op) + 1
    depth = 1
    for i in range(start, len(rest)):
        depth += rest[i] == "("
        depth -= rest[i] == ")"
        if depth == 0:
            return rest[start:i]
    return rest[start:]


def hlo_chain(text):
    """The order token in XLA's optimized HLO: each jaxoverlap custom call's last operand is a
    token, and B's token operand is A's token result -- a get-tuple-element of A's call, followed
    through the calls XLA wraps command buffers in (a parameter of the callee is the call's
    operand; a result of the call is its callee's root tuple's element)."""
    import re

    defs, comp_of, roots = {}, {}, {}  # name -> rest of its line / its computation; comp -> root
    comp = None
    for line in text.splitlines():
        c = re.match(r"\s*(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{\s*$", line)
        if c:
            comp = c.group(1)
            continue
        m = re.match(r"\s*(ROOT )?%?([\w.\-]+) = (.*)$", line)
        if m:
            defs[m.group(2)], comp_of[m.group(2)] = m.group(3), comp
            if m.group(1):
                roots[comp] = m.group(2)
    calls = {}  # name -> (target, its last operand)
    for n, rest in defs.items():
        t = re.search(r'custom_call_target="(jaxoverlap_\w+)"', rest)
        if t and "custom-call(" in rest:
            operands = _operand_names(_call_args(rest, "custom-call"))
            calls[n] = (t.group(1), operands[-1] if operands else "")

    def source(name, index=None, depth=0):
        """The jaxoverlap call whose result ``name`` (element ``index`` of it) is, or None."""
        rest = defs.get(name, "")
        if depth > 20 or not rest:
            return None
        if name in calls:
            return name
        if "get-tuple-element(" in rest:
            (of,) = _operand_names(_call_args(rest, "get-tuple-element"))[:1] or [""]
            k = re.search(r"index=(\d+)", rest)
            return source(of, int(k.group(1)) if k else None, depth + 1)
        if re.search(r"(?<![\w-])tuple\(", rest) and index is not None:
            elems = _operand_names(_call_args(rest, "tuple"))
            return source(elems[index], None, depth + 1) if index < len(elems) else None
        callee = re.search(r"(?:to_apply|calls)=%?([\w.\-]+)", rest)
        if " call(" in " " + rest and callee:
            return source(roots.get(callee.group(1), ""), index, depth + 1)
        k = re.match(r"\S+ parameter\((\d+)\)", rest)
        if k:  # a parameter of a called computation: the call's operand
            callee_of = rf"(?:to_apply|calls)=%?{re.escape(comp_of[name])}(?![\w.\-])"
            for srest in defs.values():
                if re.search(callee_of, srest):
                    operands = _operand_names(_call_args(srest, "call"))
                    i = int(k.group(1))
                    if " call(" in " " + srest and i < len(operands):
                        return source(operands[i], index, depth + 1)
        return None

    tokens = all(defs.get(tok, "").startswith("token[]") for _, tok in calls.values())
    edges = [f"{calls[src][0]}->{t}" for t, tok in calls.values() if (src := source(tok))]
    ok = len(calls) >= 2 and tokens and edges
    print(
        f"hlo_chain {'OK' if ok else 'FAILED'} calls={len(calls)} token_operands={tokens} "
        f"edges={edges}",
        flush=True,
    )
    if not ok:  # what XLA printed, to see why
        for n, rest in defs.items():
            if "jaxoverlap_" in rest or any(n == tok for _, tok in calls.values()):
                print("  hlo:", n, "=", rest[:400], flush=True)


def execution_order(text):
    """The jaxoverlap custom calls of an optimized (scheduled) HLO module in the order its thunks
    run: the entry computation's instructions in order, a ``call`` or ``while`` expanded in
    place (its callee or body once)."""
    import re

    comps, entry, comp = {}, None, None
    for line in text.splitlines():
        c = re.match(r"\s*(ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{\s*$", line)
        if c:
            comp = c.group(2)
            comps[comp] = []
            entry = comp if c.group(1) else entry
        elif comp is not None and " = " in line:
            comps[comp].append(line)
    order = []

    def expand(name, depth=0):
        for line in comps.get(name, []) if depth < 20 else []:
            t = re.search(r'custom_call_target="(jaxoverlap_\w+)"', line)
            if t and "custom-call(" in line:
                order.append(t.group(1))
            elif re.search(r" (call|while)\(", line):
                callee = re.search(r"(?:to_apply|calls|body)=%?([\w.\-]+)", line)
                if callee:
                    expand(callee.group(1), depth + 1)

    expand(entry)
    return order


def hlo_order(text, targets):
    """The barrier form's order in XLA's optimized HLO: its schedule runs A then B, each once
    per step (`execution_order`)."""
    order = execution_order(text)
    ok = len(order) >= 2 and order == list(targets) * (len(order) // 2)
    print(f"hlo_chain {'OK' if ok else 'FAILED'} schedule={order}", flush=True)


def run_graphs(f, args, rel_err, bits, steps, executions=8):
    from tests.gpu.xproc_worker import run_counted

    outs, calls, captured = run_counted(f, args, executions)
    first = bits(outs[0])
    same = all(all(np.array_equal(a, b) for a, b in zip(first, bits(o))) for o in outs[1:])
    err = rel_err(outs[0])
    device_calls = 2 * steps * executions
    ok = same and err < 5e-2 and captured > 0 and calls < device_calls
    print(
        f"graphs {'OK' if ok else 'FAILED'} host_calls={calls} captured={captured} "
        f"device_calls={device_calls} repeat_bitwise={same} rel_err={err:.1e}",
        flush=True,
    )


def run_concurrent(f, args, nat, rel_err, jaxoverlap, jnp, jax, client, process):
    """``ORDER_ITERS`` (1,000) executions of ``f``, every one's shards of this process bitwise
    equal to the first's. The comparison is this process's own: a jit over its addressable
    shards (single-device arrays) folds ``equal`` into one flag on its GPU, no host copy and no
    collective per execution. (A jit over the global arrays -- run 59's version -- reduces across
    the processes: an all-reduce through NCCL, which refuses two ranks on one GPU.) Every
    ``ORDER_EVERY`` (100) executions it waits for the flag and prints ``concurrent_progress``;
    process 0 then decides for both (the key-value store) whether the next hundred fit the
    budget ``ORDER_BUDGET_S`` (40 s), so that both stop at the same execution and neither's
    fused call waits for a peer that stopped. Stopped short, the check fails, saying where."""
    from functools import reduce

    iters = int(os.environ.get("ORDER_ITERS", "1000"))
    every = int(os.environ.get("ORDER_EVERY", "100"))
    budget = float(os.environ.get("ORDER_BUDGET_S", "40"))

    def mine(outs):
        return [s.data for o in outs for s in o.addressable_shards]

    @jax.jit
    def same(ok, first, now):
        return reduce(jnp.logical_and, [jnp.array_equal(a, b) for a, b in zip(first, now)], ok)

    before = nat.handler_calls()
    t0 = time.time()
    first = f(*args)
    mine_first = mine(first)
    dev = mine_first[0].devices().pop()
    ok = same(jax.device_put(np.bool_(True), dev), mine_first, mine_first)
    jax.block_until_ready(ok)
    print(f"concurrent_progress 1/{iters} first execution {time.time() - t0:.2f}s", flush=True)
    done, t1, go = 1, time.time(), True
    while done < iters and go:
        for _ in range(min(every, iters - done)):
            ok = same(ok, mine_first, mine(f(*args)))
            done += 1
        jax.block_until_ready(ok)
        elapsed = time.time() - t0
        rate = (time.time() - t1) / (done - 1)
        print(
            f"concurrent_progress {done}/{iters} {elapsed:.1f}s ({1e3 * rate:.2f} ms per "
            f"execution) equal={bool(ok)}",
            flush=True,
        )
        key = f"order/concurrent/{done}"
        if process == 0:  # the next batch fits the budget at this rate: both go on, else stop
            client.key_value_set(key, "1" if elapsed + every * rate < budget else "0")
        go = client.blocking_key_value_get(key, 60_000) == "1"
    ok = bool(ok)
    dt = time.time() - t0
    jaxoverlap.check_errors()
    after = nat.handler_calls()
    calls, captured = after[0] - before[0], after[1] - before[1]
    err = rel_err(first)
    good = done == iters and ok and err < 5e-2 and captured == 0 and calls == 2 * iters
    short = "" if done == iters else f" (stopped: the next {every} would exceed {budget:.0f}s)"
    print(
        f"concurrent {'OK' if good else 'FAILED'} iterations={done}/{iters}{short} "
        f"bitwise_equal={ok} host_calls={calls} captured={captured} rel_err={err:.1e} "
        f"in {dt:.1f}s",
        flush=True,
    )


def run_inverted(c, inverted, args, process, shards, want, jaxoverlap, timeout_s):
    """After `run_graphs` (both processes in order: workspaces warm, values right): process 1
    runs the inverted program ``c`` while process 0 runs the same one again.

    Each process's first call waits for the peer's copy of it, queued behind the peer's other
    call, until the timeout (3 s). What follows is a race between the two processes' timeouts,
    and both outcomes are right: usually each first call gives up (NaN) and its error names the
    op; but when the peer started its first call a little earlier, the peer's give-up releases
    its copy of this process's first call before this one's deadline -- that call then completes
    with right values (it paired with its true copy: same workspace, same epoch) and the error
    this process sees is the peer's give-up of the other call (call 4 of 2026-12-02). Judged on
    what holds in both: the deadlock showed (a NaN step-0 output in this process), every output
    step is all NaN or right (never wrong finite values), a `FusedCallError` naming one of the
    program's ops (the peer's give-up names the op of the call it marked), all within a few
    timeouts."""
    import jax

    t0 = time.time()
    error = None
    steps_nan = outputs_ok = deadlocked = None
    try:
        outs = jax.block_until_ready(c(*args))
        got = shards(outs)  # this process's A shard, then its B shard: [steps, ...] each
        # Per scan step, the NaN fraction of A and B (which calls gave up, which ran).
        steps_nan = [
            [round(float(np.isnan(v[i]).mean()), 3) for i in range(len(v))] for _, v in got
        ]
        outputs_ok = True
        for (idx, v), w in zip(got, want, strict=True):
            w = w[idx]
            for i in range(len(v)):
                if np.isnan(v[i]).all():
                    continue
                err = float(np.max(np.abs(v[i] - w[i])) / (np.max(np.abs(w[i])) + 1e-6))
                outputs_ok &= err < 5e-2
        deadlocked = any(np.isnan(v[0]).all() for _, v in got)
        jaxoverlap.check_errors()
    except Exception as e:  # the program's own error, or check_errors'
        error = e
    dt = time.time() - t0
    ops = ("jaxoverlap.matmul_reduce_scatter", "jaxoverlap.all_gather_matmul")
    # Both outcomes' errors name the op: a timeout its own call's, a peer's give-up the op of the
    # call it marked (the finish kernel's record carries it since FusedCall's join passes it on).
    named = error is not None and any(op in str(error) for op in ops)
    typed = isinstance(error, jaxoverlap.FusedCallError)
    # Outputs are None only if the program itself raised (then there are none to judge).
    values = outputs_ok is None or (outputs_ok and deadlocked)
    # Bounded: a few timeouts (the first call's, then the rest giving up at once: Peers::dead).
    ok = named and typed and values and dt < 4 * timeout_s
    print(
        f"inverted {'OK' if ok else 'FAILED'} process={process} inverted={inverted} in "
        f"{dt:.1f}s steps_nan(A, B)={steps_nan} values_ok={outputs_ok} deadlocked={deadlocked} "
        f"error={type(error).__name__}: {str(error)[:600]}",
        flush=True,
    )


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]), sys.argv[5])
