"""The patterns real model code uses between a matmul and its collective (issue 27), rewritten
within the ops' dtype tolerances, values and gradients: a norm between a gather along K and its
matmul (jaxoverlap/rewrite/norms.py), a per-shard bias added before the reduce-scatter, a cast
on the weight between the parameter and the matmul, mixed operand dtypes (in the rewrite and in
`jaxoverlap.matmul`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from overlap_util import TOL, assert_tree_close, check_rewrite, inputs, loss_of, mesh_1d, prims

import jaxoverlap
from jaxoverlap import fused
from jaxoverlap.overlap import explain, overlap

BF16 = jnp.bfloat16


def _sm(body, in_specs, out_specs, mesh=None):
    return jax.shard_map(body, mesh=mesh or mesh_1d(), in_specs=in_specs, out_specs=out_specs)


def _rs(y, dim=0):
    return lax.psum_scatter(y, "tp", scatter_dimension=dim, tiled=True)


def rms_norm(h, scale):  # in f32, as Llama/seqax compute it
    hf = h.astype(jnp.float32)
    hf = hf * lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + 1e-6)
    return hf.astype(h.dtype) * scale


def layer_norm(h, scale, bias):
    mu = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mu), axis=-1, keepdims=True)
    return (h - mu) * lax.rsqrt(var + 1e-5) * scale + bias


@pytest.fixture
def ag_fuses(monkeypatch, native_ok):
    """The all_gather_matmul along K runs fused under backend='auto' (a tuned win), so the
    norm rewrite applies; CPU execution then takes the op's reference path."""
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", True)
    win = dict(choice="fused", chunks=1, comm_sms=4, ms_xla=1.0, ms_fused=0.5)
    monkeypatch.setattr(fused.policy, "tuned", lambda *a, **k: win)


# ----------------------------------------------------------------------------- (a) norm across K

K_SPECS = (P(None, "tp"), P(), P(None, "tp"))


def _norm_case(norm, gathered_scale=False, cast_after=False):
    scale_spec = P("tp") if gathered_scale else P()
    specs = (P(None, "tp"), scale_spec, P(None, "tp"))
    x, scale, w = inputs(mesh_1d(), [((64, 256), specs[0]), ((256,), specs[1]),
                                     ((256, 128), specs[2])], BF16)  # fmt: skip
    scale = scale + 1

    def body(x, scale, w):
        h = lax.all_gather(x, "tp", axis=1, tiled=True)  # x sharded over K (features)
        if gathered_scale:
            scale = lax.all_gather(scale, "tp", tiled=True)  # FSDP'd norm scale
        if cast_after:  # typed varying after its broadcast, as jax 0.11 orders it itself
            scale = lax.pcast(lax.broadcast_in_dim(scale, h.shape, (1,)), "tp", to="varying")
        if norm == "rms":
            h = rms_norm(h, scale)
        else:
            h = layer_norm(h, scale, 0.5 * scale)
        return h @ w

    return _sm(body, specs, P(None, "tp")), (x, scale, w)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6))


def _as_accurate(new, fn, args):
    """Values and gradients of ``new`` (bf16) as close to ``fn`` computed in f32 as ``fn`` in
    bf16 is (within 2x, or 1e-2 of the largest magnitude): the statistics' re-association
    stays inside bf16 rounding."""
    up = [a.astype(jnp.float32) for a in args]
    argnums = tuple(range(len(args)))
    for what in (lambda g: g, lambda g: jax.grad(loss_of(g), argnums)):
        want = jax.tree.leaves(jax.jit(what(fn))(*up))
        old = jax.tree.leaves(jax.jit(what(fn))(*args))
        got = jax.tree.leaves(jax.jit(what(new))(*args))
        for g, o, w in zip(got, old, want, strict=True):
            assert _rel(g, w) <= max(2 * _rel(o, w), 1e-2), (_rel(g, w), _rel(o, w))


