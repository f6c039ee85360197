"""The reduce-scatter over the last dimension (jaxoverlap/fused/last_dim.py), lowered for CUDA
without a GPU: one jaxoverlap_gemm_rs_v2 call of the transposed problem with both operands
column-major (w.T and x.T are w and x as they are) and the result column-major, no XLA
reduce-scatter; a transposed weight (w_colmajor) is read row-major instead; `auto` keeps XLA's
path until the kernel has run on two GPUs. The values: tests/gpu/test_xproc_gpu.py (two
processes)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, fused

TOKEN = "!stablehlo.token"  # every fused call's last operand and result (the order)


def _lower(x_shape, w_shape, cfg):
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

    def body(x, w):
        return jaxoverlap.matmul_reduce_scatter(x, w, "tp", scatter_dimension=-1, config=cfg)

    spec = P(*([None] * (len(x_shape) - 1)), "tp")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P("tp", None)), out_specs=spec))
    x = jax.ShapeDtypeStruct(x_shape, jnp.bfloat16)
    w = jax.ShapeDtypeStruct(w_shape, jnp.bfloat16)
    return f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("x_shape", [(1024, 2 * 512), (2, 512, 2 * 512)])
def test_last_dimension_is_one_call_of_the_transposed_problem(lowering_only, monkeypatch, x_shape):
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: None)
    text = _lower(x_shape, (2 * 512, 768), Config(backend="fused"))
    (call,) = [ln for ln in text.splitlines() if f"@{fused.GEMM_RS_TARGET}" in ln]
    assert "reduce_scatter" not in text
    m = int(np.prod(x_shape[:-1]))
    # A = w.T [N, K], B = x.T [K, M], both column-major; out [M, N / 2] column-major.
    assert (
        f"(tensor<768x512xbf16>, tensor<512x{m}xbf16>, {TOKEN}) -> (tensor<{m}x384xbf16>, {TOKEN})"
        in call
    ), call
    assert "x_colmajor = 1" in call and "w_colmajor = 1" in call
    layouts = re.findall(r"dense<\[0, 1\]> : tensor<2xindex>", call)
    assert len(layouts) == 3, call  # two operands and the result, minor-to-major [0, 1]
    # Rows per rank: N / 2 = 384, chunks of a multiple of 128 rows -> 3 does not divide into the
    # defaults 4 or 2; 1 chunk.
    assert "chunks = 1" in call


def test_transposed_weight_is_read_row_major(lowering_only, monkeypatch):
    """dx of all_gather_matmul gathering K is ct @ w.T scattered over its last dimension, with w.T
    the weight read in place (w_colmajor): the transposed problem's A is then w, row-major."""
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: None)
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", True)
    monkeypatch.setattr(fused.policy, "_auto_reason", lambda *a: None)  # "measured faster"
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    cfg = Config(backend="auto")  # "fused" would raise: no fused variant returning x along K

    def body(x, w):
        return jaxoverlap.all_gather_matmul(x, w, "tp", gather_dimension=-1, config=cfg)

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P(None, "tp")
    )
    g = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32)), argnums=0))
    x = jax.ShapeDtypeStruct((1024, 2 * 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2 * 512, 2 * 768), jnp.bfloat16)
    text = g.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if f"@{fused.GEMM_RS_TARGET}" in ln]
    assert len(calls) == 1, text[-3000:]
    (call,) = calls
    assert "x_colmajor = 0" in call and "w_colmajor = 1" in call, call
    # A = w [K, N] as is (row-major), B = ct.T [N, M] (ct read column-major); dx [M, K / 2].
    assert (
        f"(tensor<1024x768xbf16>, tensor<768x1024xbf16>, {TOKEN}) -> "
        f"(tensor<1024x512xbf16>, {TOKEN})" in call
    ), call
    assert "operand_layouts = [dense<[1, 0]> : tensor<2xindex>, dense<[0, 1]>" in call, call


