// A scheduler variant of tools/probes/tile_stock_probe.cu (hybrid_gemm.cuh, stock_api.h VARIANT_LIST).
#include "hybrid_gemm.cuh"
VARIANT_GEMM(hybv1_128x256c2x1, 256, 2, 1, false, 1)
