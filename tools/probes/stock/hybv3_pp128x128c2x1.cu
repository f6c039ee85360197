// A scheduler variant of tools/probes/tile_stock_probe.cu (hybrid_gemm.cuh, stock_api.h VARIANT_LIST).
#include "hybrid_gemm.cuh"
VARIANT_GEMM(hybv3_pp128x128c2x1, 128, 2, 1, true, 3)
