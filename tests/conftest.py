"""Test setup: 8 fake CPU devices, so sharding logic runs on any machine.

The flag must be set before jax initialises its backends, hence here and not in a fixture. GPU
tests (tests/gpu) run on the real devices and add their own markers.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
