"""The tile probes' CPU-side logic: tools/tile_paper.py's paper columns and layer budget, and
tools/probes/tile_live.py's shape files (the GPU parts run on the GPU: gpu_check.sh --canary,
--live-waits, --tile-ref)."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tools"), os.path.join(ROOT, "tools", "probes")]

import tile_live  # noqa: E402
import tile_paper  # noqa: E402


def test_t_comm_and_demand():
    # tp 2, 8192 x 4096: half of 2 * M * N bytes (64 MiB) over 370 GB/s
    assert tile_paper.t_comm_ms(2, 8192, 4096) == pytest.approx(8192 * 4096 / 370e9 * 1e3)
    # tp 4 sends 3/4 of it; the foreign phase's demand is t_comm / t * n / (n - 1)
    assert tile_paper.t_comm_ms(4, 8192, 4096) == pytest.approx(1.5 * 8192 * 4096 / 370e9 * 1e3)
    t = tile_paper.t_comm_ms(4, 8192, 4096)
    assert tile_paper.nvlink_demand(4, 8192, 4096, t) == pytest.approx(4 / 3)


def test_run21_sites_are_the_layers_tuned_shapes():
    sites, budget = tile_paper.layer_sites()
    assert len(sites) == 12 and set(budget) == {
        "run21-8b",
        "run21-70b-tp8share",
        "run21-70b",
    }
    # the 8B layer: out-proj and down-proj forward (w row-major), dx of Q/K/V and gate/up
    assert [s[1:6] for s in sites if s[0] == "run21-8b"] == [
        (2, 8192, 2048, 4096, 0),
        (2, 8192, 7168, 4096, 0),
        (2, 8192, 6144, 4096, 1),
        (2, 8192, 14336, 4096, 1),
    ]
    plain, bound = budget["run21-8b"]
    assert plain - bound == pytest.approx(14.7256 - 13.7501, abs=1e-3)


def test_a_site_that_is_not_tuned_is_an_error(tmp_path):
    with open(tile_paper.LAYERS_JSON) as f:
        doc = json.load(f)
    doc["rows"][0]["d_model"] = 2048  # its sites no longer match the layer's tuned shapes
    bad = tmp_path / "layers.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="not among the tuned"):
        tile_paper.layer_sites(str(bad))


def test_layer_budget_line(capsys):
    sites, budget = tile_paper.layer_sites()
    rows = []
    for st, tp, m, k, n, wcol, site in sites:
        if st != "run21-8b":
            continue
        ms = dict(reference=1.0, plain=1.01, solo=1.05, prod=1.1)  # 0.1 ms over per site
        rows.append(dict(set=st, site=site, tp=tp, M=m, K_local=k, N=n, w_colmajor=wcol,
                         pick="e", swizzle=8, reference_is="xla", ms=ms))  # fmt: skip
    tile_paper.report(rows, budget)
    out = capsys.readouterr().out
    gap = budget["run21-8b"][0] - budget["run21-8b"][1]
    assert f"leaves {1 - 0.4 / gap:.2f} of it" in out
    # the out-projection (8192 x 4096 bf16 out, tp 2): 0.0907 ms on the link + 1.1 / 2 < 1.1
    assert tile_paper.with_link_ms(rows[0]) == pytest.approx(1.1)
    row = dict(rows[0], ms=dict(rows[0]["ms"], prod=0.1))  # a kernel faster than its link
    assert tile_paper.with_link_ms(row) == pytest.approx(8192 * 4096 / 370e9 * 1e3 + 0.05)
    assert "LAYER BUDGET run21-70b: no timed sites" in out


def test_the_menu_tables_rows_are_read_too(capsys):
    """tile_rs_probe's table (cuBLASLt the only reference, no layer sites): paper columns for
    each row, the judged rows' geomean, no layer budget."""
    ms = dict(reference=1.0, plain=1.02, solo=1.05, prod=1.08)
    rows = [dict(set="project", tp=2, M=8192, K_local=4096, N=8192, pick="pp128x128c2x1",
                 swizzle=8, ms=ms)]  # fmt: skip
    tile_paper.report(rows, {})
    out = capsys.readouterr().out
    assert "ref 1.000 (cublaslt) pp128x128c2x1 sw8 plain 1.020" in out
    assert "TILE PAPER project: 1 judged rows" in out and "prod/ref 1.080" in out
    assert "LAYER BUDGET" not in out


def test_shape_files_and_deadline(tmp_path):
    f = tmp_path / "shapes.txt"
    f.write_text("project 2 8192 4096 8192\nrun21-8b 2 8192 6144 4096 1 bwd dx qkv\n\n")
    rows = tile_live.read_shapes(str(f))
    assert rows[0] == dict(set="project", tp=2, M=8192, K=4096, N=8192, wcol=0, site="")
    assert rows[1]["wcol"] == 1 and rows[1]["site"] == "bwd dx qkv"
    assert list(tile_live.within(rows, 0)) == rows
    assert list(tile_live.within(rows, 1e-9)) == rows[:1]  # the first always runs


@pytest.mark.parametrize("wcol", [0, 1])
def test_xla_programs_compute_each_pairs_gemm(wcol):
    import numpy as np

    s = dict(M=32, K=16, N=8, wcol=wcol)
    one, many, xs, ws = tile_live.xla_programs(s, 3)
    assert xs[0].shape == (32, 16) and ws[0].shape == ((8, 16) if wcol else (16, 8))
    for x, w, y in zip(xs, ws, many(xs, ws), strict=True):
        wf = np.asarray(w, np.float32)
        want = np.asarray(x, np.float32) @ (wf.T if wcol else wf)
        np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2e-2, atol=2e-2)
        np.testing.assert_array_equal(np.asarray(one(x, w)), np.asarray(y))


def test_xla_timers_time_the_same_gemm_both_ways():
    s = dict(M=64, K=32, N=16, wcol=1)
    timers = tile_live.xla_timers(s, est_ms=0.1)  # a short GEMM: 8 pairs per batched call
    assert set(timers) == {"xla", "xla_batched"} and timers["xla"] is not timers["xla_batched"]
    assert all(t(2) > 0 for t in timers.values())
    one = tile_live.xla_timers(s, est_ms=2.0)  # a long GEMM: no batch, the same timer
    assert one["xla_batched"] is one["xla"]
