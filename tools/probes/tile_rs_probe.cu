// Probe of the tile-fused GEMM + reduce-scatter's menu (ffi/kernels/tile_rs.cuh, tile_rs.cu) on
// ONE GPU.
//
//   check: n ranks of a group on one GPU (n = 2, 4, 8), each kernel on its own stream with 1/n of
//          the SMs (all must be resident: there is no time-slicing within a process), several
//          calls in a row (epochs, double-buffered staging, the claim counters' parity) -> each
//          rank's block against an f32 reference and bitwise equal across calls; every menu
//          entry, and ranks running different entries (the flag layout is the entry's own
//          business: one flag per 16 x 128 piece whatever the tile).
//   time FILE [--pick] [--plain] [--swizzle S] [--order O] [--json OUT]: the shapes of FILE (tools/shapes.py: "<set> <tp> M K N"
//          per line), one rank alone on all SMs, timed interleaved (BENCHMARKS.md) per shape:
//          the reference = the GEMM runner's searched cuBLASLt plan (ffi/runtime/gemm.h; XLA's
//          jnp.matmul is NOT timed here: the reference is cuBLASLt only), every entry as a plain
//          GEMM (mode 2) and solo (mode 1: the foreign tiles' stores and the own tiles' adds of
//          tp - 1 peer slabs, no waits or flags) and "prod" (mode 0, the production kernel, on
//          the emulated group: flags published, fences executed, own tiles' waits passing as
//          their peers' tiles are done; class Problem; "prod-legacy": the pick with the full
//          fence per foreign slab and its flags always a tile late, as before issue 24).
//          --pick: first a separate pass chooses each shape's entry with the production
//          selection (tile_rs_choose, empty cache), then the interleaved run times the pick
//          too. --swizzle S: the entries at raster band S (default 8). --plain: the reference
//          and mode 2 only (e.g. an experimental scheduler that cannot
//          run the protocol's order; solo and prod print as plain). Geomeans per set; judged
//          shapes 2 M K N >= 1e11. --order shuffle (default) | fixed: each round runs the variants
//          in a fresh random (seeded) order, or always in the order above. In the fixed order
//          the same launch (the pick = entry 0 at band 8) measured 0.972 of the reference at the
//          round's start and 1.045 late in it (8192 x 26624 x 16384, session 7 call 2; 0.956 /
//          1.119 in the evening's table): the GPU is power-capped on long K and a variant's time
//          depends on what ran before it.
//
//          TILE_PROBE_DECOMP=1: entry 0 also in modes 5, 3, 4, 6, 7 and 8 (tile_rs.h; where solo's
//          cost over plain sits; 7, 8: prod, solo WITH the own tiles' L2 prefetch), as "mode<k>:" JSON keys.
//          TILE_PROBE_DECOMP_ENTRY=k, TILE_PROBE_DECOMP_EPI=V: entry k (of this build's menu) with
//          epilogue variant V instead of entry 0 with 0 (e.g. the ping-pong entry, epi 4).
//
//   prof TP M K N: one launch of cuBLASLt's plan and of each entry plain and prod between
//          cudaProfilerStart/Stop (ncu --profile-from-start off), after two unprofiled rounds.
//          TILE_PROBE_PROF_EPI=V: every entry with TileRsArgs::epi = V (e.g. 4, the ping-pong
//          entries' TMA tensor stores; a cooperative entry ignores bits it does not compile).
//          TILE_PROBE_PROF_MODES=54: those modes (tile_rs.h's digits, in order) instead of 20.
//
// Build: tools/probes/build_tile_rs_probe.sh (CPU machine). Usage: tile_rs_probe check |
// tile_rs_probe time FILE [--pick] [--json OUT] | tile_rs_probe prof TP M K N
#include <cuda_bf16.h>
#include <cuda_profiler_api.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "runtime/gemm.h"
#include "kernels/comm.h"
#include "kernels/fill.h"
#include "kernels/tile_rs.h"
#include "runtime/tile_menu.h"
#include "probe_check.h"

using namespace jaxoverlap;

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
                     uint32_t* abort, ErrorRecord* err, int sms, int mode, int entry) {
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
  a.entry = entry;
  a.mode = mode;
  a.stall_rank = -1;
  a.op = kOpGemmRs;
  a.timeout_ns = 10ull * 1000 * 1000 * 1000;
  a.err = err;
  return a;
}

