"""``matmul_reduce_scatter``: ``psum_scatter(x @ w)`` as one op (row-parallel linear layers)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching, mlir

from jaxoverlap import reference
from jaxoverlap.ops import _common
from jaxoverlap.ops.primitives import (
    all_gather_matmul_keep_p,
    all_gather_matmul_p,
    matmul_reduce_scatter_p,
    matmul_reduce_scatter_tangent_p,
)

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
    params = dict(axis_name=names, scatter_dimension=d, config=config, w_colmajor=False)
    _common.check_fused_possible(OP, x, w, params, n)
    x, w = _common.vary_operands(x, w, names)
    return matmul_reduce_scatter_p.bind(x, w, **params)


# ----------------------------------------------------------------------------- primitive


def _abstract_eval(x, w, *, axis_name, scatter_dimension, config, w_colmajor):
    del config, w_colmajor
    n = _common.axis_size(axis_name)
    shape = [*x.shape[:-1], w.shape[1]]
    shape[scatter_dimension] //= n
    vma = _common.operands_vma(OP, x, w)
    return x.update(shape=tuple(shape), manual_axis_type=x.mat.update(varying=vma))


_common.def_abstract_eval(matmul_reduce_scatter_p, _abstract_eval)


# ----------------------------------------------------------------------------- lowering

_common.register_lowerings(matmul_reduce_scatter_p, OP, reference.matmul_reduce_scatter)

# The op's tangent when both x and w carry one (`primitives.matmul_reduce_scatter_tangent_p`);
# its transpose is `_tangent_transpose`.


def _tangent_reference(dx, dw, x, w, *, axis_name, scatter_dimension, **params):
    del params
    both = jnp.matmul(dx, w) + jnp.matmul(x, dw)
    return lax.psum_scatter(both, axis_name, scatter_dimension=scatter_dimension, tiled=True)


_common.def_abstract_eval(
    matmul_reduce_scatter_tangent_p, lambda dx, dw, x, w, **params: _abstract_eval(x, w, **params)
)
mlir.register_lowering(
    matmul_reduce_scatter_tangent_p,
    mlir.lower_fun(_tangent_reference, multiple_results=False),
)


# ----------------------------------------------------------------------------- autodiff, batching


def _gather_ct_matmul_wt(ct, w, *, axis_name, scatter_dimension, **params):
    """``(all_gather(ct) @ w.T, all_gather(ct))``: the sibling all_gather_matmul's variant that
    returns what it gathered, reading ``w.T`` in place, where it can express it."""
    if scatter_dimension < ct.ndim - 1:
        wt, params = _common.transposed_w(w, params)
        return all_gather_matmul_keep_p.bind(
            ct, wt, axis_name=axis_name, gather_dimension=scatter_dimension, **params
        )
    # The scattered dimension is N, which w.T contracts: no all-gather-matmul shape for that.
    gathered = lax.all_gather(ct, axis_name, axis=scatter_dimension, tiled=True)
    return jnp.matmul(gathered, jnp.transpose(w)), gathered


def _transpose_x(ct, x, w, *, axis_name, scatter_dimension, **params):
    """d/dx: ``all_gather(ct) @ w.T`` -- the sibling all_gather_matmul where it can express it."""
    del x
    if scatter_dimension < ct.ndim - 1:
        wt, params = _common.transposed_w(w, params)
        return all_gather_matmul_p.bind(
            ct, wt, axis_name=axis_name, gather_dimension=scatter_dimension, **params
        )
    gathered = lax.all_gather(ct, axis_name, axis=scatter_dimension, tiled=True)
    return jnp.matmul(gathered, jnp.transpose(w))


def _transpose_w(ct, x, w, *, axis_name, scatter_dimension, **params):
    """d/dw: ``x^T @ all_gather(ct)``, contracting every leading dimension."""
    del w, params
    gathered = lax.all_gather(ct, axis_name, axis=scatter_dimension, tiled=True)
    return _common.contract_leading(x, gathered)


def _tangent_transpose(ct, dx, dw, x, w, **params):
    """Both gradients from one gather of the cotangent: dx's fused all_gather_matmul also
    returns the gathered cotangent, which dW = x^T @ it contracts (as plain JAX shares its one
    all_gather between the two)."""
    if type(ct) is ad.Zero:
        return [ad.Zero(v.aval) if ad.is_undefined_primal(v) else None for v in (dx, dw)] + [
            None,
            None,
        ]
    dx_ct, gathered = _gather_ct_matmul_wt(ct, w, **params)
    dw_ct = _common.contract_leading(x, gathered)
    return [
        dx_ct if ad.is_undefined_primal(dx) else None,
        dw_ct if ad.is_undefined_primal(dw) else None,
        None,
        None,
    ]


def _jvp(primals, tangents, **params):
    """The op itself forward. With a tangent on x only or on w only, the op again (its transpose
    is the sibling op, or a gather for dW); with both, `matmul_reduce_scatter_tangent_p`, whose
    transpose gathers the cotangent once for both gradients, fused with dx's matmul."""
    x, w = primals
    dx, dw = tangents
    out = matmul_reduce_scatter_p.bind(x, w, **params)
    zx, zw = type(dx) is ad.Zero, type(dw) is ad.Zero
    if zx and zw:
        return out, _common.zero_tangent(out)
    if zw:
        return out, matmul_reduce_scatter_p.bind(dx, w, **params)
    if zx:
        return out, matmul_reduce_scatter_p.bind(x, dw, **params)
    return out, matmul_reduce_scatter_tangent_p.bind(dx, dw, x, w, **params)


def _tangent_jvp(primals, tangents, **params):
    """Higher-order autodiff through the tangent primitive: JAX's rules for its reference."""
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(partial(_tangent_reference, **params), tuple(primals), tangents)


def _tangent_batch(args, dims, **params):
    return jax.vmap(partial(_tangent_reference, **params), in_axes=tuple(dims))(*args), 0


ad.defbilinear(matmul_reduce_scatter_p, _transpose_x, _transpose_w)
ad.primitive_jvps[matmul_reduce_scatter_p] = _jvp
ad.primitive_transposes[matmul_reduce_scatter_tangent_p] = _tangent_transpose
ad.primitive_jvps[matmul_reduce_scatter_tangent_p] = _tangent_jvp
batching.primitive_batchers[matmul_reduce_scatter_tangent_p] = _tangent_batch
batching.primitive_batchers[matmul_reduce_scatter_p] = _common.batch_rule(
    matmul_reduce_scatter_p.bind, "scatter_dimension"
)
