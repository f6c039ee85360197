"""Benchmark `jaxoverlap.matmul_reduce_scatter` against XLA, following BENCHMARKS.md.

Per shape (M x K_local x N, tp ranks, output scattered over M), in one run on fresh random bf16:
  gemm_only     jnp.matmul of the local shards (the bound: communication fully hidden)
  xla           jnp.matmul then lax.psum_scatter in shard_map (no overlap)
  xla_windowed  the GEMM under jit shardings with XLA's windowed-einsum flags (a child process:
                XLA reads its flags at start-up)
  rs_only       lax.psum_scatter alone (NCCL)
  jaxoverlap    matmul_reduce_scatter with backend="fused" (null where the fused path cannot run);
                what backend="auto" picks is timed and reported beside it.
  tile          the same with Config(schedule="tile") (jaxoverlap/fused/tile.py: one GEMM whose
                epilogue communicates), rows scattered only; null where it cannot run.
  gemm_part     (diagnostic) the fused op's GEMM schedule alone on its SM partition, without
                communication: with gemm_only and rs_only it shows where the fused time goes.
Every reduce-scatter result is checked against an f32 reference before it is timed.

  python benchmarks/matmul_reduce_scatter.py                # the BENCHMARKS.md shapes, all GPUs
  python benchmarks/matmul_reduce_scatter.py --quick        # fewer, shorter samples
  python benchmarks/matmul_reduce_scatter.py --cpu-smoke    # 2 fake CPU devices, tiny shapes

Exit status: 0 when every measured result was correct; 1 when a check failed, when an error
stopped the run (the JSON keeps the rows before it), or, with --require-fused, when the fused
path did not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile

import _common as C

SHAPES = C.SHAPES
SMOKE_SHAPES = [(64, 32, 48), (128, 64, 64)]
WINDOWED_FLAGS = C.WINDOWED_FLAGS
METHODS = ("gemm_only", "xla", "xla_windowed", "rs_only", "jaxoverlap")
# Per-device M x K_local x N of real layers' reduce-scatters at 8192 tokens: attention out-proj and
# MLP down-proj of 8B- (d 4096, ffn 14336), 70B- (8192, 28672) and 405B-class (16384, 53248)
# models at tp=2, and one GPU's share of a 70B layer at tp=4.
LAYER_SHAPES = [
    (8192, 2048, 4096),
    (8192, 7168, 4096),
    (8192, 4096, 8192),
    (8192, 14336, 8192),
    (8192, 8192, 16384),
    (8192, 26624, 16384),
    (16384, 3584, 4096),
]
BF16_TOL = 2e-2  # max |out - ref| / max |ref|, ref in f32; bf16 rounds the partials and the sum


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(p, "matmul_reduce_scatter")
    p.add_argument(
        "--shapes",
        help="comma-separated MxK_localxN, or 'layers' for real layers' projections (attention "
        "out and MLP down of 8B/70B/405B-class models at tp=2, one GPU's share at tp=4) "
        "(default: BENCHMARKS.md shapes)",
    )
    p.add_argument(
        "--windowed",
        choices=("auto", "on", "off"),
        default="auto",
        help="time xla_windowed in a child process (auto: on except --cpu-smoke)",
    )
    p.add_argument("--windowed-timeout", type=float, default=240.0, help="child limit, seconds")
    p.add_argument("--require-fused", action="store_true", help="fail if the fused path is absent")
    p.add_argument("--comm-sms", type=int, help="Config.comm_sms of the fused run (default: auto)")
    p.add_argument("--chunks", type=int, help="Config.chunks of the fused run (default: auto)")
    p.add_argument(
        "--scatter",
        choices=("rows", "last"),
        default="rows",
        help="the scattered dimension: rows (M) or the last one (N, jaxoverlap/fused/last_dim.py)",
    )
    p.add_argument(
        "--no-breakdown",
        dest="breakdown",
        action="store_false",
        help="skip gemm_part (the fused GEMM schedule alone, no communication)",
    )
    p.add_argument("--windowed-child", help=argparse.SUPPRESS)  # internal: JSON path to write
    a = C.finish_args(p, p.parse_args(argv), target_ms=40.0, quick_target_ms=15.0)
    if a.shapes == "layers":
        a.shapes = LAYER_SHAPES
    elif a.shapes:
        a.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",")]
    else:
        a.shapes = SMOKE_SHAPES if a.cpu_smoke else SHAPES
    return a


# ----------------------------------------------------------------------------- inputs and checks


def make_inputs(jax, mesh, shape, tp, seed):
    """x [M, K_local*tp] split over K, w [K_local*tp, N] split over K; random bf16 on device."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    M, Kl, N = shape
    K = Kl * tp
    kx, kw, ky = jax.random.split(jax.random.fold_in(jax.random.key(seed), M * 7 + Kl * 3 + N), 3)
    bf16 = jnp.bfloat16

    def gen(key, shp, spec, scale=1.0):
        f = jax.jit(
            lambda k: (jax.random.normal(k, shp, jnp.float32) * scale).astype(bf16),
            out_shardings=NamedSharding(mesh, spec),
        )
        return f(key)

    x = gen(kx, (M, K), P(None, "tp"))
    w = gen(kw, (K, N), P("tp", None), K**-0.5)
    y = gen(ky, (M, N * tp), P(None, "tp"))  # rs_only: each rank holds a random [M, N] partial
    return x, w, y


