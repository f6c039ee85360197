// The tile-fused GEMM + reduce-scatter for bfloat16, w column-major (the transpose of a row-major [N, K]).
#include "kernels/tile_rs.cuh"

namespace jaxoverlap {

using TileBf16Wcol = tile::TileKernel<cutlass::bfloat16_t, true>;
cudaError_t tile_rs_preload_bf16_wcol() { return TileBf16Wcol::preload(); }
cudaError_t tile_rs_launch_bf16_wcol(const TileRsArgs& a, cudaStream_t stream) {
  return TileBf16Wcol::launch(a, stream);
}

}  // namespace jaxoverlap
