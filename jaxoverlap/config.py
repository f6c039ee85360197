"""`Config`: the knobs of one jaxoverlap call.

A `Config` is a primitive parameter, so it must be hashable and immutable: two calls with equal
configs share a jit cache entry, and nothing outside it (no environment variable, no global) may
change what a call computes or how it communicates.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

Backend = Literal["auto", "xla", "fused"]
_BACKENDS = ("auto", "xla", "fused")
Schedule = Literal["chunked", "tile"]
_SCHEDULES = (None, "chunked", "tile")
DEFAULT_TIMEOUT_S = 100.0
MAX_TIMEOUT_S = 86400.0  # one day; the kernels count nanoseconds in 64 bits


def check_timeout(where: str, timeout_s) -> float:
    """``timeout_s`` as a float, or ValueError naming ``where`` unless it is a finite number in
    (0, MAX_TIMEOUT_S]."""
    ok = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
    if not (ok and math.isfinite(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(
            f"{where}: timeout_s={timeout_s!r} must be a finite number of seconds in "
            f"(0, {MAX_TIMEOUT_S:g}] (default {DEFAULT_TIMEOUT_S:g}); a wait without a bound "
            f"would hang on a stalled peer instead of failing."
        )
    return float(timeout_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """How a jaxoverlap op runs. Every field has a default that is right for most users.

    Attributes:
      backend: ``"auto"`` runs the fused GPU kernel where it is supported and measured to be
        faster, else the reference lax composition (and logs once why). ``"fused"`` insists on
        the fused kernel and raises, naming the reason, where it cannot run. ``"xla"`` always
        runs the reference composition (XLA's own GEMM and NCCL collective).
      comm_sms: SMs given to the communication partition of the GPU (the GEMM gets the rest).
        ``0``: no partition, the copy engine moves the data (``matmul_reduce_scatter``; the
        other ops ignore it). ``None`` picks the measured default for the shape.
      chunks: sub-chunks each rank's row block is split into, to shorten pipeline fill and
        drain. ``None`` picks the measured default.
      timeout_s: bound, in seconds, on every cross-GPU wait. A peer that does not signal within
        this time makes the call give up on every rank instead of hanging: the outputs of the
        ranks that gave up are NaN, and `jaxoverlap.check_errors()` (or else the next fused
        call) raises an error naming the op, rank, peer and chunk. The default, 100 s, is
        DeepEP's (PyTorch's NCCL watchdog waits 10 min): a healthy fused call takes
        milliseconds, so 100 s still surfaces a real hang within two minutes, while a profiler,
        compute-sanitizer, MPS time-slicing or a debugger that pauses one GPU for seconds does
        not trip it. Finite, positive, at most `MAX_TIMEOUT_S`.
      deterministic: add partial sums in a fixed order, so equal inputs give equal bits on every
        run. ``False`` allows arrival-order reductions where a kernel offers them; today's
        kernels always reduce in a fixed order, so it changes nothing yet.
      schedule: how the fused ``matmul_reduce_scatter`` over rows overlaps its GEMM and its
        reduce-scatter (the other ops, and the scatter of the last dimension, ignore it).
        ``"chunked"``: the GEMM in chunks of rows, each pushed to its owner as it is done by a
        communication partition of ``comm_sms`` SMs (or the copy engine, ``comm_sms=0``).
        ``"tile"``: one persistent GEMM over the whole GPU whose epilogue stores each tile
        straight into its owner's memory, the tiles other ranks wait for first; no split GEMM
        and no communication SMs (bfloat16, rows per rank a multiple of 256). ``None``: what
        the tuner measured best for the shape, else ``"chunked"``.
    """

    backend: Backend = "auto"
    comm_sms: int | None = None
    chunks: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    deterministic: bool = True
    schedule: Schedule | None = None

    def __post_init__(self):
        if self.backend not in _BACKENDS:
            raise ValueError(
                f"jaxoverlap.Config: backend={self.backend!r} is not one of {_BACKENDS}."
            )
        if self.comm_sms is not None and (not isinstance(self.comm_sms, int) or self.comm_sms < 0):
            raise ValueError(
                f"jaxoverlap.Config: comm_sms={self.comm_sms!r} must be an int >= 0 (0: the copy "
                "engine) or None."
            )
        if self.chunks is not None and (not isinstance(self.chunks, int) or self.chunks < 1):
            raise ValueError(
                f"jaxoverlap.Config: chunks={self.chunks!r} must be a positive int or None."
            )
        check_timeout("jaxoverlap.Config", self.timeout_s)
        if not isinstance(self.deterministic, bool):
            raise ValueError(
                f"jaxoverlap.Config: deterministic={self.deterministic!r} must be a bool."
            )
        if self.schedule not in _SCHEDULES:
            raise ValueError(
                f"jaxoverlap.Config: schedule={self.schedule!r} is not one of {_SCHEDULES}."
            )


DEFAULT = Config()
