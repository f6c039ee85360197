"""Fused groups that span processes (one process per GPU; jaxoverlap/xproc.py): two processes
joined by jax.distributed, each driving one GPU (on a one-GPU machine both drive GPU 0, where
the kernels time-slice), run every fused op with backend="fused" (tests/gpu/xproc_worker.py):
the fused custom call is compiled in, results match a float32 reference; a peer that compiled
but never runs, or is killed, makes the other time out naming it and refuse later calls, with
XLA work still running; a peer that never lowers makes the other's lowering fail naming it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.gpu import xproc_training

pytestmark = pytest.mark.gpu

WORKER = os.path.join(os.path.dirname(__file__), "xproc_worker.py")


def _run(mode, *, timeout=240, env=(), setup=None, worker=WORKER, log_dir=None):
    """Runs ``worker`` (xproc_worker.py or another two-process worker: tests/gpu/order_worker.py)
    in two processes with ``mode``; returns their outputs (stdout + stderr). ``log_dir``: each
    process writes to ``<log_dir>/<mode>.<process>.log`` as it runs (what a run cut from outside
    leaves behind), read back at the end."""
    import jax

    gpus = len(jax.devices("gpu"))
    if setup is not None:
        os.makedirs(setup, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.getcwd(),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",  # two processes may share one GPU
        "XPROC_STACKS_AFTER_S": str(max(timeout - 20, 10)),  # a hang shows where it is
        **dict(env),
    }
    logs = [os.path.join(log_dir, f"{mode}.{p}.log") if log_dir else None for p in range(2)]
    sinks = [open(log, "w") if log else subprocess.PIPE for log in logs]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(p), "2", str(port), str(p % gpus), mode],
            stdout=sinks[p],
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for p in range(2)
    ]

    def output(i, q, **kw):
        out = q.communicate(**kw)[0]
        if logs[i] is None:
            return out
        sinks[i].close()
        with open(logs[i]) as f:
            return f.read()

    outs = []
    for i, p in enumerate(procs):
        try:
            outs.append(output(i, p, timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            tails = [f"--- process {j}:\n{output(j, q)[-4000:]}" for j, q in enumerate(procs)]
            pytest.fail(f"xproc worker ({mode}) hung past {timeout} s\n" + "\n".join(tails))
    return outs


OPS = [
    "matmul_reduce_scatter",
    "all_gather_matmul",
    "matmul_all_reduce",
    "matmul_reduce_scatter_ce",
    "matmul_reduce_scatter_tile",  # Config(schedule="tile"): the epilogue communicates
    "matmul_reduce_scatter_tile_3d",  # ... over a middle dimension
    "matmul_reduce_scatter_cols",  # the last dimension (jaxoverlap/fused/last_dim.py)
    "matmul_reduce_scatter_cols_3d",
    "all_gather_matmul_k",  # along K: a float32 sum, bitwise XLA's single GEMM here
    "all_gather_matmul_k_3d",
    "gemm_search",  # the plans those calls made: algorithms timed, none failed
    "tma_reduce_scatter",  # the standalone TMA reduce-scatter (jaxoverlap_rs_v2)
]


def _results(out):
    return {ln.split(" ")[0]: ln for ln in out.splitlines() if " OK" in ln or " FAILED" in ln}


@pytest.mark.parametrize("op", OPS)
def test_ops_across_processes(gpus_any, op, xproc_ops):
    for rank, out in enumerate(xproc_ops):
        line = _results(out).get(op)
        assert line and " OK" in line, f"process {rank}: {line}\n{out[-3000:]}"


@pytest.fixture(scope="module")
def xproc_ops():
    return _run("ops")


@pytest.mark.parametrize("op", OPS)
def test_ops_across_processes_other_shapes(gpus_any, op, xproc_ops_other):
    """Every op and variant again at a second set of shapes, unlike the tests' own
    (xproc_worker.SHAPES["other"]: M, K, N = 1536, 1280, 768)."""
    for rank, out in enumerate(xproc_ops_other):
        line = _results(out).get(op)
        assert line and " OK" in line, f"process {rank}: {line}\n{out[-3000:]}"


@pytest.fixture(scope="module")
def xproc_ops_other():
    return _run("ops", env={"XPROC_SHAPES": "other"})


TILE_CASES = "matmul_reduce_scatter_tile,matmul_reduce_scatter_tile_3d"


def test_every_tile_entry_across_processes(gpus_any):
    """Issue 23: every entry of the tile menu, with every store path its selection can pick
    (kernels/tile_rs.cu, kPpAltEpi; the ping-pong entries' only path in the default build is
    the TMA tensor stores, session 16), forced in both processes
    (JAXOVERLAP_TILE_ENTRY=<entry>:<epi>): the tile cases' values, their HLO and their bits
    repeated. Across processes the peers' staging is CUDA IPC memory, which the tensor stores'
    maps address; the one-process probe (tile_rs_probe check) never has it. A name of no entry
    fails the calls with the menu's names -- the knob is read on this path."""
    from jaxoverlap import runtime

    menu = runtime.native().tile_menu()
    assert menu and menu[0][0] == "128x256c2x1", menu
    variants = []
    for name, alt in menu:
        variants += [(name, 0), *((name, b) for b in (1, 2, 4, 8) if alt & b)]
    bad = []
    for name, epi in dict.fromkeys(variants):
        env = {"JAXOVERLAP_TILE_ENTRY": f"{name}:{epi}", "XPROC_ONLY": TILE_CASES}
        for rank, out in enumerate(_run("ops", env=env)):
            for case in TILE_CASES.split(","):
                line = _results(out).get(case)
                if not line or " OK" not in line:
                    bad.append(f"{name}:{epi} process {rank}: {line}\n{out[-1500:]}")
    assert not bad, "\n".join(bad)
    env = {"JAXOVERLAP_TILE_ENTRY": "no_such_entry", "XPROC_ONLY": TILE_CASES}
    for rank, out in enumerate(_run("ops", env=env)):
        line = _results(out).get("matmul_reduce_scatter_tile")
        assert line and " FAILED" in line and "128x256c2x1" in line, f"{rank}: {line}"


