"""Test-only and tool-only knobs of the fused path, read when an op is lowered
(`jaxoverlap.fused` re-exports them; `jaxoverlap.fused.call.knob_attrs` sends them). Production
calls carry no knob: a call lowered under one goes to its target's ``_knobs`` twin, the same
handler with ``stall_rank`` and ``profile`` attributes (issue 26, D17)."""

from __future__ import annotations

import contextlib
import contextvars

_stall_rank: contextvars.ContextVar[int] = contextvars.ContextVar("stall_rank", default=-1)
_stall_target: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "stall_target", default=None
)
_profile: contextvars.ContextVar[int] = contextvars.ContextVar("profile", default=0)


@contextlib.contextmanager
def _stalled_rank_for_tests(rank: int, target: str | None = None):
    """Test-only: ops lowered inside this block (only the custom calls named ``target``, if
    given) make ``rank`` never signal its pushes, so its peers must time out with an error
    naming it (instead of hanging)."""
    token = _stall_rank.set(int(rank))
    target_token = _stall_target.set(target)
    try:
        yield
    finally:
        _stall_rank.reset(token)
        _stall_target.reset(target_token)


@contextlib.contextmanager
def _failed_rank_for_tests(rank: int):
    """Test-only: ops lowered inside this block make the handler of ``rank`` fail after it
    counted the call (as an out-of-memory or a cuBLASLt error would), while its peers launch:
    every rank must give up that call promptly (abort word, not the timeout)."""
    token = _stall_rank.set(-2 - int(rank))
    try:
        yield
    finally:
        _stall_rank.reset(token)


@contextlib.contextmanager
def _gemm_only_for_tools():
    """Tools only: fused GEMM+RS and AG+GEMM calls lowered inside this block run their GEMM
    schedule without any communication, and `tma_reduce_scatter` pushes without summing (wrong
    results either way), to measure where time goes."""
    token = _profile.set(1)
    try:
        yield
    finally:
        _profile.reset(token)
