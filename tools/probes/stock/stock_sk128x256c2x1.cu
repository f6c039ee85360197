// One stock CUTLASS GEMM of tools/probes/tile_stock_probe.cu (stock_gemm.cuh).
#include "stock_gemm.cuh"
STOCK_GEMM(sk128x256c2x1, false, 128, 256, 2, 1, false, true)
