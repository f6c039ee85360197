"""Running a GPU test's script in a fresh Python process (a stalled or failed fused call must
not take the test process down, and some checks need a process of their own)."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def run_script(code, *args, timeout=180, only_results=False):
    """Runs ``code`` with ``args`` under this checkout; returns (stdout + stderr, {first word of a
    stdout line: the line}). ``only_results``: only lines with " OK" or " RAISED" (the scripts'
    `line(tag, fn)` results). Fails the test if the process outlives ``timeout``."""
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert time.time() - t0 < timeout
    keep = (lambda ln: " OK" in ln or " RAISED" in ln) if only_results else (lambda ln: True)
    lines = {ln.split(" ")[0]: ln for ln in p.stdout.splitlines() if keep(ln)}
    return p.stdout + p.stderr, lines


def native_probe(device, name, **kwargs):
    """Runs the test-only native probe ``_native.<name>`` on ``device`` (a jax GPU device) with
    ``kwargs``; prints its result (the GPU logs keep it) and fails the test on a CUDA error."""
    from jaxoverlap import runtime

    nat = runtime.native()
    assert nat is not None, "the native extension is not built"
    r = dict(getattr(nat, name)(device.local_hardware_id, **kwargs))
    print(name.lstrip("_"), r)
    assert r["error"] == "", r
    return r
