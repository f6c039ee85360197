// One stock CUTLASS GEMM of tools/probes/tile_stock_probe.cu (stock_gemm.cuh).
#include "stock_gemm.cuh"
STOCK_GEMM(coop256x128c1x2, false, 256, 128, 1, 2, false, false)
