"""`overlap`: give unchanged shard_map code the jaxoverlap ops. `explain`: say what it did.

``jaxoverlap.overlap(fn)`` traces ``fn`` to a jaxpr, replaces every matmul/collective pair that a
jaxoverlap op computes exactly (see `jaxoverlap.rewrite.patterns` for the rules), and evaluates
the rewritten jaxpr under whatever transformation is active. The result is an ordinary function:
``jax.jit``, ``jax.grad`` and ``jax.vmap`` compose with it from outside, and ``fn`` may itself use
them (and ``lax.scan``, ``jax.checkpoint``, nested calls) around or inside ``jax.shard_map``.
"""

from __future__ import annotations

import functools
import re
import sys
from collections import Counter

import jax
from jax._src import core

from jaxoverlap import target as target_lib
from jaxoverlap.config import Config
from jaxoverlap.rewrite import Candidate, rewrite_closed_jaxpr

__all__ = ["Candidate", "explain", "overlap"]


def overlap(fn=None, *, config: Config | None = None):
    """Return a function that computes ``fn`` with the jaxoverlap ops substituted.

    Replaced, inside ``jax.shard_map`` (at any depth; or when the returned function is itself
    called inside a shard_map body):

    * ``lax.psum_scatter(x @ w, axes, scatter_dimension=d, tiled=True)``
      -> ``matmul_reduce_scatter(x, w, axes, scatter_dimension=d)``
    * ``lax.all_gather(x, axes, axis=d, tiled=True) @ w``
      -> ``all_gather_matmul(x, w, axes, gather_dimension=d)``
    * ``lax.psum(x @ w, axes)`` -> ``matmul_all_reduce(x, w, axes)``

    where ``x @ w`` is any ``jnp.matmul``/``jnp.dot``/``@``/``einsum``/``lax.dot_general`` that
    contracts the last dimension of ``x [..., K]`` with the first of a 2-D ``w [K, N]`` (or the
    last of a ``w [N, K]``, which the op then receives transposed), in a
    float dtype, at default precision, with no ``preferred_element_type`` other than the operand
    dtype, and whose intermediate result is used by nothing else. Anything else is left exactly as
    written; `explain` lists every candidate with the reason it was or was not replaced.

    Args:
      fn: the function to transform. Its arguments are pytrees of arrays (close over static
        values with ``functools.partial``).
      config: the `jaxoverlap.Config` given to every substituted op (``None``: defaults).

    Returns:
      A function with ``fn``'s signature and results. Usable as ``@overlap`` or
      ``@overlap(config=...)``.
    """
    if fn is None:
        return functools.partial(overlap, config=config)
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"jaxoverlap.overlap: config must be a jaxoverlap.Config, got {config!r}.")
    if not callable(fn):
        raise TypeError(f"jaxoverlap.overlap: expected a function, got {fn!r}.")

    def rewritten(*args, **kwargs):
        closed, out_tree, flat_args = _trace(fn, args, kwargs)
        closed, _ = rewrite_closed_jaxpr(closed, config)
        out = core.eval_jaxpr(closed.jaxpr, closed.consts, *flat_args)
        return jax.tree.unflatten(out_tree, out)

    # Called eagerly, go through jit: the rewritten jaxpr is new on every trace, so its inner
    # jit calls would otherwise be recompiled on every call. (fn is traced either way.)
    cached = jax.jit(rewritten)

    @functools.wraps(fn)
    def overlapped(*args, **kwargs):
        if core.trace_state_clean():
            return cached(*args, **kwargs)
        return rewritten(*args, **kwargs)

    overlapped._jaxoverlap_wrapped = (fn, config)
    return overlapped


