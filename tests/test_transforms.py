"""The ops compose with JAX's transformations: jit, vmap inside shard_map, grad (via the
sibling ops), several ops in one program; and they appear in jaxprs and lower to HLO."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import TOL, P, assert_close, make_mesh, place, random

import jaxoverlap
from jaxoverlap import reference

F32 = TOL[jnp.float32]


def _mrs(x, w):
    return jaxoverlap.matmul_reduce_scatter(x, w, "tp", scatter_dimension=0)


def _mrs_ref(x, w):
    return reference.matmul_reduce_scatter(x, w, "tp", scatter_dimension=0)


def _agm(x, w):
    return jaxoverlap.all_gather_matmul(x, w, "tp", gather_dimension=0)


def _agm_ref(x, w):
    return reference.all_gather_matmul(x, w, "tp", gather_dimension=0)


def _mar(x, w):
    return jaxoverlap.matmul_all_reduce(x, w, "tp")


def _mar_ref(x, w):
    return reference.matmul_all_reduce(x, w, "tp")


# fn, ref, x spec (local x [8, 16] per device), w spec, out spec -- for vmapped callers the
# batch dim of x / w is prepended and left unsharded.
OPS = {
    "matmul_reduce_scatter": (_mrs, _mrs_ref, ("rows", "tp"), ("tp", None), ("tp", None)),
    "all_gather_matmul": (_agm, _agm_ref, ("tp", None), (None, "tp"), (None, "tp")),
    "matmul_all_reduce": (_mar, _mar_ref, (None, "tp"), ("tp", None), (None, None)),
}


def _setup(op, bx=None, bw=None):
    mesh = make_mesh("tp4")
    fn, ref, xs, ws, os_ = OPS[op]
    xs = tuple(None if e == "rows" else e for e in xs)
    x = random(jax.random.key(0), ((bx,) if bx else ()) + (8 * 4, 16 * 4), jnp.float32)
    w = random(jax.random.key(1), ((bw,) if bw else ()) + (16 * 4, 12 * 4), jnp.float32)
    # Only the dims named in the specs are sharded; scale the rest back to their local size.
    x = x[..., : 8 * (4 if xs[0] else 1), : 16 * (4 if xs[1] else 1)]
    w = w[..., : 16 * (4 if ws[0] else 1), : 12 * (4 if ws[1] else 1)]
    x_spec = P(*(((None,) if bx else ()) + xs))
    w_spec = P(*(((None,) if bw else ()) + ws))
    out_spec = P(*(((None,) if (bx or bw) else ()) + os_))
    x, w = place(mesh, (x, w), (x_spec, w_spec))
    return mesh, fn, ref, x, w, (x_spec, w_spec), out_spec


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("batched", ["x", "w", "both"])
def test_vmap_inside_shard_map(op, batched):
    bx = 3 if batched in ("x", "both") else None
    bw = 3 if batched in ("w", "both") else None
    mesh, fn, ref, x, w, in_specs, out_spec = _setup(op, bx, bw)
    axes = (0 if bx else None, 0 if bw else None)

    def run(f):
        body = jax.vmap(f, in_axes=axes)
        with jax.set_mesh(mesh):
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec))(
                x, w
            )

    assert_close(run(fn), run(ref), F32, f"vmap {op} over {batched}")


def test_vmap_batch_dim_not_leading():
    """in_axes=1 on x: the batching rule moves the batch dim, result batch dim is 0."""
    mesh, fn, ref, x, w, (xs, ws), out_spec = _setup("matmul_reduce_scatter", bx=3)
    x = jnp.moveaxis(x, 0, 1)
    xs = P(xs[1], None, xs[2])
    x = place(mesh, (x,), (xs,))[0]

    def run(f):
        body = jax.vmap(f, in_axes=(1, None))
        with jax.set_mesh(mesh):
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(xs, ws), out_specs=out_spec))(
                x, w
            )

    assert_close(run(fn), run(ref), F32, "vmap in_axes=1")


def test_two_ops_in_one_program_and_jaxpr():
    """A sequence-parallel MLP: all_gather_matmul -> gelu -> matmul_reduce_scatter, under jit."""
    mesh = make_mesh("tp4")
    x = random(jax.random.key(0), (32, 16), jnp.float32)
    w1 = random(jax.random.key(1), (16, 64), jnp.float32)
    w2 = random(jax.random.key(2), (64, 16), jnp.float32)
    specs = (P("tp", None), P(None, "tp"), P("tp", None))
    x, w1, w2 = place(mesh, (x, w1, w2), specs)

    def block(agm, mrs):
        def f(x, w1, w2):
            return mrs(jax.nn.gelu(agm(x, w1)), w2)

        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P("tp", None)))

    fused = block(_agm, _mrs)
    ref = block(_agm_ref, _mrs_ref)
    with jax.set_mesh(mesh):
        assert_close(fused(x, w1, w2), ref(x, w1, w2), F32, "mlp")
        jaxpr = str(jax.make_jaxpr(fused)(x, w1, w2))
    assert "all_gather_matmul[" in jaxpr and "matmul_reduce_scatter[" in jaxpr
    assert "reduce_scatter[" not in jaxpr.replace("matmul_reduce_scatter[", "")
    assert "all_gather[" not in jaxpr.replace("all_gather_matmul[", "")


@pytest.mark.parametrize(
    "op,collective",
    [
        ("matmul_reduce_scatter", "reduce_scatter"),
        ("all_gather_matmul", "all_gather"),
        ("matmul_all_reduce", "all_reduce"),
    ],
)
def test_lowers_to_reference_hlo_on_cpu(op, collective):
    """On CPU the primitive lowers to its reference composition: one dot and one collective."""
    mesh, fn, _, x, w, in_specs, out_spec = _setup(op)
    with jax.set_mesh(mesh):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec))
        text = f.lower(x, w).as_text()
    assert f"stablehlo.{collective}" in text
    assert "stablehlo.dot_general" in text
    assert "custom_call" not in text


def test_backward_uses_sibling_ops():
    """d/dx of matmul_reduce_scatter is all_gather_matmul and vice versa (so a fused forward
    gets a fused backward); d/dx of matmul_all_reduce needs no communication."""
    for op, sibling in [
        ("matmul_reduce_scatter", "all_gather_matmul["),
        ("all_gather_matmul", "matmul_reduce_scatter["),
    ]:
        mesh, fn, _, x, w, in_specs, out_spec = _setup(op)
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
        with jax.set_mesh(mesh):
            loss = lambda x, w, mapped=mapped: mapped(x, w).sum()  # noqa: E731
            jaxpr = str(jax.make_jaxpr(jax.grad(loss))(x, w))
        assert sibling in jaxpr, (op, jaxpr)


def test_jit_of_op_matches_eager_shard_map():
    mesh, fn, ref, x, w, in_specs, out_spec = _setup("matmul_reduce_scatter")
    with jax.set_mesh(mesh):
        eager = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(x, w)
        jitted = jax.jit(jax.shard_map(ref, mesh=mesh, in_specs=in_specs, out_specs=out_spec))(x, w)
    assert_close(eager, jitted, F32, "eager vs jit")


def test_check_vma_false_and_replicated_weight():
    """Works with check_vma=False, and with a weight replicated over the axis (its gradient
    is then summed over the group, as for the reference)."""
    mesh = make_mesh("tp4")
    x = random(jax.random.key(0), (32, 16 * 4), jnp.float32)
    w = random(jax.random.key(1), (16 * 4, 8), jnp.float32)
    x, w = place(mesh, (x, w), (P(None, "tp"), P()))
    for check_vma in (True, False):

        def loss(f, x, w, check_vma=check_vma):
            body = functools.partial(f)
            g = jax.shard_map(
                lambda x, w: body(x, w[: x.shape[-1]]),
                mesh=mesh,
                in_specs=(P(None, "tp"), P()),
                out_specs=P("tp", None),
                check_vma=check_vma,
            )
            return jnp.sum(g(x, w) ** 2)

        with jax.set_mesh(mesh):
            got = jax.jit(jax.value_and_grad(functools.partial(loss, _mrs), argnums=(0, 1)))(x, w)
            want = jax.jit(jax.value_and_grad(functools.partial(loss, _mrs_ref), argnums=(0, 1)))(
                x, w
            )
        assert_close(got[0], want[0], F32, f"value check_vma={check_vma}")
        for g, r in zip(got[1], want[1]):
            assert_close(g, r, F32, f"grad check_vma={check_vma}")


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("check_vma", [True, False])
def test_grads_with_and_without_check_vma(op, check_vma):
    """Gradients equal the reference's whether or not shard_map tracks varying axes (without it,
    the transpose of the all-reduce must be an explicit psum)."""
    mesh, fn, ref, x, w, in_specs, out_spec = _setup(op)
    ct = random(
        jax.random.key(7),
        jax.eval_shape(
            jax.shard_map(ref, mesh=mesh, in_specs=in_specs, out_specs=out_spec), x, w
        ).shape,
        jnp.float32,
    )

    def value_and_grads(f):
        g = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=check_vma)
        loss = lambda x, w: jnp.sum(g(x, w) * ct)  # noqa: E731
        with jax.set_mesh(mesh):
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

    (got, got_g), (want, want_g) = value_and_grads(fn), value_and_grads(ref)
    assert_close(got, want, F32, f"{op} value")
    for name, g, r in zip(("dx", "dw"), got_g, want_g):
        assert_close(g, r, F32, f"{op} {name} check_vma={check_vma}")


@pytest.mark.parametrize("op", list(OPS))
def test_float64_gradients_are_float64_accurate(op):
    with jax.enable_x64(True):
        mesh, fn, ref, x, w, in_specs, out_spec = _setup(op)
        x, w = place(mesh, (x.astype(jnp.float64), w.astype(jnp.float64)), in_specs)

        def grads(f):
            g = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
            with jax.set_mesh(mesh):
                return jax.jit(jax.grad(lambda x, w: jnp.sum(g(x, w) ** 2), (0, 1)))(x, w)

        for g, r in zip(grads(fn), grads(ref)):
            assert g.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-12, atol=1e-12)


def _count_eqns(fn, *args):
    """Primitive name -> count in ``fn``'s jaxpr, at any depth."""
    counts = {}

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        visit(sub)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts


