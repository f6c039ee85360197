"""Start N local processes of a JAX script, joined by ``jax.distributed``, for trying
multi-process code on one machine::

    python -m jaxoverlap.launch -n 2 [--devices-per-process K] script.py [args...]

Each process gets, through the environment, what ``jax.distributed.initialize`` needs: the
coordinator's address (127.0.0.1 and a free port: loopback only), the process count, its id, and
its local devices by JAX's convention (``local_device_ids``: process ``i`` drives GPUs
``i*K .. i*K+K-1``, every GPU stays visible to CUDA), or with ``--cuda-visible-devices`` by
``CUDA_VISIBLE_DEVICES`` (each process sees only its own GPUs; some projects saw this break
CUDA IPC between processes, hence not the default). On a machine without accelerators each
process gets ``K`` fake CPU devices instead. The script calls :func:`initialize` first.

Output lines are prefixed with the rank. The launcher waits for every process; when one exits
non-zero (or on Ctrl-C, SIGTERM or ``--timeout``) it stops the others (SIGTERM, then SIGKILL
after a grace period) and exits with the first failure's code (124 on timeout).

Across real hosts, use the scheduler's launcher instead and have the script call
``jax.distributed.initialize()``, which reads SLURM, Open MPI and Kubernetes environments by
itself (``examples/multihost.py --cluster``); :func:`initialize` is a no-op there.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

ENV_ADDRESS = "JAXOVERLAP_COORDINATOR_ADDRESS"
ENV_PROCESSES = "JAXOVERLAP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXOVERLAP_PROCESS_ID"
ENV_DEVICES = "JAXOVERLAP_LOCAL_DEVICE_IDS"
GRACE_S = 5.0  # from SIGTERM to SIGKILL
TIMEOUT_EXIT = 124


def initialize(*, initialization_timeout=120):
    """``jax.distributed.initialize`` from this launcher's environment; a no-op (returns False)
    when the script was not started by it. Call before anything touches a JAX device."""
    if ENV_PROCESSES not in os.environ:
        return False
    import jax

    address = os.environ[ENV_ADDRESS]
    jax.distributed.initialize(
        coordinator_address=address,
        coordinator_bind_address=address,  # loopback only (JAX's default binds every interface)
        num_processes=int(os.environ[ENV_PROCESSES]),
        process_id=int(os.environ[ENV_PROCESS_ID]),
        local_device_ids=[int(i) for i in os.environ[ENV_DEVICES].split(",")],
        initialization_timeout=initialization_timeout,
    )
    return True


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(rank, n, k, address, *, cuda_visible=False):
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={k}".strip()
    env[ENV_ADDRESS] = address
    env[ENV_PROCESSES] = str(n)
    env[ENV_PROCESS_ID] = str(rank)
    mine = [rank * k + i for i in range(k)]
    if cuda_visible:  # positions in the parent's CUDA_VISIBLE_DEVICES, if it set one
        parent = env.get("CUDA_VISIBLE_DEVICES")
        names = parent.split(",") if parent else [str(i) for i in range(max(mine) + 1)]
        if max(mine) >= len(names):
            raise ValueError(f"process {rank} needs GPU {max(mine)}; visible: {parent}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(names[i] for i in mine)
        mine = list(range(k))
    env[ENV_DEVICES] = ",".join(map(str, mine))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _pump(rank, stream, lock):
    """Copy a child's output to ours, line by line, prefixed with its rank."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            sys.stdout.write(f"[{rank}] {line}\n")
            sys.stdout.flush()
    stream.close()


def _stop(procs):
    """SIGTERM every live child's process group, then SIGKILL whatever is left after GRACE_S."""
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)  # the child leads its own group (start_new_session)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)


def _exit_code(rc):
    return 128 - rc if rc < 0 else rc  # killed by signal s: 128 + s, as a shell reports it


def run(n, script_argv, *, devices_per_process=1, timeout_s=None, cuda_visible=False):
    """Run ``script_argv`` (a script path and its arguments) as ``n`` processes; returns the
    exit code (0, the first failure's, or 124 when ``timeout_s`` ran out)."""
    address = f"127.0.0.1:{_free_port()}"
    lock = threading.Lock()
    procs, pumps = [], []

    # SIGINT and SIGTERM only set a flag that the loop reads: an exception raised wherever the
    # signal lands (inside Popen, or a poll holding the child's wait lock) could leave a child
    # unstopped or the stop waiting on a lock (a CI run timed out in the Ctrl-C test).
    interrupted = []

    def on_signal(signum, frame):
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(n):
            p = subprocess.Popen(
                [sys.executable, *script_argv],
                env=_child_env(rank, n, devices_per_process, address, cuda_visible=cuda_visible),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            procs.append(p)
            t = threading.Thread(target=_pump, args=(rank, p.stdout, lock), daemon=True)
            t.start()
            pumps.append(t)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        code = 0
        while None in [p.poll() for p in procs]:  # a list: poll every child, every round
            if interrupted:
                raise KeyboardInterrupt
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed:
                code = _exit_code(failed[0].returncode)
                rank = procs.index(failed[0])
                _report(lock, f"process {rank} exited with {code}; stopping the others")
                break
            if deadline is not None and time.monotonic() > deadline:
                code = TIMEOUT_EXIT
                _report(lock, f"timeout after {timeout_s} s; stopping every process")
                break
            time.sleep(0.05)
        else:
            failed = [p for p in procs if p.returncode != 0]
            code = _exit_code(failed[0].returncode) if failed else 0
        if interrupted:
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        code = 130
        _report(lock, "interrupted; stopping every process")
    finally:
        _stop(procs)
        for s, handler in previous.items():
            signal.signal(s, handler)
        for t in pumps:
            t.join(timeout=GRACE_S)
    return code


def _report(lock, message):
    with lock:
        sys.stderr.write(f"[launch] {message}\n")
        sys.stderr.flush()


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m jaxoverlap.launch",
        description="Start N local processes of a JAX script joined by jax.distributed.",
    )
    parser.add_argument("-n", "--processes", type=int, required=True)
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=1,
        help="GPUs (local_device_ids) or, without accelerators, fake CPU devices per process",
    )
    parser.add_argument(
        "--cuda-visible-devices",
        action="store_true",
        help="give each process its GPUs through CUDA_VISIBLE_DEVICES, not local_device_ids",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds; then exit 124")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    a = parser.parse_args(argv)
    if a.processes < 1 or a.devices_per_process < 1:
        parser.error("-n and --devices-per-process must be at least 1")
    return run(
        a.processes,
        [a.script, *a.args],
        devices_per_process=a.devices_per_process,
        timeout_s=a.timeout,
        cuda_visible=a.cuda_visible_devices,
    )


if __name__ == "__main__":
    sys.exit(main())
