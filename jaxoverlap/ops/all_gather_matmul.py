"""``all_gather_matmul``: ``all_gather(x) @ w`` as one op (column-parallel linear layers)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax._src import core
from jax.interpreters import ad, batching

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
    params = dict(axis_name=names, gather_dimension=d, config=config)
    _common.check_fused_possible(OP, x, w, params, n)
    x, w = _common.vary_operands(x, w, names)
    return all_gather_matmul_p.bind(x, w, **params)


# ----------------------------------------------------------------------------- primitive

all_gather_matmul_p = core.Primitive(OP)


def _abstract_eval(x, w, *, axis_name, gather_dimension, config):
    del config
    n = _common.axis_size(axis_name)
    shape = [*x.shape[:-1], w.shape[1]]
    if gather_dimension < x.ndim - 1:  # along K the gathered dim is contracted away
        shape[gather_dimension] *= n
    vma = _common.operands_vma(OP, x, w)
    return x.update(shape=tuple(shape), manual_axis_type=x.mat.update(varying=vma))


all_gather_matmul_p.def_abstract_eval(_abstract_eval)


# ----------------------------------------------------------------------------- lowering

_common.register_lowerings(all_gather_matmul_p, OP, reference.all_gather_matmul)


# ----------------------------------------------------------------------------- autodiff, batching


def _transpose_x(ct, x, w, *, axis_name, gather_dimension, config):
    """d/dx: ``psum_scatter(ct @ w.T)`` -- the sibling matmul_reduce_scatter."""
    del x
    from jaxoverlap.ops.matmul_reduce_scatter import matmul_reduce_scatter_p

    return matmul_reduce_scatter_p.bind(
        ct,
        jnp.transpose(w),
        axis_name=axis_name,
        scatter_dimension=gather_dimension,
        config=config,
    )


def _transpose_w(ct, x, w, *, axis_name, gather_dimension, config):
    """d/dw: ``all_gather(x)^T @ ct``, contracting every leading dimension."""
    del w, config
    gathered = lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True)
    return _common.contract_leading(gathered, ct)


def _jvp(primals, tangents, *, axis_name, gather_dimension, config):
    """With a tangent on w (weights being trained) dW needs the gathered x, which plain JAX keeps
    from the forward as a residual. The fused kernel does not hand out the x it gathered, so under
    ``backend="auto"``/``"xla"`` the forward is then the plain ``all_gather(x) @ w`` (its gather
    kept for dW) and only dx's transpose, a matmul_reduce_scatter, runs fused -- the op forward
    would gather x a second time for dW. ``backend="fused"`` keeps the op forward (as asked) and
    gathers x again for dW. Without a tangent on w: the op, and the sibling op for dx."""
    x, w = primals
    dx, dw = tangents
    params = dict(axis_name=axis_name, gather_dimension=gather_dimension, config=config)
    if type(dw) is ad.Zero:
        out = all_gather_matmul_p.bind(x, w, **params)
        if type(dx) is ad.Zero:
            return out, ad.Zero.from_primal_value(out)
        return out, all_gather_matmul_p.bind(dx, w, **params)
    gathered = lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True)
    if config.backend == "fused":
        out = all_gather_matmul_p.bind(x, w, **params)
    else:
        out = jnp.matmul(gathered, w)
    tangent = jnp.matmul(gathered, dw)
    if type(dx) is not ad.Zero:
        tangent = tangent + all_gather_matmul_p.bind(dx, w, **params)
    return out, tangent


ad.defbilinear(all_gather_matmul_p, _transpose_x, _transpose_w)
ad.primitive_jvps[all_gather_matmul_p] = _jvp
batching.primitive_batchers[all_gather_matmul_p] = _common.batch_rule(
    all_gather_matmul_p.bind, "gather_dimension"
)
