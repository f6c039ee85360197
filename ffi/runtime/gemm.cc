#include "runtime/gemm.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <mutex>

#include "runtime/capture.h"
#include "kernels/fill.h"

namespace jaxoverlap {
namespace {

std::mutex cache_mu;
std::string cache_dir;  // under cache_mu

// A cached choice: "<index> <ms first> <ms kept> <candidates>\n". False if absent or unusable.
bool read_choice(const std::string& path, int found, GemmRunner::Choice* c) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return false;
  int index = -1, candidates = 0;
  float first = 0, best = 0;
  const bool ok = std::fscanf(f, "%d %f %f %d", &index, &first, &best, &candidates) == 4;
  std::fclose(f);
  if (!ok || index < 0 || index >= found || candidates != found) return false;
  c->chosen = index, c->ms_first = first, c->ms_best = best, c->candidates = candidates;
  c->cached = true;
  return true;
}

bool publish_choice(const std::string& path, const GemmRunner::Choice& c) {
  char text[96];
  std::snprintf(text, sizeof(text), "%d %.6f %.6f %d\n", c.chosen, c.ms_first, c.ms_best,
                c.candidates);
  return publish_once(path, text);
}

std::string lt_error(const char* what, cublasStatus_t s) {
  return std::string("cuBLASLt ") + what + " failed with status " + std::to_string((int)s);
}

}  // namespace

bool publish_once(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) return true;  // no cache (read-only, missing directory): keep our own choice
  std::fputs(text.c_str(), f);
  const bool written = std::fclose(f) == 0;
  const bool linked = written && link(tmp.c_str(), path.c_str()) == 0;
  const bool exists = !linked && errno == EEXIST;
  unlink(tmp.c_str());
  return !exists;
}

constexpr int kCandidates = 8;  // heuristic candidates timed per shape
constexpr int kReps = 3;        // launches per timing; two timings per candidate, best kept

std::string GemmRunner::init() {
  if (handle_) return "";
  const char* knob = std::getenv("JAXOVERLAP_GEMM_SEARCH");
  search_ = !(knob && std::strcmp(knob, "0") == 0);
  const char* fill = std::getenv("JAXOVERLAP_SANITIZER_MEMSET");  // gemm.h: sanitizer runs only
  sanitizer_memset_ = fill && std::strcmp(fill, "1") == 0;
  int dev = 0, sms = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess)
    device_tag_ = std::string(prop.name) + "/" + std::to_string(sms) + "/" +
                  std::to_string(cublasLtGetVersion());
  cudaGetLastError();
  // The workspace of GEMMs captured on XLA's streams (stream_workspace), allocated now: nothing
  // can be allocated under capture.
  if (cudaError_t e = cudaMalloc(&captured_workspace_, workspace_bytes_))
    return std::string("cudaMalloc of a cuBLASLt workspace failed: ") + cudaGetErrorString(e);
  // The stream of the candidate timing's scratch allocations (time_candidates), created now:
  // an ordinary stream of the device's primary context, never a green-context one.
  if (cudaError_t e = cudaStreamCreateWithFlags(&scratch_stream_, cudaStreamNonBlocking))
    return std::string("creating the GEMM search's scratch stream failed: ") +
           cudaGetErrorString(e);
  if (sanitizer_memset_) {  // gemm.h; waited for here: XLA's streams use this workspace
    if (std::string e = sanitizer_fill(captured_workspace_, workspace_bytes_, scratch_stream_);
        !e.empty())
      return e;
    if (cudaError_t e = cudaStreamSynchronize(scratch_stream_))
      return std::string("JAXOVERLAP_SANITIZER_MEMSET's fill: ") + cudaGetErrorString(e);
  }
  for (cudaEvent_t* ev : {&scratch_ready_, &scratch_used_})
    if (cudaError_t e = cudaEventCreateWithFlags(ev, cudaEventDisableTiming))
      return std::string("cudaEventCreate failed: ") + cudaGetErrorString(e);
  cublasStatus_t s = cublasLtCreate(&handle_);
  if (s != CUBLAS_STATUS_SUCCESS) return lt_error("cublasLtCreate", s);
  return "";
}

