#include "gemm.h"

#include <string>

namespace jaxoverlap {
namespace {

std::string lt_error(const char* what, cublasStatus_t s) {
  return std::string("cuBLASLt ") + what + " failed with status " + std::to_string((int)s);
}

}  // namespace

std::string GemmRunner::init() {
  if (handle_) return "";
  cublasStatus_t s = cublasLtCreate(&handle_);
  if (s != CUBLAS_STATUS_SUCCESS) return lt_error("cublasLtCreate", s);
  if (cudaError_t e = cudaMalloc(&workspace_, workspace_bytes_))
    return std::string("cudaMalloc of the cuBLASLt workspace failed: ") + cudaGetErrorString(e);
  return "";
}

std::string GemmRunner::plan(const GemmShape& s, Plan** out) {
  auto it = plans_.find(s.key());
  if (it != plans_.end()) {
    *out = &it->second;
    return "";
  }
  Plan p{};
  const cudaDataType_t t = s.dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
  cublasStatus_t st;
#define LT(call)                                 \
  if ((st = (call)) != CUBLAS_STATUS_SUCCESS) { \
    return lt_error(#call, st);                 \
  }
  LT(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  if (s.sm_count > 0) {
    int32_t sms = s.sm_count;
    LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms,
                                      sizeof(sms)));
  }
  // Row-major D[m,n] = A[m,k] B[k,n] is column-major D^T[n,m] = B^T[n,k] A^T[k,m].
  LT(cublasLtMatrixLayoutCreate(&p.la, t, s.n, s.k, s.n));
  LT(cublasLtMatrixLayoutCreate(&p.lb, t, s.k, s.m, s.k));
  LT(cublasLtMatrixLayoutCreate(&p.lc, t, s.n, s.m, s.n));
  cublasLtMatmulPreference_t pref;
  LT(cublasLtMatmulPreferenceCreate(&pref));
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                          &workspace_bytes_, sizeof(workspace_bytes_)));
  cublasLtMatmulHeuristicResult_t r{};
  int found = 0;
  st = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.la, p.lb, p.lc, p.lc, pref, 1, &r, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return lt_error("cublasLtMatmulAlgoGetHeuristic", st);
  if (!found)
    return "cuBLASLt found no algorithm for the GEMM " + std::to_string(s.m) + "x" +
           std::to_string(s.k) + "x" + std::to_string(s.n);
#undef LT
  p.algo = r.algo;
  auto [pos, _] = plans_.emplace(s.key(), p);
  *out = &pos->second;
  return "";
}

std::string GemmRunner::run(const GemmShape& s, const void* a, const void* b, const void* c,
                            void* d, cudaStream_t stream) {
  Plan* p = nullptr;
  if (std::string err = plan(s, &p); !err.empty()) return err;
  const float alpha = 1.0f, beta = s.accumulate ? 1.0f : 0.0f;
  cublasStatus_t st =
      cublasLtMatmul(handle_, p->desc, &alpha, b, p->la, a, p->lb, &beta, s.accumulate ? c : d,
                     p->lc, d, p->lc, &p->algo, workspace_, workspace_bytes_, stream);
  if (st != CUBLAS_STATUS_SUCCESS) return lt_error("cublasLtMatmul", st);
  return "";
}

}  // namespace jaxoverlap
