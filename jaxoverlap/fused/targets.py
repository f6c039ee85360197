"""The FFI targets of the native extension, each name written once on this side (the other side:
``registrations()`` in ffi/registry.cc). A name is a contract with compiled programs: a change to a
target's operands or attributes is a new ``_v2`` target, never an edit of a ``_v1``
(tests/golden/custom_calls.json pins what each one receives).

The ``_v2`` targets (issue 26) take the device's order token as their last operand and return one
as their last result (`jaxoverlap.fused.call`, `FusedOrder`), and carry no test-only knob (D17):
a call lowered under a knob (`jaxoverlap.fused.knobs`) goes to the target's ``_knobs`` twin
(`with_knobs`), the same handler with ``stall_rank`` and ``profile`` attributes. The ``_v1``
targets (no token; the knobs as attributes of every call) stay registered, unchanged: the lowering
emits them while the order token is off (the default, `jaxoverlap.fused.call.ORDER_CALLS`), and
programs compiled against them keep working."""

from __future__ import annotations

GEMM_RS_TARGET = "jaxoverlap_gemm_rs_v2"  # GEMM + reduce-scatter over rows (SM partition)
GEMM_AR_TARGET = "jaxoverlap_gemm_ar_v2"  # the same schedule, the reduced rows gathered too
GEMM_RS_CE_TARGET = "jaxoverlap_gemm_rs_ce_v2"  # comm_sms=0: copy-engine pushes, no partition
GEMM_RS_TILE_TARGET = "jaxoverlap_gemm_rs_tile_v2"  # schedule="tile" (fused/tile.py)
AG_GEMM_TARGET = "jaxoverlap_ag_gemm_v2"  # all-gather + GEMM over rows
AG_GEMM_KEEP_TARGET = "jaxoverlap_ag_gemm_keep_v2"  # also returns the gathered x
AG_K_TARGET = "jaxoverlap_ag_gemm_k_v2"  # all-gather along K (fused/last_dim.py)
DGRAD_RS_WGRAD_TARGET = "jaxoverlap_dgrad_rs_wgrad_v2"  # the column-parallel backward
DGRAD_RS_WGRAD_ACC_TARGET = "jaxoverlap_dgrad_rs_wgrad_acc_v2"  # with e[M, K] added to ct @ w.T
RS_TARGET = "jaxoverlap_rs_v2"  # the standalone TMA reduce-scatter (fused/tma.py)

ALL = (
    GEMM_RS_TARGET,
    GEMM_AR_TARGET,
    GEMM_RS_CE_TARGET,
    GEMM_RS_TILE_TARGET,
    AG_GEMM_TARGET,
    AG_GEMM_KEEP_TARGET,
    AG_K_TARGET,
    DGRAD_RS_WGRAD_TARGET,
    DGRAD_RS_WGRAD_ACC_TARGET,
    RS_TARGET,
)

KNOBS_SUFFIX = "_knobs"


def with_knobs(target):
    """The test- and tool-only twin of ``target`` (ffi/registry.cc registers both)."""
    return target + KNOBS_SUFFIX


def v1(target):
    """The ``_v1`` target of a ``_v2`` one: no order token, the knobs on every call."""
    assert target.endswith("_v2"), target
    return target[: -len("_v2")] + "_v1"
