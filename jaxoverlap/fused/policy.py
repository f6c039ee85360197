"""When the fused path runs, and with which settings: the rules, the tuner's entries, the chunk
choice. Decisions only -- no custom call is built here (`jaxoverlap.fused.call`), and which
schedule serves a call is `jaxoverlap.fused.dispatch`'s. The same functions answer at trace time
(`dispatch.unsupported_reason`, which the ops' lowering and ``explain`` ask), at lowering (the
settings: `rows_setting`, `ag_rows_chunks`, `tuned_setting`) and in the tuner (`choose_chunks`,
the variants' tuning keys `LAST_DIM` ...), so the three never disagree.

What ``backend="auto"`` may pick: the kernels measured on two GPUs, by the tuner's entry for the
op and shape, else by the conservative rules below; the kernels not yet measured there only with
``JAXOVERLAP_AUTO_NEW_KERNELS=1`` (`new_kernels_reason`), or where this machine's tuner, which
tries every kernel, measured one faster for the shape (`measured`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxoverlap import xproc
from jaxoverlap.fused import cache, targets

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
    `jaxoverlap.target.Target` to decide for (explain): a named one's entry from its tuning cache
    (none without one); this machine's from the cache it names. Each entry read is noted in
    ``target.lookups`` (what explain says a decision came from)."""
    cache_file = target.tuning_cache if target is not None else None
    if target is not None and target.predicted:
        kind = target.device_kind if cache_file else None
    else:
        devices = jax.devices()
        kind = devices[0].device_kind if devices[0].platform == "gpu" else None
    if kind is None:
        return None
    key = cache.Key(op, m_total, k, n_cols, str(np.dtype(dtype)), n, kind)
    entry = cache.lookup(key, cache_file)
    live = target is None or not target.predicted
    if live and jax.process_count() > 1 and cache_file is None:  # every process lowers the
        entry = xproc.agree("tuned/" + xproc.exchange_key((), (key.id(),)), entry)  # same program
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
    if entry and entry.get("schedule") == "tile" and not new_kernels_reason(entry):
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
    all_gather_matmul. ``target``: as `tuned`'s."""
    entry = tuned(op, m, k, n_cols, dtype, n, target)
    shape = f"M={m} K={k} N={n_cols} over {n} GPUs"
    if entry is not None:
        return entry_reason(entry, shape)
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


def entry_reason(entry, shape):
    """None where the tuner's ``entry`` chose the fused path, else why auto keeps XLA's."""
    if entry["choice"] == "fused":
        return None
    return (
        f"backend='auto': tuned, XLA's path measured as fast or faster for {shape} "
        f"(xla {entry['ms_xla']:.3f} ms, best fused {entry['ms_fused'] or float('nan'):.3f} ms)"
    )


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
# reduce-scatter (Config(comm_sms=0)), the tile schedule, the last-dimension reduce-scatter and
# the all-gather along K (fused/last_dim.py) -- are not picked by backend="auto" where untuned
# until they have run and been measured there (correct so far with two processes sharing one
# GPU: docs/measurements.md runs 29-30, 35-36); backend="fused" (or comm_sms=0) runs them. Where
# auto would have used them it keeps JAX's own collectives (what plain JAX runs).
# JAXOVERLAP_AUTO_NEW_KERNELS=1 opts auto in. The tuner (jaxoverlap.tune) tries them all on the
# user's GPUs, values checked against XLA's and each bounded by a short timeout; its entries mark
# that with ``new_kernels`` (`NEW_KERNELS_FIELD`), and such an entry choosing one of them lets
# auto take it for that shape on that machine (`measured`). Entries without the field (written
# before, or by an opted-in run of the old tuner) keep the gate.
AUTO_NEW_KERNELS = os.environ.get("JAXOVERLAP_AUTO_NEW_KERNELS") == "1"
NEW_KERNELS_FIELD = "new_kernels"
# The tuning keys' op of the held-back variants that have their own entry (the copy engine and
# the tile schedule share matmul_reduce_scatter's): `jaxoverlap.fused.cache.Key` shapes --
# LAST_DIM x [m, k], w [k, n] scattering N; ALONG_K x [m, k / group], w [k, n]; KEEP as
# all_gather_matmul (m gathered rows); BACKWARD the column-parallel layer's forward shape (ct
# [m gathered rows, n], w [k, n]).
LAST_DIM = "matmul_reduce_scatter_last_dim"
ALONG_K = "all_gather_matmul_along_k"
KEEP = "all_gather_matmul_keep"
BACKWARD = "all_gather_matmul_backward"


_every_kernel = contextvars.ContextVar("every_kernel", default=False)


