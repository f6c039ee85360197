"""Does compute-sanitizer run a plain XLA lax.scan and its gradient (no jaxoverlap), jax 0.11.2?

Run 29 (docs/measurements.md): the fused training step under lax.scan segfaulted in the host
under memcheck; this separates XLA + sanitizer from our kernels. Session 9 (2026-12-03, one
H200, compute-sanitizer 2025.3.1): with XLA's command buffers on (the default) it runs clean;
with them off it crashes (SIGSEGV, 2 of 2 runs) while XLA compiles the gradient, and the crash
is in the compute-sanitizer process itself (frames in its own binary, in a thread it started:
tools/probes/crash_backtrace.c preloaded), as in every training case that died under the tool:

    XLA_PYTHON_CLIENT_PREALLOCATE=false \\
    XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=" \\
    LD_PRELOAD=build/probes/libcrash_backtrace.so \\
    compute-sanitizer --tool memcheck --leak-check no python tools/probes/sanitizer_scan_probe.py

(Each of --xla_gpu_enable_triton_gemm=false, --xla_gpu_force_compilation_parallelism=1 and
`ulimit -s 262144` let it finish once: which of them, if any, avoids the crash is not settled.)"""

import jax
import jax.numpy as jnp
from jax import lax


def step(c, w):
    return jnp.tanh(c @ w), None


f = jax.jit(lambda c, ws: lax.scan(step, c, ws)[0])
g = jax.jit(jax.grad(lambda c, ws: jnp.sum(f(c, ws).astype(jnp.float32))))
k = jax.random.key(0)
c = jax.random.normal(k, (256, 256), jnp.bfloat16)
ws = jax.random.normal(k, (8, 256, 256), jnp.bfloat16)
print("xla scan OK", float(jnp.sum(f(c, ws).astype(jnp.float32))), flush=True)
print("xla scan grad OK", float(jnp.sum(g(c, ws).astype(jnp.float32))), flush=True)
