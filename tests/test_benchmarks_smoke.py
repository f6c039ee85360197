"""The benchmark scripts run end to end on 2 fake CPU devices and write the BENCHMARKS.md schema.

`--smoke-stand-in` times the reference composition in the jaxoverlap / TMA slots so that the
reporting paths (ratios, geometric means, best-by-SM-count) run; the numbers mean nothing.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--cpu-smoke", "--smoke-stand-in", "--samples", "2", "--target-ms", "1"]


def run(script, out, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), *FAST, "--out", str(out)]
    r = subprocess.run(
        [*cmd, *extra], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def load(out, stem):
    with open(os.path.join(out, stem + ".json")) as f:
        return json.load(f)


@pytest.mark.parametrize("windowed,scatter", [("off", "rows"), ("on", "rows"), ("on", "last")])
def test_matmul_reduce_scatter_smoke(tmp_path, windowed, scatter):
    stdout = run(
        "matmul_reduce_scatter.py",
        tmp_path,
        "--windowed",
        windowed,
        "--scatter",
        scatter,
        "--shapes",
        "64x32x48",
        "--name",
        "mrs",
    )
    assert "geomean speedup of jaxoverlap over xla" in stdout
    doc = load(tmp_path, "mrs")
    assert {"machine", "date", "jax_version", "rows"} <= doc.keys()
    (row,) = doc["rows"]
    assert (row["M"], row["K_local"], row["N"], row["tp"], row["dtype"]) == (
        64,
        32,
        48,
        2,
        "bfloat16",
    )
    assert row["scatter_dimension"] == (0 if scatter == "rows" else 1)
    assert set(row["ms"]) == {"gemm_only", "xla", "xla_windowed", "rs_only", "jaxoverlap"}
    measured = {"gemm_only", "xla", "rs_only", "jaxoverlap"} | (
        {"xla_windowed"} if windowed == "on" else set()
    )
    for m, v in row["ms"].items():
        assert (v is not None and v > 0) if m in measured else v is None, (m, v)
    assert all(c["ok"] for c in row["check"].values())
    assert row["auto_picks"] == "xla" and row["auto_ms"] > 0  # no fused kernel on CPU
    assert row["gemm_partition_ms"] > 0
    assert doc["geomean"]["jaxoverlap_over_xla"] > 0


def test_rs_bandwidth_smoke(tmp_path):
    stdout = run(
        "rs_bandwidth.py", tmp_path, "--sizes-mb", "0.0625", "--sms", "4,16", "--name", "rsbw"
    )
    assert "TMA with <= 16 SMs" in stdout
    doc = load(tmp_path, "rsbw")
    assert {"machine", "date", "jax_version", "rows"} <= doc.keys()
    (row,) = doc["rows"]
    assert row["nccl"]["busbw_GBs"] > 0
    assert [c["comm_sms"] for c in row["tma"]] == [4, 16]
    assert all(c["busbw_GBs"] > 0 and c["check"]["ok"] for c in row["tma"])
    assert doc["worst_best_tma_busbw_GBs"] > 0


@pytest.mark.parametrize("along", ["rows", "K"])
def test_all_gather_matmul_smoke(tmp_path, along):
    extra = ("--along", along)
    stdout = run("all_gather_matmul.py", tmp_path, "--shapes", "128x64x64", "--name", "agm", *extra)
    assert "geomean speedup of jaxoverlap over xla" in stdout
    doc = load(tmp_path, "agm")
    assert {"machine", "date", "jax_version", "rows"} <= doc.keys()
    (row,) = doc["rows"]
    assert (row["op"], row["M"], row["K"], row["N_local"], row["tp"]) == (
        "all_gather_matmul",
        128,
        64,
        64,
        2,
    )
    assert row["gather_dimension"] == (0 if along == "rows" else "K") and row["dtype"] == "bfloat16"
    assert set(row["ms"]) == {
        "xla",
        "gemm_only",
        "ag_only",
        "jaxoverlap",
        "auto",
        "gemm_part",
        "xla_again",
    }
    assert all(v is not None and v > 0 for v in row["ms"].values()), row["ms"]
    assert all(c["ok"] for c in row["check"].values())
    assert row["auto_picks"] == "xla"  # no fused kernel on CPU


def test_stress_tool_smoke():
    """tools/stress.py runs its scan programs, compares them and reports (reference path)."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "stress.py"), "--cpu-smoke", "--calls", "200"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "STRESS: PASSED" in r.stdout and "fused calls" in r.stdout, r.stdout


