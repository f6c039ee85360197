// Live ranks of the tile-fused GEMM + reduce-scatter on ONE GPU, as a shared library
// (build/probes/libtile_live.so, driven by tools/probes/tile_live.py through ctypes):
//
//   tl_canary  the race canary (issues 24.3, 25.2): two ranks of one group as concurrent kernels
//              in this process, each on its own stream and half the SMs, `calls` calls, rank 1
//              launched late by 0 / 25 / 50 us (a delay kernel on its stream; the delay rotates
//              per call). Every call's inputs are made so that each peer's 16 x 128 piece of a
//              slab has a known value f(epoch, source, block, piece): small integers, exact in
//              bf16 and in the f32 sum, different from every earlier epoch's -- so a stale
//              (previous-epoch), torn or misplaced slab is a wrong value. Each rank's output is
//              checked on the device after every call. Covers the tile kernel (every menu entry,
//              w row- and column-major) and the standalone reduce-scatter's comm kernel (the
//              reduce-push schedule and the senders/receivers schedule at n = 2).
//   tl_live    live waits (issue 24.3): per shape, the two ranks (n = 2) running the production
//              kernel (mode 0) at the same time on half the SMs each, against two cuBLASLt GEMMs
//              of the same per-rank problem at the same time (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET
//              = half the SMs each, the GEMM runner's searched plan), and against the same pair
//              in mode 1 (the same GEMM and traffic without flags or waits). Rank 1 launched 0 /
//              25 / 50 us late. Per call: the pair's makespan (first launch to both done) and
//              each rank's kernel time from its own start; the own-tile wait time is NOT
//              measured inside the kernel (no instrumentation there): its proxy is the rank's
//              mode-0 time minus its mode-1 time in the same interleaved rounds.
//   tl_ref_*   one shape's timing core for tools/probes/tile_live.py's reference table: the
//              GEMM runner's searched cuBLASLt plan, the production selection's pick as a plain
//              GEMM (mode 2), solo (mode 1) and prod (mode 0 on the emulated group, as
//              tile_rs_probe.cu's Problem), entry 0; the Python side times XLA's jnp.matmul in
//              the same rounds (BENCHMARKS.md "On one GPU": reference = the faster of the two).
//
// Build: tools/probes/build_tile_live.sh (links the native build's objects).
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/ce.h"
#include "kernels/comm.h"
#include "kernels/fill.h"
#include "kernels/tile_rs.h"
#include "runtime/gemm.h"
#include "runtime/tile_menu.h"
#include "probe_check.h"

using namespace jaxoverlap;

namespace {

constexpr int kSwizzle = 8;  // jaxoverlap/fused/tile.py's DEFAULT_SWIZZLE
constexpr int kDelaysUs[3] = {0, 25, 50};

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__global__ void delay_kernel(uint64_t ns) {
  const uint64_t t0 = global_ns();
  while (global_ns() - t0 < ns) {
  }
}
// Every call ends with the library's finish (launch_finish, kernels/comm.h), as a handler's
// does: it advances the epoch AND zeroes the next call's ticket counter (Flags::claim), which
// the reduce-push CTAs count their places in (issue 26, R6). This file's own finish once only
// advanced the epoch: from the third call on the reduce-push CTAs drew tickets past the grid
// and the comm canary hung (issue 25; helper Q's calls 1-2 of 2026-12-02).

// The canary's value of source `src`'s piece `piece` of row block `blk` in the call with epoch
// target e: an integer in [1, 61], so a sum of two is exact in bf16 (< 256) and in f32, and
// f(e) != f(e - 1), f(e - 2) for every piece (37 and 74 are not multiples of 61).
__host__ __device__ inline int canary_value(uint32_t e, int src, int blk, int64_t piece) {
  return (int)((e * 37u + (uint32_t)src * 11u + (uint32_t)blk * 5u + (uint32_t)(piece * 3)) % 61u) +
         1;
}

// Tile kernel inputs: x[i, k] = f(e, src, i / m, (i % m) / 16 * fc + k) for k < fc (fc = flag
// columns, N / 128 rounded up), else 0; w[k, j] = (k == j / 128), so (x @ w)[i, j] = x[i, j/128]:
// one value per 16 x 128 piece of a slab, the unit the kernel publishes.
__global__ void canary_fill_x(__nv_bfloat16* x, int64_t rows, int64_t K, int64_t m, int fc,
                              uint32_t e, int src) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * K;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = i / K, k = i % K;
    const int blk = (int)(row / m);
    const float v = k < fc ? (float)canary_value(e, src, blk, (row % m) / 16 * fc + k) : 0.f;
    x[i] = __float2bfloat16(v);
  }
}
__global__ void canary_fill_w(__nv_bfloat16* w, int64_t K, int64_t N, int col_major) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < K * N;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t k = col_major ? i % K : i / N, j = col_major ? i / K : i % N;
    w[i] = __float2bfloat16(k == j / kFlagCols ? 1.f : 0.f);
  }
}
// Comm and copy-engine inputs: elements [offset, offset + count) of a source's n row blocks of
// `elems` each, p[i] = f(e, src, block, (index in the block) / 1024).
__global__ void canary_fill_blocks(__nv_bfloat16* p, int64_t count, int64_t elems, int64_t offset,
                                   uint32_t e, int src) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t q = offset + i;
    p[i] = __float2bfloat16((float)canary_value(e, src, (int)(q / elems), (q % elems) / 1024));
  }
}

