"""Shared pieces of the benchmark scripts: platform setup, timing, tables, JSON and plots.

Nothing here initialises a JAX backend at import time: `setup_platform` must run first, and the
windowed-XLA child process must be started before the parent touches a GPU (JAX preallocates
most of the GPU memory, so two live processes would starve each other).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# NVLink multicast stays off on the shared GPU machines (it can take their GPUs out of service);
# set here so that a script started on its own, and its child processes, keep it off too.
for _var, _val in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_var, _val)

# XLA's own collective matmul (windowed einsum), BENCHMARKS.md's `xla_windowed` anchor. Flags are
# read at start-up: a child process gets them.
WINDOWED_FLAGS = (
    "--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true"
)

# The BENCHMARKS.md shapes, M x K_local x N (also swept by tools/tune_gemm_rs.py).
SHAPES = [
    (8192, 4096, 8192),
    (8192, 14336, 8192),
    (16384, 8192, 8192),
    (4096, 4096, 4096),
    (2048, 8192, 8192),
]

TIMING = (
    "python loop: per sample, N back-to-back calls of the jitted function, then "
    "jax.block_until_ready on the last output, timed with time.perf_counter; methods of one "
    "shape are timed round-robin (sample 1 of every method, then sample 2, ...); ms = median "
    "over samples of (sample time / N)"
)


def add_common_args(p, script: str):
    """The options both scripts share; `finish_args` fills their mode-dependent defaults."""
    p.add_argument("--tp", type=int, help="ranks (default: all devices)")
    p.add_argument("--samples", type=int, help="samples per method (default 9; quick, smoke 5)")
    p.add_argument("--target-ms", type=float, help="length of one sample in ms")
    p.add_argument("--seed", type=int, help="input seed (default: fresh random, recorded)")
    p.add_argument("--quick", action="store_true", help="fewer and shorter samples")
    p.add_argument("--cpu-smoke", action="store_true", help="2 fake CPU devices, tiny sizes")
    p.add_argument("--out", help="results folder (default benchmarks/results; smoke: a temp dir)")
    p.add_argument("--name", help=f"file stem (default {script}_<tp>x<gpu>)")
    p.add_argument(
        "--smoke-stand-in",
        action="store_true",
        help="--cpu-smoke only: time the reference in jaxoverlap's slots, to exercise the "
        "report logic (labelled as a stand-in)",
    )


def finish_args(p, a, target_ms: float, quick_target_ms: float):
    short = a.quick or a.cpu_smoke
    a.samples = a.samples or (5 if short else 9)
    a.target_ms = a.target_ms or (quick_target_ms if short else target_ms)
    if a.smoke_stand_in and not a.cpu_smoke:
        p.error("--smoke-stand-in is only for --cpu-smoke")
    return a


def start(args, seed: int):
    """Platform, mesh and run info, before any measurement; prints the run's first line."""
    jax = setup_platform(args.cpu_smoke)
    mesh, tp = make_mesh(jax, args.tp)
    info = run_info(args.cpu_smoke)
    print(f"{info['machine']}, jax {info['jax_version']}, tp={tp}, seed={seed}", flush=True)
    return jax, mesh, tp, info


def measure_rows(items, measure, done, label):
    """`measure(item)` for each item, then `done(row)` outside the guard; stops at the first
    measurement that raises (e.g. a kernel timeout) and keeps the rows before it. Returns the rows
    and "<label(item)>: <error>" (None when every item was measured)."""
    rows = []
    for item in items:
        try:
            row = measure(item)
        except Exception as e:  # noqa: BLE001 - e.g. a kernel timeout: keep what was measured
            crashed = f"{label(item)}: {type(e).__name__}: {e}"
            print(f"ABORTED at {crashed}", flush=True)
            return rows, crashed
        done(row)
        rows.append(row)
    return rows, None


def results_doc(info: dict, tp: int, seed: int, args, **fields) -> dict:
    """The results JSON: run info, timing set-up, then the script's `fields` in their order."""
    return {
        **info,
        "tp": tp,
        "seed": seed,
        "timing": TIMING,
        "samples": args.samples,
        "target_sample_ms": args.target_ms,
        **fields,
    }


def failed(bad: list[str], sep: str, crashed: str | None) -> bool:
    """Prints the failed checks (joined by `sep`) and the abort; True if there was either."""
    if bad:
        print("FAILED correctness check: " + sep.join(bad))
    if crashed:
        print(f"FAILED: aborted at {short(crashed)}")
    return bool(bad or crashed)


