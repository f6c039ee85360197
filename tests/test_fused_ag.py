"""The fused all_gather_matmul's decisions on CPU: trace-time reasons, alignment, the
cost-model rule for backend="auto", the custom call a CUDA lowering emits (lowered for CUDA from
fake CPU devices; no GPU needed), and the backward pass's use of both fused ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, fused
from jaxoverlap.fused import backward as fused_backward

TOKEN = "!stablehlo.token"  # every fused call's last operand and result (the order)

OP = "all_gather_matmul"
FUSED = Config(backend="fused")


def _aval(shape, dtype=jnp.bfloat16):
    return jax.core.ShapedArray(shape, dtype)


def _reason(x_shape, w_shape, n=2, dtype=jnp.bfloat16, dim=0, **cfg):
    params = dict(axis_name=("tp",), gather_dimension=dim, config=Config(**cfg), w_colmajor=False)
    return fused.unsupported_reason(OP, _aval(x_shape, dtype), _aval(w_shape, dtype), params, n)


def test_reasons(native_ok, monkeypatch):
    assert _reason((512, 512), (512, 768), backend="fused") is None
    # rows of x per rank need not be divisible by the group size (they are gathered, not split)
    assert _reason((3 * 128, 512), (512, 768), n=3, backend="fused") is None
    assert _reason((4, 384, 512), (512, 512), backend="fused") is None
    assert "float32" in _reason((512, 512), (512, 768), dtype=jnp.float32, backend="fused")
    assert "multiples of 8" in _reason((512, 500), (500, 768), backend="fused")
    assert "alignment" in _reason((24, 8), (8, 8), backend="fused")
    assert "alignment" in _reason((512, 512), (512, 768), backend="fused", chunks=3)
    assert "outside 2..8" in _reason((512, 512), (512, 768), n=16, backend="fused")
    # any dimension but K: major-most in the custom call's layout ([B, S, D] split over S)
    assert _reason((4, 384, 512), (512, 512), dim=1, backend="fused") is None
    assert _reason((1, 384, 512), (512, 512), dim=1, backend="fused") is None  # [1, S, D]
    # K (fused/last_dim.py: a float32 sum of the blocks' GEMMs); auto only when opted in
    assert _reason((4, 384, 64), (128, 512), dim=2, backend="fused") is None
    assert "K / n=4" in _reason((4, 384, 4), (8, 512), dim=2, backend="fused")
    assert "alignment" in _reason((1, 3, 8), (16, 512), dim=2, backend="fused")  # 3 x 8
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", False)
    assert "along K" in _reason((4, 384, 64), (128, 512), dim=2)
    assert "no rows" in _reason((0, 512), (512, 768), backend="fused")


def test_auto_rule_is_the_cost_model(native_ok, monkeypatch):
    # Untuned: tp=2, gathered rows and K >= 4096, N_local >= 2048: fused; else or tp > 2: XLA.
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: None)
    assert _reason((4096, 8192), (8192, 4096)) is None
    assert _reason((2048, 4096), (4096, 7168)) is None
    assert _reason((2048, 4096), (4096, 2048)) is None  # N_local 2048: measured 1.35x over XLA
    assert "outside the conservative rule" in _reason((2048, 4096), (4096, 1024))  # N_local 1024
    assert "outside the conservative rule" in _reason((1024, 4096), (4096, 8192))  # 2048 rows
    assert "outside the conservative rule" in _reason((4096, 2048), (2048, 8192))  # K 2048
    assert "outside the conservative rule" in _reason((4096, 8192), (8192, 4096), n=4)
    assert fused.ag_auto_predicts_win(8192, 4096, 4096, 2)
    assert not fused.ag_auto_predicts_win(8192, 4096, 4096, 8)


def test_public_function_raises_with_the_reason(native_ok):
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

    def body(x, w):
        return jaxoverlap.all_gather_matmul(x, w, "tp", gather_dimension=2, config=FUSED)

    specs = (P(None, None, "tp"), P())
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())
    x = jnp.zeros((4, 256, 8), jnp.bfloat16)  # K / n = 4 per device: not a multiple of 8
    with pytest.raises(ValueError, match="must be multiples of 8"):
        jax.jit(f).trace(x, jnp.zeros((8, 128), jnp.bfloat16))


def _calls(text, target):
    return [line for line in text.splitlines() if f"@{target}" in line]


def test_cuda_lowering_emits_the_custom_call(lowering_only):
    devs = np.array(jax.devices()[:4])[[2, 0, 3, 1]].reshape(2, 2)
    mesh = Mesh(devs, ("dp", "tp"))

    def body(x, w):
        return jaxoverlap.all_gather_matmul(x, w, "tp", config=FUSED)

    w = jax.ShapeDtypeStruct((512, 2 * 384), jnp.bfloat16)
    text = (
        jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")
            )
        )
        .trace(jax.ShapeDtypeStruct((2 * 256, 512), jnp.bfloat16), w)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    calls = _calls(text, fused.AG_GEMM_TARGET)
    assert len(calls) == 1 and "all_gather" not in text
    call = calls[0]
    # devices 2,0 form one tp group and 3,1 the other; ranks follow the tp position
    assert "ordinals = dense<[2, 0, 3, 1]>" in call
    assert "ranks = dense<[0, 1, 0, 1]>" in call
    assert "groups = dense<[2, 0, 2, 0, 3, 1, 3, 1]>" in call
    assert "n = 2" in call and "chunks = 1" in call and "stall_rank" not in call
    assert (
        f"(tensor<256x512xbf16>, tensor<512x384xbf16>, {TOKEN}) -> (tensor<512x384xbf16>, {TOKEN})"
        in call
    )
    # a 3-D x [B, S, K]: gathering dimension 0 (B) is one contiguous block of rows per rank
    f3 = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, None, "tp")
        )
    )
    text3 = (
        f3.trace(jax.ShapeDtypeStruct((2 * 2, 256, 512), jnp.bfloat16), w)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    (call3,) = _calls(text3, fused.AG_GEMM_TARGET)
    assert (
        f"(tensor<2x256x512xbf16>, tensor<512x384xbf16>, {TOKEN}) -> "
        f"(tensor<4x256x384xbf16>, {TOKEN})" in call3
    )


def test_backward_uses_both_fused_ops(lowering_only):
    """d/dx of all_gather_matmul is a matmul_reduce_scatter and vice versa: with the fused
    config, a train step's HLO has both custom calls and no all-gather for those GEMMs."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

    def layer(x, w1, w2):
        h = jaxoverlap.all_gather_matmul(x, w1, "tp", config=FUSED)
        return jaxoverlap.matmul_reduce_scatter(h, w2, "tp", config=FUSED)

    def loss(x, w1, w2):
        y = jax.shard_map(
            layer,
            mesh=mesh,
            in_specs=(P("tp"), P(None, "tp"), P("tp", None)),
            out_specs=P("tp"),
        )(x, w1, w2)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    x = jax.ShapeDtypeStruct((2 * 512, 256), jnp.bfloat16)
    w1 = jax.ShapeDtypeStruct((256, 2 * 384), jnp.bfloat16)
    w2 = jax.ShapeDtypeStruct((2 * 384, 256), jnp.bfloat16)
    text = (
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        .trace(x, w1, w2)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    # Training: the forward AG returns the x it gathered (for dW1); the backward of the
    # reduce-scatter is the same variant on the cotangent (shared by dh and dW2); the backward
    # of the all-gather is one call computing dx's reduce-scatter beside dW1's GEMM. Forward RS.
    # Nothing gathered or scattered by XLA.
    keep, plain = _calls(text, fused.AG_GEMM_KEEP_TARGET), _calls(text, fused.AG_GEMM_TARGET)
    rs, bwd = _calls(text, fused.GEMM_RS_TARGET), _calls(text, fused_backward.TARGET)
    assert len(keep) == 2 and not plain and len(rs) == 1 and len(bwd) == 1
    assert "all_gather" not in text and "reduce_scatter" not in text
    # The backward's `ct @ w.T` reads w in place: the custom call asks for w column-major (XLA
    # makes the transpose a bitcast) and tells the kernel so; the forward's w is row-major.
    colmajor = "dense<[0, 1]> : tensor<2xindex>"
    forward, backward = keep
    assert "w_colmajor = 0" in forward and colmajor not in forward
    assert "w_colmajor = 1" in backward and colmajor in backward
    assert _site(forward) != _site(backward)  # GEMM plans differ: separate workspaces
    assert "w_colmajor = 0" in rs[0] and colmajor not in rs[0]
    assert "w_colmajor = 1" in bwd[0] and colmajor in bwd[0]
    # (ct, w.T, g) -> (dx, dW, scratch for ct @ w.T)
    assert (
        f"-> (tensor<512x256xbf16>, tensor<256x384xbf16>, tensor<1024x256xbf16>, {TOKEN})" in bwd[0]
    )


def _site(call):
    return call.split("site = ")[1].split(" ")[0]


@pytest.mark.parametrize("opted_in", [False, True])
def test_auto_takes_the_training_path_only_once_opted_in(lowering_only, monkeypatch, opted_in):
    """Until the training path's kernels have run on GPUs, backend="auto" keeps JAX's own
    collectives for them (JAXOVERLAP_AUTO_NEW_KERNELS=1, fused.AUTO_NEW_KERNELS, opts in);
    the forward reduce-scatter stays fused either way."""
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", opted_in)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

    def layer(x, w1, w2):
        h = jaxoverlap.all_gather_matmul(x, w1, "tp")
        return jaxoverlap.matmul_reduce_scatter(h, w2, "tp")

    def loss(x, w1, w2):
        specs = (P("tp"), P(None, "tp"), P("tp", None))
        y = jax.shard_map(layer, mesh=mesh, in_specs=specs, out_specs=P("tp"))(x, w1, w2)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    shapes = [(8192, 4096), (4096, 2 * 4096), (2 * 4096, 4096)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args)
    text = text.lower(lowering_platforms=("cuda",)).as_text()
    training = [fused.AG_GEMM_KEEP_TARGET, fused_backward.TARGET]
    assert all((f"@{t}" in text) == opted_in for t in training), text.count("@jaxoverlap")
    # not opted in: dx of the all-gather is the sibling matmul_reduce_scatter, as before
    assert len(_calls(text, fused.GEMM_RS_TARGET)) == (1 if opted_in else 2)
    assert ("all_gather" in text) != opted_in


def test_middle_dimension_is_major_most_in_the_calls_layout(lowering_only):
    """[B, S, D] split over S (sequence parallelism with a batch): every fused call of the
    training step takes x, the cotangent and the gathered x -- and gives its results -- with S
    major-most, so each rank's block is contiguous rows (XLA transposes where needed)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

    def layer(x, w1, w2):
        h = jaxoverlap.all_gather_matmul(x, w1, "tp", gather_dimension=1, config=FUSED)
        return jaxoverlap.matmul_reduce_scatter(h, w2, "tp", scatter_dimension=1, config=FUSED)

    def loss(x, w1, w2):
        specs = (P(None, "tp"), P(None, "tp"), P("tp", None))
        y = jax.shard_map(layer, mesh=mesh, in_specs=specs, out_specs=P(None, "tp"))(x, w1, w2)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    x = jax.ShapeDtypeStruct((4, 2 * 256, 512), jnp.bfloat16)
    w1 = jax.ShapeDtypeStruct((512, 2 * 384), jnp.bfloat16)
    w2 = jax.ShapeDtypeStruct((2 * 384, 512), jnp.bfloat16)
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, w1, w2)
    text = text.lower(lowering_platforms=("cuda",)).as_text()
    s_major = "dense<[2, 0, 1]> : tensor<3xindex>"
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @jaxoverlap_" in ln]
    assert len(calls) == 4, calls  # keep (fwd), RS (fwd), keep (bwd of RS), backward of AG
    for call in calls:
        operands, results = call.split("operand_layouts = ")[1].split("result_layouts = ")
        assert operands.count(s_major) >= 1 and results.count(s_major) >= 1, call
    assert "all_gather" not in text and "reduce_scatter" not in text
