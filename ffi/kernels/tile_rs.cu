// The tile-fused GEMM + reduce-scatter's host side: what it supports, the menu of kernels (one
// instantiation file per entry and w layout, tile_rs_e<k>_<wrow|wcol>.cu, so they compile in
// parallel) and the choice of an entry per problem, by timing at first execution.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "gemm.h"
#include "kernels/fill.h"
#include "kernels/tile_rs.h"

namespace jaxoverlap {

using TilePreload = cudaError_t (*)();
using TileLaunch = cudaError_t (*)(const TileRsArgs&, cudaStream_t);
#define JAXOVERLAP_TILE_DECLARE(NAME)                  \
  cudaError_t tile_rs_preload_##NAME();                \
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
#undef JAXOVERLAP_TILE_DECLARE

namespace {

// The menu: every entry is CUTLASS's cooperative persistent kernel with our scheduler and
// epilogue (tile_rs.cuh), 128-row tiles; they differ in the tile's columns and the cluster.
// docs/tile-schedule.md says why each is there (the one-GPU table of every entry per shape).
struct Entry {
  const char* name;
  TilePreload preload[2];  // [w_colmajor]
  TileLaunch launch[2];
};
#define JAXOVERLAP_TILE_MENU_ENTRY(NAME, E) \
  {NAME, {tile_rs_preload_##E##_wrow, tile_rs_preload_##E##_wcol}, \
   {tile_rs_launch_##E##_wrow, tile_rs_launch_##E##_wcol}}
const Entry kMenu[] = {
    // Flux's GEMM + reduce-scatter tile: w's 64 x 256 tile multicast to both CTAs of a cluster.
    JAXOVERLAP_TILE_MENU_ENTRY("128x256c2x1", e0),
    // Half the columns: twice the tiles, a finer last wave (short-M or narrow shapes).
    JAXOVERLAP_TILE_MENU_ENTRY("128x128c2x1", e1),
    // No cluster: every SM runs a CTA (2x1 clusters leave a GPC's odd SM idle) and tiles are
    // claimed one by one.
    JAXOVERLAP_TILE_MENU_ENTRY("128x256c1x1", e2),
    JAXOVERLAP_TILE_MENU_ENTRY("128x128c1x1", e3),
    // x's tile multicast along N: the footprint of entry 0 transposed (wide N, long K).
    JAXOVERLAP_TILE_MENU_ENTRY("128x128c1x2", e4),
};
#undef JAXOVERLAP_TILE_MENU_ENTRY
constexpr int kMenuSize = sizeof(kMenu) / sizeof(kMenu[0]);

std::mutex g_mu;                                    // everything below
std::map<int, uint32_t> g_loaded;                   // device -> loaded (entry, layout) bits
std::map<std::pair<int, std::string>, TileChoice> g_choices;  // (device, problem) -> choice

__global__ void advance_epoch(Flags* f) { f->epoch += 1; }

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

cudaError_t launch_tile_rs(const TileRsArgs& a, cudaStream_t stream) {
  if (a.dtype != DType::kBF16 || a.entry < 0 || a.entry >= kMenuSize) return cudaErrorInvalidValue;
  return kMenu[a.entry].launch[a.w_colmajor ? 1 : 0](a, stream);
}

namespace {

constexpr int kTileReps = 3;  // launches per timing; two timings per candidate, the best kept

// The problem as the cache knows it: device kind, group size, shape, w layout, grid, the swizzle
// asked for and the menu (a different build's menu is a different problem).
std::string problem_text(const TileRsArgs& a) {
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, a.peers.device);
  cudaGetLastError();
  std::string text = std::string(prop.name) + "/" + std::to_string(prop.multiProcessorCount);
  for (int64_t v : {(int64_t)a.dtype, (int64_t)a.peers.n, a.m, a.N, a.K, (int64_t)a.w_colmajor,
                    (int64_t)a.sm_count, (int64_t)a.swizzle})
    text += " " + std::to_string(v);
  for (const Entry& e : kMenu) text += std::string(" ") + e.name;
  return text;
}

std::string cache_path(const std::string& dir, const std::string& text) {
  if (dir.empty()) return "";
  char name[40];
  std::snprintf(name, sizeof(name), "tile-%016zx", std::hash<std::string>{}(text));
  return dir + "/" + name;
}

// "<entry name> <swizzle> <ms> <ms of entry 0>\n"; false if absent or not of this menu.
bool read_choice(const std::string& path, TileChoice* c) {
  if (path.empty()) return false;
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return false;
  char name[64] = {};
  int swizzle = 0;
  float ms = 0, ms0 = 0;
  const bool ok = std::fscanf(f, "%63s %d %f %f", name, &swizzle, &ms, &ms0) == 4;
  std::fclose(f);
  if (!ok || swizzle < 1 || swizzle > 64) return false;
  for (int e = 0; e < kMenuSize; ++e)
    if (std::string(name) == kMenu[e].name) {
      c->entry = e, c->swizzle = swizzle, c->ms = ms, c->ms_default = ms0, c->timed = 0;
      return true;
    }
  return false;
}

// First writer wins, every process adopts the file (gemm.h: publish_once).
bool publish_choice(const std::string& path, const TileChoice& c) {
  char text[128];
  std::snprintf(text, sizeof(text), "%s %d %.6f %.6f\n", kMenu[c.entry].name, c.swizzle, c.ms,
                c.ms_default);
  return publish_once(path, text);
}

// Times the candidates as the fused kernel runs alone (mode 1: its GEMM, the foreign tiles'
// stores into a staging buffer and the own tiles' adds of n - 1 slabs, no waits) on random
// scratch operands on `stream` (stream-ordered allocations: only this stream is synchronised).
std::string time_candidates(const TileRsArgs& call, cudaStream_t stream, TileChoice* out) {
  const int n = call.peers.n;
  const int64_t rows = n * call.m;
  const int64_t slot = tile_rs_slot_bytes(call.m, call.N);
  const int64_t sizes[4] = {rows * call.K * 2, call.K * call.N * 2, call.m * call.N * 2,
                            (n - 1) * slot};
  char* buf[4] = {};
  Flags* flags = nullptr;
  cudaEvent_t ev[2] = {};
  std::string note;
  auto fail = [&](const char* what, cudaError_t e) {
    cudaGetLastError();
    if (note.empty()) note = std::string(what) + ": " + cudaGetErrorString(e);
  };
  for (int i = 0; i < 4 && note.empty(); ++i) {
    if (cudaError_t e = cudaMallocAsync((void**)&buf[i], sizes[i], stream)) {
      buf[i] = nullptr;
      fail("scratch allocation for timing the tile kernels", e);
    } else if (cudaError_t e = launch_fill_uniform(buf[i], sizes[i] / 2, FillType::kBF16,
                                                   4321u + i, stream)) {
      fail("filling scratch operands", e);
    }
  }
  if (note.empty()) {
    if (cudaError_t e = cudaMallocAsync((void**)&flags, sizeof(Flags), stream)) {
      flags = nullptr;
      fail("scratch allocation for timing the tile kernels", e);
    } else if (cudaError_t e = cudaMemsetAsync(flags, 0, sizeof(Flags), stream)) {
      fail("clearing scratch flags", e);
    }
  }
  for (auto& e : ev)
    if (note.empty())
      if (cudaError_t err = cudaEventCreate(&e)) fail("cudaEventCreate", err);
  TileRsArgs a = call;
  a.x = buf[0], a.w = buf[1], a.out = buf[2];
  for (int i = 0; i < n; ++i) a.peers.stage[i] = buf[3], a.peers.flags[i] = flags;
  a.mode = 1;
  a.err = nullptr;
  auto time_one = [&](int entry, int swizzle) -> float {
    a.entry = entry, a.swizzle = swizzle;
    float best = std::numeric_limits<float>::infinity();
    for (int pass = 0; pass < 3 && note.empty(); ++pass) {  // pass 0: load and warm up
      if (pass > 0) cudaEventRecord(ev[0], stream);
      bool ok = true;
      for (int k = 0; k < (pass ? kTileReps : 1) && ok; ++k) {
        ok = launch_tile_rs(a, stream) == cudaSuccess;
        advance_epoch<<<1, 1, 0, stream>>>(flags);  // the claim counters alternate per call
      }
      if (!ok) {
        cudaGetLastError();
        return best;  // an entry that cannot run this problem: +inf
      }
      if (pass == 0) continue;
      cudaEventRecord(ev[1], stream);
      float t = 0;
      if (cudaError_t e = cudaEventSynchronize(ev[1]))
        fail("timing the tile kernels", e);
      else if (cudaEventElapsedTime(&t, ev[0], ev[1]) == cudaSuccess)
        best = std::min(best, t / kTileReps);
    }
    return best;
  };
  if (note.empty()) {
    // Every entry at the asked swizzle, then the bands of the two fastest; a candidate must beat
    // the one kept by 1 % (noise), so the default stays unless another is clearly faster.
    float ms[kMenuSize];
    int first = 0, second = -1;
    for (int e = 0; e < kMenuSize && note.empty(); ++e) {
      ms[e] = time_one(e, call.swizzle);
      ++out->timed;
      if (e == 0) continue;
      if (ms[e] < 0.99f * ms[first]) second = first, first = e;
      else if (second < 0 || ms[e] < ms[second]) second = e;
    }
    out->entry = first, out->swizzle = call.swizzle, out->ms = ms[first];
    out->ms_default = ms[0];
    for (int e : {first, second}) {
      if (e < 0 || !note.empty()) continue;
      for (int sw : {1, 2, 4, 8, 16}) {
        if (sw == call.swizzle || !note.empty()) continue;
        const float t = time_one(e, sw);
        ++out->timed;
        if (t < 0.99f * out->ms) out->entry = e, out->swizzle = sw, out->ms = t;
      }
    }
    if (!(out->ms_default < std::numeric_limits<float>::infinity()) && note.empty())
      note = "the default entry failed to run on scratch operands";
  }
  for (char* b : buf)
    if (b) cudaFreeAsync(b, stream);
  if (flags) cudaFreeAsync(flags, stream);
  for (cudaEvent_t e : ev)
    if (e) cudaEventDestroy(e);
  cudaGetLastError();
  return note;
}

}  // namespace

std::string tile_rs_choose(const TileRsArgs& a, cudaStream_t stream, bool time_it, bool publish,
                           const std::string& cache_dir, TileChoice* out) {
  const std::string text = problem_text(a);
  const std::pair<int, std::string> key{a.peers.device, text};
  {
    std::lock_guard<std::mutex> hold(g_mu);
    auto it = g_choices.find(key);
    if (it != g_choices.end()) {
      *out = it->second;
      return "";
    }
  }
  TileChoice c;
  c.entry = 0, c.swizzle = a.swizzle;
  const std::string path = cache_path(cache_dir, text);
  if (read_choice(path, &c)) {
    c.note = "adopted " + path;
  } else if (!time_it) {
    *out = c;
    out->note = "not timed (no stream to time on): the default entry, not remembered";
    return "";
  } else {
    c.note = time_candidates(a, stream, &c);
    if (!c.note.empty()) {
      c = TileChoice{0, a.swizzle, 0, 0, c.timed, c.note};  // the default, not published
    } else if (!publish) {
      c.note = "timed, not published";
    } else if (!path.empty() && !publish_choice(path, c)) {
      TileChoice theirs;
      if (read_choice(path, &theirs)) c = theirs, c.note = "another process chose first";
    }
  }
  std::lock_guard<std::mutex> hold(g_mu);
  *out = g_choices.emplace(key, c).first->second;
  return "";
}

}  // namespace jaxoverlap
