// Menu entry 3 of the tile-fused GEMM + reduce-scatter (tile_rs.cu lists the menu): bfloat16,
// w column-major (w^T stored [N, K]), ping-pong, tiles 128x128 per warpgroup, no cluster.
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY(e3_wcol, true, 128, 1, 1, true)
