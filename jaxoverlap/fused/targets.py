"""The FFI targets of the native extension, each name written once on this side (the other side:
``registrations()`` in ffi/registry.cc). A name is a contract with compiled programs: a change to a
target's operands or attributes is a new ``_v2`` target, never an edit of a ``_v1``
(tests/golden/custom_calls.json pins what each one receives)."""

from __future__ import annotations

GEMM_RS_TARGET = "jaxoverlap_gemm_rs_v1"  # GEMM + reduce-scatter over rows (SM partition)
GEMM_AR_TARGET = "jaxoverlap_gemm_ar_v1"  # the same schedule, the reduced rows gathered too
GEMM_RS_CE_TARGET = "jaxoverlap_gemm_rs_ce_v1"  # comm_sms=0: copy-engine pushes, no partition
GEMM_RS_TILE_TARGET = "jaxoverlap_gemm_rs_tile_v1"  # schedule="tile" (fused/tile.py)
AG_GEMM_TARGET = "jaxoverlap_ag_gemm_v1"  # all-gather + GEMM over rows
AG_GEMM_KEEP_TARGET = "jaxoverlap_ag_gemm_keep_v1"  # also returns the gathered x
AG_K_TARGET = "jaxoverlap_ag_gemm_k_v1"  # all-gather along K (fused/last_dim.py)
DGRAD_RS_WGRAD_TARGET = "jaxoverlap_dgrad_rs_wgrad_v1"  # the column-parallel backward
DGRAD_RS_WGRAD_ACC_TARGET = "jaxoverlap_dgrad_rs_wgrad_acc_v1"  # with e[M, K] added to ct @ w.T
RS_TARGET = "jaxoverlap_rs_v1"  # the standalone TMA reduce-scatter (fused/tma.py)

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
