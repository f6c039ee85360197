// Tools menu entry 6 (not in the default build; tile_rs.cu, build_tile_rs_probe.sh ENTRIES): the
// ping-pong 128x128 c2x1 kernel with entry 4's claim path before session 9 (each warpgroup claims
// tile k + 2 at the start of its epilogue of tile k), for A/B timing against entry 4, w wcol.
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY_SCHED(e6_wcol, true, 128, 2, 1, true, 0)
