// The tile schedule's choice of a menu entry per problem (kernels/tile_rs.cu has the menu): timed
// at the problem's first execution, as the GEMM plans are (runtime/gemm.h), cached in this
// process and published to the plans' cache directory, so every rank launches the same entry.
#include "runtime/tile_menu.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels/fill.h"
#include "runtime/gemm.h"

namespace jaxoverlap {

namespace {

std::mutex g_mu;                                              // g_choices
std::map<std::pair<int, std::string>, TileChoice> g_choices;  // (device, problem) -> choice

constexpr int kTileReps = 3;  // launches per timing (1 for a kernel over 1 ms); two timings per
                              // candidate in the first pass and the bands, the best kept (the
                              // runoff: one per round)
// The selection runs at the problem's first call, under the device's lock, while a peer that
// launched already spins: after the first pass over the menu, the raster bands are tried only
// while the selection has taken less than this.
constexpr double kTileBudgetS = 0.4;

// The problem as the cache knows it: device kind, group size, shape, w layout, grid, the swizzle
// asked for and the menu (a different build's menu is a different problem).
// Device name and SM count, read once per device (cudaGetDeviceProperties is slow: it must not
// run on every call).
std::string device_text(int device) {
  static std::mutex mu;
  static std::map<int, std::string> texts;
  std::lock_guard<std::mutex> hold(mu);
  auto it = texts.find(device);
  if (it != texts.end()) return it->second;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return "unknown device";  // not remembered: asked again next time
  }
  return texts[device] = std::string(prop.name) + "/" + std::to_string(prop.multiProcessorCount);
}

std::string problem_text(const TileRsArgs& a) {
  std::string text = device_text(a.peers.device);
  for (int64_t v : {(int64_t)a.dtype, (int64_t)a.peers.n, a.m, a.N, a.K, (int64_t)a.w_colmajor,
                    (int64_t)a.sm_count, (int64_t)a.swizzle})
    text += " " + std::to_string(v);
  // each entry's name and the variants its selection times: a choice made by another menu, or
  // by kernels of another store-path build (session 16: the ping-pong entries' one path), is
  // not adopted
  for (int e = 0; e < tile_rs_menu_size(); ++e)
    text += std::string(" ") + tile_rs_entry_name(e) + "/" +
            std::to_string(tile_rs_entry_alt_epi(e));
  return text + " epi";  // choices with an epilogue variant (older files lack it: not adopted)
}

std::string cache_path(const std::string& dir, const std::string& text) {
  if (dir.empty()) return "";
  char name[40];
  std::snprintf(name, sizeof(name), "tile-%016zx", std::hash<std::string>{}(text));
  return dir + "/" + name;
}

// "<entry name> <swizzle> <ms> <ms of entry 0> <epi>\n"; false if absent or not of this menu.
bool read_choice(const std::string& path, TileChoice* c) {
  if (path.empty()) return false;
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return false;
  char name[64] = {};
  int swizzle = 0, epi = 0;
  float ms = 0, ms0 = 0;
  const bool ok = std::fscanf(f, "%63s %d %f %f %d", name, &swizzle, &ms, &ms0, &epi) == 5;
  std::fclose(f);
  if (!ok || swizzle < 1 || swizzle > 64 || epi < 0) return false;
  for (int e = 0; e < tile_rs_menu_size(); ++e)
    if (std::string(name) == tile_rs_entry_name(e)) {
      // one of the variants this entry times: 0 or a single bit of its alternatives
      if ((epi & (epi - 1)) || (epi & ~tile_rs_entry_alt_epi(e))) return false;
      c->entry = e, c->swizzle = swizzle, c->ms = ms, c->ms_default = ms0, c->timed = 0;
      c->epi = epi;
      return true;
    }
  return false;
}

// First writer wins, every process adopts the file (runtime/gemm.h: publish_once).
bool publish_choice(const std::string& path, const TileChoice& c) {
  char text[128];
  std::snprintf(text, sizeof(text), "%s %d %.6f %.6f %d\n", tile_rs_entry_name(c.entry), c.swizzle,
                c.ms, c.ms_default, c.epi);
  return publish_once(path, text);
}

struct Candidate {
  int entry, swizzle, epi;
  float ms;
};

// The runoff (session 16). The first pass and the bands time each candidate alone, in sequence,
// and keep the incumbent unless another is 1 % faster, so candidates within 1-2 % of each other
// win or lose by the GPU's drift (session 15: between two runs the pick changed on 3 of 11
// shapes). So every configuration within kRunoffBand of the kept one (the kept one and at most
// kRunoffMax - 1 others, the fastest first) is timed again in interleaved rounds, one warm-up
// launch and one timing each, rotating the order, and the lowest median wins: at least
// kRunoffMinRounds rounds, then more up to kRunoffRounds while the selection is within
// kRunoffBudgetS.
constexpr float kRunoffBand = 1.03f;
constexpr int kRunoffMax = 4;
constexpr int kRunoffMinRounds = 3, kRunoffRounds = 7;
constexpr double kRunoffBudgetS = 0.8;

template <class TimeOne, class Elapsed>
void runoff(const std::vector<Candidate>& timed, TimeOne& time_one, Elapsed& elapsed_s,
            TileChoice* out) {
  std::vector<Candidate> fin{{out->entry, out->swizzle, out->epi, out->ms}};
  std::vector<Candidate> rest;
  for (const Candidate& c : timed)
    if (c.ms <= kRunoffBand * out->ms) rest.push_back(c);
  std::sort(rest.begin(), rest.end(),
            [](const Candidate& x, const Candidate& y) { return x.ms < y.ms; });
  for (const Candidate& c : rest) {
    if ((int)fin.size() >= kRunoffMax) break;
    bool seen = false;
    for (const Candidate& f : fin)
      seen |= f.entry == c.entry && f.swizzle == c.swizzle && f.epi == c.epi;
    if (!seen) fin.push_back(c);
  }
  if (fin.size() < 2) return;
  const int k = (int)fin.size();
  std::vector<std::vector<float>> t(k);
  for (int round = 0; round < kRunoffRounds; ++round) {
    if (round >= kRunoffMinRounds && elapsed_s() > kRunoffBudgetS) break;
    for (int i = 0; i < k; ++i) {
      const Candidate& c = fin[(i + round) % k];
      const float ms = time_one(c.entry, c.swizzle, c.epi, 1);
      ++out->timed;
      if (!(ms < std::numeric_limits<float>::infinity())) return;  // a failure: keep the pick
      t[(i + round) % k].push_back(ms);
    }
  }
  int best = 0;
  std::vector<float> med(k);
  for (int i = 0; i < k; ++i) {
    std::sort(t[i].begin(), t[i].end());
    med[i] = t[i][t[i].size() / 2];
    if (med[i] < med[best]) best = i;
  }
  out->entry = fin[best].entry, out->swizzle = fin[best].swizzle, out->epi = fin[best].epi;
  out->ms = med[best];
}

// Times the candidates as the production kernel (mode 0) of an emulated group of n ranks on
// this GPU alone, so the pick is the fastest production kernel, flags and fences included: every
// peer's staging and flags are one scratch buffer of this rank, the foreign tiles' stores and
// flags land in the very slots the own tiles wait on (slot n - 1 - j for block j, slot s - 1 for
// source s), so every flag is published, every fence executed, and every own tile adds n - 1
// slabs once their foreign tiles are done (claimed first: no wait depends on a CTA that never
// started). Random scratch operands on `stream` (stream-ordered allocations: only this stream is
// synchronised); the staging starts zeroed (no stale flag of a later epoch).
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
    } else if (cudaError_t e = i == 3 ? cudaMemsetAsync(buf[i], 0, sizes[i], stream)
                                      : launch_fill_uniform(buf[i], sizes[i] / 2, FillType::kBF16,
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
  a.mode = 0;
  a.err = nullptr;
  a.peers.abort = nullptr;  // not the group's: a scratch epoch is no call of it
  a.peers.dead = nullptr;
  a.stall_rank = -1;
  // The emulated waits pass at once; should one ever not, it gives up after 1 s, not after the
  // call's timeout (100 s by default) per entry timed.
  a.timeout_ns = std::min<uint64_t>(call.timeout_ns, 1000000000ull);
  // An entry that cannot launch the problem (can_implement, its cluster's occupancy) is not
  // launched: +inf. Pass 0 loads and warms up (one launch) and sets the launches per timing.
  // `passes` timings after the warm-up, the best kept.
  auto time_one = [&](int entry, int swizzle, int epi, int passes = 2) -> float {
    a.entry = entry, a.swizzle = swizzle, a.epi = epi;
    float best = std::numeric_limits<float>::infinity();
    if (check_tile_entry(a) != cudaSuccess) {
      cudaGetLastError();
      return best;
    }
    int reps = 1;
    for (int pass = 0; pass <= passes && note.empty(); ++pass) {
      const int count = pass ? reps : 1;
      cudaEventRecord(ev[0], stream);
      bool ok = true;
      for (int k = 0; k < count && ok; ++k) {
        ok = launch_tile_rs(a, stream) == cudaSuccess;  // the call's end included
      }
      if (!ok) {
        cudaGetLastError();
        return std::numeric_limits<float>::infinity();
      }
      cudaEventRecord(ev[1], stream);
      float t = 0;
      if (cudaError_t e = cudaEventSynchronize(ev[1]))
        fail("timing the tile kernels", e);
      else if (cudaEventElapsedTime(&t, ev[0], ev[1]) != cudaSuccess)
        cudaGetLastError();
      else if (pass == 0)
        reps = t < 1.0f ? kTileReps : 1;
      else
        best = std::min(best, t / count);
    }
    return best;
  };
  const auto start = std::chrono::steady_clock::now();
  auto elapsed_s = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  if (note.empty()) {
    // Every entry at the asked swizzle, with its default epilogue and its other variants
    // (tile_rs_entry_alt_epi: none in the default build; in tools builds with the ping-pong
    // entries' runtime store paths, their lanes' and tensor stores, which win on short K where
    // their bulk stores lose to every cooperative entry: each variant is timed whatever the
    // entry's rank), then the bands of the two fastest with their faster variant (within the
    // budget); a candidate must beat the one kept by 1 % (noise). Then the runoff between the
    // kept one and those within 3 % of it (above), whose lowest median wins with no margin: its
    // interleaved rounds do what the margin did for sequential timings. Its three rounds run
    // whatever the time taken so far (up to 4 candidates x 3 x (1 + kTileReps) launches).
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<Candidate> timed;  // every configuration timed, for the runoff
    std::vector<float> ms(tile_rs_menu_size());
    std::vector<int> epi(tile_rs_menu_size(), 0);
    int first = -1, second = -1;
    for (int e = 0; e < tile_rs_menu_size() && note.empty(); ++e) {
      ms[e] = time_one(e, call.swizzle, 0);
      ++out->timed;
      timed.push_back({e, call.swizzle, 0, ms[e]});
      // each alternative variant (a bit of tile_rs_entry_alt_epi) alone
      for (int alt = 1; alt <= tile_rs_entry_alt_epi(e) && note.empty(); alt <<= 1) {
        if (!(tile_rs_entry_alt_epi(e) & alt)) continue;
        const float t = time_one(e, call.swizzle, alt);
        ++out->timed;
        timed.push_back({e, call.swizzle, alt, t});
        if (t < 0.99f * ms[e]) ms[e] = t, epi[e] = alt;
      }
      if (!(ms[e] < inf)) continue;
      if (first < 0) first = e;
      else if (ms[e] < 0.99f * ms[first]) second = first, first = e;
      else if (second < 0 || ms[e] < ms[second]) second = e;
    }
    if (first < 0 && note.empty()) note = "no menu entry could run the problem on scratch operands";
    if (first >= 0)
      out->entry = first, out->swizzle = call.swizzle, out->epi = epi[first], out->ms = ms[first];
    out->ms_default = ms[0];
    for (int e : {first, second}) {
      if (e < 0 || !note.empty()) continue;
      for (int sw : {1, 2, 4, 8, 16}) {
        if (sw == call.swizzle || !note.empty() || elapsed_s() > kTileBudgetS) continue;
        const float t = time_one(e, sw, epi[e]);
        ++out->timed;
        timed.push_back({e, sw, epi[e], t});
        if (t < 0.99f * out->ms) out->entry = e, out->swizzle = sw, out->epi = epi[e], out->ms = t;
      }
    }
    if (first >= 0 && note.empty()) runoff(timed, time_one, elapsed_s, out);
  }
  for (char* b : buf)
    if (b) cudaFreeAsync(b, stream);
  if (flags) cudaFreeAsync(flags, stream);
  for (cudaEvent_t e : ev)
    if (e) cudaEventDestroy(e);
  cudaGetLastError();
  return note;
}

// JAXOVERLAP_TILE_ENTRY=<entry name>[:<epi>]: that menu entry with that epilogue variant
// (kTileEpi* bits, default 0) at the call's swizzle, instead of the selection -- not timed, not
// published, not remembered. For tests and tuning runs (tests/gpu/test_xproc_gpu.py runs every
// entry and store path across two processes with it); every process of a group must set the
// same. An unknown name, a variant outside 0..15 or an entry that cannot launch the problem
// fails the call with a message that names the menu.
std::string forced_choice(const TileRsArgs& a, const std::string& spec, TileChoice* out) {
  const size_t colon = spec.find(':');
  const std::string name = spec.substr(0, colon);
  long epi = 0;
  if (colon != std::string::npos) {
    const std::string v = spec.substr(colon + 1);
    char* end = nullptr;
    epi = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end || epi < 0 || epi > 15)
      return "JAXOVERLAP_TILE_ENTRY=" + spec +
             ": the epilogue variant after ':' must be 0..15 (kTileEpi* bits, kernels/tile_rs.h)";
  }
  std::string names;
  for (int e = 0; e < tile_rs_menu_size(); ++e) {
    if (name == tile_rs_entry_name(e)) {
      TileRsArgs t = a;
      t.entry = e, t.epi = (int32_t)epi;
      if (cudaError_t err = check_tile_entry(t)) {
        cudaGetLastError();
        return "JAXOVERLAP_TILE_ENTRY=" + spec + ": entry " + name +
               " cannot launch this problem (" + cudaGetErrorString(err) + ")";
      }
      *out = TileChoice{};
      out->entry = e, out->swizzle = a.swizzle, out->epi = (int)epi;
      out->note = "forced by JAXOVERLAP_TILE_ENTRY=" + spec;
      return "";
    }
    names += std::string(e ? ", " : "") + tile_rs_entry_name(e);
  }
  return "JAXOVERLAP_TILE_ENTRY=" + spec + " names no entry of the tile menu (" + names + ")";
}

}  // namespace

std::string tile_rs_choose(const TileRsArgs& a, cudaStream_t stream, bool time_it, bool publish,
                           const std::string& cache_dir, TileChoice* out) {
  if (const char* forced = std::getenv("JAXOVERLAP_TILE_ENTRY"); forced && *forced)
    return forced_choice(a, forced, out);
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
      c = TileChoice{0, a.swizzle, 0, 0, 0, c.timed, c.note};  // the default, not published
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
