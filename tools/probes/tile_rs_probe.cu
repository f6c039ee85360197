// Probe of the tile-fused GEMM + reduce-scatter (ffi/kernels/tile_rs.cuh) on ONE GPU.
//
//   check: two ranks of a tp = 2 group on one GPU, each kernel on its own stream with half the
//          SMs (both must be resident: there is no time-slicing within a process), several calls
//          in a row (epochs, double-buffered staging, the claim counters' parity) -> each rank's
//          block against an f32 reference and bitwise equal across calls.
//   time:  per-device M x K x N, one rank alone on all SMs: the kernel as a plain GEMM (mode 2),
//          the kernel with its communication traffic but no waits (mode 1: foreign tiles stored
//          to a second buffer, own tiles add it), against cuBLASLt (heuristic's first choice and
//          the best of its top 8, ffi/runtime/gemm.h). What two GPUs add (NVLink, waits) is not here.
//
// Build (tools/gpu_check.sh --tile-probe does this on the GPU machine, from the carried binary):
//   nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//     -Iffi -I<cutlass>/include -I<cublas>/include tools/probes/tile_rs_probe.cu \
//     ffi/kernels/tile_rs*.cu ffi/kernels/comm.cu ffi/kernels/fill.cu ffi/runtime/gemm.cc ffi/runtime/capture.cc \
//     -L<cublas>/lib -l:libcublasLt.so.13 -o tile_rs_probe
// Usage: tile_rs_probe check | time M K N [M K N ...]
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/gemm.h"
#include "kernels/comm.h"
#include "kernels/fill.h"
#include "kernels/tile_rs.h"

using namespace jaxoverlap;

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

