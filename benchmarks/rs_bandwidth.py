"""Reduce-scatter bus bandwidth: jaxoverlap's standalone TMA kernel by SM count vs NCCL.

Per size (bytes of each rank's input; bf16 [rows, 8192] scattered over rows):
  nccl    lax.psum_scatter(..., tiled=True) in shard_map (XLA's NCCL reduce-scatter)
  tma_k   jaxoverlap.fused.tma.tma_reduce_scatter with comm_sms=k (no GEMM)
bus bandwidth = size * (n - 1) / n / time (the nccl-tests convention for reduce-scatter).
Each TMA result is checked against the NCCL result before it is timed.

  python benchmarks/rs_bandwidth.py                 # 64, 128, 256 MB; 4..32 SMs
  python benchmarks/rs_bandwidth.py --quick         # 8 and 16 SMs, fewer samples
  python benchmarks/rs_bandwidth.py --cpu-smoke     # 2 fake CPU devices, tiny sizes

Exit status: 0 when every measured result was correct; 1 when a check failed, when an error
stopped the run (the JSON keeps the rows before it), or, with --require-tma, when the TMA
kernel could not run.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys

import _common as C

SIZES_MB = (64, 128, 256)
SMOKE_SIZES_MB = (0.0625, 0.25)
SM_COUNTS = (4, 8, 12, 16, 24, 32)
QUICK_SM_COUNTS = (8, 16)
TARGET = {"busbw_GBs": 330.0, "max_sms": 16}  # BENCHMARKS.md target for the TMA kernel
TOL = 1e-2  # max |tma - nccl| / max |nccl|; both add n bf16 partials


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(p, "rs_bandwidth")
    p.add_argument("--sizes-mb", help="comma-separated MB per rank (default 64,128,256)")
    p.add_argument("--sms", help="comma-separated comm SM counts (default 4,8,12,16,24,32)")
    p.add_argument("--cols", type=int, help="row length in elements (default 8192; smoke 64)")
    p.add_argument("--require-tma", action="store_true", help="fail if the TMA kernel is absent")
    a = C.finish_args(p, p.parse_args(argv), target_ms=30.0, quick_target_ms=10.0)
    a.cols = a.cols or (64 if a.cpu_smoke else 8192)
    sizes = SMOKE_SIZES_MB if a.cpu_smoke else SIZES_MB
    a.sizes_mb = [float(v) for v in a.sizes_mb.split(",")] if a.sizes_mb else sizes
    sms = QUICK_SM_COUNTS if a.quick or a.cpu_smoke else SM_COUNTS
    a.sms = [int(v) for v in a.sms.split(",")] if a.sms else sms
    return a


def tma_call(stand_in):
    """(y, comm_sms) -> reduce-scattered y, per device; or a sentence saying why there is none."""
    from jax import lax

    if stand_in:
        return lambda y, k: lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True)
    try:
        jaxoverlap = C.import_jaxoverlap()
        from jaxoverlap.fused import tma
    except Exception as e:  # noqa: BLE001
        return f"import jaxoverlap.fused.tma failed: {type(e).__name__}: {e}"
    fn = getattr(tma, "tma_reduce_scatter", None)
    if fn is None:
        return "jaxoverlap.fused.tma.tma_reduce_scatter does not exist in this checkout"
    params = inspect.signature(fn).parameters
    kw = {"scatter_dimension": 0} if "scatter_dimension" in params else {}
    if "comm_sms" in params:
        return lambda y, k: fn(y, "tp", comm_sms=k, **kw)
    if "config" in params:
        cfg = jaxoverlap.Config
        return lambda y, k: fn(y, "tp", config=cfg(backend="fused", comm_sms=k), **kw)
    return (
        f"jaxoverlap.fused.tma.tma_reduce_scatter{inspect.signature(fn)} takes no comm_sms/config"
    )


def measure_size(jax, mesh, tp, size_mb, args, seed, call):
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    nbytes = int(size_mb * 2**20)
    rows = nbytes // (2 * args.cols)
    if rows % tp or rows * 2 * args.cols != nbytes:
        sys.exit(f"{size_mb} MB is not a whole number of [{args.cols}] bf16 rows divisible by {tp}")
    gen = jax.jit(
        lambda k: jax.random.normal(k, (rows, args.cols * tp), jnp.float32).astype(jnp.bfloat16),
        out_shardings=NamedSharding(mesh, P(None, "tp")),
    )
    y = gen(jax.random.fold_in(jax.random.key(seed), rows))
    spec = (P(None, "tp"), P("tp", None))
    nccl = C.shard_map(lambda y: lax.psum_scatter(y, "tp", tiled=True), mesh, *spec)
    ref = nccl(y)

    @jax.jit
    def compare(out, ref):
        d = out.astype(jnp.float32) - ref.astype(jnp.float32)
        return jnp.max(jnp.abs(d)) / jnp.max(jnp.abs(ref.astype(jnp.float32))), jnp.mean(d == 0)

    row = {
        "size_MB": size_mb,
        "bytes": nbytes,
        "per_rank_shape": [rows, args.cols],
        "tp": tp,
        "dtype": "bfloat16",
        "tma": [],
        "notes": [],
    }
    fns = {"nccl": (nccl, (y,))}
    for k in args.sms if not isinstance(call, str) else []:
        cell = {"comm_sms": k, "ms": None, "busbw_GBs": None}
        try:
            f = C.shard_map(lambda y, k=k: call(y, k), mesh, *spec)
            hlo = f.lower(y).compile().as_text()
            cell["custom_calls"] = [
                t for t in C.custom_call_targets(hlo) if t.startswith("jaxoverlap")
            ]
            cell["kernel"] = (
                "stand-in"
                if args.smoke_stand_in
                else ("tma" if cell["custom_calls"] else "fallback")
            )
            if cell["kernel"] == "fallback":
                row["notes"].append(
                    f"comm_sms={k}: compiled without a jaxoverlap custom call (lax.psum_scatter)"
                )
            rel, same = (float(v) for v in compare(f(y), ref))
            cell["check"] = {"rel_err": rel, "bitwise_equal_fraction": same, "ok": rel <= TOL}
            if cell["check"]["ok"]:
                fns[f"tma_{k}"] = (f, (y,))
            else:
                row["notes"].append(f"comm_sms={k}: WRONG RESULT (rel err {rel:.3g}), not timed")
        except Exception as e:  # noqa: BLE001 - the reason is the result
            cell["error"] = f"{type(e).__name__}: {e}"
            row["notes"].append(f"comm_sms={k}: {cell['error']}")
        row["tma"].append(cell)
    res = C.bench(fns, samples=args.samples, target_ms=args.target_ms)

    def result(r):
        bw = nbytes * (tp - 1) / tp / (r["ms"] * 1e-3) / 1e9
        return {"ms": r["ms"], "busbw_GBs": bw, "iters": r["iters"], "samples_ms": r["samples_ms"]}

    row["nccl"] = result(res["nccl"])
    for cell in row["tma"]:
        if f"tma_{cell['comm_sms']}" in res:
            cell.update(result(res[f"tma_{cell['comm_sms']}"]))
    del y, ref
    return row


def gbs(v):
    return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.3g}"


def report(rows, tp, sms, stand_in, why_none):
    headers = ["MB/rank", "nccl GB/s", *(f"tma{k} GB/s" for k in sms), "best<=16 (sms)"]
    lines, best_all = [], []
    for r in rows:
        cells = {c["comm_sms"]: c for c in r["tma"]}
        small = [
            c
            for c in r["tma"]
            if c["busbw_GBs"]
            and c.get("kernel") != "fallback"
            and c["comm_sms"] <= TARGET["max_sms"]
        ]
        best = max(small, key=lambda c: c["busbw_GBs"], default=None)
        best_all.append(best["busbw_GBs"] if best else None)
        bws = [
            gbs(cells[k]["busbw_GBs"]) + ("*" if cells[k].get("kernel") == "fallback" else "")
            if k in cells
            else "-"
            for k in sms
        ]
        lines.append(
            [
                C.fmt(r["size_MB"], "g"),
                gbs(r["nccl"]["busbw_GBs"]),
                *bws,
                f"{gbs(best['busbw_GBs'])} ({best['comm_sms']})" if best else "-",
            ]
        )
    worst = min(best_all) if best_all and None not in best_all else None
    tag = " [stand-in: lax.psum_scatter]" if stand_in else ""
    text = "\n".join(
        [
            f"reduce-scatter bus bandwidth, GB/s (median), tp={tp}, bf16{tag}",
            C.table(headers, lines),
            f"TMA with <= {TARGET['max_sms']} SMs, worst size: {gbs(worst)} GB/s "
            f"(target >= {TARGET['busbw_GBs']:.0f}); NCCL: "
            + ", ".join(gbs(r["nccl"]["busbw_GBs"]) for r in rows)
            + " GB/s",
        ]
    )
    if any(c.get("kernel") == "fallback" for r in rows for c in r["tma"]):
        text += "\n* = not the TMA kernel: the call fell back to lax.psum_scatter"
    notes = ([f"  {why_none}"] if why_none else []) + [
        f"  {C.fmt(r['size_MB'], 'g')} MB: {C.short(n)}" for r in rows for n in r["notes"]
    ]
    return text + ("\nnotes:\n" + "\n".join(notes) if notes else ""), worst


def plot(rows, sms, path, title):
    def draw(ax):
        for i, r in enumerate(rows):
            pts = [(c["comm_sms"], c["busbw_GBs"]) for c in r["tma"] if c["busbw_GBs"]]
            color = f"C{i}"
            size = f"{r['size_MB']:g} MB"
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", color=color, label=f"TMA {size}")
            ax.axhline(r["nccl"]["busbw_GBs"], color=color, ls="--", lw=1, label=f"NCCL {size}")
        ax.axhline(TARGET["busbw_GBs"], color="k", ls=":", lw=1, label="target")
        ax.set_xlabel("comm SMs")
        ax.set_ylabel("bus bandwidth, GB/s")
        ax.set_xticks(list(sms))

    return C.save_plot(path, title, rows, (8, 4.5), draw)


def main(argv=None):
    args = parse_args(argv)
    seed = C.fresh_seed(args.seed)
    jax, mesh, tp, info = C.start(args, seed)
    call = tma_call(args.smoke_stand_in)
    why_none = call if isinstance(call, str) else None
    if why_none:
        print(f"TMA reduce-scatter UNAVAILABLE: {why_none}; measuring NCCL only", flush=True)

    def done(row):
        brief = {c["comm_sms"]: c["busbw_GBs"] for c in row["tma"]}
        print(
            json.dumps({"size_MB": row["size_MB"], "nccl": row["nccl"]["busbw_GBs"], "tma": brief})
        )

    rows, crashed = C.measure_rows(
        args.sizes_mb,
        lambda size: measure_size(jax, mesh, tp, size, args, seed, call),
        done,
        lambda size: f"{size:g} MB",
    )
    text, worst = report(rows, tp, args.sms, args.smoke_stand_in, why_none)
    doc = C.results_doc(
        info,
        tp,
        seed,
        args,
        busbw="bytes * (n - 1) / n / time",
        check_tolerance_rel=TOL,
        stand_in=args.smoke_stand_in,
        tma_unavailable=why_none,
        target=TARGET,
        worst_best_tma_busbw_GBs=worst,
        aborted=crashed,
        rows=rows,
    )
    C.save(args, "rs_bandwidth", info, tp, doc, text, functools.partial(plot, rows, args.sms))
    print(text)
    bad = [n for r in rows for n in r["notes"] if "WRONG RESULT" in n]
    if C.failed(bad, "; ", crashed):
        return 1
    if args.require_tma and (
        why_none or any(c["ms"] is None or c.get("kernel") != "tma" for r in rows for c in r["tma"])
    ):
        print("FAILED: --require-tma, but the TMA kernel did not run at every size and SM count")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