def test_auto_keeps_xla_until_measured(lowering_only, monkeypatch):
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", False)
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: None)
    text = _lower((8192, 2 * 4096), (2 * 4096, 8192), Config(backend="auto"))
    assert f"@{fused.GEMM_RS_TARGET}" not in text and "reduce_scatter" in text
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", True)
    text = _lower((8192, 2 * 4096), (2 * 4096, 8192), Config(backend="auto"))
    assert f"@{fused.GEMM_RS_TARGET}" in text and "reduce_scatter" not in text


def test_row_scatter_calls_say_x_is_row_major(lowering_only, monkeypatch):
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: None)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    f = jax.jit(
        jax.shard_map(
            lambda x, w: jaxoverlap.matmul_reduce_scatter(
                x, w, "tp", config=Config(backend="fused")
            ),
            mesh=mesh,
            in_specs=(P(None, "tp"), P("tp", None)),
            out_specs=P("tp", None),
        )
    )
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1024, 768), jnp.bfloat16)
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = [ln for ln in text.splitlines() if f"@{fused.GEMM_RS_TARGET}" in ln]
    assert "x_colmajor = 0" in call


def _lower_k(x_shape, w_shape, cfg, grad=False):
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

    def body(x, w):
        return jaxoverlap.all_gather_matmul(x, w, "tp", gather_dimension=-1, config=cfg)

    spec = P(*([None] * (len(x_shape) - 1)), "tp")
    f = jax.shard_map(body, mesh=mesh, in_specs=(spec, P(None, "tp")), out_specs=spec)
    if grad:  # a trained weight: the forward is the variant that returns the gathered x
        op = f
        f = jax.grad(lambda x, w: jnp.sum(op(x, w).astype(jnp.float32)), argnums=(0, 1))
    x = jax.ShapeDtypeStruct(x_shape, jnp.bfloat16)
    w = jax.ShapeDtypeStruct(w_shape, jnp.bfloat16)
    return jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("x_shape", [(1024, 2 * 256), (2, 512, 2 * 256)])
def test_gather_along_k_is_one_call_with_a_float32_sum(lowering_only, monkeypatch, x_shape):
    from jaxoverlap.fused import last_dim as fused_cols

    monkeypatch.setattr(fused.policy, "tuned", lambda *a: None)
    text = _lower_k(x_shape, (2 * 256, 2 * 384), Config(backend="fused"))
    (call,) = [ln for ln in text.splitlines() if f"@{fused_cols.AG_K_TARGET}" in ln]
    assert "all_gather" not in text
    local = "x".join(map(str, (*x_shape[:-1], 256)))
    out = "x".join(map(str, (*x_shape[:-1], 384)))
    m = int(np.prod(x_shape[:-1]))
    want = (
        f"(tensor<{local}xbf16>, tensor<512x384xbf16>, {TOKEN}) -> "
        f"(tensor<{out}xbf16>, tensor<{m}x384xf32>, {TOKEN})"
    )
    assert want in call, call
    assert "chunks = 1" in call and "comm_sms = 0" in call


def test_gather_along_k_with_a_trained_weight(lowering_only, monkeypatch):
    """dW needs the gathered x: that variant is not fused along K -- backend="fused" says so,
    "auto" (opted in) keeps XLA's all-gather."""
    from jaxoverlap.fused import last_dim as fused_cols

    monkeypatch.setattr(fused.policy, "tuned", lambda *a: None)
    with pytest.raises(ValueError, match="along K, the all-gather that also returns x"):
        _lower_k((1024, 512), (512, 768), Config(backend="fused"), grad=True)
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", True)
    monkeypatch.setattr(fused.policy, "_auto_reason", lambda *a: None)
    text = _lower_k((1024, 512), (512, 768), Config(backend="auto"), grad=True)
    assert f"@{fused_cols.AG_K_TARGET}" not in text and "all_gather" in text
