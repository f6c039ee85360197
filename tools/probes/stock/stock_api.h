// The stock CUTLASS GEMMs of tools/probes/tile_stock_probe.cu (stock_gemm.cuh): host interface.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace stock {

struct Problem {
  const void* x;  // [M, K] bf16 row-major
  const void* w;  // [K, N] bf16, row-major, or column-major ([N, K] row-major) for a wcol entry
  void* out;      // [M, N] bf16 row-major
  int64_t M, N, K;
  int sm_count;
  int swizzle;    // CUTLASS's max_swizzle_size
  int raster;     // 0 heuristic, 1 along N, 2 along M
  void* workspace;
  size_t workspace_bytes;
  void* tile_flags;  // hybrid entries: a zeroed jaxoverlap::Flags (the epilogue reads its epoch)
  int mode = 2;      // hybrid entries: TileRsArgs::mode (2: plain; 9: plain, storing nothing)
  int epi = 0;       // hybrid entries: TileRsArgs::epi (the store path: 4 = the TMA tensor stores)
};

using Run = cudaError_t (*)(const Problem&, cudaStream_t);

#define STOCK_LIST(X)                                       \
  X(coop128x256c2x1, false, 128, 256, 2, 1, false, false)   \
  X(pp128x128c1x1, false, 128, 128, 1, 1, true, false)      \
  X(pp128x128c2x1, false, 128, 128, 2, 1, true, false)      \
  X(sk128x256c2x1, false, 128, 256, 2, 1, false, true)      \
  X(coop256x128c1x2, false, 256, 128, 1, 2, false, false)   \
  X(pp128x192c2x1, false, 128, 192, 2, 1, true, false)

// Hybrids (hybrid_gemm.cuh): our TileKernel's mainloop and TileEpilogue (plain mode) with
// CUTLASS's persistent tile scheduler instead of ClaimScheduler: stock -> hybrid is the
// epilogue's cost, hybrid -> ours the scheduler's.
#define HYBRID_LIST(X)                      \
  X(hyb128x256c2x1, 256, 2, 1, false)        \
  X(hybpp128x128c1x1, 128, 1, 1, true)       \
  X(hybpp128x128c2x1, 128, 2, 1, true)

// Variants of our scheduler (hybrid_gemm.cuh's VARIANT_GEMM, tile_sched.cuh's ClaimedTilesVariant):
// our mainloop, epilogue and raster band with ClaimScheduler variant V (1: a static order, no
// counter and no ring; 2: that order through the claim ring; 3: production's claims and their
// timing with that order's tiles, no counter). Files hybv<V>_<name>.cu.
#define VARIANT_LIST(X)                          \
  X(hybv1_128x256c2x1, 256, 2, 1, false, 1)      \
  X(hybv1_pp128x128c2x1, 128, 2, 1, true, 1)      \
  X(hybv2_pp128x128c2x1, 128, 2, 1, true, 2)      \
  X(hybv3_pp128x128c2x1, 128, 2, 1, true, 3)

// NOHYB=1 builds (tools/probes/build_tile_rs_probe.sh): stock kernels only, no hybrids or
// variants (they recompile with every change of our kernel's headers).
#ifdef JAXOVERLAP_STOCK_NO_HYBRIDS
#undef HYBRID_LIST
#undef VARIANT_LIST
#define HYBRID_LIST(X)
#define VARIANT_LIST(X)
#endif

#define STOCK_DECLARE(NAME, ...) cudaError_t run_##NAME(const Problem&, cudaStream_t);
STOCK_LIST(STOCK_DECLARE)
HYBRID_LIST(STOCK_DECLARE)
VARIANT_LIST(STOCK_DECLARE)
#undef STOCK_DECLARE

}  // namespace stock
