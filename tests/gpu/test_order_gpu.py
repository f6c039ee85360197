"""Issue 26, R2 on a GPU: the order of a device's fused calls (jaxoverlap/fused/call.py,
`FusedOrder`: a token from each fused call to the next, `ORDER_FORM`), with two processes
sharing the GPUs (on a one-GPU machine both drive GPU 0; tests/gpu/order_worker.py):

* command buffers on (``JAXOVERLAP_COMMAND_BUFFERS=1``, XLA's default LHS scheduling): two
  ordered calls in a scan body are recorded into a CUDA graph and replayed, values right and
  bitwise repeatable, and the optimized HLO runs them in program order (the barrier form, the
  default: its schedule; the token form: the first call's token result passed to the second);
* the order inverted in one process (the deadlock R2 is about, forced by a test-only inversion):
  it shows once, bounded by the timeout, as NaN and a `FusedCallError` naming the op (or, when
  the peer's give-up releases this process's first call in time, the peer's give-up: both are
  right, order_worker.run_inverted); no wrong finite output; nobody hangs;
* ``--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`` with command buffers on: the fused calls
  are kept out of the concurrent graphs (`jaxoverlap.runtime.command_buffers`, one warning), and
  1,000 executions of two independent fused calls are clean and bitwise equal to the first
  (each process compares its own shards on its GPU: no collective, which NCCL would refuse with
  two ranks on one GPU), reporting progress every 100 and stopping -- failed, saying where --
  before the next hundred would pass the worker's budget (``ORDER_BUDGET_S``, 40 s), well
  inside the test's own timeout.
"""

from __future__ import annotations

import os

import pytest

from .test_xproc_gpu import _results, _run

pytestmark = pytest.mark.gpu

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "order_worker.py")
# This checkout (where this file lies) first: the workers import its jaxoverlap.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATH = os.pathsep.join(dict.fromkeys([ROOT, os.getcwd()]))
FLAG = "--xla_gpu_command_buffer_scheduling_mode"


def _order(mode, timeout=120, **env):
    env = {"PYTHONPATH": PATH, "JAXOVERLAP_ORDER_CALLS": "1", **env}
    # ORDER_LOG_DIR: the workers' whole outputs, written as they run (GPU runs keep them)
    outs = _run(
        mode, timeout=timeout, env=env, worker=WORKER, log_dir=os.environ.get("ORDER_LOG_DIR")
    )
    return outs, [_results(out) for out in outs]


def _ok(outs, results, *tags):
    for p, (out, r) in enumerate(zip(outs, results, strict=True)):
        print(f"process {p}:", *(r.get(tag) for tag in tags), sep="\n  ")  # shown with -s
        for tag in tags:
            assert tag in r and " OK" in r[tag], f"process {p}: {r.get(tag)}\n{out[-4000:]}"


@pytest.fixture(scope="module")
def graphs_then_inverted(gpus_any):
    """One pair of processes (order_worker.py mode ``graphs``): the command buffers, then the
    inversion in process 1 (it leaves the processes' fused calls given up: last)."""
    return _order("graphs", timeout=70, JAXOVERLAP_COMMAND_BUFFERS="1", ORDER_INVERTED="1")


def test_token_chained_calls_in_command_buffers(graphs_then_inverted):
    _ok(*graphs_then_inverted, "hlo_chain", "graphs")


def test_inverted_order_deadlocks_once_bounded(graphs_then_inverted):
    _ok(*graphs_then_inverted, "inverted")


def test_concurrent_command_buffers_keep_the_order(gpus_any):
    flags = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}=CONCURRENT".strip()
    outs, r = _order(
        "concurrent",
        timeout=90,
        JAXOVERLAP_COMMAND_BUFFERS="1",
        XLA_FLAGS=flags,
        ORDER_BUDGET_S="40",
    )
    if any("Unknown flag" in out and FLAG[2:] in out for out in outs):
        pytest.skip(f"this XLA has no {FLAG}: no CONCURRENT command buffers to order")
    _ok(outs, r, "hlo_chain", "concurrent")
    for out in outs:  # the fused calls were kept out of the concurrent graphs, said once
        assert out.count("is ignored for the fused calls") == 1, out[-4000:]
