"""No stray CUDA context (issue 26, R1): the thread that lowers a program exports the workspaces
of groups that span processes (jaxoverlap/xproc.py -> ffi/runtime/xproc.cc: export_rank) and has
no CUDA context of its own. Exporting must not leave it one, nor make the first allocation with
no device chosen (that creates device 0's primary context in every process, whatever its GPU),
and DeviceGuard must restore "no context" as it found it. Checked for every visible GPU from a
fresh native thread (_native._context_check) of a fresh process that has made no CUDA call
before: the driver entry points DeviceGuard loads on its first use must not create one either."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = """
import json
from jaxoverlap import runtime
nat = runtime.native()
print(json.dumps([nat._context_check(o, -(1 << 40) - o) for o, _ in nat.devices()]))
"""


def test_export_and_device_guard_leave_a_fresh_thread_without_context(gpus_any):
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) >= 1, out.stdout
    for ordinal, got in enumerate(results):
        assert got["error"] == "", got
        assert got["before"] == -1, f"a fresh thread had a context: {got}"
        assert got["after_guard"] == -1, f"DeviceGuard left a context on the thread: {got}"
        assert got["after_export"] == -1, f"the export left a context on the thread: {got}"
        assert got["alloc_device"] == ordinal, f"first allocation not on device {ordinal}: {got}"
