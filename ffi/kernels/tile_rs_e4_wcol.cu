// Menu entry 4 of the tile-fused GEMM + reduce-scatter (tile_rs.cu lists the menu): bfloat16,
// w column-major (w^T stored [N, K]), ping-pong, tiles 128x128 per warpgroup, clusters 2x1; each consumer
// warpgroup claims its tile k + 4 after its epilogue of tile k (kClaimLate, tile_sched.cuh).
#include "kernels/tile_rs.cuh"

JAXOVERLAP_TILE_ENTRY_SCHED(e4_wcol, true, 128, 2, 1, true, tile::kClaimLate)
