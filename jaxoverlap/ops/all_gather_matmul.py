"""``all_gather_matmul``: ``all_gather(x) @ w`` as one op (column-parallel linear layers)."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching, mlir

from jaxoverlap import fused, reference
from jaxoverlap.ops import _common
from jaxoverlap.ops.primitives import (
    all_gather_matmul_keep_p,
    all_gather_matmul_p,
    all_gather_matmul_tangent_p,
    dgrad_rs_wgrad_p,
    matmul_reduce_scatter_p,
)

OP = "all_gather_matmul"


# ----------------------------------------------------------------------------- public function


def all_gather_matmul(x, w, axis_name, *, gather_dimension=0, config=None):
    """``jnp.matmul(lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True), w)``.

    Call inside ``jax.shard_map``; shapes are per device.

    Args:
      x: ``[..., K]`` local shard of the activations (rank >= 2).
      w: ``[K, N]`` local weight shard; same dtype as ``x``. Or a list/tuple of such weights
        ``[K, N_i]`` (separate Q/K/V projections, SwiGLU's gate and up): x is gathered once and
        multiplied by each, without concatenating the weights (the gather hides behind the
        widest one's GEMM; in training, one reduce-scatter for dx, beside that weight's dW GEMM).
      axis_name: the mesh axis (or tuple of axes) to gather over.
      gather_dimension: which dimension of ``x`` is gathered. Default 0. The last dimension
        (K, which the matmul contracts) is valid too: x is then sharded over K, holds
        ``K / n`` columns, and ``w`` is the whole ``[K, N]``.
      config: a `jaxoverlap.Config`; ``None`` means ``Config()``.

    Returns:
      ``[..., N]`` in ``x.dtype``: the group's ``x`` blocks concatenated along
      ``gather_dimension`` (in rank order), times ``w``. A tuple of such results, one per
      weight, when ``w`` is a list/tuple.
    """
    if isinstance(w, (list, tuple)):
        return _several(x, tuple(w), axis_name, gather_dimension, config)
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


def _several(x, ws, axis_name, gather_dimension, config):
    """``all_gather_matmul(x, [w0, w1, ...])``: the variant that returns the gathered x, with the
    widest weight, then plain matmuls of the gathered x for the others (its autodiff: one
    reduce-scatter of dx for all, `_keep_jvp`)."""
    if not ws:
        raise ValueError(f"jaxoverlap.{OP}: w is an empty list; pass at least one weight.")
    names = _common.axis_tuple(OP, axis_name)
    config = _common.resolve_config(OP, config)
    xs = jnp.shape(x)
    if len(xs) < 2:
        raise ValueError(f"jaxoverlap.{OP}: x must have rank >= 2 ([rows, K]); got shape {xs}.")
    d = _common.normalize_dim(OP, "gather_dimension", gather_dimension, len(xs), range(len(xs)), xs)
    n = _common.group_size(OP, names)
    for w in ws:
        _common.check_operands(OP, x, w, k_shards=n if d == len(xs) - 1 else 1)
    params = dict(axis_name=names, gather_dimension=d, config=config, w_colmajor=False)
    lead = max(range(len(ws)), key=lambda i: jnp.shape(ws[i])[1])
    _common.check_fused_possible(OP, x, ws[lead], params, n)
    if config.backend == "xla":
        gathered = lax.all_gather(x, names, axis=d, tiled=True)
        return tuple(jnp.matmul(gathered, w) for w in ws)
    ws = list(ws)
    for i in range(len(ws)):  # x varies over the union of the weights' axes; each weight too
        x, ws[i] = _common.vary_operands(x, ws[i], names)
    for i in range(len(ws)):
        x, ws[i] = _common.vary_operands(x, ws[i], names)
    out, gathered = all_gather_matmul_keep_p.bind(x, ws[lead], **params)
    return tuple(out if i == lead else jnp.matmul(gathered, w) for i, w in enumerate(ws))


# ----------------------------------------------------------------------------- primitive


def _abstract_eval(x, w, *, axis_name, gather_dimension, config, w_colmajor):
    del config, w_colmajor
    n = _common.axis_size(axis_name)
    shape = [*x.shape[:-1], w.shape[1]]
    if gather_dimension < x.ndim - 1:  # along K the gathered dim is contracted away
        shape[gather_dimension] *= n
    vma = _common.operands_vma(OP, x, w)
    return x.update(shape=tuple(shape), manual_axis_type=x.mat.update(varying=vma))


_common.def_abstract_eval(all_gather_matmul_p, _abstract_eval)

# The variant that also returns the gathered x (`primitives.all_gather_matmul_keep_p`).


def _keep_abstract_eval(x, w, *, axis_name, gather_dimension, **params):
    out = _abstract_eval(x, w, axis_name=axis_name, gather_dimension=gather_dimension, **params)
    shape = list(x.shape)
    shape[gather_dimension] *= _common.axis_size(axis_name)
    return out, x.update(shape=tuple(shape), manual_axis_type=out.mat)


_common.def_abstract_eval(all_gather_matmul_keep_p, _keep_abstract_eval)


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
            return out, _common.zero_tangent(out)
        return out, all_gather_matmul_p.bind(dx, w, **params)
    out, gathered = all_gather_matmul_keep_p.bind(x, w, **params)
    if type(dx) is ad.Zero:
        return out, jnp.matmul(gathered, dw)
    bind = all_gather_matmul_tangent_p.bind
    (out_dot,) = bind(dx, dw, gathered, w, with_dw=True, with_gathered=False, **params)
    return out, out_dot


def _keep_jvp(primals, tangents, **params):
    """The variant's tangents: the op's, and the gathered dx -- with a tangent on x, one
    `all_gather_matmul_tangent_p` for both, so that the cotangents of the product and of the
    gathered x (when it fed other matmuls: several weights, `all_gather_matmul(x, [w0, w1])`)
    reach ONE reduce-scatter (beside dW's GEMM when w is trained)."""
    x, w = primals
    dx, dw = tangents
    out, gathered = all_gather_matmul_keep_p.bind(x, w, **params)
    zx, zw = type(dx) is ad.Zero, type(dw) is ad.Zero
    if zx:
        out_dot = _common.zero_tangent(out) if zw else jnp.matmul(gathered, dw)
        return (out, gathered), (out_dot, _common.zero_tangent(gathered))
    operands = (dx, gathered, w) if zw else (dx, dw, gathered, w)
    dots = all_gather_matmul_tangent_p.bind(*operands, with_dw=not zw, with_gathered=True, **params)
    return (out, gathered), tuple(dots)


def _keep_batch(args, dims, **params):
    """vmap of the variant: the op's own batching rule for the product, a batched gather for x."""

    def both(x, w):
        out = all_gather_matmul_p.bind(x, w, **params)
        axis = params["gather_dimension"]
        return out, lax.all_gather(x, params["axis_name"], axis=axis, tiled=True)

    return jax.vmap(both, in_axes=tuple(dims))(*args), (0, 0)


# The tangent of x and w together (`primitives.all_gather_matmul_tangent_p`): its transpose
# gathers nothing and scatters dx's cotangent once, with dw in one op with dW's GEMM.


def _split(args, with_dw):
    """(dx, dw or None, g, w) from the tangent primitive's operands."""
    return args if with_dw else (args[0], None, *args[1:])


def _tangent_reference(*args, axis_name, gather_dimension, with_gathered, with_dw, **params):
    del params
    dx, dw, g, w = _split(args, with_dw)
    g_dot = lax.all_gather(dx, axis_name, axis=gather_dimension, tiled=True)
    out_dot = jnp.matmul(g_dot, w) + (jnp.matmul(g, dw) if with_dw else 0)
    return (out_dot, g_dot) if with_gathered else (out_dot,)


def _tangent_abstract_eval(*args, with_gathered, with_dw, **params):
    dx, _, g, w = _split(args, with_dw)
    out = _abstract_eval(dx, w, **params)
    return (out, g.update(manual_axis_type=out.mat)) if with_gathered else (out,)


_common.def_abstract_eval(all_gather_matmul_tangent_p, _tangent_abstract_eval)
mlir.register_lowering(
    all_gather_matmul_tangent_p, mlir.lower_fun(_tangent_reference, multiple_results=True)
)


def _tangent_transpose(cts, *args, gather_dimension, with_gathered, with_dw, **params):
    """(dx, dW) = (psum_scatter(ct @ w.T + ct_g), g.T @ ct): one op where it scatters rows and
    dW is wanted, which runs the reduce-scatter beside dW's GEMM on GPUs
    (`jaxoverlap.ops.dgrad_rs_wgrad`); else the sibling matmul_reduce_scatter (one XLA
    reduce-scatter when ct_g is not zero) and a plain GEMM. ct_g: the gathered dx's cotangent."""
    dx, dw, g, w = _split(args, with_dw)
    ct, ct_g = cts[0], cts[1] if with_gathered else ad.Zero(g.aval)
    linear = (dx, dw) if with_dw else (dx,)
    undefined = [ad.is_undefined_primal(v) for v in linear]
    zero = [ad.Zero(v.aval) if u else None for v, u in zip(linear, undefined, strict=True)]
    axis = params["axis_name"]
    scatter = partial(lax.psum_scatter, axis_name=axis, scatter_dimension=gather_dimension)
    extra = [] if type(ct_g) is ad.Zero else [ad.instantiate_zeros(ct_g)]

    def result(dx_ct, dw_ct):
        cts_in = [dx_ct if undefined[0] else None]
        if with_dw:
            cts_in.append(dw_ct if undefined[1] else None)
        return cts_in + [None, None]

    if type(ct) is ad.Zero:
        return result(scatter(extra[0], tiled=True) if extra else zero[0], zero[-1])
    wt, params = _common.transposed_w(w, params)
    # Until the backward op has run on GPUs, auto keeps the sibling matmul_reduce_scatter for dx
    # (fused where it wins, as before) and a plain GEMM for dW (fused.new_kernels_reason) --
    # unless this machine's tuner measured the backward op faster for this shape.
    sibling = params["config"].backend == "auto" and fused.new_kernels_reason() is not None
    if sibling and with_dw:
        sibling = fused.new_kernels_reason(_measured(ct, wt, params)) is not None
    if with_dw and gather_dimension < ct.ndim - 1 and not sibling:
        params = {**params, "scatter_dimension": gather_dimension}
        return result(*dgrad_rs_wgrad_p.bind(ct, wt, g, *extra, **params))
    if extra:  # one reduce-scatter for both, as plain JAX (XLA's)
        dx_ct = scatter(jnp.matmul(ct, wt) + extra[0], tiled=True)
    else:
        dx_ct = matmul_reduce_scatter_p.bind(ct, wt, scatter_dimension=gather_dimension, **params)
    return result(dx_ct, _common.contract_leading(g, ct) if with_dw else None)


def _measured(ct, wt, params):
    """The tuner's entry for the column-parallel backward of ct[..., N] and w.T [N, K], if a
    tuner that tries every kernel measured it here (`fused.policy.measured`), else None."""
    n = _common.axis_size(params["axis_name"])
    rows, (n_cols, k) = math.prod(ct.shape[:-1]), wt.shape
    return fused.policy.measured(fused.policy.BACKWARD, rows, k, n_cols, ct.dtype, n)


def _tangent_jvp(primals, tangents, **params):
    """Higher-order autodiff through the tangent primitive: JAX's rules for its reference."""
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(partial(_tangent_reference, **params), tuple(primals), tangents)


def _tangent_batch(args, dims, **params):
    out = jax.vmap(partial(_tangent_reference, **params), in_axes=tuple(dims))(*args)
    return out, (0,) * len(out)


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