struct Miss {
  unsigned long long count;  // wrong elements, all calls
  int32_t first_set, call, rank, kind;
  int64_t row, col;
  float got, want;
};

// kind 0: tile output [m, N] of rank r (sum over n sources of the piece's value); kind 1: comm
// output [elems] of rank r.
__global__ void canary_check(const __nv_bfloat16* out, int64_t m, int64_t N, int fc, uint32_t e,
                             int r, int n, int kind, int call, Miss* miss) {
  const int64_t total = m * N;
  unsigned long long bad = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    int want = 0;
    for (int s = 0; s < n; ++s)
      want += kind == 0 ? canary_value(e, s, r, (i / N) / 16 * fc + (i % N) / kFlagCols)
                        : canary_value(e, s, r, i / 1024);
    const float got = __bfloat162float(out[i]);
    if (got != (float)want) {
      ++bad;
      if (atomicCAS(&miss->first_set, 0, 1) == 0) {
        miss->call = call, miss->rank = r, miss->kind = kind;
        miss->row = kind == 0 ? i / N : i, miss->col = kind == 0 ? i % N : 0;
        miss->got = got, miss->want = (float)want;
      }
    }
  }
  if (bad) atomicAdd(&miss->count, bad);
}

// The GEMM runner of this process (tl_init makes it): plans per shape and SM-count target.
GemmRunner* g_runner = nullptr;
GemmRunner& runner() { return *g_runner; }

int grid_for(int64_t elems) { return (int)std::min<int64_t>(1024, (elems + 255) / 256); }

int device_sms() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return sms;
}

// Host-mapped abort ring and error record of a group (tile_rs_probe.cu's set-up).
struct HostWords {
  uint32_t* abort = nullptr;
  ErrorRecord* err = nullptr;
  HostWords() {
    CK(cudaHostAlloc(&abort, kAbortSlots * 4, cudaHostAllocMapped));
    for (uint32_t i = 0; i < kAbortSlots; ++i) abort[i] = i ^ 1u;
    CK(cudaHostAlloc(&err, sizeof(ErrorRecord), cudaHostAllocMapped));
    std::memset(err, 0, sizeof(ErrorRecord));
  }
  ~HostWords() { cudaFreeHost(abort), cudaFreeHost(err); }
  bool report(const char* where) const {
    if (!err->set) return false;
    std::printf("  %s: a wait gave up: rank %d peer %d what %d chunk %d (flag %u want %u)\n", where,
                err->rank, err->peer, err->what, err->chunk, err->seen, err->target);
    return true;
  }
};

// Two in-process ranks of one group (n = 2): staging of one peer slot of `slot_bytes`, flags and
// a stream each, the group's host words.
struct Ranks2 {
  static constexpr int n = 2;
  char* stage[n];
  Flags* flags[n];
  cudaStream_t s[n];
  HostWords hw;
  explicit Ranks2(int64_t slot_bytes) {
    for (int r = 0; r < n; ++r) {
      CK(cudaMalloc(&stage[r], (n - 1) * slot_bytes));
      CK(cudaMemset(stage[r], 0, (n - 1) * slot_bytes));
      CK(cudaMalloc(&flags[r], sizeof(Flags)));
      CK(cudaMemset(flags[r], 0, sizeof(Flags)));
      CK(cudaStreamCreateWithFlags(&s[r], cudaStreamNonBlocking));
    }
  }
  ~Ranks2() {
    for (int r = 0; r < n; ++r) cudaFree(stage[r]), cudaFree(flags[r]), cudaStreamDestroy(s[r]);
  }
  Peers peers(int r) const {
    Peers p{};
    p.n = n, p.rank = r, p.device = 0;
    for (int i = 0; i < n; ++i) p.stage[i] = stage[i], p.flags[i] = flags[i];
    p.abort = hw.abort;
    return p;
  }
  // One call's start: both streams begin together (each waits for the other's previous work).
  void join(cudaEvent_t a, cudaEvent_t b) {
    CK(cudaEventRecord(a, s[0]));
    CK(cudaStreamWaitEvent(s[1], a));
    CK(cudaEventRecord(b, s[1]));
    CK(cudaStreamWaitEvent(s[0], b));
  }
};

