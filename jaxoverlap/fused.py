"""The fused GPU path: decides whether an op can run fused, and emits its custom call.

Contract with `jaxoverlap/ops/*` (the only callers):

* ``unsupported_reason(op, x, w, params, axis_size)`` is asked at trace time (bind) with the
  per-device avals. It returns ``None`` when nothing known at trace time rules the fused path out,
  else a sentence saying why (no native extension, dtype, alignment, ...). ``backend="fused"``
  raises with that sentence; ``"auto"`` takes the reference path and logs it once.
* ``lower(op, ctx, x, w, params)`` is called from the op's CUDA lowering rule. It returns the
  custom call's results, or raises `FusedUnavailable` with a sentence saying why the fused path
  cannot run here (platform, topology, mesh) -- known only at lowering time.

``op`` is one of ``"matmul_reduce_scatter"``, ``"all_gather_matmul"``, ``"matmul_all_reduce"``;
``params`` is the primitive's params dict (``axis_name`` as a tuple, ``scatter_dimension`` or
``gather_dimension`` where the op has one, ``config``).

What is fused in this version: ``matmul_reduce_scatter`` (SM partition + TMA pushes, or with
``comm_sms=0`` copy-engine pushes) and ``all_gather_matmul`` (copy-engine pushes; a variant also
returns the gathered x) over blocks of rows of the flattened ``[..., K]`` input -- the scattered
or gathered dimension, any but the last, is made major-most by the custom call's layout
(`rows_major`) -- and ``matmul_all_reduce`` as one call: the fused reduce-scatter over rows whose
reduced chunks the copy engine pushes to every peer as they are done; the column-parallel
backward is in `jaxoverlap.fused_backward`. bf16 or f16, 2..8 GPUs of one process with NVLink
peer access. `AUTO_NEW_KERNELS` (below) says which of these ``backend="auto"`` may pick yet.
Alignment: ``K`` and ``N`` multiples of 8; rows per rank per chunk times ``K`` and times ``N``
multiples of 128 elements (every GEMM operand 256-byte aligned).

The standalone TMA reduce-scatter of the benchmarks is in `jaxoverlap.tma`.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxoverlap import runtime, topology, xproc
from jaxoverlap._knobs import (  # noqa: F401  (re-exported: tests and tools use fused.<knob>)
    _failed_rank_for_tests,
    _gemm_only_for_tools,
    _profile,
    _stall_rank,
    _stall_target,
    _stalled_rank_for_tests,
)
from jaxoverlap.fused_attrs import (  # noqa: F401  (re-exported: the lowerings use fused.<name>)
    FusedUnavailable,
    _call_tag,
    _group_table,
    _operands_kind,
    _table_attrs,
    site_key,
)

GEMM_RS_TARGET = "jaxoverlap_gemm_rs_v1"
GEMM_AR_TARGET = "jaxoverlap_gemm_ar_v1"  # the same schedule, the reduced rows gathered too
AG_GEMM_TARGET = "jaxoverlap_ag_gemm_v1"
AG_GEMM_KEEP_TARGET = "jaxoverlap_ag_gemm_keep_v1"  # also returns the gathered x
GEMM_RS_CE_TARGET = "jaxoverlap_gemm_rs_ce_v1"  # comm_sms=0: copy-engine pushes, no partition
GEMM_RS_TILE_TARGET = "jaxoverlap_gemm_rs_tile_v1"  # schedule="tile" (jaxoverlap/fused_tile.py)
MAX_CHUNKS = 16  # kMaxChunks in ffi/kernels/common.cuh
_SUPPORTED = (jnp.bfloat16, jnp.float16)

# Without tuning data (jaxoverlap.tune), the setting that won most often on 2x H200, and a
# conservative rule for backend="auto": at tp=2, M >= 2048, N >= 4096 and 4096 <= K_local <= 8192
# the fused op measured faster than XLA beyond the run-to-run spread on every shape tried; the
# communication to hide shrinks relative to the GEMM as K grows (at K_local = 14336: 1.05, 1.04,
# 1.01 and 0.95x of XLA over four runs). Anything else takes XLA's path until it is tuned.
_DEFAULT_SETTING = (2, 4)  # (chunks, comm_sms)
_AUTO_MIN = (2048, 4096, 4096)
_AUTO_MAX_K = 8192
DEFAULT_COMM_SMS = 4  # GEMM keeps a structured 128-SM partition (measured best, see above)

# all_gather_matmul, backend="auto" where untuned. The fused op pushes x with the copy engine (no
# SMs) while the GEMM of the own block runs, so it costs the GEMM little when one block's copy
# (m*K*2 bytes at ~350 GB/s) is shorter than the own block's GEMM (2*m*K*N flops at ~650
# TFLOP/s): their ratio is N_local / ~1860, independent of m and K. Measured on 2x H200
# (docs/measurements.md, run 18): fused was faster than XLA's all_gather -> matmul on all nine
# shapes tried (1.05-1.49x), N_local 2048-14336, gathered M 4096-16384, K 4096-16384. The rule
# covers that range at tp=2 (the only group measured); anything else waits for the tuner.
_AG_AUTO_MIN = (4096, 4096, 2048)  # (gathered rows, K, N_local)


def tuned(op, m_total, k, n_cols, dtype, n, target=None):
    """The tuner's entry for this op and shape on this machine's GPUs, or None. ``target``: a
    `jaxoverlap.target.Target` to decide for (explain): a named one's entry from its tuning
    cache; this machine's from the cache it names (each entry it finds recorded)."""
    from jaxoverlap import tune

    if target is not None and target.predicted:
        return target.tuned(op, m_total, k, n_cols, dtype, n)
    cache = target.tuning_cache if target is not None else None
    devices = jax.devices()
    if devices[0].platform != "gpu":
        return None
    key = tune.Key(
        op, m_total, k, n_cols, str(np.dtype(dtype)), n,
        devices[0].device_kind,
    )  # fmt: skip
    entry = tune.lookup(key, cache)
    if jax.process_count() > 1 and cache is None:  # every process lowers the same program
        entry = xproc.agree("tuned/" + xproc.exchange_key((), (key.id(),)), entry)
    if target is not None:
        target.lookups.append(entry)
    return entry


