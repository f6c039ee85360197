#include "gemm.h"

#include <cstdint>
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
  return "";
}

int GemmRunner::alignment(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && v % a) a /= 2;
  return a;
}

std::string GemmRunner::stream_workspace(cudaStream_t stream, void** out) {
  auto it = workspaces_.find(stream);
  if (it == workspaces_.end()) {
    void* p = nullptr;
    if (cudaError_t e = cudaMalloc(&p, workspace_bytes_))
      return std::string("cudaMalloc of a cuBLASLt workspace failed: ") + cudaGetErrorString(e);
    it = workspaces_.emplace(stream, p).first;
  }
  *out = it->second;
  return "";
}

std::string GemmRunner::plan(const GemmShape& s, const GemmAlign& al, Plan** out) {
  const auto key = std::make_tuple(s.key(), al.key());
  auto it = plans_.find(key);
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
  // Row-major D[m,n] = A[m,k] B[k,n] is column-major D^T[n,m] = B^T[n,k] A^T[k,m]. A
  // column-major B is a column-major [k, n] matrix whose transpose is cuBLASLt's A.
  if (s.b_col) {
    const int32_t op_t = CUBLAS_OP_T;
    LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
    LT(cublasLtMatrixLayoutCreate(&p.la, t, s.k, s.n, s.ldb ? s.ldb : s.k));
  } else {
    LT(cublasLtMatrixLayoutCreate(&p.la, t, s.n, s.k, s.ldb ? s.ldb : s.n));
  }
  // Likewise a column-major A is cuBLASLt's transposed B.
  if (s.a_col) {
    const int32_t op_t = CUBLAS_OP_T;
    LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_t, sizeof(op_t)));
    LT(cublasLtMatrixLayoutCreate(&p.lb, t, s.m, s.k, s.lda ? s.lda : s.m));
  } else {
    LT(cublasLtMatrixLayoutCreate(&p.lb, t, s.k, s.m, s.k));
  }
  LT(cublasLtMatrixLayoutCreate(&p.lc, s.f32_out ? CUDA_R_32F : t, s.n, s.m, s.n));
  cublasLtMatmulPreference_t pref;
  LT(cublasLtMatmulPreferenceCreate(&pref));
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                          &workspace_bytes_, sizeof(workspace_bytes_)));
  // cuBLASLt's A/B are our B/A (see the layouts above).
  const uint32_t align[4] = {(uint32_t)al.b, (uint32_t)al.a, (uint32_t)al.c, (uint32_t)al.d};
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    LT(cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align[i], sizeof(align[i])));
  cublasLtMatmulHeuristicResult_t r{};
  int found = 0;
  st = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.la, p.lb, p.lc, p.lc, pref, 1, &r, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return lt_error("cublasLtMatmulAlgoGetHeuristic", st);
  if (!found)
    return "cuBLASLt found no algorithm for the GEMM " + std::to_string(s.m) + "x" +
           std::to_string(s.k) + "x" + std::to_string(s.n) + " with operand alignments " +
           std::to_string(al.a) + "/" + std::to_string(al.b) + "/" + std::to_string(al.c) + "/" +
           std::to_string(al.d) + " bytes";
#undef LT
  p.algo = r.algo;
  auto [pos, _] = plans_.emplace(key, p);
  *out = &pos->second;
  return "";
}

std::string GemmRunner::run(const GemmShape& s, const void* a, const void* b, const void* c,
                            void* d, cudaStream_t stream) {
  const void* cin = s.accumulate ? c : d;
  const GemmAlign al{alignment(a), alignment(b), alignment(cin), alignment(d)};
  Plan* p = nullptr;
  if (std::string err = plan(s, al, &p); !err.empty()) return err;
  void* ws = nullptr;
  if (std::string err = stream_workspace(stream, &ws); !err.empty()) return err;
  const float alpha = 1.0f, beta = s.accumulate ? 1.0f : 0.0f;
  cublasStatus_t st = cublasLtMatmul(handle_, p->desc, &alpha, b, p->la, a, p->lb, &beta, cin,
                                     p->lc, d, p->lc, &p->algo, ws, workspace_bytes_, stream);
  if (st != CUBLAS_STATUS_SUCCESS) return lt_error("cublasLtMatmul", st);
  return "";
}

}  // namespace jaxoverlap
