"""Stream memory operations and the copy-engine schedules' signals (issue 26, R5;
docs/ordering-and-stream-memops.md section 3), on one GPU, through the test-only probe
``_native._stream_memops_probe`` (ffi/kernels/memops_probe.cu):

1. a kernel that takes every thread slot of every SM (2 x 1,024 threads per SM) spins, bounded,
   on a flag; released from another (highest-priority) stream once all its blocks run:
   by ``cuStreamWriteValue32`` -- the signals' path outside capture (ffi/kernels/ce.cu) -- it
   ends at once; by a one-thread kernel -- the signal used before -- every block times out
   first, and the kernel runs only after; by a 4-byte copy within the device -- the signals'
   path under capture -- it needs an SM too (measured 2026-12-02: 263 of 264 blocks time out);
2. a graph captured once (a stream wait ``EQ`` on a constant with its reset in one batch, then a
   stream write: NCCL's captured scheme) replayed 200 times, each against a fresh occupier: no
   timeout, every replay completes;
3. the trap: a captured ``GEQ`` wait on the index the host knew at capture passes at once when
   replayed for the next call -- why no captured wait of ours compares with a host-side value.

Also the capabilities the diagnostics show (``runtime.stream_memop_caps``)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def probe(gpus_any):
    from jaxoverlap import runtime

    nat = runtime.native()
    if nat is None:
        pytest.fail("the native extension is not built")
    ordinal = gpus_any[0].local_hardware_id
    r = dict(nat._stream_memops_probe(ordinal, replays=200, bound_s=0.25))
    print("stream_memops_probe", r)
    assert r["error"] == "", r
    return r


def test_the_occupier_holds_every_thread_slot(probe):
    assert probe["resident_per_sm"] == 2, probe  # 2 x 1,024 threads: nothing else fits
    assert probe["blocks"] == 2 * probe["sms"], probe


def test_stream_write_releases_a_full_device_kernel(probe):
    assert probe["write_value_timeouts"] == 0, probe
    assert probe["write_value_ms"] < 0.5 * 1e3 * probe["bound_s"], probe


def test_a_copy_within_the_device_waits_for_an_sm(probe):
    """The captured signals' 4-byte copy, within one device (two processes sharing a GPU), runs
    on an SM: the occupier's blocks time out before it lands (why the uncaptured signals are
    stream writes). A copy to a peer GPU is for the two-GPU run."""
    assert probe["copy_timeouts"] >= probe["blocks"] // 2, probe
    assert probe["copy_ms"] < 1e3 * probe["bound_s"] + 100, probe


def test_one_thread_signal_kernel_waits_for_the_device(probe):
    """Every block of the occupier times out before the one-thread kernel can start; it runs
    after (the flag is set), so the same release by kernel costs the whole bound."""
    assert probe["kernel_timeouts"] == probe["blocks"], probe
    assert probe["kernel_flag_after"] == 1, probe
    assert probe["kernel_ms"] >= 1e3 * probe["bound_s"], probe


def test_captured_wait_and_write_replayed(probe):
    # captured as batch memory-operation nodes (the driver's node type), nothing else copied
    assert probe["graph_memop_nodes"] >= 1 and probe["graph_memcpy_nodes"] == 0, probe
    assert probe["replay_timeouts"] == 0, probe
    assert probe["replay_flag_after"] == probe["replays"] == 200, probe


def test_captured_geq_on_a_host_index_passes_without_waiting(probe):
    """Regression test of the trap (documents why we do not do that): the first replay waits
    for the flag the host meant; the second, meant for the next call, does not wait at all."""
    assert probe["trap_first_waited"], probe
    assert not probe["trap_second_waited"], probe


def test_memop_capabilities_are_reported(gpus_any):
    from jaxoverlap import runtime

    caps = runtime.stream_memop_caps(gpus_any[0].local_hardware_id)
    print("stream_memop_caps", caps)
    assert caps["entry_points"], caps
    for key in ("mem_ops_64", "flush_remote_writes", "wait_value_nor"):
        assert caps[key] in (0, 1), caps
