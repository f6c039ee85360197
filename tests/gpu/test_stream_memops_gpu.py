"""Stream memory operations and the copy-engine schedules' signals (issue 26, R5;
docs/ordering-and-stream-memops.md section 3), on one GPU, through the test-only probe
``_native._stream_memops_probe`` (ffi/kernels/memops_probe.cu):

1. a kernel that takes every thread slot of every SM (2 x 1,024 threads per SM) spins, bounded,
   on a flag; released from another (highest-priority) stream once all its blocks run:
   by ``cuStreamWriteValue32`` -- the signals' path (ffi/kernels/ce.cu) -- it ends at once; by
   a one-thread kernel -- the signal before issue 26 -- every block times out first, and the
   kernel runs only after; by a 4-byte copy within the device -- the signal of run 57's fix --
   it needs an SM too (measured 2026-12-02: 263 of 264 blocks time out);
2. a graph captured once (a stream wait ``EQ`` on a constant with its reset in one batch, then a
   stream write: NCCL's captured scheme) replayed 200 times, each against a fresh occupier: no
   timeout, every replay completes;
3. the trap: a captured ``GEQ`` wait on the index the host knew at capture passes at once when
   replayed for the next call -- why no captured wait of ours compares with a host-side value;
4. the copy-engine schedules' own signal (``launch_ce_signal_arrival``, through
   ``_native._ce_signal_probe``) on two ranks' flag blocks at epoch 25 -- as after calls of other
   ops sharing the workspace, captured or not (run 57's failure: the signal carried the host's
   number 8 where the device wanted 26): it releases the full-device occupier at once, uncaptured
   and replayed from a graph captured once, and the receiver's wait takes it for this call only
   (before the sender's slot-free wait announced the call, the previous call's count does not
   satisfy it). The signal of the run-57 fix (a copy of a device word) and the one before it (a
   one-thread kernel) both need an SM: this test fails with either.

Also the capabilities the diagnostics show (``runtime.stream_memop_caps``)."""

from __future__ import annotations

import pytest

from .scripts import native_probe

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def probe(gpus_any):
    return native_probe(gpus_any[0], "_stream_memops_probe", replays=200, bound_s=0.25)


def test_the_occupier_holds_every_thread_slot(probe):
    assert probe["resident_per_sm"] == 2, probe  # 2 x 1,024 threads: nothing else fits
    assert probe["blocks"] == 2 * probe["sms"], probe


def test_stream_write_releases_a_full_device_kernel(probe):
    assert probe["write_value_timeouts"] == 0, probe
    assert probe["write_value_ms"] < 0.5 * 1e3 * probe["bound_s"], probe


def test_a_copy_within_the_device_waits_for_an_sm(probe):
    """A 4-byte copy of a device word (run 57's signal), within one device (two processes sharing
    a GPU), runs on an SM: the occupier's blocks time out before it lands (why the signals are
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


@pytest.fixture(scope="module")
def ce_probe(gpus_any):
    return native_probe(gpus_any[0], "_ce_signal_probe", replays=100, bound_s=0.25, epoch=25)


def test_ce_receiver_does_not_take_the_previous_calls_count(ce_probe):
    """Before the sender's slot-free wait announces call 26, the receiver's wait of chunk 0 times
    out (50 ms) on the call word, reporting the previous call (25) and this one (26), although the
    landed count of call 25 (1) is already what chunk 0 wants."""
    assert ce_probe["early_timed_out"], ce_probe
    assert (ce_probe["early_seen"], ce_probe["early_wanted"]) == (25, 26), ce_probe
    assert (ce_probe["announced_call"], ce_probe["announced_landed"]) == (26, 0), ce_probe


def test_ce_signal_releases_a_full_device_kernel(ce_probe):
    """The production signal after a push lands while a kernel holds every thread slot of every
    SM: no occupier block times out (a copy or a kernel would wait for the 0.25 s bound)."""
    assert ce_probe["signal_timeouts"] == 0, ce_probe
    assert ce_probe["signal_ms"] < 0.5 * 1e3 * 0.25, ce_probe
    assert ce_probe["landed_after"] == 1, ce_probe
    assert ce_probe["wait_passed"], ce_probe
    assert ce_probe["later_chunk_timed_out"], ce_probe  # chunk 1 was never pushed
    assert ce_probe["fallbacks"] == 0, ce_probe


def test_ce_signal_captured_and_replayed(ce_probe):
    """Captured once (as XLA's command buffers capture the handler), replayed 100 times against
    a fresh full-device occupier: a memory-operation node only, no kernel or copy, and no
    occupier block ever times out."""
    assert ce_probe["graph_memop_nodes"] == 1, ce_probe
    assert ce_probe["graph_kernel_nodes"] == 0 and ce_probe["graph_memcpy_nodes"] == 0, ce_probe
    assert ce_probe["replay_timeouts"] == 0, ce_probe
    assert ce_probe["replays_done"] == ce_probe["replays"] == 100, ce_probe


def test_memop_capabilities_are_reported(gpus_any):
    from jaxoverlap import runtime

    caps = runtime.stream_memop_caps(gpus_any[0].local_hardware_id)
    print("stream_memop_caps", caps)
    assert caps["entry_points"], caps
    for key in ("mem_ops_64", "flush_remote_writes", "wait_value_nor"):
        assert caps[key] in (0, 1), caps
    assert caps["signal_fallbacks"] >= 0, caps
