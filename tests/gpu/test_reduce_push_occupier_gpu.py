"""The standalone reduce-scatter's reduce-push kernel beside a kernel holding most SMs (issue 26,
R6; docs/ordering-and-stream-memops.md section 4), on one GPU, through the test-only probe
``_native._reduce_push_probe`` (ffi/kernels/memops_probe.cu): two ranks' reduce-push kernels
(16 CTAs each, 8 MiB blocks, CTAs paired by ticket) on one device while an occupier holds every
SM but ``free_sms`` (one occupier block per SM: it takes the SM's whole shared memory, so no
reduce-push CTA fits beside it); 5 calls per case, each output checked against own + peer block.

With at least one rank's CTAs plus one free SM, some CTA pair always runs, finishes and makes
room: no wait may time out and every output is exact. With fewer, on one device, rank 0's
resident CTAs wait for rank 1's, which cannot start until they give up -- an artefact of two
ranks sharing one device's SMs (two GPUs never compete for SMs) -- measured, and only required
to stay bounded by the timeout."""

from __future__ import annotations

import pytest

from .scripts import native_probe

pytestmark = pytest.mark.gpu

CTAS = 16


def _probe(gpus_any, free_sms, calls=5, timeout_s=1.0):
    return native_probe(
        gpus_any[0],
        "_reduce_push_probe",
        free_sms=free_sms,
        ctas=CTAS,
        block_bytes=8 << 20,
        calls=calls,
        timeout_s=timeout_s,
    )


@pytest.mark.parametrize("free", ["all", "2x", "1.5x", "1x+1"])
def test_reduce_push_beside_an_occupier(gpus_any, free):
    free_sms = {"2x": 2 * CTAS, "1.5x": CTAS + CTAS // 2, "1x+1": CTAS + 1}.get(free, 10_000)
    r = _probe(gpus_any, free_sms)
    assert r["occupier_blocks"] == max(0, r["sms"] - free_sms), r
    assert r["timeouts"] == 0 and r["wrong"] == 0, r
    assert r["epochs"] == r["calls"] == 5, r


@pytest.mark.parametrize("free_sms", [CTAS, CTAS // 2])
def test_reduce_push_with_fewer_free_sms_than_ctas_is_bounded(gpus_any, free_sms):
    timeout_s = 0.25
    r = _probe(gpus_any, free_sms, calls=1, timeout_s=timeout_s)
    # Measured, not required to pass on one device: the epochs still advance once per call and
    # the call ends within the timeouts of its waves of CTAs (each CTA waits at most twice).
    waves = -(-2 * CTAS // free_sms)
    assert r["epochs"] == r["calls"] == 1, r
    assert r["ms_max"] < 1e3 * (2 * waves * timeout_s + 1.0), r
