"""jaxoverlap.launch: N local processes joined by jax.distributed (examples/multihost.py across
2 processes x 2 fake CPU devices, gloo collectives), rank-prefixed output, the first failure's
exit code, no process left behind on a failure, a timeout or Ctrl-C."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from jaxoverlap import launch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# tp inside each process (the dp gradient reduction crosses processes), and tp across both
# processes (the block's all-gather and reduce-scatter cross them).
@pytest.mark.parametrize("tp,mesh", [(None, "dp=2 x tp=2"), (4, "dp=1 x tp=4")])
def test_multihost_example_runs_across_two_processes(tp, mesh):
    cmd = [sys.executable, "-m", "jaxoverlap.launch", "-n", "2", "--devices-per-process", "2"]
    cmd += ["--timeout", "100", str(ROOT / "examples" / "multihost.py")]
    cmd += ["--tp", str(tp)] if tp else []
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        assert f"[{rank}] process {rank}/2: mesh {mesh}" in r.stdout
        assert f"[{rank}] process {rank}/2: errors loss" in r.stdout
        assert f"[{rank}] process {rank}/2: OK" in r.stdout


# A child that reports its pid, then behaves as its rank says: "exit:<code>", "sleep" (until
# killed) or "stubborn" (ignores SIGTERM).
CHILD = """
import os, signal, sys, time
rank = int(os.environ["JAXOVERLAP_PROCESS_ID"])
assert os.environ["JAXOVERLAP_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
assert os.environ["JAXOVERLAP_NUM_PROCESSES"] == str(len(sys.argv) - 2)
what = sys.argv[2 + rank]
if what == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
print(f"rank {rank} devices {os.environ['JAXOVERLAP_LOCAL_DEVICE_IDS']} will {what}", flush=True)
if what.startswith("exit:"):
    while len(os.listdir(sys.argv[1])) < len(sys.argv) - 2:  # the others have started
        time.sleep(0.02)
    sys.exit(int(what[5:]))
time.sleep(60)
"""


def _pids(tmp_path, n):
    return [int((tmp_path / "run" / f"pid{r}").read_text()) for r in range(n)]


@pytest.fixture
def child(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "GRACE_S", 1.0)
    (tmp_path / "run").mkdir()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return lambda *what: [str(script), str(tmp_path / "run"), *what]


def test_failure_propagates_and_stops_the_others(child, tmp_path, capfd):
    t0 = time.monotonic()
    code = launch.run(3, child("sleep", "exit:3", "stubborn"), devices_per_process=2)
    assert code == 3
    assert time.monotonic() - t0 < 15
    assert not any(_alive(p) for p in _pids(tmp_path, 3))
    out, err = capfd.readouterr()
    assert "[1] rank 1 devices 2,3 will exit:3" in out and "[2] rank 2 devices 4,5" in out
    assert "process 1 exited with 3" in err


def test_success_and_timeout(child, tmp_path, capfd):
    assert launch.run(2, child("exit:0", "exit:0")) == 0
    t0 = time.monotonic()
    assert launch.run(2, child("sleep", "sleep"), timeout_s=0.5) == launch.TIMEOUT_EXIT
    assert time.monotonic() - t0 < 10
    assert not any(_alive(p) for p in _pids(tmp_path, 2))
    assert "timeout after 0.5 s" in capfd.readouterr().err


def test_ctrl_c_stops_every_process(child, tmp_path):
    cmd = [sys.executable, "-m", "jaxoverlap.launch", "-n", "2", *child("sleep", "sleep")]
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 20
        while len(list((tmp_path / "run").iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = _pids(tmp_path, 2)
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=20) == 130
        assert not any(_alive(pid) for pid in pids)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_child_environment_and_no_op_initialize(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_foo=1")
    env = launch._child_env(1, 2, 4, "127.0.0.1:1234")
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
    assert env[launch.ENV_DEVICES] == "4,5,6,7"
    assert env[launch.ENV_PROCESS_ID] == "1" and env[launch.ENV_PROCESSES] == "2"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = launch._child_env(1, 2, 2, "127.0.0.1:1234", cuda_visible=True)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env[launch.ENV_DEVICES] == "0,1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,5,3,1")
    env = launch._child_env(1, 2, 2, "127.0.0.1:1234", cuda_visible=True)
    assert env["CUDA_VISIBLE_DEVICES"] == "3,1"
    with pytest.raises(ValueError, match="needs GPU 5"):
        launch._child_env(2, 3, 2, "127.0.0.1:1234", cuda_visible=True)
    monkeypatch.delenv(launch.ENV_PROCESSES, raising=False)
    assert launch.initialize() is False
