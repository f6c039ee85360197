"""Tuning by measurement: which path and which settings each fused op takes, per shape.

For a key (device kind, op, per-device shape, dtype, group size) the tuner times XLA's own path
and every candidate setting of every fused kernel that passes the one-GPU suite on the real GPUs,
side by side (round-robin samples, medians), and records the outcome in a JSON cache on disk.
Each candidate's values are checked against XLA's result first (beyond the dtype's tolerance:
recorded in the entry's ``failed`` and never chosen), and each is bounded by a short timeout
(``--timeout``, 5 s: the kernels' cross-GPU waits through ``Config(timeout_s=)``, the call by a
wall clock; past it: recorded as failed, and the tuning moves on). ``backend="auto"`` then takes
the fused path exactly where the recorded measurement beat XLA by more than the noise (the larger
spread of the two, at least 2 %), with the fastest setting -- also for the kernels not yet
measured on two GPUs, which untuned auto leaves out (`fused.policy.new_kernels_reason`): an entry
of this tuner (marked ``new_kernels``) that names one lets auto take it for that shape on this
machine. Where nothing is recorded auto uses a conservative rule (`fused.policy`) and says so
once in the log.

What is tried (`candidates`; ``--candidates`` prints it), per op (`OPS`; each its own entry),
and the rule that makes an entry of the timings (`decide`) are `jaxoverlap.fused.tuning`'s:
matmul_reduce_scatter over rows -- chunks x comm SMs, the copy engine (comm_sms=0), the tile
schedule; matmul_all_reduce and the last-dimension scatter (``matmul_reduce_scatter_last_dim``)
-- chunks x comm SMs; all_gather_matmul over rows and its variant that keeps the gathered x
(``all_gather_matmul_keep``: a trained weight's forward, several weights) -- chunks; the
all-gather along K (``all_gather_matmul_along_k``) and the column-parallel backward
(``all_gather_matmul_backward``) -- their one schedule.

    python -m jaxoverlap.tune --op all --shapes 8192x4096x8192,4096x14336x4096 --tp 2
    python -m jaxoverlap.tune --op all_gather_matmul --shapes 8192x8192x4096
    python -m jaxoverlap.tune --list            # what the cache holds

From Python, ``jaxoverlap.tune.tune_function(fn, *args)`` tunes every jaxoverlap op that
``fn`` (e.g. an ``overlap``-ed train step; under ``jax.grad`` also the keep variant and the
column-parallel backward) contains.

The cache lives in ``$XDG_CACHE_HOME/jaxoverlap`` (default ``~/.cache/jaxoverlap``), one file
per fingerprint of what the timings depend on (jaxlib version, the native extension's build,
the GPU driver), so a rebuilt extension or a new driver starts empty. Decisions are taken at
trace and lowering time from data every rank shares: in one process from its cache; with several
processes (`jax.distributed`) each offers the entry of its own cache and all use the first one
offered (`jaxoverlap.xproc.agree`), so no two processes can lower different programs.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import runtime
from jaxoverlap.fused import policy, tuning
from jaxoverlap.fused.cache import (  # noqa: F401  (re-exported: the cache, as before the split)
    CACHE_VERSION,
    Key,
    cache_path,
    load,
    lookup,
    record,
)
from jaxoverlap.fused.tuning import (  # noqa: F401  (re-exported: what is tried, the decision)
    NOISE_FLOOR,
    OPS,
    RS_CANDIDATES,
    RS_CE_CANDIDATES,
    TILE,
    candidates,
    decide,
    describe,
    faster,
    name_of,
    shapes_of,
)
from jaxoverlap.ops import primitives
from jaxoverlap.runtime import cache_dir, fingerprint  # noqa: F401  (re-exported, as above)

log = logging.getLogger("jaxoverlap")
# Relative error (to the largest |value| of XLA's result) a fused candidate may differ by.
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2}
CANDIDATE_TIMEOUT_S = 5.0  # each candidate's calls; Config(timeout_s=) bounds its waits too
WARMUP_LIMIT_S = 120.0  # the first call (the handler's GEMM plan search), still bounded


# ----------------------------------------------------------------------------- measuring


def _time(fns: dict, samples: int, target_ms: float) -> dict:
    """name -> (median, q1, q3) in ms of round-robin samples, each ~target_ms of back-to-back
    calls. Quartiles, not (max - min): one sample disturbed by something else on the machine
    must not veto a decision (BENCHMARKS.md's (max - min) / median read 10-33 % on 7 samples of
    otherwise stable GEMMs in a tuning run, docs/measurements.md run 17)."""
    iters = {}
    for name, (fn, args) in fns.items():
        jax.block_until_ready(fn(*args))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        est = (time.perf_counter() - t0) * 1e3
        iters[name] = max(3, min(500, math.ceil(target_ms / max(est, 1e-3))))
    runs = {name: [] for name in fns}
    for _ in range(samples):
        for name, (fn, args) in fns.items():
            t0 = time.perf_counter()
            out = None
            for _ in range(iters[name]):
                out = fn(*args)
            jax.block_until_ready(out)
            runs[name].append((time.perf_counter() - t0) * 1e3 / iters[name])
    out = {}
    for name, ts in runs.items():
        q1, med, q3 = statistics.quantiles(ts, n=4, method="inclusive")
        out[name] = (med, q1, q3)
    return out


def _problem(op, m, k, n, group):
    """``(global operand shapes, in_specs, out_specs, body(config) -> fn of the per-device
    operands)`` of ``op`` at the `Key` shape (m, k, n) over ``group`` GPUs."""
    row = ("tp",)

    def prim(p, **dims):  # a variant bound as its op binds it (per-device operands)
        return lambda config: (
            lambda *a: tuple(p.bind(*a, axis_name=row, config=config, w_colmajor=False, **dims))
        )

    def public(fn, **dims):
        return lambda config: lambda x, w: fn(x, w, "tp", config=config, **dims)

    rs = ((m, k * group), (k * group, n)), (P(None, "tp"), P("tp", None))
    ag = ((m, k), (k, n * group)), (P("tp", None), P(None, "tp"))
    table = {
        "matmul_reduce_scatter": (*rs, P("tp", None), public(jaxoverlap.matmul_reduce_scatter)),
        "matmul_all_reduce": (*rs, P(), public(jaxoverlap.matmul_all_reduce)),
        "all_gather_matmul": (*ag, P(None, "tp"), public(jaxoverlap.all_gather_matmul)),
        policy.LAST_DIM: (
            *rs,
            P(None, "tp"),
            public(jaxoverlap.matmul_reduce_scatter, scatter_dimension=1),
        ),
        policy.ALONG_K: (
            ((m, k), (k, n * group)),
            (P(None, "tp"), P(None, "tp")),
            P(None, "tp"),
            public(jaxoverlap.all_gather_matmul, gather_dimension=1),
        ),
        # (out, the gathered x): one copy of x per rank, stacked
        policy.KEEP: (
            *ag,
            (P(None, "tp"), P("tp")),
            prim(primitives.all_gather_matmul_keep_p, gather_dimension=0),
        ),
        # ct [m, n] and g [m, k] per rank (stacked), w.T [n, k]: (dx [m / group, k], dW [k, n])
        policy.BACKWARD: (
            ((m, n * group), (n * group, k), (m * group, k)),
            (P(None, "tp"), P("tp", None), P("tp", None)),
            (P("tp", None), P(None, "tp")),
            prim(primitives.dgrad_rs_wgrad_p, scatter_dimension=0),
        ),
    }
    return table[op]


def _bounded_call(fn, args, limit):
    """``fn(*args)`` run to completion in a thread for at most ``limit`` seconds: ``({"out": ...}
    or {"error": ...}, seconds)``, or ``(None, limit)`` if it is still running (left behind)."""
    box = {}

    def run():
        try:
            box["out"] = jax.block_until_ready(fn(*args))
        except Exception as e:  # noqa: BLE001  (a failed call is a failed candidate)
            box["error"] = e

    t0 = time.perf_counter()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        return None, limit
    return box, time.perf_counter() - t0


def _check(fn, args, want, dtype, limit_s):
    """Runs the compiled candidate ``fn`` and compares it with XLA's ``want``: None if right,
    else why it is not used. Each call runs in a thread bounded by a wall-clock limit (the first,
    which searches GEMM plans, by `WARMUP_LIMIT_S`; the second by ``limit_s``); the kernels'
    cross-GPU waits are bounded by the same ``limit_s`` (Config(timeout_s=)), so a candidate that
    stalls gives up, and one still running past the limit is abandoned (its thread left
    behind)."""
    for limit in (max(WARMUP_LIMIT_S, limit_s), limit_s):
        box, took = _bounded_call(fn, args, limit)
        if box is None:
            return f"timeout: no result within {limit:g} s (abandoned)"
        try:
            runtime.check_errors()  # a wait that gave up (NaN outputs) raises here
        except runtime.FusedCallError as e:
            return f"failed: {e}"
        if "error" in box:
            return f"failed: {type(box['error']).__name__}: {box['error']}"
        if took > limit:
            return f"timeout: {took:.1f} s > {limit:g} s"
    got = jax.tree.leaves(box["out"])
    worst = 0.0
    for g, wnt in zip(got, want, strict=True):
        g = np.asarray(g.astype(jnp.float32))
        scale = max(float(np.abs(wnt).max()), 1e-6)
        err = float(np.abs(g - wnt).max()) / scale if g.size else 0.0
        worst = max(worst, err if np.isfinite(err) else np.inf)
    if worst > TOLERANCE[str(np.dtype(dtype))]:
        return f"wrong values: relative error {worst:.3g} vs XLA's path"
    return None


def _gpus(group):
    """The first ``group`` GPUs, or RuntimeError."""
    devices = jax.devices()
    if devices[0].platform != "gpu" or len(devices) < group:
        raise RuntimeError(f"jaxoverlap.tune: needs {group} GPUs, found {devices}")
    return devices[:group]


def tune_op(
    op,
    m,
    k,
    n,
    group,
    dtype="bfloat16",
    *,
    samples=9,
    target_ms=40.0,
    save=True,
    timeout_s=CANDIDATE_TIMEOUT_S,
):
    """Tunes ``op`` (one of `OPS`) on ``group`` GPUs. Shapes as in `Key`: matmul_reduce_scatter,
    matmul_all_reduce and the last-dimension scatter x [m, k] and w [k, n] per device;
    all_gather_matmul and its keep variant m gathered rows, x [m / group, k], w [k, n] per
    device; along K x [m, k / group], w [k, n]; the column-parallel backward its forward's
    shape (ct [m, n], w [k, n]). Every candidate's values are checked against XLA's path and
    each candidate is bounded by ``timeout_s``; one that fails either is recorded in the entry's
    ``failed`` and never chosen."""
    if op not in OPS:
        raise ValueError(f"jaxoverlap.tune: op must be one of {OPS}, not {op!r}")
    devices = _gpus(group)
    mesh = Mesh(np.array(devices), ("tp",))
    dt = jnp.dtype(dtype)
    shapes, in_specs, out_specs, body = _problem(op, m, k, n, group)
    keys = jax.random.split(jax.random.key(m * 7 + k * 3 + n), len(shapes))
    args = []
    for key_, shape, spec in zip(keys, shapes, in_specs, strict=True):
        a = jax.random.normal(key_, shape, jnp.float32) / np.sqrt(shape[0] if args else 1)
        args.append(jax.device_put(a.astype(dt), NamedSharding(mesh, spec)))

    def make(config):
        fn = jax.shard_map(body(config), mesh=mesh, in_specs=in_specs, out_specs=out_specs)
        return jax.jit(fn)

    fns = {"xla": (make(jaxoverlap.Config(backend="xla")), args)}
    want = [np.asarray(v.astype(jnp.float32)) for v in jax.tree.leaves(fns["xla"][0](*args))]
    failed = {}
    for cand in candidates(op):
        if not tuning.aligned(op, cand, m, k, n, group):
            continue  # this split is not aligned for the shape
        extra = dict(schedule=TILE) if cand == TILE else dict(chunks=cand[0], comm_sms=cand[1])
        config = jaxoverlap.Config(backend="fused", timeout_s=timeout_s, **extra)
        fn = make(config)
        try:
            fn = fn.lower(*args).compile()
        except ValueError as e:  # backend="fused" refused: the reason says why (dtype, ...)
            log.info("jaxoverlap.tune: %s %dx%dx%d %s not fusable: %s", op, m, k, n, cand, e)
            continue
        except Exception as e:  # noqa: BLE001  (did not compile: a failed candidate)
            why = f"failed to compile: {type(e).__name__}: {e}"
        else:
            why = _check(fn, args, want, dt, timeout_s)
        if why is not None:
            log.warning("jaxoverlap.tune: %s %dx%dx%d %s: %s", op, m, k, n, name_of(cand), why)
            failed[name_of(cand)] = why
            continue
        fns[cand] = (fn, args)
    entry = decide(_time(fns, samples, target_ms))
    entry[policy.NEW_KERNELS_FIELD] = True  # every kernel tried (auto may take what won)
    entry["failed"] = failed
    key = Key(op, m, k, n, str(dt), group, devices[0].device_kind)
    if save:
        record(key, entry)
    return key, entry


def tune_function(fn, *args, progress=print, **kwargs) -> dict:
    """Tunes every op of ``fn(*args)`` that has a fused kernel; returns id -> entry."""
    todo = [s for s in shapes_of(fn, *args, **kwargs) if s[0] in OPS]
    out = {}
    for i, (op, m, k, n, dtype, group) in enumerate(todo, 1):
        if dtype not in ("bfloat16", "float16"):
            progress(f"[{i}/{len(todo)}] {op} {m}x{k}x{n} {dtype}: no fused kernel for {dtype}")
            continue
        key, entry = tune_op(op, m, k, n, group, dtype)
        out[key.id()] = entry
        progress(f"[{i}/{len(todo)}] {describe(key, entry)}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxoverlap.tune", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--op", default="matmul_reduce_scatter", choices=(*OPS, "all"), help="'all': every op"
    )
    p.add_argument(
        "--shapes",
        help="comma-separated MxKxN: matmul_reduce_scatter (and _last_dim, matmul_all_reduce) "
        "per device x [M, K], w [K, N]; all_gather_matmul (and _keep, _backward) M gathered "
        "rows, K, N_local; all_gather_matmul_along_k M, K (whole), N_local",
    )
    p.add_argument("--tp", type=int, default=2, help="GPUs in the group (default 2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--samples", type=int, default=9)
    p.add_argument(
        "--timeout",
        type=float,
        default=CANDIDATE_TIMEOUT_S,
        help=f"seconds a candidate may take (default {CANDIDATE_TIMEOUT_S:g}); past it, or "
        "with values unlike XLA's, it is recorded as failed and never chosen",
    )
    p.add_argument("--list", action="store_true", help="print the cache and exit")
    p.add_argument("--candidates", action="store_true", help="print what is tried and exit")
    a = p.parse_args(argv)
    ops = OPS if a.op == "all" else (a.op,)
    if a.candidates:
        for op in ops:
            print(f"{op}: xla, " + ", ".join(name_of(c) for c in candidates(op)))
        return 0
    if a.list:
        print(cache_path())
        for kid, e in sorted(load().items()):
            how = "schedule=tile" if e.get("schedule") == TILE else f"chunks={e['chunks']}"
            failed = f" failed={sorted(e['failed'])}" if e.get("failed") else ""
            print(f"{kid}: {e['choice']} {how} comm_sms={e['comm_sms']}{failed}")
        return 0
    if not a.shapes:
        p.error("--shapes is required (or --list, --candidates)")
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",")]
    if any(len(s) != 3 for s in shapes):
        p.error("--shapes: each shape is MxKxN, e.g. 8192x4096x8192")
    todo = [(op, s) for s in shapes for op in ops]
    print(f"tuning {len(todo)} op/shape(s) into {cache_path()}", flush=True)
    for i, (op, (m, k, n)) in enumerate(todo, 1):
        key, entry = tune_op(op, m, k, n, a.tp, a.dtype, samples=a.samples, timeout_s=a.timeout)
        print(f"[{i}/{len(todo)}] {describe(key, entry)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
