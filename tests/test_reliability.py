"""Reliability decisions checked without GPUs: the timeout policy, and where the fused path
refuses to run (compute capability, NVLink) at lowering."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, config, fused, runtime


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 0, 0.0, -1.0, True, "5", 1e9])
def test_timeout_rejects_unbounded_and_nonsense(bad):
    with pytest.raises(ValueError, match=r"timeout_s=.* must be a finite number of seconds"):
        Config(timeout_s=bad)


def test_timeout_default_is_in_line_with_the_field():
    assert Config().timeout_s == config.DEFAULT_TIMEOUT_S == 100.0
    assert Config(timeout_s=1).timeout_s == 1
    assert Config(timeout_s=config.MAX_TIMEOUT_S).timeout_s == config.MAX_TIMEOUT_S


def test_tma_reduce_scatter_checks_its_timeout():
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    for bad in (math.nan, math.inf, -1.0):
        f = jax.shard_map(
            lambda v, bad=bad: fused.tma_reduce_scatter(v, "tp", timeout_s=bad),
            mesh=mesh,
            in_specs=P(None, "tp"),
            out_specs=P("tp"),
        )
        with pytest.raises(ValueError, match="tma_reduce_scatter: timeout_s="):
            jax.jit(f).trace(jax.ShapeDtypeStruct((64, 64), jnp.bfloat16))
