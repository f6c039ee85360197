// Menu entry 4 of the tile-fused GEMM + reduce-scatter (tile_rs.cu lists the menu): bfloat16,
// w column-major (w^T stored [N, K]), ping-pong, tiles 128x128 per warpgroup, clusters 2x1.
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY(e4_wcol, true, 128, 2, 1, true)
