// One hybrid GEMM of tools/probes/tile_stock_probe.cu (hybrid_gemm.cuh).
#include "hybrid_gemm.cuh"
HYBRID_GEMM(hyb128x256c2x1, 256, 2, 1, false)