// n ranks on one GPU (each kernel on 1/n of the SMs), `calls` calls, rank r running menu entry
// entries[r] with epilogue variant epis[r] (TileRsArgs::epi; null: 0); false on a mismatch.
// *out0: rank 0's block of the first call.
bool check(int64_t M, int64_t K, int64_t N, int w_col, int calls, int n, const int* entries,
           std::vector<uint16_t>* out0, const int* epis = nullptr) {
  const int64_t m = M / n;
  int total_sms = 0;
  CK(cudaDeviceGetAttribute(&total_sms, cudaDevAttrMultiProcessorCount, 0));
  // Every rank's kernel must be resident at once (no time-slicing within a process): a cluster
  // of slack for the GPCs' cluster placement beyond two ranks (clusters of at most 2 CTAs).
  const int sms = (total_sms / n / 2 - (n > 2 ? 1 : 0)) * 2;
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
      TileRsArgs a = make_args(rk, r, n, m, N, K, w_col, abort, err, sms, 0, entries[r]);
      a.epi = epis ? epis[r] : 0;
      CK(launch_tile_rs(a, rk[r].stream));  // the kernel ends the call (release, epoch)
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
        if (!(rel < 1e-2) || r == 0)
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
  if (out0) *out0 = first[0];
  for (int r = 0; r < n; ++r) {
    cudaFree(rk[r].x), cudaFree(rk[r].w), cudaFree(rk[r].out), cudaFree(rk[r].stage);
    cudaFree(rk[r].flags), cudaStreamDestroy(rk[r].stream);
  }
  cudaFree(dref), cudaFreeHost(abort), cudaFreeHost(err);
  return ok;
}

// Median ms per launch of each variant, timed interleaved (BENCHMARKS.md): 7 rounds
// (TILE_PROBE_ROUNDS=R: R), each
// variant `reps` launches per round in turn (20, fewer for long launches: a round of one variant
// stays ~5 ms or more), after warm-up launches of each; spread = (max - min) / median of the 7.
struct Timed {
  float ms, spread;
};
bool kShuffle = true;  // time --order: a random order of the variants per round (or fixed)
std::vector<Timed> time_interleaved(const std::vector<std::function<void()>>& fns, cudaStream_t s,
                                    int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (const auto& f : fns)
    for (int i = 0; i < std::max(2, reps / 4); ++i) f();
  std::vector<std::vector<float>> ts(fns.size());
  std::vector<size_t> order(fns.size());
  const char* env_rounds = std::getenv("TILE_PROBE_ROUNDS");  // default 7
  const int rounds = env_rounds ? std::max(1, std::atoi(env_rounds)) : 7;
  for (int rep = 0; rep < rounds; ++rep) {
    for (size_t v = 0; v < fns.size(); ++v) order[v] = v;
    if (kShuffle) {
      std::mt19937 rng(7919u * (unsigned)rep + (unsigned)fns.size());
      std::shuffle(order.begin(), order.end(), rng);
    }
    for (size_t v : order) {
      CK(cudaEventRecord(a, s));
      for (int i = 0; i < reps; ++i) fns[v]();
      CK(cudaEventRecord(b, s));
      CK(cudaEventSynchronize(b));
      float ms;
      CK(cudaEventElapsedTime(&ms, a, b));
      ts[v].push_back(ms / reps);
    }
  }
  std::vector<Timed> out;
  for (auto& t : ts) {
    std::sort(t.begin(), t.end());
    out.push_back({t[t.size() / 2], (t.back() - t.front()) / t[t.size() / 2]});
  }
  cudaEventDestroy(a), cudaEventDestroy(b);
  return out;
}

struct Shape {
  std::string set;
  int tp;
  int64_t M, K, N;
  TileChoice pick;
  double choose_s = 0;
  bool picked = false;
};

// The emulated rank 0 of a group of tp (all peers' staging and flags one buffer of this rank:
// the foreign tiles' stores land there, the own tiles read tp - 1 slabs from it). In mode 0
// ("prod": the production kernel) the foreign tiles' flags land in the very slots the own tiles
// wait on (slot n - 1 - j for block j, slot src - 1 for source src: the same n - 1 slots), so
// every flag is published, every fence executed and every wait passes once its tile is done.
struct Problem {
  Rank rk[kMaxRanks];
  uint32_t* abort;
  ErrorRecord* err;
  int64_t m;
  Problem(const Shape& sh) {
    m = sh.M / sh.tp;
    CK(cudaHostAlloc(&abort, kAbortSlots * 4, cudaHostAllocMapped));
    for (uint32_t i = 0; i < kAbortSlots; ++i) abort[i] = i ^ 1u;
    CK(cudaHostAlloc(&err, sizeof(ErrorRecord), cudaHostAllocMapped));
    std::memset(err, 0, sizeof(ErrorRecord));
    Rank& r0 = rk[0];
    const int64_t stage = (sh.tp - 1) * tile_rs_slot_bytes(m, sh.N);
    CK(cudaMalloc(&r0.stage, stage));
    CK(cudaMalloc(&r0.flags, sizeof(Flags)));
    CK(cudaMemset(r0.flags, 0, sizeof(Flags)));
    CK(cudaMalloc(&r0.x, sh.M * sh.K * 2));
    CK(cudaMalloc(&r0.w, sh.K * sh.N * 2));
    CK(cudaMalloc(&r0.out, sh.M * sh.N * 2));
    fill(r0.x, sh.M * sh.K, 5);
    fill(r0.w, sh.K * sh.N, 7);
    CK(cudaMemset(r0.stage, 0, stage));  // flags included: no stale epochs
    for (int r = 1; r < sh.tp; ++r) rk[r] = r0;
    CK(cudaDeviceSynchronize());
  }
  ~Problem() {
    cudaFree(rk[0].stage), cudaFree(rk[0].flags), cudaFree(rk[0].x), cudaFree(rk[0].w);
    cudaFree(rk[0].out), cudaFreeHost(abort), cudaFreeHost(err);
  }
  TileRsArgs args(const Shape& sh, int sms, int mode, int entry, int swizzle, int legacy = 0,
                  int epi = 0) {
    TileRsArgs a = make_args(rk, 0, sh.tp, m, sh.N, sh.K, 0, abort, err, sms, mode, entry);
    a.swizzle = swizzle;
    a.epi = epi;
    a.legacy_publish = legacy;
    a.timeout_ns = 2ull * 1000 * 1000 * 1000;  // a wait that gives up shows within seconds
    return a;
  }
};

