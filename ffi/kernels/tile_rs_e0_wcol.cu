// Menu entry 0 of the tile-fused GEMM + reduce-scatter (tile_rs.cu lists the menu): bfloat16,
// w column-major (w^T stored [N, K]), tiles 128x256, clusters 2x1.
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY(e0_wcol, true, 256, 2, 1, false)
