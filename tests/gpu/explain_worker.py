"""One process of the explain spot check (tests/gpu/test_explain_gpu.py starts two).

    python tests/gpu/explain_worker.py PROCESS NPROC PORT GPU

Joins ``jax.distributed`` with one GPU (on a one-GPU machine both processes share GPU 0), and for
three cases of tests/idioms.py on a 2-device ``tp`` mesh spanning the processes -- the scaling
book MLP under ``backend="auto"`` (the untuned rule picks both fused kernels), seqax's norm
across K under ``backend="fused"`` (rewritten, fused), Flax NNX projections under ``"auto"``
(held back: XLA's path) -- checks that what ``jaxoverlap.explain`` says for this machine (the
live target) is what the compiled program contains (the jaxoverlap custom calls, by op and by the
kernel explain names), and that ``overlap(f)`` computes ``f``'s values (bf16 tolerance) against
the same layer run on two CPU devices of this process. XLA's own collectives cannot run here (NCCL
refuses two ranks on one GPU), so a program that keeps one (the held-back Flax NNX case) is
compiled and compared with explain, not run; the line says so.
Prints ``<case> OK ...`` or ``<case> FAILED ...``.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import traceback

import numpy as np

CASES = (("scaling_book", None), ("seqax", "fused"), ("flax_nnx", None))


def main(process, nproc, port, gpu):
    import jax

    jax.config.update("jax_num_cpu_devices", 2)  # the reference: the layer on two CPU devices
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=process,
        local_device_ids=[gpu], initialization_timeout=120,
    )  # fmt: skip
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import idioms
    from idioms import IDIOMS
    from jax.sharding import Mesh, NamedSharding

    import jaxoverlap

    cpus = jax.local_devices(backend="cpu")[:2]

    def on_cpu(name, host_args):
        """The idiom's layer, unrewritten, on this process's two CPU devices: the whole output."""
        gpu_mesh = idioms._mesh
        idioms._mesh = lambda shape, names: Mesh(  # noqa: E731
            np.array(cpus[: int(np.prod(shape))]).reshape(shape), names,
            axis_types=gpu_mesh(shape, names).axis_types,
        )  # fmt: skip
        try:
            f_cpu, specs_cpu = IDIOMS[name]()
        finally:
            idioms._mesh = gpu_mesh
        xs = [jax.device_put(a, NamedSharding(s.sharding.mesh, s.sharding.spec))
              for a, s in zip(host_args, specs_cpu, strict=True)]  # fmt: skip
        return np.asarray(jax.jit(f_cpu)(*xs), np.float32)

    rng = np.random.default_rng(0)
    for name, backend in CASES:
        try:
            f, specs = IDIOMS[name]()
            config = jaxoverlap.Config(backend=backend) if backend else None
            args, host = [], []
            for s in specs:
                a = (rng.standard_normal(s.shape, np.float32) / np.sqrt(s.shape[-1])).astype(
                    s.dtype
                )
                host.append(a)
                args.append(jax.make_array_from_callback(s.shape, s.sharding, lambda i, a=a: a[i]))
            found = jaxoverlap.explain(f, *args, config=config)
            said = collections.Counter(c.op for c in found if c.path.startswith("fused"))
            g = jax.jit(jaxoverlap.overlap(f, config=config))
            text = g.lower(*args).compile().as_text()
            ops = {"gemm_ar": "matmul_all_reduce", "ag_gemm": "all_gather_matmul",
                   "gemm_rs": "matmul_reduce_scatter"}  # fmt: skip
            targets = set(re.findall(r'custom_call_target="(jaxoverlap_\w+)"', text))
            calls = collections.Counter(
                next(op for k, op in ops.items() if k in t) for t in targets
            )
            assert calls == said, f"explain said {dict(said)}, compiled {dict(calls)}"
            kernels = {c.kernel.split(" ")[0] for c in found if c.path.startswith("fused")}
            assert kernels == targets, f"explain named {kernels}, compiled {targets}"
            left = sorted(
                set(re.findall(r"\b(all-gather|reduce-scatter|all-reduce)(?:-start)?\(", text))
            )
            if left:  # XLA's collectives need NCCL, which refuses two ranks on one GPU
                why = f"not run: XLA's {left} cannot run on one GPU"
                print(f"{name} OK fused={dict(said)} verdict as compiled; {why}", flush=True)
                continue
            shard = g(*args).addressable_shards[0]
            got = np.asarray(shard.data, np.float32)
            want = on_cpu(name, host)[shard.index]
            err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))
            assert np.isfinite(got).all() and err < 2e-2, f"relative error {err:.2e}"
            jaxoverlap.check_errors()
            print(f"{name} OK fused={dict(said)} rel_err={err:.1e} process={process}", flush=True)
        except Exception as e:  # report every case
            print(f"{name} FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
            traceback.print_exc()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]))
