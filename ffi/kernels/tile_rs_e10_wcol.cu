// Tools menu entry 10 (not in the default build; tile_rs.cu, build_tile_rs_probe.sh ENTRIES): the
// ping-pong 128x128 c2x1 kernel (entry 4's) with a static order -- CTA cluster c runs tiles c,
// c + clusters, ... of the claim order (ClaimedTilesVariant<1>: no counter, no ring, the epilogue
// claims nothing) -- for timing against entry 4 inside the same tile kernel (issue 23, session
// 15: what the dynamic claims cost a plain GEMM). Not deadlock-free when a peer's CTAs are not
// all resident (why production claims): never in a selection, w wcol.
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY_SCHED(e10_wcol, true, 128, 2, 1, true, 1)
