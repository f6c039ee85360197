"""Benchmark `jaxoverlap.all_gather_matmul` against XLA, following BENCHMARKS.md.

Per shape (M gathered rows x K x N_local, tp ranks; x [M/tp, K] per device, w [K, N_local]; with
`--along K`, x [M, K/tp] gathered along K, the contracted dimension), in one run on fresh random
bf16, timed round-robin (interleaved samples):
  xla          lax.all_gather(x, tiled) then jnp.matmul in shard_map (no overlap); timed first
  gemm_only    jnp.matmul of the gathered x [M, K] and w (the bound: communication fully hidden)
  ag_only      lax.all_gather alone (NCCL)
  jaxoverlap   all_gather_matmul with backend="fused" (null where the fused path cannot run);
               what backend="auto" picks is timed and reported beside it (auto=).
  gemm_part    (diagnostic) the fused op's GEMM schedule alone, without communication
  xla_again    xla once more, timed last: the row is flagged noisy if the two differ by > 5 %
Every result is checked against an f32 reference before it is timed. XLA's windowed einsum is not
timed here (see benchmarks/matmul_reduce_scatter.py for the reduce-scatter side).

  python benchmarks/all_gather_matmul.py                # BENCHMARKS.md AG shapes + layer shapes
  python benchmarks/all_gather_matmul.py --quick        # fewer, shorter samples
  python benchmarks/all_gather_matmul.py --cpu-smoke    # 2 fake CPU devices, tiny shapes
  python benchmarks/all_gather_matmul.py --along K      # x split over K (the JAX docs' layout)

Exit status: 0 when every measured result was correct; 1 when a check failed or an error stopped
the run (the JSON keeps the rows before it), or, with --require-fused, when the fused path did
not run.
"""

from __future__ import annotations

import sys

import _common as C
import _interleaved as I

# BENCHMARKS.md's all-gather -> matmul table, then column-parallel layers at tp = 2 with 8192
# tokens: QKV and fused gate+up of 8B- (d 4096, ffn 14336), 70B- (d 8192) and 405B-class
# (d 16384) models (N_local = output features / 2).
SHAPES = [
    (8192, 8192, 4096),
    (8192, 8192, 14336),
    (16384, 8192, 8192),
    (4096, 4096, 2048),
    (8192, 4096, 7168),
    (8192, 4096, 3072),  # 8B QKV (4096 + 2 x 1024)
    (8192, 4096, 14336),  # 8B gate+up (2 x 14336)
    (8192, 8192, 5120),  # 70B QKV (8192 + 2 x 1024)
    (8192, 16384, 9216),  # 405B QKV (16384 + 2 x 1024)
]
SMOKE_SHAPES = [(128, 64, 64), (256, 128, 64)]
METHODS = ("xla", "gemm_only", "ag_only", "jaxoverlap", "auto", "gemm_part", "xla_again")
BF16_TOL = 2e-2  # max |out - ref| / max |ref|, ref in f32


def parse_args(argv=None):
    shapes_help = "comma-separated MxKxN_local (M = gathered rows)"

    def along(p):
        p.add_argument("--along", choices=("rows", "K"), default="rows", help="what is gathered")

    return I.parse_args(
        argv, __doc__, "all_gather_matmul", SHAPES, SMOKE_SHAPES, shapes_help, extra=along
    )


def _x_spec(along):
    from jax.sharding import PartitionSpec as P

    return P("tp", None) if along == "rows" else P(None, "tp")


