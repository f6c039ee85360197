"""The FusedCall skeleton every fused handler runs in (ffi/handlers/fused_call_skeleton.h),
checked without GPUs: the header is plain C++, compiled here by the system compiler with a fake
runtime that records every call the skeleton makes (tests/native/fused_call_test.cc), and each
scenario's record is held to the protocol order (docs/call-order.md): the device's launch lock
before the workspace, begin_call before any launch, a failure after begin_call through fail_call
returning success, and the releases (lock, capture scope, device) in reverse."""

from __future__ import annotations

import subprocess

import pytest
from harness import native_driver

OPEN = ["save context", "set_device", "capture scope", "device_runtime", "lock"]
RELEASE = ["unlock", "end capture scope", "restore context"]
LAUNCHES = ("preload", "ce_setup", "partition", "fork", "launch", "join")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    exe = native_driver(tmp_path_factory, "fused_call_test.cc")

    def go(scenario):
        """-> ({device: [events]}, {device: (code, message)})"""
        out = subprocess.run([str(exe), scenario], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        events, results = {}, {}
        for ln in out.stdout.splitlines():
            if ln.startswith("result "):
                _, dev, code, *msg = ln.split(" ")
                results[int(dev)] = (int(code), " ".join(msg))
            else:
                dev, ev = ln.split(": ", 1)
                events.setdefault(int(dev), []).append(ev)
        return events, results

    return go


def first(events, prefix):
    return next(i for i, e in enumerate(events) if e.startswith(prefix))


def single(run, scenario, result=(0, ""), device=0):
    """The events of `scenario`'s one call (on `device`), held to the protocol, and its result."""
    events, results = run(scenario)
    assert results == {device: result}, results
    check_protocol(events[device])
    return events[device]


def check_protocol(events):
    """What every call that opened must show, whatever its outcome."""
    opened = [o for e in events for o in OPEN if e.startswith(o)]
    assert opened == OPEN[: len(opened)], events
    # Releases in reverse, after the handler's last statement, for what was acquired.
    tail = events[first(events, "handler returns") + 1 :]
    acquired = {"capture scope": "end capture scope", "lock": "unlock"}  # in open order
    want = [r for o, r in acquired.items() if any(e.startswith(o) for e in events)][::-1]
    assert tail == want + ["restore context"], events
    if any(e.startswith("workspace") for e in events):
        assert first(events, "lock") < first(events, "workspace"), events
    launched = [i for i, e in enumerate(events) if e.startswith(LAUNCHES)]
    if launched:
        assert first(events, "begin_call") < min(launched), events


def test_one_process_two_devices(run):
    events, results = run("one_process_two_devices")
    assert set(events) == {0, 1} and results == {0: (0, ""), 1: (0, "")}
    for d in (0, 1):
        ev = events[d]
        check_protocol(ev)
        streams = f"{200 + 2 * d}/{201 + 2 * d}"
        assert ev == [
            f"handler checks rank={d}",
            "save context",
            f"set_device {d}",
            f"capture scope stream={100 + d} jaxoverlap.test_op",
            f"device_runtime {d}",
            "lock",
            f"workspace site=42 group=0,1 rank={d} bytes=4096 partials=1 gather=0",
            f"begin_call rank={d} run=1234 tag=9",
            "preload",
            "partition comm_sms=16",
            f"error_record {d}",
            "mark the start of the schedule",
            f"schedule rank={d} n=2 timeout_ns=5000000000 streams={streams}",
            f"fork stream={100 + d} streams={streams} gemm=1 uses=1",
            "launch warm-up",
            "launch kernel",
            f"join stream={100 + d} streams={streams} gemm=1 rank={d} out={10 + d} op=5",
            "handler returns",
            *RELEASE,
        ], ev


def test_two_processes_one_device(run):
    """This process holds rank 1; rank 0 is global device 7 of another process (-1 - 7 in the
    group table): the workspace is asked for with that group, the copy engine's streams are XLA's
    (GEMMs) and the copy stream (pushes)."""
    ev = single(run, "two_processes_one_device")
    assert "workspace site=42 group=-8,0 rank=1 bytes=4096 partials=1 gather=0" in ev
    assert ev.index("preload") < ev.index("ce_setup") < first(ev, "error_record")
    assert "fork stream=100 streams=100/300 gemm=0 uses=2" in ev
    assert "join stream=100 streams=100/300 gemm=0 rank=1 out=10 op=5" in ev
    assert not any(e.startswith("partition") for e in ev)


def test_tile_schedule_never_forks_a_stream(run):
    ev = single(run, "tile")
    # Its staging's layout depends on the shape: a workspace of its own, not its size class's.
    assert "workspace site=42 group=0,1 rank=0 bytes=4096 partials=1 gather=0 exact=1" in ev
    assert ev.index("preload") < first(ev, "launch")
    assert not any(e.startswith(("partition", "ce_setup")) for e in ev)
    assert "fork stream=100 streams=none gemm=0 uses=0" in ev
    # The tile kernel ends its own call (kernels/tile_rs.cuh, end_call): the join runs no finish.
    assert "join stream=100 streams=none gemm=0 rank=0 out=10 op=5 finished by the kernel" in ev


@pytest.mark.parametrize(
    "scenario, result, poison",
    [
        # Issued out of order: given up on every rank, the output poisoned, success.
        ("given_up", (0, ""), "10"),
        # The call chosen to report an earlier failure: closed unpoisoned, the report the error.
        (
            "refused",
            (3, "jaxoverlap.test_op: an earlier fused call failed: op X timed out"),
            "none",
        ),
    ],
)
def test_begin_call_answers(run, scenario, result, poison):
    """begin_call's answer other than "run": nothing launched but close_call."""
    ev = single(run, scenario, result)
    assert ev[first(ev, "begin_call") + 1 : first(ev, "handler returns")] == [
        "preload",
        f"close_call stream=100 streams=none rank=0 poison={poison}",
    ]
    assert not any(e.startswith(("fork", "launch", "join", "fail_call", "schedule")) for e in ev)


def test_failure_after_begin_call(run):
    """A CUDA call of the schedule failed after launches: the all-reduce's copy stream is joined
    into the partition, fail_call gets the op's name, the partition's streams and the poisoned
    output, and the handler returns success."""
    ev = single(run, "failure_after_begin_call")
    msg = "jaxoverlap.test_op: cudaMemcpyAsync(dst, src): invalid argument"
    tail = ev[first(ev, "launch kernel") + 1 : first(ev, "handler returns")]
    assert tail == [
        "join_copy into 200/201",
        f"fail_call stream=100 streams=200/201 rank=0 index=7 poison=10 msg={msg}",
    ]
    assert not any(e.startswith("join ") for e in ev)


def test_failure_in_start_joins_only_streams_granted(run):
    ev = single(run, "failure_in_start")
    assert ev[first(ev, "partition") + 1].startswith(
        "fail_call stream=100 streams=none rank=0 index=7 poison=10 "
        "msg=jaxoverlap.test_op: green contexts unavailable"
    )


def test_schedule_without_join_fails_the_call(run):
    """A schedule that returned without join() (no finish kernel: this rank's epoch would fall
    behind its peers' for good) is a failure after begin_call."""
    ev = single(run, "no_join")
    assert ev[first(ev, "launch kernel") + 1] == (
        "fail_call stream=100 streams=200/201 rank=0 index=7 poison=10 msg=jaxoverlap.test_op: "
        "the schedule ended without join()"
    )


def test_injected_failure(run):
    """stall_rank = -2 - rank (fused._failed_rank_for_tests): that rank fails after begin_call,
    with the copy engine's streams granted by then."""
    ev = single(run, "injected_failure", device=1)
    assert ev[first(ev, "ce_setup") + 1] == (
        "fail_call stream=101 streams=101/301 rank=1 index=7 poison=11 msg=jaxoverlap.test_op: "
        "test-only failure injected on this rank after begin_call"
    )


@pytest.mark.parametrize(
    "scenario, code, msg, last",
    [
        ("open_fails", 2, "jaxoverlap.test_op: out of memory", "workspace"),
        ("set_device_fails", 2, "jaxoverlap.test_op: cudaSetDevice failed", "set_device"),
    ],
)
def test_open_fails_before_begin_call(run, scenario, code, msg, last):
    ev = single(run, scenario, (code, msg))
    assert not any(e.startswith("begin_call") for e in ev)
    assert ev[first(ev, "handler returns") - 1].startswith(last), ev


@pytest.mark.parametrize(
    "scenario, msg",
    [
        ("bad_timeout", "timeout_s=-1.000000 must be a finite number of seconds in (0, 86400]"),
        ("bad_group", "group table is inconsistent: device 1 does not list the same group at "
                      "rank 1"),
    ],
)  # fmt: skip
def test_check_touches_nothing(run, scenario, msg):
    events, results = run(scenario)
    assert events == {0: ["handler returns"]}
    assert results == {0: (1, f"jaxoverlap.test_op: {msg}")}
