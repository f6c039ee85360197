// Host-side declarations of the tile-fused GEMM + reduce-scatter (ffi/kernels/tile_rs.cuh): one
// persistent CUTLASS GEMM whose epilogue does the communication. Plain CUDA runtime types only.
//
// Rank r of n computes x[n * m, K] @ w[K, N]; row block j (m rows) of the product belongs to
// rank j. Tiles are handed out in the order blocks r+1, r+2, ..., r (own block last) from a
// counter, to whichever CTA asks next. A foreign tile's epilogue stores it (bf16/f16) straight
// into its owner's staging slot in peer memory and, once the stores are done, publishes one flag
// per 16-row x 128-column piece. An own tile's epilogue waits (bounded) for the matching pieces
// of every peer,
// adds them to its f32 accumulators in rank order and rounds once. No GEMM split, no
// communication kernel, no SM partition: the communication is in the epilogue of the tiles
// every other rank waits for, which come first.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/comm.h"

namespace jaxoverlap {

constexpr int kTileM = 128;    // tile rows (cooperative: two consumer warpgroups of 64; ping-pong:
                               // one warpgroup's); the columns (256 or 128), the schedule and the
                               // cluster are the menu entry's (tile_rs.cu)
constexpr int kTileSlabs = 8;  // 16-row slabs of a tile: one per consumer warp
constexpr int kFlagCols = 128; // columns per flag: a 16 x 128 piece of a slab, whatever the entry
constexpr int64_t kTileRowAlign = 256;  // a rank's rows: a multiple of this (every entry's cluster)

struct TileRsArgs {
  Peers peers;
  const void* x;       // [n * m, K] row-major
  const void* w;       // [K, N], row-major, or column-major if w_colmajor
  void* out;           // [m, N] row-major: this rank's block of the sum (mode 2: [n * m, N])
  int64_t m, N, K;     // m: rows per rank
  int32_t w_colmajor;
  DType dtype;
  int64_t slot_bytes;  // stride of the staging slots (tile_rs_slot_bytes)
  int32_t sm_count;    // CTAs of the persistent grid
  int32_t swizzle;     // cluster rows per raster band (L2 reuse of x within a band)
  int32_t entry;       // the menu entry (tile_rs_menu_size(); tile_rs_choose picks it)
  int32_t epi;         // the epilogue's variant, kTileEpi* bits (0: the entry's default;
                       // tile_rs_choose picks it with the entry)
  // 0: the fused op. Tools only (tools/probes/tile_rs_probe.cu): 1 = no waits and no flags (the
  // GEMM and the epilogue's traffic alone); 2 = a plain GEMM of all n * m rows into out (the
  // kernel's GEMM floor); 3 = 1 without the own tiles' adds; 4 = 3 with the foreign tiles stored
  // into out ([n * m, N]) too; 5 = 2 in the fused op's block order; 6 = 4 (before 2026-12-02's
  // last call: 4 without the prefetch below); 7 = 0 and 8 = 1 with the own tiles' L2 prefetch of
  // their peer data (tile_sched.cuh), which production no longer issues (measured slower);
  // 9 = 2 whose epilogue stores nothing (out is left as it was): the kernel's mainloop and
  // scheduler alone, what the epilogue's stores cost a plain GEMM.
  int32_t mode;
  int32_t stall_rank;  // test-only: this rank never publishes its tiles (-1: none)
  // Tools only: 1 = each foreign slab's flags published after a full system fence and always a
  // tile late (the epilogue before issue 24), for timing against today's.
  int32_t legacy_publish;
  int32_t op;
  uint64_t timeout_ns;
  ErrorRecord* err;
};

// TileRsArgs::epi bits: runtime choices of the epilogue (no instantiation more; the default
// build's ping-pong kernels have one store path and ignore them: JAXOVERLAP_TILE_PP_TENSOR_ONLY
// below); none changes a value or the protocol (ranks may run different ones).
// LaneStores: a ping-pong entry's foreign (and plain) slabs leave by the lanes' stores, as the
// cooperative kernel's do, instead of bulk async stores (faster prod on short K, slower plain on
// long K: tools builds with the ping-pong kernels' runtime paths time both). BulkStores: a cooperative entry's by bulk async stores
// (measured slower everywhere: tools only). (Two more bits, an own slab's L2 prefetch at its
// epilogue's start and flags every second foreign tile, were measured and dropped on 2026-12-02:
// docs/measurements.md, "The tile epilogue's store path as a runtime choice".)
// TensorStores (issue 23/24, 2026-12-03): foreign and plain slabs leave by TMA *tensor* stores, as
// stock CUTLASS's epilogue does -- one cp.async.bulk.tensor per 16 x 32 chunk (lane 0 of the warp)
// from a 64-byte-swizzled shared buffer, through a tensor map per destination (each peer's
// staging slot, both parities as rows 0..2m, or out) encoded at the launch -- instead of 16 row
// copies per chunk; overrides the other two bits. Ping-pong kernels only (with TensorLoads; a
// cooperative kernel ignores both unless built with JAXOVERLAP_TILE_TENSOR_COOP=1). Checked and
// timed on one GPU (session 9); in the selection from their first run across two processes
// (session 10) to session 16, since then the ping-pong kernels' only path (below).
//
// JAXOVERLAP_TILE_PP_TENSOR_ONLY (session 16): 1 (the default build) compiles the ping-pong kernels
// with the TMA tensor stores as their only store path -- the epi bits then change nothing in them,
// and their selection times no variant (tile_rs.cu's kPpAltEpi) -- because the runtime choice of
// paths costs the MMA loop: with the lanes' and bulk paths compiled in, entry 4's k-loop spills
// (stack 16 bytes) and its production kernel is 2.8 % slower on short K with the same tensor
// stores (one H200, same-entries A/B, docs/measurements.md "Session 16"). 0: tools builds with the
// runtime alternatives (bulk by default, LaneStores, TensorStores, TensorLoads) for A/B.
#ifndef JAXOVERLAP_TILE_PP_TENSOR_ONLY
#define JAXOVERLAP_TILE_PP_TENSOR_ONLY 1
#endif
constexpr int32_t kTileEpiLaneStores = 1;
constexpr int32_t kTileEpiBulkStores = 2;
constexpr int32_t kTileEpiTensorStores = 4;
// TensorLoads (2026-12-03): an own slab's peer units come by TMA tensor loads (lane 0, one per
// 16 x 32 unit, completing on an mbarrier per unit buffer) instead of every lane's cp.async; the
// same bytes added in the same order.
constexpr int32_t kTileEpiTensorLoads = 8;

// Flags of one rank's block: one per 16 rows x kFlagCols columns (row-major over the block), the
// same for every menu entry (a 256-column tile publishes and waits for two per slab), so the
// workspace and the protocol do not depend on the entry -- ranks may even run different ones.
int64_t tile_rs_flags_per_block(int64_t m, int64_t N);
// A staging slot (Peers::stage[j] + slot * slot_bytes holds what source stage_slot^-1 sends to
// rank j): the m x N block of each epoch parity (consecutive calls alternate, so a source never
// overwrites data its owner may still read), then the source's flags: the epoch of the call
// whose 16 x 128 piece has landed. Zeroed when the workspace is made.
int64_t tile_rs_slot_bytes(int64_t m, int64_t N);
__host__ __device__ inline uint32_t* tile_slab_flags(char* slot, int64_t m, int64_t N) {
  return reinterpret_cast<uint32_t*>(slot + 2 * m * N * 2);
}

// "" if the kernel runs this problem, else why not.
std::string tile_rs_unsupported(DType dtype, int n, int64_t m, int64_t N, int64_t K,
                                const void* x, const void* w, const void* out);
// The menu (tile_rs.cu): entries 0 .. tile_rs_menu_size() - 1, entry 0 the default.
int tile_rs_menu_size();
const char* tile_rs_entry_name(int entry);  // e.g. "128x256c2x1"
// The epilogue variants the selection also times for an entry, one bit each (each alone beside
// epi 0: its other store paths; 0: none).
int32_t tile_rs_entry_alt_epi(int entry);
// Loads one entry's kernel on the current device and sets its shared-memory limit (outside any
// capture; DESIGN.md decision 5: before a kernel of ours can spin). Idempotent, thread-safe.
cudaError_t preload_tile_entry(int entry, bool w_colmajor);
// Whether entry a.entry can launch the problem of `a` (CUTLASS's can_implement; its cluster fits
// on the GPU): cudaSuccess or why not. Preloads the entry.
cudaError_t check_tile_entry(const TileRsArgs& a);
// The call's kernel and its end: the kernel's last CTA releases the peers' staging slots, fills
// the output with NaN if a wait gave up and advances the epoch (tile_rs.cuh, end_call): no
// release or finish kernel follows it. In an emulated group (every rank's flags one block: the
// probes, the selection's scratch timing) it releases for the emulated peers too.
cudaError_t launch_tile_rs(const TileRsArgs& a, cudaStream_t stream);

// Ends a call of an emulated group of n ranks whose flags are all `flags`, for kernels that do
// not end their calls themselves (the stock probe's hybrids: CUTLASS's kernel with our epilogue),
// on `stream`: every peer has released the staging it read, and the epoch advances (the claim
// counters alternate per call).
cudaError_t tile_rs_finish_emulated(Flags* flags, int n, cudaStream_t stream);

}  // namespace jaxoverlap
