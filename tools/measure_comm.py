"""Compact A/B measurement of jaxoverlap's communication paths on 2 GPUs (one process).

* standalone TMA reduce-scatter: reduce-push (default at n = 2) vs the senders/receivers
  schedule (profile 2), and NCCL (``lax.psum_scatter``), bus bandwidth in GB/s;
* fused GEMM + reduce-scatter (TMA sender kernel, 4 comm SMs) by chunk count, against
  ``gemm_only`` (the GEMM alone) and ``xla`` (GEMM + psum_scatter), ms.

Every variant is checked against the XLA result before it is timed. Stops starting new items
once ``--budget-s`` is spent (prints what it has).

    python tools/measure_comm.py [--budget-s 70] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

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

RS_MB = (64, 256)
SHAPES = [  # most communication-bound first (the budget may cut the list)
    (8192, 4096, 8192),
    (2048, 8192, 8192),
    (16384, 8192, 8192),
    (4096, 4096, 4096),
    (8192, 14336, 8192),
]


@contextlib.contextmanager
def profile(value):
    token = fused._profile.set(value)
    try:
        yield
    finally:
        fused._profile.reset(token)


def bench(f, *args):
    return C.median_ms(f, *args, iters=10, batches=3)


def timed(name, row, fn, ref, args, prof=0, tol=2e-2):
    try:
        with profile(prof):  # the lowering reads the profile value
            out = fn(*args)
        if ref is not None:
            err = C.rel_err(out, ref)
            if err > tol:
                row[name] = f"WRONG rel err {err:.3g}"
                return None
        row[name] = round(bench(fn, *args), 4)
        return row[name]
    except Exception as e:  # report, keep measuring
        row[name] = f"{type(e).__name__}: {str(e)[:300]}"
        return None


def rs_rows(mesh, tp, deadline):
    rows = []
    for mb in RS_MB:
        if time.monotonic() > deadline:
            break
        cols = 4096
        m = mb * 2**20 // 2 // (cols * tp) * tp
        y = jax.device_put(
            jax.random.normal(jax.random.key(mb), (m, cols * tp), jnp.bfloat16),
            NamedSharding(mesh, P(None, "tp")),
        )
        nbytes = m * cols * 2
        busbw = lambda t, nb=nbytes: round(nb * (tp - 1) / tp / (t * 1e-3) / 1e9, 1)  # noqa: E731
        spec = (P(None, "tp"), P("tp", None))
        nccl = C.shard_map(
            lambda v: lax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True), mesh, *spec
        )
        ref = nccl(y)
        row = dict(MiB=mb)
        t = timed("nccl_ms", row, nccl, None, (y,))
        row["nccl_GBs"] = busbw(t) if t else None
        for k, prof in ((4, 0), (8, 0), (16, 0), (16, 2)):
            if time.monotonic() > deadline:
                break
            name = f"{'staged' if prof else 'rpush'}_{k}"
            f = C.shard_map(lambda v, k=k: tma.tma_reduce_scatter(v, "tp", comm_sms=k), mesh, *spec)
            t = timed(name + "_ms", row, f, ref, (y,), prof, tol=1e-2)
            row[name + "_GBs"] = busbw(t) if t else None
        if not isinstance(row.get("rpush_16_ms"), str):  # bitwise repeatable
            f = C.shard_map(lambda v: tma.tma_reduce_scatter(v, "tp", comm_sms=16), mesh, *spec)
            row["rpush_16_repeatable"] = bool(np.array_equal(np.asarray(f(y)), np.asarray(f(y))))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def gemm_rs_rows(mesh, tp, deadline, variants, baselines):
    rows = []
    for m, k_local, n in SHAPES:
        if time.monotonic() > deadline:
            break
        x, w = C.tools_gemm_inputs(mesh, (m, k_local, n), tp)
        specs = ((P(None, "tp"), P("tp", None)), P("tp", None))
        gemm = C.shard_map(jnp.matmul, mesh, specs[0], P(None, "tp"))
        xla = C.shard_map(
            lambda x, w: lax.psum_scatter(jnp.matmul(x, w), "tp", scatter_dimension=0, tiled=True),
            mesh,
            *specs,
        )
        ref = xla(x, w)
        row = dict(shape=f"{m}x{k_local}x{n}")
        if baselines:
            timed("gemm_only", row, gemm, None, (x, w))
            timed("xla", row, xla, None, (x, w))
        for chunks in variants:
            if time.monotonic() > deadline:
                break
            cfg = jaxoverlap.Config(backend="fused", chunks=chunks, comm_sms=4)
            f = C.shard_map(
                lambda x, w, cfg=cfg: jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg),
                mesh,
                *specs,
            )
            timed(f"c{chunks}_s4", row, f, ref, (x, w))
        if isinstance(row.get("gemm_only"), float):
            for key in [f"c{c}_s4" for c in variants]:
                if isinstance(row.get(key), float):
                    row[key + "/gemm"] = round(row[key] / row["gemm_only"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=70.0)
    ap.add_argument("--json")
    ap.add_argument("--skip-rs", action="store_true")
    ap.add_argument("--skip-gemm", action="store_true")
    ap.add_argument("--chunks", default="2,4", help="chunk counts of the fused runs")
    ap.add_argument("--no-baselines", action="store_true", help="skip gemm_only and xla")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes (script check only)")
    args = ap.parse_args()
    if args.cpu_smoke:
        global RS_MB, SHAPES
        RS_MB, SHAPES = (1,), [(256, 128, 256)]
    t0 = time.monotonic()
    devs = jax.devices()
    tp = 2
    mesh = Mesh(np.array(devs[:tp]), ("tp",))
    print(f"jax {jax.__version__} {devs[0].device_kind} x{len(devs)}", flush=True)
    rs = [] if args.skip_rs else rs_rows(mesh, tp, t0 + args.budget_s * 0.5)
    variants = [int(c) for c in args.chunks.split(",")]
    rows = (
        []
        if args.skip_gemm
        else gemm_rs_rows(mesh, tp, t0 + args.budget_s, variants, not args.no_baselines)
    )
    print(f"done in {time.monotonic() - t0:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=devs[0].device_kind, rs=rs, gemm_rs=rows), f, indent=1)


if __name__ == "__main__":
    main()
