"""One-GPU measurements of the tile-fused GEMM + reduce-scatter with live ranks, and its table's
reference with XLA in it (build/probes/libtile_live.so, tools/probes/tile_live.cu; built on the
CPU machine by tools/probes/build_tile_live.sh).

  canary [--calls 10000]   the race canary (issues 24.3, 25.2): two ranks as concurrent kernels,
                           rank 1 late by 0/25/50 us, every foreign slab a known f(epoch, source,
                           block, piece): the tile kernel (every menu entry, both w layouts),
                           the comm kernel's two n = 2 schedules (standalone reduce-scatter),
                           the chunked schedule's pushes (comm kernel, copy engine).
                           Each part in a child process bounded by --part-timeout-s (60 s;
                           --parts: a subset). Prints "TILE CANARY ..."; exit 1 on any wrong
                           element, wait that gave up, or part that did not finish.
  live SHAPES [--json OUT] live waits (issue 24.3): per judged shape (2*M*K*N >= 1e11), two ranks
                           (n = 2) on half the SMs each against two concurrent cuBLASLt GEMMs on
                           half the SMs each; rank 1 late by 0/25/50 us. The own-tile wait is not
                           measured inside the kernel; its proxy: a rank's mode-0 kernel time
                           minus its mode-1 time (same GEMM and traffic, no flags or waits).
  ref SHAPES [--sites] [--json OUT]
                           the reference table (issue 23.3): per shape, in the same interleaved
                           rounds, XLA's jitted jnp.matmul and the GEMM runner's searched
                           cuBLASLt plan (reference = the faster), the production selection's
                           pick (chosen first, empty cache) plain / solo / prod, entry 0 plain /
                           prod. --sites adds run 21's layer sites (tools/tile_paper.py).

SHAPES: tools/shapes.py's lines "<set> <tp> M K N" (an optional 6th field: 1 = w column-major,
7th: a site label).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
LIB = os.path.join(ROOT, "build", "probes", "libtile_live.so")
JUDGED_FLOP = 1e11
DELAYS_US = (0, 25, 50)


def load_lib():
    """The probe library, after cuBLASLt (the nvidia-cublas wheel's, as gpu_check.sh finds it)."""
    try:
        import nvidia

        for p in nvidia.__path__:
            lib = os.path.join(p, "cu13", "lib", "libcublasLt.so.13")
            if os.path.exists(lib):
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                break
    except ImportError:
        pass  # then the loader's path must have it
    lib = ctypes.CDLL(os.environ.get("TILE_LIVE_LIB", LIB))
    ll, i, d, p = ctypes.c_longlong, ctypes.c_int, ctypes.c_double, ctypes.c_void_p
    lib.tl_canary_tile.argtypes = [i, ll, ll, ll, i]
    lib.tl_canary_tile.restype = ll
    lib.tl_canary_comm.argtypes = [i, ll, i, i, i, i]
    lib.tl_canary_comm.restype = ll
    lib.tl_canary_chunked.argtypes = [i, ll, i, i, i]
    lib.tl_canary_chunked.restype = ll
    lib.tl_live.argtypes = [ll, ll, ll, ctypes.c_char_p, ctypes.POINTER(d), ctypes.POINTER(i),
                            ctypes.POINTER(i)]  # fmt: skip
    lib.tl_ref_open.argtypes = [i, ll, ll, ll, i]
    lib.tl_ref_open.restype = p
    lib.tl_ref_close.argtypes = [p]
    lib.tl_ref_choose.argtypes = [p, ctypes.c_char_p, ctypes.POINTER(i), ctypes.POINTER(d)]
    lib.tl_ref_choose.restype = ctypes.c_char_p
    lib.tl_ref_run.argtypes = [p, i, i, ctypes.POINTER(d)]
    lib.tl_ref_run.restype = d
    if lib.tl_init() != 0:
        raise SystemExit("tl_init failed")
    return lib


def read_shapes(path):
    rows = []
    with open(path) as f:
        for line in f:
            v = line.split()
            if len(v) < 5:
                continue
            tp, m, k, n = (int(x) for x in v[1:5])
            wcol = int(v[5]) if len(v) > 5 else 0
            rows.append(dict(set=v[0], tp=tp, M=m, K=k, N=n, wcol=wcol, site=" ".join(v[6:])))
    return rows


def within(shapes, deadline_s):
    """The shapes, until `deadline_s` seconds (0: none) have passed since the first began."""
    t0 = time.perf_counter()
    for i, s in enumerate(shapes):
        if i and deadline_s and time.perf_counter() - t0 > deadline_s:
            print(f"deadline of {deadline_s} s reached: {i} of {len(shapes)} shapes done")
            return
        yield s


def flop(s):
    return 2.0 * s["M"] * s["K"] * s["N"]


def geomean(v):
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


# The canary's parts: name -> the library call (calls, join_every) -> wrong elements (-1: a wait
# gave up). The tile kernel: 2 ranks x 1024 rows, N = 1152 (9 flag columns: a 256-wide tile's
# second half past N), K = 256; the comm kernel: 1 Mi bf16 per block in 4 chunks, 8 CTAs a rank;
# the chunked schedule's pushes (comm kernel with 4 senders, copy engine): 1 Mi bf16 per block in
# 4 chunks.
CANARY_PARTS = {
    "tile": lambda lib, c, j: lib.tl_canary_tile(c, 1024, 1152, 256, j),
    "comm reduce-push": lambda lib, c, j: lib.tl_canary_comm(c, 1 << 20, 4, 8, 1, j),
    "comm senders/receivers": lambda lib, c, j: lib.tl_canary_comm(c, 1 << 20, 4, 8, 0, j),
    "chunked, comm kernel": lambda lib, c, j: lib.tl_canary_chunked(c, 1 << 20, 4, 4, j),
    "chunked, copy engine": lambda lib, c, j: lib.tl_canary_chunked(c, 1 << 20, 4, 0, j),
}


def cmd_canary(a, lib):
    """Each part in a child process of its own (``--part``), bounded by ``--part-timeout-s``: a
    part that hangs (the comm canary did, issue 25: the probe's finish never zeroed the
    reduce-push tickets) is reported as such and the others still run."""
    if a.part:
        bad = CANARY_PARTS[a.part](lib, a.calls, a.join_every)
        print(f"PART {a.part}: {bad}", flush=True)
        return 0
    t0 = time.perf_counter()
    results = []
    for name in a.parts.split(",") if a.parts else CANARY_PARTS:
        cmd = [sys.executable, os.path.abspath(__file__), "canary", "--part", name,
               "--calls", str(a.calls), "--join-every", str(a.join_every)]  # fmt: skip
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.part_timeout_s)
            out = p.stdout + p.stderr
            got = [ln for ln in out.splitlines() if ln.startswith(f"PART {name}: ")]
            bad = int(got[-1].rsplit(" ", 1)[1]) if got else None
            why = None if got else f"no result (exit {p.returncode})"
        except subprocess.TimeoutExpired as e:
            out = e.stdout or ""
            out = out.decode(errors="replace") if isinstance(out, bytes) else out
            bad, why = None, f"TIMED OUT after {a.part_timeout_s:.0f} s"
        print(out.rstrip(), flush=True)
        results.append((name, bad, why, time.perf_counter() - t))
    ok = all(bad == 0 for _, bad, _, _ in results)
    print(
        f"TILE CANARY {'PASSED' if ok else 'FAILED'}: "
        + ", ".join(
            f"{name} {a.calls} calls "
            + (why if why else "wait gave up" if bad < 0 else f"{bad} wrong")
            + f" ({dt:.1f} s with start-up)"
            for name, bad, why, dt in results
        )
        + f" ({time.perf_counter() - t0:.1f} s)"
    )
    return 0 if ok else 1


