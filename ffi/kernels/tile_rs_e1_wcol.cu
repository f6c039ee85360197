// Menu entry 1 of the tile-fused GEMM + reduce-scatter (tile_rs.cu lists the menu): bfloat16,
// w column-major (w^T stored [N, K]), tiles 128x256, clusters 1x1.
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY(e1_wcol, true, 256, 1, 1, false)