@contextlib.contextmanager
def every_kernel():
    """Inside this block auto's trace-time choices take every kernel (the tuner traces a function
    so to find each op it could fuse: the column-parallel backward, which untuned auto leaves
    out, is then in the jaxpr)."""
    token = _every_kernel.set(True)
    try:
        yield
    finally:
        _every_kernel.reset(token)


def measured(op, m, k, n_cols, dtype, n, target=None):
    """The tuner's entry for ``op`` and this shape if a tuner that tries every kernel wrote it
    (values checked, each candidate bounded), else None. Arguments as `tuned`'s."""
    entry = tuned(op, m, k, n_cols, dtype, n, target)
    return entry if entry is not None and entry.get(NEW_KERNELS_FIELD) else None


def gated_auto_reason(kind, what, rule, m, k, n_cols, dtype, n, target=None):
    """``backend="auto"``'s decision for a kernel not yet run on two GPUs (``kind``, a tuning op
    name such as `LAST_DIM`; ``what`` names it in the reason): this machine's measurement of it
    if the tuner wrote one, else the gate, else ``rule`` = (op, m, k, n_cols): the conservative
    rule of the op whose kernel it runs on."""
    entry = measured(kind, m, k, n_cols, dtype, n, target)
    if entry is not None:  # this machine's tuner measured this kernel for the shape
        return entry_reason(entry, f"M={m} K={k} N={n_cols} over {n} GPUs")
    if why := new_kernels_reason():  # not yet run on two GPUs
        return f"{why} ({what})"
    return _auto_reason(*rule, dtype, n, target)


def new_kernels_reason(entry=None):
    """None if backend="auto" may take the kernels that have not run on GPUs yet (above): opted
    in, or ``entry`` (the tuner's for the call's shape) measured one of them faster here."""
    if AUTO_NEW_KERNELS or _every_kernel.get():
        return None
    if entry is not None and entry.get(NEW_KERNELS_FIELD) and entry.get("choice") == "fused":
        return None
    return (
        "backend='auto': this fused kernel has not been measured on two GPUs yet (it ran "
        "correct only with two processes sharing one GPU); backend='fused' runs it "
        "(JAXOVERLAP_AUTO_NEW_KERNELS=1 lets auto pick it; `python -m jaxoverlap.tune` on "
        "this machine's GPUs measures it, and auto then takes it where it won)"
    )


def rows_setting(op, config, m_total, k, n_cols, dtype, n, target=None):
    """The reduce-scatter over rows (``op`` matmul_reduce_scatter, or matmul_all_reduce, its
    schedule with the reduced rows gathered): ``(target, chunks, comm_sms)`` with the settings
    the tuner found for ``op`` and this shape, else the defaults; an explicit ``Config.chunks`` /
    ``comm_sms`` / ``schedule`` wins. The tile schedule has no settings here (its raster band is
    `tile.DEFAULT_SWIZZLE`, which the handler's selection at first execution refines; the tuner
    records none). ``target``: the `jaxoverlap.target.Target` whose tuning cache to read, as
    `tuned`'s (explain names the kernel with it)."""
    rs = op == "matmul_reduce_scatter"
    entry = tuned(op, m_total, k, n_cols, dtype, n, target)
    if rs and schedule_of(config, entry) == "tile":
        return targets.GEMM_RS_TILE_TARGET, 1, 0
    setting = tuned_setting(op, m_total, k, n_cols, dtype, n, entry)
    chunks = choose_chunks(m_total // n, k, n_cols, config.chunks or setting[0])
    if chunks is None:
        chunks = choose_chunks(m_total // n, k, n_cols, None)
    comm_sms = config.comm_sms if config.comm_sms is not None else setting[1]
    if comm_sms == 0 and config.comm_sms is None and new_kernels_reason(entry):
        comm_sms = DEFAULT_COMM_SMS  # an entry of the old tuner's opted-in run; not allowed now
    if comm_sms == 0 and rs:  # the copy engine: the reduce-scatter's CE handler
        return targets.GEMM_RS_CE_TARGET, chunks, 0
    target = targets.GEMM_RS_TARGET if rs else targets.GEMM_AR_TARGET
    return target, chunks, comm_sms or DEFAULT_COMM_SMS  # the AR has no CE handler


def ag_rows_chunks(config, m, k, n_cols, dtype, n):
    """Chunks of the all-gather over rows of ``m`` rows per rank: the config's, else the
    tuner's, else one per block (at tp=2 the own block's GEMM hides the whole copy)."""
    entry = tuned("all_gather_matmul", m * n, k, n_cols, dtype, n)
    want = config.chunks or (entry["chunks"] if entry and entry["chunks"] else 1)
    return choose_chunks(m, k, n_cols, want) or choose_chunks(m, k, n_cols, 1)