def tuned_setting(op, m_total, k, n_cols, dtype, n, entry=None):
    """(chunks, comm_sms) the tuner measured best for this op and shape, else the default."""
    entry = entry or tuned(op, m_total, k, n_cols, dtype, n)
    return (entry["chunks"], entry["comm_sms"]) if entry and entry["chunks"] else _DEFAULT_SETTING


def schedule_of(config, entry):
    """The reduce-scatter's schedule: the config's, else the tuner's (the tile schedule only
    where auto may take kernels not yet measured on two GPUs), else "chunked"."""
    if config.schedule:
        return config.schedule
    if entry and entry.get("schedule") == "tile" and not new_kernels_reason():
        return "tile"
    return "chunked"


def auto_predicts_win(m_total, k, n_cols, n):
    """The conservative rule used where nothing was tuned (see above)."""
    if n != 2:
        return False  # only tp=2 has been measured
    big_enough = all(v >= lo for v, lo in zip((m_total, k, n_cols), _AUTO_MIN, strict=True))
    return big_enough and k <= _AUTO_MAX_K


def ag_auto_predicts_win(m_gathered, k, n_cols, n):
    """The conservative rule for the fused all_gather_matmul where untuned (see above)."""
    return n == 2 and all(
        v >= lo for v, lo in zip((m_gathered, k, n_cols), _AG_AUTO_MIN, strict=True)
    )


def _auto_reason(op, m, k, n_cols, dtype, n, target=None):
    """None if backend="auto" should take the fused path, else why not. ``m`` is the rows of
    x as the op's tuning key counts them: per device for matmul_reduce_scatter, gathered for
    all_gather_matmul."""
    entry = tuned(op, m, k, n_cols, dtype, n, target)
    shape = f"M={m} K={k} N={n_cols} over {n} GPUs"
    if entry is not None:
        if entry["choice"] == "fused":
            return None
        return (
            f"backend='auto': tuned, XLA's path measured as fast or faster for {shape} "
            f"(xla {entry['ms_xla']:.3f} ms, best fused {entry['ms_fused'] or float('nan'):.3f} ms)"
        )
    rules = {
        "matmul_reduce_scatter": (auto_predicts_win, "tp=2, M>=2048, N>=4096, 4096<=K<=8192"),
        "all_gather_matmul": (
            ag_auto_predicts_win,
            "tp=2, gathered M >= 4096, K >= 4096, N_local >= 2048",
        ),
        # The fused all-reduce: not measured yet, so no rule; the tuner decides.
        "matmul_all_reduce": (lambda *_: False, "none: never measured"),
    }
    rule, what = rules[op]
    if rule(m, k, n_cols, n):
        return None
    return (
        f"backend='auto': {shape} is untuned and outside the conservative rule ({what}); run "
        f"`python -m jaxoverlap.tune --op {op} --shapes {m}x{k}x{n_cols} --tp {n}` to measure it"
    )