@pytest.mark.parametrize("op", ["matmul_reduce_scatter", "all_gather_matmul"])
def test_training_gathers_no_more_than_plain_jax(op):
    """Differentiating w.r.t. x and w (training) must not communicate more than JAX's autodiff
    of the reference does -- one gather and one reduce-scatter per op (RS: the cotangent gathered
    once for dx and dW; AG: x gathered once in the forward, kept for dW) -- and every collective
    is inside an op that can run fused: the all_gather_matmul variant that also returns what it
    gathered (AG's forward; RS's backward, reading w.T in place), the RS op (RS's forward), and
    the backward op that scatters AG's dx beside dW's GEMM."""
    mesh, fn, ref, x, w, in_specs, out_spec = _setup(op)

    def loss(f):
        g = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
        return jax.grad(lambda x, w: jnp.sum(g(x, w) ** 2), argnums=(0, 1))

    ours, plain = _count_eqns(loss(fn), x, w), _count_eqns(loss(ref), x, w)
    assert plain.get("all_gather", 0) == plain.get("reduce_scatter", 0) == 1, plain
    for xla_collective in ("all_gather", "reduce_scatter", "psum", "all_gather_matmul"):
        assert ours.get(xla_collective, 0) == 0, (xla_collective, ours)
    assert ours.get("all_gather_matmul_keep", 0) == 1, ours
    scatters = ("matmul_reduce_scatter", "all_gather_matmul_backward")
    assert sum(ours.get(s, 0) for s in scatters) == 1, ours
    gx, gw = jax.jit(loss(fn))(x, w)
    rx, rw = jax.jit(loss(ref))(x, w)
    assert_close(gx, rx, F32)
    assert_close(gw, rw, F32)


