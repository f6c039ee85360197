"""The tuner's cache, decision rule and model walk (the timing itself needs GPUs: tests/gpu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import tune


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tune, "fingerprint", lambda: "test")
    return tmp_path / "jaxoverlap" / "tune-test.json"


KEY = tune.Key("matmul_reduce_scatter", 8192, 4096, 8192, "bfloat16", 2, "NVIDIA H200")


def test_record_and_lookup_round_trip(cache):
    assert tune.lookup(KEY) is None
    tune.record(KEY, dict(choice="fused", chunks=2, comm_sms=4))
    assert cache.exists()
    assert tune.lookup(KEY)["chunks"] == 2
    other = tune.Key("matmul_reduce_scatter", 8192, 4096, 8192, "bfloat16", 4, "NVIDIA H200")
    assert tune.lookup(other) is None  # group size is part of the key
    tune.record(other, dict(choice="xla", chunks=None, comm_sms=None))
    assert tune.lookup(KEY)["choice"] == "fused" and tune.lookup(other)["choice"] == "xla"


def test_unreadable_cache_is_ignored(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    assert tune.lookup(KEY) is None


def test_decide_applies_the_noise_rule():
    # 3 % faster with 1 % spreads: a win (margin floor 2 %).
    e = tune.decide({"xla": (1.00, 0.01), (2, 4): (0.97, 0.01), (1, 4): (0.99, 0.01)})
    assert e["choice"] == "fused" and (e["chunks"], e["comm_sms"]) == (2, 4)
    # 3 % faster but a 5 % spread: not beyond the noise.
    assert tune.decide({"xla": (1.00, 0.05), (2, 4): (0.97, 0.01)})["choice"] == "xla"
    # 1 % faster: below the 2 % floor.
    assert tune.decide({"xla": (1.00, 0.0), (2, 4): (0.99, 0.0)})["choice"] == "xla"
    # No candidate was aligned for the shape.
    assert tune.decide({"xla": (1.00, 0.0)})["choice"] == "xla"


def test_shapes_of_finds_the_ops_of_an_overlapped_model():
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(x, w1, w2):
        h = jax.lax.all_gather(x, "tp", axis=0, tiled=True) @ w1
        return jax.lax.psum_scatter(h @ w2, "tp", scatter_dimension=0, tiled=True)

    fn = jax.shard_map(
        body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp")
    )
    x = jnp.ones((64, 32), jnp.bfloat16)
    w1, w2 = jnp.ones((32, 48), jnp.bfloat16), jnp.ones((48, 32), jnp.bfloat16)
    found = tune.shapes_of(jaxoverlap.overlap(fn), x, w1, w2)
    assert ("matmul_reduce_scatter", 64, 12, 32, "bfloat16", 4) in found
    assert ("all_gather_matmul", 64, 32, 12, "bfloat16", 4) in found  # gathered rows


def test_cli_needs_shapes_and_lists_the_cache(cache, capsys):
    with pytest.raises(SystemExit):
        tune.main([])
    tune.record(KEY, dict(choice="fused", chunks=2, comm_sms=4))
    assert tune.main(["--list"]) == 0
    assert "chunks=2 comm_sms=4" in capsys.readouterr().out


def test_tuning_needs_gpus():
    if jax.devices()[0].platform == "gpu":
        pytest.skip("GPU machine: tests/gpu measures for real")
    with pytest.raises(RuntimeError, match="needs 2 GPUs"):
        tune.tune_op("matmul_reduce_scatter", 4096, 4096, 4096, 2)
