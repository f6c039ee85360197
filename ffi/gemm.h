// cuBLASLt GEMM driver: row-major D[m, n] = A[m, k] . B[k, n] (+ C[m, n]), f32 accumulation,
// targeted at the SM count of the partition it runs on. One per device; plans cached by shape.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>

#include "kernels/comm.h"

namespace jaxoverlap {

struct GemmShape {
  int64_t m, n, k;
  DType dtype;
  bool accumulate;  // D = A.B + C (beta = 1) instead of D = A.B
  int sm_count;     // CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET (0: whole device)
  auto key() const { return std::make_tuple(m, n, k, (int)dtype, accumulate, sm_count); }
};

class GemmRunner {
 public:
  std::string init();  // on the current device
  // Returns "" on success, else a sentence saying what failed.
  std::string run(const GemmShape& s, const void* a, const void* b, const void* c, void* d,
                  cudaStream_t stream);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
  };
  std::string plan(const GemmShape& s, Plan** out);
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 32u << 20;
  std::map<decltype(GemmShape{}.key()), Plan> plans_;
};

}  // namespace jaxoverlap