@pytest.mark.parametrize("norm, gathered_scale, cast_after", [
    ("rms", False, False), ("layer", False, False), ("rms", True, False),
    ("rms", False, True)])  # fmt: skip
def test_norm_between_a_gather_along_k_and_its_matmul(ag_fuses, norm, gathered_scale, cast_after):
    f, args = _norm_case(norm, gathered_scale, cast_after)
    new = overlap(f)
    before, after = prims(jax.make_jaxpr(f)(*args)), prims(jax.make_jaxpr(new)(*args))
    assert after["all_gather_matmul"] == 1 and after["all_gather"] == 0, after  # (scale's too)
    assert after["psum_invariant"] + after["psum"] >= 1 + before["psum_invariant"], after
    _as_accurate(new, f, args)
    (c,) = [c for c in explain(f, *args, target="4xH200") if c.op == "all_gather_matmul"]
    assert c.rewritten and "norm across K" in c.note and c.path.startswith("fused"), c


def test_norm_across_k_is_left_where_an_operand_differs_across_ranks(ag_fuses):
    """A norm whose scale differs across the ranks (here: scaled by the rank's index) is not
    rewritten: rank j would normalise block j with its own scale, where the original uses the
    gathering rank's for the whole row. The program stays as written and computes the same."""
    f0, args = _norm_case("rms")
    specs = (P(None, "tp"), P(), P(None, "tp"))

    def body(x, scale, w):
        h = lax.all_gather(x, "tp", axis=1, tiled=True)
        mine = scale * (1 + lax.axis_index("tp")).astype(scale.dtype)  # varies over tp
        return rms_norm(h, mine) @ w

    f = _sm(body, specs, P(None, "tp"))
    new = overlap(f)
    assert prims(jax.make_jaxpr(new)(*args))["all_gather_matmul"] == 0
    np.testing.assert_array_equal(np.asarray(jax.jit(new)(*args)), np.asarray(jax.jit(f)(*args)))


def test_norm_across_k_is_left_where_the_gather_would_not_fuse():
    """f32 (no fused kernel): the norm stays as written, with the reason, and no advice to move
    it before the gather (that would change the result)."""
    f, args = _norm_case("rms")
    args = [a.astype(jnp.float32) for a in args]
    (c,) = explain(f, *args, target="4xH200")
    assert not c.rewritten and "left as written" in c.reason and "float32" in c.reason, c
    assert "before the all_gather" not in c.reason
    assert prims(jax.make_jaxpr(overlap(f))(*args)) == prims(jax.make_jaxpr(f)(*args))


# ----------------------------------------------------------------------------- (b) bias before RS


@pytest.mark.parametrize("bias_spec", [P(), P("tp")])
def test_per_shard_bias_before_the_reduce_scatter_of_the_last_dim(bias_spec):
    """GPT-J / the shard_map tutorial: ``psum_scatter(x @ w + b, dim=-1)``. Every rank adds b,
    so the sum holds it n times: the op plus n * b's block (replicated b), or the psum_scatter
    of the per-rank biases (b differs across the ranks)."""
    specs = (P(None, "tp"), P("tp", None), bias_spec)
    n_bias = 32 * (4 if bias_spec == P("tp") else 1)
    args = inputs(mesh_1d(), [((16, 64), specs[0]), ((64, 32), specs[1]), ((n_bias,), specs[2])])

    def body(x, w, b):
        return _rs(x @ w + b, 1)

    f = _sm(body, specs, P(None, "tp"))
    if bias_spec == P():
        new = check_rewrite(f, args, ["matmul_reduce_scatter"])
    else:  # the bias's own psum_scatter (32 elements) stays
        new = overlap(f)
        after = prims(jax.make_jaxpr(new)(*args))
        assert after["matmul_reduce_scatter"] == 1 and after["reduce_scatter"] == 1, after
        assert_tree_close(jax.jit(new)(*args), jax.jit(f)(*args), TOL[jnp.float32])
        grads = [jax.jit(jax.grad(loss_of(h), (0, 1, 2)))(*args) for h in (new, f)]
        assert_tree_close(*grads, TOL[jnp.float32])
    (c,) = explain(new, *args)
    assert "scattered block" in c.note, c


