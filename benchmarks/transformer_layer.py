"""A tensor-parallel transformer layer's train step: plain JAX vs jaxoverlap vs no communication.

The layer is `examples/transformer_layer.py`'s (Megatron sequence parallelism in shard_map:
all_gather -> Q/K/V, causal `jax.nn.dot_product_attention`, out-projection -> psum_scatter;
all_gather -> SwiGLU gate/up, down -> psum_scatter; RMSNorm, residuals). Per size, timed
round-robin in one process (BENCHMARKS.md protocol), `value_and_grad` of an MSE loss w.r.t. every
parameter:

- `plain`: the model as written (XLA's collectives; timed again at the end as `plain_again`);
- `jaxoverlap`: `jaxoverlap.overlap(model)` with the default config (`backend="auto"`);
- `fused`: the same with `backend="fused"` where every rewritten op can run fused (optional);
- `overlap_xla`: the rewrite with `backend="xla"` (the ops' reference path: what the rewrite
  costs by itself);
- `jit` / `matmul` (optional): the same model as global-view jit code (sharding constraints), with
  plain ``@`` or with `jaxoverlap.matmul`; with ``--windowed``, a child process times `plain` and
  `jit` under XLA's collective-matmul flags (`jit_windowed`: XLA's own overlap, the anchor);
- `nocomm`: the bound -- every collective replaced by a local stand-in of the same shapes behind
  `lax.optimization_barrier` (gather = tile, scatter = sum of the row blocks; their transposes are
  local too), so XLA computes the same GEMMs with no communication.

hidden fraction = (plain - jaxoverlap) / (plain - nocomm): 1 = all exposed communication hidden.

    python benchmarks/transformer_layer.py                  # GPUs: every size
    python benchmarks/transformer_layer.py --sizes 8b --profile-dir /tmp/trace --hlo-dir /tmp/hlo
    python benchmarks/transformer_layer.py --cpu-smoke      # 2 fake CPU devices, tiny sizes
"""

from __future__ import annotations

import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
sys.path[:0] = [HERE, EXAMPLES]

import _common as C  # noqa: E402

# name -> (d_model, heads, ffn): global layer sizes; "tp8share" is one GPU's share of a
# 70B-class layer at tp = 8 (its compute), run at tp = 2 (understates its communication).
SIZES = {
    "8b": (4096, 32, 14336),
    "70b": (8192, 64, 28672),
    "405b": (16384, 128, 53248),
    "70b-tp8share": (8192, 16, 7168),
}
SMOKE_SIZES = {"smoke": (256, 8, 512)}
VARIANTS = ("plain", "jaxoverlap", "fused", "overlap_xla", "nocomm", "jit", "matmul")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_common_args(p, "transformer_layer")
    p.add_argument("--sizes", help=f"comma-separated names of {list(SIZES)} (default: all)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step (default 8192)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument(
        "--variants", default="plain,jaxoverlap,overlap_xla,nocomm", help=f"of {VARIANTS}"
    )
    p.add_argument(
        "--tune", action="store_true", help="tune the overlapped step's ops first (jaxoverlap.tune)"
    )
    p.add_argument(
        "--attention",
        choices=["xla", "cudnn"],
        help="dot_product_attention implementation (default: JAX's pick; cudnn crashed XLA's "
        "compiler on this layer with jax 0.11.2, docs/measurements.md)",
    )
    p.add_argument(
        "--fused-proj",
        action="store_true",
        help="one Q/K/V weight and one gate/up weight (as many models store them)",
    )
    p.add_argument(
        "--windowed",
        action="store_true",
        help="also time the jit form under XLA's collective-matmul flags (child process)",
    )
    p.add_argument("--profile-dir", help="write a jax.profiler trace of plain and jaxoverlap")
    p.add_argument("--hlo-dir", help="write the compiled HLO of every variant")
    a = C.finish_args(p, p.parse_args(argv), target_ms=300.0, quick_target_ms=150.0)
    table = SMOKE_SIZES if a.cpu_smoke else SIZES
    a.size_names = a.sizes.split(",") if a.sizes else list(table)
    for n in a.size_names:
        if n not in table:
            p.error(f"--sizes: unknown size {n!r} (known: {list(table)})")
    a.sizes = {n: table[n] for n in a.size_names}
    a.variants = a.variants.split(",")
    if bad := [v for v in a.variants if v not in VARIANTS]:
        p.error(f"--variants: unknown {bad} (known: {VARIANTS})")
    if "plain" not in a.variants:
        a.variants.insert(0, "plain")
    if a.fused_proj and {"jit", "matmul"} & set(a.variants):
        p.error("--fused-proj: the jit/matmul variants use separate weights")
    if a.cpu_smoke:
        a.tokens = min(a.tokens, 256)
    return a


