"""The FFI targets of the native extension, each name written once on this side (the other side:
``registrations()`` in ffi/registry.cc). A name is a contract with compiled programs: a change to a
target's operands or attributes is a new target (a new version suffix), never an edit of an old
one (tests/golden/ pins what each one receives).

Each op is named below by its ``_v2`` target; the other names derive from it:

* ``_v3`` (`v3`; issue 26, D17): no order token and no test-only knob -- the production
  attributes only. The lowering emits it while the order is off (the default) and in the
  order's barrier form (`jaxoverlap.fused.call.ORDER_CALLS`, ``ORDER_FORM``).
* ``_v2`` (the constants): the device's order token as the last operand and the last result
  (`FusedOrder`), no knob; the order's token form.
* ``_knobs`` twins (`with_knobs`) of both: the same handler and the same token (or none), plus
  the ``stall_rank`` and ``profile`` attributes; a call lowered under a knob
  (`jaxoverlap.fused.knobs`) goes there.
* ``_v1`` (`v1`): no token, the knobs as attributes of every call -- what the lowering emitted
  before issue 26. Registered unchanged for programs compiled against it (one ABI with
  ``_v3_knobs``: the extension binds both names to one symbol); nothing emits it now.
"""

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
    """The test- and tool-only twin of ``target`` (a ``_v2`` or ``_v3`` name; ffi/registry.cc
    registers both)."""
    return target + KNOBS_SUFFIX


def _version(target, suffix):
    assert target.endswith("_v2"), target
    return target[: -len("_v2")] + suffix


def v1(target):
    """The ``_v1`` target of a ``_v2`` one: no order token, the knobs on every call."""
    return _version(target, "_v1")


def v3(target):
    """The ``_v3`` target of a ``_v2`` one: no order token, no knob (the production target)."""
    return _version(target, "_v3")