def make_inputs(jax, mesh, shape, tp, seed, along="rows"):
    """x [M, K] split over rows (or K), w [K, N_local * tp] split over N; random bf16."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    M, K, Nl = shape
    kx, kw = jax.random.split(jax.random.fold_in(jax.random.key(seed), M * 7 + K * 3 + Nl), 2)

    def gen(key, shp, spec, scale=1.0):
        f = jax.jit(
            lambda k: (jax.random.normal(k, shp, jnp.float32) * scale).astype(jnp.bfloat16),
            out_shardings=NamedSharding(mesh, spec),
        )
        return f(key)

    x = gen(kx, (M, K), _x_spec(along))
    w = gen(kw, (K, Nl * tp), P(None, "tp"), K**-0.5)
    return x, w, jax.device_put(x, NamedSharding(mesh, P()))  # gemm_only: gathered x everywhere


def error_fn(mesh, along="rows"):
    """(x, w, out) -> max |out - ref| / max |ref|, ref = all_gather(x) @ w in f32."""
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    def body(x, w, out):
        axis = 0 if along == "rows" else 1
        xg = lax.all_gather(x.astype(jnp.float32), "tp", axis=axis, tiled=True)
        ref = jnp.matmul(xg, w.astype(jnp.float32))
        err = lax.pmax(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)), "tp")
        return err / lax.pmax(jnp.max(jnp.abs(ref)), "tp")

    return C.shard_map(body, mesh, (_x_spec(along), P(None, "tp"), P(None, "tp")), P())


def jaxoverlap_fns(mesh, args):
    """backend -> jitted fn (+ the GEMM-only diagnostic), or a sentence saying why not."""
    from jax.sharding import PartitionSpec as P

    specs = ((_x_spec(args.along), P(None, "tp")), P(None, "tp"))
    knobs = {"chunks": args.chunks}
    dim = 0 if args.along == "rows" else 1
    return I.jaxoverlap_fns(mesh, args, "all_gather_matmul", *specs, knobs, gather_dimension=dim)


def measure_shape(jax, mesh, tp, shape, args, jo, seed):
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    M, K, Nl = shape
    x, w, xg = make_inputs(jax, mesh, shape, tp, seed, args.along)
    axis = 0 if args.along == "rows" else 1
    xw = (_x_spec(args.along), P(None, "tp"))
    gather = lambda x: lax.all_gather(x, "tp", axis=axis, tiled=True)  # noqa: E731
    xla = C.shard_map(lambda x, w: jnp.matmul(gather(x), w), mesh, xw, P(None, "tp"))
    gemm = C.shard_map(jnp.matmul, mesh, (P(), P(None, "tp")), P(None, "tp"))
    # the gathered copies side by side (the output is typed varying over tp)
    ag = C.shard_map(gather, mesh, xw[0], xw[0])
    err_f = error_fn(mesh, args.along)
    row = {"op": "all_gather_matmul", "tp": tp, "processes": 1, "dtype": "bfloat16", "M": M}
    dim = 0 if args.along == "rows" else "K"
    row.update(K=K, N_local=Nl, gather_dimension=dim, notes=[], check={}, iters={}, samples_ms={})
    check = lambda out: {"rel_err": (r := float(err_f(x, w, out))), "ok": r <= BF16_TOL}  # noqa
    row["check"]["xla"] = check(xla(x, w))
    row["check"]["gemm_only"] = check(gemm(xg, w))
    fns = {"xla": (xla, (x, w)), "gemm_only": (gemm, (xg, w)), "ag_only": (ag, (x,))}
    if isinstance(jo, str):
        row["notes"].append(jo)
    else:
        I.add_fused_methods(row, jo, fns, check, (x, w), args.smoke_stand_in)
    return I.time_interleaved(row, fns, METHODS, args)


def main(argv=None):
    args = parse_args(argv)
    title = (
        f"all_gather_matmul (along {args.along}), ms (median), tp={{tp}}, bf16; "
        "jo = backend='fused', gemm_part = its GEMM schedule without communication, "
        "auto= what 'auto' runs"
    )
    return I.main(
        args, "all_gather_matmul", lambda mesh: jaxoverlap_fns(mesh, args), measure_shape,
        METHODS, ("M", "K", "N_local"), "MxKxN_l", title, ["xla", "jaxoverlap", "auto", "ag_only"],
        tolerance=BF16_TOL, fused_config={"chunks": args.chunks},
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