@pytest.mark.parametrize("case", ["matmul_reduce_scatter", "matmul_reduce_scatter_tile"])
def test_stalled_peer_process(gpus_any, case):
    out0, _ = _run("stall", timeout=120, env={"XPROC_CASE": case})
    r = _results(out0)
    for tag in ("stall", "refused", "xla_after"):
        assert tag in r and " OK" in r[tag], f"{tag}: {r.get(tag)}\n{out0[-3000:]}"


def test_killed_peer_process(gpus_any):
    """A peer process killed after the workspace was exchanged (its exported buffers still
    mapped here): the call gives up within the timeout naming peer rank 1, NaN output, later
    calls refused, XLA still runs."""
    out0, _ = _run("killed", timeout=120)
    r = _results(out0)
    for tag in ("stall", "refused", "xla_after"):
        assert tag in r and " OK" in r[tag], f"{tag}: {r.get(tag)}\n{out0[-3000:]}"


GRAPH_CASES = [f"graphs_{t}{s}" for t in ("rs", "rs_ce", "ag") for s in ("", "_scan")]


def _graph_counts(line):
    return dict(kv.split("=", 1) for kv in line.split()[2:])


def test_fused_calls_in_command_buffers(gpus_any, tmp_path):
    """Fused ops among other work, alone and in lax.scan, with the handlers registered
    COMMAND_BUFFER_COMPATIBLE (JAXOVERLAP_COMMAND_BUFFERS=1) and XLA's command buffers on and
    off: every execution repeats its bits and is near the reference; on, XLA captures the calls
    of the scan bodies and replays the graph without running the handler on the host (outside
    a scan XLA may leave a call ungraphed, or re-capture it when fresh outputs change buffer
    addresses); off, one host call per device call; and on and off give the same bits."""
    runs = {}
    for mode, flags in (("on", ""), ("off", " --xla_gpu_enable_command_buffer=")):
        env = {
            "XPROC_DUMP": str(tmp_path / mode),
            "JAXOVERLAP_COMMAND_BUFFERS": "1",
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + flags,
        }
        runs[mode] = _run("graphs", env=env, setup=tmp_path / mode)
    lines = {m: [_results(out) for out in outs] for m, outs in runs.items()}
    report = "\n".join(
        f"{m} process {p}: {r.get(t)}"
        for m in lines
        for p, r in enumerate(lines[m])
        for t in GRAPH_CASES
    )
    for p in range(2):
        r_on, r_off = lines["on"][p], lines["off"][p]
        for tag in GRAPH_CASES:
            for r in (r_on, r_off):
                assert tag in r and " OK" in r[tag], f"{tag}\n{report}\n{runs['on'][p][-3000:]}"
            c_on, c_off = _graph_counts(r_on[tag]), _graph_counts(r_off[tag])
            # every copy-engine signal a stream write (no SM), captured or not (issue 26, R5)
            assert c_on["signal_fallbacks"] == c_off["signal_fallbacks"] == "0", report
            device = int(c_on["device_calls"])
            assert int(c_off["host_calls"]) == device and c_off["captured"] == "0", report
            if tag.endswith("_scan"):  # XLA graphs the body; its buffers keep their addresses
                assert int(c_on["captured"]) >= 1, f"never captured\n{report}"
                assert int(c_on["host_calls"]) < device, f"not replayed\n{report}"
            a = np.load(tmp_path / "on" / f"{tag}.{p}.npy")
            b = np.load(tmp_path / "off" / f"{tag}.{p}.npy")
            assert np.array_equal(a, b), f"{tag}: process {p} differs with command buffers off"