def cmd_live(a, lib):
    shapes = [s for s in read_shapes(a.shapes) if flop(s) >= JUDGED_FLOP and s["M"] % 512 == 0]
    if a.limit:
        shapes = shapes[: a.limit]
    cache = tempfile.mkdtemp(prefix="tile_live_cache")
    rows = []
    print(
        "live waits: 2 ranks (n = 2) on half the SMs each vs two cuBLASLt GEMMs on half each, "
        "per-rank problem M x K x N; ratio = makespan / cuBLASLt pair's (median of 7 rounds); "
        "wait proxy = rank's mode-0 minus mode-1 kernel time, us"
    )
    for s in within(shapes, a.deadline_s):
        out = (ctypes.c_double * 24)()
        e, sw = ctypes.c_int(), ctypes.c_int()
        rc = lib.tl_live(s["M"], s["K"], s["N"], cache.encode(), out, e, sw)
        row = dict(s, pick_entry=e.value, swizzle=sw.value, delays={})
        line = f"{s['set']:<9} {s['M']:>6}x{s['K']:>6}x{s['N']:>6} e{e.value} sw{sw.value} |"
        for di, d in enumerate(DELAYS_US):
            o = out[8 * di : 8 * di + 8]
            row["delays"][str(d)] = dict(
                ms_cublaslt_pair=o[0], ms_prod_pair=o[1], ms_solo_pair=o[2],
                rank_ms_prod=[o[3], o[4]], rank_ms_solo=[o[5], o[6]], spread=o[7],
                ratio=o[1] / o[0], solo_ratio=o[2] / o[0],
                wait_proxy_us=[(o[3] - o[5]) * 1e3, (o[4] - o[6]) * 1e3],
            )  # fmt: skip
            r = row["delays"][str(d)]
            line += (
                f" {d}us: {r['ratio']:.3f} (solo {r['solo_ratio']:.3f}) wait "
                f"{r['wait_proxy_us'][0]:.0f}/{r['wait_proxy_us'][1]:.0f} |"
            )
        print(line + (" A WAIT GAVE UP" if rc else ""))
        rows.append(row)
        save(a.json, dict(tool="tools/probes/tile_live.py live", date=now(), rows=rows))
    sets = sorted({r["set"] for r in rows}, key=[r["set"] for r in rows].index)
    for st in sets:
        for d in DELAYS_US:
            rs = [r["delays"][str(d)] for r in rows if r["set"] == st]
            print(
                f"TILE LIVE {st:<9} delay {d:>2} us ({len(rs)} judged shapes): prod pair / "
                f"cuBLASLt pair {geomean([r['ratio'] for r in rs]):.3f} geomean (max "
                f"{max(r['ratio'] for r in rs):.3f}), solo pair "
                f"{geomean([r['solo_ratio'] for r in rs]):.3f}"
                f"; wait proxy median rank 0 / 1: "
                f"{statistics.median(r['wait_proxy_us'][0] for r in rs):.0f} / "
                f"{statistics.median(r['wait_proxy_us'][1] for r in rs):.0f} us"
            )
    return 0


