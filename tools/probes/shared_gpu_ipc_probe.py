"""Can two JAX processes share one GPU, and map each other's memory by CUDA IPC?

Answers what a one-GPU machine can say about the cross-process workspace (issue 11) before it
is built: each of 2 processes joins ``jax.distributed`` with ``local_device_ids=[0]`` (both on
GPU 0), runs a JAX op, allocates 1 MiB with ``cudaMalloc``, exports it (``cudaIpcGetMemHandle``)
through the ``jax.distributed`` key-value store, opens the peer's (``cudaIpcOpenMemHandle``) and
reads what the peer wrote. Then process 1 exits and process 0 reads the mapping again (what a
killed peer does to an importer), runs a JAX op (is its context still usable?).

    python tools/probes/shared_gpu_ipc_probe.py          # parent: starts both, prints their lines
"""

from __future__ import annotations

import ctypes
import glob
import os
import socket
import subprocess
import sys
import time


def cudart():
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    dirs = ["/usr/local/cuda/lib64", "/usr/local/cuda/lib", *glob.glob("/usr/local/cuda-*/lib*")]
    for d in sys.path:
        dirs += glob.glob(os.path.join(d, "nvidia", "*", "lib")) + glob.glob(
            os.path.join(d, "nvidia", "cuda_runtime", "lib")
        )
    for d in [""] + dirs:
        for n in names:
            try:
                return ctypes.CDLL(os.path.join(d, n) if d else n)
            except OSError:
                continue
    raise OSError("libcudart not found")


class Handle(ctypes.Structure):  # cudaIpcMemHandle_t: passed by value to cudaIpcOpenMemHandle
    _fields_ = [("reserved", ctypes.c_char * 64)]


def child(pid, port):
    import jax
    import jax.numpy as jnp

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=pid,
        local_device_ids=[0],
        initialization_timeout=60,
    )
    say = lambda *a: print(f"[{pid}]", *a, flush=True)  # noqa: E731
    say("devices", jax.devices(), "local", jax.local_devices())
    say("local op", float(jnp.sum(jnp.ones((1024, 1024)) @ jnp.ones((1024, 1024)))))
    from jax._src import distributed

    kv = distributed.global_state.client
    rt = cudart()
    rt.cudaSetDevice(0)
    p = ctypes.c_void_p()
    assert rt.cudaMalloc(ctypes.byref(p), 1 << 20) == 0
    assert rt.cudaMemset(p, pid + 1, 1 << 20) == 0
    rt.cudaDeviceSynchronize()
    h = Handle()
    e = rt.cudaIpcGetMemHandle(ctypes.byref(h), p)
    say("cudaIpcGetMemHandle", e)
    kv.key_value_set(f"probe/h{pid}", ctypes.string_at(ctypes.byref(h), 64).hex())
    peer = kv.blocking_key_value_get(f"probe/h{1 - pid}", 60_000)
    ph = Handle.from_buffer_copy(bytes.fromhex(peer))
    rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), Handle, ctypes.c_uint]
    q = ctypes.c_void_p()
    t0 = time.perf_counter()
    e = rt.cudaIpcOpenMemHandle(ctypes.byref(q), ph, 1)  # cudaIpcMemLazyEnablePeerAccess
    say("cudaIpcOpenMemHandle", e, f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
    b = ctypes.c_uint32()
    e = rt.cudaMemcpy(ctypes.byref(b), q, 4, 2)  # device to host
    say("read peer memory", e, hex(b.value), "expected", hex((2 - pid) * 0x01010101))
    kv.wait_at_barrier("probe/read", 60_000)
    if pid == 1:  # not the coordinator's process (its exit stops every process at once)
        say("exiting while the peer holds the mapping")
        os._exit(0)
    time.sleep(3)  # the peer has exited
    e = rt.cudaMemcpy(ctypes.byref(b), q, 4, 2)
    say("read after the exporter exited:", e, hex(b.value))
    e = rt.cudaIpcCloseMemHandle(q)
    say("cudaIpcCloseMemHandle", e)
    say("local op after", float(jnp.sum(jnp.ones((256, 256)))))
    os._exit(0)


def main():
    if len(sys.argv) == 3:
        return child(int(sys.argv[1]), int(sys.argv[2]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}
    procs = [
        subprocess.Popen([sys.executable, __file__, str(i), str(port)], env=env) for i in range(2)
    ]
    for p in procs:
        try:
            p.wait(timeout=150)
        except subprocess.TimeoutExpired:
            p.kill()
            print("probe child timed out")
    print("exit codes", [p.returncode for p in procs])


if __name__ == "__main__":
    main()