def _dim(args):
    """The scattered dimension of x @ w ([M, N]) and the result's spec."""
    from jax.sharding import PartitionSpec as P

    return (0, P("tp", None)) if getattr(args, "scatter", "rows") == "rows" else (1, P(None, "tp"))


def error_fn(mesh, dim=0):
    """(x, w, out) -> max |out - ref| / max |ref| with ref = psum_scatter(x @ w) in f32."""
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    def body(x, w, out):
        xw = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32))
        ref = lax.psum_scatter(xw, "tp", scatter_dimension=dim, tiled=True)
        err = lax.pmax(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)), "tp")
        scale = lax.pmax(jnp.max(jnp.abs(ref)), "tp")
        return err / scale

    out = P("tp", None) if dim == 0 else P(None, "tp")
    return C.shard_map(body, mesh, (P(None, "tp"), P("tp", None), out), P())


def check(err_f, x, w, out):
    rel = float(err_f(x, w, out))
    return {"rel_err": rel, "ok": bool(rel <= BF16_TOL)}


# ----------------------------------------------------------------------------- xla_windowed child


def run_windowed_child(args, seed, tp):
    """Times xla_windowed in a fresh process (before this one touches a GPU); shape -> result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "windowed.json")
        shapes = ",".join("x".join(map(str, s)) for s in args.shapes)
        opts = f"--seed {seed} --samples {args.samples} --target-ms {args.target_ms}"
        cmd = [sys.executable, os.path.abspath(__file__), "--windowed-child", out, *opts.split()]
        cmd += ["--shapes", shapes]
        cmd += ["--tp", str(tp)] if tp else []
        cmd += ["--cpu-smoke"] if args.cpu_smoke else []
        cmd += ["--scatter", args.scatter]
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {WINDOWED_FLAGS}")
        print(f"xla_windowed: child process with XLA_FLAGS={env['XLA_FLAGS'].strip()!r}")
        try:
            r = subprocess.run(cmd, env=env, timeout=args.windowed_timeout)
        except subprocess.TimeoutExpired:
            return {}, f"xla_windowed child timed out after {args.windowed_timeout:.0f} s"
        if r.returncode != 0 or not os.path.exists(out):
            return {}, f"xla_windowed child failed (exit status {r.returncode}); see its output"
        with open(out) as f:
            return {tuple(r["shape"]): r for r in json.load(f)}, None


def windowed_child(args):
    jax = C.setup_platform(args.cpu_smoke)
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    mesh, tp = C.make_mesh(jax, args.tp)
    dim, out_spec = _dim(args)
    err_f = error_fn(mesh, dim)
    out_sh = NamedSharding(mesh, out_spec)
    rows = []
    for shape in args.shapes:
        x, w, _ = make_inputs(jax, mesh, shape, tp, args.seed)
        f = jax.jit(lambda x, w: jax.lax.with_sharding_constraint(jnp.matmul(x, w), out_sh))
        row = {"shape": list(shape)}
        try:
            hlo = f.lower(x, w).compile().as_text()
            row["collective_permutes"] = hlo.count("collective-permute")
            row["check"] = check(err_f, x, w, f(x, w))
            if row["check"]["ok"]:
                row.update(
                    C.bench(
                        {"xla_windowed": (f, (x, w))},
                        samples=args.samples,
                        target_ms=args.target_ms,
                    )["xla_windowed"]
                )
        except Exception as e:  # noqa: BLE001 - reported, the parent goes on
            row["error"] = f"{type(e).__name__}: {e}"
        print("xla_windowed", shape, {k: v for k, v in row.items() if k != "samples_ms"})
        rows.append(row)
        del x, w
    C.write_json(args.windowed_child, rows)


# ----------------------------------------------------------------------------- main run


def jaxoverlap_fns(jax, mesh, args):
    """backend -> jitted fn, or a sentence saying why jaxoverlap cannot be used at all."""
    from jax.sharding import PartitionSpec as P

    try:
        jaxoverlap = C.import_jaxoverlap()
    except Exception as e:  # noqa: BLE001
        return f"import jaxoverlap failed: {type(e).__name__}: {e}"
    if not hasattr(jaxoverlap, "matmul_reduce_scatter"):
        return "jaxoverlap.matmul_reduce_scatter does not exist in this checkout"

    def make(backend, schedule=None):
        knobs = {"comm_sms": args.comm_sms, "chunks": args.chunks} if backend == "fused" else {}
        if schedule:
            knobs = {"schedule": schedule} if backend == "fused" else {}
        cfg = jaxoverlap.Config(backend=backend, **knobs)

        dim, out_spec = _dim(args)

        def body(x, w):
            return jaxoverlap.matmul_reduce_scatter(x, w, "tp", scatter_dimension=dim, config=cfg)

        return C.shard_map(body, mesh, (P(None, "tp"), P("tp", None)), out_spec)

    fused_or_stand_in = "xla" if args.smoke_stand_in else "fused"
    fns = {"fused": make(fused_or_stand_in), "auto": make("auto")}
    if args.scatter == "rows" and "schedule" in jaxoverlap.Config.__dataclass_fields__:
        fns["tile"] = make(fused_or_stand_in, schedule="tile")
    # Where the time goes: the fused op's GEMM schedule alone on its partition (no
    # communication, wrong numbers), through the tools-only switch of jaxoverlap.fused.
    try:
        from jaxoverlap import fused

        profile = getattr(fused, "_gemm_only_for_tools", None)
    except ImportError:
        profile = None
    if args.smoke_stand_in:
        profile = contextlib.nullcontext
    if profile is not None and args.breakdown:
        fns["gemm_partition"] = (make("xla" if args.smoke_stand_in else "fused"), profile)
    return fns


def measure_shape(jax, mesh, tp, shape, args, seed, jo):
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    M, Kl, N = shape
    x, w, y = make_inputs(jax, mesh, shape, tp, seed)
    dim, out_spec = _dim(args)
    xw = (P(None, "tp"), P("tp", None))
    gemm = C.shard_map(jnp.matmul, mesh, xw, P(None, "tp"))
    scatter = lambda v: lax.psum_scatter(v, "tp", scatter_dimension=dim, tiled=True)  # noqa: E731
    xla = C.shard_map(lambda x, w: scatter(jnp.matmul(x, w)), mesh, xw, out_spec)
    # y [M, N * tp] over N: each rank a random [M, N] partial; scattered over M or N.
    rs = C.shard_map(scatter, mesh, P(None, "tp"), out_spec if dim == 0 else P(None, "tp"))
    err_f = error_fn(mesh, dim)
    row = {
        "M": M,
        "K_local": Kl,
        "N": N,
        "tp": tp,
        "scatter_dimension": dim,
        "dtype": "bfloat16",
        "notes": [],
        "check": {},
        "iters": {},
        "samples_ms": {},
    }
    fns = {"gemm_only": (gemm, (x, w)), "rs_only": (rs, (y,))}
    row["check"]["xla"] = check(err_f, x, w, xla(x, w))
    if row["check"]["xla"]["ok"]:
        fns["xla"] = (xla, (x, w))
    if isinstance(jo, str):
        row["notes"].append(jo)
    else:
        for backend in [b for b in ("fused", "auto", "tile") if b in jo]:
            f, key = jo[backend], {"fused": "jaxoverlap"}.get(backend, backend)
            try:
                targets = C.custom_call_targets(f.lower(x, w).compile().as_text())
                ours = [t for t in targets if t.startswith("jaxoverlap")]
                row["check"][key] = check(err_f, x, w, f(x, w))
            except Exception as e:  # noqa: BLE001 - the reason is the result
                row["notes"].append(f"backend={backend!r}: {type(e).__name__}: {e}".strip())
                continue
            if backend == "auto":
                row["auto_picks"] = "fused" if ours else "xla"
            else:
                row[f"{key}_custom_calls"] = ours
                if not ours and not args.smoke_stand_in:
                    row["notes"].append(
                        f"backend='fused' ({key}) compiled without a jaxoverlap custom call (the "
                        "reference ran): not timed"
                    )
                    continue
            if row["check"][key]["ok"]:
                fns[key] = (f, (x, w))
            else:
                row["notes"].append(f"backend={backend!r}: WRONG RESULT, not timed")
        if "jaxoverlap" in fns and "gemm_partition" in jo:
            gemm_partition(jax, row, fns, jo["gemm_partition"], err_f, x, w, args.smoke_stand_in)
    res = C.bench(fns, samples=args.samples, target_ms=args.target_ms)
    row["ms"] = {m: res[m]["ms"] if m in res else None for m in METHODS}
    row["auto_ms"] = res["auto"]["ms"] if "auto" in res else None
    row["tile_ms"] = res["tile"]["ms"] if "tile" in res else None
    row["gemm_partition_ms"] = res["gemm_partition"]["ms"] if "gemm_partition" in res else None
    for name, r in res.items():
        row["iters"][name], row["samples_ms"][name] = r["iters"], r["samples_ms"]
    del x, w, y
    return row


def gemm_partition(jax, row, fns, fn_and_profile, err_f, x, w, stand_in):
    """Adds the fused op's GEMM-only schedule to `fns` if the switch demonstrably took effect."""
    f, profile = fn_and_profile
    try:
        with profile():  # the switch is read when the call is traced and lowered
            out = f(x, w)
        rel = check(err_f, x, w, out)["rel_err"]
    except Exception as e:  # noqa: BLE001
        row["notes"].append(f"gemm_partition: {type(e).__name__}: {e}")
        return
    if rel <= BF16_TOL and not stand_in:  # no communication must give the wrong sum
        row["notes"].append("gemm_partition: the GEMM-only switch had no effect; not timed")
        return
    fns["gemm_partition"] = (f, (x, w))


