// One hybrid GEMM of tools/probes/tile_stock_probe.cu (hybrid_gemm.cuh).
#include "hybrid_gemm.cuh"
HYBRID_GEMM(hybpp128x128c2x1, 128, 2, 1, true)
