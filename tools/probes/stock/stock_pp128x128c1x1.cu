// One stock CUTLASS GEMM of tools/probes/tile_stock_probe.cu (stock_gemm.cuh).
#include "stock_gemm.cuh"
STOCK_GEMM(pp128x128c1x1, false, 128, 128, 1, 1, true, false)
