// Menu entry 2 of the tile-fused GEMM + reduce-scatter (tile_rs.cu lists the menu): bfloat16,
// w column-major (w^T stored [N, K]), tiles 128x128, clusters 1x2.
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY(e2_wcol, true, 128, 1, 2, false)
