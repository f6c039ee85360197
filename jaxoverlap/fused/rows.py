"""The schedules over blocks of rows of the flattened ``[..., K]`` x -- the scattered or gathered
dimension, any but the last, made major-most by the custom call's layout (`call.rows_major`):

* ``matmul_reduce_scatter``: the chunked GEMM + reduce-scatter (an SM partition pushes by TMA,
  jaxoverlap_gemm_rs_v3), with ``comm_sms=0`` the copy engine pushes (jaxoverlap_gemm_rs_ce_v3),
  or the tile schedule (`jaxoverlap.fused.tile`);
* ``matmul_all_reduce`` as one call (jaxoverlap_gemm_ar_v3, ffi/handlers/gemm_rs.cc): the fused
  reduce-scatter over rows, and as each reduced chunk of this rank's rows is done, the copy
  engine pushes it to every peer (no SMs), which copies it into its output. Both halves of the
  all-reduce's traffic overlap the GEMMs; every rank holds the owners' rows verbatim (bitwise
  equal outputs). Its settings and the decision are the tuner's for this op and shape;
* ``all_gather_matmul`` (copy-engine pushes, jaxoverlap_ag_gemm_v3), and its variant that also
  returns the gathered x (jaxoverlap_ag_gemm_keep_v3, the training path's forward).

The settings come from `jaxoverlap.fused.policy`; the call is emitted by `call.emit`.
"""

from __future__ import annotations

from jaxoverlap import xproc
from jaxoverlap.fused import call, policy, targets, tile


def gather_target(keep_gathered):
    """all_gather_matmul over rows: its FFI target (``keep_gathered``: the variant that also
    returns the gathered x)."""
    return targets.AG_GEMM_KEEP_TARGET if keep_gathered else targets.AG_GEMM_TARGET


def lower_gather(ctx, x, w, params, table, keep_gathered):
    """all_gather_matmul over rows; ``keep_gathered``: the variant that also returns x."""
    x_aval, w_aval = ctx.avals_in
    m, k, n_cols = policy._rows(x_aval.shape), x_aval.shape[-1], w_aval.shape[1]
    chunks = policy.ag_rows_chunks(params["config"], m, k, n_cols, x_aval.dtype, table.n)
    target = gather_target(keep_gathered)
    workspace = (xproc.spec_bytes(m, k, x_aval.dtype), False, False)  # x's block
    spec = call.row_spec(ctx, params, target, 0, chunks, workspace)
    return call.emit(ctx, table, spec, x, w)


def lower_scatter(op, ctx, x, w, params, table):
    """matmul_reduce_scatter over rows, or (``op`` matmul_all_reduce) the all-reduce."""
    x_aval, w_aval = ctx.avals_in
    m_total, k, n_cols = policy._rows(x_aval.shape), x_aval.shape[-1], w_aval.shape[1]
    target, chunks, comm_sms = policy.rows_setting(
        op, params["config"], m_total, k, n_cols, x_aval.dtype, table.n
    )
    if target == targets.GEMM_RS_TILE_TARGET:
        return tile.lower(ctx, x, w, params, table)
    block = xproc.spec_bytes(m_total // table.n, n_cols, x_aval.dtype)  # the output's block
    workspace = (block, True, target == targets.GEMM_AR_TARGET)
    return call.emit(
        ctx, table, call.row_spec(ctx, params, target, comm_sms, chunks, workspace), x, w
    )
