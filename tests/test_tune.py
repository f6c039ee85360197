"""The tuner's cache, decision rule and model walk (the timing itself needs GPUs: tests/gpu)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
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


# ----------------------------------------------------------------------------- every kernel

KIND = "NVIDIA H200"
AUTO = jaxoverlap.Config(backend="auto")


def _measured_entry(best, field=True):
    """An entry as `tune.tune_op` records it where ``best`` won (faster than XLA beyond the
    noise, ahead of the chunked SM schedule); ``field=False``: as the tuner wrote it before."""
    times = {"xla": (1.0, 0.99, 1.01), (1, 4): (0.95, 0.94, 0.96), best: (0.8, 0.79, 0.81)}
    e = tune.decide(times)
    if field:
        e.update(new_kernels=True, failed={})
    return e


def _from_cache(op, m, k, n_cols, dtype, n, target=None):
    """`fused.policy.tuned` reading the test's tuning cache as a GPU machine's (off GPU it is
    None): the entry `tune.record` wrote for this key."""
    return tune.lookup(tune.Key(op, m, k, n_cols, str(jnp.dtype(dtype)), n, KIND))


# kind -> (tuning key (op, m, k, n) of its per-device shape, the winning candidate, its target)
HELD_BACK = {
    "tile": (("matmul_reduce_scatter", 1024, 512, 384), "tile", "jaxoverlap_gemm_rs_tile_v2"),
    "copy_engine": (("matmul_reduce_scatter", 1024, 512, 384), (4, 0), "jaxoverlap_gemm_rs_ce_v2"),
    "last_dim": (
        ("matmul_reduce_scatter_last_dim", 1024, 512, 768),
        (1, 4),
        "jaxoverlap_gemm_rs_v2",
    ),
    "along_k": (("all_gather_matmul_along_k", 1024, 512, 384), (1, 0), "jaxoverlap_ag_gemm_k_v2"),
    "keep": (("all_gather_matmul_keep", 1024, 256, 384), (1, None), "jaxoverlap_ag_gemm_keep_v2"),
    "backward": (
        ("all_gather_matmul_backward", 1024, 256, 384),
        (1, 0),
        "jaxoverlap_dgrad_rs_wgrad_v2",
    ),
}


def _lower_auto(kind):
    """The module of ``kind``'s call under backend="auto", lowered for CUDA (fake devices)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    col, row = P(None, "tp"), P("tp", None)
    if kind in ("tile", "copy_engine", "last_dim"):
        dim = 1 if kind == "last_dim" else 0
        n = 768 if kind == "last_dim" else 384

        def body(x, w):
            return jaxoverlap.matmul_reduce_scatter(x, w, "tp", scatter_dimension=dim, config=AUTO)

        f = jax.shard_map(body, mesh=mesh, in_specs=(col, row), out_specs=(col if dim else row))
        shapes = (1024, 2 * 512), (2 * 512, n)
    elif kind == "along_k":

        def body(x, w):
            return jaxoverlap.all_gather_matmul(x, w, "tp", gather_dimension=1, config=AUTO)

        f = jax.shard_map(body, mesh=mesh, in_specs=(col, col), out_specs=col)
        shapes = (1024, 2 * 256), (2 * 256, 2 * 384)
    else:  # a trained column-parallel layer: the keep variant forward, the backward

        def body(x, w):
            return jaxoverlap.all_gather_matmul(x, w, "tp", config=AUTO)

        g = jax.shard_map(body, mesh=mesh, in_specs=(row, col), out_specs=col)
        f = jax.grad(lambda x, w: jnp.sum(g(x, w).astype(jnp.float32) ** 2), argnums=(0, 1))
        shapes = (2 * 512, 256), (256, 2 * 384)
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _reason(kind):
    """Why auto keeps XLA's path for ``kind``'s call (None: it fuses), as the lowering and
    explain ask (`fused.unsupported_reason`; the backward's `fused.backward`)."""
    from jax._src.core import ShapedArray

    from jaxoverlap import fused

    bf16 = lambda *s: ShapedArray(s, jnp.bfloat16)  # noqa: E731  (per-device operands)
    params = dict(axis_name=("tp",), config=AUTO, w_colmajor=False)
    if kind == "backward":  # ct [1024, 384], w.T [384, 256]
        return fused.backward.unsupported_reason(
            bf16(1024, 384), bf16(384, 256), dict(params, scatter_dimension=0), 2
        )
    op, x, w, dims = {
        "tile": ("matmul_reduce_scatter", (1024, 512), (512, 384), dict(scatter_dimension=0)),
        "copy_engine": (
            "matmul_reduce_scatter",
            (1024, 512),
            (512, 384),
            dict(scatter_dimension=0),
        ),
        "last_dim": ("matmul_reduce_scatter", (1024, 512), (512, 768), dict(scatter_dimension=1)),
        "along_k": ("all_gather_matmul", (1024, 256), (512, 384), dict(gather_dimension=1)),
        "keep": ("all_gather_matmul", (512, 256), (256, 384), dict(gather_dimension=0)),
    }[kind]
    return fused.unsupported_reason(
        op, bf16(*x), bf16(*w), dict(params, **dims), 2, keep_gathered=kind == "keep"
    )


