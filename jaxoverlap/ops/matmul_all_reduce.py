"""``matmul_all_reduce``: ``psum(x @ w)`` as one op (row-parallel layers, replicated output)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax._src import config as jax_config
from jax._src import core
from jax.interpreters import ad, batching

from jaxoverlap import reference
from jaxoverlap.ops import _common
from jaxoverlap.ops.primitives import matmul_all_reduce_p

OP = "matmul_all_reduce"


# ----------------------------------------------------------------------------- public function


def matmul_all_reduce(x, w, axis_name, *, config=None):
    """``lax.psum(jnp.matmul(x, w), axis_name)``.

    Call inside ``jax.shard_map``; shapes are per device.

    Args:
      x: ``[..., K]`` local activations (leading batch dimensions allowed).
      w: ``[K, N]`` local weight shard; same dtype as ``x``.
      axis_name: the mesh axis (or tuple of axes) to sum over.
      config: a `jaxoverlap.Config`; ``None`` means ``Config()``.

    Returns:
      ``[..., N]`` in ``x.dtype``, the same on every device of the group (invariant over
      ``axis_name``): the sum over the group of every device's ``x @ w``.
    """
    names = _common.axis_tuple(OP, axis_name)
    config = _common.resolve_config(OP, config)
    _common.check_operands(OP, x, w)
    n = _common.group_size(OP, names)
    params = dict(axis_name=names, config=config, w_colmajor=False)
    _common.check_fused_possible(OP, x, w, params, n)
    x, w = _common.vary_operands(x, w, names)
    return matmul_all_reduce_p.bind(x, w, **params)


# ----------------------------------------------------------------------------- primitive


def _abstract_eval(x, w, *, axis_name, config, w_colmajor):
    del config, w_colmajor
    vma = _common.operands_vma(OP, x, w) - frozenset(axis_name)
    shape = (*x.shape[:-1], w.shape[1])
    return x.update(shape=shape, manual_axis_type=x.mat.update(varying=vma))


_common.def_abstract_eval(matmul_all_reduce_p, _abstract_eval)


# ----------------------------------------------------------------------------- lowering

_common.register_lowerings(matmul_all_reduce_p, OP, reference.matmul_all_reduce)


# ----------------------------------------------------------------------------- autodiff, batching
# The transpose of a sum over the group hands every device the sum of the cotangents. With
# check_vma=True the cotangent is typed invariant (already that sum) and only needs the no-op
# pvary; with check_vma=False nothing says so, and the transpose is a psum, as for lax.psum.
# What is left is a plain matmul.


def _summed_ct(ct, axis_name):
    if jax_config._check_vma.value:
        return core.pvary(ct, axis_name)
    return lax.psum(ct, axis_name)


def _transpose_x(ct, x, w, *, axis_name, **params):
    del x, params
    return jnp.matmul(_summed_ct(ct, axis_name), jnp.transpose(w))


def _transpose_w(ct, x, w, *, axis_name, **params):
    del w, params
    return _common.contract_leading(x, _summed_ct(ct, axis_name))


ad.defbilinear(matmul_all_reduce_p, _transpose_x, _transpose_w)
batching.primitive_batchers[matmul_all_reduce_p] = _common.batch_rule(
    matmul_all_reduce_p.bind, None
)
