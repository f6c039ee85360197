"""The fused GEMM + reduce-scatter on 2 GPUs against XLA's matmul + psum_scatter."""

from __future__ import annotations

import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, fused
from jaxoverlap.fused import tma

from .scripts import run_script

pytestmark = pytest.mark.gpu

FUSED = Config(backend="fused")
XLA = Config(backend="xla")
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 2e-3}  # relative to the result's max magnitude


def _mesh(gpus, order=(0, 1), shape=(2,), names=("tp",)):
    return Mesh(np.array([gpus[i] for i in order]).reshape(shape), names)


def _fn(mesh, config, x_spec=P(None, "tp"), out_spec=P("tp", None), axis="tp", **kw):
    def body(x, w):
        return jaxoverlap.matmul_reduce_scatter(x, w, axis, config=config, **kw)

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(x_spec, P("tp", None)), out_specs=out_spec)
    )


def _inputs(mesh, m, k_local, n, dtype, seed=0, x_spec=P(None, "tp"), batch=()):
    kx, kw = jax.random.split(jax.random.key(seed))
    k = 2 * k_local
    x = jax.random.normal(kx, (*batch, m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    spec = P(*([None] * len(batch)), *x_spec) if batch else x_spec
    return (
        jax.device_put(x, NamedSharding(mesh, spec)),
        jax.device_put(w, NamedSharding(mesh, P("tp", None))),
    )


def _close(got, want, dtype):
    got = np.asarray(got.astype(jnp.float32))
    want = np.asarray(want.astype(jnp.float32))
    scale = max(np.abs(want).max(), 1e-6)
    err = np.abs(got - want).max() / scale
    assert err < TOL[dtype], f"max error {err:.3g} of max |ref| {scale:.3g}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "m,k_local,n",
    [(1024, 512, 768), (1536, 384, 640), (768, 1152, 1280), (4096, 4096, 4096), (2048, 8192, 8192)],
)
def test_values(gpus, m, k_local, n, dtype):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, m, k_local, n, dtype)
    got = _fn(mesh, FUSED)(x, w)
    _close(got, _fn(mesh, XLA)(x, w), dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_copy_engine_pushes(gpus, chunks, dtype):
    """Config(comm_sms=0): no SM partition, the copy engine moves the partials (its own handler,
    ffi/handlers/gemm_rs_ce.cc): values against XLA's, 2-D and 3-D x, 200 calls bitwise equal."""
    mesh = _mesh(gpus)
    cfg = Config(backend="fused", comm_sms=0, chunks=chunks)
    for m, k_local, n in ((1536, 640, 896), (4096, 4096, 4096)):
        x, w = _inputs(mesh, m, k_local, n, dtype)
        _close(_fn(mesh, cfg)(x, w), _fn(mesh, XLA)(x, w), dtype)
    x, w = _inputs(mesh, 384, 512, 640, dtype, batch=(4,))
    spec = dict(x_spec=P(None, None, "tp"), out_spec=P("tp"))
    f = _fn(mesh, cfg, **spec)
    first = f(x, w)
    _close(first, _fn(mesh, XLA, **spec)(x, w), dtype)
    outs = [f(x, w) for _ in range(200)]
    same = jax.jit(lambda a, bs: jnp.stack([jnp.array_equal(a, b) for b in bs]))
    assert np.asarray(same(first, outs)).all()
    hlo = f.lower(x, w).compile().as_text()
    assert f'custom_call_target="{fused.emitted(fused.GEMM_RS_CE_TARGET)}"' in hlo


def test_batch_dims_and_chunk_counts(gpus):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 384, 512, 512, jnp.bfloat16, batch=(4,))
    spec = dict(x_spec=P(None, None, "tp"), out_spec=P("tp"))
    ref = _fn(mesh, XLA, **spec)
    for chunks in (1, 2, 4):
        f = _fn(mesh, Config(backend="fused", chunks=chunks, comm_sms=16), **spec)
        _close(f(x, w), ref(x, w), jnp.bfloat16)


