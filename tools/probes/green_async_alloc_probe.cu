// One-GPU probe (issue 25 item 3): the GEMM runner's candidate timing (ffi/runtime/gemm.cc,
// time_candidates) without cuBLASLt, to run under compute-sanitizer: stream-ordered scratch
// (cudaMallocAsync / cudaFreeAsync), a fill kernel, two timing events, on
//   mode 0: a green-context stream (the GEMM partition's, as the chunked reduce-scatter and the
//           all-reduce plan their GEMMs: ffi/runtime/green_ctx.cc),
//   mode 1: an ordinary stream (as the copy-engine handlers do: XLA's stream),
//   mode 2: the green-context stream with cudaMalloc / cudaFree instead.
// Prints "mode M OK ..." or "mode M FAILED ...": a crash under a tool in mode 0 only points at
// the tool and green contexts, not at our kernels.
//   nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Itools/probes \
//        -o build/probes/green_async_alloc_probe tools/probes/green_async_alloc_probe.cu
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "probe_check.h"

template <typename F>
F sym(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q;
  cudaGetDriverEntryPointByVersion(name, &p, 13000, cudaEnableDefault, &q);
  if (!p) {
    std::printf("FAILED driver symbol %s not found\n", name);
    std::exit(1);
  }
  return reinterpret_cast<F>(p);
}
#define D(name) static auto name##_ = sym<decltype(&name)>(#name)
#define CU(x)                                                                  \
  do {                                                                         \
    if (CUresult r_ = (x)) {                                                   \
      std::printf("FAILED %s -> CUresult %d (line %d)\n", #x, (int)r_, __LINE__); \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

__global__ void fill(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = v + (float)(i % 7);
}

__global__ void check(const float* p, size_t n, float v, int* bad) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    if (p[i] != v + (float)(i % 7)) atomicAdd(bad, 1);
}

static cudaStream_t green_stream() {
  D(cuDeviceGet);
  D(cuDeviceGetDevResource);
  D(cuDevSmResourceSplitByCount);
  D(cuDevResourceGenerateDesc);
  D(cuGreenCtxCreate);
  D(cuGreenCtxStreamCreate);
  CUdevice dev;
  CU(cuDeviceGet_(&dev, 0));
  CUdevResource all, group, rest;
  CU(cuDeviceGetDevResource_(dev, &all, CU_DEV_RESOURCE_TYPE_SM));
  unsigned n = 1;
  CU(cuDevSmResourceSplitByCount_(&group, &n, &all, &rest, 0, 112));  // a GEMM side of 112 SMs
  CUdevResourceDesc desc;
  CUgreenCtx ctx;
  CUstream s;
  CU(cuDevResourceGenerateDesc_(&desc, &group, 1));
  CU(cuGreenCtxCreate_(&ctx, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM));
  CU(cuGreenCtxStreamCreate_(&s, ctx, CU_STREAM_NON_BLOCKING, 0));
  return (cudaStream_t)s;
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  CK(cudaSetDevice(0));
  CK(cudaFree(nullptr));
  cudaStream_t s;
  if (mode == 1)
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  else
    s = green_stream();
  const size_t n = 1 << 20;
  int* bad;
  CK(cudaMalloc(&bad, sizeof(int)));
  CK(cudaMemset(bad, 0, sizeof(int)));
  cudaEvent_t ev[2];
  for (auto& e : ev) CK(cudaEventCreate(&e));
  float ms_total = 0;
  for (int rep = 0; rep < 3; ++rep) {
    float* p = nullptr;
    if (mode == 2)
      CK(cudaMalloc(&p, n * sizeof(float)));
    else
      CK(cudaMallocAsync(&p, n * sizeof(float), s));
    CK(cudaEventRecord(ev[0], s));
    fill<<<64, 256, 0, s>>>(p, n, (float)rep);
    CK(cudaGetLastError());
    check<<<64, 256, 0, s>>>(p, n, (float)rep, bad);
    CK(cudaGetLastError());
    CK(cudaEventRecord(ev[1], s));
    CK(cudaEventSynchronize(ev[1]));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    ms_total += ms;
    if (mode == 2)
      CK(cudaFree(p));
    else
      CK(cudaFreeAsync(p, s));
  }
  CK(cudaStreamSynchronize(s));
  int h_bad = -1;
  CK(cudaMemcpy(&h_bad, bad, sizeof(int), cudaMemcpyDeviceToHost));
  const char* what[] = {"green-context stream, cudaMallocAsync", "ordinary stream, cudaMallocAsync",
                        "green-context stream, cudaMalloc"};
  std::printf("mode %d (%s) %s: %d wrong values, %.3f ms timed\n", mode, what[mode % 3],
              h_bad == 0 ? "OK" : "FAILED", h_bad, ms_total);
  return h_bad == 0 ? 0 : 1;
}