void GemmRunner::set_cache_dir(const std::string& dir) {
  std::lock_guard<std::mutex> lock(cache_mu);
  cache_dir = dir;
}

std::string GemmRunner::get_cache_dir() {
  std::lock_guard<std::mutex> lock(cache_mu);
  return cache_dir;
}

std::string GemmRunner::cache_file(const GemmShape& s, const GemmAlign& al) const {
  std::string dir;
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    dir = cache_dir;
  }
  if (dir.empty() || device_tag_.empty()) return "";
  const auto [m, n, k, dt, acc, sms, b_col, a_col, lda, f32_out, ldb] = s.key();
  std::string text = device_tag_;
  for (int64_t v : {m, n, k, (int64_t)dt, (int64_t)acc, (int64_t)sms, (int64_t)b_col,
                    (int64_t)a_col, lda, (int64_t)f32_out, ldb, (int64_t)al.a, (int64_t)al.b,
                    (int64_t)al.c, (int64_t)al.d})
    text += " " + std::to_string(v);
  char name[32];
  std::snprintf(name, sizeof(name), "gemm-%016zx", std::hash<std::string>{}(text));
  return dir + "/" + name;
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
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(stream, &capture);
    if (capture != cudaStreamCaptureStatusNone) {
      // XLA's trace stream (a new one per capture): no allocation is possible here. Every
      // captured GEMM on a stream of XLA's shares one workspace: XLA's command buffers run
      // their commands one after another (its default, LHS scheduling mode).
      if (!captured_workspace_) return "no cuBLASLt workspace for GEMMs captured into a CUDA graph";
      *out = captured_workspace_;
      return "";
    }
    void* p = nullptr;
    if (cudaError_t e = cudaMalloc(&p, workspace_bytes_))
      return std::string("cudaMalloc of a cuBLASLt workspace failed: ") + cudaGetErrorString(e);
    it = workspaces_.emplace(stream, p).first;
    if (std::string e = sanitizer_fill(p, workspace_bytes_, stream); !e.empty()) return e;
  }
  *out = it->second;
  return "";
}

std::string GemmRunner::sanitizer_fill(void* p, size_t bytes, cudaStream_t stream) const {
  if (!sanitizer_memset_) return "";
  if (cudaError_t e = cudaMemsetAsync(p, 0xFF, bytes, stream))
    return std::string("JAXOVERLAP_SANITIZER_MEMSET's fill: ") + cudaGetErrorString(e);
  return "";
}

std::string GemmRunner::describe(const GemmShape& s, const GemmAlign& al, int want, Plan* out,
                                 cublasLtMatmulHeuristicResult_t* r, int* found) {
  Plan& p = *out;
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
  st = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.la, p.lb, p.lc, p.lc, pref, want, r,
                                      found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return lt_error("cublasLtMatmulAlgoGetHeuristic", st);
  if (!*found)
    return "cuBLASLt found no algorithm for the GEMM " + std::to_string(s.m) + "x" +
           std::to_string(s.k) + "x" + std::to_string(s.n) + " with operand alignments " +
           std::to_string(al.a) + "/" + std::to_string(al.b) + "/" + std::to_string(al.c) + "/" +
           std::to_string(al.d) + " bytes";
#undef LT
  return "";
}

void GemmRunner::destroy(Plan* p) {
  if (p->desc) cublasLtMatmulDescDestroy(p->desc);
  for (cublasLtMatrixLayout_t l : {p->la, p->lb, p->lc})
    if (l) cublasLtMatrixLayoutDestroy(l);
  *p = Plan{};
}

