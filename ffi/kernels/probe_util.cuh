// Test-only helpers shared by the device probes (kernels/memops_probe.cu,
// kernels/reduce_push_probe.cu): the global timer and a probe's first error.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace jaxoverlap {
namespace {

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A probe's first CUDA error, as "<what>: <CUDA's description>"; true if `e` is one.
struct FirstError {
  std::string& error;
  bool operator()(const char* what, cudaError_t e) const {
    if (error.empty() && e != cudaSuccess) error = std::string(what) + ": " + cudaGetErrorString(e);
    return e != cudaSuccess;
  }
};

}  // namespace
}  // namespace jaxoverlap
