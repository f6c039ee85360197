"""`jaxoverlap.overlap` leaves alone every pair whose semantics differ, and `explain` says why.

Each case is a shard_map program on 4 fake CPU devices with one matmul/collective pair that must
not be rewritten: the jaxpr stays as it was, explain names the reason, values are unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from overlap_util import (
    COLLECTIVE,
    TOL,
    assert_tree_close,
    inputs,
    mesh_1d,
    prims,
)

from jaxoverlap.overlap import explain, overlap


def _rs(y):
    return lax.psum_scatter(y, "tp", tiled=True)


def _sm(body, in_specs, out_specs, check_vma=True):
    return jax.shard_map(body, mesh=mesh_1d(), in_specs=in_specs, out_specs=out_specs,
                         check_vma=check_vma)  # fmt: skip


ROW = (P(None, "tp"), P("tp", None))  # x [M, K/t], w [K/t, N]
NEGATIVE = {
    "precision": (
        lambda x, w: _rs(jnp.matmul(x, w, precision=lax.Precision.HIGHEST)),
        ROW, P("tp", None), "precision",
    ),
    "preferred_element_type": (
        lambda x, w: _rs(jnp.matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                    preferred_element_type=jnp.float32)),
        ROW, P("tp", None), "preferred_element_type=float32",
    ),
    "untiled": (
        lambda x, w: lax.psum_scatter(x[:4] @ w, "tp", tiled=False),
        ROW, P("tp"), "tiled=False",
    ),
    "untiled_all_gather": (
        lambda x, w: jnp.einsum("tmk,kn->tmn", lax.all_gather(x, "tp", tiled=False), w),
        (P("tp", None), P()), P("tp", None, None), "tiled=False",
    ),
    "axis_index_groups": (
        lambda x, w: lax.psum(x @ w, "tp", axis_index_groups=[[0, 1], [2, 3]]),
        ROW, P("tp", None), "axis_index_groups",
    ),
    "x_contracted_on_first_dim": (
        lambda x, w: _rs(jnp.einsum("km,kn->mn", x.T, w)),
        ROW, P("tp", None), "not on its last",
    ),
    "batch_dims": (
        lambda x, w: lax.psum_scatter(
            jnp.einsum("bmk,bkn->bmn", x[None], w[None]), "tp", scatter_dimension=1, tiled=True
        ),
        ROW, P(None, "tp", None), "batch dimensions",
    ),
    "intermediate_used_elsewhere": (
        lambda x, w: (lambda y: (_rs(y), y))(x @ w),
        ROW, (P("tp", None), P("tp", None)), "also used elsewhere",
    ),
    "gathered_used_elsewhere": (
        lambda x, w: (lambda g: (g @ w, g))(lax.all_gather(x, "tp", tiled=True)),
        (P("tp", None), P()), (P("tp", None), P("tp", None)), "also used elsewhere",
    ),
    "integer_dtype": (
        lambda x, w: _rs(x.astype(jnp.int32) @ w.astype(jnp.int32)),
        ROW, P("tp", None), "not floating point",
    ),
    "op_refuses_float8": (
        lambda x, w: _rs(x.astype(jnp.float8_e4m3fn) @ w.astype(jnp.float8_e4m3fn)),
        ROW, P("tp", None), "does not accept it",
    ),
    "gathered_weight": (
        lambda x, w: x @ lax.all_gather(w, "tp", tiled=True),
        (P(), P("tp", None)), P("tp", None), "weight operand",
    ),
    "custom_jvp": (
        jax.custom_jvp(lambda x, w: _rs(x @ w)),
        ROW, P("tp", None), "custom_jvp",
    ),
}  # fmt: skip
NEGATIVE["custom_jvp"][0].defjvps(lambda t, y, x, w: _rs(t @ w), lambda t, y, x, w: _rs(x @ t))


@pytest.mark.parametrize("case", list(NEGATIVE))
def test_skipped_with_reason(case, capsys):
    body, in_specs, out_specs, reason = NEGATIVE[case]
    f = _sm(body, in_specs, out_specs, check_vma=case != "axis_index_groups")
    x, w = inputs(mesh_1d(), [((16, 32), P()), ((32, 8), P())])
    before = jax.make_jaxpr(f)(x, w)
    after = jax.make_jaxpr(overlap(f))(x, w)
    assert prims(after) == prims(before)
    assert not set(prims(after)) & set(COLLECTIVE), prims(after)
    found = explain(f, x, w)
    assert len(found) == 1 and not found[0].rewritten, found
    assert reason in found[0].reason, found[0].reason
    assert "why: " + found[0].reason in capsys.readouterr().out
    if case not in ("axis_index_groups", "integer_dtype", "op_refuses_float8"):
        assert_tree_close(jax.jit(overlap(f))(x, w), jax.jit(f)(x, w), TOL[jnp.float32])


def test_not_inside_shard_map_has_no_candidates(capsys):
    x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
    assert explain(lambda x, w: jnp.tanh(x @ w), x, w) == []
    assert "no candidates" in capsys.readouterr().out
    np.testing.assert_array_equal(overlap(lambda x, w: x @ w)(x, w), x @ w)