def add_windowed(row, win, win_err):
    r = win.get((row["M"], row["K_local"], row["N"]))
    if r is None:
        if win_err:
            row["notes"].append(win_err)
        return
    row["xla_windowed_collective_permutes"] = r.get("collective_permutes")
    if "check" in r:
        row["check"]["xla_windowed"] = r["check"]
    if "ms" in r:
        row["ms"]["xla_windowed"] = r["ms"]
        row["iters"]["xla_windowed"], row["samples_ms"]["xla_windowed"] = (
            r["iters"],
            r["samples_ms"],
        )
    elif "error" in r:
        row["notes"].append(f"xla_windowed: {r['error']}")


def report(rows, tp, stand_in):
    """The stdout table and the geometric means (also returned for the JSON)."""
    jo = "jaxoverlap" + ("[stand-in]" if stand_in else "")
    headers = f"MxK_lxN gemm_only xla xla_win rs_only {jo} gemm_part auto auto= xla/jo win/jo "
    headers = (headers + "jo/gemm xla/auto tile tile/gemm xla/tile").split()
    lines = []
    for r in rows:
        ms = r["ms"]
        lines.append(
            [
                f"{r['M']}x{r['K_local']}x{r['N']}",
                *(C.fmt(ms[m]) for m in METHODS),
                C.fmt(r.get("gemm_partition_ms")),
                C.fmt(r["auto_ms"]),
                r.get("auto_picks", "-"),
                C.fmt(C.ratio(ms["xla"], ms["jaxoverlap"]), ".2f"),
                C.fmt(C.ratio(ms["xla_windowed"], ms["jaxoverlap"]), ".2f"),
                C.fmt(C.ratio(ms["jaxoverlap"], ms["gemm_only"]), ".2f"),
                C.fmt(C.ratio(ms["xla"], r["auto_ms"]), ".2f"),
                C.fmt(r.get("tile_ms")),
                C.fmt(C.ratio(r.get("tile_ms"), ms["gemm_only"]), ".2f"),
                C.fmt(C.ratio(ms["xla"], r.get("tile_ms")), ".2f"),
            ]
        )
    g = {
        "jaxoverlap_over_xla": C.geomean(
            C.ratio(r["ms"]["xla"], r["ms"]["jaxoverlap"]) for r in rows
        ),
        "jaxoverlap_over_xla_windowed": C.geomean(
            C.ratio(r["ms"]["xla_windowed"], r["ms"]["jaxoverlap"]) for r in rows
        ),
        "jaxoverlap_over_gemm_only": C.geomean(
            C.ratio(r["ms"]["jaxoverlap"], r["ms"]["gemm_only"]) for r in rows
        ),
        "auto_over_xla": C.geomean(C.ratio(r["ms"]["xla"], r["auto_ms"]) for r in rows),
        "tile_over_xla": C.geomean(C.ratio(r["ms"]["xla"], r.get("tile_ms")) for r in rows),
        "tile_over_gemm_only": C.geomean(
            C.ratio(r.get("tile_ms"), r["ms"]["gemm_only"]) for r in rows
        ),
    }
    n = sum(r["ms"]["jaxoverlap"] is not None for r in rows)
    text = "\n".join(
        [
            f"matmul_reduce_scatter, ms (median), tp={tp}, bf16; "
            "jo = jaxoverlap backend='fused', gemm_part = its GEMM schedule alone on its SM "
            "partition (no communication), auto= what backend='auto' runs",
            C.table(headers, lines),
            f"geomean speedup of jaxoverlap over xla: {C.fmt(g['jaxoverlap_over_xla'], '.3f')}x, "
            f"over xla_windowed: {C.fmt(g['jaxoverlap_over_xla_windowed'], '.3f')}x, "
            f"jaxoverlap/gemm_only: {C.fmt(g['jaxoverlap_over_gemm_only'], '.3f')} "
            f"({n}/{len(rows)} shapes fused); auto over xla: {C.fmt(g['auto_over_xla'], '.3f')}x; "
            f"tile schedule over xla: {C.fmt(g['tile_over_xla'], '.3f')}x, tile/gemm_only: "
            f"{C.fmt(g['tile_over_gemm_only'], '.3f')}",
        ]
    )
    common = set.intersection(*(set(r["notes"]) for r in rows)) if rows else set()
    notes = [f"  all shapes: {C.short(n)}" for n in sorted(common)]
    notes += [
        f"  {r['M']}x{r['K_local']}x{r['N']}: {C.short(n)}"
        for r in rows
        for n in r["notes"]
        if n not in common
    ]
    if notes:
        text += "\nnotes:\n" + "\n".join(dict.fromkeys(notes))
    return text, g