@pytest.mark.parametrize("kind", sorted(HELD_BACK))
def test_a_measured_entry_lets_auto_take_a_held_back_kernel(
    cache, lowering_only, monkeypatch, kind
):
    """Untuned, auto keeps XLA's path for a kernel not yet measured on two GPUs (the gate's
    reason; the tile and copy-engine schedules: the chunked one's rule), and so does an entry of
    the tuner before it tried every kernel; the tuner's entry naming the kernel as the winner
    for this shape makes auto lower to it."""
    from jaxoverlap import fused

    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", False)
    monkeypatch.setattr(fused.policy, "tuned", _from_cache)
    (op, m, k, n), best, target = HELD_BACK[kind]
    key = tune.Key(op, m, k, n, "bfloat16", 2, KIND)
    text = _lower_auto(kind)
    assert f"@{target}" not in text
    assert "reduce_scatter" in text or "all_gather" in text  # XLA's collective
    why = _reason(kind)
    if kind in ("tile", "copy_engine"):
        assert "untuned" in why and "python -m jaxoverlap.tune" in why, why
    else:
        assert "JAXOVERLAP_AUTO_NEW_KERNELS" in why and "two GPUs" in why, why

    if kind != "backward":  # an entry without the field (the old tuner's): still gated
        tune.record(key, _measured_entry(best, field=False))
        old = _lower_auto(kind)
        assert f"@{target}" not in old
        if kind in ("tile", "copy_engine"):  # the chunked SM schedule the entry allows
            assert "@jaxoverlap_gemm_rs_v2" in old and "comm_sms = 4" in old
    tune.record(key, _measured_entry(best))
    assert _reason(kind) is None
    text = _lower_auto(kind)
    calls = [ln for ln in text.splitlines() if f"@{target}" in ln]
    assert len(calls) == 1, text[-2000:]
    if kind == "keep":  # the backward is still untuned: the sibling reduce-scatter, XLA's
        assert "@jaxoverlap_dgrad_rs_wgrad_v2" not in text
    if kind == "backward":  # measured without the forward: that stays XLA's gather
        assert "@jaxoverlap_ag_gemm_keep_v2" not in text and "all_gather" in text
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", True)  # opted in: the same kernel
    assert f"@{target}" in _lower_auto(kind)


def _fake_problem(slow_s):
    """A stand-in for `tune._problem` runnable on CPU: the reduce-scatter of x @ w, right for
    most candidates, wrong values for 2 chunks, and for the tile schedule a call that takes
    ``slow_s`` (a host callback sleeping; ``problem.done`` is set when it ends)."""
    import threading
    import time

    done = threading.Event()

    def slow(y):
        time.sleep(slow_s)
        done.set()
        return y

    def body(config):
        def f(x, w):
            y = jax.lax.psum_scatter(x @ w, "tp", scatter_dimension=0, tiled=True)
            if config.chunks == 2:
                y = y * 1.5
            if config.schedule == "tile":
                y = jax.pure_callback(slow, jax.ShapeDtypeStruct(y.shape, y.dtype), y)
            return y

        return f

    def problem(op, m, k, n, group):
        shapes = (m, k * group), (k * group, n)
        return shapes, (P(None, "tp"), P("tp", None)), P("tp", None), body

    problem.done = done
    return problem


