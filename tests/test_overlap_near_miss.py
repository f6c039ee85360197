"""Near misses: something between the matmul and the collective that cannot move across it, or a
Megatron-style custom_vjp f/g operator. `explain` lists each with the equation in between and how
to move it; the program is left as written. Also explain's summary and ``verbose=False``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from overlap_util import TOL, assert_tree_close, inputs, loss_of, mesh_1d, prims

import jaxoverlap
from jaxoverlap.overlap import explain, overlap, summary


def _sm(body, in_specs, out_specs):
    return jax.shard_map(body, mesh=mesh_1d(), in_specs=in_specs, out_specs=out_specs)


def _rs(y, dim=0):
    return lax.psum_scatter(y, "tp", scatter_dimension=dim, tiled=True)


def _ag(x):
    return lax.all_gather(x, "tp", axis=0, tiled=True)


def _rms(x):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


ROW = (P(None, "tp"), P("tp", None))
COL = (P("tp", None), P(None, "tp"))
NEAR = {
    "tanh": (lambda x, w: _rs(jnp.tanh(x @ w)), ROW, P("tp"), "a tanh", "does not commute"),
    # relu(psum(y)) is not psum(relu(y)): no advice to move it (it would change the result)
    "relu": (lambda x, w: lax.psum(jax.nn.relu(x @ w), "tp"), ROW, P(), "custom_jvp_call (relu)",
             "no equal form"),
    "scale": (lambda x, w: _rs((x @ w) * x[:, :1]), ROW, P("tp"), "a mul", "differs across"),
    "replicated_scale": (lambda x, w: lax.psum((x @ w) * 0.5, "tp"), ROW, P(), "a mul",
                         "scale after"),
    # (a bias along the scattered rows is rewritten: tests/test_overlap_patterns.py)
    "full_addend": (
        lambda x, w: _rs(x @ w + jnp.tanh(x[:, :8])), ROW, P("tp"), "a add",
        "not a broadcast bias",
    ),
    "reshape_moves_rows": (
        lambda x, w: _rs((x @ w).reshape(2, 8, 8), 1), ROW, P(None, "tp"), "a reshape",
        "moves the scattered dimension",
    ),
    "norm_after_gather": (
        lambda x, w: _rms(_ag(x)) @ w, COL, P(None, "tp"), "between the all_gather",
        "before the all_gather",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(NEAR))
def test_near_miss_is_listed_with_what_is_between(case):
    body, in_specs, out_specs, what, how = NEAR[case]
    f = _sm(body, in_specs, out_specs)
    x, w = inputs(mesh_1d(), [((16, 32), in_specs[0]), ((32, 8), in_specs[1])])
    (c,) = explain(f, x, w)
    assert (c.kind, c.rewritten) == ("near miss", False), c
    assert what in c.reason and how in c.reason, c.reason
    assert prims(jax.make_jaxpr(overlap(f))(x, w)) == prims(jax.make_jaxpr(f)(x, w))
    (line,) = summary([c, c])[1:]  # one line per reason, without the source line
    assert line.startswith("    2 near miss: ") and ".py:" not in line, line
    assert_tree_close(jax.jit(overlap(f))(x, w), jax.jit(f)(x, w), TOL[jnp.float32])


@jax.custom_vjp
def megatron_g(x):  # psum forward, identity backward
    return lax.psum(x, "tp")


megatron_g.defvjp(lambda x: (lax.psum(x, "tp"), None), lambda _, ct: (ct,))


@jax.custom_vjp
def megatron_f(x):  # identity forward, psum backward
    return x


megatron_f.defvjp(lambda x: (x, None), lambda _, ct: (lax.psum(ct, "tp"),))


def test_megatron_f_and_g_operators_are_near_misses():
    """A Megatron MLP (no sequence parallelism): ``g(gelu(f(x) @ w1) @ w2)``."""
    specs = (P(), P(None, "tp"), P("tp", None))
    args = inputs(mesh_1d(), [((8, 16), specs[0]), ((16, 32), specs[1]), ((32, 16), specs[2])])

    def body(x, w1, w2):
        return megatron_g(jax.nn.gelu(megatron_f(x) @ w1) @ w2)

    f = jax.shard_map(body, mesh=mesh_1d(), in_specs=specs, out_specs=P(), check_vma=False)
    found = explain(f, *args)
    assert [(c.kind, c.op, c.rewritten) for c in found] == [
        ("near miss", "matmul_all_reduce", False),
        ("near miss", "matmul_all_reduce", False),
    ], found
    assert "'f' operator" in found[0].reason and "megatron_f" in found[0].reason
    assert "'g' operator" in found[1].reason and "psum" in found[1].detail
    assert_tree_close(jax.jit(overlap(f))(*args), jax.jit(f)(*args), TOL[jnp.float32])


def test_without_f_and_g_the_backward_psum_is_rewritten_by_overlap_of_grad():
    """What the near-miss reasons advise: plain ``x @ w1`` with a replicated x under
    check_vma=True; overlap of the gradient then fuses the backward's matmul + psum."""
    specs = (P(), P(None, "tp"), P("tp", None))
    args = inputs(mesh_1d(), [((8, 16), specs[0]), ((16, 32), specs[1]), ((32, 16), specs[2])])
    f = _sm(lambda x, w1, w2: lax.psum(jax.nn.gelu(x @ w1) @ w2, "tp"), specs, P())
    grad = jax.grad(loss_of(f))
    ops = [(c.op, c.rewritten) for c in explain(grad, *args)]
    assert ("matmul_all_reduce", True) in ops, ops
    assert prims(jax.make_jaxpr(overlap(grad))(*args))["matmul_all_reduce"] >= 1
    assert_tree_close(jax.jit(overlap(grad))(*args), jax.jit(grad)(*args), TOL[jnp.float32])