def now():
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())


def save(path, doc):
    """Writes the JSON after every shape (a run cut short keeps what it measured)."""
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(path + ".tmp", path)


NAMES = ["xla", "cublaslt", "plain", "solo", "prod", "plain:entry0", "prod:entry0"]


def xla_programs(s, r):
    """XLA's jitted GEMM of shape `s` (x @ w.T for a column-major w) on r operand pairs drawn as
    the library's are (uniform in [-1, 1): tensor cores draw data-dependent power, and this GPU
    runs power-capped): (one GEMM, r GEMMs in one call each after the last, xs, ws)."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(s["M"] * 7 + s["K"] * 3 + s["N"]), 2 * r)
    w_shape = (s["N"], s["K"]) if s["wcol"] else (s["K"], s["N"])

    def draw(key, shape):
        return jax.random.uniform(key, shape, jnp.bfloat16, -1.0, 1.0)

    xs = [draw(keys[2 * i], (s["M"], s["K"])) for i in range(r)]
    ws = [draw(keys[2 * i + 1], w_shape) for i in range(r)]

    def mm(x, w):
        return jnp.matmul(x, w.T) if s["wcol"] else jnp.matmul(x, w)

    def chain(xs, ws):  # GEMM i + 1 after GEMM i (a barrier, no work): never concurrent
        ys = []
        for x, w in zip(xs, ws, strict=True):
            if ys:
                x, _ = jax.lax.optimization_barrier((x, ys[-1]))
            ys.append(mm(x, w))
        return ys

    return jax.jit(mm), jax.jit(chain), xs, ws


def xla_timers(s, est_ms):
    """XLA's GEMM of shape `s` (xla_programs) timed two ways: "xla", one jitted call per GEMM
    (what a program pays, dispatch included), and "xla_batched", R GEMMs per call (the dispatch
    amortised; R = 1 where a GEMM takes >= 1 ms). Returns {name: sample}, sample(reps) -> wall
    ms per GEMM of `reps` calls from an idle device to completion."""
    import jax

    r = 1 if est_ms >= 1.0 else min(8, max(2, int(2.0 / max(est_ms, 0.05))))
    one, many, xs, ws = xla_programs(s, r)

    def timer(fn, args, per):
        jax.block_until_ready(fn(*args))  # compiled (and autotuned) before any sample

        def sample(reps):
            t = time.perf_counter()
            for _ in range(reps):
                y = fn(*args)
            jax.block_until_ready(y)
            return (time.perf_counter() - t) * 1e3 / (reps * per)

        return sample

    timers = {"xla": timer(one, (xs[0], ws[0]), 1)}
    timers["xla_batched"] = timer(many, (xs, ws), r) if r > 1 else timers["xla"]
    return timers


def time_shape(lib, s, cache):
    """One shape of the reference table: the pick chosen first, then 7 interleaved rounds."""
    h = lib.tl_ref_open(s["tp"], s["M"], s["K"], s["N"], s["wcol"])
    sw, secs, ev = ctypes.c_int(), ctypes.c_double(), ctypes.c_double()
    pick = lib.tl_ref_choose(h, cache.encode(), sw, secs).decode()

    def lib_sample(v, reps):
        ms = lib.tl_ref_run(h, v, reps, ev)
        if ms < 0:
            raise SystemExit(f"{s}: variant {NAMES[v + 1]} failed")
        return ms

    est = lib_sample(0, 2)
    reps = max(2, min(20, int(5.0 / max(est, 1e-3))))
    xla = xla_timers(s, est)
    xla["xla"](max(2, reps // 4))
    xla["xla_batched"](max(2, reps // 4))
    for v in range(6):
        lib_sample(v, max(2, reps // 4))
    for _ in range(2):  # BENCHMARKS.md: a row whose baseline moved > 5 % is run again
        samples = {k: [] for k in NAMES + ["xla_batched", "xla_again"]}
        ev_ms = {k: [] for k in NAMES[1:]}
        for _ in range(7):
            samples["xla"].append(xla["xla"](reps))
            samples["xla_batched"].append(xla["xla_batched"](reps))
            for v in range(6):
                samples[NAMES[v + 1]].append(lib_sample(v, reps))
                ev_ms[NAMES[v + 1]].append(ev.value)
            samples["xla_again"].append(xla["xla"](reps))
        med = {k: statistics.median(v) for k, v in samples.items()}
        noisy = abs(med["xla_again"] / med["xla"] - 1) > 0.05
        if not noisy:
            break
    lib.tl_ref_close(h)
    spread = {k: (max(v) - min(v)) / med[k] for k, v in samples.items()}
    xla_ms = min(med["xla"], med["xla_batched"])
    ref = min(xla_ms, med["cublaslt"])
    row = dict(
        op="matmul_reduce_scatter", tp=s["tp"], dtype="bfloat16", M=s["M"], K_local=s["K"],
        N=s["N"], w_colmajor=s["wcol"], set=s["set"], site=s["site"], pick=pick,
        swizzle=sw.value, choose_s=round(secs.value, 3),
        reference_is="xla" if xla_ms < med["cublaslt"] else "cublaslt",
        ms=dict(reference=ref, **med),
        event_ms={k: statistics.median(v) for k, v in ev_ms.items()},
        spread=spread, noisy=noisy,
    )  # fmt: skip
    print(
        f"{s['set']:<18} {s['site']:<15} tp {s['tp']} {s['M']:>6}x{s['K']:>6}x{s['N']:>6}"
        f"{' wcol' if s['wcol'] else ''} {flop(s):.1e} | xla {med['xla']:.3f} batched "
        f"{med['xla_batched']:.3f} cublaslt "
        f"{med['cublaslt']:.3f} (ref {row['reference_is']}) | {pick} sw{sw.value} plain "
        f"{med['plain'] / ref:.3f} solo {med['solo'] / ref:.3f} prod {med['prod'] / ref:.3f} "
        f"| e0 plain {med['plain:entry0'] / ref:.3f} prod {med['prod:entry0'] / ref:.3f} | "
        f"spread max {max(spread.values()):.0%}{' NOISY' if noisy else ''} | "
        f"choose {secs.value:.2f} s"
    )
    return row


def cmd_ref(a, lib):
    import jax

    shapes = read_shapes(a.shapes)
    if a.sites:
        sys.path.insert(0, os.path.join(ROOT, "tools"))
        import tile_paper

        sites = tile_paper.layer_sites()[0]
        shapes = [
            dict(set=st, tp=tp, M=m, K=k, N=n, wcol=wcol, site=site)
            for st, tp, m, k, n, wcol, site in sites
        ] + shapes  # first: the layer budget needs them all
    if a.judged_only:
        shapes = [s for s in shapes if flop(s) >= JUDGED_FLOP]
    cache = tempfile.mkdtemp(prefix="tile_ref_cache")
    rows = []
    print(
        "per shape, wall ms per call (7 interleaved rounds, median; every sample starts on an idle "
        "device and ends at device completion): reference = min(XLA jnp.matmul, searched "
        "cuBLASLt); ratios against it"
    )
    doc = dict(
        machine="1x " + jax.devices()[0].device_kind, date=now(), jax_version=jax.__version__,
        tool="tools/probes/tile_live.py ref (tools/probes/tile_live.cu)",
        timing="wall clock per sample (reps back-to-back calls from an idle device to device "
        "completion), variants of one shape interleaved, 7 rounds; ms = median; reference = "
        "the faster of XLA's jitted jnp.matmul and the GEMM runner's searched cuBLASLt plan, "
        "timed in the same rounds; plain = mode 2, solo = mode 1, prod = mode 0 on the "
        "emulated group; event_ms: the library's variants by CUDA events",
        rows=rows,
    )  # fmt: skip
    for s in within(shapes, a.deadline_s):
        rows.append(time_shape(lib, s, cache))
        save(a.json, doc)
    for st in sorted({r["set"] for r in rows}, key=[r["set"] for r in rows].index):
        rs = [r for r in rows if r["set"] == st and flop(dict(r, K=r["K_local"])) >= JUDGED_FLOP]
        if not rs:
            continue

        def g(k, rs=rs):
            return geomean([r["ms"][k] / r["ms"]["reference"] for r in rs])

        print(
            f"TILE REF geomean {st:<18} judged ({len(rs):2d}): xla/ref {g('xla'):.3f} (batched "
            f"{g('xla_batched'):.3f}) cublaslt/ref "
            f"{g('cublaslt'):.3f} (XLA the reference on "
            f"{sum(r['reference_is'] == 'xla' for r in rs)}) | pick plain/ref {g('plain'):.3f} "
            f"solo/ref {g('solo'):.3f} prod/ref {g('prod'):.3f} | entry 0 plain/ref "
            f"{g('plain:entry0'):.3f} prod/ref {g('prod:entry0'):.3f}"
        )
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("canary")
    c.add_argument("--calls", type=int, default=10000)
    c.add_argument("--join-every", type=int, default=4, help="both streams start together every")
    c.add_argument("--part", help="run this part here (the parent runs each in a child)")
    c.add_argument("--parts", default="", help="the parts to run, comma-separated (default all)")
    c.add_argument("--part-timeout-s", type=float, default=60.0, help="each part's bound")
    for name in ("live", "ref"):
        q = sub.add_parser(name)
        q.add_argument("shapes")
        q.add_argument("--json")
        q.add_argument("--deadline-s", type=float, default=0)
        q.add_argument("--limit", type=int, default=0)
        if name == "ref":
            q.add_argument("--sites", action="store_true")
            q.add_argument("--judged-only", action="store_true")
    a = p.parse_args()
    if a.cmd == "ref":  # JAX's client first, on the device's primary context the library shares
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import jax

        jax.devices()
    if a.cmd == "canary" and not a.part:  # the parts run in children, each loading the library
        return cmd_canary(a, None)
    lib = load_lib()
    return {"canary": cmd_canary, "live": cmd_live, "ref": cmd_ref}[a.cmd](a, lib)


if __name__ == "__main__":
    sys.exit(main())
