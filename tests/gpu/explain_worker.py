"""One process of the explain spot check (tests/gpu/test_explain_gpu.py starts two).

    python tests/gpu/explain_worker.py PROCESS NPROC PORT GPU

Joins ``jax.distributed`` with one GPU (on a one-GPU machine both processes share GPU 0), and for
three cases of tests/idioms.py on a 2-device ``tp`` mesh spanning the processes -- the scaling
book MLP under ``backend="auto"`` (the untuned rule picks both fused kernels), seqax's norm
across K under ``backend="fused"`` (rewritten, fused), Flax NNX projections under ``"auto"``
(held back: XLA's path) -- checks that what ``jaxoverlap.explain`` says for this machine (the
live target) is what the compiled program contains (the jaxoverlap custom calls, by op and by the
kernel explain names), and that ``overlap(f)`` computes ``f``'s values (bf16 tolerance).
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

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=process,
        local_device_ids=[gpu], initialization_timeout=120,
    )  # fmt: skip
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from idioms import IDIOMS

    import jaxoverlap

    rng = np.random.default_rng(0)
    for name, backend in CASES:
        try:
            f, specs = IDIOMS[name]()
            config = jaxoverlap.Config(backend=backend) if backend else None
            args = []
            for s in specs:
                a = (rng.standard_normal(s.shape, np.float32) / np.sqrt(s.shape[-1])).astype(
                    s.dtype
                )
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
            got = np.asarray(g(*args).addressable_shards[0].data, np.float32)
            want = np.asarray(jax.jit(f)(*args).addressable_shards[0].data, np.float32)
            err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))
            assert np.isfinite(got).all() and err < 2e-2, f"relative error {err:.2e}"
            jaxoverlap.check_errors()
            print(f"{name} OK fused={dict(said)} rel_err={err:.1e} process={process}", flush=True)
        except Exception as e:  # report every case
            print(f"{name} FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
            traceback.print_exc()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]))