def test_wrong_and_slow_candidates_are_recorded_and_never_chosen(cache, monkeypatch):
    """tune_op on fake CPU devices (the timing faked: every wrong or slow candidate would have
    been the fastest): values unlike XLA's -> "wrong values", a call past the per-candidate
    timeout -> "timeout", both recorded in the entry's ``failed`` and never chosen; the winner
    among the rest is recorded with the field that lets auto take it."""
    monkeypatch.setattr(tune, "_gpus", lambda group: jax.devices()[:group])
    problem = _fake_problem(slow_s=2.0)
    monkeypatch.setattr(tune, "_problem", problem)
    monkeypatch.setattr(tune, "WARMUP_LIMIT_S", 0.5)
    fast = {(4, 4): 0.8}

    def fake_time(fns, samples, target_ms):
        out = {}
        for c in fns:
            t = 1.0 if c == "xla" else 0.5 if c == "tile" or c[0] == 2 else fast.get(c, 0.9)
            out[c] = (t, t * 0.99, t * 1.01)
        return out

    monkeypatch.setattr(tune, "_time", fake_time)
    key, e = tune.tune_op("matmul_reduce_scatter", 256, 128, 128, 2, timeout_s=0.5)
    assert e["choice"] == "fused" and (e["chunks"], e["comm_sms"]) == (4, 4), e
    assert e["new_kernels"] is True and e["schedule"] == "chunked"
    wrong = {c for c, why in e["failed"].items() if why.startswith("wrong values")}
    assert wrong == {"2x4", "2x8", "2x0"}, e["failed"]
    assert e["failed"]["tile"].startswith("timeout"), e["failed"]
    assert set(e["failed"]) == wrong | {"tile"}
    assert not set(e["candidates"]) & set(e["failed"])
    assert {"1x4", "4x8", "4x0"} <= set(e["candidates"])  # the copy engine was tried too
    assert tune.lookup(key) == e  # recorded in the cache
    assert "tile not used: timeout" in tune.describe(key, e)
    assert problem.done.wait(30)  # the abandoned call ends (before the process does)


def test_cli_lists_every_candidate(capsys):
    assert tune.main(["--candidates", "--op", "all"]) == 0
    out = dict(ln.split(": ", 1) for ln in capsys.readouterr().out.strip().splitlines())
    assert set(out) == set(tune.OPS)
    assert out["matmul_reduce_scatter"].split(", ")[-3:] == ["2x0", "4x0", "tile"]
    assert out["matmul_reduce_scatter_last_dim"] == out["matmul_all_reduce"]
    assert out["all_gather_matmul_keep"] == "xla, 1xNone, 2xNone, 4xNone"
    assert out["all_gather_matmul_backward"] == out["all_gather_matmul_along_k"] == "xla, 1x0"


def test_shapes_of_finds_the_held_back_variants_of_a_trained_layer():
    """Under autodiff the tuner meets the keep variant and the column-parallel backward (traced
    as if every kernel were allowed: untuned auto leaves the backward out of the jaxpr), and
    the last-dimension and along-K forms under their own ops (along K only where w is not
    trained: the variant returning x is not fused along K)."""
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(x, w1, w2, w3):
        h = jaxoverlap.all_gather_matmul(x, w1, "tp", config=AUTO)
        y = jaxoverlap.matmul_reduce_scatter(h, w2, "tp", scatter_dimension=1, config=AUTO)
        return jaxoverlap.all_gather_matmul(y, w3, "tp", gather_dimension=1, config=AUTO)

    specs = (P("tp"), P(None, "tp"), P("tp", None), P(None, "tp"))
    layer = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(None, "tp"))
    f = lambda *a: jnp.sum(layer(*a).astype(jnp.float32))  # noqa: E731
    args = [jnp.ones(s, jnp.bfloat16) for s in ((64, 32), (32, 96), (96, 64), (64, 16))]
    found = tune.shapes_of(jax.grad(f, argnums=(0, 1, 2)), *args)  # w3 not trained
    assert ("all_gather_matmul_keep", 64, 32, 48, "bfloat16", 2) in found
    assert ("all_gather_matmul_backward", 64, 32, 48, "bfloat16", 2) in found
    assert ("matmul_reduce_scatter_last_dim", 64, 48, 64, "bfloat16", 2) in found
    assert ("all_gather_matmul_along_k", 64, 64, 8, "bfloat16", 2) in found


@pytest.mark.parametrize("op", tune.OPS)
def test_every_op_the_tuner_times_runs_on_fake_devices(cache, monkeypatch, op):
    """tune_op end to end on 2 fake CPU devices for every op and variant (timing faked): its
    operands, specs and XLA's path run; every fused candidate is refused here (no GPU), so
    none is timed or recorded as failed and the entry says XLA."""
    monkeypatch.setattr(tune, "_gpus", lambda group: jax.devices()[:group])
    monkeypatch.setattr(tune, "_time", lambda fns, samples, ms: {c: (1.0, 1.0, 1.0) for c in fns})
    key, e = tune.tune_op(op, 512, 256, 256, 2)
    assert key.op == op and tune.lookup(key) == e
    assert e["choice"] == "xla" and e["candidates"] == {} and e["failed"] == {}
