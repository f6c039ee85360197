"""Measure the fused GEMM + reduce-scatter against XLA on the GPUs; sweep chunks and comm SMs.

Feeds `jaxoverlap.fused.MEASURED_SETTINGS` and docs/measurements.md. Same timing method as
BENCHMARKS.md (jitted calls back to back, median of batches), random bf16, every variant checked
against XLA's result before it is timed. Also the standalone TMA reduce-scatter's bus bandwidth
by SM count against NCCL (``lax.psum_scatter``).

    python tools/tune_gemm_rs.py [--quick] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import fused

SHAPES = [
    (8192, 4096, 8192),
    (8192, 14336, 8192),
    (16384, 8192, 8192),
    (4096, 4096, 4096),
    (2048, 8192, 8192),
]


def bench(f, *args, iters=20, batches=5):
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / iters * 1e3)
    return statistics.median(ts)


def smap(mesh, body, in_specs, out_specs):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def rel_err(a, b):
    a = np.asarray(a.astype(jnp.float32))
    b = np.asarray(b.astype(jnp.float32))
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def gemm_rs_rows(mesh, tp, variants, shapes):
    rows = []
    for m, k_local, n in shapes:
        kx, kw = jax.random.split(jax.random.key(m + k_local + n))
        k = k_local * tp
        x = jax.device_put(
            jax.random.normal(kx, (m, k), jnp.bfloat16), NamedSharding(mesh, P(None, "tp"))
        )
        w = jax.device_put(
            (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16),
            NamedSharding(mesh, P("tp", None)),
        )
        specs = ((P(None, "tp"), P("tp", None)), P("tp", None))
        gemm = smap(mesh, jnp.matmul, specs[0], P(None, "tp"))

        def xla_body(x, w):
            return lax.psum_scatter(jnp.matmul(x, w), "tp", scatter_dimension=0, tiled=True)

        xla = smap(mesh, xla_body, *specs)
        y = gemm(x, w)
        rs = smap(
            mesh,
            lambda v: lax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True),
            P(None, "tp"),
            P("tp", None),
        )
        ref = xla(x, w)
        row = dict(M=m, K_local=k_local, N=n, tp=tp, dtype="bfloat16")
        ms = dict(gemm_only=bench(gemm, x, w), xla=bench(xla, x, w), rs_only=bench(rs, y))
        fused_ms = {}
        for chunks, comm, gemm_only in variants:
            auto = chunks is None
            cfg = jaxoverlap.Config(
                backend="auto" if auto else "fused", chunks=chunks, comm_sms=comm
            )

            def body(x, w, cfg=cfg):
                return jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg)

            name = "auto" if auto else f"{'gemmonly_' if gemm_only else ''}c{chunks}_s{comm}"
            try:
                f = smap(mesh, body, *specs)
                if gemm_only:  # the GEMM schedule on its partition, no communication
                    with fused._gemm_only_for_tools():
                        jax.block_until_ready(f(x, w))
                    fused_ms[name] = bench(f, x, w)
                    continue
                err = rel_err(f(x, w), ref)
                if err > 2e-2:
                    fused_ms[name] = f"WRONG rel err {err:.3g}"
                    continue
                fused_ms[name] = bench(f, x, w)
            except Exception as e:  # report, keep measuring the other variants
                fused_ms[name] = f"{type(e).__name__}: {str(e)[:200]}"
        row["ms"] = ms
        row["fused_ms"] = fused_ms
        timed = {
            k: v
            for k, v in fused_ms.items()
            if isinstance(v, float) and "gemmonly" not in k and k != "auto"
        }
        if timed:
            best = min(timed, key=timed.get)
            row["best"] = best
            ms["jaxoverlap"] = timed[best]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def rs_rows(mesh, tp, sms_list, sizes_mb):
    rows = []
    for mb in sizes_mb:
        cols = 4096
        m = mb * 2**20 // 2 // (cols * tp) * tp
        y = jax.device_put(
            jax.random.normal(jax.random.key(mb), (m, cols * tp), jnp.bfloat16),
            NamedSharding(mesh, P(None, "tp")),
        )
        nbytes = m * cols * 2  # per rank input
        busbw = lambda t, nb=nbytes: nb * (tp - 1) / tp / (t * 1e-3) / 1e9  # noqa: E731
        nccl = smap(
            mesh,
            lambda v: lax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True),
            P(None, "tp"),
            P("tp", None),
        )
        ref = nccl(y)
        t = bench(nccl, y)
        row = dict(MiB=nbytes / 2**20, nccl_ms=t, nccl_busbw=busbw(t))
        for k in sms_list:
            f = smap(
                mesh,
                lambda v, k=k: fused.tma_reduce_scatter(v, "tp", comm_sms=k),
                P(None, "tp"),
                P("tp", None),
            )
            try:
                err = rel_err(f(y), ref)
                if err > 1e-2:
                    row[f"tma_{k}"] = f"WRONG {err:.3g}"
                    continue
                t = bench(f, y)
                row[f"tma_{k}_ms"] = t
                row[f"tma_{k}_busbw"] = busbw(t)
                g = smap(
                    mesh,
                    lambda v, k=k: fused.tma_reduce_scatter(v, "tp", comm_sms=k),
                    P(None, "tp"),
                    P("tp", None),
                )
                with fused._gemm_only_for_tools():  # push only, on k / 2 CTAs
                    jax.block_until_ready(g(y))
                row[f"push_only_{k // 2}cta_busbw"] = busbw(bench(g, y))
            except Exception as e:
                row[f"tma_{k}"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--skip-rs", action="store_true")
    ap.add_argument("--rs-only", action="store_true")
    args = ap.parse_args()
    devs = jax.devices()
    tp = 2
    mesh = Mesh(np.array(devs[:tp]), ("tp",))
    print(f"jax {jax.__version__} {devs[0].device_kind} x{len(devs)}", flush=True)
    variants = [(2, 4, False), (4, 4, False), (2, 8, False), (2, 4, True), (None, None, False)]
    if args.quick:
        variants = [(2, 8, False), (2, 4, False)]
    rs = [] if args.skip_rs else rs_rows(mesh, tp, [8, 16, 32], [64, 256])
    rows = [] if args.rs_only else gemm_rs_rows(mesh, tp, variants, SHAPES)
    print("\nshape               gemm    xla     rs   fused(best)  fused/gemm  xla/fused  best")
    for r in rows:
        ms = r["ms"]
        jo = ms.get("jaxoverlap")
        print(
            f"{r['M']}x{r['K_local']}x{r['N']:<6} {ms['gemm_only']:7.3f} {ms['xla']:6.3f} "
            f"{ms['rs_only']:6.3f} {jo if jo is None else f'{jo:9.3f}'}   "
            f"{'-' if jo is None else f'{jo / ms["gemm_only"]:.3f}':>8}  "
            f"{'-' if jo is None else f'{ms["xla"] / jo:.3f}':>8}  {r.get('best')}"
        )
    for r in rs:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=devs[0].device_kind, gemm_rs=rows, rs=rs), f, indent=1)


if __name__ == "__main__":
    main()
