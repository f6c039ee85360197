"""``all_gather_matmul``: ``all_gather(x) @ w`` as one op (column-parallel linear layers)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core
from jax.interpreters import ad, batching, mlir

from jaxoverlap import reference
from jaxoverlap.ops import _common

OP = "all_gather_matmul"


# ----------------------------------------------------------------------------- public function


def all_gather_matmul(x, w, axis_name, *, gather_dimension=0, config=None):
    """``jnp.matmul(lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True), w)``.

    Call inside ``jax.shard_map``; shapes are per device.

    Args:
      x: ``[..., K]`` local shard of the activations (rank >= 2).
      w: ``[K, N]`` local weight shard; same dtype as ``x``.
      axis_name: the mesh axis (or tuple of axes) to gather over.
      gather_dimension: which dimension of ``x`` is gathered. Default 0. The last dimension
        (K, which the matmul contracts) is valid too: x is then sharded over K, holds
        ``K / n`` columns, and ``w`` is the whole ``[K, N]``.
      config: a `jaxoverlap.Config`; ``None`` means ``Config()``.

    Returns:
      ``[..., N]`` in ``x.dtype``: the group's ``x`` blocks concatenated along
      ``gather_dimension`` (in rank order), times ``w``.
    """
    names = _common.axis_tuple(OP, axis_name)
    config = _common.resolve_config(OP, config)
    xs = jnp.shape(x)
    if len(xs) < 2:
        raise ValueError(
            f"jaxoverlap.{OP}: x must have rank >= 2 ([rows, K]); got shape {xs}. Add a leading "
            "dim (x[None])."
        )
    d = _common.normalize_dim(OP, "gather_dimension", gather_dimension, len(xs), range(len(xs)), xs)
    n = _common.group_size(OP, names)
    _common.check_operands(OP, x, w, k_shards=n if d == len(xs) - 1 else 1)
    params = dict(axis_name=names, gather_dimension=d, config=config, w_colmajor=False)
    _common.check_fused_possible(OP, x, w, params, n)
    x, w = _common.vary_operands(x, w, names)
    return all_gather_matmul_p.bind(x, w, **params)


# ----------------------------------------------------------------------------- primitive

all_gather_matmul_p = core.Primitive(OP)


def _abstract_eval(x, w, *, axis_name, gather_dimension, config, w_colmajor):
    del config, w_colmajor
    n = _common.axis_size(axis_name)
    shape = [*x.shape[:-1], w.shape[1]]
    if gather_dimension < x.ndim - 1:  # along K the gathered dim is contracted away
        shape[gather_dimension] *= n
    vma = _common.operands_vma(OP, x, w)
    return x.update(shape=tuple(shape), manual_axis_type=x.mat.update(varying=vma))


all_gather_matmul_p.def_abstract_eval(_abstract_eval)

# The variant that also returns the gathered x: the forward of a layer whose weight is trained
# (dW = gathered^T @ ct needs it, as plain JAX keeps its all_gather's result), and the backward
# of matmul_reduce_scatter (ct gathered once for dx and dW). Internal: only autodiff binds it.
all_gather_matmul_keep_p = core.Primitive(OP + "_keep")
all_gather_matmul_keep_p.multiple_results = True


def _keep_abstract_eval(x, w, *, axis_name, gather_dimension, **params):
    out = _abstract_eval(x, w, axis_name=axis_name, gather_dimension=gather_dimension, **params)
    shape = list(x.shape)
    shape[gather_dimension] *= _common.axis_size(axis_name)
    return out, x.update(shape=tuple(shape), manual_axis_type=out.mat)


all_gather_matmul_keep_p.def_abstract_eval(_keep_abstract_eval)


# ----------------------------------------------------------------------------- lowering

_common.register_lowerings(all_gather_matmul_p, OP, reference.all_gather_matmul)
_common.register_lowerings(
    all_gather_matmul_keep_p, OP, reference.all_gather_matmul_keep, keep_gathered=True
)


# ----------------------------------------------------------------------------- autodiff, batching


def _transpose_x(ct, x, w, *, gather_dimension, **params):
    """d/dx: ``psum_scatter(ct @ w.T)`` -- the sibling matmul_reduce_scatter, reading ``w.T``
    in place (`_common.transposed_w`)."""
    del x
    from jaxoverlap.ops.matmul_reduce_scatter import matmul_reduce_scatter_p

    wt, params = _common.transposed_w(w, params)
    return matmul_reduce_scatter_p.bind(ct, wt, scatter_dimension=gather_dimension, **params)


def _transpose_w(ct, x, w, *, axis_name, gather_dimension, **params):
    """d/dw: ``all_gather(x)^T @ ct``, contracting every leading dimension."""
    del w, params
    gathered = lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True)
    return _common.contract_leading(gathered, ct)


def _jvp(primals, tangents, **params):
    """With a tangent on w (weights being trained) dW needs the gathered x, which plain JAX keeps
    from the forward as a residual: the forward is then the variant that also returns the x it
    gathered (`all_gather_matmul_keep_p`, one gather for the product and dW, as in plain JAX).
    With tangents on both, the tangent is `all_gather_matmul_tangent_p`, whose transpose computes
    dx's reduce-scatter beside dW's GEMM (`dgrad_rs_wgrad`). Without a tangent on w: the op, and
    the op again for the tangent."""
    x, w = primals
    dx, dw = tangents
    if type(dw) is ad.Zero:
        out = all_gather_matmul_p.bind(x, w, **params)
        if type(dx) is ad.Zero:
            return out, ad.Zero.from_primal_value(out)
        return out, all_gather_matmul_p.bind(dx, w, **params)
    out, gathered = all_gather_matmul_keep_p.bind(x, w, **params)
    return out, _tangent(gathered, w, dx, dw, params)


def _tangent(gathered, w, dx, dw, params):
    """``all_gather(dx) @ w + all_gather(x) @ dw`` given the gathered x (dw is not zero)."""
    if type(dx) is ad.Zero:
        return jnp.matmul(gathered, dw)
    return all_gather_matmul_tangent_p.bind(dx, dw, gathered, w, **params)


# The op's tangent with tangents on both x and w, ``all_gather(dx) @ w + g @ dw`` (g: the gathered
# x), as a linear primitive of (dx, dw): its transpose is one op computing dx's reduce-scatter and
# dW's GEMM together, so the collective hides behind dW's GEMM. Internal.
all_gather_matmul_tangent_p = core.Primitive(OP + "_tangent")


def _tangent_reference(dx, dw, g, w, *, axis_name, gather_dimension, **params):
    del params
    return reference.all_gather_matmul(dx, w, axis_name, gather_dimension=gather_dimension) + (
        jnp.matmul(g, dw)
    )


all_gather_matmul_tangent_p.def_abstract_eval(
    lambda dx, dw, g, w, **params: _abstract_eval(dx, w, **params)
)
mlir.register_lowering(
    all_gather_matmul_tangent_p, mlir.lower_fun(_tangent_reference, multiple_results=False)
)


def _tangent_transpose(ct, dx, dw, g, w, *, gather_dimension, **params):
    """(dx, dW) = (psum_scatter(ct @ w.T), g.T @ ct): one op where it scatters rows, which runs
    the reduce-scatter beside dW's GEMM on GPUs (`jaxoverlap.ops.dgrad_rs_wgrad`); else the
    sibling matmul_reduce_scatter and a plain GEMM."""
    undefined = [ad.is_undefined_primal(v) for v in (dx, dw)]
    if type(ct) is ad.Zero:
        return [ad.Zero(v.aval) if u else None for v, u in zip((dx, dw), undefined)] + [None, None]
    wt, params = _common.transposed_w(w, params)
    if gather_dimension < ct.ndim - 1:
        from jaxoverlap.ops.dgrad_rs_wgrad import dgrad_rs_wgrad_p

        params = {**params, "scatter_dimension": gather_dimension}
        dx_ct, dw_ct = dgrad_rs_wgrad_p.bind(ct, wt, g, **params)
    else:
        from jaxoverlap.ops.matmul_reduce_scatter import matmul_reduce_scatter_p

        dx_ct = matmul_reduce_scatter_p.bind(ct, wt, scatter_dimension=gather_dimension, **params)
        dw_ct = _common.contract_leading(g, ct)
    return [dx_ct if undefined[0] else None, dw_ct if undefined[1] else None, None, None]


def _tangent_jvp(primals, tangents, **params):
    """Higher-order autodiff through the tangent primitive: JAX's rules for its reference."""
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(partial(_tangent_reference, **params), tuple(primals), tangents)


