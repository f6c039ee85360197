"""`matmul_reduce_scatter` fused with its group spread over processes (one per GPU), against the
same in one process and XLA: issue 11's measurement. Run it both ways on the same GPUs:

  python -m jaxoverlap.launch -n 2 --devices-per-process 1 benchmarks/processes.py   # 2 x 1 GPU
  python benchmarks/processes.py                                                     # 1 x 2 GPUs
  python -m jaxoverlap.launch -n 2 --devices-per-process 1 benchmarks/processes.py \\
      --cpu-smoke --smoke-stand-in                                                   # harness

Per shape (M x K_local x N; tp = every device of every process; x [M, K_local] and w [K_local, N]
per device, the [M / tp, N] result scattered over rows), in one run on fresh random bf16, timed
round-robin in every process, a fixed number of calls per sample (`--iters`: every process must
make the same calls in the same order, as the collectives require; process 0 reports):
gemm_only (the local GEMM), xla (jnp.matmul then lax.psum_scatter), rs_only (lax.psum_scatter
alone), jaxoverlap (backend="fused"). Every result is checked against a float32 reference on
the devices of the process that checks it. The JSON rows carry ``processes`` (BENCHMARKS.md), so
the two runs' rows compare directly.

Exit status: 0 when every measured result was correct; 1 otherwise (or, with --require-fused,
when the fused path did not run).
"""

from __future__ import annotations

import argparse
import json
import sys

import _common as C

SMOKE_SHAPES = [(64, 32, 48)]
METHODS = ("gemm_only", "xla", "rs_only", "jaxoverlap")
BF16_TOL = 2e-2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(p, "processes")
    p.add_argument("--shapes", help="comma-separated MxK_localxN")
    p.add_argument("--require-fused", action="store_true", help="fail if the fused path is absent")
    p.add_argument(
        "--iters",
        type=int,
        help="calls per sample, the same in every process (default 20; smoke 3): a count chosen "
        "per process from its own timing would run different numbers of collectives",
    )
    a = C.finish_args(p, p.parse_args(argv), target_ms=40.0, quick_target_ms=15.0)
    if a.shapes:
        a.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",")]
    else:
        a.shapes = SMOKE_SHAPES if a.cpu_smoke else C.SHAPES
    a.iters = a.iters or (3 if a.cpu_smoke or a.quick else 20)
    return a


def bench(fns, samples, iters):
    """`_common.bench` with a fixed number of calls per sample: every process must make the same
    calls (each of them a collective), so nothing may depend on a process's own timings."""
    import statistics

    import jax

    sync_each = jax.devices()[0].platform == "cpu"  # as _common.bench: XLA:CPU collectives
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    for _ in range(samples):
        for name, (fn, args) in fns.items():
            times[name].append(C._time_once(fn, args, iters, sync_each))
    return {n: {"ms": statistics.median(t), "samples_ms": t} for n, t in times.items()}


