// Tools menu entry 7 (not in the default build; tile_rs.cu, build_tile_rs_probe.sh ENTRIES): the
// ping-pong 128x128 c2x1 kernel with the candidate claim path kClaimLatePairs (tile_sched.cuh), w wrow.
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY_SCHED(e7_wrow, false, 128, 2, 1, true, 6)
