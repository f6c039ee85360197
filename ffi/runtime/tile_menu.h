// The choice of the tile schedule's kernel per problem (runtime/tile_menu.cc).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kernels/tile_rs.h"

namespace jaxoverlap {

// Selection at first execution (as runtime/gemm.cc's plans): the entry and swizzle of a problem,
// timed on the call's stream, cached in this process and published to `cache_dir` (first
// writer wins, every process adopts the file), so every rank launches the same entry.
struct TileChoice {
  int entry = 0, swizzle = 8;
  int epi = 0;                   // TileRsArgs::epi: the entry's epilogue variant (store path)
  // the pick's time (the runoff's median if one ran, else the best of two timings) and entry
  // 0's at the given swizzle (the best of two timings of the first pass)
  float ms = 0, ms_default = 0;
  int timed = 0;                 // candidates timed (0: cached or adopted)
  std::string note;              // why nothing was timed or published ("" if it was)
};
// `a`: the call's arguments (entry, epi and mode ignored; a.swizzle is a candidate and the
// default).
// `time_it`: false under capture (the caller times on a side stream outside the capture, or
// keeps the default): then only the cache is read. Never launches on `stream` when false.
// Returns "" or why the call cannot run: only JAXOVERLAP_TILE_ENTRY (an entry forced for tests
// and tuning runs, tile_menu.cc) fails it; a selection that cannot time keeps entry 0.
std::string tile_rs_choose(const TileRsArgs& a, cudaStream_t stream, bool time_it, bool publish,
                           const std::string& cache_dir, TileChoice* out);

}  // namespace jaxoverlap
