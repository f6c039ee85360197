"""The fused GPU path: decides whether an op can run fused, and emits its custom call.

Contract with `jaxoverlap/ops/*` (the only callers):

* ``unsupported_reason(op, x, w, params, axis_size)`` is asked at trace time (bind) with the
  per-device avals. It returns ``None`` when nothing known at trace time rules the fused path out,
  else a sentence saying why (no native extension, dtype, alignment, ...). ``backend="fused"``
  raises with that sentence; ``"auto"`` takes the reference path and logs it once.
* ``lower(op, ctx, x, w, params)`` is called from the op's CUDA lowering rule. It returns the
  custom call's results, or raises `FusedUnavailable` with a sentence saying why the fused path
  cannot run here (platform, topology, mesh) -- known only at lowering time.

``op`` is one of ``"matmul_reduce_scatter"``, ``"all_gather_matmul"``, ``"matmul_all_reduce"``;
``params`` is the primitive's params dict (``axis_name`` as a tuple, ``scatter_dimension`` or
``gather_dimension`` where the op has one, ``config``).
"""

from __future__ import annotations


class FusedUnavailable(Exception):
    """The fused path cannot run for this call; the message says why."""


def unsupported_reason(op, x, w, params, axis_size):
    del x, w, params, axis_size
    return f"{op}: the fused GPU kernel is not implemented yet in this version of jaxoverlap"


def lower(op, ctx, x, w, params):
    del ctx, x, w, params
    raise FusedUnavailable(
        f"{op}: the fused GPU kernel is not implemented yet in this version of jaxoverlap"
    )
