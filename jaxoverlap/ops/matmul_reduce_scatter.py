"""``matmul_reduce_scatter``: ``psum_scatter(x @ w)`` as one op (row-parallel linear layers)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax._src import core
from jax.interpreters import ad, batching

from jaxoverlap import reference
from jaxoverlap.ops import _common

OP = "matmul_reduce_scatter"


# ----------------------------------------------------------------------------- public function


def matmul_reduce_scatter(x, w, axis_name, *, scatter_dimension=0, config=None):
    """``lax.psum_scatter(x @ w, axis_name, scatter_dimension=scatter_dimension, tiled=True)``.

    Call inside ``jax.shard_map``; shapes are per device.

    Args:
      x: ``[..., K]`` local activations (leading batch dimensions allowed).
      w: ``[K, N]`` local weight shard; same dtype as ``x``.
      axis_name: the mesh axis (or tuple of axes) to reduce-scatter over; its size ``n`` must
        divide the scattered dimension.
      scatter_dimension: which dimension of the result ``[..., N]`` is scattered (default 0).
      config: a `jaxoverlap.Config`; ``None`` means ``Config()``.

    Returns:
      ``[..., N]`` in ``x.dtype`` with dimension ``scatter_dimension`` divided by ``n``: this
      device's block of the sum over the group of every device's ``x @ w``.
    """
    names = _common.axis_tuple(OP, axis_name)
    config = _common.resolve_config(OP, config)
    _common.check_operands(OP, x, w)
    out_shape = (*jnp.shape(x)[:-1], jnp.shape(w)[1])
    d = _common.normalize_dim(
        OP,
        "scatter_dimension",
        scatter_dimension,
        len(out_shape),
        range(len(out_shape)),
        out_shape,
    )
    n = _common.group_size(OP, names)
    if out_shape[d] % n:
        raise ValueError(
            f"jaxoverlap.{OP}: result dimension {d} (size {out_shape[d]}, result shape "
            f"{out_shape} from x {jnp.shape(x)} @ w {jnp.shape(w)}) is not divisible by the size "
            f"{n} of axis {names}. Pad that dimension to a multiple of {n} or scatter another "
            f"dimension (scatter_dimension=...)."
        )
    params = dict(axis_name=names, scatter_dimension=d, config=config)
    _common.check_fused_possible(OP, x, w, params, n)
    x, w = _common.vary_operands(x, w, names)
    return matmul_reduce_scatter_p.bind(x, w, **params)


# ----------------------------------------------------------------------------- primitive

matmul_reduce_scatter_p = core.Primitive(OP)


def _abstract_eval(x, w, *, axis_name, scatter_dimension, config):
    del config
    n = _common.axis_size(axis_name)
    shape = [*x.shape[:-1], w.shape[1]]
    shape[scatter_dimension] //= n
    vma = _common.operands_vma(OP, x, w)
    return x.update(shape=tuple(shape), manual_axis_type=x.mat.update(varying=vma))


matmul_reduce_scatter_p.def_abstract_eval(_abstract_eval)


# ----------------------------------------------------------------------------- lowering

_common.register_lowerings(matmul_reduce_scatter_p, OP, reference.matmul_reduce_scatter)


# ----------------------------------------------------------------------------- autodiff, batching


def _transpose_x(ct, x, w, *, axis_name, scatter_dimension, config):
    """d/dx: ``all_gather(ct) @ w.T`` -- the sibling all_gather_matmul where it can express it."""
    del x
    wt = jnp.transpose(w)
    if scatter_dimension < ct.ndim - 1:
        from jaxoverlap.ops.all_gather_matmul import all_gather_matmul_p

        return all_gather_matmul_p.bind(
            ct, wt, axis_name=axis_name, gather_dimension=scatter_dimension, config=config
        )
    # The scattered dimension is N, which w.T contracts: no all-gather-matmul shape for that.
    gathered = lax.all_gather(ct, axis_name, axis=scatter_dimension, tiled=True)
    return jnp.matmul(gathered, wt)


def _transpose_w(ct, x, w, *, axis_name, scatter_dimension, config):
    """d/dw: ``x^T @ all_gather(ct)``, contracting every leading dimension."""
    del w, config
    gathered = lax.all_gather(ct, axis_name, axis=scatter_dimension, tiled=True)
    return _common.contract_leading(x, gathered)


def _jvp(primals, tangents, *, axis_name, scatter_dimension, config):
    """The op itself forward. Its tangent, when both x and w carry one, is the plain
    ``psum_scatter(dx @ w + x @ dw)`` under ``backend="auto"``/``"xla"``: its transpose gathers the
    cotangent once for both gradients, exactly as JAX differentiates the reference, where the two
    sibling ops would gather it twice (the fused all_gather_matmul for dx, an all_gather for
    dW). ``backend="fused"`` keeps the sibling ops, as asked. One tangent: the sibling op."""
    x, w = primals
    dx, dw = tangents
    params = dict(axis_name=axis_name, scatter_dimension=scatter_dimension, config=config)
    out = matmul_reduce_scatter_p.bind(x, w, **params)
    zx, zw = type(dx) is ad.Zero, type(dw) is ad.Zero
    if zx and zw:
        return out, ad.Zero.from_primal_value(out)
    if zw:
        return out, matmul_reduce_scatter_p.bind(dx, w, **params)
    if zx:
        return out, matmul_reduce_scatter_p.bind(x, dw, **params)
    if config.backend == "fused":
        bind = matmul_reduce_scatter_p.bind
        return out, bind(dx, w, **params) + bind(x, dw, **params)
    both = jnp.matmul(dx, w) + jnp.matmul(x, dw)
    return out, lax.psum_scatter(both, axis_name, scatter_dimension=scatter_dimension, tiled=True)


ad.defbilinear(matmul_reduce_scatter_p, _transpose_x, _transpose_w)
ad.primitive_jvps[matmul_reduce_scatter_p] = _jvp
batching.primitive_batchers[matmul_reduce_scatter_p] = _common.batch_rule(
    matmul_reduce_scatter_p.bind, "scatter_dimension"
)
