// Tools menu entry 5 (not in the default build; tile_rs.cu, build_tile_rs_probe.sh ENTRIES): the
// ping-pong 128x128 c2x1 kernel with the candidate claim path kClaimPairs (tile_sched.cuh), w wcol.
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY_SCHED(e5_wcol, true, 128, 2, 1, true, 4)