# ----------------------------------------------------------------------------- (c) weight cast


def test_weight_cast_before_each_matmul_of_one_gathered_value():
    """Flax modules with dtype=bf16 cast their f32 kernel right before their own matmul, so the
    second projection's weight is computed after the first matmul: the casts move up."""
    specs = (P("tp", None), P(None, "tp"), P(None, "tp"), P("tp", None))
    args = inputs(mesh_1d(), [((32, 64), specs[0]), ((64, 32), specs[1]), ((64, 32), specs[2]),
                              ((32, 64), specs[3])])  # fmt: skip

    def body(x, wq, wk, wo):
        h = lax.all_gather(x.astype(BF16), "tp", axis=0, tiled=True)
        q = jax.nn.gelu(h @ wq.astype(BF16))
        k = h @ wk.astype(BF16)
        return _rs((q * k) @ wo.astype(BF16))

    new = check_rewrite(_sm(body, specs, P("tp", None)), args,
                        ["all_gather_matmul", "matmul_reduce_scatter"], BF16)  # fmt: skip
    ag = [c for c in explain(new, *args) if c.op == "all_gather_matmul"]
    assert ag[0].rewritten and "moved before the op" in ag[0].note, ag


# ----------------------------------------------------------------------------- (d) mixed dtypes


def test_mixed_operand_dtypes_are_promoted_as_jnp_matmul_does():
    specs = (P(None, "tp"), P("tp", None))
    x, w = inputs(mesh_1d(), [((16, 64), specs[0]), ((64, 32), specs[1])])
    x = x.astype(BF16)  # bf16 activations, f32 weights (GPT-J; Llama 3's f32 configuration)
    f = _sm(lambda x, w: _rs(jnp.matmul(x, w)), specs, P("tp"))
    new = check_rewrite(f, (x, w), ["matmul_reduce_scatter"], BF16)  # (dx is bf16)
    (c,) = explain(new, x, w)
    assert "mixed operand dtypes" in c.note and c.rewritten, c
    g = _sm(lambda x, w: lax.all_gather(x, "tp", axis=0, tiled=True) @ w, (P("tp"), P(None, "tp")),
            P(None, "tp"))  # fmt: skip
    xg, wg = inputs(mesh_1d(), [((16, 64), P("tp")), ((64, 32), P(None, "tp"))])
    check_rewrite(g, (xg.astype(BF16), wg), ["all_gather_matmul"], BF16)


def test_jaxoverlap_matmul_promotes_mixed_dtypes():
    mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
    x = jax.device_put(jnp.ones((8, 16), BF16), NamedSharding(mesh, P(None, "tp")))
    w = jax.device_put(jnp.full((16, 4), 0.5, jnp.float32), NamedSharding(mesh, P("tp", None)))
    xh, wh = jnp.asarray(np.asarray(x)), jnp.asarray(np.asarray(w))  # unsharded reference
    y = jaxoverlap.matmul(x, w)
    assert y.dtype == jnp.matmul(xh, wh).dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(jnp.matmul(xh, wh)), **TOL[jnp.float32])
    with jax.set_mesh(mesh):
        gx, gw = jax.grad(lambda x, w: jaxoverlap.matmul(x, w).sum(), (0, 1))(x, w)
    wx, ww = jax.grad(lambda x, w: jnp.matmul(x, w).sum(), (0, 1))(xh, wh)
    assert (gx.dtype, gw.dtype) == (wx.dtype, ww.dtype)
    assert_tree_close((gx, gw), (wx, ww), TOL[BF16])
