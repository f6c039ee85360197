"""The tile schedule of the fused `matmul_reduce_scatter` over rows (``Config(schedule="tile")``).

One persistent CUTLASS GEMM over the whole GPU computes ``x @ w`` tile by tile, the tiles of the
blocks other ranks own first; each tile's epilogue stores it (bf16) straight into its owner's
staging in peer memory and publishes a flag per 16 x 128 piece; the own block's tiles come last,
wait (bounded) for the peers' pieces of the same tile, add them to the f32 accumulators in rank
order and round once. The kernel is one of a menu (tile sizes, clusters), chosen per problem by
timing at its first execution (ffi/kernels/tile_rs.cu). There is no split GEMM, no communication
kernel and no SM partition: the chunked schedule's two measured costs (splitting the GEMM, the
last chunk's push on 4 SMs) are gone by construction (ffi/kernels/tile_rs.h has the protocol,
ffi/handlers/gemm_rs_tile.cc the call).
Which calls take it: `policy.rows_setting` (the config, or the tuner's entry); this module checks
what the kernel supports and describes its call for `call.emit`.

Supported: bfloat16, rows per rank a multiple of 256 (the largest cluster's rows), K and N
multiples of 8, 2..8 GPUs, w row- or column-major (``ct @ w.T`` in a backward), x in rows (any
scattered dimension but the last: the custom call's layout makes it major-most, as for the
chunked schedule). Everything else -- the group table, the workspace key, the failure path, the
call-order guard, processes -- is the other handlers'.
"""

from __future__ import annotations

import numpy as np

from jaxoverlap.fused import call, policy
from jaxoverlap.fused.targets import GEMM_RS_TILE_TARGET as TARGET

ROW_ALIGN = 256  # kTileRowAlign in ffi/kernels/tile_rs.h
FLAG_ROWS, FLAG_COLS = 16, 128  # a flag per 16 x kFlagCols piece of a block (ffi/kernels/tile_rs.h)
# Cluster rows (256 rows of x) per raster band: 8 was as fast as or faster than 1, 2 and 4 on
# each of 10 shapes, timed interleaved on one H200 (docs/measurements.md runs 48-50); up to 6 %
# faster than 4 on the 16384-wide shapes (more reuse of w's tiles in L2).
DEFAULT_SWIZZLE = 8


def unsupported_reason(dtype, m, k, n_cols, n):
    """Why the tile kernel cannot run a reduce-scatter of ``m`` rows per rank, or None."""
    if np.dtype(dtype) != np.dtype("bfloat16"):
        dt = np.dtype(dtype)
        return f"schedule='tile' runs bfloat16 only, not {dt} (schedule='chunked' does)"
    if m % ROW_ALIGN:
        return (
            f"schedule='tile': the rows per rank ({m}) must be a multiple of {ROW_ALIGN} "
            f"(schedule='chunked' needs only 128-element alignment)"
        )
    if k % 8 or n_cols % 8:
        return f"schedule='tile': K={k} and N={n_cols} must be multiples of 8"
    if n * m >= 2**31 or n_cols >= 2**31 or k >= 2**31:
        return "schedule='tile': a dimension exceeds the GEMM's 32-bit problem shape"
    return None


def slot_bytes(m, n_cols):
    """One staging slot as the handler sizes it (tile_rs_slot_bytes in ffi/kernels/tile_rs.cu):
    the m x N block of both epoch parities, then the source's flags; 256-byte aligned."""
    flags = (m // FLAG_ROWS) * (-(-n_cols // FLAG_COLS))
    return -(-(2 * m * n_cols * 2 + flags * 4) // 256) * 256


def lower(ctx, x, w, params, table):
    """The tile schedule's custom call (its workspace: one slot per source)."""
    x_aval, w_aval = ctx.avals_in
    m = policy._rows(x_aval.shape) // table.n
    # xproc maps it across processes; exact (the 4th): the slots' flags sit at a place that moves
    # with the shape, so this workspace is not shared by size class (ffi/runtime/ws_class.h)
    workspace = (slot_bytes(m, w_aval.shape[1]), False, False, True)
    spec = call.row_spec(ctx, params, TARGET, 0, 1, workspace, swizzle=DEFAULT_SWIZZLE)
    return call.emit(ctx, table, spec, x, w)
