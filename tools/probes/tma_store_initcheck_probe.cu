// One-GPU probe (issue 25 item 3): does compute-sanitizer initcheck see memory written by a TMA
// bulk store (cp.async.bulk.global.shared::cta)? Call E's initcheck reported every 32-byte
// granule of a case's 256 KiB output, which our kernels write that way, as uninitialized when
// copied to the host. Here a 256 KiB buffer (never written before) is written from shared memory
// by mode 0: TMA bulk stores; mode 1: plain st.global of the same bytes. Then a kernel reads it
// back with plain loads and the host copies it (cudaMemcpy) and checks every byte. Under
// initcheck, reports in mode 0 and none in mode 1 mean the tool does not track TMA stores.
//   nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Itools/probes \
//        -o build/probes/tma_store_initcheck_probe tools/probes/tma_store_initcheck_probe.cu
//   tma_store_initcheck_probe MODE      (prints "mode M OK ..." or "mode M FAILED ...")
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

constexpr int kBlocks = 16, kBytes = 16384, kThreads = 256;  // 256 KiB in all

__global__ void write_kernel(int mode, const uint4* src, uint4* dst) {
  __shared__ alignas(128) uint4 buf[kBytes / 16];
  const int base = blockIdx.x * (kBytes / 16);
  for (int i = threadIdx.x; i < kBytes / 16; i += kThreads) buf[i] = src[base + i];
  if (mode == 0) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // smem writes -> async proxy
    __syncthreads();
    if (threadIdx.x == 0) {
      const uint32_t s = (uint32_t)__cvta_generic_to_shared(buf);
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + base),
                   "r"(s), "r"(kBytes)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
  } else {
    __syncthreads();
    for (int i = threadIdx.x; i < kBytes / 16; i += kThreads) dst[base + i] = buf[i];
  }
}

__global__ void read_kernel(const uint32_t* dst, unsigned long long* sum) {
  unsigned long long s = 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < kBlocks * kBytes / 4;
       i += gridDim.x * blockDim.x)
    s += dst[i];
  atomicAdd(sum, s);
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  const size_t n = (size_t)kBlocks * kBytes;
  std::vector<uint32_t> host(n / 4);
  for (size_t i = 0; i < host.size(); ++i) host[i] = (uint32_t)(i * 2654435761u);
  uint4 *src, *dst;
  unsigned long long* sum;
  CK(cudaMalloc(&src, n));
  CK(cudaMalloc(&dst, n));  // never written before write_kernel
  CK(cudaMalloc(&sum, sizeof *sum));
  CK(cudaMemcpy(src, host.data(), n, cudaMemcpyHostToDevice));
  CK(cudaMemset(sum, 0, sizeof *sum));
  write_kernel<<<kBlocks, kThreads>>>(mode, src, dst);
  CK(cudaGetLastError());
  read_kernel<<<8, 256>>>((const uint32_t*)dst, sum);
  CK(cudaGetLastError());
  std::vector<uint32_t> back(n / 4);
  CK(cudaMemcpy(back.data(), dst, n, cudaMemcpyDeviceToHost));
  unsigned long long dev_sum = 0, want_sum = 0;
  CK(cudaMemcpy(&dev_sum, sum, sizeof dev_sum, cudaMemcpyDeviceToHost));
  size_t wrong = 0;
  for (size_t i = 0; i < host.size(); ++i) {
    wrong += back[i] != host[i];
    want_sum += host[i];
  }
  const bool ok = wrong == 0 && dev_sum == want_sum;
  std::printf("mode %d (%s) %s: %zu of %zu words wrong, device sum %s\n", mode,
              mode == 0 ? "TMA bulk stores" : "plain stores", ok ? "OK" : "FAILED", wrong,
              host.size(), dev_sum == want_sum ? "right" : "wrong");
  return ok ? 0 : 1;
}
