// The tile-fused GEMM + reduce-scatter for bfloat16, w row-major [K, N].
#include "kernels/tile_rs.cuh"

namespace jaxoverlap {

using TileBf16Wrow = tile::TileKernel<cutlass::bfloat16_t, false>;
cudaError_t tile_rs_preload_bf16_wrow() { return TileBf16Wrow::preload(); }
cudaError_t tile_rs_launch_bf16_wrow(const TileRsArgs& a, cudaStream_t stream) {
  return TileBf16Wrow::launch(a, stream);
}

}  // namespace jaxoverlap
