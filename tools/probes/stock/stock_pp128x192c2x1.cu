// One stock CUTLASS GEMM of tools/probes/tile_stock_probe.cu (stock_gemm.cuh).
#include "stock_gemm.cuh"
STOCK_GEMM(pp128x192c2x1, false, 128, 192, 2, 1, true, false)