def save(args, script: str, info: dict, tp: int, doc: dict, text: str, plot) -> None:
    """Writes <stem>.json, <stem>.txt (the table) and <stem>.png (if matplotlib is there)."""
    name = args.name or file_stem(script, tp, info["machine"], args.cpu_smoke)
    out = args.out or (
        os.path.join(tempfile.gettempdir(), "jaxoverlap_bench_smoke")
        if args.cpu_smoke
        else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    )
    stem = os.path.join(out, name)
    write_json(stem + ".json", doc)
    with open(stem + ".txt", "w") as f:
        f.write(text + "\n")
    png = plot(stem + ".png", f"{info['machine']} {info['date']}")
    print(f"wrote {stem}.json/.txt" + (" and .png" if png else ""))


def setup_platform(cpu_smoke: bool, cpu_devices: int = 2):
    """Pick the platform before any JAX backend exists (fake CPU devices in smoke mode)."""
    import jax

    if cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    return jax


def shard_map(f, mesh, in_specs, out_specs):
    import jax

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def make_mesh(jax, tp: int | None):
    """A 1-D mesh ("tp",) over the first `tp` devices (default: all)."""
    import numpy as np

    devs = jax.devices()
    tp = tp or len(devs)
    if tp > len(devs):
        sys.exit(f"--tp {tp}: only {len(devs)} devices ({devs[0].device_kind})")
    return jax.sharding.Mesh(np.array(devs[:tp]), ("tp",)), tp


def fresh_seed(seed: int | None) -> int:
    return secrets.randbits(31) if seed is None else seed


def machine_name(cpu_smoke: bool = False) -> str:
    """GPU name and driver from nvidia-smi, else the JAX device kind."""
    if not cpu_smoke and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
            lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
            if lines:
                counts = {ln: lines.count(ln) for ln in lines}
                return "; ".join(f"{n}x {ln}" for ln, n in counts.items())
        except (OSError, subprocess.SubprocessError):
            pass
    import jax

    devs = jax.devices()
    return f"{len(devs)}x {devs[0].device_kind} ({devs[0].platform})"


def file_stem(script: str, tp: int, machine: str, cpu_smoke: bool) -> str:
    """e.g. matmul_reduce_scatter_2xH200 (from "2x NVIDIA H200, 580.159.04")."""
    if cpu_smoke:
        return f"{script}_{tp}xcpu_smoke"
    kind = machine.split(";")[0].split(",")[0].split()[-1]
    return f"{script}_{tp}x{re.sub(r'[^A-Za-z0-9_-]+', '', kind) or 'device'}"


def run_info(cpu_smoke: bool) -> dict:
    import jax
    import jaxlib

    return {
        "machine": machine_name(cpu_smoke)
        + (" [cpu-smoke: fake CPU devices]" if cpu_smoke else ""),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "git_commit": _git_commit(),
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "XLA_FLAGS")},
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _time_once(fn, args, iters: int, sync_each: bool = False) -> float:
    import jax

    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn(*args)
        if sync_each:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3


def bench(fns: dict, *, samples: int, target_ms: float, min_iters: int = 5, max_iters: int = 2000):
    """Times each `name -> (fn, args)` round-robin; returns name -> {ms, iters, samples_ms}.

    Iterations per sample are chosen per function so that one sample lasts about `target_ms`.
    On CPU every call is waited for: XLA:CPU deadlocks in its collectives when hundreds of
    calls are queued on fake devices (seen with jaxlib 0.11.2 on 2 cores).
    """
    import jax

    sync_each = jax.devices()[0].platform == "cpu"
    max_iters = min(max_iters, 20) if sync_each else max_iters

    iters = {}
    for name, (fn, args) in fns.items():
        jax.block_until_ready(fn(*args))  # warm-up (compiled already, but caches, allocator)
        jax.block_until_ready(fn(*args))
        est = _time_once(fn, args, 3, sync_each)
        iters[name] = int(min(max_iters, max(min_iters, math.ceil(target_ms / max(est, 1e-3)))))
    times = {name: [] for name in fns}
    for _ in range(samples):
        for name, (fn, args) in fns.items():
            times[name].append(_time_once(fn, args, iters[name], sync_each))
    return {
        name: {"ms": statistics.median(ts), "iters": iters[name], "samples_ms": ts}
        for name, ts in times.items()
    }


