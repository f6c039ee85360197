"""GPU tests: run on real CUDA devices; skipped without two of them, unless
JAXOVERLAP_REQUIRE_GPU=1 makes the missing GPUs a failure (GPU machines set it)."""

import os

import pytest


def _gpus():
    import jax

    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.fixture(scope="session")
def gpus():
    devs = _gpus()
    if len(devs) < 2:
        msg = f"needs 2 CUDA GPUs, found {len(devs)}"
        if os.environ.get("JAXOVERLAP_REQUIRE_GPU") == "1":
            pytest.fail(msg + " (JAXOVERLAP_REQUIRE_GPU=1)")
        pytest.skip(msg)
    return devs[:2]


@pytest.fixture(scope="session")
def gpus_any():
    """At least one CUDA GPU (tests whose processes may share one, tests/gpu/test_xproc_gpu.py)."""
    devs = _gpus()
    if not devs:
        msg = "needs a CUDA GPU, found none"
        if os.environ.get("JAXOVERLAP_REQUIRE_GPU") == "1":
            pytest.fail(msg + " (JAXOVERLAP_REQUIRE_GPU=1)")
        pytest.skip(msg)
    return devs