int kSwizzle = 8;  // jaxoverlap/fused/tile.py's DEFAULT_SWIZZLE (time --swizzle S: another)
constexpr int kEpiAll = kTileEpiLaneStores | kTileEpiBulkStores;

// TILE_PROBE_EPI="V:MODES ..." (e.g. "3:210 1:0"): every entry also with TileRsArgs::epi
// = V in each listed mode (2 plain, 1 solo, 0 prod, 9 plain without the epilogue's stores),
// timed in the same interleaved rounds; the summary gives each variant over the same entry's and
// mode's default (epi 0; mode 9: over plain).
struct EpiVariant {
  int epi;
  std::vector<int> modes;
};
std::vector<EpiVariant> epi_variants() {
  std::vector<EpiVariant> out;
  const char* env = std::getenv("TILE_PROBE_EPI");
  if (!env) return out;
  std::string s(env);
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && s[i] == ' ') ++i;
    size_t j = s.find(' ', i);
    if (j == std::string::npos) j = s.size();
    const std::string tok = s.substr(i, j - i);
    i = j;
    const size_t c = tok.find(':');
    if (tok.empty() || c == std::string::npos) continue;
    EpiVariant v{std::atoi(tok.substr(0, c).c_str()), {}};
    for (char ch : tok.substr(c + 1))
      if ((ch >= '0' && ch <= '2') || ch == '9') v.modes.push_back(ch - '0');
    out.push_back(v);
  }
  return out;
}

const char* mode_name(int mode) {
  return mode == 2 ? "plain" : mode == 1 ? "solo" : mode == 0 ? "prod" : "nostore";
}

