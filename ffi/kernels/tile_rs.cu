// The tile-fused GEMM + reduce-scatter's host side: what it supports, the menu of kernels (one
// instantiation file per entry and w layout, tile_rs_e<k>_<wrow|wcol>.cu, so they compile in
// parallel). The choice of an entry per problem, by timing at its first execution, is the
// runtime's (ffi/runtime/tile_menu.cc).
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>

#include "kernels/tile_rs.h"

namespace jaxoverlap {

using TilePreload = cudaError_t (*)();
using TileCheck = cudaError_t (*)(const TileRsArgs&);
using TileLaunch = cudaError_t (*)(const TileRsArgs&, cudaStream_t);
#define JAXOVERLAP_TILE_DECLARE(NAME)                  \
  cudaError_t tile_rs_preload_##NAME();                \
  cudaError_t tile_rs_check_##NAME(const TileRsArgs&); \
  cudaError_t tile_rs_launch_##NAME(const TileRsArgs&, cudaStream_t);
JAXOVERLAP_TILE_DECLARE(e0_wrow)
JAXOVERLAP_TILE_DECLARE(e0_wcol)
JAXOVERLAP_TILE_DECLARE(e1_wrow)
JAXOVERLAP_TILE_DECLARE(e1_wcol)
JAXOVERLAP_TILE_DECLARE(e2_wrow)
JAXOVERLAP_TILE_DECLARE(e2_wcol)
JAXOVERLAP_TILE_DECLARE(e3_wrow)
JAXOVERLAP_TILE_DECLARE(e3_wcol)
JAXOVERLAP_TILE_DECLARE(e4_wrow)
JAXOVERLAP_TILE_DECLARE(e4_wcol)
// Tools entries (candidate claim paths of tile_sched.cuh; not in the default build)
JAXOVERLAP_TILE_DECLARE(e5_wrow)
JAXOVERLAP_TILE_DECLARE(e5_wcol)
JAXOVERLAP_TILE_DECLARE(e6_wrow)
JAXOVERLAP_TILE_DECLARE(e6_wcol)
JAXOVERLAP_TILE_DECLARE(e7_wrow)
JAXOVERLAP_TILE_DECLARE(e7_wcol)
JAXOVERLAP_TILE_DECLARE(e8_wrow)
JAXOVERLAP_TILE_DECLARE(e8_wcol)
JAXOVERLAP_TILE_DECLARE(e9_wrow)
JAXOVERLAP_TILE_DECLARE(e9_wcol)
JAXOVERLAP_TILE_DECLARE(e10_wrow)
JAXOVERLAP_TILE_DECLARE(e10_wcol)
#undef JAXOVERLAP_TILE_DECLARE

namespace {

// The menu: every entry is a CUTLASS persistent kernel (cooperative or ping-pong) with our
// scheduler and epilogue (tile_rs.cuh), 128-row tiles; they differ in the schedule, the tile's
// columns and the cluster. docs/tile-schedule.md says why each is there (the one-GPU table of
// every entry per shape).
struct Entry {
  const char* name;
  int32_t alt_epi;  // the epilogue variants the selection also times (tile_rs_entry_alt_epi)
  TilePreload preload[2];  // [w_colmajor]
  TileCheck check[2];
  TileLaunch launch[2];
};
#define JAXOVERLAP_TILE_MENU_ENTRY(NAME, E, ALT) \
  {NAME, ALT, {tile_rs_preload_##E##_wrow, tile_rs_preload_##E##_wcol}, \
   {tile_rs_check_##E##_wrow, tile_rs_check_##E##_wcol}, \
   {tile_rs_launch_##E##_wrow, tile_rs_launch_##E##_wcol}}
// JAXOVERLAP_TILE_MENU_MASK (a build option for tuning runs: tools/probes/build_tile_rs_probe.sh's
// ENTRIES): the entries compiled in, bit k = entry k; the default build has them all.
#ifndef JAXOVERLAP_TILE_MENU_MASK
#define JAXOVERLAP_TILE_MENU_MASK 0x1f
#endif
#define JAXOVERLAP_TILE_IN(K) ((JAXOVERLAP_TILE_MENU_MASK >> (K)) & 1)
// The ping-pong entries' alternatives the selection times, each alone against epi 0. Default
// build: none -- their kernels have one store path, the TMA tensor stores
// (JAXOVERLAP_TILE_PP_TENSOR_ONLY, tile_rs.h; session 16: the runtime choice's k-loop spill cost
// the production kernel 2.8 % on short K). Tools builds with the choice (=0): the lanes' stores
// and the tensor stores against the bulk ones (session 9, one H200: the pick over its entry at
// the bulk stores 0.95-1.00, docs/measurements.md). The tensor stores' maps address the peers'
// staging, which two processes map through CUDA IPC: tests/gpu/test_xproc_gpu.py's every-entry
// test ran them so in session 10 (passed) before they joined the selection; across two GPUs
// (NVLink) they have not run yet. JAXOVERLAP_TILE_ENTRY=<entry>:<epi> forces any variant
// (runtime/tile_menu.cc; a default build's ping-pong kernel ignores the store bits). The TMA tensor loads (kTileEpiTensorLoads) stay tools-only: 1-3 %
// slower.
constexpr int32_t kPpAltEpi =
    JAXOVERLAP_TILE_PP_TENSOR_ONLY ? 0 : kTileEpiLaneStores | kTileEpiTensorStores;
const Entry kMenu[] = {
#if JAXOVERLAP_TILE_IN(0)
    // Flux's GEMM + reduce-scatter tile: w's 64 x 256 tile multicast to both CTAs of a cluster.
    JAXOVERLAP_TILE_MENU_ENTRY("128x256c2x1", e0, 0),
#endif
#if JAXOVERLAP_TILE_IN(1)
    // No cluster: every SM runs a CTA (2x1 clusters leave a GPC's odd SM idle) and tiles are
    // claimed one by one.
    JAXOVERLAP_TILE_MENU_ENTRY("128x256c1x1", e1, 0),
#endif
#if JAXOVERLAP_TILE_IN(2)
    // x's tile multicast along N: the footprint of entry 0 transposed (wide N, long K).
    JAXOVERLAP_TILE_MENU_ENTRY("128x128c1x2", e2, 0),
#endif
#if JAXOVERLAP_TILE_IN(3)
    // Ping-pong: each consumer warpgroup runs its own 128 x 128 tile, and one's epilogue (the
    // foreign tiles' stores to the peers, the own tiles' adds of their slabs) runs under the
    // other's MMA (cuBLASLt's kernel on 8192 x 2048 x 4096 is a one-warpgroup-per-tile 128 x 160
    // one with a 2x1 cluster: nvjet_sm90_tst_128x160_64x5_2x1, ncu in docs/measurements.md).
    JAXOVERLAP_TILE_MENU_ENTRY("pp128x128c1x1", e3, kPpAltEpi),
#endif
#if JAXOVERLAP_TILE_IN(4)
    // The same with w's tile multicast to a cluster of two (TensorRT-LLM's GEMM + all-reduce
    // tiles are ping-pong 128 x N, cluster 2x1); each warpgroup claims its tile k + 4 after its
    // epilogue of tile k (kClaimLate: the claim's atomic leaves the epilogue; in prod 2.2 %
    // faster than claiming at the epilogue's start, on 36 of 36 judged shapes in session 9 with
    // the tensor stores, 33 of 36 with the bulk ones; entry 3's c1x1 kernel did not gain in
    // session 8 and keeps the earlier claims).
    JAXOVERLAP_TILE_MENU_ENTRY("pp128x128c2x1", e4, kPpAltEpi),
#endif
    // Tools entries 5-9 (ENTRIES="4 5 ..." in build_tile_rs_probe.sh; never in the default
    // build): the ping-pong kernels with another claim path of tile_sched.cuh, to be timed
    // against entries 3 and 4 in the same interleaved rounds (issue 23, sessions 8-9).
#if JAXOVERLAP_TILE_IN(5)
    JAXOVERLAP_TILE_MENU_ENTRY("pp128x128c2x1+pairs", e5, kPpAltEpi),
#endif
#if JAXOVERLAP_TILE_IN(6)
    // entry 4's claims before session 9 (at the epilogue's start, two tiles ahead)
    JAXOVERLAP_TILE_MENU_ENTRY("pp128x128c2x1-early", e6, kPpAltEpi),
#endif
#if JAXOVERLAP_TILE_IN(7)
    JAXOVERLAP_TILE_MENU_ENTRY("pp128x128c2x1+latepairs", e7, kPpAltEpi),
#endif
#if JAXOVERLAP_TILE_IN(8)
    JAXOVERLAP_TILE_MENU_ENTRY("pp128x128c1x1+late", e8, kPpAltEpi),
#endif
#if JAXOVERLAP_TILE_IN(9)
    // the own block spread through the claim order (issue 24)
    JAXOVERLAP_TILE_MENU_ENTRY("pp128x128c2x1+spread", e9, kPpAltEpi),
#endif
#if JAXOVERLAP_TILE_IN(10)
    // entry 4's kernel with a static order (no counter, no ring): what the claims cost (session
    // 15); not safe when a peer's CTAs are not all resident -- timing only, never `check`ed
    JAXOVERLAP_TILE_MENU_ENTRY("pp128x128c2x1=static", e10, kPpAltEpi),
#endif
};
#undef JAXOVERLAP_TILE_MENU_ENTRY
#undef JAXOVERLAP_TILE_IN
constexpr int kMenuSize = sizeof(kMenu) / sizeof(kMenu[0]);

std::mutex g_mu;                   // g_loaded
std::map<int, uint32_t> g_loaded;  // device -> loaded (entry, layout) bits

__global__ void finish_emulated(Flags* f, int n) {
  const uint32_t e = f->epoch + 1u;
  for (int j = 0; j < n; ++j) f->slot_free[j] = e;
  f->epoch = e;
}

}  // namespace

int64_t tile_rs_flags_per_block(int64_t m, int64_t N) {
  return (m / 16) * ((N + kFlagCols - 1) / kFlagCols);
}

int64_t tile_rs_slot_bytes(int64_t m, int64_t N) {
  const int64_t bytes = 2 * m * N * 2 + tile_rs_flags_per_block(m, N) * 4;
  return (bytes + 255) / 256 * 256;
}

std::string tile_rs_unsupported(DType dtype, int n, int64_t m, int64_t N, int64_t K,
                                const void* x, const void* w, const void* out) {
  if (dtype != DType::kBF16) return "the tile schedule is built for bfloat16 only";
  if (n < 2 || n > kMaxRanks) return "the group must have 2 to 8 ranks";
  if (m < kTileRowAlign || m % kTileRowAlign)
    return "the rows per rank must be a positive multiple of " + std::to_string(kTileRowAlign);
  if (N < 8 || N % 8 || K < 8 || K % 8)
    return "N and K must be positive multiples of 8 (16-byte rows for TMA and the epilogue)";
  if ((int64_t)n * m > INT32_MAX || N > INT32_MAX || K > INT32_MAX)
    return "a dimension exceeds the GEMM's 32-bit problem shape";
  if (tile_rs_flags_per_block(m, N) > INT32_MAX) return "too many tiles";
  for (const void* p : {x, w, out})
    if (reinterpret_cast<uintptr_t>(p) % 16) return "an operand is not 16-byte aligned (TMA)";
  return "";
}

int tile_rs_menu_size() { return kMenuSize; }

int32_t tile_rs_entry_alt_epi(int entry) {
  return entry >= 0 && entry < kMenuSize ? kMenu[entry].alt_epi : 0;
}

const char* tile_rs_entry_name(int entry) {
  return entry >= 0 && entry < kMenuSize ? kMenu[entry].name : "?";
}

cudaError_t preload_tile_entry(int entry, bool w_colmajor) {
  if (entry < 0 || entry >= kMenuSize) return cudaErrorInvalidValue;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device)) return e;
  const uint32_t bit = 1u << (2 * entry + (w_colmajor ? 1 : 0));
  std::lock_guard<std::mutex> hold(g_mu);
  if (g_loaded[device] & bit) return cudaSuccess;
  if (cudaError_t e = kMenu[entry].preload[w_colmajor ? 1 : 0]()) return e;
  g_loaded[device] |= bit;
  return cudaSuccess;
}

cudaError_t check_tile_entry(const TileRsArgs& a) {
  if (a.dtype != DType::kBF16 || a.entry < 0 || a.entry >= kMenuSize) return cudaErrorInvalidValue;
  if (cudaError_t e = preload_tile_entry(a.entry, a.w_colmajor != 0)) return e;
  return kMenu[a.entry].check[a.w_colmajor ? 1 : 0](a);
}

cudaError_t launch_tile_rs(const TileRsArgs& a, cudaStream_t stream) {
  if (a.dtype != DType::kBF16 || a.entry < 0 || a.entry >= kMenuSize) return cudaErrorInvalidValue;
  return kMenu[a.entry].launch[a.w_colmajor ? 1 : 0](a, stream);
}

cudaError_t tile_rs_finish_emulated(Flags* flags, int n, cudaStream_t stream) {
  finish_emulated<<<1, 1, 0, stream>>>(flags, n);
  return cudaGetLastError();
}

}  // namespace jaxoverlap