namespace {

// ref[i, j] = sum_k a[i, k] * b(k, j) in f32 (b row-major [K, N], or column-major)
__global__ void ref_gemm(const __nv_bfloat16* a, const __nv_bfloat16* b, float* c, int M, int N,
                         int K, int b_col, int accumulate) {
  __shared__ float sa[16][17], sb[16][17];
  const int i = blockIdx.y * 16 + threadIdx.y, j = blockIdx.x * 16 + threadIdx.x;
  float acc = 0;
  for (int k0 = 0; k0 < K; k0 += 16) {
    const int ka = k0 + threadIdx.x, kb = k0 + threadIdx.y;
    sa[threadIdx.y][threadIdx.x] = i < M && ka < K ? __bfloat162float(a[(int64_t)i * K + ka]) : 0;
    sb[threadIdx.y][threadIdx.x] =
        j < N && kb < K
            ? __bfloat162float(b_col ? b[(int64_t)j * K + kb] : b[(int64_t)kb * N + j])
            : 0;
    __syncthreads();
    for (int k = 0; k < 16; ++k) acc += sa[threadIdx.y][k] * sb[k][threadIdx.x];
    __syncthreads();
  }
  if (i < M && j < N) c[(int64_t)i * N + j] = (accumulate ? c[(int64_t)i * N + j] : 0) + acc;
}

__global__ void finish(Flags* f) { f->epoch += 1; }

struct Rank {
  __nv_bfloat16 *x, *w, *out;
  char* stage;
  Flags* flags;
  cudaStream_t stream;
};

void fill(void* p, int64_t n, uint32_t seed) {
  CK(launch_fill_uniform(p, n, FillType::kBF16, seed, nullptr));
}

TileRsArgs make_args(Rank* rk, int r, int n, int64_t m, int64_t N, int64_t K, int w_col,
                     uint32_t* abort, ErrorRecord* err, int sms, int mode) {
  TileRsArgs a{};
  a.peers.n = n;
  a.peers.rank = r;
  a.peers.device = 0;
  for (int i = 0; i < n; ++i) {
    a.peers.stage[i] = rk[i].stage;
    a.peers.flags[i] = rk[i].flags;
  }
  a.peers.abort = abort;
  a.x = rk[r].x;
  a.w = rk[r].w;
  a.out = rk[r].out;
  a.m = m;
  a.N = N;
  a.K = K;
  a.w_colmajor = w_col;
  a.dtype = DType::kBF16;
  a.slot_bytes = tile_rs_slot_bytes(m, N);
  a.sm_count = sms;
  a.swizzle = 4;
  a.mode = mode;
  a.stall_rank = -1;
  a.op = kOpGemmRs;
  a.timeout_ns = 10ull * 1000 * 1000 * 1000;
  a.err = err;
  return a;
}

// n ranks on one GPU (each kernel on 1/n of the SMs), `calls` calls; false on a mismatch.
bool check(int64_t M, int64_t K, int64_t N, int w_col, int calls, int n) {
  const int64_t m = M / n;
  int total_sms = 0;
  CK(cudaDeviceGetAttribute(&total_sms, cudaDevAttrMultiProcessorCount, 0));
  // Every rank's kernel must be resident at once (no time-slicing within a process): a cluster
  // of slack for the GPCs' cluster placement beyond two ranks.
  const int sms = (total_sms / n / kTileClusterM - (n > 2 ? 1 : 0)) * kTileClusterM;
  Rank rk[kMaxRanks];
  uint32_t* abort;
  CK(cudaHostAlloc(&abort, kAbortSlots * 4, cudaHostAllocMapped));
  for (uint32_t i = 0; i < kAbortSlots; ++i) abort[i] = i ^ 1u;
  ErrorRecord* err;
  CK(cudaHostAlloc(&err, sizeof(ErrorRecord), cudaHostAllocMapped));
  std::memset(err, 0, sizeof(ErrorRecord));
  const int64_t stage_bytes = (n - 1) * tile_rs_slot_bytes(m, N);
  for (int r = 0; r < n; ++r) {
    CK(cudaMalloc(&rk[r].x, M * K * 2));
    CK(cudaMalloc(&rk[r].w, K * N * 2));
    CK(cudaMalloc(&rk[r].out, m * N * 2));
    CK(cudaMalloc(&rk[r].stage, stage_bytes));
    CK(cudaMemset(rk[r].stage, 0, stage_bytes));
    CK(cudaMalloc(&rk[r].flags, sizeof(Flags)));
    CK(cudaMemset(rk[r].flags, 0, sizeof(Flags)));
    CK(cudaStreamCreateWithFlags(&rk[r].stream, cudaStreamNonBlocking));
    fill(rk[r].x, M * K, 11 + r);
    fill(rk[r].w, K * N, 23 + r);
  }
  CK(cudaDeviceSynchronize());  // the fills and clears (legacy stream) before the ranks' streams
  std::vector<float> ref(m * N);
  float* dref;
  CK(cudaMalloc(&dref, m * N * 4));
  std::vector<std::vector<uint16_t>> first(n, std::vector<uint16_t>(m * N));
  bool ok = true;
  for (int call = 0; call < calls; ++call) {
    for (int r = 0; r < n; ++r) {
      TileRsArgs a = make_args(rk, r, n, m, N, K, w_col, abort, err, sms, 0);
      CK(launch_tile_rs(a, rk[r].stream));
      CK(launch_release_slots(a.peers, rk[r].stream));
      finish<<<1, 1, 0, rk[r].stream>>>(rk[r].flags);
    }
    CK(cudaDeviceSynchronize());
    if (err->set) {
      std::printf("  call %d: wait gave up: rank %d peer %d what %d chunk %d (flag %u want %u)\n",
                  call, err->rank, err->peer, err->what, err->chunk, err->seen, err->target);
      return false;
    }
    for (int r = 0; r < n; ++r) {
      std::vector<uint16_t> got(m * N);
      CK(cudaMemcpy(got.data(), rk[r].out, m * N * 2, cudaMemcpyDeviceToHost));
      if (call == 0) {  // ref_r = sum_s x_s[block r] @ w_s
        for (int s = 0; s < n; ++s) {
          dim3 grid((N + 15) / 16, (m + 15) / 16), block(16, 16);
          ref_gemm<<<grid, block>>>(rk[s].x + r * m * K, rk[s].w, dref, (int)m, (int)N, (int)K,
                                    w_col, s > 0);
        }
        CK(cudaMemcpy(ref.data(), dref, m * N * 4, cudaMemcpyDeviceToHost));
        double mx = 0, diff = 0;
        int64_t worst = 0;
        for (int64_t i = 0; i < m * N; ++i) {
          uint32_t bits = (uint32_t)got[i] << 16;
          float v;
          std::memcpy(&v, &bits, 4);
          mx = std::max(mx, (double)std::fabs(ref[i]));
          const double d = std::isfinite(v) ? std::fabs(v - ref[i]) : 1e30;
          if (d > diff) diff = d, worst = i;
        }
        const double rel = diff / (mx > 0 ? mx : 1);
        std::printf("  rank %d: max |err| / max |ref| = %.2e (worst at row %lld col %lld)\n", r,
                    rel, (long long)(worst / N), (long long)(worst % N));
        if (!(rel < 1e-2)) ok = false;
        first[r] = got;
      } else if (got != first[r]) {
        std::printf("  rank %d: call %d differs from call 0 (not bitwise repeatable)\n", r, call);
        ok = false;
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    cudaFree(rk[r].x), cudaFree(rk[r].w), cudaFree(rk[r].out), cudaFree(rk[r].stage);
    cudaFree(rk[r].flags), cudaStreamDestroy(rk[r].stream);
  }
  cudaFree(dref), cudaFreeHost(abort), cudaFreeHost(err);
  return ok;
}

// Median ms per launch of each variant, timed interleaved (BENCHMARKS.md): 7 rounds, each
// variant 20 launches per round in turn, after 5 warm-up launches of each; spread = (max -
// min) / median of the 7.
struct Timed {
  float ms, spread;
};
std::vector<Timed> time_interleaved(const std::vector<std::function<void()>>& fns, cudaStream_t s) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (const auto& f : fns)
    for (int i = 0; i < 5; ++i) f();
  std::vector<std::vector<float>> ts(fns.size());
  for (int rep = 0; rep < 7; ++rep)
    for (size_t v = 0; v < fns.size(); ++v) {
      CK(cudaEventRecord(a, s));
      for (int i = 0; i < 20; ++i) fns[v]();
      CK(cudaEventRecord(b, s));
      CK(cudaEventSynchronize(b));
      float ms;
      CK(cudaEventElapsedTime(&ms, a, b));
      ts[v].push_back(ms / 20);
    }
  std::vector<Timed> out;
  for (auto& t : ts) {
    std::sort(t.begin(), t.end());
    out.push_back({t[t.size() / 2], (t.back() - t.front()) / t[t.size() / 2]});
  }
  cudaEventDestroy(a), cudaEventDestroy(b);
  return out;
}

// Returns {plain / cuBLASLt, solo / cuBLASLt}.
std::pair<double, double> time_shape(int64_t M, int64_t K, int64_t N, GemmRunner* lt) {
  const int n = 2;
  const int64_t m = M / n;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Rank rk[2];
  uint32_t* abort;
  CK(cudaHostAlloc(&abort, kAbortSlots * 4, cudaHostAllocMapped));
  for (uint32_t i = 0; i < kAbortSlots; ++i) abort[i] = i ^ 1u;
  for (int r = 0; r < n; ++r) {  // rank 1 only lends its staging (the foreign tiles' target)
    CK(cudaMalloc(&rk[r].stage, (n - 1) * tile_rs_slot_bytes(m, N)));
    CK(cudaMalloc(&rk[r].flags, sizeof(Flags)));
    CK(cudaMemset(rk[r].flags, 0, sizeof(Flags)));
    rk[r].x = rk[r].w = nullptr;
  }
  CK(cudaMalloc(&rk[0].x, M * K * 2));
  CK(cudaMalloc(&rk[0].w, K * N * 2));
  CK(cudaMalloc(&rk[0].out, M * N * 2));
  fill(rk[0].x, M * K, 5);
  fill(rk[0].w, K * N, 7);
  fill(rk[0].stage, m * N * 2, 9);
  CK(cudaDeviceSynchronize());
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // cuBLASLt with the runner's search (the best of its top 8 by timing, ffi/runtime/gemm.h), as the
  // chunked schedule's GEMMs run; planned before the timing.
  const GemmShape gs{M, N, K, DType::kBF16, false, 0, false};
  if (std::string e = lt->run(gs, rk[0].x, rk[0].w, nullptr, rk[0].out, s); !e.empty()) {
    std::printf("cuBLASLt: %s\n", e.c_str());
    std::exit(1);
  }
  auto tile = [&](int mode, int swizzle) -> std::function<void()> {
    TileRsArgs a = make_args(rk, 0, n, m, N, K, 0, abort, nullptr, sms, mode);
    a.swizzle = swizzle;
    // Each call ends with the epoch's advance, as a fused call does (the claim counters
    // alternate between calls).
    return [&, a] {
      CK(launch_tile_rs(a, s));
      finish<<<1, 1, 0, s>>>(rk[0].flags);
    };
  };
  const char* names[] = {"cublasLt", "plain", "plain-rot", "solo sw1", "solo sw4", "solo sw8",
                         "no-add", "one-buffer"};
  std::vector<std::function<void()>> fns = {
      [&] { lt->run(gs, rk[0].x, rk[0].w, nullptr, rk[0].out, s); },
      tile(2, 4), tile(5, 4), tile(1, 1), tile(1, 4), tile(1, 8), tile(3, 4), tile(4, 4)};
  const std::vector<Timed> t = time_interleaved(fns, s);
  std::printf("%6lld x %6lld x %6lld |", (long long)M, (long long)K, (long long)N);
  for (size_t v = 0; v < t.size(); ++v)
    std::printf(" %s %.3f (%.0f%%)", names[v], t[v].ms, 100 * t[v].spread);
  const float solo = std::min({t[3].ms, t[4].ms, t[5].ms});
  std::printf(" | plain/lt %.3f solo/lt %.3f\n", t[1].ms / t[0].ms, solo / t[0].ms);
  for (int r = 0; r < n; ++r) cudaFree(rk[r].stage), cudaFree(rk[r].flags);
  cudaFree(rk[0].x), cudaFree(rk[0].w), cudaFree(rk[0].out), cudaFreeHost(abort);
  cudaStreamDestroy(s);
  return {t[1].ms / t[0].ms, solo / t[0].ms};
}

}  // namespace

int main(int argc, char** argv) {
  CK(cudaSetDevice(0));
  CK(preload_tile_kernels());
  CK(preload_comm_kernels());
  // This file's kernels too: a module loaded lazily while a rank's kernel spins on its peer
  // waits for that kernel, whose peer is launched only after the load (seen: the first check
  // timed out; DESIGN.md's decision 5).
  cudaFuncAttributes attr;
  CK(cudaFuncGetAttributes(&attr, finish));
  CK(cudaFuncGetAttributes(&attr, ref_gemm));
  const std::string what = argc > 1 ? argv[1] : "check";
  if (what == "check") {
    struct Case {
      int64_t M, K, N;
      int w_col, n;
      const char* why;
    } cases[] = {
        {4096, 4096, 4096, 0, 2, "square, full tiles"},
        {4096, 4096, 4096, 1, 2, "w column-major"},
        {2048, 1032, 1000, 0, 2, "K % 64 != 0, N % 256 != 0 (partial tiles)"},
        {1024, 256, 512, 0, 2, "fewer tiles than CTAs"},
        {8192, 2048, 4096, 0, 2, "many tiles per CTA"},
        {4096, 1024, 1280, 0, 4, "4 ranks: three peers' slabs summed in rank order"},
        {8192, 512, 768, 1, 8, "8 ranks, w column-major"},
    };
    bool ok = true;
    for (const Case& c : cases) {
      std::printf("check %lld x %lld x %lld, %d ranks (%s):\n", (long long)c.M, (long long)c.K,
                  (long long)c.N, c.n, c.why);
      const std::string why = tile_rs_unsupported(DType::kBF16, c.n, c.M / c.n, c.N, c.K,
                                                  nullptr, nullptr, nullptr);
      if (!why.empty()) {
        std::printf("  unsupported: %s\n", why.c_str());
        ok = false;
        continue;
      }
      if (!check(c.M, c.K, c.N, c.w_col, 4, c.n)) ok = false;
    }
    std::printf("TILE CHECK: %s\n", ok ? "PASSED" : "FAILED");
    return ok ? 0 : 1;
  }
  GemmRunner lt;
  if (std::string e = lt.init(); !e.empty()) {
    std::printf("cuBLASLt: %s\n", e.c_str());
    return 1;
  }
  std::printf("M x K x N (per device): ms (spread) of each variant, interleaved; solo = the "
              "best of its swizzles\n");
  double lp = 0, ls = 0;
  int shapes = 0;
  for (int i = 2; i + 2 < argc; i += 3, ++shapes) {
    auto [p, q] = time_shape(std::atoll(argv[i]), std::atoll(argv[i + 1]), std::atoll(argv[i + 2]), &lt);
    lp += std::log(p), ls += std::log(q);
  }
  if (shapes)
    std::printf("TILE geomean over %d shapes: plain / cuBLASLt %.3f, solo / cuBLASLt %.3f\n",
                shapes, std::exp(lp / shapes), std::exp(ls / shapes));
  return 0;
}
