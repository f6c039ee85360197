"""Which schedule serves a call, and whether one can: the fused path's entry points.

Contract with `jaxoverlap/ops/*` (the only callers, through the `jaxoverlap.fused` face):

* ``unsupported_reason(op, x, w, params, axis_size, keep_gathered, target)`` is asked at trace
  time (bind) with the per-device avals, by the op's lowering and by ``explain`` (for a
  ``target``). It returns ``None`` when nothing known at trace time rules the fused path out,
  else a sentence saying why (no native extension, dtype, alignment, ...). ``backend="fused"``
  raises with that sentence; ``"auto"`` takes the reference path and logs it once.
* ``lower(op, ctx, x, w, params)`` is called from the op's CUDA lowering rule. It returns the
  custom call's results, or raises `FusedUnavailable` with a sentence saying why the fused path
  cannot run here (platform, topology, mesh) -- known only at lowering time.
* ``kernel(op, x, w, params, axis_size, keep_gathered, target)``: which custom call ``lower``
  emits for a call that runs fused, and its schedule in words (``explain`` prints it).

``op`` is one of ``"matmul_reduce_scatter"``, ``"all_gather_matmul"``, ``"matmul_all_reduce"``;
``params`` is the primitive's params dict (``axis_name`` as a tuple, ``scatter_dimension`` or
``gather_dimension`` where the op has one, ``config``).

What is fused in this version: over blocks of rows of the flattened ``[..., K]`` input
(`jaxoverlap.fused.rows`, and the tile schedule `jaxoverlap.fused.tile`), over the last dimension
(`jaxoverlap.fused.last_dim`); the column-parallel backward is `jaxoverlap.fused.backward`, the
standalone TMA reduce-scatter `jaxoverlap.fused.tma`. bf16 or f16, 2..8 GPUs of one process with
NVLink peer access, or one GPU per process of one host. `policy.AUTO_NEW_KERNELS` says which of
these ``backend="auto"`` may pick yet. Alignment: ``K`` and ``N`` multiples of 8; rows per rank
per chunk times ``K`` and times ``N`` multiples of 128 elements (every GEMM operand 256-byte
aligned).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxoverlap import runtime, topology
from jaxoverlap.fused import call, last_dim, policy, rows, targets, tile
from jaxoverlap.fused.call import FusedUnavailable
from jaxoverlap.fused.policy import _FUSED_OPS, _SUPPORTED, DEFAULT_COMM_SMS


def unsupported_reason(op, x, w, params, axis_size, keep_gathered=False, target=None):
    """Trace-time check; see the module docstring. The one decision: the ops' CUDA lowering asks
    it for this machine, ``explain`` for a `jaxoverlap.target.Target` (``target``: whose facts
    -- extension, GPU kind, tuning cache -- to decide from; None: this machine's). The group's
    devices are checked when the call is emitted (`call.group_decision`). ``keep_gathered``:
    all_gather_matmul's variant that also returns the gathered x (the training path's forward),
    which ``backend="auto"`` takes only once the kernels not yet measured on two GPUs are
    allowed."""
    config = params["config"]
    if keep_gathered and op == "all_gather_matmul" and params.get("gather_dimension") == x.ndim - 1:
        # (last_dim.lower_k: the variant is not built along K) -- decided here, so that
        # explain, the tuner and lowering agree and backend="fused" fails at trace time
        return "along K, the all-gather that also returns x (for a trained dW) is not fused"
    if not (keep_gathered and config.backend == "auto"):
        return _unsupported_reason(op, x, w, params, axis_size, target)
    fused = {**params, "config": dataclasses.replace(config, backend="fused")}
    if why := _unsupported_reason(op, x, w, fused, axis_size, target):  # cannot run here
        return why
    n, rows = int(axis_size), policy._rows(x.shape) * int(axis_size)  # gathered rows
    entry = policy.measured(policy.KEEP, rows, x.shape[-1], w.shape[1], x.dtype, n, target)
    if entry is not None:  # this machine's tuner measured the variant: what won, over any rule
        return policy.entry_reason(entry, f"M={rows} K={x.shape[-1]} N={w.shape[1]} over {n} GPUs")
    return policy.new_kernels_reason() or _unsupported_reason(op, x, w, params, axis_size, target)


def _unsupported_reason(op, x, w, params, axis_size, target):
    if op not in _FUSED_OPS:
        return f"{op} has no fused GPU kernel in this version (only {', '.join(_FUSED_OPS)})"
    why = runtime.unavailable_reason() if target is None else target.native_reason()
    if why:
        return why
    if x.dtype != w.dtype or not any(x.dtype == np.dtype(t) for t in _SUPPORTED):
        return f"the fused kernel supports bfloat16 and float16, not {x.dtype}"
    gather = op == "all_gather_matmul"
    dim = params.get("gather_dimension" if gather else "scatter_dimension", 0)
    if x.ndim < 2:
        return f"x has rank {x.ndim}: dimension 0 is then K or N, not rows of x[..., K]"
    if dim == x.ndim - 1 and op in ("matmul_reduce_scatter", "all_gather_matmul"):
        n = int(axis_size)
        if not 2 <= n <= topology.MAX_GROUP:
            return f"group size {n} is outside 2..{topology.MAX_GROUP}"
        if gather:
            return last_dim.unsupported_reason_k(x, w, params, n, target)
        return last_dim.unsupported_reason(x, w, params, n, target)
    # Any dimension but the last: the custom call takes x (and gives its results) with that
    # dimension major-most (`call.rows_major`), so each rank's block is contiguous rows of x[..., K]
    # ([B, S, D] split over S: sequence parallelism) -- the same kernel.
    if dim >= x.ndim - 1:
        verb = "gathers" if gather else "scatters"
        what = "K, which the GEMM contracts" if gather else "N, the GEMM's columns"
        return (
            f"the fused kernel {verb} blocks of rows of x[..., K]; dimension {dim} of "
            f"x{tuple(x.shape)} is {what}"
        )
    if math.prod(x.shape[:dim]) != 1 and params["config"].backend == "auto":
        if why := policy.new_kernels_reason():  # the layout below has not run on GPUs yet
            return f"{why} (dimension {dim} of x{tuple(x.shape)} through a {dim}-major layout)"
    n = int(axis_size)
    if not 2 <= n <= topology.MAX_GROUP:
        return f"group size {n} is outside 2..{topology.MAX_GROUP}"
    k, n_cols = x.shape[-1], w.shape[1]
    m_total = policy._rows(x.shape)
    if k % 8 or n_cols % 8:
        return f"K={k} and N={n_cols} must be multiples of 8"
    if m_total == 0:
        return "x has no rows"
    if not gather and x.shape[dim] % n:
        return f"dimension {dim} ({x.shape[dim]}) is not divisible by the group size {n}"
    m = m_total if gather else m_total // n  # rows of one rank's block
    config = params["config"]
    if op == "matmul_reduce_scatter" and config.schedule == "tile":
        if why := tile.unsupported_reason(x.dtype, m, k, n_cols, n):
            return why
        if config.backend != "auto":
            return None
        entry = policy.measured(op, m_total, k, n_cols, x.dtype, n, target)
        if entry is not None and entry.get("schedule") == "tile":  # measured here: it won
            return None
        return policy.new_kernels_reason() or policy._auto_reason(
            op, m_total, k, n_cols, x.dtype, n, target
        )
    chunks = policy.choose_chunks(m, k, n_cols, config.chunks or (1 if gather else None))
    if chunks is None:
        return (
            f"alignment: rows per rank per chunk ({m}/{config.chunks or 1}) times K={k} and "
            f"times N={n_cols} must be multiples of 128 elements"
        )
    if gather:
        return (
            policy._auto_reason(op, m * n, k, n_cols, x.dtype, n, target)
            if config.backend == "auto"
            else None
        )
    comm_sms = config.comm_sms or DEFAULT_COMM_SMS
    if comm_sms > 64:
        return f"comm_sms={comm_sms} leaves too few SMs for the GEMM"
    if config.backend == "auto":
        return policy._auto_reason(op, m_total, k, n_cols, x.dtype, n, target)
    return None


def lower(op, ctx, x, w, params, keep_gathered=False):
    """Emit the fused custom call (see the module docstring). ``keep_gathered``: the
    all_gather_matmul variant with a second result, the gathered x."""
    if op not in _FUSED_OPS:
        raise FusedUnavailable(f"{op} has no fused GPU kernel in this version")
    table = call._group_table(ctx, params["axis_name"])
    gather = op == "all_gather_matmul"
    if _schedule(op, params, ctx.avals_in[0].ndim) is last_dim:
        if gather:
            return last_dim.lower_k(ctx, x, w, params, table, keep_gathered)
        return last_dim.lower(ctx, x, w, params, table)
    if gather:
        return rows.lower_gather(ctx, x, w, params, table, keep_gathered)
    return rows.lower_scatter(op, ctx, x, w, params, table)


def _schedule(op, params, ndim):
    """The schedule module that lowers a fused call of ``op`` (x of rank ``ndim``): `last_dim`
    where the gathered or scattered dimension is x's last, else `rows` (the all-reduce's too)."""
    if op != "matmul_all_reduce" and call.row_dim(params) == ndim - 1:
        return last_dim
    return rows


def kernel(op, x, w, params, axis_size, keep_gathered=False, target=None):
    """``(FFI target, its schedule in words)``: the custom call `lower` emits for a call that
    runs fused (``explain`` names it: `call.emitted`, the name in the HLO of a program lowered
    now). Routed as `lower` routes (`_schedule`); the reduce-scatter over rows takes its kernel
    and settings from `policy.rows_setting`, as `rows.lower_scatter` does. ``target``: as
    `unsupported_reason`'s."""
    gather = op == "all_gather_matmul"
    if _schedule(op, params, x.ndim) is last_dim:
        if gather:
            return call.emitted(targets.AG_K_TARGET), "the all-gather along K"
        return call.emitted(targets.GEMM_RS_TARGET), "the last dimension, as the transposed problem"
    if gather:
        kept = ", also returning the gathered x" if keep_gathered else ""
        name = call.emitted(rows.gather_target(keep_gathered))
        return name, f"row blocks pushed by the copy engine{kept}"
    config, m_total, n = params["config"], policy._rows(x.shape), int(axis_size)
    name, chunks, comm_sms = policy.rows_setting(
        op, config, m_total, x.shape[-1], w.shape[1], x.dtype, n, target
    )
    how = {
        targets.GEMM_RS_TILE_TARGET: "the tile schedule",
        targets.GEMM_RS_CE_TARGET: f"{chunks} chunk(s) per block, pushed by the copy engine",
        targets.GEMM_RS_TARGET: f"{chunks} chunk(s) per block, {comm_sms} SMs pushing by TMA",
        targets.GEMM_AR_TARGET: f"{chunks} chunk(s) per block, {comm_sms} SMs reducing, then "
        "the copy engine gathering the reduced rows",
    }
    return call.emitted(name), how[name]