def median_ms(fn, *args, iters: int, batches: int, warmups: int = 1) -> float:
    """The tools' timing: after `warmups` calls, the median over `batches` of the ms per call of
    `iters` back-to-back calls."""
    import jax

    for _ in range(warmups):
        jax.block_until_ready(fn(*args))
    return statistics.median(_time_once(fn, args, iters) for _ in range(batches))


def tools_gemm_inputs(mesh, shape, tp: int):
    """The tools' GEMM inputs (fixed keys, unlike the benchmarks' recorded seed): bf16
    x [M, K_local * tp] ~ N(0, 1) and w [K, N] ~ N(0, 1) / sqrt(K), both split over K."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    m, k_local, n = shape
    kx, kw = jax.random.split(jax.random.key(m + k_local + n))
    k = k_local * tp
    x = jax.device_put(
        jax.random.normal(kx, (m, k), jnp.bfloat16), NamedSharding(mesh, P(None, "tp"))
    )
    w = jax.device_put(
        (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16),
        NamedSharding(mesh, P("tp", None)),
    )
    return x, w


def rel_err(a, b) -> float:
    """max |a - b| / max |b| in f32, on the host (b's maximum floored at 1e-6)."""
    import jax.numpy as jnp
    import numpy as np

    a = np.asarray(a.astype(jnp.float32))
    b = np.asarray(b.astype(jnp.float32))
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def import_jaxoverlap():
    """The jaxoverlap package, from this checkout when it is not installed."""
    try:
        import jaxoverlap
    except ModuleNotFoundError:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import jaxoverlap
    return jaxoverlap


def custom_call_targets(hlo_text: str) -> list[str]:
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


def geomean(xs) -> float | None:
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def ratio(a, b) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


def fmt(v, spec: str = ".3f") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, float) else str(v)


def short(text: str, limit: int = 300) -> str:
    """One line of at most `limit` characters (the JSON keeps the whole message)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([line, "-" * len(line), *body])


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def save_plot(path: str, title: str, rows, figsize, draw):
    """Draws `rows` with `draw(ax)` and writes the PNG; its path, or None (no rows, or no
    matplotlib)."""
    plt = pyplot()
    if plt is None or not rows:
        return None
    fig, ax = plt.subplots(figsize=figsize)
    draw(ax)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None (it is not a jaxoverlap dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the PNG plot (JSON and table are complete)")
        return None
    return plt


def finish_op_benchmark(args, script, info, tp, seed, rows, crashed, report, plot, label, **fields):
    """The op benchmarks' end: table, JSON/PNG, failed checks, --require-fused; the exit status.

    ``report(rows, tp, stand_in) -> (text, geomean)``, ``plot(rows, path, title)``,
    ``label(row) -> "MxKxN"``; ``fields`` go into the JSON (e.g. the fused config).
    """
    import functools

    text, g = report(rows, tp, args.smoke_stand_in)
    doc = results_doc(
        info, tp, seed, args, check_tolerance_rel=fields.pop("tolerance"),
        stand_in=args.smoke_stand_in, **fields, geomean=g, aborted=crashed, rows=rows,
    )  # fmt: skip
    save(args, script, info, tp, doc, text, functools.partial(plot, rows))
    print(text)
    bad = [f"{label(r)} {m}" for r in rows for m, c in r["check"].items() if not c["ok"]]
    if failed(bad, ", ", crashed):
        return 1
    if args.require_fused and any(r["ms"]["jaxoverlap"] is None for r in rows):
        print("FAILED: --require-fused, but the fused path did not run on every shape")
        return 1
    return 0


def plot_vs_gemm(rows, path, title, methods, label, figsize=(11, 4.5)):
    """Bars of each method's time over gemm_only, one group per row (``label(row)``)."""

    def draw(ax):
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            vals = [ratio(r["ms"][m], r["ms"]["gemm_only"]) or 0.0 for r in rows]
            x = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(rows))]
            ax.bar(x, vals, width, label=m)
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="gemm_only (comm. free)")
        ax.set_xticks(range(len(rows)), [label(r) for r in rows], rotation=20, fontsize=7)
        ax.set_ylabel("time / gemm_only (lower is better)")

    return save_plot(path, title, rows, figsize, draw)