std::string GemmRunner::plan(const GemmShape& s, const GemmAlign& al, cudaStream_t stream,
                             Plan** out) {
  const auto key = std::make_tuple(s.key(), al.key());
  auto it = plans_.find(key);
  if (it != plans_.end()) {
    *out = &it->second;
    return "";
  }
  Plan p{};
  cublasLtMatmulHeuristicResult_t r[kCandidates]{};
  int found = 0;
  if (std::string e = describe(s, al, search_ ? kCandidates : 1, &p, r, &found); !e.empty()) {
    destroy(&p);
    return e;
  }
  Choice& c = p.choice;
  c = Choice{s.m, s.n, s.k, s.sm_count, s.accumulate};
  const std::string path = found > 1 ? cache_file(s, al) : "";
  // Planned while XLA captures the call (a call site whose first call was captured, or a new
  // operand alignment): nothing may run on `stream` now, so the candidates are timed on a stream
  // of a set-up thread, on the whole device rather than the GEMM's partition, and the choice is
  // kept here, not published; the chosen kernel has run once, so it is loaded before any graph
  // that captures it is launched.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(stream, &capture);
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  bool ran = false;
  if (found <= 1) {
    c.note = search_ ? "one candidate" : "JAXOVERLAP_GEMM_SEARCH=0";
  } else if (!path.empty() && read_choice(path, found, &c)) {
    // another process's (or an earlier run's) choice
  } else {
    std::vector<float> ms;
    c.note = capturing ? time_outside_capture(p, s, al, r, found, &ms)
                       : time_candidates(p, s, al, r, found, stream, &ms);
    if (c.note.empty()) {
      int best = 0;
      for (int i = 1; i < found; ++i)
        if (ms[i] < ms[best]) best = i;
      if (!(ms[best] < 0.99f * ms[0])) best = 0;  // within noise: the heuristic's choice
      c.candidates = found, c.chosen = best, c.ms_first = ms[0], c.ms_best = ms[best];
      ran = true;
      if (capturing)
        c.note = "timed on the whole device while XLA captured its call (not published)";
      else if (!path.empty() && !publish_choice(path, c))
        read_choice(path, found, &c);  // another process chose first: take its choice, so
                                       // both compute the same bits
    }
  }
  if (capturing && !ran) {  // load the chosen kernel: run it once on scratch operands
    std::vector<float> ms;
    if (std::string e = time_outside_capture(p, s, al, &r[c.chosen], 1, &ms); !e.empty()) {
      destroy(&p);
      return "loading a GEMM kernel while XLA captures its call: " + e;
    }
  }
  p.algo = r[c.chosen].algo;
  auto [pos, _] = plans_.emplace(key, p);
  *out = &pos->second;
  return "";
}

std::string GemmRunner::time_outside_capture(const Plan& p, const GemmShape& s,
                                             const GemmAlign& al,
                                             const cublasLtMatmulHeuristicResult_t* r, int found,
                                             std::vector<float>* ms) {
  return outside_capture("timing GEMM candidates", [&]() -> std::string {
    cudaStream_t side = nullptr;
    if (cudaError_t e = cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking))
      return std::string("cudaStreamCreate: ") + cudaGetErrorString(e);
    void* ws = nullptr;
    std::string note;
    if (cudaError_t e = cudaMallocAsync(&ws, workspace_bytes_, side)) {
      note = std::string("cudaMallocAsync of a cuBLASLt workspace: ") + cudaGetErrorString(e);
      ws = nullptr;
    } else {
      note = sanitizer_fill(ws, workspace_bytes_, side);
      if (note.empty()) note = time_candidates(p, s, al, r, found, side, ms, ws);
      cudaFreeAsync(ws, side);
    }
    if (cudaError_t e = cudaStreamSynchronize(side); e != cudaSuccess && note.empty())
      note = std::string("cudaStreamSynchronize: ") + cudaGetErrorString(e);
    cudaStreamDestroy(side);
    cudaGetLastError();
    return note;
  });
}

