// Menu entry 1 of the tile-fused GEMM + reduce-scatter (tile_rs.cu lists the menu): bfloat16,
// w row-major [K, N], tiles 128x256, clusters 1x1.
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY(e1_wrow, false, 256, 1, 1, false)