def _tangent_batch(args, dims, **params):
    return jax.vmap(partial(_tangent_reference, **params), in_axes=dims)(*args), 0


def _keep_jvp(primals, tangents, **params):
    """Higher-order autodiff through the variant: the op's tangent, and the gathered tangent."""
    x, w = primals
    dx, dw = tangents
    out, gathered = all_gather_matmul_keep_p.bind(x, w, **params)
    if type(dw) is ad.Zero:
        out_dot = (
            ad.Zero.from_primal_value(out)
            if type(dx) is ad.Zero
            else all_gather_matmul_p.bind(dx, w, **params)
        )
    else:
        out_dot = _tangent(gathered, w, dx, dw, params)
    if type(dx) is ad.Zero:
        g_dot = ad.Zero.from_primal_value(gathered)
    else:
        g_dot = lax.all_gather(dx, params["axis_name"], axis=params["gather_dimension"], tiled=True)
    return (out, gathered), (out_dot, g_dot)


def _keep_batch(args, dims, **params):
    """vmap of the variant: the op's own batching rule for the product, a batched gather for x."""

    def both(x, w):
        out = all_gather_matmul_p.bind(x, w, **params)
        axis = params["gather_dimension"]
        return out, lax.all_gather(x, params["axis_name"], axis=axis, tiled=True)

    return jax.vmap(both, in_axes=dims)(*args), (0, 0)


ad.defbilinear(all_gather_matmul_p, _transpose_x, _transpose_w)
ad.primitive_jvps[all_gather_matmul_p] = _jvp
ad.primitive_jvps[all_gather_matmul_keep_p] = _keep_jvp
batching.primitive_batchers[all_gather_matmul_keep_p] = _keep_batch
ad.primitive_transposes[all_gather_matmul_tangent_p] = _tangent_transpose
ad.primitive_jvps[all_gather_matmul_tangent_p] = _tangent_jvp
batching.primitive_batchers[all_gather_matmul_tangent_p] = _tangent_batch
batching.primitive_batchers[all_gather_matmul_p] = _common.batch_rule(
    all_gather_matmul_p.bind, "gather_dimension"
)
