"""explain on the real GPU: two processes (one GPU each; on a one-GPU machine both share GPU 0)
check three cases of tests/idioms.py (tests/gpu/explain_worker.py): explain's verdict for this
machine equals the jaxoverlap custom calls in the compiled program, and the rewritten program
computes the original's values. Skips without a GPU (JAXOVERLAP_REQUIRE_GPU=1: fails)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

WORKER = os.path.join(os.path.dirname(__file__), "explain_worker.py")


def test_explain_verdicts_match_the_compiled_program(gpus_any):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(p), "2", str(port), str(p % len(gpus_any))],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for p in range(2)
    ]  # fmt: skip
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("explain worker hung past 300 s:\n" + procs[0].communicate()[0][-4000:])
    for out in outs:
        for case in ("scaling_book", "seqax", "flax_nnx"):
            assert f"{case} OK" in out, out[-6000:]
