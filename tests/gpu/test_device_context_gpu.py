"""No stray CUDA context (issue 26, R1): the thread that lowers a program exports the workspaces
of groups that span processes (jaxoverlap/xproc.py -> ffi/runtime/xproc.cc: export_rank) and has
no CUDA context of its own. Exporting must not leave it one, nor make the first allocation with
no device chosen (that creates device 0's primary context in every process, whatever its GPU),
and DeviceGuard must restore "no context" as it found it. Checked on every visible GPU from a
fresh native thread (_native._context_check)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_export_and_device_guard_leave_a_fresh_thread_without_context(gpus_any):
    from jaxoverlap import runtime

    nat = runtime.native()
    for i, dev in enumerate(gpus_any):
        ordinal = dev.local_hardware_id
        got = nat._context_check(ordinal, -(1 << 40) - i)  # a site no lowering sends
        assert got["error"] == "", got
        assert got["before"] == -1, f"a fresh thread had a context: {got}"
        assert got["after_guard"] == -1, f"DeviceGuard left a context on the thread: {got}"
        assert got["after_export"] == -1, f"the export left a context on the thread: {got}"
        assert got["alloc_device"] == ordinal, f"first allocation not on device {ordinal}: {got}"