def test_permuted_devices_and_2d_mesh(gpus):
    # tp over both GPUs in reversed order, inside a (dp=1, tp=2) mesh
    mesh = _mesh(gpus, order=(1, 0), shape=(1, 2), names=("dp", "tp"))
    x, w = _inputs(mesh, 1024, 256, 512, jnp.bfloat16, x_spec=P("dp", "tp"))
    spec = dict(x_spec=P("dp", "tp"), out_spec=P(("dp", "tp"), None))
    _close(_fn(mesh, FUSED, **spec)(x, w), _fn(mesh, XLA, **spec)(x, w), jnp.bfloat16)


def test_bitwise_deterministic_and_1000_calls(gpus):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 2048, 1024, 1024, jnp.bfloat16, seed=3)
    f = _fn(mesh, FUSED)
    first = f(x, w)
    _close(first, _fn(mesh, XLA)(x, w), jnp.bfloat16)
    outs = [f(x, w) for _ in range(1000)]
    same = jax.jit(lambda a, bs: jnp.stack([jnp.array_equal(a, b) for b in bs]))
    for i in range(0, 1000, 100):
        ok = np.asarray(same(first, outs[i : i + 100]))
        assert ok.all(), f"calls {i + np.flatnonzero(~ok)} differ bitwise from the first call"


def test_inside_scan_and_fori_loop(gpus):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 1024, 512, 1024, jnp.bfloat16, seed=5)

    def looped(config):
        def body(x, w):
            def step(i, acc):
                xi = x * (1.0 + i.astype(x.dtype) / 8)
                y = jaxoverlap.matmul_reduce_scatter(xi, w, "tp", config=config)
                return acc + y.astype(jnp.float32)

            acc0 = lax.pcast(jnp.zeros((512, 1024), jnp.float32), ("tp",), to="varying")
            acc = lax.fori_loop(0, 6, step, acc0)

            def sstep(c, xs):
                return c, jaxoverlap.matmul_reduce_scatter(xs, w, "tp", config=config)

            _, ys = lax.scan(sstep, 0, jnp.stack([x, -x, 2 * x]))
            return acc, ys

        return jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P(None, "tp"), P("tp", None)),
                out_specs=(P("tp", None), P(None, "tp", None)),
            )
        )

    (a1, s1), (a2, s2) = looped(FUSED)(x, w), looped(XLA)(x, w)
    _close(a1, a2, jnp.bfloat16)
    _close(s1, s2, jnp.bfloat16)


def test_two_calls_in_one_program_and_hlo(gpus):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 1024, 512, 768, jnp.bfloat16, seed=7)

    def body(x, w):
        y1 = jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=FUSED)
        y2 = jaxoverlap.matmul_reduce_scatter(2 * x, w, "tp", config=FUSED)
        return y1, y2

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(None, "tp"), P("tp", None)),
            out_specs=(P("tp", None), P("tp", None)),
        )
    )
    hlo = f.lower(x, w).compile().as_text()
    assert hlo.count(f'custom_call_target="{fused.emitted(fused.GEMM_RS_TARGET)}"') == 2
    assert "reduce-scatter" not in hlo
    y1, y2 = f(x, w)
    ref = _fn(mesh, XLA)
    _close(y1, ref(x, w), jnp.bfloat16)
    _close(y2, ref(2 * x, w), jnp.bfloat16)


def test_middle_dimension_after_size_1_dims(gpus):
    """[1, S, K] sequence parallelism: scatter and gather dimension 1 run the fused kernels
    (their blocks are rows of x[..., K]) and equal XLA's."""
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 2048, 1024, 1024, jnp.bfloat16, batch=(1,))  # x [1, 2048, 2048]

    def make(config):
        def body(x, w):
            y = jaxoverlap.matmul_reduce_scatter(x, w, "tp", scatter_dimension=1, config=config)
            wt = jnp.transpose(w)  # [N, K_local]: gather the scattered rows back
            return jaxoverlap.all_gather_matmul(y, wt, "tp", gather_dimension=1, config=config)

        specs = dict(in_specs=(P(None, None, "tp"), P("tp", None)), out_specs=P(None, None, "tp"))
        return jax.jit(jax.shard_map(body, mesh=mesh, **specs))

    _close(make(FUSED)(x, w), make(XLA)(x, w), jnp.bfloat16)
    hlo = make(FUSED).lower(x, w).compile().as_text()
    assert f'custom_call_target="{fused.emitted(fused.GEMM_RS_TARGET)}"' in hlo
    assert f'custom_call_target="{fused.emitted(fused.AG_GEMM_TARGET)}"' in hlo
    assert "reduce-scatter" not in hlo and "all-gather" not in hlo