// The tile kernel's pair: per rank x [2m, K], w [K, N] (and a column-major copy), out [2m, N] (a
// cuBLASLt GEMM's whole product; the tile kernel writes the first m rows).
struct Pair : Ranks2 {
  int64_t m, N, K;
  __nv_bfloat16 *x[n], *w[n], *wc[n] = {}, *out[n];
  Pair(int64_t m_, int64_t N_, int64_t K_, bool col_copy)
      : Ranks2(tile_rs_slot_bytes(m_, N_)), m(m_), N(N_), K(K_) {
    for (int r = 0; r < n; ++r) {
      CK(cudaMalloc(&x[r], n * m * K * 2));
      CK(cudaMalloc(&w[r], K * N * 2));
      if (col_copy) CK(cudaMalloc(&wc[r], K * N * 2));
      CK(cudaMalloc(&out[r], n * m * N * 2));
      CK(launch_fill_uniform(x[r], n * m * K, FillType::kBF16, 31 + r, nullptr));
      CK(launch_fill_uniform(w[r], K * N, FillType::kBF16, 47 + r, nullptr));
    }
    CK(cudaDeviceSynchronize());
  }
  ~Pair() {
    for (int r = 0; r < n; ++r) {
      cudaFree(x[r]), cudaFree(w[r]), cudaFree(out[r]);
      if (wc[r]) cudaFree(wc[r]);
    }
  }
  TileRsArgs tile(int r, int sms, int mode, int entry, int swizzle, bool wcol) const {
    TileRsArgs a{};
    a.peers = peers(r);
    a.x = x[r], a.w = wcol ? wc[r] : w[r], a.out = out[r];
    a.m = m, a.N = N, a.K = K, a.w_colmajor = wcol;
    a.dtype = DType::kBF16;
    a.slot_bytes = tile_rs_slot_bytes(m, N);
    a.sm_count = sms, a.swizzle = swizzle, a.entry = entry, a.mode = mode;
    a.stall_rank = -1, a.op = kOpGemmRs;
    a.timeout_ns = 10ull * 1000 * 1000 * 1000;
    a.err = hw.err;
    return a;
  }
};

// A canary run's bookkeeping: the mismatch record, the join events, the clock; every 500 calls
// (bounded queues; a failure shows early) and at the end, whether a wait gave up (and after each
// call, without waiting, the host-mapped error record: no call is launched after a give-up).
struct Canary {
  Ranks2& g;
  Miss* miss;
  cudaEvent_t ea, eb;
  std::chrono::steady_clock::time_point t0;
  bool gave_up = false;
  double secs = 0;
  explicit Canary(Ranks2& g_) : g(g_) {
    CK(cudaHostAlloc(&miss, sizeof(Miss), cudaHostAllocMapped));
    std::memset(miss, 0, sizeof(Miss));
    CK(cudaEventCreateWithFlags(&ea, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&eb, cudaEventDisableTiming));
    CK(cudaDeviceSynchronize());
    t0 = std::chrono::steady_clock::now();
  }
  ~Canary() { cudaFreeHost(miss), cudaEventDestroy(ea), cudaEventDestroy(eb); }
  // Before call c: the join every `join_every` calls; after it: the periodic check.
  void begin(int c, int join_every) {
    if (join_every > 0 && c % join_every == 0) g.join(ea, eb);
  }
  void end(int c, const char* what) {
    if (c % 500 == 499) {
      CK(cudaDeviceSynchronize());
      gave_up = g.hw.report(what);
    } else if (*(volatile int32_t*)&g.hw.err->set) {  // host-mapped: no launch past a give-up
      gave_up = true;
    }
  }
  // After the last call: waits for the device, reports a wait that gave up; then the caller prints
  // its verdict line's head and finish() its tail and the first mismatch.
  void settle(const char* what) {
    CK(cudaDeviceSynchronize());
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    gave_up = gave_up || g.hw.report(what);
  }
  // The wrong elements, -1 if a wait gave up.
  long long finish() {
    std::printf(": %llu wrong elements%s in %.2f s\n", miss->count,
                gave_up ? ", A WAIT GAVE UP" : "", secs);
    if (miss->first_set)
      std::printf("  first: call %d rank %d row/element %lld col %lld: got %g want %g\n",
                  miss->call, miss->rank, (long long)miss->row, (long long)miss->col, miss->got,
                  miss->want);
    return gave_up ? -1 : (long long)miss->count;
  }
};

// The half of the SMs each of two ranks gets (both kernels resident at once: an even number, for
// 2-CTA clusters; tile_rs_probe.cu's check).
int half_sms() { return device_sms() / 4 * 2; }

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