def plot(rows, path, title):
    methods = ["xla", "xla_windowed", "jaxoverlap", "rs_only"]
    return C.plot_vs_gemm(
        rows, path, title, methods, lambda r: f"{r['M']}x{r['K_local']}x{r['N']}", (11, 4.5)
    )


def main(argv=None):
    args = parse_args(argv)
    if args.windowed_child:
        return windowed_child(args)
    seed = C.fresh_seed(args.seed)
    win, win_err = {}, "xla_windowed not measured (--windowed off / --cpu-smoke)"
    if args.windowed == "on" or (args.windowed == "auto" and not args.cpu_smoke):
        win, win_err = run_windowed_child(args, seed, args.tp)  # before this process uses a GPU
    jax, mesh, tp, info = C.start(args, seed)
    jo = jaxoverlap_fns(jax, mesh, args)

    def done(row):
        add_windowed(row, win, win_err)
        print(
            json.dumps({k: row[k] for k in ("M", "K_local", "N", "ms", "auto_ms", "notes")}),
            flush=True,
        )

    rows, crashed = C.measure_rows(
        args.shapes,
        lambda shape: measure_shape(jax, mesh, tp, shape, args, seed, jo),
        done,
        lambda shape: "x".join(map(str, shape)),
    )
    return C.finish_op_benchmark(
        args, "matmul_reduce_scatter", info, tp, seed, rows, crashed, report, plot,
        lambda r: f"{r['M']}x{r['K_local']}x{r['N']}",
        tolerance=BF16_TOL, fused_config={"comm_sms": args.comm_sms, "chunks": args.chunks},
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