def explain(
    fn,
    *args,
    verbose: bool = True,
    target=None,
    tuning_cache: str | None = None,
    config: Config | None = None,
    **kwargs,
) -> list[Candidate]:
    """Print and return one `Candidate` per matmul/collective pair `overlap` finds in ``fn``.

    Traces ``fn(*args, **kwargs)`` (nothing is computed; arguments may be arrays or
    ``jax.ShapeDtypeStruct``) and reports, for each pair, the op that would replace it and whether
    it is replaced, or why not; for each rewrite, what it moved or reshaped and the path its CUDA
    lowering takes on the target (fused and why -- a tuned entry, the untuned rule or
    ``backend='fused'`` -- or XLA's path and why), decided by the function the lowering calls
    (`jaxoverlap.fused.unsupported_reason`, and the check of the group's devices) under the same
    ``Config`` and environment; near misses (an equation between the pair) with that equation, and
    how to move it only where the moved program computes the same values (exactly, or within
    rounding where the move reorders a sum or rounds a scale once: the advice says which). It ends
    with one summary line per path and per reason. ``verbose=False`` folds the out-of-scope skips
    (e.g. FSDP weight gathers) into one line. ``fn`` may be a function returned by `overlap`; its
    config is used (else ``config``). Call it where you would call ``fn``: for a shard_map body,
    from inside the shard_map.

    ``target``: the machine to decide for: None -- this machine's GPUs, or, where it has none
    (or no native extension), ``"2xH200"``; a name ``"<n>x<GPU>"`` (``"8xH100"``): n Hopper GPUs
    of one process joined by NVLink, a prediction; or a `jaxoverlap.target.Target`.
    ``tuning_cache``: a tuning cache file to decide from (e.g. the cluster's
    ``~/.cache/jaxoverlap/tune-*.json``, copied to a laptop).
    """
    fn, wrapped = getattr(fn, "_jaxoverlap_wrapped", (fn, None))
    config = wrapped or config
    where = target_lib.resolve(target, tuning_cache)
    closed, _, _ = _trace(fn, args, kwargs)
    _, candidates = rewrite_closed_jaxpr(closed, config, where)
    name = getattr(fn, "__name__", repr(fn))
    shown = [c for c in candidates if verbose or c.kind != "out of scope"]
    lines = [str(c) for c in shown] or [
        "no candidates: no matmul feeds a psum_scatter or psum, and no all_gather feeds a matmul, "
        "inside jax.shard_map"
    ]
    if len(shown) < len(candidates):
        lines.append(f"({len(candidates) - len(shown)} out-of-scope skips folded; verbose=True "
                     "lists them)")  # fmt: skip
    rewritten = sum(c.rewritten for c in candidates)
    print(f"jaxoverlap.explain({name}): {rewritten} of {len(candidates)} candidates rewritten; "
          f"GPU paths for {where.describe()}")  # fmt: skip
    print("\n".join([*lines, *summary(candidates)]), file=sys.stdout)
    return candidates


_SOURCE = re.compile(r" \([^()]*:\d+(:\d+)?( \([^()]*\))?\)")  # " (file.py:12:3 (fn))"


def summary(candidates) -> list[str]:
    """One line per GPU path of the rewrites and per reason of the skips (source lines left
    out, so that one reason at many places is one line), most frequent first."""
    paths = Counter(c.path for c in candidates if c.rewritten)
    skips = Counter((c.kind, _SOURCE.sub("", c.reason)) for c in candidates if not c.rewritten)
    out = ["summary:"] if candidates else []
    out += [f"  {k:3d} rewritten, GPU path {p}" for p, k in paths.most_common()]
    out += [f"  {k:3d} {kind if kind != 'candidate' else 'skipped'}: {why}"
            for (kind, why), k in skips.most_common()]  # fmt: skip
    return out


def _trace(fn, args, kwargs):
    """``fn``'s closed jaxpr, its output tree, and the flat arguments in jaxpr order."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
    flat_args = jax.tree.leaves((args, kwargs))
    if len(flat_args) != len(closed.jaxpr.invars):
        raise TypeError(
            f"jaxoverlap.overlap: {getattr(fn, '__name__', fn)} takes {len(flat_args)} array "
            f"leaves but traced to {len(closed.jaxpr.invars)} inputs; pass arrays only (bind "
            "static arguments with functools.partial)."
        )
    return closed, jax.tree.structure(out_shape), flat_args
