"""Precision and time of the two layouts of a weight gradient's dot, on one device (issue 27).

``dW = sum over the leading dims of x [..., K] and ct [..., N]`` can be emitted as

* A: ``dot_general(x, ct)`` contracting the leading dims -> ``[K, N]`` (what the jaxoverlap ops'
  backward emits: `jaxoverlap.ops._common.contract_leading`), or
* B: ``dot_general(ct, x)`` -> ``[N, K]``, then a transpose (what JAX's own transpose of
  ``x @ w`` emits, so what the original program computes).

The rewrite by `jaxoverlap.overlap` moves a layer's dW from B to A. On XLA:CPU, with more than
one leading dim, B is ~10x less precise in bf16 (measured: 2.5e-3 vs 2.4e-2 relative error
against float32 at [4, 2048] x 256 x 512 and [2, 8192] x 512 x 256; equal with one leading dim).
This probe measures both on the device it runs on, at three layer shapes: relative error of the
bf16 result against the float32 dot of the same bf16 inputs (largest error / largest value), and
the time (round-robin samples of the two, interleaved; medians and spreads as BENCHMARKS.md
asks). It prints, per shape, which layout to keep: the more precise one unless the other is
faster beyond the noise rule (median lower by more than the larger spread and at least 2 %).

    python tools/probes/dw_layout_probe.py            # on a GPU machine; CPU works too (slow)
    python tools/probes/dw_layout_probe.py --small    # CPU-sized shapes
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# (leading dims of x and ct, K, N): a Llama-8B-like MLP's down projection at tp=2, its up
# projection, and a 70B-like attention output projection at tp=8.
SHAPES = (((2, 4096), 7168, 4096), ((4, 2048), 4096, 7168), ((1, 8192), 1024, 8192))
SMALL = (((4, 2048), 256, 512), ((2, 8192), 512, 256), ((16384,), 128, 128))


def layout_a(x, ct):
    lead = tuple(range(x.ndim - 1))
    return lax.dot_general(x, ct, ((lead, lead), ((), ())))


def layout_b(x, ct):
    lead = tuple(range(x.ndim - 1))
    return jnp.transpose(lax.dot_general(ct, x, ((lead, lead), ((), ()))))


def rel_err(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))


def timed(fns: dict, args, samples: int, reps: int) -> dict:
    """Round-robin samples (each `reps` calls, synchronised), per function: a list of ms."""
    for f in fns.values():
        jax.block_until_ready(f(*args))  # compiled and warm
    times = {k: [] for k in fns}
    for _ in range(samples):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                out = f(*args)
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) * 1e3 / reps)
    return times


def spread(ts):
    m = statistics.median(ts)
    return (max(ts) - min(ts)) / m


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="CPU-sized shapes")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}); jax {jax.__version__}")
    fns = {"A": jax.jit(layout_a), "B": jax.jit(layout_b)}
    ref_fn = jax.jit(lambda x, ct: layout_a(x.astype(jnp.float32), ct.astype(jnp.float32)))
    for lead, k, n in SMALL if args.small else SHAPES:
        k1, k2 = jax.random.split(jax.random.key(0))
        x = jax.random.normal(k1, (*lead, k), jnp.float32).astype(jnp.bfloat16)
        ct = jax.random.normal(k2, (*lead, n), jnp.float32).astype(jnp.bfloat16)
        with jax.default_matmul_precision("highest"):
            ref = ref_fn(x, ct)
        errs = {name: rel_err(f(x, ct).astype(jnp.float32), ref) for name, f in fns.items()}
        times = timed(fns, (x, ct), args.samples, args.reps)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        noise = max(max(spread(ts) for ts in times.values()), 0.02)
        precise = min(errs, key=errs.get)
        other = "B" if precise == "A" else "A"
        faster = med[other] < med[precise] * (1 - noise)
        keep = other if faster else precise
        print(
            f"x {lead}x{k}, ct {lead}x{n}: "
            + "  ".join(
                f"{name}: err {errs[name]:.2e}, {med[name]:.3f} ms "
                f"(spread {spread(times[name]):.1%})"
                for name in fns
            )  # fmt: skip
            + f"  -> keep {keep}"
            + (f" (the less precise one: faster by more than {noise:.1%})" if faster else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