# ----------------------------------------------------------------------------- decisions


def _rows(x_shape):
    return math.prod(x_shape[:-1])


def _aligned(rows_per_chunk, k, n_cols):
    return (rows_per_chunk * k) % 128 == 0 and (rows_per_chunk * n_cols) % 128 == 0


def choose_chunks(m, k, n_cols, requested=None):
    """Sub-chunks per rank's row block of ``m`` rows: ``requested`` if aligned, else the largest
    of 4, 2, 1 that divides ``m`` with aligned operands; None when even 1 is unaligned."""
    options = (requested,) if requested else (4, 2, 1)
    for c in options:
        if c <= MAX_CHUNKS and m % c == 0 and _aligned(m // c, k, n_cols):
            return c
    return None


_FUSED_OPS = ("matmul_reduce_scatter", "all_gather_matmul", "matmul_all_reduce")

# Kernels that have not run on two GPUs yet -- all_gather_matmul's variant that returns the
# gathered x and the column-parallel backward (docs/training-path.md), the copy-engine
# reduce-scatter (Config(comm_sms=0)) and the last-dimension reduce-scatter (fused_cols.py) --
# are never picked by backend="auto" (nor tried by the tuner) until they have run and been
# measured there (correct so far with two processes sharing one GPU: docs/measurements.md runs
# 29-30, 35-36); backend="fused" (or comm_sms=0) runs them. Where auto would have
# used them it keeps JAX's own collectives (what plain JAX runs).
# JAXOVERLAP_AUTO_NEW_KERNELS=1 opts auto and the tuner in.
AUTO_NEW_KERNELS = os.environ.get("JAXOVERLAP_AUTO_NEW_KERNELS") == "1"


def new_kernels_reason():
    """None if backend="auto" may take the kernels that have not run on GPUs yet (above)."""
    if AUTO_NEW_KERNELS:
        return None
    return (
        "backend='auto': this fused kernel has not been measured on two GPUs yet (it ran "
        "correct only with two processes sharing one GPU); backend='fused' runs it "
        "(JAXOVERLAP_AUTO_NEW_KERNELS=1 lets auto pick it)"
    )


def unsupported_reason(op, x, w, params, axis_size, target=None):
    """Trace-time check; see the module docstring. ``target``: a `jaxoverlap.target.Target`
    whose facts to decide from (None: this machine's)."""
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
        from jaxoverlap import fused_cols  # the last dimension (it imports this module)

        n = int(axis_size)
        if not 2 <= n <= topology.MAX_GROUP:
            return f"group size {n} is outside 2..{topology.MAX_GROUP}"
        if gather:
            return fused_cols.unsupported_reason_k(x, w, params, n, target)
        return fused_cols.unsupported_reason(x, w, params, n, target)
    # Any dimension but the last: the custom call takes x (and gives its results) with that
    # dimension major-most (`rows_major`), so each rank's block is contiguous rows of x[..., K]
    # ([B, S, D] split over S: sequence parallelism) -- the same kernel.
    if dim >= x.ndim - 1:
        verb = "gathers" if gather else "scatters"
        what = "K, which the GEMM contracts" if gather else "N, the GEMM's columns"
        return (
            f"the fused kernel {verb} blocks of rows of x[..., K]; dimension {dim} of "
            f"x{tuple(x.shape)} is {what}"
        )
    if math.prod(x.shape[:dim]) != 1 and params["config"].backend == "auto":
        if why := new_kernels_reason():  # the layout below has not run on GPUs yet
            return f"{why} (dimension {dim} of x{tuple(x.shape)} through a {dim}-major layout)"
    n = int(axis_size)
    if not 2 <= n <= topology.MAX_GROUP:
        return f"group size {n} is outside 2..{topology.MAX_GROUP}"
    k, n_cols = x.shape[-1], w.shape[1]
    m_total = _rows(x.shape)
    if k % 8 or n_cols % 8:
        return f"K={k} and N={n_cols} must be multiples of 8"
    if m_total == 0:
        return "x has no rows"
    if not gather and x.shape[dim] % n:
        return f"dimension {dim} ({x.shape[dim]}) is not divisible by the group size {n}"
    m = m_total if gather else m_total // n  # rows of one rank's block
    config = params["config"]
    if op == "matmul_reduce_scatter" and config.schedule == "tile":
        from jaxoverlap import fused_tile

        if why := fused_tile.unsupported_reason(x.dtype, m, k, n_cols, n):
            return why
        if config.backend != "auto":
            return None
        return new_kernels_reason() or _auto_reason(op, m_total, k, n_cols, x.dtype, n, target)
    chunks = choose_chunks(m, k, n_cols, config.chunks or (1 if gather else None))
    if chunks is None:
        return (
            f"alignment: rows per rank per chunk ({m}/{config.chunks or 1}) times K={k} and "
            f"times N={n_cols} must be multiples of 128 elements"
        )
    if gather:
        if config.backend != "auto":
            return None
        return _auto_reason(op, m * n, k, n_cols, x.dtype, n, target)
    comm_sms = config.comm_sms or DEFAULT_COMM_SMS
    if comm_sms > 64:
        return f"comm_sms={comm_sms} leaves too few SMs for the GEMM"
    if config.backend == "auto":
        return _auto_reason(op, m_total, k, n_cols, x.dtype, n, target)
    return None


def decide(op, x, w, params, axis_size, keep_gathered=False, target=None):
    """Everything known before the custom call is emitted, in one place: None when ``op`` takes
    the fused path, else why not. The CUDA lowering asks it for this machine; `jaxoverlap.explain`
    for a `jaxoverlap.target.Target`. (The group's devices are checked when the call is emitted:
    `jaxoverlap.fused_attrs.group_decision`.) ``keep_gathered``: all_gather_matmul's variant that
    also returns the gathered x (several weights of one gathered value)."""
    reason = unsupported_reason(op, x, w, params, axis_size, target)
    if reason is None and keep_gathered and params["config"].backend == "auto":
        reason = new_kernels_reason()  # the variant has not run on two GPUs yet
    return reason


def rows_major(shape, dim):
    """The minor-to-major layout that puts dimension ``dim`` of ``shape`` major-most and keeps
    the others in order: the gathered/scattered dimension's blocks are then contiguous rows of
    ``[..., K]``. Row-major where that is already so (``dim`` 0, or only size-1 dimensions
    before it). XLA transposes to and from it where the producer or consumer cannot take it as
    is (an elementwise producer writes any layout for free)."""
    ndim = len(shape)
    if math.prod(shape[:dim]) == 1:
        return tuple(reversed(range(ndim)))
    return tuple(i for i in reversed(range(ndim)) if i != dim) + (dim,)


def row_dim(params):
    """The gathered/scattered dimension of an op's params (0 for the all-reduce)."""
    return params.get("gather_dimension", params.get("scatter_dimension", 0))


def _ffi_call(target, ctx, x, w, params, attrs):
    """The custom call, x and its results with the gathered/scattered dimension major-most
    (`rows_major`), w column-major when ``params["w_colmajor"]`` (w is the transpose of a
    row-major array: XLA then passes that array as is, and the kernel reads it as cuBLASLt's
    transposed operand), else row-major."""
    colmajor = bool(params["w_colmajor"])
    x_aval = ctx.avals_in[0]
    d = row_dim(params)
    layouts = [rows_major(x_aval.shape, d), (0, 1) if colmajor else (1, 0)]
    results = [rows_major(a.shape, d if a.ndim == x_aval.ndim else 0) for a in ctx.avals_out]
    lowering = jax.ffi.ffi_lowering(target, operand_layouts=layouts, result_layouts=results)
    if target in (GEMM_RS_TARGET, GEMM_AR_TARGET):  # x row-major (fused_cols.py: column-major)
        attrs = dict(attrs, x_colmajor=0)
    return lowering(ctx, x, w, profile=_profile.get(), w_colmajor=int(colmajor), **attrs)


def lower(op, ctx, x, w, params, keep_gathered=False):
    """Emit the fused custom call (see the module docstring). ``keep_gathered``: the
    all_gather_matmul variant with a second result, the gathered x."""
    if op not in _FUSED_OPS:
        raise FusedUnavailable(f"{op} has no fused GPU kernel in this version")
    x_aval, w_aval = ctx.avals_in
    table = _group_table(ctx, params["axis_name"])
    config = params["config"]
    m_total, k, n_cols = _rows(x_aval.shape), x_aval.shape[-1], w_aval.shape[1]
    runtime.register_targets()
    if op == "matmul_all_reduce":
        return _lower_all_reduce(ctx, x, w, params, table)
    if row_dim(params) == x_aval.ndim - 1 and op != "matmul_all_reduce":
        from jaxoverlap import fused_cols

        if op == "all_gather_matmul":
            return fused_cols.lower_k(ctx, x, w, params, table, keep_gathered)
        return fused_cols.lower(ctx, x, w, params, table)
    if op == "all_gather_matmul":
        entry = tuned(op, m_total * table.n, k, n_cols, x_aval.dtype, table.n)
        # One chunk per block by default: at tp=2 the own block's GEMM hides the whole copy.
        want = config.chunks or (entry["chunks"] if entry and entry["chunks"] else 1)
        chunks = choose_chunks(m_total, k, n_cols, want) or choose_chunks(m_total, k, n_cols, 1)
        target = AG_GEMM_KEEP_TARGET if keep_gathered else AG_GEMM_TARGET
        kind = (target, *_operands_kind(x_aval, w_aval, params))
        spec = (xproc.spec_bytes(m_total, k, x_aval.dtype), False, False)  # x's block
        attrs = _table_attrs(table, 0, chunks, config.timeout_s, kind, ctx, spec)
        return _ffi_call(target, ctx, x, w, params, attrs)
    return _lower_rows(GEMM_RS_TARGET, op, ctx, x, w, params, table)


def _lower_rows(target, op, ctx, x, w, params, table):
    """The custom call ``target`` of the reduce-scatter schedule over rows (GEMM_RS_TARGET, or
    GEMM_AR_TARGET), with the settings the tuner found for ``op`` and this shape, else the
    defaults; an explicit ``Config.chunks`` / ``comm_sms`` wins."""
    x_aval, w_aval = ctx.avals_in
    config = params["config"]
    m_total, k, n_cols = _rows(x_aval.shape), x_aval.shape[-1], w_aval.shape[1]
    entry = tuned(op, m_total, k, n_cols, x_aval.dtype, table.n)
    if target == GEMM_RS_TARGET and schedule_of(config, entry) == "tile":
        from jaxoverlap import fused_tile

        swizzle = (entry or {}).get("swizzle") or fused_tile.DEFAULT_SWIZZLE
        return fused_tile.lower(ctx, x, w, params, table, swizzle)
    setting = tuned_setting(op, m_total, k, n_cols, x_aval.dtype, table.n, entry)
    chunks = choose_chunks(m_total // table.n, k, n_cols, config.chunks or setting[0])
    if chunks is None:
        chunks = choose_chunks(m_total // table.n, k, n_cols, None)
    comm_sms = config.comm_sms if config.comm_sms is not None else setting[1]
    if comm_sms == 0 and config.comm_sms is None and new_kernels_reason():
        comm_sms = DEFAULT_COMM_SMS  # a tuner entry from an opted-in run; not allowed now
    if comm_sms == 0:  # the copy engine: the reduce-scatter's CE handler; the AR has none
        target = GEMM_RS_CE_TARGET if target == GEMM_RS_TARGET else target
        comm_sms = 0 if target == GEMM_RS_CE_TARGET else DEFAULT_COMM_SMS
    kind = (target, *_operands_kind(x_aval, w_aval, params))
    block = xproc.spec_bytes(m_total // table.n, n_cols, x_aval.dtype)  # the output's block
    spec = (block, True, target == GEMM_AR_TARGET)
    attrs = _table_attrs(table, comm_sms, chunks, config.timeout_s, kind, ctx, spec)
    return _ffi_call(target, ctx, x, w, params, attrs)


def _lower_all_reduce(ctx, x, w, params, table):
    """``psum(x @ w)`` as one custom call (GEMM_AR_TARGET, ffi/gemm_rs_ffi.cc): the fused GEMM +
    reduce-scatter over rows, and as each reduced chunk of this rank's rows is done, the copy
    engine pushes it to every peer (no SMs), which copies it into its output. Both halves of
    the all-reduce's traffic overlap the GEMMs (the reduce-scatter followed by XLA's all-gather
    left the gather exposed). Every rank holds the owners' rows verbatim: bitwise equal outputs.
    Its settings and the decision are the tuner's for this op and shape."""
    return _lower_rows(GEMM_AR_TARGET, "matmul_all_reduce", ctx, x, w, params, table)
