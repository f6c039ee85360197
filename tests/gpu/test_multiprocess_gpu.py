"""examples/multihost.py under jaxoverlap.launch on real GPUs: 2 processes x 1 GPU (the tp
group spans processes: fused, its workspace mapped across them by CUDA IPC, with both ways of
giving each process its GPU), 1 process x 2 GPUs (fused), and, where 4 GPUs exist, 2 processes x
2 GPUs (tp fused inside each process, dp across processes through XLA)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def _launch(n, k, *flags, example_flags=()):
    cmd = [sys.executable, "-m", "jaxoverlap.launch", "-n", str(n), "--devices-per-process"]
    cmd += [str(k), "--timeout", "240", *flags, "examples/multihost.py", *example_flags]
    # This pytest process may hold most of each GPU's memory already (XLA preallocates).
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    for rank in range(n):
        assert f"[{rank}] process {rank}/{n}: OK" in p.stdout, out[-4000:]
    return p.stdout


@pytest.mark.parametrize("flags", [(), ("--cuda-visible-devices",)])
def test_two_processes_one_gpu_each(gpus, flags):
    out = _launch(2, 1, *flags, example_flags=("--expect-fused",))
    assert "mesh dp=1 x tp=2" in out and "backend: fused jaxoverlap kernels" in out


def test_one_process_two_gpus_fuses(gpus):
    out = _launch(1, 2, example_flags=("--expect-fused",))
    assert "backend: fused jaxoverlap kernels" in out


@pytest.mark.parametrize("flags", [(), ("--cuda-visible-devices",)])
def test_two_processes_two_gpus_each_fuse_tp(gpus, flags):
    import jax

    if len(jax.devices("gpu")) < 4:
        pytest.skip("needs 4 GPUs (2 processes x 2)")
    out = _launch(2, 2, *flags, example_flags=("--expect-fused",))
    assert out.count("mesh dp=2 x tp=2") == 2
