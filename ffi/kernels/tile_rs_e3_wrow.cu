// Menu entry 3 of the tile-fused GEMM + reduce-scatter (tile_rs.cu lists the menu): bfloat16,
// w row-major [K, N], ping-pong, tiles 128x128 per warpgroup, no cluster.
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY(e3_wrow, false, 128, 1, 1, true)
