// Tools menu entry 9 (not in the default build; tile_rs.cu, build_tile_rs_probe.sh ENTRIES): the
// ping-pong 128x128 c2x1 kernel with the candidate claim path kClaimLateSpread (tile_sched.cuh:
// kClaimLate, the own block spread through the claim order), w wrow.
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY_SCHED(e9_wrow, false, 128, 2, 1, true, 7)
