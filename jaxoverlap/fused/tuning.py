"""What the tuner tries and how a measurement becomes an entry: the ops it tunes (`OPS`, each
under its own `Key` op), each op's candidate settings (`candidates`, `aligned`), the rule that
turns timings into the cached entry (`faster`, `decide`), the tuning keys of a function's ops
(`shapes_of`) and an entry's one-line summary (`describe`).

No measuring here (that, the CLI and `tune_function` are `jaxoverlap.tune`, which drives the
package's public ops); the entries are read back by `jaxoverlap.fused.policy`.
"""

from __future__ import annotations

import math
import time

import jax

from jaxoverlap.fused import last_dim, policy
from jaxoverlap.fused.cache import Key

NOISE_FLOOR = 0.02  # "faster" needs at least this margin (BENCHMARKS.md timing protocol)
# Candidate settings of the fused GEMM + reduce-scatter: sub-chunks per block x comm SMs.
RS_CANDIDATES = tuple((c, s) for c in (1, 2, 4) for s in (4, 8))
# comm_sms=0: the copy engine pushes, no SM partition (matmul_reduce_scatter only); one chunk
# would expose the whole push (the own GEMM needs the peers' partials), so 2 and 4.
RS_CE_CANDIDATES = ((2, 0), (4, 0))
# Config(schedule="tile"): one GEMM whose epilogue communicates (jaxoverlap/fused/tile.py); no
# chunks, no SMs of its own. A candidate is (chunks, comm_sms) or this.
TILE = "tile"

# ----------------------------------------------------------------------------- decisions


def name_of(cand):
    """A candidate as the entry names it: "tile", or "<chunks>x<comm_sms>"."""
    return cand if cand == TILE else f"{cand[0]}x{cand[1]}"


def faster(t, ref) -> bool:
    """``t`` beats ``ref`` (each ``(median, q1, q3)`` in ms): the median is lower by at least 2 %
    (BENCHMARKS.md's floor) and the interquartile ranges do not overlap (``t``'s q3 below
    ``ref``'s q1), so neither a small difference nor one disturbed sample decides."""
    return t[0] < ref[0] * (1.0 - NOISE_FLOOR) and t[2] < ref[1]


