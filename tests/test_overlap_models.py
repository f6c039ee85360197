"""`jaxoverlap.overlap` on model code as people write it (issue 10): default precision, N-D
weights (Flax DenseGeneral / MaxText einsums), casts/reshapes/bias adds between the pair, one
gathered activation feeding several matmuls, gathers along K.

Every case: the rewritten jaxpr holds the op and not the collective it replaced, values and
gradients equal the original's (`overlap_util.check_rewrite`), and explain says what it did.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from overlap_util import TOL, assert_tree_close, check_rewrite, inputs, mesh_1d, prims

from jaxoverlap.overlap import explain, overlap

B, S, D, H, DH, F = 2, 8, 16, 4, 4, 32  # global sizes; tp = 4


def _sm(body, in_specs, out_specs, check_vma=True):
    return jax.shard_map(body, mesh=mesh_1d(), in_specs=in_specs, out_specs=out_specs,
                         check_vma=check_vma)  # fmt: skip


def _rewritten(f, args):
    found = explain(f, *args)
    assert found and all(c.rewritten for c in found), found
    return found


def _rs(y, dim=0):
    return lax.psum_scatter(y, "tp", scatter_dimension=dim, tiled=True)


def _ag(x, dim=0):
    return lax.all_gather(x, "tp", axis=dim, tiled=True)


ROW = (P(None, "tp"), P("tp", None))  # x [M, K/t], w [K/t, N]


@pytest.mark.parametrize("precision", [lax.Precision.DEFAULT, (lax.Precision.DEFAULT,) * 2])
def test_default_precision_is_no_precision(precision):
    f = _sm(lambda x, w: _rs(jnp.matmul(x, w, precision=precision)), ROW, P("tp", None))
    args = inputs(mesh_1d(), [((16, 32), ROW[0]), ((32, 8), ROW[1])])
    check_rewrite(f, args, ["matmul_reduce_scatter"])


def test_preferred_element_type_equal_to_the_operands_is_rewritten():
    f = _sm(lambda x, w: _rs(jnp.matmul(x, w, preferred_element_type=jnp.float32)), ROW,
            P("tp", None))  # fmt: skip
    args = inputs(mesh_1d(), [((16, 32), ROW[0]), ((32, 8), ROW[1])])
    check_rewrite(f, args, ["matmul_reduce_scatter"])


def test_f32_result_cast_straight_back_is_the_ops_rounding():
    """``einsum(..., preferred_element_type=f32).astype(bf16)`` (f32 accumulation, rounded
    once) is what the ops compute; an f32 result that is reduced in f32 is not (skipped)."""
    f32 = jnp.float32
    specs = (P("tp", None), P(None, "tp"), P(None, "tp"), P("tp", None))
    shapes = [(S * 2, D), (D, F), (D, F), (F, D)]
    args = inputs(mesh_1d(), list(zip(shapes, specs, strict=True)), jnp.bfloat16)

    def mm(a, b):
        return jnp.matmul(a, b, preferred_element_type=f32).astype(a.dtype)

    def mlp(x, wg, wu, wd):
        g = _ag(x)
        h = jax.nn.silu(mm(g, wg)) * mm(g, wu)
        return _rs(mm(h, wd)), h

    def body(x, wg, wu, wd):
        y, h = mlp(x, wg, wu, wd)
        return y, _rs(jnp.matmul(h, wd, preferred_element_type=f32))

    f = _sm(body, specs, (P("tp", None), P("tp", None)))
    new = overlap(f)
    assert_tree_close(jax.jit(new)(*args), jax.jit(f)(*args), TOL[jnp.bfloat16])
    after = prims(jax.make_jaxpr(new)(*args))
    assert after["all_gather_matmul"] == after["matmul_reduce_scatter"] == 1, after
    found = explain(f, *args)
    assert [c.rewritten for c in found] == [True, True, False], found
    assert "is the op's rounding" in found[0].note and "is the op's rounding" in found[1].note
    assert "preferred_element_type=float32" in found[2].reason
    rewritable = _sm(lambda *a: mlp(*a)[0], specs, P("tp", None))
    check_rewrite(rewritable, args, ["all_gather_matmul", "matmul_reduce_scatter"], jnp.bfloat16)


# ----------------------------------------------------------------------------- N-D weights


def test_attention_projections_with_nd_weights():
    """QKV ``[3, D, H/t, Dh]`` after a sequence gather; out-projection ``[H/t, Dh, D]`` into a
    sequence reduce-scatter (MaxText / Flax DenseGeneral einsums)."""
    specs = (P(None, "tp", None), P(None, None, "tp", None), P("tp", None, None))
    args = inputs(mesh_1d(), [((B, S, D), specs[0]), ((3, D, H, DH), specs[1]),
                              ((H, DH, D), specs[2])])  # fmt: skip

    def body(x, wqkv, wo):
        qkv = jnp.einsum("bsd,kdhe->kbshe", _ag(x, 1), wqkv)
        o = qkv[0] * qkv[1] + qkv[2]  # (attention's shapes, without its cost)
        return _rs(jnp.einsum("bshe,hed->bsd", o, wo), 1)

    f = _sm(body, specs, P(None, "tp", None))
    check_rewrite(f, args, ["all_gather_matmul", "matmul_reduce_scatter"])
    notes = [c.note for c in _rewritten(f, args)]
    assert "transpose(1, 0, 2, 3) as [16, 12]" in notes[0], notes
    assert "as [4, 16]" in notes[1], notes


@pytest.mark.parametrize("dim,ok", [(2, True), (3, False)])
def test_scatter_over_a_weight_dimension(dim, ok):
    """``[b, s, H, Dh]`` results: scattering H (the first weight dim) is a block of the
    flattened N; scattering Dh is not."""
    specs = (P(None, None, "tp"), P("tp", None, None))
    args = inputs(mesh_1d(), [((B, S, D), specs[0]), ((D, H * 2, DH), specs[1])])
    out = [None] * 4
    out[dim] = "tp"
    f = _sm(lambda x, w: _rs(jnp.einsum("bsd,dhe->bshe", x, w), dim), specs, P(*out))
    if ok:
        check_rewrite(f, args, ["matmul_reduce_scatter"])
    else:
        (c,) = explain(f, *args)
        assert not c.rewritten and "a weight dimension other than the first" in c.reason


# ----------------------------------------------------------------------------- between the pair


@pytest.mark.parametrize("check_vma", [True, False])
def test_bias_before_reduce_scatter_and_psum(check_vma):
    """``psum_scatter(x @ w + b)`` adds b on every rank: the rewrite adds ``psum(b)`` after."""
    specs = (*ROW, P())
    args = inputs(mesh_1d(), [((16, 32), ROW[0]), ((32, 8), ROW[1]), ((8,), P())])

    def body(x, w, b):
        return _rs(x @ w + b), lax.psum(2.0 - (x @ w), "tp")

    f = _sm(body, specs, (P("tp", None), P()), check_vma)
    if check_vma:  # b is typed as replicated: psum(b) is 4 * b, no collective
        check_rewrite(f, args, ["matmul_reduce_scatter", "matmul_all_reduce"])
    else:  # untyped: b's psum stays (a collective of 8 elements)
        new = overlap(f)
        assert_tree_close(jax.jit(new)(*args), jax.jit(f)(*args), TOL[jnp.float32])
        after = prims(jax.make_jaxpr(new)(*args))
        assert after["psum"] == 1 and after["reduce_scatter"] == 0, after
    found = _rewritten(f, args)
    assert all("bias moved after the collective" in c.note for c in found), found


def test_cast_and_reshape_between_the_pair():
    """bf16 matmul cast to f32 before the reduce-scatter; a reshape splitting N into heads;
    the gathered x cast to bf16 and split into heads before an ``[H, Dh, N]`` matmul."""
    args = inputs(mesh_1d(), [((16, 32), ROW[0]), ((32, 16), ROW[1]),
                              ((H * DH, 8), P(None, "tp"))], jnp.bfloat16)  # fmt: skip

    def body(x, w, w2):
        y = _rs((x @ w).astype(jnp.float32).reshape(16, H, DH))  # [16/t, H, Dh]
        g = _ag(y).astype(jnp.bfloat16).reshape(16, H * DH)
        return y, g @ w2

    f = _sm(body, (*ROW, P(None, "tp")), (P("tp", None, None), P(None, "tp")))
    check_rewrite(f, args, ["matmul_reduce_scatter", "all_gather_matmul"], dtype=jnp.bfloat16)
    notes = " / ".join(c.note for c in _rewritten(f, args))
    assert "cast to float32 moved after" in notes and "reshape moved after" in notes, notes
    assert "reshape moved before the all_gather" in notes, notes


# ----------------------------------------------------------------------------- one gather, N dots


def test_separate_qkv_and_swiglu_share_one_gather():
    specs = (P("tp", None), *(P(None, "tp"),) * 3, P("tp", None), *(P(None, "tp"),) * 2,
             P("tp", None))  # fmt: skip
    shapes = [(S * 2, D), (D, D), (D, D), (D, D), (D, D), (D, F), (D, F), (F, D)]
    args = inputs(mesh_1d(), list(zip(shapes, specs, strict=True)))

    def body(x, wq, wk, wv, wo, wg, wu, wd):
        g = _ag(x)
        q, k, v = g @ wq, g @ wk, g @ wv
        x = x + _rs(jax.nn.softmax(q @ k.T, axis=-1) @ v @ wo)
        g = _ag(x)
        return x + _rs((jax.nn.silu(g @ wg) * (g @ wu)) @ wd)

    f = _sm(body, specs, P("tp", None))
    new = check_rewrite(f, args, ["all_gather_matmul", "matmul_reduce_scatter"])
    assert prims(jax.make_jaxpr(new)(*args))["all_gather_matmul"] == 2
    notes = [c.note for c in explain(f, *args) if c.op == "all_gather_matmul"]
    assert notes == [
        "3 matmuls of one gathered value: one op for all the weights (not concatenated)",
        "2 matmuls of one gathered value: one op for all the weights (not concatenated)",
    ]


# ----------------------------------------------------------------------------- gathers along K


def test_gather_along_k(dtype=jnp.float32):
    """x sharded over d_model: ``all_gather(x, axis=-1) @ w`` and ``[H, Dh]`` heads gathered
    over H then contracted with ``w [H, Dh, D]``."""
    specs = (P(None, None, "tp"), P(None, "tp"), P(None, None, "tp", None), P(None, None, "tp"))
    shapes = [(B, S, D), (D, F), (B, S, H, DH), (H, DH, D)]
    args = inputs(mesh_1d(), list(zip(shapes, specs, strict=True)), dtype)

    def body(x, w, o, wo):
        return _ag(x, 2) @ w, jnp.einsum("bshe,hed->bsd", _ag(o, 2), wo)

    f = _sm(body, specs, (P(None, None, "tp"), P(None, None, "tp")))
    check_rewrite(f, args, ["all_gather_matmul"], dtype=dtype)
    assert all("gathers along K" in c.note for c in _rewritten(f, args))


def test_sequence_parallel_transformer_layer_as_model_authors_write_it():
    """RMSNorm on the local shard, all_gather -> einsum QKV ``[D, 3, H, Dh]`` (DEFAULT
    precision), causal attention, ``[H, Dh, D]`` out-projection -> psum_scatter, residual,
    all_gather -> SwiGLU gate/up -> down -> psum_scatter: every pair rewritten (f32 values and
    gradients; bf16 is matched the same way)."""
    specs = (P("tp", None), P(None, None, "tp", None), P("tp", None, None), P(None, "tp"),
             P(None, "tp"), P("tp", None))  # fmt: skip
    shapes = [(S * 2, D), (D, 3, H, DH), (H, DH, D), (D, F), (D, F), (F, D)]
    dflt = lax.Precision.DEFAULT

    def rms(x):
        x32 = x.astype(jnp.float32)
        return (x32 * lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)

    def layer(x, wqkv, wo, wg, wu, wd):
        qkv = jnp.einsum("sd,dkhe->skhe", _ag(rms(x)), wqkv, precision=dflt)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        o = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        x = x + _rs(jnp.einsum("she,hed->sd", o, wo, precision=dflt))
        h = _ag(rms(x))
        return x + _rs((jax.nn.silu(h @ wg) * (h @ wu)) @ wd)

    f = _sm(layer, specs, P("tp", None))
    args = inputs(mesh_1d(), list(zip(shapes, specs, strict=True)))
    check_rewrite(f, args, ["all_gather_matmul", "matmul_reduce_scatter"])
    args = inputs(mesh_1d(), list(zip(shapes, specs, strict=True)), jnp.bfloat16)
    found = _rewritten(f, args)
    assert [c.op for c in found] == ["all_gather_matmul", "matmul_reduce_scatter"] * 2, found


def test_parallel_block_sum_of_two_matmuls_is_one_op():
    """GPT-J / PaLM parallel block: ``psum(attn @ wo + mlp @ w2)`` is one matmul_all_reduce of
    ``[attn, mlp] @ [wo; w2]`` (concatenated along K); a reduce-scatter likewise."""
    specs = (P(None, "tp"), P(None, "tp"), P("tp", None), P("tp", None))
    shapes = [(S * 2, D), (S * 2, F), (D, D), (F, D)]
    args = inputs(mesh_1d(), list(zip(shapes, specs, strict=True)))

    def body(a, b, wo, w2):
        return lax.psum(a @ wo + b @ w2, "tp"), _rs(jnp.tanh(a) @ wo + jnp.tanh(b) @ w2)

    f = _sm(body, specs, (P(), P("tp", None)))
    check_rewrite(f, args, ["matmul_all_reduce", "matmul_reduce_scatter"])
    assert all("concatenated along K" in c.note for c in _rewritten(f, args))