def no_comm(tp):
    """Local stand-ins of the layer's collectives: same shapes, no communication."""
    import jax.numpy as jnp
    from jax import lax

    def gather(x):
        return lax.optimization_barrier(jnp.concatenate([x] * tp, axis=0))

    def scatter(y):
        y = lax.optimization_barrier(y)
        return y.reshape(tp, y.shape[0] // tp, *y.shape[1:]).sum(0)

    return gather, scatter


def example():
    """examples/transformer_layer.py (same file name as this script: loaded by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "example_transformer_layer", os.path.join(EXAMPLES, "transformer_layer.py")
    )
    if spec.name not in sys.modules:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # before running it: dataclasses look it up
        spec.loader.exec_module(module)
    return sys.modules[spec.name]


def step_fns(jax, mesh, tp, dims, variants, jo):
    L = example()
    plain = L.make_model(dims, mesh)
    models = {
        "plain": plain,
        "jaxoverlap": jo.overlap(plain),
        "fused": jo.overlap(plain, config=jo.Config(backend="fused")),
        "overlap_xla": jo.overlap(plain, config=jo.Config(backend="xla")),
        "nocomm": L.make_model(dims, mesh, comm=no_comm(tp)),
        "jit": L.make_global_model(dims, mesh, use_jaxoverlap=False),
        "matmul": L.make_global_model(dims, mesh, use_jaxoverlap=True),
    }
    return {v: jax.jit(jax.value_and_grad(L.loss_fn(models[v]))) for v in variants}


def measure_size(jax, mesh, tp, name, size, args, seed, jo):
    import jax.numpy as jnp

    L = example()
    d, heads, ffn = size
    seq = min(args.seq, args.tokens)
    dtype = jnp.float32 if args.cpu_smoke else jnp.bfloat16
    attention = args.attention
    dims = L.Dims(
        d, heads, ffn, seq, batch=args.tokens // seq, layers=1, attention=attention,
        fused_proj=args.fused_proj,
    )  # fmt: skip
    k_p, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
    params = L.init_params(dims, k_p, dtype)
    x = jax.random.normal(k_x, (dims.tokens, d), jnp.float32).astype(dtype)
    y = jax.random.normal(k_y, (dims.tokens, d), jnp.float32).astype(dtype)
    args_ = L.place(mesh, params, x, y, dims)
    fns = step_fns(jax, mesh, tp, dims, args.variants, jo)
    tuned = {}
    if args.tune:
        from jaxoverlap import tune

        step = jax.value_and_grad(L.loss_fn(jo.overlap(L.make_model(dims, mesh))))
        tuned = tune.tune_function(step, *args_, progress=lambda s: print("  tune " + s))

    sites, hlo, collectives = {}, {}, {}
    for v, f in fns.items():
        compiled = f.lower(*args_).compile()
        hlo[v] = compiled.as_text()
        sites[v] = sum(hlo[v].count(f'custom_call_target="{t}"') for t in jo_targets(jo))
        collectives[v] = len(_XLA_COLLECTIVE.findall(hlo[v]))
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            with open(os.path.join(args.hlo_dir, f"{name}_{v}.hlo.txt"), "w") as fh:
                fh.write(hlo[v])
    # The rewrite must not change the numbers beyond bf16 rounding.
    ref_loss = float(fns["plain"](*args_)[0])
    bad = []
    for v in fns:
        if v != "nocomm":
            loss = float(fns[v](*args_)[0])
            if abs(loss - ref_loss) > 2e-2 * max(abs(ref_loss), 1e-6):
                bad.append(f"{name}/{v}: loss {loss} vs plain {ref_loss}")

    timed = {v: (f, args_) for v, f in fns.items()}
    timed["plain_again"] = (fns["plain"], args_)
    res = C.bench(timed, samples=args.samples, target_ms=args.target_ms)
    ms = {v: res[v]["ms"] for v in res}
    spread = {v: (max(r["samples_ms"]) - min(r["samples_ms"])) / r["ms"] for v, r in res.items()}
    if args.profile_dir:
        profile(jax, fns, args_, os.path.join(args.profile_dir, name))
    plain, jo_ms, bound = ms["plain"], ms.get("jaxoverlap"), ms.get("nocomm")
    hidden = (
        (plain - jo_ms) / (plain - bound)
        if jo_ms is not None and bound is not None and plain - bound > 1e-9
        else None
    )
    return dict(
        size=name,
        d_model=d,
        ffn=ffn,
        heads=heads,
        tokens=dims.tokens,
        seq=seq,
        attention=attention,
        tuned=tuned,
        tp=tp,
        processes=1,
        dtype=str(jnp.dtype(dtype)),
        ms=ms,
        spread=spread,
        fused_call_sites=sites,
        xla_collectives=collectives,  # all-gathers, reduce-scatters, all-reduces left to XLA
        speedup=C.ratio(plain, jo_ms),
        bound_speedup=C.ratio(plain, bound),
        hidden_fraction=hidden,
        noisy=abs(ms["plain_again"] / plain - 1) > 0.05,
        bad=bad,
    )


_XLA_COLLECTIVE = re.compile(r" (?:all-gather|reduce-scatter|all-reduce)(?:-start)?\(")


def jo_targets(jo):
    from jaxoverlap import fused
    from jaxoverlap.fused import backward as fused_backward

    found = {v for k, v in vars(fused).items() if k.endswith("_TARGET") and isinstance(v, str)}
    return sorted(found | {fused_backward.TARGET})


def profile(jax, fns, args_, path):
    """A trace of a few steps of plain and jaxoverlap (TensorBoard / Perfetto)."""
    os.makedirs(path, exist_ok=True)
    with jax.profiler.trace(path, create_perfetto_trace=True):
        for v in ("plain", "jaxoverlap"):
            if v in fns:
                for _ in range(2):
                    with jax.profiler.TraceAnnotation(v):
                        jax.block_until_ready(fns[v](*args_))
    print(f"wrote a profiler trace to {path}")


def run_windowed_child(args, seed):
    """plain and jit of every size under XLA's collective-matmul flags, in a fresh process
    started before this one touches a GPU; size -> ms."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), "--out", tmp]
        cmd += ["--name", "child", "--variants", "plain,jit", "--seed", str(seed)]
        cmd += ["--sizes", ",".join(args.size_names), "--tokens", str(args.tokens)]
        cmd += ["--seq", str(args.seq), "--samples", str(args.samples)]
        cmd += ["--target-ms", str(args.target_ms)] + (["--cpu-smoke"] if args.cpu_smoke else [])
        cmd += ["--tp", str(args.tp)] if args.tp else []
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {C.WINDOWED_FLAGS}")
        print(f"windowed: child process with XLA_FLAGS={env['XLA_FLAGS'].strip()!r}", flush=True)
        r = subprocess.run(cmd, env=env, timeout=900)
        path = os.path.join(tmp, "child.json")
        if r.returncode != 0 or not os.path.exists(path):
            print(f"windowed child failed (exit status {r.returncode})", flush=True)
            return {}
        with open(path) as f:
            return {row["size"]: row["ms"] for row in json.load(f)["rows"]}


def report(rows, stand_in=False):
    headers = ["size", "tokens", "plain", "jaxoverlap", "overlap_xla", "nocomm", "plain_again"]
    headers += ["speedup", "bound", "hidden", "sites", "xla_coll", "note"]
    body = []
    for r in rows:
        ms, coll = r["ms"], r.get("xla_collectives", {})
        body.append(
            [r["size"], str(r["tokens"])]
            + [C.fmt(ms.get(v)) for v in ("plain", "jaxoverlap", "overlap_xla", "nocomm")]
            + [C.fmt(ms.get("plain_again")), C.fmt(r["speedup"]), C.fmt(r["bound_speedup"])]
            + [C.fmt(r["hidden_fraction"], ".2f"), str(r["fused_call_sites"].get("jaxoverlap"))]
            + ["/".join(str(coll.get(v)) for v in ("jaxoverlap", "plain"))]
            + (["NOISY" if r["noisy"] else ""])
        )
    text = C.table(headers, body)
    text += (
        "\nms = median train step (value_and_grad, forward + backward); speedup = plain / "
        "jaxoverlap; bound = plain / nocomm; hidden = (plain - jaxoverlap) / (plain - nocomm); "
        "sites = fused custom calls in jaxoverlap's compiled step; xla_coll = collectives left to "
        "XLA in jaxoverlap's step / in plain's; NOISY = plain and plain_again "
        "differ by > 5 %."
    )
    return text


def plot(rows, path, title):
    def draw(ax):
        names = [r["size"] for r in rows]
        for i, v in enumerate(("jaxoverlap", "nocomm")):
            ax.bar(
                [j + 0.4 * i for j in range(len(rows))],
                [C.ratio(r["ms"]["plain"], r["ms"].get(v)) or 0 for r in rows],
                width=0.4,
                label=f"plain / {v}",
            )
        ax.axhline(1.0, color="k", lw=0.8)
        ratios = [
            C.ratio(r["ms"]["plain"], r["ms"].get(v)) or 1.0
            for r in rows
            for v in ("jaxoverlap", "nocomm")
        ]
        ax.set_ylim(min(0.9, min(ratios) - 0.02), max(ratios) + 0.03)
        ax.set_xticks([j + 0.2 for j in range(len(rows))], names)
        ax.set_ylabel("speedup over plain JAX")

    return C.save_plot(path, title, rows, (7, 3.5), draw)


def main(argv=None):
    args = parse_args(argv)
    seed = C.fresh_seed(args.seed)
    windowed = run_windowed_child(args, seed) if args.windowed else {}
    jax, mesh, tp, info = C.start(args, seed)
    jo = C.import_jaxoverlap()

    def done(row):
        if row["size"] in windowed:
            w = windowed[row["size"]]
            row["ms"]["plain_windowed_run"], row["ms"]["jit_windowed"] = w["plain"], w["jit"]
            print(f"  XLA collective matmul (child run): plain {w['plain']:.3f} ms, jit "
                  f"{w['jit']:.3f} ms ({w['plain'] / w['jit']:.3f}x)", flush=True)  # fmt: skip
        print(report([row]).split("\n")[2], flush=True)

    rows, crashed = C.measure_rows(
        list(args.sizes.items()),
        lambda item: measure_size(jax, mesh, tp, *item, args, seed, jo),
        done,
        lambda item: item[0],
    )
    text = report(rows)
    print(text)
    doc = C.results_doc(info, tp, seed, args, rows=rows, aborted=crashed)
    C.save(args, "transformer_layer", info, tp, doc, text, lambda p, t: plot(rows, p, t))
    bad = [b for r in rows for b in r["bad"]]
    sys.exit(1 if C.failed(bad, "; ", crashed) else 0)


if __name__ == "__main__":
    main()