extern "C" {

// Loads every kernel this library launches (DESIGN.md decision 5: no lazy load while a rank
// spins) and sets the device. 0 on success.
int tl_init() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CK(cudaSetDevice(0));
  for (int e = 0; e < tile_rs_menu_size(); ++e)
    for (bool wc : {false, true}) CK(preload_tile_entry(e, wc));
  CK(preload_comm_kernels());
  CK(preload_ce_kernels());
  cudaFuncAttributes attr;
  const void* fns[] = {(const void*)delay_kernel, (const void*)canary_fill_x,
                       (const void*)canary_fill_w,
                       (const void*)canary_fill_blocks, (const void*)canary_check};
  for (const void* f : fns) CK(cudaFuncGetAttributes(&attr, f));
  if (!g_runner) {
    g_runner = new GemmRunner;
    if (std::string e = g_runner->init(); !e.empty()) {
      std::printf("cuBLASLt: %s\n", e.c_str());
      return 1;
    }
  }
  return 0;
}

// The tile kernel's canary: `calls` calls of a group of two on one GPU (rows per rank m, N, K).
// Both streams start together every `join_every` calls; in between the ranks run free (rank 1,
// delayed before every call, falls behind and rank 0 runs into its next call: the double-buffered
// staging's slot-release waits). Entry (call / 3) % menu on both ranks, w column-major on odd
// thousands of calls. Returns the wrong elements (0: clean), -1 if a wait gave up.
long long tl_canary_tile(int calls, long long m, long long N, long long K, int join_every) {
  Pair p(m, N, K, true);
  const int fc = (int)((N + kFlagCols - 1) / kFlagCols);
  if (K < fc) {
    std::printf("canary: K (%lld) must be at least N / 128 (%d)\n", K, fc);
    return -1;
  }
  for (int r = 0; r < Pair::n; ++r) {
    canary_fill_w<<<grid_for(K * N), 256>>>(p.w[r], K, N, 0);
    canary_fill_w<<<grid_for(K * N), 256>>>(p.wc[r], K, N, 1);
  }
  Canary cn(p);
  const int sms = half_sms(), E = tile_rs_menu_size();
  int per_delay[3] = {}, wcol_calls = 0;
  std::vector<int> per_entry(E, 0);
  for (int c = 0; c < calls && !cn.gave_up; ++c) {
    const uint32_t e = (uint32_t)c + 1u;  // the flags' epoch before call c is c
    const int d = c % 3, entry = (c / 3) % E;
    const bool wcol = (c / 1000) % 2 == 1;
    ++per_delay[d], ++per_entry[entry], wcol_calls += wcol;
    cn.begin(c, join_every);
    for (int r = 0; r < Pair::n; ++r) {
      cudaStream_t s = p.s[r];
      if (r == 1) delay_kernel<<<1, 1, 0, s>>>(kDelaysUs[d] * 1000ull);
      canary_fill_x<<<grid_for(2 * m * K), 256, 0, s>>>(p.x[r], 2 * m, K, m, fc, e, r);
      TileRsArgs a = p.tile(r, sms, 0, entry, kSwizzle, wcol);
      CK(launch_tile_rs(a, s));  // the kernel ends the call (release, epoch)
      canary_check<<<grid_for(m * N), 256, 0, s>>>(p.out[r], m, N, fc, e, r, Pair::n, 0, c,
                                                   cn.miss);
    }
    cn.end(c, "canary tile");
  }
  cn.settle("canary tile");
  std::printf("CANARY tile: %d calls x 2 ranks, %lld x %lld x %lld (m = %lld rows per rank), "
              "%d SMs each, join every %d calls; delays 0/25/50 us: %d/%d/%d calls; entries",
              calls, 2 * m, K, N, m, sms, join_every, per_delay[0], per_delay[1], per_delay[2]);
  for (int e = 0; e < E; ++e) std::printf(" %s %d", tile_rs_entry_name(e), per_entry[e]);
  std::printf("; w column-major %d calls", wcol_calls);
  return cn.finish();
}

