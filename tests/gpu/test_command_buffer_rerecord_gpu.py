"""Command buffers re-recorded in one process only (issue 26, R3; tests/gpu/xproc_rerecord.py):
two processes of one fused group, the copy-engine reduce-scatter in a scanned step put in XLA's
command buffers (JAXOVERLAP_COMMAND_BUFFERS=1). Process 1 compiles a fresh program and moves
its buffers between steps, so XLA re-records its graph (its handler runs on the host again)
while process 0 only replays: no false error, every step bitwise equal to the first; then a
stall of process 1 times out once in process 0, naming peer rank 1 and the call by the epoch the
devices counted, not by the hosts' diverged call numbers."""

from __future__ import annotations

import pytest

from .test_xproc_gpu import _results, _run

pytestmark = pytest.mark.gpu


def _counts(line):
    return dict(kv.split("=", 1) for kv in line.split()[2:] if "=" in kv)


def test_rerecord_in_one_process_then_stall(gpus_any):
    outs = _run("rerecord", timeout=150, env={"JAXOVERLAP_COMMAND_BUFFERS": "1"})
    lines = [_results(out) for out in outs]
    report = "\n".join(f"process {p}: {r}" for p, r in enumerate(lines))
    print(report)
    for p, r in enumerate(lines):
        assert "rerecord" in r and " OK" in r["rerecord"], f"{report}\n{outs[p][-3000:]}"
    c0, c1 = (_counts(r["rerecord"]) for r in lines)
    assert int(c0["captured"]) >= 1, f"never captured: the test checks nothing\n{report}"
    assert int(c1["host_calls"]) > int(c0["host_calls"]), (
        f"process 1 did not re-record more often than process 0\n{report}"
    )
    assert "rerecord_stall" in lines[0] and " OK" in lines[0]["rerecord_stall"], (
        f"{report}\n{outs[0][-3000:]}"
    )