def test_stalled_peer_process_many_calls(gpus_any):
    """16 fused calls of one program launched ahead: after the first timeout the rest give up
    at once (Peers::dead), so the error comes within a few timeouts, not one per call."""
    out0, _ = _run("stall_many", timeout=150)
    r = _results(out0)
    assert "stall_many" in r and " OK" in r["stall_many"], out0[-3000:]


def test_absent_peer_process(gpus_any):
    out0, _ = _run("absent", timeout=120, env={"JAXOVERLAP_SETUP_TIMEOUT_S": "8"})
    r = _results(out0)
    assert "absent" in r and " OK" in r["absent"], out0[-3000:]


@pytest.fixture(scope="module")
def xproc_train():
    return _run("train", timeout=400)


TRAINING_CASES = list(xproc_training.CASES)


@pytest.mark.parametrize("case", TRAINING_CASES)
def test_training_path_across_processes(gpus_any, case, xproc_train):
    """The training path's fused calls (the all-gather that returns x, the column-parallel
    backward, w.T in place, [B, S, D] over S) across two processes against the unsharded
    model (tests/gpu/xproc_training.py)."""
    for rank, out in enumerate(xproc_train):
        line = _results(out).get(case)
        assert line and " OK" in line, f"process {rank}: {line}\n{out[-3000:]}"


def test_training_in_command_buffers(gpus_any):
    """The training path's fused calls (the scanned two-layer MLP's forward and backward among
    them) with the handlers registered COMMAND_BUFFER_COMPATIBLE: XLA captures some of them into
    its command buffers, and every case is still correct and repeats its bits."""
    env = {"JAXOVERLAP_COMMAND_BUFFERS": "1", "XPROC_ONLY": ",".join(TRAINING_CASES[-3:])}
    outs = _run("train", env=env)
    captured = 0
    for rank, out in enumerate(outs):
        for case in TRAINING_CASES[-3:]:
            line = _results(out).get(case)
            assert line and " OK" in line, f"process {rank}: {line}\n{out[-3000:]}"
            captured += int(line.split("captured=")[1].split()[0])
        assert "capture was invalidated" not in out, out[-3000:]
    assert captured > 0, "no fused call was captured: the test checks nothing"


def test_bitwise_equal_to_one_process(gpus, tmp_path):
    """2 processes x 1 GPU against 1 process x 2 GPUs (this pytest process): the same fused
    calls on the same inputs give the same bits (needs 2 GPUs)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    from . import xproc_worker

    outs = _run("ops", env={"XPROC_DUMP": str(tmp_path)})
    mesh = Mesh(np.array(gpus), ("tp",))

    def arr(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    for tag, f, args, *_ in xproc_worker.op_cases(mesh, arr, 60.0):
        y = f(*args)
        shards = sorted(y.addressable_shards, key=lambda s: s.device.id)
        for p, shard in enumerate(shards):
            path = tmp_path / f"{tag}.{p}.npy"
            assert path.exists(), f"{tag}: process {p} wrote nothing\n{outs[p][-2000:]}"
            got = np.asarray(shard.data).view(np.uint16)
            assert np.array_equal(got, np.load(path)), f"{tag}: rank {p} differs"