// The standalone reduce-scatter's comm kernel (ffi/kernels/comm.cu, as handlers/rs.cc drives it)
// as two in-process ranks: reduce_push 1 (n == 2's schedule: TMA bulk adds into the peer's
// accumulator) or 0 (senders + receivers), `ctas` CTAs per rank, a block of `elems` bf16 per
// rank in `chunks` chunks. Same delays and joins as tl_canary_tile. Returns the wrong elements.
long long tl_canary_comm(int calls, long long elems, int chunks, int ctas, int reduce_push,
                         int join_every) {
  constexpr int n = Ranks2::n;
  const int64_t block_bytes = elems * 2;
  Ranks2 g(block_bytes);
  __nv_bfloat16 *src[n], *out[n];
  for (int r = 0; r < n; ++r) {
    CK(cudaMalloc(&src[r], n * block_bytes));
    CK(cudaMalloc(&out[r], block_bytes));
  }
  Canary cn(g);
  for (int c = 0; c < calls && !cn.gave_up; ++c) {
    const uint32_t e = (uint32_t)c + 1u;
    cn.begin(c, join_every);
    for (int r = 0; r < n; ++r) {
      cudaStream_t s = g.s[r];
      if (r == 1) delay_kernel<<<1, 1, 0, s>>>(kDelaysUs[c % 3] * 1000ull);
      canary_fill_blocks<<<grid_for(n * elems), 256, 0, s>>>(src[r], n * elems, elems, 0, e, r);
      CommArgs a{};
      a.peers = g.peers(r);
      a.src = reinterpret_cast<const char*>(src[r]);
      a.own = a.src + r * block_bytes;
      a.out = reinterpret_cast<char*>(out[r]);
      a.block_bytes = block_bytes;
      a.chunks = chunks;
      a.reduce_push = reduce_push;
      a.senders = reduce_push ? ctas : ctas / 2;
      a.receivers = reduce_push ? 0 : ctas - ctas / 2;
      a.stall_rank = -1;
      a.op = kOpReduceScatter;
      a.timeout_ns = 10ull * 1000 * 1000 * 1000;
      a.err = g.hw.err;
      a.dtype = DType::kBF16;
      CK(launch_comm(a, s));
      CK(launch_release_slots(a.peers, s));
      CK(launch_finish(g.flags[r], s));
      canary_check<<<grid_for(elems), 256, 0, s>>>(out[r], elems, 1, 1, e, r, n, 1, c, cn.miss);
    }
    cn.end(c, "canary comm");
  }
  cn.settle("canary comm");
  std::printf("CANARY comm %s: %d calls x 2 ranks, %lld bf16 per block in %d chunks, %d CTAs "
              "each, join every %d calls, delays 0/25/50 us rotating",
              reduce_push ? "reduce-push" : "senders/receivers", calls, elems, chunks, ctas,
              join_every);
  const long long bad = cn.finish();
  for (int r = 0; r < n; ++r) cudaFree(src[r]), cudaFree(out[r]);
  return bad;
}

