"""The fused path of a column-parallel layer's backward (`jaxoverlap.ops.dgrad_rs_wgrad`).

For ``y = all_gather(x) @ w`` trained in both x and w, the backward needs
``dx = psum_scatter(ct @ w.T)`` and ``dW = all_gather(x).T @ ct``. XLA runs the reduce-scatter
between the two GEMMs with nothing beside it (measured: every collective of a TP layer's step is
exposed). The custom call ``jaxoverlap_dgrad_rs_wgrad_v3`` (ffi/handlers/dgrad_rs_wgrad.cc) runs
the dgrad GEMM
whole, pushes the peers' blocks of its result with the copy engine while the weight-gradient GEMM
runs, then sums what arrived: the reduce-scatter hides behind dW's GEMM and neither GEMM is split
(Transformer Engine's "bulk" overlap of the backward, without SMs for the communication).

Same contract as `jaxoverlap.fused.dispatch`: ``unsupported_reason`` at trace time, ``lower`` at
lowering time (raises `call.FusedUnavailable`).
"""

from __future__ import annotations

import math

import numpy as np
from jax._src import core

from jaxoverlap import runtime, topology, xproc
from jaxoverlap.fused import call, policy
from jaxoverlap.fused.targets import DGRAD_RS_WGRAD_ACC_TARGET as ACC_TARGET
from jaxoverlap.fused.targets import DGRAD_RS_WGRAD_TARGET as TARGET

# backend="auto" where untuned (not measured yet: a bandwidth model). The push of (n - 1) blocks
# of m x K (copy engine, ~390 GB/s) must fit under the wgrad GEMM (2 M K N flops, ~650 TFLOP/s):
# N >= ~930 at n = 2, ~1600 at n = 8 -- so N >= 2048; and blocks of >= 1M elements (2 MB), below
# which NCCL's reduce-scatter is latency-bound and cheap while the fused call's fixed costs stay.
_AUTO_MIN_N = 2048
_AUTO_MIN_BLOCK = 1 << 20


def unsupported_reason(ct, wt, params, axis_size):
    """None if the fused backward can run for ct[..., N] and w.T[N, K], else why not."""
    why = runtime.unavailable_reason()
    if why:
        return why
    if ct.dtype != wt.dtype or not any(ct.dtype == np.dtype(t) for t in policy._SUPPORTED):
        return f"the fused kernel supports bfloat16 and float16, not {ct.dtype}"
    d = params["scatter_dimension"]
    if d >= ct.ndim - 1:  # other dimensions: major-most in the call's layout (call.rows_major)
        return (
            f"the fused backward scatters blocks of rows of ct[..., N]; dimension {d} of "
            f"ct{tuple(ct.shape)} is N"
        )
    n = int(axis_size)
    if not 2 <= n <= topology.MAX_GROUP:
        return f"group size {n} is outside 2..{topology.MAX_GROUP}"
    n_cols, k = wt.shape
    rows = math.prod(ct.shape[:-1])
    if rows == 0 or rows % n:
        return f"the rows of ct ({rows}) are not a positive multiple of the group size {n}"
    block = rows // n * k
    if k % 8 or n_cols % 8 or block % 128:
        return f"K={k}, N={n_cols} must be multiples of 8 and rows/n x K of 128 elements"
    if params["config"].backend == "auto":
        entry = policy.measured(policy.BACKWARD, rows, k, n_cols, ct.dtype, n)
        if entry is not None:  # this machine's tuner measured this kernel for the shape
            return policy.entry_reason(entry, f"M={rows} K={k} N={n_cols} over {n} GPUs")
        if why := policy.new_kernels_reason():
            return why
    if params["config"].backend == "auto" and (n_cols < _AUTO_MIN_N or block < _AUTO_MIN_BLOCK):
        return (
            f"backend='auto': N={n_cols} and a block of {rows // n}x{k} are below the rule for the "
            f"fused backward (N >= {_AUTO_MIN_N}, blocks >= {_AUTO_MIN_BLOCK} elements)"
        )
    return None


def lower(ctx, ct, wt, g, *e, params):
    """The custom call; returns [dx, dW] (its third result, a scratch for ct @ w.T, is XLA's
    buffer: no memory held between calls). ``e``: the optional addend of ct @ w.T."""
    ct_aval, wt_aval, g_aval = ctx.avals_in[:3]
    table = call._group_table(ctx, params["axis_name"])
    rows = math.prod(ct_aval.shape[:-1])
    d = params["scatter_dimension"]
    major = lambda a: call.rows_major(a.shape, d)  # noqa: E731  (blocks of rows contiguous)
    spec = call.Spec(
        kind=(
            ACC_TARGET if e else TARGET,
            *call._operands_kind(ct_aval, wt_aval, params),
            tuple(g_aval.shape),
        ),
        comm_sms=0,
        chunks=1,
        timeout_s=params["config"].timeout_s,
        workspace=(
            xproc.spec_bytes(rows // table.n, wt_aval.shape[1], ct_aval.dtype),
            False,
            False,
        ),
        operand_layouts=(
            major(ct_aval),
            call.w_layout(params),
            major(g_aval),
            *(major(a) for a in ctx.avals_in[3:]),
        ),
        result_layouts=(major(ctx.avals_out[0]), (1, 0), (1, 0)),  # dx, dW, the scratch
        attrs=dict(w_colmajor=int(params["w_colmajor"])),
        scratch=(core.ShapedArray((rows, wt_aval.shape[1]), ct_aval.dtype),),
    )
    return call.emit(ctx, table, spec, ct, wt, g, *e)
