"""initcheck on XLA alone (issue 25): does compute-sanitizer's initcheck report XLA's own
elementwise fusion reading the output of XLA's own cuBLAS GEMM? No jaxoverlap code runs here.

    compute-sanitizer --tool initcheck python tools/probes/xla_gemm_initcheck_probe.py MODE

MODE ``gemm``: y = x @ w (bf16, XLA's cuBLASLt GEMM), then sin(convert(y)) in a fusion of XLA's
(an optimization barrier keeps the convert out of the GEMM's epilogue) -- the pattern of the
training cases (tests/gpu/training_models.py: sum(sin(op(x, w).astype(f32)))), whose initcheck
runs reported >1,000 "Uninitialized __global__ memory read" in XLA's ``loop_convert_fusion``
reading the fused op's output. MODE ``plain``: the same, but y written by an elementwise fusion
of XLA's (plain stores) instead of the GEMM: the control. Prints ``<mode> OK`` with the result
checked against NumPy; the sanitizer's log says which kernels it reported.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def main(mode):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1536, 640), np.float32)
    w = rng.standard_normal((640, 1280), np.float32) / 32
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)

    @jax.jit
    def f(x, w):
        if mode == "gemm":
            y = x @ w
        else:
            y = (x[:, : 1280 // 2].astype(jnp.float32) * 2).astype(jnp.bfloat16)
        y = lax.optimization_barrier(y)
        return jnp.sin(y.astype(jnp.float32))

    print(f.lower(xb, wb).compile().as_text().count("fusion"), "fusions", flush=True)
    got = np.asarray(f(xb, wb))
    xf, wf = np.asarray(xb, np.float32), np.asarray(wb, np.float32)
    want = np.sin(xf @ wf if mode == "gemm" else xf[:, :640] * 2)
    err = float(np.abs(got - want).max())
    print(f"{mode} {'OK' if err < 5e-2 else 'FAILED'} max_err={err:.2e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gemm")