// The chunked fused GEMM + reduce-scatter's pushes at n = 2, as two in-process ranks, each with a
// GEMM stream and a side stream; a fill stands in for each GEMM (the canary values are what the
// GEMM would compute). `senders` = 0: the copy-engine schedule (handlers/gemm_rs_ce.cc): GEMM
// stream: the peer block's chunks, an event each; copy stream: the bounded wait for the peer's
// slot, per chunk (after its event) the push (cudaMemcpyAsync into the peer's staging) and the
// arrival flag; GEMM stream: per chunk the wait for the peer's arrival. `senders` > 0: the
// SM-partition schedule (handlers/gemm_rs.cc): GEMM stream: the peer block's chunks, each
// followed by its ready flag (launch_signal_ready); comm stream: the comm kernel (`senders`
// CTAs, src_by_step, wait_ready: it waits for each ready flag and pushes the chunk with TMA);
// GEMM stream: per chunk launch_wait_chunk. Both then sum own + peer (launch_sum_blocks: f32,
// one rounding; the handler's own GEMM with C = the slot), release the slot, join the side
// stream and finish. Returns the wrong elements.
long long tl_canary_chunked(int calls, long long elems, int chunks, int senders, int join_every) {
  constexpr int n = Ranks2::n;
  const int64_t block_bytes = elems * 2, chunk_elems = elems / chunks;
  Ranks2 g(block_bytes);
  __nv_bfloat16 *part[n], *own[n], *out[n];
  cudaStream_t side[n];
  std::vector<cudaEvent_t> ev(n * (chunks + 2));
  for (auto& e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  for (int r = 0; r < n; ++r) {
    CK(cudaMalloc(&part[r], block_bytes));
    CK(cudaMalloc(&own[r], block_bytes));
    CK(cudaMalloc(&out[r], block_bytes));
    CK(cudaStreamCreateWithFlags(&side[r], cudaStreamNonBlocking));
  }
  Canary cn(g);
  const uint64_t timeout = 10ull * 1000 * 1000 * 1000;
  for (int c = 0; c < calls && !cn.gave_up; ++c) {
    const uint32_t e = (uint32_t)c + 1u;
    cn.begin(c, join_every);
    for (int r = 0; r < n; ++r) {
      const int j = 1 - r;
      cudaStream_t s = g.s[r];
      cudaEvent_t* my = &ev[r * (chunks + 2)];
      const Peers pr = g.peers(r);
      if (r == 1) delay_kernel<<<1, 1, 0, s>>>(kDelaysUs[c % 3] * 1000ull);
      CK(cudaEventRecord(my[chunks], s));  // the fork
      CK(cudaStreamWaitEvent(side[r], my[chunks]));
      if (!senders) CK(launch_ce_wait_slot_free(pr, j, kOpGemmRs, timeout, g.hw.err, side[r]));
      char* dst = g.stage[j] + stage_slot(r, j, n) * block_bytes;
      for (int k = 0; k < chunks; ++k) {  // the "GEMM" of the peer's block, chunk k
        __nv_bfloat16* d = part[r] + k * chunk_elems;
        const int64_t at = j * elems + k * chunk_elems;
        canary_fill_blocks<<<grid_for(chunk_elems), 256, 0, s>>>(d, chunk_elems, elems, at, e, r);
        if (senders) {
          CK(launch_signal_ready(g.flags[r], k, s));
          continue;
        }
        CK(cudaEventRecord(my[k], s));
        CK(cudaStreamWaitEvent(side[r], my[k]));
        CK(cudaMemcpyAsync(dst + k * chunk_elems * 2, d, chunk_elems * 2, cudaMemcpyDefault,
                           side[r]));
        CK(launch_ce_signal_arrival(pr, j, k, -1, side[r]));
      }
      if (senders) {  // after the producer in host order, as the handler launches it
        CommArgs a{};
        a.peers = pr;
        a.src = reinterpret_cast<const char*>(part[r]);
        a.out = nullptr;
        a.block_bytes = block_bytes;
        a.chunks = chunks;
        a.senders = senders;
        a.src_by_step = 1;
        a.wait_ready = 1;
        a.stall_rank = -1;
        a.op = kOpGemmRs;
        a.timeout_ns = timeout;
        a.err = g.hw.err;
        a.dtype = DType::kBF16;
        CK(launch_comm(a, side[r]));
      }
      canary_fill_blocks<<<grid_for(elems), 256, 0, s>>>(own[r], elems, elems, r * elems, e, r);
      for (int k = 0; k < chunks; ++k) {
        if (senders)
          CK(launch_wait_chunk(pr, k, senders, 0, kOpGemmRs, timeout, g.hw.err, s));
        else
          CK(launch_ce_wait_arrival(pr, j, k, kOpGemmRs, timeout, g.hw.err, s));
        CK(launch_sum_blocks(out[r] + k * chunk_elems, own[r] + k * chunk_elems,
                             g.stage[r] + k * chunk_elems * 2, 1, elems, chunk_elems,
                             DType::kBF16, 16, s));
      }
      CK(launch_release_slots(pr, s));
      CK(cudaEventRecord(my[chunks + 1], side[r]));  // the join
      CK(cudaStreamWaitEvent(s, my[chunks + 1]));
      CK(launch_finish(g.flags[r], s));
      canary_check<<<grid_for(elems), 256, 0, s>>>(out[r], elems, 1, 1, e, r, n, 1, c, cn.miss);
    }
    cn.end(c, "canary chunked");
  }
  cn.settle("canary chunked");
  std::printf("CANARY chunked %s: %d calls x 2 ranks, %lld bf16 per block in %d chunks, join "
              "every %d calls, delays 0/25/50 us rotating",
              senders ? "comm kernel" : "copy engine", calls, elems, chunks, join_every);
  if (senders) std::printf(", %d sender CTAs", senders);
  const long long bad = cn.finish();
  for (int r = 0; r < n; ++r) {
    cudaFree(part[r]), cudaFree(own[r]), cudaFree(out[r]);
    cudaStreamDestroy(side[r]);
  }
  for (auto& x : ev) cudaEventDestroy(x);
  return bad;
}

// Live waits of one shape (per rank x [M, K] @ w [K, N], M = 2 m: the per-device GEMM, its group
// two ranks whatever the share's tp). out_ms[3 delays][8]: makespan ms of the cuBLASLt pair,
// the mode-0 pair, the mode-1 pair; then rank 0 and rank 1 kernel ms in mode 0, in mode 1 (each
// from the rank's own start); the last: the rounds' largest spread of the three makespans.
// Timing: 7 rounds, the three variants interleaved, `reps` calls each (~5 ms a round), per-call
// CUDA events; makespan = median over rounds of the round's mean; rank times = median over calls.
// The pick: the production selection (tile_rs_choose) for this grid, empty cache `cache_dir`.
// Returns 0, or -1 if a wait gave up.
int tl_live(long long M, long long K, long long N, const char* cache_dir, double* out_ms,
            int* pick_entry, int* pick_swizzle) {
  const int64_t m = M / 2;
  Pair p(m, N, K, false);
  const int sms = half_sms();
  TileChoice pick;
  // TILE_LIVE_ENTRY=<menu name> (tools): that entry at band 8 with its default epilogue, no
  // selection (e.g. a tools entry of a probe build, tile_sched.cuh's candidate claim paths).
  int forced = -1;
  if (const char* name = std::getenv("TILE_LIVE_ENTRY"))
    for (int e = 0; e < tile_rs_menu_size(); ++e)
      if (std::strcmp(tile_rs_entry_name(e), name) == 0) forced = e;
  if (forced >= 0) {
    pick.entry = forced, pick.swizzle = kSwizzle, pick.epi = 0;
  } else {
    TileRsArgs a = p.tile(0, sms, 0, 0, kSwizzle, false);
    tile_rs_choose(a, p.s[0], true, true, cache_dir, &pick);
    CK(cudaStreamSynchronize(p.s[0]));
  }
  *pick_entry = pick.entry, *pick_swizzle = pick.swizzle;
  GemmRunner& lt = runner();
  const GemmShape gs{M, N, K, DType::kBF16, false, sms, false};
  for (int r = 0; r < 2; ++r)  // plans (searched on this stream, alone) before any timing
    if (std::string e = lt.run(gs, p.x[r], p.w[r], nullptr, p.out[r], p.s[r]); !e.empty()) {
      std::printf("cuBLASLt: %s\n", e.c_str());
      return -1;
    }
  CK(cudaDeviceSynchronize());
  // One call of variant v (0 cuBLASLt, 1 mode 0, 2 mode 1) with rank 1 late by d us; events:
  // ev[0] start, ev[1] rank 1's start (after the delay), ev[2] / ev[3] ranks' kernel ends,
  // ev[4] both done (the call's end: the slot release and finish included).
  auto call = [&](int v, int d, cudaEvent_t* ev) {
    CK(cudaEventRecord(ev[0], p.s[0]));
    CK(cudaStreamWaitEvent(p.s[1], ev[0]));
    delay_kernel<<<1, 1, 0, p.s[1]>>>(kDelaysUs[d] * 1000ull);
    CK(cudaEventRecord(ev[1], p.s[1]));
    for (int r = 0; r < 2; ++r) {
      if (v == 0) {
        lt.run(gs, p.x[r], p.w[r], nullptr, p.out[r], p.s[r]);
        CK(cudaEventRecord(ev[2 + r], p.s[r]));
      } else {
        TileRsArgs a = p.tile(r, sms, v == 1 ? 0 : 1, pick.entry, pick.swizzle, false);
        a.epi = pick.epi;
        CK(launch_tile_rs(a, p.s[r]));  // the kernel ends the call (release, epoch)
        CK(cudaEventRecord(ev[2 + r], p.s[r]));
      }
    }
    CK(cudaEventRecord(ev[5], p.s[1]));
    CK(cudaStreamWaitEvent(p.s[0], ev[5]));
    CK(cudaEventRecord(ev[4], p.s[0]));
  };
  // ~5 ms a round of a variant, from one call of the cuBLASLt pair
  std::vector<cudaEvent_t> probe(6);
  for (auto& e : probe) CK(cudaEventCreate(&e));
  call(0, 0, probe.data());
  call(0, 0, probe.data());
  CK(cudaEventSynchronize(probe[4]));
  float est = 1;
  CK(cudaEventElapsedTime(&est, probe[0], probe[4]));
  const int reps = std::max(3, std::min(20, (int)(5.0f / std::max(est, 1e-3f))));
  std::vector<cudaEvent_t> ev(reps * 6);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  constexpr int kRounds = 7;
  int rc = 0;
  for (int d = 0; d < 3; ++d) {
    std::vector<double> span[3], rank[3][2];
    for (int v = 0; v < 3; ++v)
      for (int i = 0; i < 2; ++i) call(v, d, probe.data());  // warm-up
    for (int round = 0; round < kRounds; ++round)
      for (int v = 0; v < 3; ++v) {
        for (int i = 0; i < reps; ++i) call(v, d, &ev[6 * i]);
        CK(cudaEventSynchronize(ev[6 * (reps - 1) + 4]));
        double sum = 0;
        for (int i = 0; i < reps; ++i) {
          float t;
          CK(cudaEventElapsedTime(&t, ev[6 * i], ev[6 * i + 4]));
          sum += t;
          for (int r = 0; r < 2; ++r) {
            CK(cudaEventElapsedTime(&t, ev[6 * i + r], ev[6 * i + 2 + r]));
            rank[v][r].push_back(t);
          }
        }
        span[v].push_back(sum / reps);
      }
    double* o = out_ms + 8 * d;
    double spread = 0;
    for (int v = 0; v < 3; ++v) {
      const double med = median(span[v]);
      o[v] = med;
      spread = std::max(spread,
                        (*std::max_element(span[v].begin(), span[v].end()) -
                         *std::min_element(span[v].begin(), span[v].end())) / med);
    }
    o[3] = median(rank[1][0]), o[4] = median(rank[1][1]);
    o[5] = median(rank[2][0]), o[6] = median(rank[2][1]);
    o[7] = spread;
    if (p.hw.report("live")) rc = -1;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  for (auto& e : probe) cudaEventDestroy(e);
  return rc;
}

// ---- one shape's timing core for the reference table (tools/probes/tile_live.py ref) ----

struct RefShape {
  int tp;
  int64_t M, K, N, m;
  int wcol;
  __nv_bfloat16 *x, *w, *out;
  char* stage;
  Flags* flags;
  HostWords hw;
  cudaStream_t s;
  TileChoice pick;
};

void* tl_ref_open(int tp, long long M, long long K, long long N, int wcol) {
  RefShape* h = new RefShape;
  h->tp = tp, h->M = M, h->K = K, h->N = N, h->m = M / tp, h->wcol = wcol;
  const int64_t stage = (tp - 1) * tile_rs_slot_bytes(h->m, N);
  CK(cudaMalloc(&h->x, M * K * 2));
  CK(cudaMalloc(&h->w, K * N * 2));
  CK(cudaMalloc(&h->out, M * N * 2));
  CK(cudaMalloc(&h->stage, stage));
  CK(cudaMemset(h->stage, 0, stage));
  CK(cudaMalloc(&h->flags, sizeof(Flags)));
  CK(cudaMemset(h->flags, 0, sizeof(Flags)));
  CK(launch_fill_uniform(h->x, M * K, FillType::kBF16, 5, nullptr));
  CK(launch_fill_uniform(h->w, K * N, FillType::kBF16, 7, nullptr));
  CK(cudaStreamCreateWithFlags(&h->s, cudaStreamNonBlocking));
  CK(cudaDeviceSynchronize());
  return h;
}

void tl_ref_close(void* hp) {
  RefShape* h = static_cast<RefShape*>(hp);
  cudaDeviceSynchronize();
  cudaFree(h->x), cudaFree(h->w), cudaFree(h->out), cudaFree(h->stage), cudaFree(h->flags);
  cudaStreamDestroy(h->s);
  delete h;
}

namespace {
// The emulated rank 0 of a group of tp (tile_rs_probe.cu's Problem): every peer's staging and
// flags are this rank's own, so mode 0 publishes, fences and waits on its own foreign tiles.
TileRsArgs ref_args(RefShape* h, int mode, int entry, int swizzle) {
  TileRsArgs a{};
  a.peers.n = h->tp, a.peers.rank = 0, a.peers.device = 0;
  for (int i = 0; i < h->tp; ++i) a.peers.stage[i] = h->stage, a.peers.flags[i] = h->flags;
  a.peers.abort = h->hw.abort;
  a.x = h->x, a.w = h->w, a.out = h->out;
  a.m = h->m, a.N = h->N, a.K = h->K, a.w_colmajor = h->wcol;
  a.dtype = DType::kBF16;
  a.slot_bytes = tile_rs_slot_bytes(h->m, h->N);
  a.sm_count = device_sms(), a.swizzle = swizzle, a.entry = entry, a.mode = mode;
  a.stall_rank = -1, a.op = kOpGemmRs;
  a.timeout_ns = 2ull * 1000 * 1000 * 1000;
  a.err = h->hw.err;
  return a;
}
}  // namespace

// The production selection for this shape (tile_rs_choose, cache `cache_dir`). Returns the
// entry's name; *swizzle, *seconds.
const char* tl_ref_choose(void* hp, const char* cache_dir, int* swizzle, double* seconds) {
  RefShape* h = static_cast<RefShape*>(hp);
  const auto t0 = std::chrono::steady_clock::now();
  tile_rs_choose(ref_args(h, 0, 0, kSwizzle), h->s, true, true, cache_dir, &h->pick);
  CK(cudaStreamSynchronize(h->s));
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  *swizzle = h->pick.swizzle;
  return tile_rs_entry_name(h->pick.entry);
}

// Launches variant v `reps` times on the shape's stream and waits for them (the device idle
// before, as the Python side's XLA samples): 0 the searched cuBLASLt plan, 1 / 2 / 3 the pick
// plain / solo / prod, 4 / 5 entry 0 plain / prod at swizzle 8. Returns wall ms per launch (the
// Python side times XLA the same way); *event_ms: the same launches by CUDA events.
double tl_ref_run(void* hp, int v, int reps, double* event_ms) {
  RefShape* h = static_cast<RefShape*>(hp);
  static cudaEvent_t a = nullptr, b = nullptr;
  if (!a) {
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
  }
  const GemmShape gs{h->M, h->N, h->K, DType::kBF16, false, 0, h->wcol != 0};
  static const int kMode[6] = {-1, 2, 1, 0, 2, 0};
  const int entry = v >= 4 ? 0 : h->pick.entry, sw = v >= 4 ? kSwizzle : h->pick.swizzle;
  TileRsArgs ta = ref_args(h, v > 0 ? kMode[v] : 0, entry, sw);
  if (v < 4) ta.epi = h->pick.epi;  // the pick's epilogue variant
  CK(cudaStreamSynchronize(h->s));
  const auto t0 = std::chrono::steady_clock::now();
  CK(cudaEventRecord(a, h->s));
  for (int i = 0; i < reps; ++i) {
    if (v == 0) {
      if (std::string e = runner().run(gs, h->x, h->w, nullptr, h->out, h->s); !e.empty()) {
        std::printf("cuBLASLt: %s\n", e.c_str());
        return -1;
      }
    } else {
      CK(launch_tile_rs(ta, h->s));  // the kernel ends the call (the emulated release, epoch)
    }
  }
  CK(cudaEventRecord(b, h->s));
  CK(cudaEventSynchronize(b));
  const double wall =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  float t = 0;
  CK(cudaEventElapsedTime(&t, a, b));
  *event_ms = t / reps;
  if (h->hw.report("ref")) return -1;
  return wall / reps;
}

}  // extern "C"