std::string GemmRunner::time_candidates(const Plan& p, const GemmShape& s, const GemmAlign& al,
                                        const cublasLtMatmulHeuristicResult_t* r, int found,
                                        cudaStream_t stream, std::vector<float>* ms,
                                        void* workspace) {
  // Scratch operands as large as the real ones (leading dimensions included), each offset from
  // its 256-byte-aligned base by the real pointer's alignment, filled with random values. All
  // stream-ordered (cudaMallocAsync/cudaFreeAsync): nothing here synchronises the device, only
  // this stream, which a handler has already ordered after the work its GEMMs depend on.
  // Allocated and freed on the runner's scratch stream, an ordinary one, ordered before and
  // after `stream` by events -- never on `stream` itself, which is the SM partition's GEMM stream
  // (a green context's) when a fused call plans its GEMMs: compute-sanitizer 2025.3.1's
  // initcheck crashed the process in its cuMemAllocAsync hook on a stream-ordered allocation on
  // a green-context stream (issue 25; tools/probes/green_async_alloc_probe.cu reproduces it
  // without our code; tests/gpu/test_gemm_search_gpu.py runs the search there under initcheck).
  const int64_t elt = 2;  // bf16 or f16
  const int64_t out_elt = s.f32_out ? 4 : elt;
  const int64_t a_elems = s.a_col ? (s.lda ? s.lda : s.m) * s.k : s.m * s.k;
  const int64_t b_elems = s.b_col ? s.n * (s.ldb ? s.ldb : s.k) : s.k * (s.ldb ? s.ldb : s.n);
  const int64_t sizes[4] = {a_elems * elt, b_elems * elt, s.m * s.n * out_elt, s.m * s.n * out_elt};
  const int aligns[4] = {al.a, al.b, al.c, al.d};
  const FillType in_type = s.dtype == DType::kF16 ? FillType::kF16 : FillType::kBF16;
  const FillType out_type = s.f32_out ? FillType::kF32 : in_type;
  char* base[4] = {};
  void* ptr[4] = {};
  void* ws = workspace;
  cudaEvent_t ev[2] = {};
  std::string note;
  auto fail = [&](const char* what, cudaError_t e) {
    cudaGetLastError();
    if (note.empty()) note = std::string(what) + ": " + cudaGetErrorString(e);
  };
  ms->assign(found, std::numeric_limits<float>::infinity());
  if (!scratch_stream_) return "the GEMM runner is not initialised (no scratch stream)";
  if (!ws)
    if (std::string e = stream_workspace(stream, &ws); !e.empty()) return e;
  for (int i = 0; i < 4 && note.empty(); ++i) {
    if (cudaError_t e = cudaMallocAsync((void**)&base[i], sizes[i] + 256, scratch_stream_)) {
      fail("scratch allocation for timing GEMM candidates", e);
      base[i] = nullptr;
    }
  }
  if (note.empty()) {  // `stream` uses the scratch only once it is allocated
    if (cudaError_t e = cudaEventRecord(scratch_ready_, scratch_stream_))
      fail("ordering the scratch allocations", e);
    else if (cudaError_t e2 = cudaStreamWaitEvent(stream, scratch_ready_))
      fail("ordering the scratch allocations", e2);
  }
  for (int i = 0; i < 4 && note.empty(); ++i) {
    const int offset = aligns[i] >= 256 ? 0 : aligns[i];
    ptr[i] = base[i] + offset;
    const FillType t = i < 2 ? in_type : out_type;
    if (cudaError_t e = launch_fill_uniform(ptr[i], sizes[i] / (t == FillType::kF32 ? 4 : 2), t,
                                           1234u + i, stream))
      fail("filling scratch operands", e);
  }
  for (auto& e : ev)
    if (note.empty())
      if (cudaError_t err = cudaEventCreate(&e)) fail("cudaEventCreate", err);
  const float alpha = 1.0f, beta = s.accumulate ? 1.0f : 0.0f;
  const void* c = s.accumulate ? ptr[2] : ptr[3];
  auto launch = [&](int i) {
    return cublasLtMatmul(handle_, p.desc, &alpha, ptr[1], p.la, ptr[0], p.lb, &beta, c, p.lc,
                          ptr[3], p.lc, &r[i].algo, ws, workspace_bytes_, stream);
  };
  for (int pass = 0; pass < 2 && note.empty(); ++pass)
    for (int i = 0; i < found && note.empty(); ++i) {
      if (pass == 0 && launch(i) != CUBLAS_STATUS_SUCCESS) continue;  // stays +inf
      if (pass == 1 && !(ms->at(i) < std::numeric_limits<float>::infinity())) continue;
      cudaEventRecord(ev[0], stream);
      bool ok = true;
      for (int k = 0; k < kReps && ok; ++k) ok = launch(i) == CUBLAS_STATUS_SUCCESS;
      cudaEventRecord(ev[1], stream);
      float t = 0;
      if (cudaError_t e = cudaEventSynchronize(ev[1])) {
        fail("timing GEMM candidates", e);
      } else if (ok && cudaEventElapsedTime(&t, ev[0], ev[1]) == cudaSuccess) {
        (*ms)[i] = std::min((*ms)[i], t / kReps);
      }
    }
  // Freed on the scratch stream once `stream` is done with the scratch (if recording the event
  // failed, after synchronising `stream`: never freed under a launch still reading it).
  if (cudaEventRecord(scratch_used_, stream) != cudaSuccess ||
      cudaStreamWaitEvent(scratch_stream_, scratch_used_) != cudaSuccess) {
    cudaGetLastError();
    cudaStreamSynchronize(stream);
  }
  for (char* b : base)
    if (b) cudaFreeAsync(b, scratch_stream_);
  for (cudaEvent_t e : ev)
    if (e) cudaEventDestroy(e);
  cudaGetLastError();
  if (note.empty() && !(ms->at(0) < std::numeric_limits<float>::infinity()))
    note = "the heuristic's first candidate failed to run on scratch operands";
  return note;
}

