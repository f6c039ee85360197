"""The fused all-gather + GEMM on 2 GPUs against XLA's all_gather + matmul."""

from __future__ import annotations

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
from jaxoverlap.fused import backward as fused_backward

from .scripts import run_script

pytestmark = pytest.mark.gpu

FUSED = Config(backend="fused")
XLA = Config(backend="xla")
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 2e-3}  # relative to the result's max magnitude
W_SPEC = P(None, "tp")  # w [K, N_local] per device


def _mesh(gpus, order=(0, 1), shape=(2,), names=("tp",)):
    return Mesh(np.array([gpus[i] for i in order]).reshape(shape), names)


def _fn(mesh, config, x_spec=P("tp"), out_spec=P(None, "tp"), axis="tp", **kw):
    def body(x, w):
        return jaxoverlap.all_gather_matmul(x, w, axis, config=config, **kw)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, W_SPEC), out_specs=out_spec))


def _inputs(mesh, m_local, k, n_local, dtype, seed=0, x_spec=P("tp"), rest=()):
    """x [2 * m_local, *rest, K] split over its first dimension, w [K, 2 * n_local] over N."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (2 * m_local, *rest, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, 2 * n_local), jnp.float32) / np.sqrt(k)).astype(dtype)
    return (
        jax.device_put(x, NamedSharding(mesh, x_spec)),
        jax.device_put(w, NamedSharding(mesh, W_SPEC)),
    )


def _close(got, want, dtype):
    got = np.asarray(got.astype(jnp.float32))
    want = np.asarray(want.astype(jnp.float32))
    assert got.shape == want.shape
    scale = max(np.abs(want).max(), 1e-6)
    err = np.abs(got - want).max() / scale
    assert err < TOL[dtype], f"max error {err:.3g} of max |ref| {scale:.3g}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "m_local,k,n_local",
    [(512, 512, 768), (768, 384, 640), (384, 1152, 1280), (2048, 4096, 4096), (1024, 8192, 8192)],
)
def test_values(gpus, m_local, k, n_local, dtype):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, m_local, k, n_local, dtype)
    _close(_fn(mesh, FUSED)(x, w), _fn(mesh, XLA)(x, w), dtype)


def test_3d_x_and_chunk_counts(gpus):
    # x [B, S, K] per device [2, 384, 512]: gathering dimension 0 gives [4, 384, N_local]
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 2, 512, 512, jnp.bfloat16, rest=(384,))
    spec = dict(out_spec=P(None, None, "tp"))
    ref = _fn(mesh, XLA, **spec)(x, w)
    for chunks in (1, 2, 4):
        got = _fn(mesh, Config(backend="fused", chunks=chunks), **spec)(x, w)
        _close(got, ref, jnp.bfloat16)


def test_permuted_devices_and_2d_mesh(gpus):
    # tp over both GPUs in reversed order, inside a (dp=1, tp=2) mesh
    mesh = _mesh(gpus, order=(1, 0), shape=(1, 2), names=("dp", "tp"))
    x, w = _inputs(mesh, 512, 256, 512, jnp.bfloat16, x_spec=P("tp", "dp"))
    spec = dict(x_spec=P("tp", "dp"), out_spec=P("dp", "tp"))
    _close(_fn(mesh, FUSED, **spec)(x, w), _fn(mesh, XLA, **spec)(x, w), jnp.bfloat16)


def test_bitwise_deterministic_and_1000_calls(gpus):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 1024, 1024, 1024, jnp.bfloat16, seed=3)
    f = _fn(mesh, FUSED)
    first = f(x, w)
    _close(first, _fn(mesh, XLA)(x, w), jnp.bfloat16)
    outs = [f(x, w) for _ in range(1000)]
    same = jax.jit(lambda a, bs: jnp.stack([jnp.array_equal(a, b) for b in bs]))
    for i in range(0, 1000, 100):
        ok = np.asarray(same(first, outs[i : i + 100]))
        assert ok.all(), f"calls {i + np.flatnonzero(~ok)} differ bitwise from the first call"


def test_two_call_sites_of_different_shapes_and_hlo(gpus):
    """The case that hung the earlier copy-engine attempt: further fused call sites (each a new
    workspace; one with a new GEMM shape) right behind the first, in one program, called back to
    back."""
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 512, 512, 768, jnp.bfloat16, seed=7)
    w3 = jax.device_put(
        (jax.random.normal(jax.random.key(8), (512, 2 * 384)) / 23).astype(jnp.bfloat16),
        NamedSharding(mesh, W_SPEC),
    )

    def program(config):
        def body(x, w, w3):
            y1 = jaxoverlap.all_gather_matmul(x, w, "tp", config=config)
            y2 = jaxoverlap.all_gather_matmul(2 * x, w, "tp", config=config)
            y3 = jaxoverlap.all_gather_matmul(x[:256] - 1, w3, "tp", config=config)
            return y1, y2, y3

        return jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P("tp"), W_SPEC, W_SPEC), out_specs=(P(None, "tp"),) * 3
            )
        )

    f = program(FUSED)
    hlo = f.lower(x, w, w3).compile().as_text()
    assert hlo.count(f'custom_call_target="{fused.emitted(fused.AG_GEMM_TARGET)}"') == 3
    assert "all-gather" not in hlo
    want = program(XLA)(x, w, w3)
    for _ in range(20):  # back to back: every site's epochs and slots advance together
        got = f(x, w, w3)
    for g, r in zip(got, want, strict=True):
        _close(g, r, jnp.bfloat16)


def test_inside_scan_and_fori_loop(gpus):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 512, 512, 1024, jnp.bfloat16, seed=5)

    def looped(config):
        def body(x, w):
            def step(i, acc):
                xi = x * (1.0 + i.astype(x.dtype) / 8)
                y = jaxoverlap.all_gather_matmul(xi, w, "tp", config=config)
                return acc + y.astype(jnp.float32)

            acc0 = lax.pcast(jnp.zeros((1024, 1024), jnp.float32), ("tp",), to="varying")
            acc = lax.fori_loop(0, 6, step, acc0)

            def sstep(c, xs):
                return c, jaxoverlap.all_gather_matmul(xs, w, "tp", config=config)

            _, ys = lax.scan(sstep, 0, jnp.stack([x, -x, 2 * x]))
            return acc, ys

        return jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P("tp"), W_SPEC),
                out_specs=(P(None, "tp"), P(None, None, "tp")),
            )
        )

    (a1, s1), (a2, s2) = looped(FUSED)(x, w), looped(XLA)(x, w)
    _close(a1, a2, jnp.bfloat16)
    _close(s1, s2, jnp.bfloat16)


def test_mlp_values_and_gradients(gpus):
    """A sequence-parallel MLP: fused all_gather_matmul then fused matmul_reduce_scatter. The
    training step fuses every collective: forward AG (returning the x it gathered for dW1) and
    RS; backward, the RS's cotangent gathered once for dh and dW2 (reading w2.T in place), and
    the AG's dx reduce-scattered beside dW1's GEMM."""
    mesh = _mesh(gpus)
    kx, k1, k2 = jax.random.split(jax.random.key(11), 3)
    d, f_local = 512, 768
    x = jax.device_put(
        jax.random.normal(kx, (2 * 1024, d)).astype(jnp.bfloat16), NamedSharding(mesh, P("tp"))
    )
    w1 = jax.device_put(
        (jax.random.normal(k1, (d, 2 * f_local)) / np.sqrt(d)).astype(jnp.bfloat16),
        NamedSharding(mesh, P(None, "tp")),
    )
    w2 = jax.device_put(
        (jax.random.normal(k2, (2 * f_local, d)) / np.sqrt(2 * f_local)).astype(jnp.bfloat16),
        NamedSharding(mesh, P("tp", None)),
    )

    def loss(config):
        def layer(x, w1, w2):
            h = jaxoverlap.all_gather_matmul(x, w1, "tp", config=config)
            return jaxoverlap.matmul_reduce_scatter(h, w2, "tp", config=config)

        def f(x, w1, w2):
            y = jax.shard_map(
                layer,
                mesh=mesh,
                in_specs=(P("tp"), P(None, "tp"), P("tp", None)),
                out_specs=P("tp"),
            )(x, w1, w2)
            return jnp.sum(jnp.square(y.astype(jnp.float32))), y

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    g_fused = loss(FUSED)
    hlo = g_fused.lower(x, w1, w2).compile().as_text()
    # forward AG and the RS's backward: the variant that also returns what it gathered
    assert hlo.count(f'custom_call_target="{fused.emitted(fused.AG_GEMM_KEEP_TARGET)}"') == 2
    assert hlo.count(f'custom_call_target="{fused.emitted(fused.AG_GEMM_TARGET)}"') == 0
    assert hlo.count(f'custom_call_target="{fused.emitted(fused.GEMM_RS_TARGET)}"') == 1
    assert hlo.count(f'custom_call_target="{fused.emitted(fused_backward.TARGET)}"') == 1
    assert "all-gather" not in hlo and "reduce-scatter" not in hlo
    assert_w_transposes_are_free(hlo, expected=2)
    (l1, y1), grads1 = g_fused(x, w1, w2)
    (l2, y2), grads2 = loss(XLA)(x, w1, w2)
    _close(y1, y2, jnp.bfloat16)
    assert abs(float(l1) - float(l2)) <= 3e-2 * abs(float(l2))
    for a, b in zip(grads1, grads2, strict=True):
        _close(a, b, jnp.bfloat16)


def assert_w_transposes_are_free(hlo, expected=None):
    """Every fused call that takes w column-major (the backward's ``ct @ w.T``) gets w with no
    copy: its operand is a bitcast of the stored weight (or the weight itself), not a transpose
    or copy fusion that materialises w.T."""
    defs = {}
    for line in hlo.splitlines():
        line = line.strip()
        if line.startswith("ROOT "):
            line = line[5:]
        if line.startswith("%") and " = " in line:
            name, rhs = line.split(" = ", 1)
            defs[name] = rhs
    found = 0
    for rhs in defs.values():
        if 'custom_call_target="jaxoverlap_' not in rhs or "{0,1}}" not in rhs:
            continue
        found += 1
        w_operand = rhs.split("custom-call(", 1)[1].split(")", 1)[0].split(", ")[1]
        producer = defs[w_operand.split(" ")[-1]]
        opcode = producer.split("(", 1)[0].split(" ")[-1]
        assert opcode in ("bitcast", "parameter", "get-tuple-element"), (w_operand, producer)
    if expected is None:
        assert found, "no fused call takes w column-major"
    else:
        assert found == expected, f"{found} fused calls take w column-major, expected {expected}"


_STALL_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, sys, time
    from jax import lax
    from jax.sharding import Mesh, PartitionSpec as P
    import jaxoverlap
    from jaxoverlap import fused
    fault = sys.argv[1]
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    # stall: rank 1 never signals its pushes, rank 0 times out after 1 s. fail: rank 1's handler
    # fails after counting the call; with a 60 s timeout only the abort word ends the call fast.
    timeout = 1.0 if fault == "stall" else 60.0
    knob = fused._stalled_rank_for_tests if fault == "stall" else fused._failed_rank_for_tests
    cfg = jaxoverlap.Config(backend="fused", timeout_s=timeout)
    f = lambda x, w: jaxoverlap.all_gather_matmul(x, w, "tp", config=cfg)
    ref = lambda x, w: lax.all_gather(x, "tp", axis=0, tiled=True) @ w
    wrap = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                            out_specs=P(None, "tp")))
    x = jax.random.normal(jax.random.key(0), (1024, 512), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (512, 1024), jnp.bfloat16) / 32
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
            y = np.asarray(jax.block_until_ready(g(x, w)), np.float32)
            return "rank0_nan=%s rank1_nan=%s seconds=%.1f" % (
                bool(np.isnan(y[:, :512]).all()), bool(np.isnan(y[:, 512:]).all()),
                time.time() - t0)
        line("STALLED", faulty)
    line("CHECK", jaxoverlap.check_errors)
    for _ in range(4):
        try:
            jaxoverlap.check_errors()
        except jaxoverlap.FusedCallError:
            pass
    line("CHECK_AGAIN", jaxoverlap.check_errors)
    want = np.asarray(wrap(ref)(x, w), np.float32)  # XLA's all-gather + matmul on both GPUs
    line("XLA", lambda: "finite=%s" % bool(np.isfinite(want).all()))
    def fused_again():
        got = np.asarray(wrap(f)(x, w), np.float32)
        return "err=%.3g" % (np.abs(got - want).max() / np.abs(want).max())
    line("FUSED1", fused_again)
    line("FUSED2", fused_again)
    """
)


