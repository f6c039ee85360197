"""One-GPU probe: what choosing cuBLASLt's algorithm by timing (ffi/runtime/gemm.cc) buys the GEMM
work of a fused tp = 2 reduce-scatter, against XLA's own (autotuned) GEMM of the whole shape.

For each M x K_local x N: XLA's jnp.dot [M, K] @ [K, N] (median of interleaved samples); the
runner's whole GEMM (whole device) with the heuristic's first choice and with the best of its
candidates; and the fused schedule's GEMM work on the green-context partition (comm_sms SMs left
out): per chunk c of the own row block (M / 2 rows), the foreign chunk (D = A.B) and the own
chunk (D = A.B + C), c of each, summed -- first choice vs best. Nothing communicates: this is
the GEMM floor of the fused op. Prints a table; JSON rows with --json PATH.

  python tools/probes/gemm_search_probe.py [--shapes layers|bench] [--json out.json]
"""

import argparse
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxoverlap import runtime

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import _common  # noqa: E402  (the benchmarks' shapes, not a copy of them)
from matmul_reduce_scatter import LAYER_SHAPES  # noqa: E402

BENCH = list(_common.SHAPES)
LAYERS = [s for s in LAYER_SHAPES if s not in BENCH]


def xla_ms(m, k, n, reps=20, samples=7):
    kx, kw = jax.random.split(jax.random.key(m * 7 + k * 3 + n))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.bfloat16)
    f = jax.jit(jnp.dot)
    f(x, w).block_until_ready()
    out = []
    for _ in range(samples):
        t = time.perf_counter()
        for _ in range(reps):
            y = f(x, w)
        y.block_until_ready()
        out.append((time.perf_counter() - t) * 1e3 / reps)
    return float(np.median(out))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="both", choices=["bench", "layers", "both"])
    p.add_argument("--comm-sms", default="4,8")
    p.add_argument("--json")
    a = p.parse_args()
    nat = runtime.native()
    shapes = {"bench": BENCH, "layers": LAYERS, "both": BENCH + LAYERS}[a.shapes]
    rows = []
    print(
        f"{'M x K x N':>20} {'xla':>7} {'top1':>7} {'best':>7} | "
        f"{'sms':>3} {'c':>1} {'sched1':>7} {'schedB':>7} {'s1/xla':>6} {'sB/xla':>6}"
    )
    for m, k, n in shapes:
        x = xla_ms(m, k, n)
        _, whole = nat._gemm_candidates(0, m, n, k, False, 0)
        row = dict(
            m=m,
            k=k,
            n=n,
            xla_ms=x,
            whole_first_ms=whole[0],
            whole_best_ms=min(whole),
            whole_candidates=whole,
            sched=[],
        )
        print(f"{m:>6}x{k:>6}x{n:>6} {x:7.3f} {whole[0]:7.3f} {min(whole):7.3f} |")
        for sms in [int(s) for s in a.comm_sms.split(",")]:
            for c in (1, 2, 4):
                mc = m // 2 // c
                gemm_sms, fo = nat._gemm_candidates(0, mc, n, k, False, sms)
                _, own = nat._gemm_candidates(0, mc, n, k, True, sms)
                first = c * (fo[0] + own[0])
                best = c * (min(fo) + min(own))
                row["sched"].append(
                    dict(
                        comm_sms=sms,
                        gemm_sms=gemm_sms,
                        chunks=c,
                        first_ms=first,
                        best_ms=best,
                        foreign=fo,
                        own=own,
                    )
                )
                print(
                    f"{'':>20} {'':>7} {'':>7} {'':>7} | {sms:>3} {c:>1} {first:7.3f} "
                    f"{best:7.3f} {first / x:6.3f} {best / x:6.3f}"
                )
        rows.append(row)

    def geomean(key):  # the best setting (comm_sms, chunks) of each shape, over XLA's GEMM
        logs = [math.log(min(s[key] for s in r["sched"]) / r["xla_ms"]) for r in rows]
        return math.exp(float(np.mean(logs)))

    print(
        f"geomean sched/xla (best setting per shape): first choice {geomean('first_ms'):.3f}, "
        f"best candidate {geomean('best_ms'):.3f}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