def decide(times: dict) -> dict:
    """From ``{"xla": (median, q1, q3), (chunks, comm_sms): (median, q1, q3), "tile": ...}``
    (ms) the entry to record."""
    x = times["xla"]
    fused = {c: t for c, t in times.items() if c != "xla"}
    best = min(fused, key=lambda c: fused[c][0]) if fused else None
    win = best is not None and faster(fused[best], x)
    iqr = lambda t: (t[2] - t[1]) / t[0]  # noqa: E731
    tile = best == TILE
    return dict(
        choice="fused" if win else "xla",
        chunks=(1 if tile else best[0]) if best else None,
        comm_sms=(0 if tile else best[1]) if best else None,
        schedule=TILE if tile else ("chunked" if best else None),
        ms_xla=x[0],
        ms_fused=fused[best][0] if best else None,
        spread=max([iqr(x)] + ([iqr(fused[best])] if best else [])),
        candidates={name_of(c): t[0] for c, t in fused.items()},
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


# ----------------------------------------------------------------------------- candidates

# The ops and variants the tuner measures, each under its own `Key` op (`fused.policy`: the
# variants held back from untuned auto until measured on two GPUs have their own entries, which
# let auto take them on this machine). The copy engine and the tile schedule are candidates of
# matmul_reduce_scatter's entry.
OPS = (
    "matmul_reduce_scatter",
    "all_gather_matmul",
    "matmul_all_reduce",
    policy.LAST_DIM,
    policy.ALONG_K,
    policy.KEEP,
    policy.BACKWARD,
)


def candidates(op):
    """The fused settings tried for ``op``: (chunks, comm_sms) -- comm_sms None = not used, 0 =
    the copy engine -- or `TILE`, the tile schedule. Every kernel of the one-GPU suite, whether
    or not untuned auto may take it yet (`fused.policy.new_kernels_reason`)."""
    if op == "matmul_reduce_scatter":
        return RS_CANDIDATES + RS_CE_CANDIDATES + (TILE,)
    if op in ("matmul_all_reduce", policy.LAST_DIM):  # SM schedules only: no CE handler
        return RS_CANDIDATES
    if op in (policy.ALONG_K, policy.BACKWARD):  # one schedule: copy engine, one chunk
        return ((1, 0),)
    return tuple((c, None) for c in (1, 2, 4))  # the all-gather over rows, and its keep variant


def aligned(op, cand, m, k, n, group):
    """False where ``cand``'s chunks do not split this shape (the tuner skips it)."""
    if cand == TILE or op in (policy.ALONG_K, policy.BACKWARD):
        return True
    if op == policy.LAST_DIM:  # the transposed problem: N / group rows per rank, K, M columns
        return last_dim.choose_chunks(n // group, k, m, cand[0]) == cand[0]
    return policy.choose_chunks(m // group, k, n, cand[0]) == cand[0]


# ----------------------------------------------------------------------------- models


def _key_of(eqn, sizes):
    """``(op, m, k, n, dtype, group)`` as `Key` counts the jaxoverlap op of ``eqn`` (`OPS`: the
    variants by their own op), or None."""
    name = eqn.primitive.name
    if name not in (*OPS[:3], policy.KEEP, policy.BACKWARD):
        return None
    x, w = (v.aval for v in eqn.invars[:2])
    group = math.prod(sizes.get(a, 1) for a in eqn.params["axis_name"])
    m, dtype = math.prod(x.shape[:-1]), str(x.dtype)
    if name == policy.BACKWARD:  # ct [..., n] and w.T [n, k]: the forward's shape
        return (name, m, w.shape[1], w.shape[0], dtype, group)
    last = x.ndim - 1
    if name == "matmul_reduce_scatter" and eqn.params["scatter_dimension"] == last:
        name = policy.LAST_DIM
    elif name == "all_gather_matmul" and eqn.params["gather_dimension"] == last:
        return (policy.ALONG_K, m, w.shape[0], w.shape[1], dtype, group)
    elif name == policy.KEEP and eqn.params["gather_dimension"] == last:
        return None  # not fused along K (the forward keeps XLA's gather)
    elif name in ("all_gather_matmul", policy.KEEP):
        m *= group  # the key counts gathered rows
    return (name, m, x.shape[-1], w.shape[1], dtype, group)


def shapes_of(fn, *args, **kwargs) -> list[tuple]:
    """The distinct (op, m, k, n, dtype, group) of the jaxoverlap ops in ``fn``'s jaxpr (at any
    depth), shaped as `Key` counts them: under autodiff also the all-gather's variant that keeps
    the gathered x and the column-parallel backward."""
    found = []

    def visit(jaxpr, sizes):
        for eqn in jaxpr.eqns:
            inner = dict(sizes)
            mesh = eqn.params.get("mesh")
            if mesh is not None and hasattr(mesh, "shape"):
                inner.update(dict(mesh.shape))
            row = _key_of(eqn, inner)
            if row is not None and row not in found:
                found.append(row)
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        visit(sub, inner)

    with policy.every_kernel():  # the ops auto could fuse once measured, the backward too
        jaxpr = jax.make_jaxpr(fn)(*args, **kwargs).jaxpr
    visit(jaxpr, {})
    return found


def describe(key: Key, e: dict) -> str:
    """One line: the op and shape, the choice, both times, the best setting, what failed."""
    gain = e["ms_xla"] / e["ms_fused"] if e.get("ms_fused") else None
    setting = f"chunks={e['chunks']} comm_sms={e['comm_sms']}" if e["chunks"] else "-"
    if e.get("schedule") == TILE:
        setting = "schedule=tile"
    failed = "".join(f"; {c} not used: {why}" for c, why in sorted(e.get("failed", {}).items()))
    return (
        f"{key.op} {key.m}x{key.k}x{key.n} {key.dtype} tp={key.group}: {e['choice']} "
        f"(xla {e['ms_xla']:.3f} ms, best fused {e['ms_fused'] or float('nan'):.3f} ms "
        f"{setting}, {gain or float('nan'):.2f}x, spread {e['spread']:.1%}{failed})"
    )