double geomean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += std::log(x);
  return v.empty() ? NAN : std::exp(s / v.size());
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach a log even if the run is cut short
  CK(cudaSetDevice(0));
  const int E = tile_rs_menu_size();
  for (int e = 0; e < E; ++e)
    for (bool wc : {false, true}) CK(preload_tile_entry(e, wc));
  CK(preload_comm_kernels());
  // This file's kernels too: a module loaded lazily while a rank's kernel spins on its peer
  // waits for that kernel, whose peer is launched only after the load (seen: the first check
  // timed out; DESIGN.md's decision 5).
  cudaFuncAttributes attr;
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
        {2048, 1032, 1000, 0, 2, "K % 64 != 0, N % 256 != 0, N % 128 != 0 (partial tiles)"},
        {1024, 256, 640, 0, 2, "fewer tiles than CTAs, N an odd number of 128-column tiles"},
        {8192, 2048, 4096, 0, 2, "many tiles per CTA"},
        {4096, 1024, 1280, 0, 4, "4 ranks: three peers' slabs summed in rank order"},
        {8192, 512, 768, 1, 8, "8 ranks, w column-major"},
        {4096, 1032, 1160, 1, 4, "4 ranks, w column-major, partial tiles in N and K"},
    };
    bool ok = true;
    for (const Case& c : cases) {
      const std::string why = tile_rs_unsupported(DType::kBF16, c.n, c.M / c.n, c.N, c.K,
                                                  nullptr, nullptr, nullptr);
      if (!why.empty()) {
        std::printf("check %lld x %lld x %lld: unsupported: %s\n", (long long)c.M,
                    (long long)c.K, (long long)c.N, why.c_str());
        ok = false;
        continue;
      }
      std::vector<uint16_t> out0, got;
      for (int e = -2; e < E; ++e) {  // -2: rank r runs entry r % E; -1: entry E - 1 - r % E
        int entries[kMaxRanks];
        for (int r = 0; r < c.n; ++r) entries[r] = e == -2 ? r % E : e == -1 ? E - 1 - r % E : e;
        std::printf("check %lld x %lld x %lld, %d ranks (%s), %s%s:\n", (long long)c.M,
                    (long long)c.K, (long long)c.N, c.n, c.why, e < 0 ? "mixed entries " : "entry ",
                    e == -2 ? "r % menu" : e == -1 ? "last - r % menu" : tile_rs_entry_name(e));
        if (!check(c.M, c.K, c.N, c.w_col, 4, c.n, entries, &got)) ok = false;
        if (e == -2) out0 = got;
        else if (got != out0)  // a fact worth knowing, not a failure
          std::printf("  note: entry %s's bits differ from rank 0's of the mixed run\n",
                      tile_rs_entry_name(e));
        if (e == -1) continue;
        // The epilogue's variants (every kTileEpi* bit: the other store path) change no value:
        // the same bits as the default. Mixed
        // entries: the odd ranks run them; one entry: every rank.
        // (kTileEpiTensorStores overrides the other store bits: passes of their own; the TMA loads
        // with the lanes' stores. A default build's ping-pong kernels ignore every bit -- one
        // store path, JAXOVERLAP_TILE_PP_TENSOR_ONLY -- so for them these passes repeat epi 0.)
        for (int var : {kEpiAll, (int)kTileEpiTensorStores,
                        (int)(kTileEpiTensorLoads | kTileEpiLaneStores)}) {
          int epis[kMaxRanks];
          for (int r = 0; r < c.n; ++r) epis[r] = e == -2 && r % 2 == 0 ? 0 : var;
          std::vector<uint16_t> got2;
          std::printf("  the same with epi %d on %s:\n", var,
                      e == -2 ? "odd ranks" : "every rank");
          if (!check(c.M, c.K, c.N, c.w_col, 4, c.n, entries, &got2, epis)) ok = false;
          if (got2 != got) {
            std::printf("  rank 0's bits differ with the epilogue variants (must not)\n");
            ok = false;
          }
        }
      }
    }
    std::printf("TILE CHECK (%d entries): %s\n", E, ok ? "PASSED" : "FAILED");
    return ok ? 0 : 1;
  }
  const bool prof = what == "prof" && argc >= 6;
  if (!prof && (what != "time" || argc < 3)) {
    std::printf("usage: tile_rs_probe check | time FILE [--pick] [--json OUT] | prof TP M K N\n");
    return 2;
  }
  GemmRunner lt;
  if (std::string e = lt.init(); !e.empty()) {
    std::printf("cuBLASLt: %s\n", e.c_str());
    return 1;
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  if (prof) {  // one launch of each variant between profiler marks
    Shape sh{"prof", std::atoi(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]),
             std::atoll(argv[5])};
    Problem p(sh);
    const GemmShape gs{sh.M, sh.N, sh.K, DType::kBF16, false, 0, false};
    const char* env_epi = std::getenv("TILE_PROBE_PROF_EPI");
    const int epi = env_epi ? std::atoi(env_epi) : 0;
    // TILE_PROBE_PROF_MODES=54 (tile_rs.h's one-digit modes in that order, as TILE_PROBE_EPI
    // lists them; other characters are skipped; default 20): e.g. what separates mode 4 from
    // mode 5 (docs/tile-schedule.md, session 13's next levers)
    std::vector<int> modes = {2, 0};
    if (const char* env = std::getenv("TILE_PROBE_PROF_MODES")) {
      modes.clear();
      for (const char* c = env; *c; ++c)
        if (*c >= '0' && *c <= '9') modes.push_back(*c - '0');
      if (modes.empty()) {
        std::printf("TILE_PROBE_PROF_MODES: no mode digit in %s\n", env);
        return 2;
      }
    }
    auto run_all = [&] {
      if (std::string e = lt.run(gs, p.rk[0].x, p.rk[0].w, nullptr, p.rk[0].out, s); !e.empty())
        std::printf("cuBLASLt: %s\n", e.c_str());
      for (int mode : modes)
        for (int e = 0; e < E; ++e) {
          CK(launch_tile_rs(p.args(sh, sms, mode, e, kSwizzle, 0, epi), s));
        }
      CK(cudaStreamSynchronize(s));
    };
    run_all();  // the plan search, loads, warm-up
    run_all();
    CK(cudaProfilerStart());
    std::printf("profiled (epi %d): cuBLASLt, then each entry in mode", epi);
    for (int mode : modes) std::printf(" %d", mode);
    std::printf(" (in that order):");
    for (int e = 0; e < E; ++e) std::printf(" %s", tile_rs_entry_name(e));
    std::printf("\n");
    run_all();
    CK(cudaProfilerStop());
    if (p.err->set) std::printf("prod: a wait gave up\n");
    return 0;
  }
  bool pick = false, plain_only = false;  // --plain: the reference and mode 2 only
  const char* json = nullptr;
  for (int i = 3; i < argc; ++i) {
    if (std::string(argv[i]) == "--pick") pick = true;
    if (std::string(argv[i]) == "--plain") plain_only = true;
    if (std::string(argv[i]) == "--swizzle" && i + 1 < argc) kSwizzle = std::atoi(argv[++i]);
    if (std::string(argv[i]) == "--json" && i + 1 < argc) json = argv[++i];
    if (std::string(argv[i]) == "--order" && i + 1 < argc)
      kShuffle = std::string(argv[++i]) != "fixed";
  }
  std::vector<Shape> shapes;
  {
    FILE* f = std::fopen(argv[2], "r");
    if (!f) {
      std::printf("cannot read %s\n", argv[2]);
      return 2;
    }
    char set[64];
    int tp;
    long long M, K, N;
    while (std::fscanf(f, "%63s %d %lld %lld %lld", set, &tp, &M, &K, &N) == 5) {
      const std::string why =
          tile_rs_unsupported(DType::kBF16, tp, M / tp, N, K, nullptr, nullptr, nullptr);
      if (!why.empty() || M % tp) {
        std::printf("skipped %s %d %lld %lld %lld: %s\n", set, tp, M, K, N, why.c_str());
        continue;
      }
      shapes.push_back(Shape{set, tp, M, K, N});
    }
    std::fclose(f);
  }
  if (pick) {  // the selection pass: production's tile_rs_choose, an empty cache per run
    char dir[] = "/tmp/tile_rs_probe_cacheXXXXXX";
    if (!mkdtemp(dir)) {
      std::printf("mkdtemp failed\n");
      return 1;
    }
    std::printf("selection pass (tile_rs_choose, cache %s):\n", dir);
    for (Shape& sh : shapes) {
      Problem p(sh);
      TileRsArgs a = p.args(sh, sms, 0, 0, kSwizzle);
      const auto t0 = std::chrono::steady_clock::now();
      tile_rs_choose(a, s, true, true, dir, &sh.pick);
      CK(cudaStreamSynchronize(s));
      sh.choose_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      sh.picked = true;
      std::printf("  %s tp %d %lld x %lld x %lld: %s sw %d (%d timed, %.2f s; %.3f ms vs "
                  "entry 0 %.3f ms)%s%s\n",
                  sh.set.c_str(), sh.tp, (long long)sh.M, (long long)sh.K, (long long)sh.N,
                  tile_rs_entry_name(sh.pick.entry), sh.pick.swizzle, sh.pick.timed, sh.choose_s,
                  sh.pick.ms, sh.pick.ms_default, sh.pick.note.empty() ? "" : ": ",
                  sh.pick.note.c_str());
    }
  }
  std::printf("\nper shape, ms (median of 7 interleaved rounds; spread %%): reference = searched "
              "cuBLASLt only (XLA's jnp.matmul not timed here); entries at swizzle %d\n",
              kSwizzle);
  FILE* jf = json ? std::fopen(json, "w") : nullptr;
  if (jf) {  // BENCHMARKS.md "One-GPU rows": the benchmarks' object format, one row per shape
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, 0));
    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%S+00:00", std::gmtime(&now));
    std::fprintf(jf,
                 "{\"machine\": \"1x %s\", \"date\": \"%s\", \"tool\": "
                 "\"tools/probes/tile_rs_probe.cu time --pick\", \"timing\": \"CUDA events; "
                 "variants of one shape interleaved, 7 rounds of up to 20 launches each; ms = median "
                 "of the rounds; reference = the GEMM runner's searched cuBLASLt plan only (XLA's "
                 "jnp.matmul not timed); plain = mode 2, solo = mode 1, prod = mode 0 on the emulated "
                 "group; entries at swizzle %d, the pick at its own\", \"order\": \"%s\", "
                 "\"rows\": [\n",
                 prop.name, date, kSwizzle, kShuffle ? "shuffle" : "fixed");
  }
  struct Agg {
    std::vector<double> best, e0, pplain, psolo, pprod, solo_plain, prod_plain, legacy_plain;
    std::vector<double> pick_epi_plain, pick_epi_prod;  // the pick over its entry at epi 0
    std::vector<std::vector<double>> plain_e, prod_e;  // per entry: plain/ref, prod/ref
    std::vector<std::pair<std::string, std::vector<double>>> epi;  // variant / default
    std::vector<double>& epi_row(const std::string& k) {
      for (auto& [name, v] : epi)
        if (name == k) return v;
      epi.push_back({k, {}});
      return epi.back().second;
    }
  };
  const std::vector<EpiVariant> evs = epi_variants();
  std::vector<std::pair<std::string, Agg>> sets;  // in order of appearance
  std::vector<std::pair<std::string, Agg>> judged;
  auto agg = [](std::vector<std::pair<std::string, Agg>>& v, const std::string& k) -> Agg& {
    for (auto& [name, a] : v)
      if (name == k) return a;
    v.push_back({k, Agg{}});
    return v.back().second;
  };
  std::vector<int> wins(E, 0);
  bool first_row = true;
  for (Shape& sh : shapes) {
    Problem p(sh);
    const GemmShape gs{sh.M, sh.N, sh.K, DType::kBF16, false, 0, false};
    if (std::string e = lt.run(gs, p.rk[0].x, p.rk[0].w, nullptr, p.rk[0].out, s); !e.empty()) {
      std::printf("cuBLASLt: %s\n", e.c_str());
      return 1;
    }
    auto tile = [&](int mode, int entry, int swizzle, int legacy = 0,
                    int epi = 0) -> std::function<void()> {
      TileRsArgs a = p.args(sh, sms, mode, entry, swizzle, legacy, epi);
      return [&, a] {  // the kernel ends each call (the emulated peers' release, the epoch)
        CK(launch_tile_rs(a, s));
      };
    };
    std::vector<std::function<void()>> fns = {
        [&] { lt.run(gs, p.rk[0].x, p.rk[0].w, nullptr, p.rk[0].out, s); }};
    for (int e = 0; e < E; ++e) fns.push_back(tile(2, e, kSwizzle));
    for (int e = 0; e < E && !plain_only; ++e) fns.push_back(tile(1, e, kSwizzle));
    for (int e = 0; e < E && !plain_only; ++e) fns.push_back(tile(0, e, kSwizzle));
    if (sh.picked && !plain_only) {
      fns.push_back(tile(2, sh.pick.entry, sh.pick.swizzle, 0, sh.pick.epi));
      fns.push_back(tile(1, sh.pick.entry, sh.pick.swizzle, 0, sh.pick.epi));
      fns.push_back(tile(0, sh.pick.entry, sh.pick.swizzle, 0, sh.pick.epi));
      fns.push_back(tile(0, sh.pick.entry, sh.pick.swizzle, 1, sh.pick.epi));  // fence, tile late
      // the pick's entry and swizzle with the default epilogue: what the epi choice bought
      fns.push_back(tile(2, sh.pick.entry, sh.pick.swizzle));
      fns.push_back(tile(0, sh.pick.entry, sh.pick.swizzle));
    }
    // TILE_PROBE_EPI: every entry with each variant in its modes
    const size_t epi_at = fns.size();
    for (const EpiVariant& v : evs)
      for (int mode : v.modes)
        for (int e = 0; e < E; ++e) fns.push_back(tile(mode, e, kSwizzle, 0, v.epi));
    // TILE_PROBE_DECOMP set: entry 0 also in modes 5 (plain in the fused op's block order), 3
    // (solo without the own tiles' adds), 4 (3 with the foreign tiles into out), 6 (= 4 since
    // production dropped the own tiles' L2 prefetch), 7 and 8 (prod and solo with that prefetch):
    // where solo's cost over plain sits (block order, staging stores, the own tiles' store path,
    // their peer loads and adds) and what the prefetch costs the fused op.
    static constexpr int kDecompModes[] = {5, 3, 4, 6, 7, 8};
    constexpr int kDecomp = sizeof(kDecompModes) / sizeof(kDecompModes[0]);
    const size_t decomp = std::getenv("TILE_PROBE_DECOMP") ? fns.size() : 0;
    const char* env_de = std::getenv("TILE_PROBE_DECOMP_ENTRY");
    const char* env_dv = std::getenv("TILE_PROBE_DECOMP_EPI");
    const int de = env_de ? std::atoi(env_de) : 0, dv = env_dv ? std::atoi(env_dv) : 0;
    if (de < 0 || de >= E) {
      std::printf("TILE_PROBE_DECOMP_ENTRY=%d: this build's menu has %d entries\n", de, E);
      return 2;
    }
    if (decomp)
      for (int mode : kDecompModes) fns.push_back(tile(mode, de, kSwizzle, 0, dv));
    const auto t0 = std::chrono::steady_clock::now();
    // ~5 ms per round of a variant (the reference's time from one timed launch)
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    fns[0]();
    CK(cudaEventRecord(a, s));
    fns[0]();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float est = 1;
    CK(cudaEventElapsedTime(&est, a, b));
    cudaEventDestroy(a), cudaEventDestroy(b);
    const int reps = std::max(2, std::min(20, (int)(5.0f / std::max(est, 1e-3f))));
    const std::vector<Timed> t = time_interleaved(fns, s, reps);
    const double ref = t[0].ms;
    int best = 0;
    for (int e = 1; e < E; ++e)
      if (t[1 + e].ms < t[1 + best].ms) best = e;
    ++wins[best];
    const double flop = 2.0 * sh.M * sh.K * sh.N;
    std::printf("%-9s tp %d %6lld x %6lld x %6lld %.1e | ref %.3f (%.0f%%) | plain", sh.set.c_str(),
                sh.tp, (long long)sh.M, (long long)sh.K, (long long)sh.N, flop, ref,
                100 * t[0].spread);
    for (int e = 0; e < E; ++e) std::printf(" %.3f", t[1 + e].ms / ref);
    // --plain: solo and prod print as the plain times (not timed)
    const int so = plain_only ? 0 : E, po = plain_only ? 0 : 2 * E;
    std::printf(" | solo");
    for (int e = 0; e < E; ++e) std::printf(" %.3f", t[1 + so + e].ms / ref);
    std::printf(" | prod");
    for (int e = 0; e < E; ++e) std::printf(" %.3f", t[1 + po + e].ms / ref);
    std::printf(" | best plain %s %.3f", tile_rs_entry_name(best), t[1 + best].ms / ref);
    double pp = 0, ps = 0, pq = 0, pl = 0;
    if (sh.picked && !plain_only) {
      pp = t[1 + 3 * E].ms / ref, ps = t[2 + 3 * E].ms / ref, pq = t[3 + 3 * E].ms / ref;
      pl = t[4 + 3 * E].ms / ref;
      std::printf(" | pick %s sw%d epi%d plain %.3f solo %.3f prod %.3f prod-legacy %.3f "
                  "(epi0: plain %.3f prod %.3f)",
                  tile_rs_entry_name(sh.pick.entry), sh.pick.swizzle, sh.pick.epi, pp, ps, pq, pl,
                  t[5 + 3 * E].ms / ref, t[6 + 3 * E].ms / ref);
    }
    {
      size_t i = epi_at;
      for (const EpiVariant& v : evs)
        for (int mode : v.modes) {
          std::printf(" | epi%d %s", v.epi, mode_name(mode));
          for (int e = 0; e < E; ++e) std::printf(" %.3f", t[i++].ms / ref);
        }
    }
    if (decomp)
      for (int i = 0; i < kDecomp; ++i)
        std::printf("%s%d %.3f", i ? " " : " | decomp mode", kDecompModes[i], t[decomp + i].ms / ref);
    std::printf(" | %.1f s\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (p.err->set)
      std::printf("  prod: a wait gave up: what %d peer %d flag %d (saw %u want %u)\n", p.err->what,
                  p.err->peer, p.err->chunk, p.err->seen, p.err->target);
    for (auto* v : {&sets, &judged}) {
      if (v == &judged && flop < 1e11) continue;
      Agg& g = agg(*v, sh.set);
      g.plain_e.resize(E), g.prod_e.resize(E);
      for (int e = 0; e < E; ++e) {
        g.plain_e[e].push_back(t[1 + e].ms / ref);
        g.prod_e[e].push_back(t[1 + po + e].ms / ref);
      }
      g.best.push_back(t[1 + best].ms / ref);
      g.e0.push_back(t[1].ms / ref);
      if (sh.picked && !plain_only) {
        g.pplain.push_back(pp), g.psolo.push_back(ps), g.pprod.push_back(pq);
        g.solo_plain.push_back(ps / pp), g.prod_plain.push_back(pq / pp);
        g.legacy_plain.push_back(pl / pp);
        g.pick_epi_plain.push_back(t[1 + 3 * E].ms / t[5 + 3 * E].ms);
        g.pick_epi_prod.push_back(t[3 + 3 * E].ms / t[6 + 3 * E].ms);
      }
      size_t i = epi_at;
      for (const EpiVariant& v : evs)
        for (int mode : v.modes)
          for (int e = 0; e < E; ++e, ++i) {
            const size_t base = plain_only && mode != 2 ? 1 + e
                                : 1 + (mode == 2 || mode == 9 ? 0 : mode == 1 ? so : po) + e;
            char key[96];
            std::snprintf(key, sizeof(key), "epi%d %s %s", v.epi, mode_name(mode),
                          tile_rs_entry_name(e));
            g.epi_row(key).push_back(t[i].ms / t[base].ms);
          }
    }
    if (jf) {
      std::fprintf(jf,
                   "%s  {\"op\": \"matmul_reduce_scatter\", \"tp\": %d, \"dtype\": \"bfloat16\", "
                   "\"M\": %lld, \"K_local\": %lld, \"N\": %lld, \"set\": \"%s\", \"pick\": "
                   "\"%s\", \"swizzle\": %d, \"choose_s\": %.3f, \"ms\": {\"reference\": %.5f",
                   first_row ? "" : ",\n", sh.tp, (long long)sh.M, (long long)sh.K,
                   (long long)sh.N, sh.set.c_str(),
                   sh.picked ? tile_rs_entry_name(sh.pick.entry) : "",
                   sh.picked ? sh.pick.swizzle : 0,
                   sh.choose_s, ref);
      if (sh.picked && !plain_only)
        std::fprintf(jf, ", \"plain\": %.5f, \"solo\": %.5f, \"prod\": %.5f, \"prod-legacy\": %.5f",
                     t[1 + 3 * E].ms, t[2 + 3 * E].ms, t[3 + 3 * E].ms, t[4 + 3 * E].ms);
      for (int e = 0; e < E; ++e)
        std::fprintf(jf, ", \"plain:%s\": %.5f, \"solo:%s\": %.5f, \"prod:%s\": %.5f",
                     tile_rs_entry_name(e), t[1 + e].ms, tile_rs_entry_name(e), t[1 + so + e].ms,
                     tile_rs_entry_name(e), t[1 + po + e].ms);
      if (decomp)
        for (int i = 0; i < kDecomp; ++i)
          std::fprintf(jf, ", \"mode%d:%s:epi%d\": %.5f", kDecompModes[i], tile_rs_entry_name(de),
                       dv, t[decomp + i].ms);
      if (sh.picked && !plain_only)
        std::fprintf(jf, ", \"pick-epi\": %d, \"plain-epi0\": %.5f, \"prod-epi0\": %.5f",
                     sh.pick.epi, t[5 + 3 * E].ms, t[6 + 3 * E].ms);
      size_t i = epi_at;
      for (const EpiVariant& v : evs)
        for (int mode : v.modes)
          for (int e = 0; e < E; ++e)
            std::fprintf(jf, ", \"%s:%s:epi%d\": %.5f", mode_name(mode), tile_rs_entry_name(e),
                         v.epi, t[i++].ms);
      std::fprintf(jf, "}}");
      std::fflush(jf);  // the rows so far survive a run cut short
      first_row = false;
    }
  }
  if (jf) std::fprintf(jf, "\n]}\n"), std::fclose(jf);
  std::printf("\nbest plain entry per shape:");
  for (int e = 0; e < E; ++e) std::printf(" %s %d", tile_rs_entry_name(e), wins[e]);
  std::printf("\n");
  for (auto* v : {&sets, &judged})
    for (auto& [name, g] : *v)
      std::printf("TILE geomean %-9s %-6s (%2zu shapes): entry0 plain/ref %.3f, best plain/ref "
                  "%.3f | pick: plain/ref %.3f solo/ref %.3f prod/ref %.3f solo/plain %.3f "
                  "prod/plain %.3f prod-legacy/plain %.3f\n",
                  name.c_str(), v == &judged ? "judged" : "all", g.best.size(), geomean(g.e0),
                  geomean(g.best), geomean(g.pplain), geomean(g.psolo), geomean(g.pprod),
                  geomean(g.solo_plain), geomean(g.prod_plain), geomean(g.legacy_plain));
  for (auto& [name, g] : judged)
    std::printf("TILE pick-epi %-9s judged (%2zu shapes): pick / its entry at epi 0: plain %.3f "
                "prod %.3f\n",
                name.c_str(), g.pick_epi_prod.size(), geomean(g.pick_epi_plain),
                geomean(g.pick_epi_prod));
  for (auto& [name, g] : judged)
    for (auto& [key, v] : g.epi)
      std::printf("TILE epi %-9s judged %-28s (%2zu shapes): variant / default %.3f (min %.3f "
                  "max %.3f)\n",
                  name.c_str(), key.c_str(), v.size(), geomean(v),
                  *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end()));
  {  // over every judged shape of every set (a variant's effect; the sets stay apart above)
    std::vector<std::pair<std::string, std::vector<double>>> all;
    for (auto& [name, g] : judged)
      for (auto& kv : g.epi) {
        const std::string& key = kv.first;
        const std::vector<double>& v = kv.second;
        auto it = std::find_if(all.begin(), all.end(), [&](auto& x) { return x.first == key; });
        if (it == all.end()) all.push_back({key, v});
        else it->second.insert(it->second.end(), v.begin(), v.end());
      }
    for (auto& [key, v] : all)
      std::printf("TILE epi all-sets  judged %-28s (%2zu shapes): variant / default %.3f (min "
                  "%.3f max %.3f)\n",
                  key.c_str(), v.size(), geomean(v), *std::min_element(v.begin(), v.end()),
                  *std::max_element(v.begin(), v.end()));
  }
  for (auto* v : {&sets, &judged})
    for (auto& [name, g] : *v)
      for (int e = 0; e < E && e < (int)g.plain_e.size(); ++e)
        std::printf("TILE entry %-14s %-9s %-6s (%2zu shapes): plain/ref %.3f prod/ref %.3f "
                    "prod/plain %.3f\n",
                    tile_rs_entry_name(e), name.c_str(), v == &judged ? "judged" : "all",
                    g.plain_e[e].size(), geomean(g.plain_e[e]), geomean(g.prod_e[e]),
                    geomean(g.prod_e[e]) / geomean(g.plain_e[e]));
  cudaStreamDestroy(s);
  return 0;
}
