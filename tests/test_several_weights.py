"""``all_gather_matmul(x, [w0, w1, ...])``: one gather for several weights (separate Q/K/V,
SwiGLU's gate and up) without concatenating them; in training, one reduce-scatter for dx."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import GRAD_TOL, TOL, P, assert_close, make_mesh, place, random
from jax import lax

import jaxoverlap
from jaxoverlap import Config, fused
from jaxoverlap.fused import backward as fused_backward

F32 = jnp.float32
WIDTHS = (12, 20, 8)  # per-device N of each weight


def _setup(gather_dimension):
    mesh = make_mesh("tp4")
    k = 16
    along_k = gather_dimension == 1
    x = random(jax.random.key(0), (32, k), F32)
    ws = [random(jax.random.key(i + 1), (k, 4 * n), F32) for i, n in enumerate(WIDTHS)]
    x_spec = P(None, "tp") if along_k else P("tp", None)
    w_spec = P(None, "tp")
    return mesh, place(mesh, (x, *ws), (x_spec,) + (w_spec,) * len(ws)), x_spec, w_spec


def _fn(mesh, x_spec, w_spec, fn):
    out_spec = P(None, "tp")
    return jax.shard_map(
        fn, mesh=mesh, in_specs=(x_spec, [w_spec] * len(WIDTHS)), out_specs=(out_spec,) * 3
    )


def _ours(d, config=None):
    return lambda x, ws: jaxoverlap.all_gather_matmul(
        x, ws, "tp", gather_dimension=d, config=config
    )


def _ref(d):
    def f(x, ws):
        g = lax.all_gather(x, "tp", axis=d, tiled=True)
        return tuple(g @ w for w in ws)

    return f


def _count(fn, *args):
    counts = {}

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
            for sub in jax.tree.leaves(eqn.params, is_leaf=lambda v: hasattr(v, "eqns")):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    visit(sub)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts


@pytest.mark.parametrize("backend", ["auto", "xla"])
@pytest.mark.parametrize("d", [0, 1])
def test_values_and_gradients(d, backend):
    mesh, (x, *ws), x_spec, w_spec = _setup(d)
    ours = _fn(mesh, x_spec, w_spec, _ours(d, Config(backend=backend)))
    ref = _fn(mesh, x_spec, w_spec, _ref(d))
    for a, b in zip(jax.jit(ours)(x, ws), jax.jit(ref)(x, ws), strict=True):
        assert_close(a, b, TOL[F32])

    def loss(f):
        return jax.jit(
            jax.grad(lambda x, ws: sum(jnp.sum(jnp.sin(y)) for y in f(x, ws)), argnums=(0, 1))
        )

    got, want = loss(ours)(x, ws), loss(ref)(x, ws)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(a, b, GRAD_TOL[F32])


@pytest.mark.parametrize("new_kernels", [True, False])
def test_training_gathers_once_and_scatters_once_without_concatenating(monkeypatch, new_kernels):
    """One gather (the variant returning x) and one reduce-scatter (the backward op, with the
    other weights' share of dx as its addend; or, before the new kernels are allowed under auto,
    XLA's) -- what plain JAX communicates -- and no weight concatenated or gradient split."""
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", new_kernels)
    mesh, (x, *ws), x_spec, w_spec = _setup(0)

    def grad(f):
        g = _fn(mesh, x_spec, w_spec, f)
        return jax.grad(lambda x, ws: sum(jnp.sum(y**2) for y in g(x, ws)), argnums=(0, 1))

    ours, plain = _count(grad(_ours(0)), x, ws), _count(grad(_ref(0)), x, ws)
    assert plain.get("all_gather") == plain.get("reduce_scatter") == 1, plain
    assert ours.get("all_gather_matmul_keep") == 1, ours
    assert ours.get("all_gather_matmul_backward", 0) == int(new_kernels), ours
    assert ours.get("reduce_scatter", 0) == int(not new_kernels), ours
    for name in ("all_gather", "psum", "concatenate", "slice", "matmul_reduce_scatter"):
        assert ours.get(name, 0) == 0, (name, ours)
    if not new_kernels:
        return
    jaxpr = jax.make_jaxpr(grad(_ours(0)))(x, ws)
    (bwd,) = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "all_gather_matmul_backward"]
    assert len(bwd.invars) == 4  # ct, w.T, gathered x, and the other weights' share of dx


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.tree.leaves(eqn.params, is_leaf=lambda v: hasattr(v, "eqns")):
            sub = getattr(sub, "jaxpr", sub)
            if hasattr(sub, "eqns"):
                yield from _eqns(sub)