@pytest.mark.parametrize("op", ["matmul_reduce_scatter", "all_gather_matmul"])
def test_training_internals_compose_with_jvp_and_vmap(op):
    """The internal primitives of a training step (the all-gather variant that returns what it
    gathered, the ops' tangents, the column-parallel backward) under forward-over-reverse
    (Hessian-vector products) and vmap of the gradient: the reference's values."""
    mesh, fn, ref, x, w, in_specs, out_spec = _setup(op)

    def grads(f):
        g = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
        return jax.grad(lambda x, w: jnp.sum(jnp.sin(g(x, w))), argnums=(0, 1))

    vx = jnp.asarray(random(jax.random.key(7), x.shape, x.dtype))  # captured: a jax array
    vw = jnp.asarray(random(jax.random.key(8), w.shape, w.dtype))
    hvp = lambda f: jax.jit(lambda x, w: jax.jvp(grads(f), (x, w), (vx, vw)))  # noqa: E731
    (g1, t1), (g2, t2) = hvp(fn)(x, w), hvp(ref)(x, w)
    for a, b in zip((*g1, *t1), (*g2, *t2), strict=True):
        assert_close(a, b, F32)
    xs = jnp.stack([x, 2 * x, -x])
    batched = lambda f: jax.jit(jax.vmap(grads(f), in_axes=(0, None)))  # noqa: E731
    for a, b in zip(batched(fn)(xs, w), batched(ref)(xs, w), strict=True):
        assert_close(a, b, F32)
