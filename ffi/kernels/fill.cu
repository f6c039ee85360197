#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/fill.h"

namespace jaxoverlap {
namespace {

__device__ float uniform(uint32_t seed, uint64_t i) {
  // A 64-bit mix (splitmix64's finaliser): independent-looking values for consecutive i.
  uint64_t z = i + 0x9e3779b97f4a7c15ull * (seed + 1u);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f;  // 24 bits -> [-1, 1)
}

__global__ void fill_kernel(void* p, int64_t elems, FillType type, uint32_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < elems;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float v = uniform(seed, (uint64_t)i);
    if (type == FillType::kF32)
      static_cast<float*>(p)[i] = v;
    else if (type == FillType::kF16)
      static_cast<__half*>(p)[i] = __float2half(v);
    else
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(v);
  }
}

}  // namespace

cudaError_t launch_fill_uniform(void* p, int64_t elems, FillType type, uint32_t seed,
                                cudaStream_t stream) {
  if (elems <= 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((elems + 255) / 256, 4096);
  fill_kernel<<<(unsigned)blocks, 256, 0, stream>>>(p, elems, type, seed);
  return cudaGetLastError();
}

}  // namespace jaxoverlap
