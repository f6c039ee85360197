"""The ops over the last dimension, fused: `matmul_reduce_scatter` scattering N (the GEMM's
columns) and `all_gather_matmul` gathering K (the contracted dimension).

Tensor-parallel code often keeps activations sharded over features: the JAX shard_map tutorial's
and the scaling book's layers scatter the last dimension. The row-scatter kernel runs it as the
transposed problem, ``out.T = w.T @ x.T``, whose row blocks are ``out``'s column blocks, with no
copy on either side of the call:

* ``w.T`` [N, K] is ``w`` read column-major (operand layout ``{0,1}``: XLA passes w as is), or,
  when w is itself the transpose of a row-major array (``w_colmajor``, as in a backward's
  ``ct @ w.T``), that array read row-major;
* ``x.T`` [K, M] is ``x`` ([..., K] flattened to [M, K], row-major) read column-major;
* the custom call is jaxoverlap_gemm_rs_v3 with ``x_colmajor=1``: its A operand (``w.T``) is
  column-major, a rank's row block is a block of it with leading dimension N
  (ffi/handlers/gemm_rs.cc);
* its result, ``out.T`` [N / n, M] row-major, is declared as ``out`` [M, N / n] column-major, so
  XLA copies it only where a consumer needs row-major (an elementwise consumer reads it as is).

Everything else -- the schedule, the workspace, the failure path, the tuner's settings (looked up
for the transposed GEMM, N x K x M) -- is the row-scatter's.

Gathering K (``all_gather(x, axis=-1) @ w``, x [..., K / n], the JAX docs' layout) is
``sum_p x_p @ w[K-block p]``: jaxoverlap_ag_gemm_k_v3 (ffi/handlers/ag_gemm.cc) pushes the blocks
by copy
engine as the row gather does, starts with the own block's GEMM at once and adds each arriving
block's GEMM into a float32 scratch (an extra XLA result, no memory held between calls), rounded
once at the end -- as XLA's single GEMM rounds once, not once per block. Forward only: the
variant that also returns the gathered x (a trained weight's dW) is not fused along K.
"""

from __future__ import annotations

import math

import numpy as np
from jax._src import core
from jax._src.interpreters import mlir
from jax._src.lib.mlir.dialects import hlo

from jaxoverlap import xproc
from jaxoverlap.fused import call, policy
from jaxoverlap.fused.targets import AG_K_TARGET, GEMM_RS_TARGET

MIN_CHUNK_ROWS = 128  # a chunk's first row of the column-major w.T stays 256-byte aligned


