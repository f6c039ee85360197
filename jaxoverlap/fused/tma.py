"""The standalone TMA reduce-scatter (private-ish API, for the bandwidth benchmark and tools):
``lax.psum_scatter`` by jaxoverlap's communication kernel, the one the fused GEMM + reduce-scatter
uses for its communication side. Its call is emitted by `jaxoverlap.fused.call.emit`, as every
fused call is."""

from __future__ import annotations

import math

import numpy as np
from jax import lax
from jax._src import core
from jax.interpreters import mlir

from jaxoverlap.config import DEFAULT_TIMEOUT_S, check_timeout
from jaxoverlap.fused import call, policy
from jaxoverlap.fused.targets import RS_TARGET

DEFAULT_RS_COMM_SMS = 16

tma_reduce_scatter_p = core.Primitive("jaxoverlap_tma_reduce_scatter")


def tma_reduce_scatter(
    x,
    axis_name,
    *,
    scatter_dimension=0,
    comm_sms=DEFAULT_RS_COMM_SMS,
    chunks=None,
    timeout_s=DEFAULT_TIMEOUT_S,
):
    """``lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)`` with jaxoverlap's TMA
    kernel (private-ish; for the bandwidth benchmark). Call inside ``jax.shard_map`` on GPUs.

    Two ranks: each of ``comm_sms`` CTAs seeds its part of the own block into a staging
    accumulator, adds its part of the peer's block into the peer's accumulator with TMA bulk adds
    over NVLink (one add per element, so bitwise repeatable), and copies the finished accumulator
    out. More ranks: half of the CTAs push each rank's blocks to their owners with TMA, the other
    half sum the arrived chunks in rank order (bitwise repeatable). bf16/f16 only; the
    block of each rank must split into ``chunks`` multiples of 16 bytes. Off CUDA (or for other
    dtypes) this is plain ``lax.psum_scatter``.
    """
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if scatter_dimension != 0:
        raise ValueError("tma_reduce_scatter: only scatter_dimension=0 is supported")
    missing = tuple(a for a in names if a not in core.typeof(x).mat.varying)
    if missing:
        x = core.pvary(x, missing)
    timeout_s = check_timeout("tma_reduce_scatter", timeout_s)
    return tma_reduce_scatter_p.bind(
        x, axis_name=names, comm_sms=int(comm_sms), chunks=chunks, timeout_s=timeout_s
    )


def _rs_abstract(x, *, axis_name, comm_sms, chunks, timeout_s):
    del comm_sms, chunks, timeout_s
    n = math.prod(core.get_axis_env().axis_size(a) for a in axis_name)
    if x.ndim < 1 or x.shape[0] % n:
        raise ValueError(
            f"tma_reduce_scatter: dimension 0 of x{tuple(x.shape)} must be divisible by the "
            f"group size {n} of axis {axis_name}"
        )
    return x.update(shape=(x.shape[0] // n, *x.shape[1:]))


def _rs_reference(ctx, x, *, axis_name, comm_sms, chunks, timeout_s):
    del comm_sms, chunks, timeout_s
    fn = lambda v: lax.psum_scatter(v, axis_name, scatter_dimension=0, tiled=True)  # noqa: E731
    return mlir.lower_fun(fn, multiple_results=False)(ctx, x)


def _rs_cuda(ctx, x, *, axis_name, comm_sms, chunks, timeout_s):
    (aval,) = ctx.avals_in
    if not any(aval.dtype == np.dtype(t) for t in policy._SUPPORTED):
        return _rs_reference(
            ctx, x, axis_name=axis_name, comm_sms=comm_sms, chunks=chunks, timeout_s=timeout_s
        )
    table = call._group_table(ctx, axis_name)
    block_bytes = aval.size * aval.dtype.itemsize // table.n
    if block_bytes % 16:
        raise ValueError(
            f"tma_reduce_scatter: each rank's block ({block_bytes} bytes of x{tuple(aval.shape)}) "
            f"must be a multiple of 16 bytes for TMA"
        )
    if chunks is None:
        chunks = next(c for c in (16, 8, 4, 2, 1) if block_bytes % (16 * c) == 0)
    row = tuple(reversed(range(aval.ndim)))  # row-major, as jax.ffi.ffi_lowering's default
    spec = call.Spec(
        kind=(RS_TARGET, tuple(aval.shape), str(aval.dtype)),
        comm_sms=comm_sms,
        chunks=chunks,
        timeout_s=timeout_s,
        workspace=(block_bytes, False, False),
        operand_layouts=(row,),
        result_layouts=(row,),
    )
    return call.emit(ctx, table, spec, x)


tma_reduce_scatter_p.def_effectful_abstract_eval(
    lambda x, **params: (_rs_abstract(x, **params), call.fused_effects())
)
mlir.register_lowering(tma_reduce_scatter_p, _rs_reference)
mlir.register_lowering(tma_reduce_scatter_p, _rs_cuda, platform="cuda", cacheable=False)
