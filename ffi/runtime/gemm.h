// cuBLASLt GEMM driver: row-major D[m, n] = A[m, k] . B[k, n] (+ C[m, n]), f32 accumulation,
// A and B each stored row-major or column-major (the transpose of a row-major array, which XLA
// then hands over without a copy: the backward's w.T, and x.T of a weight gradient),
// targeted at the SM count of the partition it runs on. One per device; plans cached by shape and
// operand alignment. Not thread-safe: callers hold their device's DeviceRuntime::launch_mu.
// A plan's algorithm is chosen by measurement, as XLA's autotuner chooses its GEMMs': the first
// use of a shape times cuBLASLt's top heuristic candidates on random operands of that shape on
// the stream it runs on (so on its partition's SMs) and keeps the fastest, unless it beats the
// heuristic's first choice by less than 1 %. With a cache directory (set_cache_dir; the Python
// side sets the tuner's), a choice is stored in one file per (device, cuBLASLt version, shape,
// alignments), created atomically: the first process to choose wins and every later or
// concurrent one adopts its choice, so the ranks of a group and reruns compute with the same
// algorithm and the same bits. JAXOVERLAP_GEMM_SEARCH=0 keeps the heuristic's first choice.
// cuBLASLt's workspace is one per stream: two GEMMs share one only if they are stream-ordered,
// so no two GEMMs (a warm-up included) ever use the same workspace at once.
// JAXOVERLAP_SANITIZER_MEMSET=1 (compute-sanitizer initcheck runs only, tools/sanitize.py; never
// in production): every GEMM's output is filled with 0xFF bytes (NaN in bf16, f16 and f32) on its
// stream just before the GEMM, and every cuBLASLt workspace when allocated. initcheck does not
// see the TMA stores cuBLASLt's Hopper GEMMs write with (tools/probes/tma_store_initcheck_probe.cu;
// issue 25), so without this every later read of a GEMM's output or of cuBLASLt's split-K partials
// is reported as uninitialised; after the fill it is not, and an element the GEMM failed to write
// reads as NaN, which every comparison with a reference catches.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

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

// Publishes `text` at `path` unless a file is there: written to a private file, then hard-linked
// into place (atomic; fails if the name exists), so readers never see a partial file and the
// first writer wins. False when another process's file was there first (the GEMM plans' and the
// tile kernels' choices, runtime/tile_menu.cc).
bool publish_once(const std::string& path, const std::string& text);

class GemmRunner {
 public:
  std::string init();  // on the current device
  // Where choices are shared between processes ("" = not at all). Process-wide.
  static void set_cache_dir(const std::string& dir);
  static std::string get_cache_dir();  // also the tile kernels' choices (runtime/tile_menu.h)
  // On the current device. Returns "" on success, else a sentence saying what failed. Any
  // pointer alignment of 2 bytes or more runs: the plan is chosen for the pointers' alignment.
  std::string run(const GemmShape& s, const void* a, const void* b, const void* c, void* d,
                  cudaStream_t stream);
  static int alignment(const void* p);

  // What the search found for one plan (tools and tests: _native.gemm_plans).
  struct Choice {
    int64_t m, n, k;
    int sm_count;
    bool accumulate;
    int candidates = 1;             // heuristic candidates timed (1: no search)
    int chosen = 0;                 // index of the one kept, in heuristic order
    float ms_first = 0, ms_best = 0;  // per launch: the heuristic's first choice, the kept one
    std::string note;               // why no search ran, if none did
    bool cached = false;            // adopted from the cache (timed by this or another process)
  };
  std::vector<Choice> choices() const;
  // Tools: ms per launch of each of cuBLASLt's top candidates for `s` (heuristic order, +inf for
  // one that failed), timed on `stream` with random 256-byte-aligned operands.
  std::string candidates_ms(const GemmShape& s, cudaStream_t stream, std::vector<float>* ms);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    Choice choice;
  };
  std::string plan(const GemmShape& s, const GemmAlign& al, cudaStream_t stream, Plan** out);
  // The descriptor and layouts of `s`, and up to `want` heuristic candidates (r, *found).
  std::string describe(const GemmShape& s, const GemmAlign& al, int want, Plan* p,
                       cublasLtMatmulHeuristicResult_t* r, int* found);
  static void destroy(Plan* p);
  // Times `found` candidates for `p` on `stream` (scratch operands with the alignments `al`);
  // ms[i] per launch, +inf for one that failed. "" or why no timing was possible.
  // `workspace`: cuBLASLt's (null: `stream`'s own, stream_workspace).
  std::string time_candidates(const Plan& p, const GemmShape& s, const GemmAlign& al,
                              const cublasLtMatmulHeuristicResult_t* r, int found,
                              cudaStream_t stream, std::vector<float>* ms,
                              void* workspace = nullptr);
  // The same on a stream of a set-up thread, for a GEMM planned while XLA captures its call
  // (capture.h: outside_capture); synchronises that stream only.
  std::string time_outside_capture(const Plan& p, const GemmShape& s, const GemmAlign& al,
                                   const cublasLtMatmulHeuristicResult_t* r, int found,
                                   std::vector<float>* ms);
  std::string stream_workspace(cudaStream_t stream, void** out);
  // The cache file of a plan ("" when there is no cache directory).
  std::string cache_file(const GemmShape& s, const GemmAlign& al) const;
  bool search_ = true;
  bool sanitizer_memset_ = false;  // JAXOVERLAP_SANITIZER_MEMSET=1 (above), read in init()
  // The fill of JAXOVERLAP_SANITIZER_MEMSET: `bytes` at `p` set to 0xFF on `stream` (a no-op
  // without the knob); "" or why it failed.
  std::string sanitizer_fill(void* p, size_t bytes, cudaStream_t stream) const;
  std::string device_tag_;  // device name, SM count, cuBLASLt version
  cublasLtHandle_t handle_ = nullptr;
  size_t workspace_bytes_ = 32u << 20;
  std::map<cudaStream_t, void*> workspaces_;  // per stream, allocated on first use
  void* captured_workspace_ = nullptr;        // GEMMs on XLA's streams under graph capture
  // The candidate timing's scratch: allocated and freed on this ordinary stream, never on a
  // green-context one (time_candidates); the events order it around the timing stream.
  cudaStream_t scratch_stream_ = nullptr;
  cudaEvent_t scratch_ready_ = nullptr, scratch_used_ = nullptr;
  std::map<std::tuple<decltype(GemmShape{}.key()), decltype(GemmAlign{}.key())>, Plan> plans_;
};

}  // namespace jaxoverlap
