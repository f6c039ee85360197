"""What the three op families share: validation, varying-axes typing, lowering dispatch, batching.

Each op module keeps its own order (public function and validation, primitive and abstract eval,
lowering, autodiff and batching, registration) and calls into these helpers for the parts that
are identical across ops.
"""

from __future__ import annotations

import logging
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core
from jax._src import mesh as mesh_lib
from jax.interpreters import ad, mlir

from jaxoverlap import fused
from jaxoverlap.config import DEFAULT, Config
from jaxoverlap.target import tracing_target

log = logging.getLogger("jaxoverlap")

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


# ----------------------------------------------------------------------------- validation


def axis_tuple(op, axis_name):
    """``axis_name`` as a non-empty tuple of names (a name or a tuple/list of names)."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not names:
        raise ValueError(f"jaxoverlap.{op}: axis_name is empty; name the mesh axis to use.")
    if len(set(names)) != len(names):
        raise ValueError(f"jaxoverlap.{op}: axis_name={axis_name!r} names an axis twice.")
    return names


def group_size(op, names):
    """Product of the sizes of the named shard_map axes; clear errors outside shard_map."""
    env = core.get_axis_env()
    manual = mesh_lib.get_abstract_mesh().manual_axes
    for name in names:
        if env.axis_exists(name) and name in manual:
            continue
        if not manual:
            if env.axis_exists(name):
                raise ValueError(
                    f"jaxoverlap.{op}: axis {name!r} is bound, but no shard_map makes it manual "
                    f"here (a vmap/pmap axis, or a custom_partitioning body?). Call the op inside "
                    f"jax.shard_map over a mesh with axis {name!r}."
                )
            raise ValueError(
                f"jaxoverlap.{op}: called outside jax.shard_map (axis {name!r} is not bound). "
                f"Call it inside a function mapped with jax.shard_map(..., mesh=mesh) whose "
                f"mesh has an axis named {name!r}, or use jaxoverlap.matmul for global-view code."
            )
        kind = (
            "bound, but not a manual axis of the enclosing shard_map (a vmap/pmap axis?)"
            if env.axis_exists(name)
            else "not an axis of the mesh"
        )
        raise ValueError(
            f"jaxoverlap.{op}: unknown axis name {name!r} ({kind}). The shard_map axes bound "
            f"here are {tuple(sorted(manual, key=str))}; pass one of them (or a tuple of them)."
        )
    return math.prod(env.axis_size(n) for n in names)


def axis_size(names):
    """Group size from the bound axis environment (abstract eval: validation already ran)."""
    env = core.get_axis_env()
    return math.prod(env.axis_size(n) for n in names)


def check_operands(op, x, w, k_shards=1):
    """Shared checks: ranks, contracting dim and dtypes of ``x [..., K]`` and ``w [K, N]``.

    ``k_shards``: x holds ``K / k_shards`` (all_gather_matmul gathering along K)."""
    xs, ws = jnp.shape(x), jnp.shape(w)
    if len(ws) != 2:
        raise ValueError(
            f"jaxoverlap.{op}: w must have rank 2 ([K, N]) but has shape {ws}. "
            f"Reshape w to 2-D (fold extra dims into N) or vmap over them."
        )
    if len(xs) < 1:
        raise ValueError(f"jaxoverlap.{op}: x must have rank >= 1 ([..., K]) but is a scalar.")
    if xs[-1] * k_shards != ws[0]:
        shards = f" times the group size {k_shards} (x is gathered along K)" if k_shards > 1 else ""
        raise ValueError(
            f"jaxoverlap.{op}: contracting dimensions differ: x has shape {xs} (K={xs[-1]}) but "
            f"w has shape {ws} (K={ws[0]}). The last dim of x{shards} must equal the first dim "
            "of w."
        )
    xd, wd = jnp.result_type(x), jnp.result_type(w)
    for name, dt in (("x", xd), ("w", wd)):
        if not any(dt == np.dtype(s) for s in _SUPPORTED_DTYPES):
            raise TypeError(
                f"jaxoverlap.{op}: {name} has dtype {dt}; supported dtypes are float32, bfloat16, "
                f"float16 and float64. Cast integer inputs to a float dtype first."
            )
    if xd != wd:
        raise TypeError(
            f"jaxoverlap.{op}: x has dtype {xd} but w has dtype {wd}; they must match "
            f"(the result has x's dtype). Cast w with w.astype(x.dtype)."
        )


def normalize_dim(op, what, dim, ndim, allowed, shape):
    """A dimension index in ``range(ndim)`` that must be one of ``allowed``."""
    if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool):
        raise TypeError(f"jaxoverlap.{op}: {what} must be an int, got {dim!r}.")
    d = int(dim) + ndim if dim < 0 else int(dim)
    if d not in allowed:
        raise ValueError(
            f"jaxoverlap.{op}: {what}={dim} is out of range for shape {shape}; valid values are "
            f"{list(allowed)} (or the same counted from the end)."
        )
    return d


def resolve_config(op, config):
    if config is None:
        return DEFAULT
    if not isinstance(config, Config):
        raise TypeError(f"jaxoverlap.{op}: config must be a jaxoverlap.Config, got {config!r}.")
    return config


def check_fused_possible(op, x, w, params, n):
    """``backend="fused"``: fail at trace time when the fused path is ruled out already."""
    if params["config"].backend != "fused":
        return
    reason = fused.unsupported_reason(
        op, core.typeof(x), core.typeof(w), params, n, target=tracing_target()
    )  # (tracing_target: explain's target, while it traces the ops; else None, this machine)
    if reason is not None:
        raise ValueError(f"jaxoverlap.{op}: backend='fused' cannot run here: {reason}")


# ----------------------------------------------------------------------------- varying axes


def vary_operands(x, w, names):
    """Give ``x`` and ``w`` the same varying axes, including the collective's axes.

    The op's result differs across the group, as ``psum_scatter``'s does, so its operands are
    typed as varying over the group (the no-op ``pvary``; its transpose is the ``psum`` that a
    replicated operand's gradient needs).
    """
    x, w = core.auto_insert_reshard(x, w)
    missing = tuple(n for n in names if n not in core.typeof(x).mat.varying)
    if missing:  # a no-op when shard_map runs with check_vma=False
        x, w = core.pvary(x, missing), core.pvary(w, missing)
    return x, w


def operands_vma(op, x, w):
    """The operands' common varying axes (they were made equal by `vary_operands`)."""
    return core.standard_vma_rule(op, x, w)


# ----------------------------------------------------------------------------- abstract eval


def def_abstract_eval(prim, abstract_eval):
    """``abstract_eval`` as ``prim``'s, with the effect every fused primitive has
    (`jaxoverlap.fused.FusedOrder`: its calls on a device run in program order)."""
    prim.def_effectful_abstract_eval(
        lambda *args, **params: (abstract_eval(*args, **params), fused.fused_effects())
    )


# ----------------------------------------------------------------------------- lowering

_logged: set[tuple[str, str]] = set()


def _log_fallback_once(op, reason):
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        log.info("jaxoverlap.%s: running the reference (XLA) path: %s", op, reason)


def register_lowerings(prim, op, reference_fn, keep_gathered=False):
    """Reference lowering on every platform; on CUDA try the fused path first.

    ``keep_gathered``: the primitive is all_gather_matmul's variant with two results, the
    product and the gathered x (``reference_fn`` returns both). ``w_colmajor`` (a param of every
    op) only asks the fused custom call to take w column-major; the reference path ignores it."""

    def reference_lowering(ctx, x, w, *, axis_name, config, w_colmajor, **dims):
        del w_colmajor
        if config.backend == "fused" and "cuda" not in ctx.module_context.platforms:
            raise ValueError(
                f"jaxoverlap.{op}: backend='fused' cannot run here: the fused kernel runs on "
                f"CUDA GPUs, and this computation is compiled for "
                f"{', '.join(ctx.module_context.platforms)}. Use backend='auto' to fall back."
            )
        fn = lambda x, w: reference_fn(x, w, axis_name, **dims)  # noqa: E731
        return mlir.lower_fun(fn, multiple_results=keep_gathered)(ctx, x, w)

    def cuda_lowering(ctx, x, w, **params):
        config = params["config"]
        if config.backend != "xla":
            x_aval, w_aval = ctx.avals_in
            mesh = getattr(ctx.module_context.axis_context, "mesh", None)
            if mesh is None:
                reason = "the op is not lowered inside a jax.shard_map mesh context"
            else:
                n = math.prod(mesh.shape[a] for a in params["axis_name"])
                reason = fused.unsupported_reason(
                    op, x_aval, w_aval, params, n, keep_gathered=keep_gathered
                )
            if reason is None:
                try:
                    return fused.lower(op, ctx, x, w, params, keep_gathered=keep_gathered)
                except fused.FusedUnavailable as e:
                    reason = str(e)
            if config.backend == "fused":
                raise ValueError(f"jaxoverlap.{op}: backend='fused' cannot run here: {reason}")
            _log_fallback_once(op, reason)
        return reference_lowering(ctx, x, w, **params)

    mlir.register_lowering(prim, reference_lowering)
    # Not cached: every fused call gets its own `call_tag` (fused.call._call_tag,
    # ffi/runtime/call_order.h).
    mlir.register_lowering(prim, cuda_lowering, platform="cuda", cacheable=False)


# ----------------------------------------------------------------------------- batching


def batch_rule(bind, dim_name):
    """A batching rule for ``bind(x, w, **params)`` where ``params[dim_name]`` (if any) counts
    the leading dims of x (and of the result, which shares them).

    * only x batched: the batch dim becomes a new leading dim of x, so ``dim_name`` shifts by one;
    * only w batched: ``w[b]`` are laid side by side as ``[K, N*B]`` (N major, B minor) so that
      one op computes every batch element, including a reduce-scatter over the N dimension;
    * both batched: one op per batch element, under ``lax.map``.
    """

    def rule(args, dims, **params):
        x, w = args
        bx, bw = dims
        if bw is None:
            x = jnp.moveaxis(x, bx, 0)
            if dim_name is not None:
                params = {**params, dim_name: params[dim_name] + 1}
            return bind(x, w, **params), 0
        w = jnp.moveaxis(w, bw, 0)
        if bx is None:
            b, k, n = w.shape
            wide = jnp.transpose(w, (1, 2, 0)).reshape(k, n * b)
            out = bind(x, wide, **{**params, "w_colmajor": False})
            out = out.reshape(*out.shape[:-1], out.shape[-1] // b, b)
            return jnp.moveaxis(out, -1, 0), 0
        x = jnp.moveaxis(x, bx, 0)
        return lax.map(lambda xw: bind(xw[0], xw[1], **params), (x, w)), 0

    return rule


def zero_tangent(value):
    """The symbolic zero tangent of ``value`` (jax 0.11 and 0.12)."""
    return ad.Zero(core.typeof(value).to_tangent_aval())


def transposed_w(w, params):
    """``w.T`` for the backward's ``ct @ w.T`` and the params that say how it is stored: the
    transpose of a row-major w is column-major, so the fused kernel reads it in place (cuBLASLt's
    transposed operand) and XLA makes the transpose a bitcast instead of materialising it
    (70B-class gate/up weight: 470 MB per step). Under backend="auto" only once the new kernels
    are allowed (`fused.new_kernels_reason`): the fused ops have not run with it on GPUs yet,
    so auto keeps the materialised transpose they ran with."""
    if params["config"].backend == "auto" and fused.new_kernels_reason():
        return jnp.transpose(w), {**params, "w_colmajor": False}
    return jnp.transpose(w), {**params, "w_colmajor": not params["w_colmajor"]}


def contract_leading(a, b):
    """``sum over the leading dims of a [..., K] and b [..., N]`` -> ``[K, N]`` (dW of a matmul).

    The same dot that JAX's own transpose of ``a @ w`` emits: the operands' dtype in and out
    (GPU GEMMs accumulate bf16/f16 in f32 anyway; f64 stays f64). Asking for an f32 result and
    casting it back, as this did before, made XLA:GPU compile the dW dot as a fusion instead of a
    cuBLAS GEMM (2x H200, docs/measurements.md, run 15).
    """
    lead = tuple(range(a.ndim - 1))
    return lax.dot_general(a, b, ((lead, lead), ((), ())))
