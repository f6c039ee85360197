"""The backward of a trained column-parallel layer as one op (internal: autodiff binds it).

For ``y = all_gather(x) @ w`` with a cotangent ``ct`` on y and the gathered x ``g`` kept from the
forward: ``dx = psum_scatter(ct @ w.T [+ e])`` and ``dW = g.T @ ct``, as ``(dx, dW)``; ``e`` (an
optional fourth operand) is the rest of the gathered x's cotangent when it fed other matmuls too.
On GPUs the reduce-scatter runs beside the weight-gradient GEMM (`jaxoverlap.fused.backward`);
elsewhere, and where that cannot run, it is exactly what JAX's own autodiff computes.
"""

from __future__ import annotations

import logging
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core
from jax.interpreters import ad, batching, mlir

from jaxoverlap import fused
from jaxoverlap.ops import _common
from jaxoverlap.ops.primitives import dgrad_rs_wgrad_p

OP = "all_gather_matmul (backward)"
log = logging.getLogger("jaxoverlap")


def _reference(ct, wt, g, *e, axis_name, scatter_dimension, **params):
    del params
    full = jnp.matmul(ct, wt)
    if e:
        full = full + e[0]
    dx = lax.psum_scatter(full, axis_name, scatter_dimension=scatter_dimension, tiled=True)
    return dx, _common.contract_leading(g, ct)


def _abstract_eval(ct, wt, g, *e, axis_name, scatter_dimension, **params):
    del params
    shape = [*ct.shape[:-1], wt.shape[1]]
    shape[scatter_dimension] //= _common.axis_size(axis_name)
    mat = ct.mat.update(varying=core.standard_vma_rule(OP, ct, wt, g, *e))
    dx = ct.update(shape=tuple(shape), manual_axis_type=mat)
    dw = ct.update(shape=(wt.shape[1], wt.shape[0]), manual_axis_type=mat)
    return dx, dw


_common.def_abstract_eval(dgrad_rs_wgrad_p, _abstract_eval)


def _reference_lowering(ctx, ct, wt, g, *e, **params):
    if params["config"].backend == "fused" and "cuda" not in ctx.module_context.platforms:
        raise ValueError(
            f"jaxoverlap.{OP}: backend='fused' cannot run here: the fused kernel runs on CUDA "
            f"GPUs, and this computation is compiled for {', '.join(ctx.module_context.platforms)}."
        )
    return mlir.lower_fun(partial(_reference, **params), multiple_results=True)(ctx, ct, wt, g, *e)


def _cuda_lowering(ctx, ct, wt, g, *e, **params):
    config = params["config"]
    if config.backend != "xla":
        mesh = getattr(ctx.module_context.axis_context, "mesh", None)
        if mesh is None:
            reason = "the op is not lowered inside a jax.shard_map mesh context"
        else:
            n = 1
            for a in params["axis_name"]:
                n *= mesh.shape[a]
            ct_aval, wt_aval = ctx.avals_in[:2]
            reason = fused.backward.unsupported_reason(ct_aval, wt_aval, params, n)
        if reason is None:
            try:
                return fused.backward.lower(ctx, ct, wt, g, *e, params=params)
            except fused.FusedUnavailable as e:
                reason = str(e)
        if config.backend == "fused":
            raise ValueError(f"jaxoverlap.{OP}: backend='fused' cannot run here: {reason}")
        _common._log_fallback_once(OP, reason)
    return _reference_lowering(ctx, ct, wt, g, *e, **params)


mlir.register_lowering(dgrad_rs_wgrad_p, _reference_lowering)
# Not cacheable: every call site gets its own call_tag (fused._call_tag).
mlir.register_lowering(dgrad_rs_wgrad_p, _cuda_lowering, platform="cuda", cacheable=False)


def _jvp(primals, tangents, **params):
    """Linear in ct; higher-order autodiff goes through JAX's rules for the reference."""
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(partial(_reference, **params), tuple(primals), tangents)


def _batch(args, dims, **params):
    return jax.vmap(partial(_reference, **params), in_axes=tuple(dims))(*args), (0, 0)


ad.primitive_jvps[dgrad_rs_wgrad_p] = _jvp
batching.primitive_batchers[dgrad_rs_wgrad_p] = _batch
