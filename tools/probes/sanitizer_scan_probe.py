"""Does compute-sanitizer memcheck run a plain XLA lax.scan (no jaxoverlap) under jax 0.11.2?

Run 29 (docs/measurements.md): the fused training step under lax.scan segfaulted in the host
under memcheck; this separates XLA + sanitizer from our kernels."""

import jax
import jax.numpy as jnp
from jax import lax

w = jnp.ones((512, 512), jnp.bfloat16) / 512


def step(h, _):
    return jnp.tanh(h @ w), None


f = jax.jit(lambda x: lax.scan(step, x, None, length=3)[0])
g = jax.jit(jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32))))
print("xla scan OK", float(g(jnp.ones((256, 512), jnp.bfloat16))[0, 0]), flush=True)
