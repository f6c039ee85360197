"""The fused GPU path: whether an op can run fused, and its custom call. Re-exports only.

Modules, in import order (each imports only those above it):

* `knobs` (test-only and tool-only context variables), `targets` (the 10 FFI target names),
  `cache` (the tuner's cache on disk; `tuned` is the policy's reading of it);
* `call` (one custom call, emitted in one place: `call.emit`; the group table, the workspace
  key, the call tag, the layouts), `policy` (when the fused path runs and with which settings:
  the rules, the tuner's entries, chunks);
* the schedules, which decide *what* a call is from `policy` and hand it to `call.emit`:
  `tile` (the reduce-scatter's tile schedule), `last_dim` (scatter N, gather K), `backward`
  (the column-parallel backward), `tma` (the standalone TMA reduce-scatter); then `rows`
  (reduce-scatter, all-reduce and all-gather over rows; the tile schedule through `tile`),
  and beside it `tuning` (what `jaxoverlap.tune` tries per op and how it decides);
* `dispatch`: ``unsupported_reason`` (trace time; also ``explain``'s answer) and ``lower``.

``jaxoverlap.fused.<name>`` keeps every name the single module ``fused.py`` had. Patch a
decision where it lives (``fused.policy.tuned``, ``fused.policy.AUTO_NEW_KERNELS``): the
names here are references taken at import.
"""

from jaxoverlap.fused import (
    backward,
    cache,
    call,
    dispatch,
    knobs,
    last_dim,
    policy,
    rows,
    targets,
    tile,
    tuning,
)
from jaxoverlap.fused.call import (
    FUSED_EFFECTS,
    FusedOrder,
    FusedUnavailable,
    _call_tag,
    _group_table,
    _operands_kind,
    _table_attrs,
    emit,
    emitted,
    fused_effects,
    group_decision,
    row_dim,
    rows_major,
    site_key,
)
from jaxoverlap.fused.dispatch import lower, unsupported_reason
from jaxoverlap.fused.knobs import (
    _failed_rank_for_tests,
    _gemm_only_for_tools,
    _profile,
    _stall_rank,
    _stall_target,
    _stalled_rank_for_tests,
)
from jaxoverlap.fused.policy import (
    _AG_AUTO_MIN,
    _AUTO_MAX_K,
    _AUTO_MIN,
    _DEFAULT_SETTING,
    _FUSED_OPS,
    _SUPPORTED,
    AUTO_NEW_KERNELS,
    DEFAULT_COMM_SMS,
    MAX_CHUNKS,
    _aligned,
    _auto_reason,
    _rows,
    ag_auto_predicts_win,
    auto_predicts_win,
    choose_chunks,
    new_kernels_reason,
    schedule_of,
    tuned,
    tuned_setting,
)
from jaxoverlap.fused.targets import (
    AG_GEMM_KEEP_TARGET,
    AG_GEMM_TARGET,
    AG_K_TARGET,
    DGRAD_RS_WGRAD_ACC_TARGET,
    DGRAD_RS_WGRAD_TARGET,
    GEMM_AR_TARGET,
    GEMM_RS_CE_TARGET,
    GEMM_RS_TARGET,
    GEMM_RS_TILE_TARGET,
    RS_TARGET,
)

__all__ = [
    "AG_GEMM_KEEP_TARGET",
    "AG_GEMM_TARGET",
    "AG_K_TARGET",
    "AUTO_NEW_KERNELS",
    "DEFAULT_COMM_SMS",
    "DGRAD_RS_WGRAD_ACC_TARGET",
    "DGRAD_RS_WGRAD_TARGET",
    "GEMM_AR_TARGET",
    "GEMM_RS_CE_TARGET",
    "GEMM_RS_TARGET",
    "GEMM_RS_TILE_TARGET",
    "MAX_CHUNKS",
    "RS_TARGET",
    "FUSED_EFFECTS",
    "fused_effects",
    "FusedOrder",
    "FusedUnavailable",
    "_AG_AUTO_MIN",
    "_AUTO_MAX_K",
    "_AUTO_MIN",
    "_DEFAULT_SETTING",
    "_FUSED_OPS",
    "_SUPPORTED",
    "_aligned",
    "_auto_reason",
    "_call_tag",
    "_failed_rank_for_tests",
    "_gemm_only_for_tools",
    "_group_table",
    "_operands_kind",
    "_profile",
    "_rows",
    "_stall_rank",
    "_stall_target",
    "_stalled_rank_for_tests",
    "_table_attrs",
    "ag_auto_predicts_win",
    "auto_predicts_win",
    "backward",
    "cache",
    "call",
    "choose_chunks",
    "dispatch",
    "emit",
    "emitted",
    "group_decision",
    "knobs",
    "last_dim",
    "lower",
    "new_kernels_reason",
    "policy",
    "row_dim",
    "rows",
    "rows_major",
    "schedule_of",
    "site_key",
    "targets",
    "tile",
    "tuning",
    "tuned",
    "tuned_setting",
    "unsupported_reason",
]