def test_explain_summary_and_verbose_false_folds_fsdp_gathers(capsys):
    """One summary line per GPU path and per reason; FSDP weight gathers fold away."""
    specs = (P("tp", None), P("tp", None), P(None, "tp"))
    args = inputs(mesh_1d(), [((16, 32), specs[0]), ((32, 32), specs[1]), ((32, 8), specs[2])])

    def body(x, w_fsdp, w):
        h = x @ _ag(w_fsdp)  # FSDP: the weight is gathered
        return _ag(h) @ w, _ag(h.astype(jnp.bfloat16)) @ w.astype(jnp.bfloat16)

    f = _sm(body, specs, (P(None, "tp"), P(None, "tp")))
    found = explain(f, *args, verbose=False)
    out = capsys.readouterr().out
    assert [c.kind for c in found] == ["out of scope", "candidate", "candidate"], found
    assert "weight operand" not in out.split("summary:")[0]
    assert "(1 out-of-scope skips folded; verbose=True lists them)" in out
    summary = out.split("summary:")[1].strip().splitlines()
    paths = {c.path for c in found if c.rewritten}
    assert len(summary) == len(paths) + 1, summary
    # The two rewrites may take different GPU paths (with the native extension built, the f32 one
    # and the bf16 one are refused for different reasons): their counts add up to 2.
    path_lines = summary[:-1]
    assert all(ln.split()[1:4] == ["rewritten,", "GPU", "path"] for ln in path_lines), summary
    assert sum(int(ln.split()[0]) for ln in path_lines) == 2, summary
    assert "out of scope: the gathered value is the matmul's weight operand" in summary[-1]
    for c in found[1:]:  # the path is computed by jaxoverlap.fused for the op's own operands
        assert c.path.startswith(("fused", "reference: ")), c.path
    explain(f, *args)
    assert "skipped   all_gather_matmul" in capsys.readouterr().out


def test_explain_path_comes_from_the_fused_module(monkeypatch):
    """With the native extension reported available, the path is what `fused` decides for the
    op's own operands: a reduce-scatter over the last dimension (N) too small for the transposed
    problem's 128-row chunks (fused/last_dim.py) runs the reference path."""
    from jaxoverlap import runtime

    monkeypatch.setattr(runtime, "unavailable_reason", lambda: None)
    mesh = mesh_1d()
    x, w = inputs(mesh, [((2, 64, 256), P(None, None, "tp")), ((256, 256), P("tp", None))],
                  jnp.bfloat16)  # fmt: skip
    specs = (P(None, None, "tp"), P("tp", None))
    f = jax.shard_map(
        lambda x, w: _rs(x @ w, 2), mesh=mesh, in_specs=specs, out_specs=P(None, None, "tp")
    )
    (c,) = explain(f, x, w)
    assert c.rewritten, c
    assert c.path.startswith("reference: alignment"), c.path
    assert "transposed problem" in c.path, c.path
    (c,) = explain(overlap(f, config=jaxoverlap.Config(backend="xla")), x, w)
    assert c.path == "reference: backend='xla'", c.path
