"""The tuner's cache, decision rule and model walk (the timing itself needs GPUs: tests/gpu)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import runtime, tune


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(runtime, "fingerprint", lambda: "test")
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
    # (median, q1, q3). 3 % faster, quartiles apart: a win, with the best setting.
    e = tune.decide(
        {"xla": (1.00, 0.99, 1.01), (2, 4): (0.97, 0.965, 0.975), (1, 4): (0.99, 0.98, 1.0)}
    )
    assert e["choice"] == "fused" and (e["chunks"], e["comm_sms"]) == (2, 4)
    # 3 % faster but the quartiles overlap: not beyond the noise.
    assert tune.decide({"xla": (1.00, 0.95, 1.05), (2, 4): (0.97, 0.96, 0.99)})["choice"] == "xla"
    # 1 % faster with tight quartiles: below the 2 % floor.
    assert tune.decide({"xla": (1.00, 1.0, 1.0), (2, 4): (0.99, 0.99, 0.99)})["choice"] == "xla"
    # 20 % faster, one wild sample each (quartiles stay tight): a win (run 17 vetoed these).
    assert tune.decide({"xla": (1.0, 0.98, 1.02), (2, 4): (0.8, 0.79, 0.82)})["choice"] == "fused"
    # No candidate was aligned for the shape.
    assert tune.decide({"xla": (1.00, 1.0, 1.0)})["choice"] == "xla"


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


def test_cli_tunes_the_op_it_is_given(cache, capsys, monkeypatch):
    seen = []

    def fake_tune_op(op, m, k, n, group, dtype, samples, timeout_s):
        seen.append((op, m, k, n, group, dtype, samples))
        return KEY, dict(choice="xla", chunks=1, comm_sms=None, ms_xla=1.0, ms_fused=1.1, spread=0)

    monkeypatch.setattr(tune, "tune_op", fake_tune_op)
    assert tune.main(["--op", "all_gather_matmul", "--shapes", "8192x8192x4096,4096x1024x512"]) == 0
    assert seen == [
        ("all_gather_matmul", 8192, 8192, 4096, 2, "bfloat16", 9),
        ("all_gather_matmul", 4096, 1024, 512, 2, "bfloat16", 9),
    ]
    assert "[2/2]" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tune.main(["--shapes", "8192x4096"])


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


@pytest.mark.parametrize("opted_in", [False, True])
def test_the_tuner_tries_every_kernel_opted_in_or_not(monkeypatch, opted_in):
    """Every kernel of the one-GPU suite is a candidate whether or not untuned auto may take it
    yet: the copy engine and the tile schedule for the reduce-scatter, the SM schedules for the
    all-reduce and the last-dimension scatter, the row gather and its keep variant by chunks, the
    all-gather along K and the column-parallel backward (copy engine, one chunk)."""
    from jaxoverlap import fused

    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", opted_in)
    rs = tune.candidates("matmul_reduce_scatter")
    assert (2, 0) in rs and (4, 0) in rs and tune.TILE in rs and (2, 4) in rs
    for op in ("matmul_all_reduce", fused.policy.LAST_DIM):  # no CE handler, no tile
        assert tune.candidates(op) == tune.RS_CANDIDATES
    assert tune.candidates(fused.policy.KEEP) == tune.candidates("all_gather_matmul")
    assert tune.candidates(fused.policy.ALONG_K) == tune.candidates(fused.policy.BACKWARD)
    assert tune.candidates(fused.policy.BACKWARD) == ((1, 0),)
    assert set(tune.OPS) == {
        "matmul_reduce_scatter",
        "matmul_all_reduce",
        "all_gather_matmul",
        "matmul_reduce_scatter_last_dim",
        "all_gather_matmul_along_k",
        "all_gather_matmul_keep",
        "all_gather_matmul_backward",
    }


def test_decide_records_the_tile_schedule():
    xla = (1.0, 0.98, 1.02)
    e = tune.decide({"xla": xla, (2, 4): (0.9, 0.89, 0.91), "tile": (0.8, 0.79, 0.81)})
    assert e["choice"] == "fused" and e["schedule"] == "tile"
    assert e["chunks"] == 1 and e["comm_sms"] == 0 and set(e["candidates"]) == {"2x4", "tile"}
    e = tune.decide({"xla": xla, (2, 4): (0.8, 0.79, 0.81), "tile": (0.9, 0.89, 0.91)})
    assert e["schedule"] == "chunked" and (e["chunks"], e["comm_sms"]) == (2, 4)


def test_register_targets_shares_gemm_choices_without_deadlock(monkeypatch, tmp_path):
    """register_targets points the GEMM runner's choices at the tuner's cache directory; the
    fingerprint it needs loads the extension through native(), which takes the registration
    lock: done under that lock it would deadlock at the first fused lowering."""
    import threading

    from jaxoverlap import runtime

    seen = []

    class FakeNative:
        def registrations(self):
            return {}

        def set_gemm_cache_dir(self, path):
            seen.append(path)

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(runtime, "_native", FakeNative())
    monkeypatch.setattr(runtime, "_registered", False)
    t = threading.Thread(target=runtime.register_targets, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "register_targets deadlocked"
    assert len(seen) == 1 and seen[0].startswith(str(tmp_path / "jaxoverlap" / "gemm-")), seen
    assert os.path.isdir(seen[0])
