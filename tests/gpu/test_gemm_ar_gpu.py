"""The fused GEMM + all-reduce (one custom call, jaxoverlap_gemm_ar_v2) on 2 GPUs against XLA's
matmul + psum: values, both ranks' outputs bitwise equal, repeated calls, and a stalled or failed
peer given up on both ranks (the stall script of test_gemm_rs_gpu)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, fused

from .test_gemm_rs_gpu import FUSED, XLA, _close, _err, _inputs, _mesh, _stall
from .test_gemm_rs_gpu import _fn as _rs_fn

pytestmark = pytest.mark.gpu


def _fn(mesh, config, x_spec=P(None, "tp")):
    def body(x, w):
        return jaxoverlap.matmul_all_reduce(x, w, "tp", config=config)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, P("tp", None)), out_specs=P()))


def _per_rank(y):
    """Each GPU's copy of a replicated result, in mesh (rank) order."""
    shards = sorted(y.addressable_shards, key=lambda s: s.device.id)
    return [np.asarray(s.data) for s in shards]


def _assert_ranks_equal(y):
    a, b = _per_rank(y)
    assert a.shape == b.shape == y.shape
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), "the ranks' outputs differ"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "m,k_local,n",
    [(1024, 512, 768), (1536, 384, 640), (768, 1152, 1280), (4096, 4096, 4096), (2048, 8192, 8192)],
)
def test_values_and_ranks_bitwise_equal(gpus, m, k_local, n, dtype):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, m, k_local, n, dtype)
    got = _fn(mesh, FUSED)(x, w)
    _close(got, _fn(mesh, XLA)(x, w), dtype)
    _assert_ranks_equal(got)


def test_3d_x_and_chunk_counts(gpus):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 384, 512, 512, jnp.bfloat16, batch=(4,))  # x [4, 384, 1024]
    x_spec = P(None, None, "tp")
    want = _fn(mesh, XLA, x_spec)(x, w)
    assert want.shape == (4, 384, 512)
    for chunks in (1, 2, 4):
        for comm_sms in (4, 16):
            cfg = Config(backend="fused", chunks=chunks, comm_sms=comm_sms)
            got = _fn(mesh, cfg, x_spec)(x, w)
            _close(got, want, jnp.bfloat16)
            _assert_ranks_equal(got)


def test_permuted_devices(gpus):
    # rank 0 on GPU 1: each rank's rows land at its rank's offset, not its ordinal's
    mesh = _mesh(gpus, order=(1, 0))
    x, w = _inputs(mesh, 1024, 256, 512, jnp.bfloat16, seed=2)
    got = _fn(mesh, FUSED)(x, w)
    _close(got, _fn(mesh, XLA)(x, w), jnp.bfloat16)


def test_hlo_is_one_call_and_no_collective(gpus):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 1024, 512, 768, jnp.bfloat16)
    hlo = _fn(mesh, FUSED).lower(x, w).compile().as_text()
    assert hlo.count(f'custom_call_target="{fused.emitted(fused.GEMM_AR_TARGET)}"') == 1
    assert fused.emitted(fused.GEMM_RS_TARGET) not in hlo
    for collective in ("all-gather", "all-reduce", "reduce-scatter"):
        assert collective not in hlo, collective


def test_bitwise_deterministic_over_200_calls(gpus):
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 2048, 1024, 1024, jnp.bfloat16, seed=3)
    f = _fn(mesh, FUSED)
    first = f(x, w)
    _close(first, _fn(mesh, XLA)(x, w), jnp.bfloat16)
    _assert_ranks_equal(first)
    outs = [f(x, w) for _ in range(200)]
    same = jax.jit(lambda a, bs: jnp.stack([jnp.array_equal(a, b) for b in bs]))
    for i in range(0, 200, 50):
        ok = np.asarray(same(first, outs[i : i + 50]))
        assert ok.all(), f"calls {i + np.flatnonzero(~ok)} differ bitwise from the first call"
    _assert_ranks_equal(outs[-1])


def test_next_to_a_reduce_scatter_in_one_program(gpus):
    """A row-parallel layer without and one with sequence parallelism in one program: the two
    targets' workspaces and flags never mix."""
    mesh = _mesh(gpus)
    x, w = _inputs(mesh, 1024, 512, 768, jnp.bfloat16, seed=7)

    def body(x, w):
        y = jaxoverlap.matmul_all_reduce(x, w, "tp", config=FUSED)
        z = jaxoverlap.matmul_reduce_scatter(2 * x, w, "tp", config=FUSED)
        return y, z, jaxoverlap.matmul_all_reduce(-x, w, "tp", config=FUSED)

    specs = dict(in_specs=(P(None, "tp"), P("tp", None)), out_specs=(P(), P("tp", None), P()))
    f = jax.jit(jax.shard_map(body, mesh=mesh, **specs))
    y, z, y2 = f(x, w)
    ar = _fn(mesh, XLA)
    _close(y, ar(x, w), jnp.bfloat16)
    _close(z, _rs_fn(mesh, XLA)(2 * x, w), jnp.bfloat16)
    _close(y2, ar(-x, w), jnp.bfloat16)
    _assert_ranks_equal(y2)


@pytest.mark.parametrize("fault", ["stall", "fail"])
def test_stalled_or_failed_peer_gives_the_call_up_on_both_ranks(gpus, fault):
    """stall: rank 1 never signals its pushes (1 s timeout): rank 0 times out waiting for rank
    1's reduce-scatter chunk; rank 0's reduced rows are then garbage, so rank 1 gives the call up
    too: both outputs NaN. (Rank 1's wait for those rows runs on a timer started microseconds
    after rank 0's, and looks at the abort word only every 1024 polls: it may time out as well,
    so either rank may be the one named.) fail: rank 1's handler fails after counting the call;
    rank 0 gives up through the abort word within seconds (timeout 60 s). Either way
    check_errors() raises, and XLA's ops and the fused op work again in the same process."""
    out, lines = _stall("gemm_ar", "check", fault=fault)
    stalled = lines.get("STALLED", "")
    assert "STALLED OK rank0_nan=True rank1_nan=True" in stalled, out[-3000:]
    check = lines.get("CHECK", "")
    assert "RAISED FusedCallError" in check, out[-3000:]
    if fault == "stall":
        assert "matmul_all_reduce timed out" in check, out[-3000:]
        assert re.search(r"\(rank [01]\).*peer rank [01]", check), out[-3000:]
    else:
        assert float(stalled.split("seconds=")[1]) < 30, out[-3000:]
        assert "test-only failure injected" in check and "rank 1;" in check, out[-3000:]
    assert lines.get("CHECK_AGAIN", "").startswith("CHECK_AGAIN OK"), out[-3000:]
    assert lines.get("XLA", "") == "XLA OK finite=True", out[-3000:]
    assert _err(lines["FUSED1"]) < 2e-2 and _err(lines["FUSED2"]) < 2e-2, out[-3000:]
