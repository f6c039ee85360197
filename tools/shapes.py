"""Per-device GEMM shapes of the one-GPU probes (tools/probes/tile_rs_probe.cu, gpu_check.sh).

Prints one line per shape, ``<set> <tp> <M> <K> <N>``: x[M, K] @ w[K, N] on one device of a
tensor-parallel group of ``tp`` ranks, the product reduce-scattered over M (each rank keeps M / tp
rows). Sets:

- ``project``: the project's 10 probe shapes (docs/measurements.md runs 45-50), tp 2.
- ``layers``: per-device shares of real layers, M = tokens, K = the layer's input width / tp,
  N = d_model: the attention out-projection and the MLP down-projection of 8B-, 14B-, 70B- and
  405B-class models at tp 2, 4 and 8 (24 shares; 4k, 8k or 16k tokens, rotated over them).
- ``--seed S``: ``--draws`` new random shares of the same layers (set name: the seed), drawn with
  4k-16k tokens, for shapes the menu was never measured on.

Usage: python tools/shapes.py [--seed S] [--draws 12] [--sets project,layers]
"""

from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import _common  # noqa: E402  (the benchmark's shapes; imports nothing heavy)

# The benchmark's 5 shapes and the 5 the tile probe added (docs/measurements.md runs 45-50).
PROJECT = _common.SHAPES + [
    (8192, 2048, 4096),
    (8192, 7168, 4096),
    (8192, 8192, 16384),
    (16384, 3584, 4096),
    (4096, 8192, 14336),
]

# name: (d_model, attention width (heads x head_dim), MLP hidden width)
MODELS = {
    "8b": (4096, 4096, 14336),
    "14b": (5120, 5120, 13824),
    "70b": (8192, 8192, 28672),
    "405b": (16384, 16384, 53248),
}
TPS = (2, 4, 8)
TOKENS = (4096, 8192, 16384)


def layer_shares():
    """The 24 fixed shares: every model x layer x tp, the token count rotated."""
    rows, g = [], 0
    for d_model, attn, mlp in MODELS.values():
        for width in (attn, mlp):
            for i, tp in enumerate(TPS):
                rows.append(("layers", tp, TOKENS[(i + g) % len(TOKENS)], width // tp, d_model))
            g += 1
    return rows


def drawn_shares(seed, draws):
    """`draws` random shares: a model, a layer, a tp and 4k-16k tokens (multiples of 2048, so
    every rank's rows are a multiple of 256)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(draws):
        d_model, attn, mlp = MODELS[rng.choice(sorted(MODELS))]
        width = rng.choice((attn, mlp))
        tp = rng.choice(TPS)
        tokens = 2048 * rng.randint(2, 8)
        rows.append((str(seed), tp, tokens, width // tp, d_model))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", help="draw new random shares with this seed (e.g. a date)")
    p.add_argument("--draws", type=int, default=12)
    p.add_argument("--sets", default=None, help="comma-separated: project, layers")
    args = p.parse_args()
    sets = args.sets.split(",") if args.sets else ([] if args.seed else ["project", "layers"])
    rows = []
    if "project" in sets:
        rows += [("project", 2, m, k, n) for m, k, n in PROJECT]
    if "layers" in sets:
        rows += layer_shares()
    if args.seed:
        rows += drawn_shares(args.seed, args.draws)
    for row in rows:
        print(" ".join(str(v) for v in row))


if __name__ == "__main__":
    main()