def choose_chunks(m, k, n_cols, requested=None):
    """`policy.choose_chunks` for the transposed problem (``m`` = N / n rows per rank, ``n_cols``
    = M), with rows per chunk a multiple of 128 (A column-major: each chunk starts 2 x rows
    bytes into it)."""
    options = (requested,) if requested else (4, 2, 1)
    for c in options:
        c = policy.choose_chunks(m, k, n_cols, c)
        if c and (m // c) % MIN_CHUNK_ROWS == 0:
            return c
    return None


def unsupported_reason(x, w, params, n, target=None):
    """Why the last-dimension reduce-scatter of ``x @ w`` cannot run fused, or None."""
    m_total, k, n_cols = math.prod(x.shape[:-1]), x.shape[-1], w.shape[1]
    if not (m_total and k and n_cols):
        return f"an empty operand: x{tuple(x.shape)}, w{tuple(w.shape)}"
    if n_cols % n:
        return f"N={n_cols} (the scattered last dimension) is not divisible by the group size {n}"
    if k % 8 or m_total % 8:
        return f"K={k} and the rows of x ({m_total}) must be multiples of 8"
    config = params["config"]
    if choose_chunks(n_cols // n, k, m_total, config.chunks) is None:
        return (
            f"alignment: the scattered dimension's block per rank ({n_cols // n}) must split "
            f"into chunks of a multiple of {MIN_CHUNK_ROWS} rows (the transposed problem)"
        )
    comm_sms = config.comm_sms or policy.DEFAULT_COMM_SMS
    if config.comm_sms == 0:
        return "the copy-engine reduce-scatter (comm_sms=0) does not scatter the last dimension"
    if comm_sms > 64:
        return f"comm_sms={comm_sms} leaves too few SMs for the GEMM"
    if config.backend == "auto":
        what = "the last dimension, through the transposed problem"
        rule = ("matmul_reduce_scatter", n_cols, k, m_total)
        return policy.gated_auto_reason(
            policy.LAST_DIM, what, rule, m_total, k, n_cols, x.dtype, n, target
        )
    return None


def unsupported_reason_k(x, w, params, n, target=None):
    """Why the all-gather along K of ``all_gather(x, -1) @ w`` cannot run fused, or None."""
    m_total, k, n_cols = math.prod(x.shape[:-1]), w.shape[0], w.shape[1]
    if not (m_total and k and n_cols):
        return f"an empty operand: x{tuple(x.shape)}, w{tuple(w.shape)}"
    if k % 8 or n_cols % 8 or (k // n) % 8:
        return f"K={k}, K / n={k // n} and N={n_cols} must be multiples of 8"
    kl = k // n
    # Every source's operands 256-byte aligned like the own block's (the handler's warm-up picks
    # the GEMM plans for one source only): x blocks in the staging slots, w's rows of each block.
    w_block = kl if params.get("w_colmajor") else kl * n_cols
    if (m_total * kl) % 128 or w_block % 128:
        return (
            f"alignment: rows x K / n ({m_total} x {kl}) and w's block of K / n rows must be "
            f"multiples of 128 elements"
        )
    config = params["config"]
    if config.backend == "auto":
        rule = ("all_gather_matmul", m_total, k, n_cols)
        return policy.gated_auto_reason(
            policy.ALONG_K, "the all-gather along K", rule, m_total, k, n_cols, x.dtype, n, target
        )
    return None


def lower_k(ctx, x, w, params, table, keep_gathered):
    """The custom call of the all-gather along K: x as is, w row- or column-major, results
    out [..., N] and the float32 scratch (dropped)."""
    if keep_gathered:
        raise call.FusedUnavailable(
            "along K, the all-gather that also returns x (for a trained weight's dW) is not fused"
        )
    x_aval, w_aval = ctx.avals_in
    m_total, kl = math.prod(x_aval.shape[:-1]), x_aval.shape[-1]
    row = lambda a: tuple(reversed(range(a.ndim)))  # noqa: E731  (minor-to-major)
    spec = call.Spec(
        kind=(AG_K_TARGET, *call._operands_kind(x_aval, w_aval, params)),
        comm_sms=0,
        chunks=1,
        timeout_s=params["config"].timeout_s,
        workspace=(xproc.spec_bytes(m_total, kl, x_aval.dtype), False, False),  # x's block
        operand_layouts=(row(x_aval), call.w_layout(params)),
        result_layouts=(*(row(a) for a in ctx.avals_out), (1, 0)),
        attrs=dict(w_colmajor=int(params["w_colmajor"])),
        scratch=(core.ShapedArray((m_total, w_aval.shape[1]), np.float32),),
    )
    return call.emit(ctx, table, spec, x, w)


def lower(ctx, x, w, params, table):
    """The custom call of the transposed problem (see the module docstring): its operands
    ``w.T`` and ``x.T`` (transposes XLA makes bitcasts: the layouts below are w's and x's own)
    and its result ``out.T`` declared as ``out`` column-major."""
    x_aval, w_aval = ctx.avals_in
    (out_aval,) = ctx.avals_out
    config = params["config"]
    n = table.n
    m_total, k, n_cols = math.prod(x_aval.shape[:-1]), x_aval.shape[-1], w_aval.shape[1]
    dtype = x_aval.dtype
    entry = policy.measured(policy.LAST_DIM, m_total, k, n_cols, dtype, n)
    setting = policy.tuned_setting("matmul_reduce_scatter", n_cols, k, m_total, dtype, n, entry)
    if not setting[1]:  # a copy-engine entry (comm_sms=0): no such variant here, the defaults
        setting = policy._DEFAULT_SETTING
    chunks = choose_chunks(n_cols // n, k, m_total, config.chunks or setting[0])
    chunks = chunks or choose_chunks(n_cols // n, k, m_total)
    a_col = not params["w_colmajor"]  # w.T column-major, unless w is a transpose already
    spec = call.Spec(
        # w's layout too (call._operands_kind): the forward (A column-major) and a backward's
        # (A = a transposed weight, row-major) must not share a workspace's warm-up.
        kind=(GEMM_RS_TARGET, "cols", *call._operands_kind(x_aval, w_aval, params)),
        comm_sms=config.comm_sms or setting[1],
        chunks=chunks,
        timeout_s=config.timeout_s,
        workspace=(xproc.spec_bytes(n_cols // n, m_total, dtype), True, False),
        operand_layouts=((0, 1) if a_col else (1, 0), (0, 1)),  # minor-to-major
        result_layouts=((0, 1),),  # out [M, N / n] column-major: out.T row-major
        attrs=dict(w_colmajor=1, x_colmajor=int(a_col)),
    )
    wt_aval = core.ShapedArray((n_cols, k), dtype)
    x2_aval, xt_aval = core.ShapedArray((m_total, k), dtype), core.ShapedArray((k, m_total), dtype)
    out2_aval = core.ShapedArray((m_total, n_cols // n), dtype)
    wt = hlo.transpose(w, mlir.dense_int_array([1, 0]))
    xt = hlo.transpose(mlir.reshape(ctx, x, x2_aval), mlir.dense_int_array([1, 0]))
    inner = ctx.replace(avals_in=[wt_aval, xt_aval], avals_out=[out2_aval])
    (out_t,) = call.emit(inner, table, spec, wt, xt)
    ctx.set_tokens_out(inner.tokens_out)  # the call's order token (call.emit)
    return [mlir.reshape(ctx, out_t, out_aval)]
