"""Measure the fused GEMM + reduce-scatter against XLA on the GPUs; sweep chunks and comm SMs.

A sweep for docs/measurements.md (the package's own tuner is `python -m jaxoverlap.tune`).
Same timing method as BENCHMARKS.md (jitted calls back to back, median of batches), random
bf16, every variant checked against XLA's result before it is timed. Also the standalone TMA
reduce-scatter's bus bandwidth by SM count against NCCL (``lax.psum_scatter``).

    python tools/tune_gemm_rs.py [--quick] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import fused
from jaxoverlap.fused import tma

# benchmarks/_common.py: the timing and shard_map helpers the benchmarks use.
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
)
import _common as C  # noqa: E402


def bench(f, *args):
    return C.median_ms(f, *args, iters=20, batches=5, warmups=2)


def gemm_rs_rows(mesh, tp, variants, shapes):
    rows = []
    for m, k_local, n in shapes:
        x, w = C.tools_gemm_inputs(mesh, (m, k_local, n), tp)
        specs = ((P(None, "tp"), P("tp", None)), P("tp", None))
        gemm = C.shard_map(jnp.matmul, mesh, specs[0], P(None, "tp"))

        def xla_body(x, w):
            return lax.psum_scatter(jnp.matmul(x, w), "tp", scatter_dimension=0, tiled=True)

        xla = C.shard_map(xla_body, mesh, *specs)
        y = gemm(x, w)
        rs = C.shard_map(
            lambda v: lax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True),
            mesh,
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
                f = C.shard_map(body, mesh, *specs)
                if gemm_only:  # the GEMM schedule on its partition, no communication
                    with fused._gemm_only_for_tools():
                        jax.block_until_ready(f(x, w))
                    fused_ms[name] = bench(f, x, w)
                    continue
                err = C.rel_err(f(x, w), ref)
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
        nccl = C.shard_map(
            lambda v: lax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True),
            mesh,
            P(None, "tp"),
            P("tp", None),
        )
        ref = nccl(y)
        t = bench(nccl, y)
        row = dict(MiB=nbytes / 2**20, nccl_ms=t, nccl_busbw=busbw(t))
        for k in sms_list:
            f = C.shard_map(
                lambda v, k=k: tma.tma_reduce_scatter(v, "tp", comm_sms=k),
                mesh,
                P(None, "tp"),
                P("tp", None),
            )
            try:
                err = C.rel_err(f(y), ref)
                if err > 1e-2:
                    row[f"tma_{k}"] = f"WRONG {err:.3g}"
                    continue
                t = bench(f, y)
                row[f"tma_{k}_ms"] = t
                row[f"tma_{k}_busbw"] = busbw(t)
                g = C.shard_map(
                    lambda v, k=k: tma.tma_reduce_scatter(v, "tp", comm_sms=k),
                    mesh,
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
    rows = [] if args.rs_only else gemm_rs_rows(mesh, tp, variants, C.SHAPES)
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
