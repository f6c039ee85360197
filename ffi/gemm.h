// cuBLASLt GEMM driver: row-major D[m, n] = A[m, k] . B[k, n] (+ C[m, n]), f32 accumulation,
// A and B each stored row-major or column-major (the transpose of a row-major array, which XLA
// then hands over without a copy: the backward's w.T, and x.T of a weight gradient),
// targeted at the SM count of the partition it runs on. One per device; plans cached by shape and
// operand alignment. Not thread-safe: callers hold their device's DeviceRuntime::launch_mu.
// cuBLASLt's workspace is one per stream: two GEMMs share one only if they are stream-ordered,
// so no two GEMMs (a warm-up included) ever use the same workspace at once.
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
  bool b_col;       // B is column-major: element (i, j) at b[j * ldb + i] (ldb: k by default)
  bool a_col = false;  // A is column-major: element (i, j) at a[j * lda + i]
  int64_t lda = 0;     // a_col: the leading dimension of A (0: m; more for a block of rows of a
                       // taller column-major matrix)
  bool f32_out = false;  // C and D are float32 (a sum over several GEMMs, rounded once)
  int64_t ldb = 0;       // the leading dimension of B (0: n, or k if b_col; more for a block of
                         // rows of a taller column-major B)
  auto key() const {
    return std::make_tuple(m, n, k, (int)dtype, accumulate, sm_count, b_col, a_col, lda, f32_out,
                           ldb);
  }
};

// Alignment in bytes (a power of two, at most 256) of each operand pointer: cuBLASLt's heuristic
// assumes 256 unless told, and XLA guarantees only 16 for entry parameters.
struct GemmAlign {
  int a, b, c, d;
  auto key() const { return std::make_tuple(a, b, c, d); }
};

class GemmRunner {
 public:
  std::string init();  // on the current device
  // On the current device. Returns "" on success, else a sentence saying what failed. Any
  // pointer alignment of 2 bytes or more runs: the plan is chosen for the pointers' alignment.
  std::string run(const GemmShape& s, const void* a, const void* b, const void* c, void* d,
                  cudaStream_t stream);
  static int alignment(const void* p);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
  };
  std::string plan(const GemmShape& s, const GemmAlign& al, Plan** out);
  std::string stream_workspace(cudaStream_t stream, void** out);
  cublasLtHandle_t handle_ = nullptr;
  size_t workspace_bytes_ = 32u << 20;
  std::map<cudaStream_t, void*> workspaces_;  // per stream, allocated on first use
  std::map<std::tuple<decltype(GemmShape{}.key()), decltype(GemmAlign{}.key())>, Plan> plans_;
};

}  // namespace jaxoverlap
