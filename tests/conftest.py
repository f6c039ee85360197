"""Test setup: 8 fake CPU devices, so sharding logic runs on any machine.

The flag must be set before jax initialises its backends, hence here and not in a fixture. GPU
tests (tests/gpu) run on the real devices and add their own markers.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()


import pytest  # noqa: E402  (after the XLA flag above)

# What CUDA reports for an NVLink peer (native peer atomics) -- see jaxoverlap.topology.
NVLINK = {"access": True, "native_atomics": True, "performance_rank": 0}


@pytest.fixture
def native_ok(monkeypatch):
    """Trace-time decisions as if the native extension were built and loadable."""
    from jaxoverlap import runtime

    monkeypatch.setattr(runtime, "unavailable_reason", lambda: None)


@pytest.fixture
def lowering_only(monkeypatch, native_ok):
    """Lowering for CUDA needs no GPU and no loaded extension (the custom call is emitted by
    name): stand in for the extension and the device queries (Hopper GPUs joined by NVLink)."""
    from jaxoverlap import runtime

    monkeypatch.setattr(runtime, "native", lambda: object())
    monkeypatch.setattr(runtime, "register_targets", lambda: None)
    monkeypatch.setattr(runtime, "can_access_peer", lambda a, b: True)
    monkeypatch.setattr(runtime, "compute_capability", lambda o: (9, 0))
    monkeypatch.setattr(runtime, "peer_link", lambda a, b: NVLINK)


@pytest.fixture(autouse=True)
def _order_calls(request, monkeypatch):
    """The CPU tests lower with the order on (issue 26 R2; opt-in, off by default:
    jaxoverlap/fused/call.py ORDER_CALLS), their subprocesses too, in its token form (the `_v2`
    targets and their knob twins, which the lowering tests name); tests/test_order.py and
    tests/test_golden_lowering.py cover the barrier form (the form the order takes, ORDER_FORM)
    and the default (the order off). GPU tests (tests/gpu) run the default."""
    if os.sep + "gpu" + os.sep in str(request.node.fspath):
        return
    from jaxoverlap.fused import call

    monkeypatch.setattr(call, "ORDER_CALLS", True)
    monkeypatch.setattr(call, "ORDER_FORM", "token")
    monkeypatch.setenv("JAXOVERLAP_ORDER_CALLS", "1")