def _stall(fault):
    return run_script(_STALL_SCRIPT, fault, only_results=True)


def _err(line):
    return float(line.split("err=")[1].split()[0])


def test_stalled_peer_is_reported_and_the_process_survives(gpus):
    # Rank 1 never signals its pushes (test-only knob, 1 s timeout): rank 0 gives up, its
    # output is NaN, no trap; check_errors() names rank 0 waiting on peer rank 1, once; then
    # XLA's own ops and the same fused op work on both GPUs of the same process.
    out, lines = _stall("stall")
    assert "STALLED OK rank0_nan=True" in lines.get("STALLED", ""), out[-3000:]
    check = lines.get("CHECK", "")
    assert "RAISED FusedCallError" in check and "all_gather_matmul timed out" in check, out[-3000:]
    assert "(rank 0)" in check and "peer rank 1" in check and "pushed by its copy" in check, out[
        -3000:
    ]
    assert lines.get("CHECK_AGAIN", "").startswith("CHECK_AGAIN OK"), out[-3000:]
    assert lines.get("XLA", "") == "XLA OK finite=True", out[-3000:]
    assert _err(lines["FUSED1"]) < 2e-2 and _err(lines["FUSED2"]) < 2e-2, out[-3000:]


def test_host_failure_on_one_rank_gives_the_call_up_everywhere(gpus):
    # Rank 1's handler fails after counting the call while rank 0 launches: rank 0's wait gives
    # up through the abort word within seconds (timeout 60 s), both outputs are NaN (rank 1's by
    # the failure path), check_errors() names rank 1, and later calls work.
    out, lines = _stall("fail")
    stalled = lines.get("STALLED", "")
    assert "rank0_nan=True rank1_nan=True" in stalled, out[-3000:]
    assert float(stalled.split("seconds=")[1]) < 30, out[-3000:]
    check = lines.get("CHECK", "")
    assert "RAISED FusedCallError" in check and "test-only failure injected" in check, out[-3000:]
    assert "rank 1;" in check, out[-3000:]
    assert lines.get("XLA", "") == "XLA OK finite=True", out[-3000:]
    assert _err(lines["FUSED1"]) < 2e-2 and _err(lines["FUSED2"]) < 2e-2, out[-3000:]
