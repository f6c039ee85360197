// The tile-fused GEMM + reduce-scatter's host side: what it supports, and the dispatch to the
// instantiations (tile_rs_<dtype>_<w layout>.cu, one kernel per file so they compile in parallel).
#include "kernels/tile_rs.h"

namespace jaxoverlap {

// One per instantiation file.
cudaError_t tile_rs_preload_bf16_wrow();
cudaError_t tile_rs_preload_bf16_wcol();
cudaError_t tile_rs_launch_bf16_wrow(const TileRsArgs& a, cudaStream_t stream);
cudaError_t tile_rs_launch_bf16_wcol(const TileRsArgs& a, cudaStream_t stream);

int64_t tile_rs_tiles_per_block(int64_t m, int64_t N) {
  return (m / kTileM) * ((N + kTileN - 1) / kTileN);
}

int64_t tile_rs_slot_bytes(int64_t m, int64_t N) {
  const int64_t bytes = 2 * m * N * 2 + tile_rs_tiles_per_block(m, N) * kTileSlabs * 4;
  return (bytes + 255) / 256 * 256;
}

std::string tile_rs_unsupported(DType dtype, int n, int64_t m, int64_t N, int64_t K,
                                const void* x, const void* w, const void* out) {
  if (dtype != DType::kBF16) return "the tile schedule is built for bfloat16 only";
  if (n < 2 || n > kMaxRanks) return "the group must have 2 to 8 ranks";
  if (m < kTileRowAlign || m % kTileRowAlign)
    return "the rows per rank must be a positive multiple of " + std::to_string(kTileRowAlign);
  if (N < 8 || N % 8 || K < 8 || K % 8)
    return "N and K must be positive multiples of 8 (16-byte rows for TMA and the epilogue)";
  if ((int64_t)n * m > INT32_MAX || N > INT32_MAX || K > INT32_MAX)
    return "a dimension exceeds the GEMM's 32-bit problem shape";
  if (tile_rs_tiles_per_block(m, N) * n > INT32_MAX / kTileSlabs) return "too many tiles";
  for (const void* p : {x, w, out})
    if (reinterpret_cast<uintptr_t>(p) % 16) return "an operand is not 16-byte aligned (TMA)";
  return "";
}

cudaError_t preload_tile_kernels() {
  if (cudaError_t e = tile_rs_preload_bf16_wrow()) return e;
  return tile_rs_preload_bf16_wcol();
}

cudaError_t launch_tile_rs(const TileRsArgs& a, cudaStream_t stream) {
  if (a.dtype != DType::kBF16) return cudaErrorInvalidValue;
  return a.w_colmajor ? tile_rs_launch_bf16_wcol(a, stream) : tile_rs_launch_bf16_wrow(a, stream);
}

}  // namespace jaxoverlap