def test_matmul_all_reduce_smoke(tmp_path):
    stdout = run("matmul_all_reduce.py", tmp_path, "--shapes", "64x32x48", "--name", "mar")
    assert "geomean speedup of jaxoverlap over xla" in stdout and "ar_only" in stdout
    doc = load(tmp_path, "mar")
    assert {"machine", "date", "jax_version", "rows"} <= doc.keys()
    (row,) = doc["rows"]
    assert (row["op"], row["M"], row["K_local"], row["N"], row["tp"], row["dtype"]) == (
        "matmul_all_reduce",
        64,
        32,
        48,
        2,
        "bfloat16",
    )
    timed = {"xla", "gemm_only", "ar_only", "jaxoverlap", "auto", "gemm_part", "xla_again"}
    assert set(row["ms"]) == timed | {"xla_windowed"}
    assert all(row["ms"][m] > 0 for m in timed) and row["ms"]["xla_windowed"] is None
    assert set(row["check"]) == {"xla", "jaxoverlap", "auto"}
    assert all(c["ok"] for c in row["check"].values())
    assert row["auto_picks"] == "xla"  # no fused kernel on CPU
    assert doc["geomean"]["jaxoverlap_over_xla"] > 0


@pytest.mark.parametrize("processes", [1, 2])
def test_processes_smoke(tmp_path, processes):
    """benchmarks/processes.py in one process (2 fake devices) and under the launcher (2
    processes x 1 device, gloo): rows with the `processes` field, checked results."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    script = [os.path.join(ROOT, "benchmarks", "processes.py"), *FAST, "--out", str(tmp_path)]
    cmd = [sys.executable, *script]
    if processes == 2:
        launch = ["-m", "jaxoverlap.launch", "-n", "2", "--devices-per-process", "1"]
        cmd = [sys.executable, *launch, "--timeout", "100", *script]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = load(tmp_path, f"processes_2x{processes}p_cpu_smoke")
    (row,) = doc["rows"]
    assert doc["processes"] == row["processes"] == processes
    assert (row["M"], row["K_local"], row["N"], row["tp"]) == (64, 32, 48, 2)
    assert all(row["ms"][m] > 0 for m in ("gemm_only", "xla", "rs_only", "jaxoverlap"))
    assert all(c["ok"] for c in row["check"].values()) and set(row["check"]) == {
        "xla",
        "jaxoverlap",
    }


def test_probe_shapes():
    """tools/shapes.py: the project's 10 shapes, >= 24 real-layer shares (every model, layer and
    tp), and seeded draws that are reproducible, new per seed, and runnable by the tile kernel
    (rows per rank a multiple of 256, K and N multiples of 8)."""

    def shapes(*args):
        r = subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", "shapes.py"), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return [line.split() for line in r.stdout.splitlines()]

    rows = shapes()
    assert sum(r[0] == "project" for r in rows) == 10
    layers = [r for r in rows if r[0] == "layers"]
    assert len(layers) >= 24
    assert {int(r[1]) for r in layers} == {2, 4, 8}
    assert {int(r[4]) for r in layers} == {4096, 5120, 8192, 16384}  # every model's d_model
    draws = shapes("--seed", "20261202")
    assert len(draws) == 12 and all(r[0] == "20261202" for r in draws)
    assert draws == shapes("--seed", "20261202") != shapes("--seed", "7")
    for kind, tp, m, k, n in rows + draws:
        tp, m, k, n = int(tp), int(m), int(k), int(n)
        assert m % tp == 0 and (m // tp) % 256 == 0 and k % 8 == 0 and n % 8 == 0
        assert kind == "project" or 4096 <= m <= 16384  # 4k-16k tokens
