"""The op benchmarks that time xla first and last (xla_again) with backend="auto" as a method of
its own (all_gather_matmul.py, matmul_all_reduce.py): their fused methods, timing and table."""

from __future__ import annotations

import argparse
import contextlib
import json

import _common as C

NOISY = 0.05  # xla vs xla_again beyond this: the row is flagged for a repeat


def parse_args(argv, doc, script, shapes, smoke_shapes, shapes_help, comm_sms=False, extra=None):
    """The options of an interleaved-row script (``comm_sms``: it also takes --comm-sms;
    ``extra(parser)`` adds the script's own); ``args.shapes`` is the list of shape tuples."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(p, script)
    if extra:
        extra(p)
    p.add_argument("--shapes", help=shapes_help)
    p.add_argument("--require-fused", action="store_true", help="fail if the fused path is absent")
    p.add_argument("--chunks", type=int, help="Config.chunks of the fused run (default: auto)")
    if comm_sms:
        p.add_argument(
            "--comm-sms", type=int, help="Config.comm_sms of the fused run (default: auto)"
        )
    a = C.finish_args(p, p.parse_args(argv), target_ms=40.0, quick_target_ms=15.0)
    if a.shapes:
        a.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",")]
    else:
        a.shapes = smoke_shapes if a.cpu_smoke else shapes
    return a


def jaxoverlap_fns(mesh, args, op, in_specs, out_spec, knobs, **op_kwargs):
    """The jitted ``jaxoverlap.<op>(x, w, "tp", **op_kwargs)`` in shard_map: "fused" (with the
    Config ``knobs``), "auto", and "gemm_part" (the fused fn and the switch that makes it run its
    GEMM schedule alone); or a sentence saying why jaxoverlap cannot run at all. With
    --smoke-stand-in the reference runs in the fused slots."""
    try:
        jaxoverlap = C.import_jaxoverlap()
        from jaxoverlap import fused
    except Exception as e:  # noqa: BLE001
        return f"import jaxoverlap failed: {type(e).__name__}: {e}"

    def make(backend):
        cfg = jaxoverlap.Config(backend=backend, **(knobs if backend == "fused" else {}))

        def body(x, w):
            return getattr(jaxoverlap, op)(x, w, "tp", config=cfg, **op_kwargs)

        return C.shard_map(body, mesh, in_specs, out_spec)

    fused_backend = "xla" if args.smoke_stand_in else "fused"
    profile = contextlib.nullcontext if args.smoke_stand_in else fused._gemm_only_for_tools
    return {
        "fused": make(fused_backend),
        "auto": make("auto"),
        "gemm_part": (make(fused_backend), profile),
    }


def add_fused_methods(row, jo, fns, check, operands, stand_in):
    """Adds ``jo["fused"]`` as "jaxoverlap" and ``jo["auto"]`` as "auto" to ``fns`` where they
    compile and ``check(out)`` passes (else a note says why), and the fused GEMM schedule
    without communication (``jo["gemm_part"]``: fn, profile switch) as "gemm_part"."""
    for key, f in (("jaxoverlap", jo["fused"]), ("auto", jo["auto"])):
        try:
            targets = C.custom_call_targets(f.lower(*operands).compile().as_text())
            row["check"][key] = check(f(*operands))
        except Exception as e:  # noqa: BLE001 - the reason is the result
            row["notes"].append(f"{key}: {type(e).__name__}: {e}".strip())
            continue
        ours = [t for t in targets if t.startswith("jaxoverlap")]
        if key == "auto":
            row["auto_picks"] = "fused" if ours else "xla"
        elif not ours and not stand_in:
            row["notes"].append("backend='fused' compiled without a jaxoverlap custom call")
            continue
        if row["check"][key]["ok"]:
            fns[key] = (f, operands)
        else:
            row["notes"].append(f"{key}: WRONG RESULT, not timed")
    if "jaxoverlap" in fns:
        f, profile = jo["gemm_part"]
        with profile():  # read when the call is traced and lowered
            f(*operands)
        fns["gemm_part"] = (f, operands)


def time_interleaved(row, fns, methods, args):
    """Times ``fns`` (xla timed again last as xla_again) into ``row``: ms per method (None where
    not timed), spreads, iterations, samples, and the noisy flag."""
    fns["xla_again"] = fns["xla"]
    res = C.bench(fns, samples=args.samples, target_ms=args.target_ms)
    row["ms"] = {m: res[m]["ms"] if m in res else None for m in methods}
    row["spread"] = {
        m: (max(r["samples_ms"]) - min(r["samples_ms"])) / r["ms"] for m, r in res.items()
    }
    for name, r in res.items():
        row["iters"][name], row["samples_ms"][name] = r["iters"], r["samples_ms"]
    a, b = row["ms"]["xla"], row["ms"]["xla_again"]
    row["noisy"] = bool(abs(a - b) > NOISY * min(a, b))
    if row["noisy"]:
        row["notes"].append(f"NOISY: xla {a:.3f} vs xla_again {b:.3f} ms: repeat this row")
    return row


def interleaved_report(rows, title, label_head, label, methods, stand_in):
    """The table of `time_interleaved` rows (one column per method, then auto's pick, the fused
    spread and the ratios) and the geometric means; (text, geomeans)."""
    jo = "jaxoverlap" + ("[stand-in]" if stand_in else "")
    headers = [label_head, *(jo if m == "jaxoverlap" else m for m in methods)]
    headers += "auto= jo_spread xla/gemm xla/jo jo/gemm xla/auto".split()
    lines = []
    for r in rows:
        ms = r["ms"]
        lines.append(
            [
                label(r),
                *(C.fmt(ms[m]) for m in methods),
                r.get("auto_picks", "-"),
                C.fmt(r["spread"].get("jaxoverlap"), ".2f"),
                C.fmt(C.ratio(ms["xla"], ms["gemm_only"]), ".2f"),
                C.fmt(C.ratio(ms["xla"], ms["jaxoverlap"]), ".2f"),
                C.fmt(C.ratio(ms["jaxoverlap"], ms["gemm_only"]), ".2f"),
                C.fmt(C.ratio(ms["xla"], ms["auto"]), ".2f"),
            ]
        )
    g = {
        "jaxoverlap_over_xla": C.geomean(
            C.ratio(r["ms"]["xla"], r["ms"]["jaxoverlap"]) for r in rows
        ),
        "jaxoverlap_over_gemm_only": C.geomean(
            C.ratio(r["ms"]["jaxoverlap"], r["ms"]["gemm_only"]) for r in rows
        ),
        "auto_over_xla": C.geomean(C.ratio(r["ms"]["xla"], r["ms"]["auto"]) for r in rows),
    }
    n = sum(r["ms"]["jaxoverlap"] is not None for r in rows)
    text = "\n".join(
        [
            title,
            C.table(headers, lines),
            f"geomean speedup of jaxoverlap over xla: {C.fmt(g['jaxoverlap_over_xla'], '.3f')}x, "
            f"jaxoverlap/gemm_only: {C.fmt(g['jaxoverlap_over_gemm_only'], '.3f')} "
            f"({n}/{len(rows)} shapes fused); auto over xla: {C.fmt(g['auto_over_xla'], '.3f')}x",
        ]
    )
    notes = [f"  {label(r)}: {C.short(note)}" for r in rows for note in r["notes"]]
    if notes:
        text += "\nnotes:\n" + "\n".join(dict.fromkeys(notes))
    return text, g


def main(args, script, make_jo, measure, methods, shape_keys, label_head, title, plot_methods,
         **fields):  # fmt: skip
    """A script's run: ``make_jo(mesh)`` (its `jaxoverlap_fns`), then ``measure(jax, mesh, tp,
    shape, args, jo, seed)`` per shape (a row with the ``shape_keys`` and ``methods`` in "ms"),
    the table (``title`` with {tp} filled in, rows labelled ``label_head``), plot (bars of
    ``plot_methods``), JSON; ``fields`` go into the JSON (``tolerance`` and the fused config).
    Returns the exit status."""
    seed = C.fresh_seed(args.seed)
    jax, mesh, tp, info = C.start(args, seed)
    jo = make_jo(mesh)

    def label(r):
        return "x".join(str(r[k]) for k in shape_keys)

    def done(row):
        print(json.dumps({k: row[k] for k in (*shape_keys, "ms", "notes")}), flush=True)

    def report(rows, tp, stand_in):
        return interleaved_report(rows, title.format(tp=tp), label_head, label, methods, stand_in)

    def plot(rows, path, plot_title):
        return C.plot_vs_gemm(rows, path, plot_title, plot_methods, label, (12, 4.5))

    rows, crashed = C.measure_rows(
        args.shapes,
        lambda shape: measure(jax, mesh, tp, shape, args, jo, seed),
        done,
        lambda shape: "x".join(map(str, shape)),
    )
    return C.finish_op_benchmark(
        args, script, info, tp, seed, rows, crashed, report, plot, label, **fields
    )