def test_cuda_lowering_of_the_training_step(lowering_only):
    """On GPUs: the keep variant forward, the backward op with the addend (the _acc target),
    w.T read column-major; no XLA collective, no concatenate."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    cfg = Config(backend="fused")

    def body(x, ws):
        return jaxoverlap.all_gather_matmul(x, ws, "tp", config=cfg)

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P("tp"), [P(None, "tp")] * 2), out_specs=(P(None, "tp"),) * 2
    )
    loss = lambda x, ws: sum(jnp.sum(y.astype(F32) ** 2) for y in f(x, ws))  # noqa: E731
    x = jax.ShapeDtypeStruct((2 * 512, 256), jnp.bfloat16)
    ws = [jax.ShapeDtypeStruct((256, 2 * n), jnp.bfloat16) for n in (384, 128)]
    text = (
        jax.jit(jax.grad(loss, argnums=(0, 1)))
        .trace(x, ws)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    acc = [ln for ln in text.splitlines() if f"@{fused_backward.ACC_TARGET}" in ln]
    assert len(acc) == 1 and "w_colmajor = 1" in acc[0], acc
    assert text.count("@jaxoverlap_ag_gemm_keep_v2") == 1
    for name in ("all_gather", "reduce_scatter", "concatenate"):
        assert name not in text, name


def test_bad_input():
    mesh, (x, *ws), x_spec, w_spec = _setup(0)
    f = jax.shard_map(
        lambda x, w: jaxoverlap.all_gather_matmul(x, [], "tp"),
        mesh=mesh,
        in_specs=(x_spec, w_spec),
        out_specs=P(),
    )
    with pytest.raises(ValueError, match="empty list"):
        jax.jit(f).trace(x, ws[0])
    g = jax.shard_map(
        lambda x, w: jaxoverlap.all_gather_matmul(x, [w, w[:8]], "tp"),
        mesh=mesh,
        in_specs=(x_spec, w_spec),
        out_specs=P(),
    )
    with pytest.raises(ValueError, match="contracting dimensions differ"):
        jax.jit(g).trace(x, ws[0])


@pytest.mark.parametrize("trained", ["weights", "x_and_narrow_weights", "x_only"])
def test_partial_training_communicates_as_plain_jax(trained):
    """Only the weights trained (x is data), or the widest weight frozen, or every weight
    frozen: values equal plain JAX's, and no more collectives than plain JAX's backward."""
    mesh, (x, *ws), x_spec, w_spec = _setup(0)
    lead = int(np.argmax(WIDTHS))

    def loss(f):
        g = _fn(mesh, x_spec, w_spec, f)

        def total(x, trainable):
            full = [trainable.get(i, w) for i, w in enumerate(ws)]
            return sum(jnp.sum(jnp.sin(y)) for y in g(x, full))

        return total

    if trained == "weights":
        trainable, argnums = {i: w for i, w in enumerate(ws)}, 1
    elif trained == "x_and_narrow_weights":
        trainable, argnums = {i: w for i, w in enumerate(ws) if i != lead}, (0, 1)
    else:
        trainable, argnums = {}, 0
    ours = jax.grad(loss(_ours(0)), argnums=argnums)
    plain = jax.grad(loss(_ref(0)), argnums=argnums)
    got, want = jax.jit(ours)(x, trainable), jax.jit(plain)(x, trainable)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(a, b, GRAD_TOL[F32])
    c_ours, c_plain = _count(ours, x, trainable), _count(plain, x, trainable)
    scatters = ("reduce_scatter", "matmul_reduce_scatter", "all_gather_matmul_backward")
    assert sum(c_ours.get(s, 0) for s in scatters) == c_plain.get("reduce_scatter", 0), c_ours
    gathers = ("all_gather", "all_gather_matmul", "all_gather_matmul_keep")
    assert sum(c_ours.get(s, 0) for s in gathers) == c_plain.get("all_gather", 0), c_ours
