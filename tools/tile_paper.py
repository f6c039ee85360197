"""What two GPUs would add to the one-GPU tile table, on paper (issue 24 item 4).

Reads the reference table's JSON (tools/probes/tile_live.py ref: per shape the reference = the
faster of XLA's jnp.matmul and the GEMM runner's searched cuBLASLt plan, and the pick's plain,
solo and prod times) and prints, per row:

- t_comm / t_gemm, t_comm = (n - 1)/n * 2*M*N bytes / 370 GB/s (one-way NVLink; bf16 output
  reduce-scattered over n ranks), t_gemm = the reference's ms (BENCHMARKS.md "On one GPU": rows
  above 0.8 are judged as plain GEMMs only);
- the foreign phase's NVLink demand: the foreign tiles ((n - 1)/n of the tiles, claimed first)
  send their (n - 1)/n * 2*M*N bytes while the kernel computes them, in about (n - 1)/n of its
  time, so the link must carry 2*M*N / t_prod bytes/s: demand = that / 370 GB/s (> 1: the stores
  would wait for the link, and the kernel with them);
- the layer budget: the reduce-scatter sites of run 21's three layers (tp = 2, 8192 tokens, one
  Q/K/V and one gate/up weight: forward out-projection and down-projection, w row-major;
  backward dx = ct @ w.T of the Q/K/V and gate/up projections, w column-major), the predicted
  step overhead sum(pick prod - reference) over them, against that layer's plain - bound from run
  21 (benchmarks/results/transformer_layer_2xH200.json): left = 1 - overhead / (plain - bound)
  (issue 24: >= 0.8 for the 8B layer, >= 0.4 for the other two); also with each site's time
  raised to what the link allows, max(prod, t_comm + prod / n).

Also reads the one-GPU menu table's JSON (tools/probes/tile_rs_probe.cu time --pick: the
reference there is the searched cuBLASLt plan alone, timed by CUDA events), whose rows carry no
`reference_is` and no w layout: the paper columns for its shapes, no layer budget.

Usage: python tools/tile_paper.py REF_JSON [--layers LAYER_JSON (default: run 21's)]
       python tools/tile_paper.py --sites   (the layer sites, one "set tp M K N wcol site" a line)
"""

from __future__ import annotations

import argparse
import json
import math
import os

NVLINK_BPS = 370e9  # one-way NVLink bandwidth of an H200 pair (BENCHMARKS.md)
HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS_JSON = os.path.join(HERE, "..", "benchmarks", "results", "transformer_layer_2xH200.json")


def t_comm_ms(tp, m, n):
    """(n - 1)/n * 2*M*N bytes over one-way NVLink, in ms."""
    return (tp - 1) / tp * 2 * m * n / NVLINK_BPS * 1e3


def nvlink_demand(tp, m, n, t_kernel_ms):
    """The foreign phase's bytes per second over the link's: 2*M*N / t_kernel / 370 GB/s."""
    return t_comm_ms(tp, m, n) * tp / (tp - 1) / t_kernel_ms


def with_link_ms(row):
    """The fused kernel's time on two GPUs on paper: today's order pushes the foreign tiles'
    bytes while it computes them, so the own tiles (1/n of the kernel) start no earlier than the
    link has carried them: max(prod, t_comm + prod / n)."""
    tp, prod = row["tp"], row["ms"]["prod"]
    return max(prod, t_comm_ms(tp, row["M"], row["N"]) + prod / tp)