def measure(jax, mesh, tp, shape, args, seed):
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jaxoverlap = C.import_jaxoverlap()
    m, k_local, n = shape
    rng = np.random.default_rng([seed, m, k_local, n])  # the same in every process
    x = rng.standard_normal((m, k_local * tp), np.float32).astype(jnp.bfloat16)
    w = (rng.standard_normal((k_local * tp, n), np.float32) / np.sqrt(k_local * tp)).astype(
        jnp.bfloat16
    )
    specs = (P(None, "tp"), P("tp", None))

    def put(a, spec):
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    xs, ws = put(x, specs[0]), put(w, specs[1])
    rs = lambda v: lax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True)  # noqa: E731
    backend = "xla" if args.smoke_stand_in else "fused"
    cfg = jaxoverlap.Config(backend=backend)
    fns = {
        "gemm_only": C.shard_map(jnp.matmul, mesh, specs, P(None, "tp")),
        "xla": C.shard_map(lambda a, b: rs(a @ b), mesh, specs, P("tp", None)),
        "rs_only": C.shard_map(lambda a, b: rs(a), mesh, specs, P("tp", None)),
        "jaxoverlap": C.shard_map(
            lambda a, b: jaxoverlap.matmul_reduce_scatter(a, b, "tp", config=cfg),
            mesh,
            specs,
            P("tp", None),
        ),
    }
    ref = x.astype(np.float32) @ w.astype(np.float32)
    row = {
        "op": "matmul_reduce_scatter",
        "M": m,
        "K_local": k_local,
        "N": n,
        "tp": tp,
        "processes": jax.process_count(),
        "dtype": "bfloat16",
        "scatter_dimension": 0,
        "check": {},
        "notes": [],
    }
    timed = {}
    for name in ("xla", "jaxoverlap"):
        try:
            hlo = fns[name].lower(xs, ws).compile().as_text()
            out = fns[name](xs, ws)
        except Exception as e:  # noqa: BLE001 - the reason is the result
            row["notes"].append(f"{name}: {type(e).__name__}: {C.short(str(e))}")
            continue
        errs = [
            C.rel_err(np.asarray(s.data, np.float32), ref[s.index]) for s in out.addressable_shards
        ]
        row["check"][name] = {"ok": max(errs) < BF16_TOL, "max_rel_err": max(errs)}
        fused = any(t.startswith("jaxoverlap") for t in C.custom_call_targets(hlo))
        if name == "jaxoverlap" and not fused and not args.smoke_stand_in:
            row["notes"].append("backend='fused' compiled without a jaxoverlap custom call")
            continue
        # Several processes: timed whatever this process's shards showed (another process's may
        # differ, and every process must run the same collectives); a wrong result still fails.
        if row["check"][name]["ok"] or jax.process_count() > 1:
            timed[name] = (fns[name], (xs, ws))
    timed["gemm_only"] = (fns["gemm_only"], (xs, ws))
    timed["rs_only"] = (fns["rs_only"], (xs, ws))
    res = bench(timed, args.samples, args.iters)
    row["ms"] = {mth: res[mth]["ms"] if mth in res else None for mth in METHODS}
    row["samples_ms"] = {mth: r["samples_ms"] for mth, r in res.items()}
    return row


def main(argv=None):
    args = parse_args(argv)
    from jaxoverlap import launch

    launched = launch.initialize()  # a no-op unless started by python -m jaxoverlap.launch
    import jax

    if args.cpu_smoke:  # launched: the launcher gave each process its fake CPU devices
        jax.config.update("jax_platforms", "cpu")
        if not launched:
            jax.config.update("jax_num_cpu_devices", 2)
    # Every process must draw the same inputs: a fresh seed only with one process.
    seed = C.fresh_seed(args.seed) if jax.process_count() == 1 else (args.seed or 0)
    mesh, tp = C.make_mesh(jax, args.tp)
    info = C.run_info(args.cpu_smoke)
    lead = jax.process_index() == 0
    if lead:
        print(f"{info['machine']}, jax {info['jax_version']}, tp={tp}, seed={seed}", flush=True)

    def done(row):
        if lead:
            print(json.dumps({k: row[k] for k in ("M", "K_local", "N", "processes", "ms")}))

    rows, crashed = C.measure_rows(
        args.shapes,
        lambda shape: measure(jax, mesh, tp, shape, args, seed),
        done,
        lambda shape: "x".join(map(str, shape)),
    )
    label = lambda r: f"{r['M']}x{r['K_local']}x{r['N']}"  # noqa: E731
    lines = [
        [label(r), *(C.fmt(r["ms"][m]) for m in METHODS),
         C.fmt(C.ratio(r["ms"]["xla"], r["ms"]["jaxoverlap"]), ".2f"),
         C.fmt(C.ratio(r["ms"]["jaxoverlap"], r["ms"]["gemm_only"]), ".2f")]
        for r in rows
    ]  # fmt: skip
    procs = jax.process_count()
    title = f"matmul_reduce_scatter, tp={tp} over {procs} process(es)" + (
        " [stand-in: the reference in jaxoverlap's slot]" if args.smoke_stand_in else ""
    )
    text = "\n".join([title, C.table(["MxK_localxN", *METHODS, "xla/jo", "jo/gemm"], lines)])
    bad = [f"{label(r)} {m}" for r in rows for m, c in r["check"].items() if not c["ok"]]
    if lead:
        doc = C.results_doc(
            info, tp, seed, args, processes=procs, stand_in=args.smoke_stand_in,
            check_tolerance_rel=BF16_TOL, aborted=crashed, rows=rows,
        )  # fmt: skip
        args.name = args.name or f"processes_{tp}x{procs}p" + (
            "_cpu_smoke" if args.cpu_smoke else ""
        )
        C.save(args, "processes", info, tp, doc, text, lambda path, title: None)
        print(text)
    if C.failed(bad, ", ", crashed):
        return 1
    if args.require_fused and any(r["ms"]["jaxoverlap"] is None for r in rows):
        print("FAILED: --require-fused, but the fused path did not run on every shape")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