def test_tma_reduce_scatter(gpus):
    mesh = _mesh(gpus)
    y = jax.device_put(
        jax.random.normal(jax.random.key(9), (4096, 2 * 1536), jnp.bfloat16),
        NamedSharding(mesh, P(None, "tp")),
    )

    def run(fn):
        return jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=P(None, "tp"), out_specs=P("tp", None))
        )(y)

    got = run(lambda v: tma.tma_reduce_scatter(v, "tp", comm_sms=16))
    want = run(lambda v: lax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True))
    _close(got, want, jnp.bfloat16)
    again = run(lambda v: tma.tma_reduce_scatter(v, "tp", comm_sms=16))
    assert np.array_equal(np.asarray(got), np.asarray(again))


_STALL_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, sys, time
    from jax import lax
    from jax.sharding import Mesh, PartitionSpec as P
    import jaxoverlap
    from jaxoverlap import fused
    from jaxoverlap.fused import tma
    kernel, report, fault = sys.argv[1], sys.argv[2], sys.argv[3]
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    # stall: rank 1 never signals, its peer times out after 1 s. fail: rank 1's handler fails
    # after counting the call; with a 60 s timeout, only the abort word can end the call fast.
    timeout = 1.0 if fault == "stall" else 60.0
    knob = fused._stalled_rank_for_tests if fault == "stall" else fused._failed_rank_for_tests
    cfg = jaxoverlap.Config(backend="fused", timeout_s=timeout)
    if kernel == "gemm_rs":
        f = lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg)
    elif kernel == "gemm_rs_ce":  # Config(comm_sms=0): copy-engine pushes
        cfg = jaxoverlap.Config(backend="fused", timeout_s=timeout, comm_sms=0)
        f = lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg)
    elif kernel == "gemm_rs_tile":  # the tile schedule: the epilogue communicates
        cfg = jaxoverlap.Config(backend="fused", timeout_s=timeout, schedule="tile")
        f = lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg)
    elif kernel == "gemm_ar":
        f = lambda x, w: jaxoverlap.matmul_all_reduce(x, w, "tp", config=cfg)
    else:  # the standalone reduce-scatter's schedule (reduce-push at n = 2)
        f = lambda x, w: tma.tma_reduce_scatter(x @ w, "tp", comm_sms=8, timeout_s=timeout)
    if kernel == "gemm_ar":
        ref, out_spec = lambda x, w: lax.psum(x @ w, "tp"), P()
    else:
        ref = lambda x, w: lax.psum_scatter(x @ w, "tp", scatter_dimension=0, tiled=True)
        out_spec = P("tp", None)
    wrap = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                                            out_specs=out_spec))
    x = jax.random.normal(jax.random.key(0), (1024, 1024), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (1024, 512), jnp.bfloat16) / 32
    def line(tag, fn):
        try:
            print(tag, "OK", fn())
        except Exception as e:
            print(tag, "RAISED", type(e).__name__, str(e).replace(chr(10), " ")[:1500])
        sys.stdout.flush()
    with knob(1):
        g = wrap(f)
        g.lower(x, w)  # lowered with the knob
        def faulty():
            t0 = time.time()
            y = jax.block_until_ready(g(x, w))
            by_rank = sorted(y.addressable_shards, key=lambda s: s.device.id)  # mesh order
            nan = [bool(np.isnan(np.asarray(s.data, np.float32)).all()) for s in by_rank]
            return "rank0_nan=%s rank1_nan=%s seconds=%.1f" % (*nan, time.time() - t0)
        line("STALLED", faulty)
    if report == "check":
        line("CHECK", jaxoverlap.check_errors)
        for _ in range(4):  # both ranks may have timed out (reduce-push): one report each
            try:
                jaxoverlap.check_errors()
            except jaxoverlap.FusedCallError:
                pass
        line("CHECK_AGAIN", jaxoverlap.check_errors)
    want = np.asarray(wrap(ref)(x, w), np.float32)  # XLA's matmul + NCCL on both GPUs
    line("XLA", lambda: "finite=%s" % bool(np.isfinite(want).all()))
    def fused_again():
        got = np.asarray(wrap(f)(x, w), np.float32)
        return "err=%.3g" % (np.abs(got - want).max() / np.abs(want).max())
    line("FUSED1", fused_again)
    line("FUSED2", fused_again)
    """
)


def _stall(kernel, report, fault="stall"):
    return run_script(_STALL_SCRIPT, kernel, report, fault, only_results=True)


def _err(line):
    return float(line.split("err=")[1].split()[0])


@pytest.mark.parametrize("kernel", ["gemm_rs", "gemm_rs_ce", "gemm_rs_tile", "rs"])
def test_stalled_peer_is_reported_and_the_process_survives(gpus, kernel):
    # Rank 1 never signals (test-only knob, 1 s timeout): rank 0 gives up, its output is NaN,
    # the kernels exit (no trap); check_errors() raises naming the ranks, once; afterwards XLA's
    # own ops and the same fused op work on both GPUs of the same process.
    out, lines = _stall(kernel, "check")
    assert "STALLED OK rank0_nan=True" in lines.get("STALLED", ""), out[-3000:]
    check = lines.get("CHECK", "")
    assert "RAISED FusedCallError" in check and "timed out" in check, out[-3000:]
    # gemm_rs: only rank 0 waits on the stalled rank 1. Reduce-push: each rank waits on the
    # other, so whichever timed out first is named.
    one_way = kernel in ("gemm_rs", "gemm_rs_ce", "gemm_rs_tile")
    named = r"\(rank 0\).*peer rank 1" if one_way else r"\(rank [01]\).*peer rank [01]"
    assert re.search(named, check), out[-3000:]
    assert lines.get("CHECK_AGAIN", "").startswith("CHECK_AGAIN OK"), out[-3000:]
    assert lines.get("XLA", "") == "XLA OK finite=True", out[-3000:]
    assert _err(lines["FUSED1"]) < 2e-2 and _err(lines["FUSED2"]) < 2e-2, out[-3000:]


def test_stalled_peer_is_raised_by_the_next_fused_call(gpus):
    # Without check_errors(): the next fused call raises the failure on every rank alike, and
    # the call after it runs normally.
    out, lines = _stall("gemm_rs", "next")
    assert "STALLED OK rank0_nan=True" in lines.get("STALLED", ""), out[-3000:]
    assert lines.get("XLA", "") == "XLA OK finite=True", out[-3000:]
    first = lines.get("FUSED1", "")
    assert "RAISED" in first and "earlier fused call failed" in first, out[-3000:]
    assert "peer rank 1" in first, out[-3000:]
    assert _err(lines["FUSED2"]) < 2e-2, out[-3000:]


@pytest.mark.parametrize("kernel", ["gemm_rs", "gemm_rs_tile", "rs"])
def test_host_failure_on_one_rank_gives_the_call_up_everywhere(gpus, kernel):
    # Rank 1's handler fails after counting the call (test-only knob) while rank 0 launches:
    # rank 0's waits give up through the abort word within seconds (the timeout is 60 s), both
    # outputs are NaN, check_errors() names rank 1, and the process goes on working.
    out, lines = _stall(kernel, "check", fault="fail")
    stalled = lines.get("STALLED", "")
    assert "rank0_nan=True rank1_nan=True" in stalled, out[-3000:]
    assert float(stalled.split("seconds=")[1]) < 30, out[-3000:]
    check = lines.get("CHECK", "")
    assert "RAISED FusedCallError" in check and "test-only failure injected" in check, out[-3000:]
    assert "rank 1;" in check, out[-3000:]
    assert lines.get("CHECK_AGAIN", "").startswith("CHECK_AGAIN OK"), out[-3000:]
    assert lines.get("XLA", "") == "XLA OK finite=True", out[-3000:]
    assert _err(lines["FUSED1"]) < 2e-2 and _err(lines["FUSED2"]) < 2e-2, out[-3000:]
