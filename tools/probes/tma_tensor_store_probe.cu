// Probe (issue 23/24, helper V): TMA tensor stores from a 64B-swizzled shared buffer, as the tile
// epilogue's tensor-store path issues them (tile_slab.cuh's store_tensor): is the swizzle the
// shared address's (bits 7-8 XOR bits 4-5 of the absolute address) or the box offset's, for
// buffers 128-, 256-, 512- and 1024-byte aligned; does a box past N (a partial tile) write only
// the columns inside; does the row coordinate reach the second parity block (rows m..2m).
// Build: nvcc -std=c++17 -arch=sm_90a tma_tensor_store_probe.cu -lcuda -o tma_tensor_store_probe
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#define CK(x)                                                                  \
  do {                                                                         \
    cudaError_t e_ = (x);                                                      \
    if (e_) {                                                                  \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      return 1;                                                                \
    }                                                                          \
  } while (0)

// value of element (r, c) of the box: r * 256 + c
__global__ void store_box(const __grid_constant__ CUtensorMap map, int off, int absolute, int x0,
                          int y0) {
  extern __shared__ __align__(1024) unsigned char sm[];
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm) + off;
  const int lane = threadIdx.x;  // 32 lanes: lane -> row lane / 2, pieces 2 (lane & 1) + {0, 1}
  const int row = lane >> 1;
  for (int i = 0; i < 2; ++i) {
    const int piece = 2 * (lane & 1) + i;
    uint32_t addr;
    if (absolute) {
      const uint32_t a = base + row * 64 + piece * 16;
      addr = a ^ (((a >> 7) & 3) << 4);
    } else {
      addr = base + row * 64 + ((piece ^ ((row >> 1) & 3)) << 4);
    }
    uint16_t v[8];
    for (int k = 0; k < 8; ++k) v[k] = (uint16_t)(row * 256 + piece * 8 + k);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr),
                 "r"(v[0] | (v[1] << 16)), "r"(v[2] | (v[3] << 16)), "r"(v[4] | (v[5] << 16)),
                 "r"(v[6] | (v[7] << 16))
                 : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncwarp();
  if (lane == 0) {
    asm volatile(
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(&map),
        "r"(x0), "r"(y0), "r"(base)
        : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}

int main() {
  CK(cudaSetDevice(0));
  cudaDriverEntryPointQueryResult q;
  void* fn = nullptr;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  auto encode = reinterpret_cast<decltype(&cuTensorMapEncodeTiled)>(fn);
  const int N = 40, m = 32;  // rows 2m: two parity blocks
  uint16_t* g;
  CK(cudaMalloc(&g, 2 * m * N * 2));
  CK(cudaFuncSetAttribute(store_box, cudaFuncAttributeMaxDynamicSharedMemorySize, 4096));
  CUtensorMap map;
  cuuint64_t dims[2] = {(cuuint64_t)N, (cuuint64_t)(2 * m)};
  cuuint64_t strides[1] = {(cuuint64_t)N * 2};
  cuuint32_t box[2] = {32, 16}, es[2] = {1, 1};
  CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, g, dims, strides, box, es,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_64B,
                      CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("encode failed %d\n", (int)r);
    return 1;
  }
  bool all = true;
  for (int off : {0, 128, 256, 512, 1024 + 384})
    for (int absolute : {1, 0})
      for (int x0 : {0, 32}) {
        const int y0 = x0 ? m + 16 : 0;  // the second box: parity block 1, partial columns
        CK(cudaMemset(g, 0xff, 2 * m * N * 2));
        store_box<<<1, 32, 4096>>>(map, off, absolute, x0, y0);
        CK(cudaDeviceSynchronize());
        std::vector<uint16_t> h(2 * m * N);
        CK(cudaMemcpy(h.data(), g, h.size() * 2, cudaMemcpyDeviceToHost));
        bool ok = true;
        for (int y = 0; y < 2 * m; ++y)
          for (int x = 0; x < N; ++x) {
            const bool in = y >= y0 && y < y0 + 16 && x >= x0 && x < x0 + 32;
            const uint16_t want = in ? (uint16_t)((y - y0) * 256 + (x - x0)) : 0xffff;
            if (h[y * N + x] != want) ok = false;
          }
        std::printf("offset %4d %-8s box (%2d, %2d): %s\n", off, absolute ? "absolute" : "relative",
                    x0, y0, ok ? "ok" : "WRONG");
        if (absolute && !ok) all = false;
      }
  std::printf("TMA TENSOR STORE PROBE (absolute-address swizzle): %s\n", all ? "PASSED" : "FAILED");
  return all ? 0 : 1;
}