std::string GemmRunner::candidates_ms(const GemmShape& s, cudaStream_t stream,
                                      std::vector<float>* ms) {
  const GemmAlign al{256, 256, 256, 256};
  Plan p{};
  cublasLtMatmulHeuristicResult_t r[kCandidates]{};
  int found = 0;
  std::string e = describe(s, al, kCandidates, &p, r, &found);
  if (e.empty()) e = time_candidates(p, s, al, r, found, stream, ms);
  destroy(&p);
  return e;
}

std::vector<GemmRunner::Choice> GemmRunner::choices() const {
  std::vector<Choice> out;
  for (const auto& [key, p] : plans_) out.push_back(p.choice);
  return out;
}

std::string GemmRunner::run(const GemmShape& s, const void* a, const void* b, const void* c,
                            void* d, cudaStream_t stream) {
  const void* cin = s.accumulate ? c : d;
  const GemmAlign al{alignment(a), alignment(b), alignment(cin), alignment(d)};
  Plan* p = nullptr;
  if (std::string err = plan(s, al, stream, &p); !err.empty()) return err;
  capture_mark("planning a GEMM");
  void* ws = nullptr;
  if (std::string err = stream_workspace(stream, &ws); !err.empty()) return err;
  // JAXOVERLAP_SANITIZER_MEMSET (gemm.h): D (row-major, leading dimension n) filled first, unless
  // it is also C (an accumulation in place), which its writer filled or initialised.
  const int64_t d_bytes = s.m * s.n * (s.f32_out ? 4 : 2);
  const char *dc = static_cast<const char*>(d), *cc = static_cast<const char*>(cin);
  if (!s.accumulate || cc + d_bytes <= dc || dc + d_bytes <= cc)
    if (std::string err = sanitizer_fill(d, d_bytes, stream); !err.empty()) return err;
  const float alpha = 1.0f, beta = s.accumulate ? 1.0f : 0.0f;
  cudaStreamCaptureStatus before = cudaStreamCaptureStatusNone, after = before;
  cudaStreamIsCapturing(stream, &before);
  cublasStatus_t st = cublasLtMatmul(handle_, p->desc, &alpha, b, p->la, a, p->lb, &beta, cin,
                                     p->lc, d, p->lc, &p->algo, ws, workspace_bytes_, stream);
  if (st != CUBLAS_STATUS_SUCCESS) return lt_error("cublasLtMatmul", st);
  if (before == cudaStreamCaptureStatusActive &&
      (cudaStreamIsCapturing(stream, &after) != cudaSuccess ||
       after != cudaStreamCaptureStatusActive))
    return "cublasLtMatmul invalidated the CUDA graph capture (" + std::to_string(s.m) + "x" +
           std::to_string(s.k) + "x" + std::to_string(s.n) + ")";
  capture_mark("a cuBLASLt GEMM");
  return "";
}

}  // namespace jaxoverlap