def layer_sites(path=LAYERS_JSON):
    """Run 21's reduce-scatter sites: [(layer, tp, M, K, N, w_colmajor, site)], and the layers'
    {name: (plain ms, bound ms)}."""
    with open(path) as f:
        doc = json.load(f)
    sites, budget = [], {}
    for row in doc["rows"]:
        name, d, ffn, tp, tokens = row["size"], row["d_model"], row["ffn"], row["tp"], row["tokens"]
        rows = [
            ("fwd out-proj", d // tp, 0),
            ("fwd down-proj", ffn // tp, 0),
            ("bwd dx qkv", 3 * d // tp, 1),
            ("bwd dx gate/up", 2 * ffn // tp, 1),
        ]
        tuned = {k.rsplit("|", 1)[-1] for k in row.get("tuned", {})}
        for site, k, wcol in rows:
            key = f"{tokens}x{k}x{d}"
            if tuned and key not in tuned:  # the layer's own tuned shapes name its sites
                raise SystemExit(
                    f"{name}: site {site} {key} is not among the tuned {sorted(tuned)}"
                )
            sites.append((f"run21-{name}", tp, tokens, k, d, wcol, site))
        budget[f"run21-{name}"] = (row["ms"]["plain"], row["ms"]["nocomm"])
    return sites, budget


def geomean(v):
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


def report(ref_rows, budget):
    print(
        "per row: tp, M x K x N, w, ref ms (which), pick, plain/ref, solo/ref, prod/ref, "
        "t_comm/t_gemm, the foreign phase's NVLink demand (x 370 GB/s) in today's order (foreign "
        "tiles first) and with own tiles interleaved (one own band per n - 1 foreign bands: the "
        "stores spread over the whole kernel)"
    )
    judged = {}
    for r in ref_rows:
        ms, tp, m, n = r["ms"], r["tp"], r["M"], r["N"]
        ref = ms["reference"]
        tc = t_comm_ms(tp, m, n) / ref
        dem = nvlink_demand(tp, m, n, ms["prod"])
        spread = t_comm_ms(tp, m, n) / ms["prod"]
        if tc > 0.8:
            flag = " -> plain GEMM only: no tile order fits (the link needs longer than the GEMM)"
        elif dem > 0.8:
            flag = " -> plain GEMM only in today's order" + (
                "; interleaved would fit" if spread <= 0.8 else "; interleaving does not fit either"
            )
        else:
            flag = ""
            if 2 * m * r["K_local"] * n >= 1e11:
                judged.setdefault(r["set"], []).append(ms["prod"] / ref)
        print(
            f"  {r['set']:<18} {r.get('site', ''):<15} tp {tp} {m}x{r['K_local']}x{n} "
            f"{'col' if r.get('w_colmajor') else 'row'} ref {ref:.3f} "
            f"({r.get('reference_is', 'cublaslt')}) "
            f"{r['pick']} sw{r['swizzle']} plain {ms['plain'] / ref:.3f} "
            f"solo {ms['solo'] / ref:.3f} prod {ms['prod'] / ref:.3f} | "
            f"t_comm/t_gemm {tc:.2f} demand {dem:.2f} (interleaved {spread:.2f}){flag}"
        )
    for st, v in judged.items():
        print(
            f"TILE PAPER {st}: {len(v)} judged rows within the link (t_comm/t_gemm and demand "
            f"<= 0.8): prod/ref {geomean(v):.3f} geomean, max {max(v):.3f}"
        )
    print()
    for layer, (plain, bound) in budget.items():
        rows = [r for r in ref_rows if r["set"] == layer]
        if not rows:
            print(f"LAYER BUDGET {layer}: no timed sites")
            continue
        over = sum(r["ms"]["prod"] - r["ms"]["reference"] for r in rows)
        over_plain = sum(r["ms"]["plain"] - r["ms"]["reference"] for r in rows)
        over_link = sum(with_link_ms(r) - r["ms"]["reference"] for r in rows)
        gap = plain - bound
        print(
            f"LAYER BUDGET {layer}: {len(rows)} reduce-scatter sites, predicted overhead "
            f"sum(prod - ref) {over:.3f} ms (as plain GEMMs {over_plain:.3f}; with the link's "
            f"time {over_link:.3f}) against plain - bound {gap:.3f} ms (run 21: {plain:.3f} - "
            f"{bound:.3f}): leaves {1 - over / gap:.2f} of it ({1 - over_link / gap:.2f} with "
            f"the link's time)"
        )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("ref_json", nargs="?")
    p.add_argument("--layers", default=LAYERS_JSON)
    p.add_argument("--sites", action="store_true", help="print the layer sites and exit")
    a = p.parse_args()
    sites, budget = layer_sites(a.layers)
    if a.sites or not a.ref_json:
        for s in sites:
            print(" ".join(str(v) for v in s[:6]), s[6].replace(" ", "_"))
        return
    with open(a.ref_json) as f:
        rows = json.load(f)["rows"]
    report(rows, budget)


if __name__ == "__main__":
    main()
