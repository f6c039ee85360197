"""The reference compositions: the oracle every jaxoverlap op must equal.

They are also the ``backend="xla"`` implementation (and the fallback of ``"auto"``): XLA's own
GEMM followed or preceded by its own (NCCL on GPUs) collective. Called per device, inside
``jax.shard_map``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def matmul_reduce_scatter(x, w, axis_name, *, scatter_dimension=0):
    return lax.psum_scatter(
        jnp.matmul(x, w), axis_name, scatter_dimension=scatter_dimension, tiled=True
    )


def all_gather_matmul(x, w, axis_name, *, gather_dimension=0):
    return jnp.matmul(lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True), w)


def matmul_all_reduce(x, w, axis_name):
    return lax.psum(jnp.matmul(x, w), axis_name)


def all_gather_matmul_keep(x, w, axis_name, *, gather_dimension=0):
    """``all_gather_matmul`` and the gathered ``x`` (what its weight gradient needs)."""
    gathered = lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True)
    return jnp.matmul(gathered, w), gathered
