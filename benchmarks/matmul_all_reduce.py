"""Benchmark `jaxoverlap.matmul_all_reduce` (psum(x @ w)) against XLA, following BENCHMARKS.md.

Per shape (M x K_local x N, tp ranks; x [M, K_local] and w [K_local, N] per device, the [M, N]
sum on every device), in one run on fresh random bf16, timed round-robin (interleaved samples):
  xla          jnp.matmul then lax.psum in shard_map (no overlap): the anchor; timed first
  gemm_only    jnp.matmul of the local shards (the bound: communication fully hidden)
  ar_only      lax.psum of a random [M, N] partial per device alone (NCCL)
  jaxoverlap   matmul_all_reduce with backend="fused" (null where the fused path cannot run);
               what backend="auto" picks is timed and reported beside it (auto=).
  gemm_part    (diagnostic) the fused op's GEMM schedule alone, without communication
  xla_again    xla once more, timed last: the row is flagged noisy if the two differ by > 5 %
Every result is checked against an f32 reference on every device before it is timed. XLA's
windowed einsum does not apply to an all-reduce (null in the JSON).

  python benchmarks/matmul_all_reduce.py                # the BENCHMARKS.md shapes
  python benchmarks/matmul_all_reduce.py --quick        # fewer, shorter samples
  python benchmarks/matmul_all_reduce.py --cpu-smoke    # 2 fake CPU devices, tiny shapes

Exit status: 0 when every measured result was correct; 1 when a check failed or an error stopped
the run (the JSON keeps the rows before it), or, with --require-fused, when the fused path did
not run.
"""

from __future__ import annotations

import sys

import _common as C
import _interleaved as I
from matmul_reduce_scatter import make_inputs

SMOKE_SHAPES = [(64, 32, 48), (128, 64, 64)]
METHODS = ("xla", "gemm_only", "ar_only", "jaxoverlap", "auto", "gemm_part", "xla_again")
BF16_TOL = 2e-2  # max |out - ref| / max |ref|, ref in f32; bf16 rounds the partials and the sum


def parse_args(argv=None):
    return I.parse_args(
        argv, __doc__, "matmul_all_reduce", C.SHAPES, SMOKE_SHAPES, "comma-separated MxK_localxN",
        comm_sms=True,
    )  # fmt: skip


def error_fn(mesh):
    """(x, w, out) -> max |out - ref| / max |ref| over every device's copy of out, with
    ref = psum(x @ w) in f32."""
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    def body(x, w, out):
        ref = lax.psum(jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32)), "tp")
        err = lax.pmax(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)), "tp")
        return err / lax.pmax(jnp.max(jnp.abs(ref)), "tp")

    return C.shard_map(body, mesh, (P(None, "tp"), P("tp", None), P()), P())


def measure_shape(jax, mesh, tp, shape, args, jo, seed):
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    M, Kl, N = shape
    x, w, y = make_inputs(jax, mesh, shape, tp, seed)  # y: a random [M, N] partial per device
    xw = (P(None, "tp"), P("tp", None))
    xla = C.shard_map(lambda x, w: lax.psum(jnp.matmul(x, w), "tp"), mesh, xw, P())
    gemm = C.shard_map(jnp.matmul, mesh, xw, P(None, "tp"))
    ar = C.shard_map(lambda y: lax.psum(y, "tp"), mesh, P(None, "tp"), P())
    err_f = error_fn(mesh)
    row = {"op": "matmul_all_reduce", "tp": tp, "processes": 1, "dtype": "bfloat16", "M": M}
    row.update(K_local=Kl, N=N, notes=[], check={}, iters={}, samples_ms={})
    check = lambda out: {"rel_err": (r := float(err_f(x, w, out))), "ok": r <= BF16_TOL}  # noqa
    row["check"]["xla"] = check(xla(x, w))
    fns = {"xla": (xla, (x, w)), "gemm_only": (gemm, (x, w)), "ar_only": (ar, (y,))}
    if isinstance(jo, str):
        row["notes"].append(jo)
    else:
        I.add_fused_methods(row, jo, fns, check, (x, w), args.smoke_stand_in)
    row = I.time_interleaved(row, fns, METHODS, args)
    row["ms"]["xla_windowed"] = None  # BENCHMARKS.md's schema: not applicable here
    return row


def main(argv=None):
    from jax.sharding import PartitionSpec as P

    args = parse_args(argv)
    knobs = {"chunks": args.chunks, "comm_sms": args.comm_sms}
    specs = ((P(None, "tp"), P("tp", None)), P())
    title = (
        "matmul_all_reduce, ms (median), tp={tp}, bf16; jo = backend='fused', "
        "gemm_part = its GEMM schedule without communication, auto= what 'auto' runs"
    )
    return I.main(
        args, "matmul_all_reduce",
        lambda mesh: I.jaxoverlap_fns(mesh, args, "matmul_all_reduce", *specs, knobs),
        measure_shape, METHODS, ("M", "K_local", "N"), "MxK_lxN", title,
        ["xla", "jaxoverlap", "auto", "ar_only"], tolerance=BF16_TOL, fused_config=knobs,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
