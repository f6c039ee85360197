"""Why run 59's CONCURRENT order test never reported (tests/gpu/order_worker.py before s5-O):
its bitwise check was ``jax.jit(lambda a, b: jnp.array_equal(a, b))`` over **global** arrays
sharded across two processes, which XLA reduces across them (an all-reduce). On a one-GPU
machine both processes drive GPU 0, and XLA's GPU collectives go through NCCL, which refuses two
ranks on one GPU. This probe runs exactly that comparison once, in two processes:

    bash -c 'for p in 0 1; do python tools/probes/global_compare_probe.py $p 2 PORT & done; wait'

Each process prints ``global_compare_hlo`` (whether the compiled comparison holds an
all-reduce), then ``global_compare returned ...`` or ``global_compare raised ...`` with the
time taken; a hang shows as every thread's stack after $XPROC_STACKS_AFTER_S (default 20 s).
Then the same comparison on this process's own shard (the fixed check): ``local_compare``."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())


def main(process, nproc, port):
    os.environ.setdefault("XPROC_STACKS_AFTER_S", "20")
    from tests.gpu.xproc_worker import join

    mesh, arr = join(process, nproc, port, 0)
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    x = arr(np.arange(2 * 256 * 128, dtype=np.float32).reshape(512, 128), P("tp"))
    same = jax.jit(lambda a, b: jnp.array_equal(a, b))
    text = same.lower(x, x).compile().as_text()
    print(f"global_compare_hlo all-reduce={'all-reduce' in text}", flush=True)
    t0 = time.time()
    try:
        out = bool(same(x, x))
        print(f"global_compare returned {out} in {time.time() - t0:.1f}s", flush=True)
    except Exception as e:  # noqa: BLE001 - the probe reports whatever XLA raises
        print(f"global_compare raised {type(e).__name__} in {time.time() - t0:.1f}s: "
              f"{str(e)[:600]}", flush=True)  # fmt: skip
    (mine,) = [s.data for s in x.addressable_shards]
    t0 = time.time()
    out = bool(jax.jit(lambda a, b: jnp.array_equal(a, b))(mine, mine))
    print(f"local_compare returned {out} in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
