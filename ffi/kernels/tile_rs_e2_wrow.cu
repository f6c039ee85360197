// Menu entry 2 of the tile-fused GEMM + reduce-scatter (tile_rs.cu lists the menu): bfloat16,
// w row-major [K, N], tiles 128x128, clusters 1x2.
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY(e2_wrow, false, 128, 1, 2, false)
