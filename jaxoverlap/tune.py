"""Tuning by measurement: which path and which settings each fused op takes, per shape.

For a key (device kind, op, per-device shape, dtype, group size) the tuner times XLA's own path
and every candidate setting of the fused kernel on the real GPUs, side by side (round-robin
samples, medians), checks each fused result against XLA's, and records the outcome in a JSON
cache on disk. ``backend="auto"`` then takes the fused path exactly where the recorded
measurement beat XLA by more than the noise (the larger spread of the two, at least 2 %), with
the fastest setting; where nothing is recorded it uses a conservative rule (`fused.policy`)
and says so once in the log.

    python -m jaxoverlap.tune --shapes 8192x4096x8192,4096x14336x4096 --tp 2
    python -m jaxoverlap.tune --op all_gather_matmul --shapes 8192x8192x4096
    python -m jaxoverlap.tune --list            # what the cache holds

From Python, ``jaxoverlap.tune.tune_function(fn, *args)`` tunes every jaxoverlap op that
``fn`` (e.g. an ``overlap``-ed train step) contains.

The cache lives in ``$XDG_CACHE_HOME/jaxoverlap`` (default ``~/.cache/jaxoverlap``), one file
per fingerprint of what the timings depend on (jaxlib version, the native extension's build,
the GPU driver), so a rebuilt extension or a new driver starts empty. Decisions are taken at
trace and lowering time from data every rank shares: in one process from its cache; with several
processes (`jax.distributed`) each offers the entry of its own cache and all use the first one
offered (`jaxoverlap.xproc.agree`), so no two processes can lower different programs.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap.fused import policy
from jaxoverlap.fused.cache import (  # noqa: F401  (re-exported: the cache, as before the split)
    CACHE_VERSION,
    Key,
    cache_path,
    load,
    lookup,
    record,
)
from jaxoverlap.runtime import cache_dir, fingerprint  # noqa: F401  (re-exported, as above)

log = logging.getLogger("jaxoverlap")
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
    name = lambda c: c if c == TILE else f"{c[0]}x{c[1]}"  # noqa: E731
    return dict(
        choice="fused" if win else "xla",
        chunks=(1 if tile else best[0]) if best else None,
        comm_sms=(0 if tile else best[1]) if best else None,
        schedule=TILE if tile else ("chunked" if best else None),
        ms_xla=x[0],
        ms_fused=fused[best][0] if best else None,
        spread=max([iqr(x)] + ([iqr(fused[best])] if best else [])),
        candidates={name(c): t[0] for c, t in fused.items()},
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


# ----------------------------------------------------------------------------- measuring


def _time(fns: dict, samples: int, target_ms: float) -> dict:
    """name -> (median, q1, q3) in ms of round-robin samples, each ~target_ms of back-to-back
    calls. Quartiles, not (max - min): one sample disturbed by something else on the machine
    must not veto a decision (BENCHMARKS.md's (max - min) / median read 10-33 % on 7 samples of
    otherwise stable GEMMs in a tuning run, docs/measurements.md run 17)."""
    iters = {}
    for name, (fn, args) in fns.items():
        jax.block_until_ready(fn(*args))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        est = (time.perf_counter() - t0) * 1e3
        iters[name] = max(3, min(500, math.ceil(target_ms / max(est, 1e-3))))
    runs = {name: [] for name in fns}
    for _ in range(samples):
        for name, (fn, args) in fns.items():
            t0 = time.perf_counter()
            out = None
            for _ in range(iters[name]):
                out = fn(*args)
            jax.block_until_ready(out)
            runs[name].append((time.perf_counter() - t0) * 1e3 / iters[name])
    out = {}
    for name, ts in runs.items():
        q1, med, q3 = statistics.quantiles(ts, n=4, method="inclusive")
        out[name] = (med, q1, q3)
    return out


OPS = ("matmul_reduce_scatter", "all_gather_matmul", "matmul_all_reduce")


def candidates(op):
    """The fused settings tried for ``op``: (chunks, comm_sms) -- comm_sms None = not used --
    or `TILE`, the tile schedule."""
    if op == "matmul_reduce_scatter":
        new = RS_CE_CANDIDATES + (TILE,) if policy.AUTO_NEW_KERNELS else ()
        return RS_CANDIDATES + new
    if op != "all_gather_matmul":  # the all-reduce runs the reduce-scatter's SM schedule
        return RS_CANDIDATES
    return tuple((c, None) for c in (1, 2, 4))


def tune_op(op, m, k, n, group, dtype="bfloat16", *, samples=9, target_ms=40.0, save=True):
    """Tunes ``op`` on ``group`` GPUs. Shapes as in `Key`: matmul_reduce_scatter and
    matmul_all_reduce x [m, k] and w [k, n] per device; all_gather_matmul m gathered rows,
    x [m / group, k], w [k, n] per device."""
    if op not in OPS:
        raise ValueError(f"jaxoverlap.tune: op must be one of {OPS}, not {op!r}")
    devices = jax.devices()
    if devices[0].platform != "gpu" or len(devices) < group:
        raise RuntimeError(f"jaxoverlap.tune: needs {group} GPUs, found {devices}")
    mesh = Mesh(np.array(devices[:group]), ("tp",))
    dt = jnp.dtype(dtype)
    rs = op != "all_gather_matmul"
    # Global operands: RS and AR contract a K split over the group; AG gathers rows, splits N.
    xg, wg = ((m, k * group), (k * group, n)) if rs else ((m, k), (k, n * group))
    specs = {
        "matmul_reduce_scatter": (P(None, "tp"), P("tp", None), P("tp", None)),
        "matmul_all_reduce": (P(None, "tp"), P("tp", None), P()),
        "all_gather_matmul": (P("tp", None), P(None, "tp"), P(None, "tp")),
    }[op]
    kx, kw = jax.random.split(jax.random.key(m * 7 + k * 3 + n))
    x = jax.random.normal(kx, xg, jnp.float32).astype(dt)
    w = (jax.random.normal(kw, wg, jnp.float32) / np.sqrt(wg[0])).astype(dt)
    x = jax.device_put(x, NamedSharding(mesh, specs[0]))
    w = jax.device_put(w, NamedSharding(mesh, specs[1]))
    fn_op = getattr(jaxoverlap, op)

    def make(config):
        body = lambda x, w: fn_op(x, w, "tp", config=config)  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs[:2], out_specs=specs[2]))

    fns = {"xla": (make(jaxoverlap.Config(backend="xla")), (x, w))}
    want = np.asarray(fns["xla"][0](x, w).astype(jnp.float32))
    scale = max(float(np.abs(want).max()), 1e-6)
    block = m // group  # rows of one rank's block (RS: scattered; AG: gathered)
    for cand in candidates(op):
        if cand == TILE:
            config = jaxoverlap.Config(backend="fused", schedule=TILE)
        elif policy.choose_chunks(block, k, n, cand[0]) != cand[0]:
            continue  # this split is not aligned for the shape
        else:
            config = jaxoverlap.Config(backend="fused", chunks=cand[0], comm_sms=cand[1])
        fn = make(config)
        try:
            got = np.asarray(fn(x, w).astype(jnp.float32))
        except ValueError as e:  # backend="fused" refused: the reason says why (dtype, ...)
            log.info("jaxoverlap.tune: %s %dx%dx%d %s not fusable: %s", op, m, k, n, cand, e)
            continue
        err = float(np.abs(got - want).max()) / scale
        if err > 2e-2:
            raise RuntimeError(
                f"jaxoverlap.tune: fused {op} {m}x{k}x{n} {cand} differs from XLA's result "
                f"(relative error {err:.3g})"
            )
        fns[cand] = (fn, (x, w))
    entry = decide(_time(fns, samples, target_ms))
    key = Key(op, m, k, n, str(dt), group, devices[0].device_kind)
    if save:
        record(key, entry)
    return key, entry


# ----------------------------------------------------------------------------- models


def shapes_of(fn, *args, **kwargs) -> list[tuple]:
    """The distinct (op, m, k, n, dtype, group) of the jaxoverlap ops in ``fn``'s jaxpr (at any
    depth), shaped as `Key` counts them."""
    names = ("matmul_reduce_scatter", "all_gather_matmul", "matmul_all_reduce")
    found = []
    variants = {"all_gather_matmul_keep": "all_gather_matmul"}  # same kernel, tuned as one

    def visit(jaxpr, sizes):
        for eqn in jaxpr.eqns:
            inner = dict(sizes)
            mesh = eqn.params.get("mesh")
            if mesh is not None and hasattr(mesh, "shape"):
                inner.update(dict(mesh.shape))
            name = variants.get(eqn.primitive.name, eqn.primitive.name)
            if name in names:
                x, w = (v.aval for v in eqn.invars)
                group = math.prod(inner.get(a, 1) for a in eqn.params["axis_name"])
                m = math.prod(x.shape[:-1])
                if name == "all_gather_matmul":
                    m *= group  # the key counts gathered rows
                row = (name, m, x.shape[-1], w.shape[1], str(x.dtype), group)
                if row not in found:
                    found.append(row)
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        visit(sub, inner)

    visit(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr, {})
    return found


def tune_function(fn, *args, progress=print, **kwargs) -> dict:
    """Tunes every op of ``fn(*args)`` that has a fused kernel; returns id -> entry."""
    todo = [s for s in shapes_of(fn, *args, **kwargs) if s[0] in OPS]
    out = {}
    for i, (op, m, k, n, dtype, group) in enumerate(todo, 1):
        if dtype not in ("bfloat16", "float16"):
            progress(f"[{i}/{len(todo)}] {op} {m}x{k}x{n} {dtype}: no fused kernel for {dtype}")
            continue
        key, entry = tune_op(op, m, k, n, group, dtype)
        out[key.id()] = entry
        progress(f"[{i}/{len(todo)}] {describe(key, entry)}")
    return out


def describe(key: Key, e: dict) -> str:
    gain = e["ms_xla"] / e["ms_fused"] if e.get("ms_fused") else None
    setting = f"chunks={e['chunks']} comm_sms={e['comm_sms']}" if e["chunks"] else "-"
    if e.get("schedule") == TILE:
        setting = "schedule=tile"
    return (
        f"{key.op} {key.m}x{key.k}x{key.n} {key.dtype} tp={key.group}: {e['choice']} "
        f"(xla {e['ms_xla']:.3f} ms, best fused {e['ms_fused'] or float('nan'):.3f} ms "
        f"{setting}, {gain or float('nan'):.2f}x, spread {e['spread']:.1%})"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxoverlap.tune", description=__doc__.split("\n")[0]
    )
    p.add_argument("--op", default="matmul_reduce_scatter", choices=OPS)
    p.add_argument(
        "--shapes",
        help="comma-separated MxKxN: matmul_reduce_scatter per device x [M, K], w [K, N]; "
        "all_gather_matmul M gathered rows, K, N_local",
    )
    p.add_argument("--tp", type=int, default=2, help="GPUs in the group (default 2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--samples", type=int, default=9)
    p.add_argument("--list", action="store_true", help="print the cache and exit")
    a = p.parse_args(argv)
    if a.list:
        print(cache_path())
        for kid, e in sorted(load().items()):
            how = "schedule=tile" if e.get("schedule") == TILE else f"chunks={e['chunks']}"
            print(f"{kid}: {e['choice']} {how} comm_sms={e['comm_sms']}")
        return 0
    if not a.shapes:
        p.error("--shapes is required (or --list)")
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",")]
    if any(len(s) != 3 for s in shapes):
        p.error("--shapes: each shape is MxKxN, e.g. 8192x4096x8192")
    print(f"tuning {len(shapes)} shape(s) into {cache_path()}", flush=True)
    for i, (m, k, n) in enumerate(shapes, 1):
        key, entry = tune_op(a.op, m, k, n, a.tp, a.dtype, samples=a.samples)
        print(f"[{i}/{len(shapes)}] {describe(key, entry)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
