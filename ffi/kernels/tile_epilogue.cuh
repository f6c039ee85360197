// The tile-fused GEMM + reduce-scatter's epilogue (protocol in tile_rs.h; the kernel that runs it
// in tile_rs.cuh): TileEpilogue, per 16-row slab (one consumer warp): foreign tiles -> the owner's
// staging (peer memory) through shared memory, by TMA tensor stores (ping-pong; tools builds:
// bulk async stores) or the lanes' coalesced stores (cooperative), neither waited for; the slab's flags published after the
// stores have landed; own tiles check each peer's flags of the slab, load the peers' slabs
// asynchronously (tile_slab.cuh), add them in rank order to the f32 accumulators, round once,
// store. TileCollective plugs it into CUTLASS's warp-specialised kernels. Device code only.
#pragma once

#include <cuda.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>

#include "kernels/tile_rs.h"
#include "kernels/tile_sched.cuh"
#include "kernels/tile_slab.cuh"
// after tile_sched.cuh: the mailbox then follows the claim ring in static shared memory
#include "kernels/tile_publisher.cuh"

namespace jaxoverlap::tile {

struct EpilogueArgs {
  Peers peers;
  char* out;
  int64_t m, N, slot_bytes;
  int32_t flag_cols;  // flags per 16-row slab of a block (one per kFlagCols columns)
  int32_t own_first;  // the first cluster tile of the own block in claim order (tile_sched.cuh)
  int32_t legacy_publish;  // tools only (TileRsArgs::legacy_publish)
  int32_t claims;  // 1: the tiles come from ClaimScheduler (ping-pong: end_tile claims the next)
  int32_t epi;     // TileRsArgs::epi (kTileEpi* bits)
  int32_t mode, stall_rank, op;
  uint64_t timeout_ns;
  ErrorRecord* err;
  // epi kTileEpiTensorStores, or a ping-pong kernel of the default build (kTensorOnly): the TMA
  // tensor maps of the stores (TileKernel::encode_maps, at the launch): maps[j], j != rank, the staging slot this rank fills on rank j (16-bit [2m, N]: the
  // two parities' blocks); maps[rank] out as a plain GEMM writes it ([n m, N]; modes 2, 4, 5, 6
  // only). Kernel parameters (grid constants): TMA reads them in place.
  CUtensorMap maps[kMaxRanks];
  // epi kTileEpiTensorLoads: loads[i], the staging slot i of this rank (16-bit [2m, N], what
  // source rank + 1 + i sends), for the own tiles' TMA loads of their peer slabs.
  CUtensorMap loads[kMaxRanks - 1];
};

// A 16-row slab's accumulators: the ping-pong kernel's second slab of a warp is the same layout
// at an offset.
template <class Acc>
struct SlabAcc {
  Acc& acc;
  int off;
  CUTLASS_DEVICE float& operator()(int i) const { return acc(i + off); }
};

// The epilogue, in the operator() form that CUTLASS's Sm90TmaWarpSpecializedAdapter calls for
// each tile with the accumulators of the calling thread. Cooperative kernel: thread t (of 256)
// holds, for the 64 x kTileN accumulator block of warpgroup t / 128 (SM90 64xNx16 f32 layout),
// value i = v0 + 2 v1 + 4 v2 at row 16 (t / 32) + (t % 32) / 4 + 8 v1 of the tile and column
// 8 v2 + 2 (t % 4) + v0: each warp owns a 16-row slab, which is the unit of communication.
// Ping-pong kernel (kPingpong): one warpgroup holds the whole 128-row tile, thread t (of 128)
// the same for rows 64 h + ..., at i + h kTileN / 2: warp w owns slabs w and w + 4.
template <class Element, int kTileN, bool kPingpong, int kClusterCtas = 1>
class TileEpilogue {
  using Sched = ClaimScheduler<kTileN, kClusterCtas, 1, kPingpong>;
  static_assert(kTileN % kFlagCols == 0, "a tile covers whole flag columns");
  static constexpr int kFlagsPerSlab = kTileN / kFlagCols;
  static constexpr int kSlabsPerWarp = kPingpong ? 2 : 1;
  static constexpr int kThreads = kPingpong ? 128 : 256;  // the epilogue's threads per tile
  using Slab = SlabIO<Element, kTileN>;
  // Foreign and plain slabs leave by TMA tensor stores in the ping-pong kernel (its only path in
  // the default build, kTensorOnly below; tools builds: bulk async stores by default, the epi
  // bits choosing the others), by stores of the warp's lanes in the cooperative one by default
  // (its epi bits choose bulk stores: a runtime choice, tools only). The
  // cooperative kernel's epilogue issues a whole tile's bulk stores at once, 1,024 small copies
  // per CTA that queue in the TMA unit ahead of the next tile's mainloop loads (measured: 128x256
  // plain GEMMs 10 % slower, docs/measurements.md); the ping-pong kernel's spread under the other
  // warpgroup's MMA, whose shared memory the lanes' stores contend for -- but on short K its
  // 512 bulk copies per tile cost more than the lanes' stores do (docs/tile-schedule.md).
  // kTileEpiTensorStores: TMA tensor stores instead (asynchronous like the bulk ones, so bulk()
  // holds for them too: the same waits and fences before a flag); kTileEpiTensorLoads: the own
  // slabs' peer units by TMA loads. Compiled into the ping-pong kernels only (the bits do nothing
  // in a cooperative one): both paths together cost the cooperative kernel 28 bytes of spills,
  // and its selection does not time them (JAXOVERLAP_TILE_TENSOR_COOP=1: probe builds that do).
#ifndef JAXOVERLAP_TILE_TENSOR_COOP
#define JAXOVERLAP_TILE_TENSOR_COOP 0
#endif
  static constexpr bool kTensorPaths = kPingpong || JAXOVERLAP_TILE_TENSOR_COOP;
  // How flush() releases the flags (JAXOVERLAP_TILE_FLAG_RELEASE; issue 24, sessions 13-14):
  // 1 (production) one fence.acq_rel.sys, then st.relaxed.sys per flag: PTX's release pattern
  // (a fence followed by a strong store), cumulative like st.release, one MEMBAR.ALL.SYS per
  // flush in lane 0 of the MMA warp; 0 st.release.sys per flag (a MEMBAR.ALL.SYS each: 2-3 %
  // slower fused ops on short K, measured); 2 st.release.gpu per flag -- a probe build's
  // measurement of what the system scope costs (as much as 1), valid on one GPU only, never for
  // peers on other GPUs; 3 no fence at all, not even the bulk stores' proxy fence -- no valid
  // protocol, a probe build's bound on what the fences cost (one GPU: 0.963-0.985 of 1 in prod
  // on short K, session 14). (fence.proxy.async.global and fence.release.sys in place of 1's
  // fences, a MEMBAR.ALL.GPU and an L1 invalidation fewer, measured equal to 1.)
#ifndef JAXOVERLAP_TILE_FLAG_RELEASE
#define JAXOVERLAP_TILE_FLAG_RELEASE 1
#endif
  static constexpr int kFlagRelease = JAXOVERLAP_TILE_FLAG_RELEASE;
  static_assert(kFlagRelease >= 0 && kFlagRelease <= 3, "JAXOVERLAP_TILE_FLAG_RELEASE: 0 to 3");

 public:
  // The ping-pong kernels' one store path (JAXOVERLAP_TILE_PP_TENSOR_ONLY, tile_rs.h): the TMA
  // tensor stores whatever the epi bits; no lanes' or bulk stores, no tensor loads. (Public:
  // TileKernel::encode_maps encodes the stores' maps for it.)
  static constexpr bool kTensorOnly = kPingpong && JAXOVERLAP_TILE_PP_TENSOR_ONLY != 0;

 private:
  CUTLASS_DEVICE bool tensor() const {
    if constexpr (kTensorOnly) return true;
    return kTensorPaths && (p_->epi & kTileEpiTensorStores) != 0;
  }
  CUTLASS_DEVICE bool tensor_loads() const {
    if constexpr (kTensorOnly) return false;
    return kTensorPaths && (p_->epi & kTileEpiTensorLoads) != 0;
  }
  CUTLASS_DEVICE bool bulk() const {
    if constexpr (kTensorOnly) return true;
    return tensor() ||
           (kPingpong ? !(p_->epi & kTileEpiLaneStores) : (p_->epi & kTileEpiBulkStores) != 0);
  }

 public:
  using ElementOutput = Element;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementC = Element;
  using ElementD = Element;
  using StrideC = cute::Stride<int64_t, cute::_1, int64_t>;
  using StrideD = StrideC;
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  static constexpr bool kPerWarpgroupTiles = kPingpong;

  struct SharedStorage {
    alignas(128) float slab[kTileSlabs][kSlabWords];  // one per consumer warp
    // epi kTileEpiTensorLoads: each warp's unit buffers' mbarriers (a multiple of 128 bytes)
    alignas(128) uint64_t mbar[kTileSlabs][kUnitBufs];
  };
  struct Arguments {
    EpilogueArgs a;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }

  // CUTLASS's cooperative kernel constructs the epilogue once with every thread before it
  // initialises its pipelines and arrives at the cluster barrier (and once more in the consumer
  // warps only): the producer threads of that first construction clear the scheduler's ring,
  // fenced before the arrival, so no peer CTA's claim can be overwritten by the clearing. (The
  // ping-pong kernel constructs it after the arrival: its scheduler pipeline clears the ring,
  // tile_sched.cuh.)
  CUTLASS_HOST_DEVICE explicit TileEpilogue(Params const& p) : p_(&p.a) {
#if defined(__CUDA_ARCH__)
    if (!kPingpong && threadIdx.x < kRing) {
      claim_ring()[threadIdx.x] = 0;
      asm volatile("fence.acq_rel.cluster;" ::: "memory");
    }
#endif
  }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK, BlockCoordMNKL blk,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma,
                                 ResidueMNK, int thread_idx, char* smem) {
    static_assert(cute::size(FrgLayout{}) == kTileM * kTileN / kThreads, "unexpected accumulators");
    auto& acc = const_cast<cute::Tensor<FrgEngine, FrgLayout>&>(accumulators);
    const EpilogueArgs& a = *p_;
    const int w = thread_idx / 32, lane = thread_idx % 32;
    Flags* local = a.peers.flags[a.peers.rank];
    if (e_ == 0) e_ = *(volatile uint32_t*)&local->epoch + 1u;
    flush();
    // This CTA's k-th tile (ping-pong: warpgroup g runs tiles g, g + 2, ...).
    const uint32_t k = kPingpong ? 2 * k_ + (threadIdx.x / 128 - 1) : k_;
    ++k_;
    last_k_ = k;
    if (kPingpong && a.claims) Sched::claim_next(local, e_, k + 2, a.claims);  // read at end_tile
    if (a.mode == 9) return;  // tools: the GEMM without its epilogue's stores (tile_rs.h)
    const int64_t row = (int64_t)cute::get<0>(blk) * kTileM;  // the tile's first row
    const int64_t col0 = (int64_t)cute::get<1>(blk) * kTileN;
    if (col0 >= a.N) return;  // a cluster's CTA past the last column (clusters along N)
    // The warp's shared rows (ping-pong: the two warpgroups' warps have their own).
    float* sm = reinterpret_cast<SharedStorage*>(smem)->slab[kPingpong ? threadIdx.x / 32 - 4 : w];
    const int n = a.peers.n, r = a.peers.rank;
    const int j = (int)(row / a.m);
    const int64_t block_bytes = a.m * a.N * 2;
    const int64_t parity = (e_ & 1u) * block_bytes;
    const int nflags = (int)min((int64_t)kFlagsPerSlab, a.flag_cols - col0 / kFlagCols);
    if (kTStoreProbe == 5 && a.mode == 2) return;  // tools: mode 2 without its slabs' stores
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < kSlabsPerWarp; ++h) {
      const SlabAcc<std::remove_reference_t<decltype(acc)>> sacc{acc, h * (kTileN / 2)};
      const int s = w + 4 * h;  // the slab (16 rows) of the tile
      if (a.mode == 2 || a.mode == 5) {
        store_slab(sacc, a.out + ((row + 16 * s) * a.N + col0) * 2, sm, lane, col0, r,
                   row + 16 * s);
        continue;
      }
      const int64_t brow = row - j * a.m + 16 * s;  // the slab's first row in its block
      // The slab's first flag (16 rows x kFlagCols columns each); nflags: how many it covers.
      const int64_t flag0 = (brow / 16) * a.flag_cols + col0 / kFlagCols;
      if (j != r) {
        const int slot = stage_slot(r, j, n);
        if ((a.mode == 0 || a.mode == 7) && !(freed_ & (1u << j))) {
          // Double-buffered staging: this call writes the parity that call e - 2 used.
          if (!warp_wait(&local->slot_free[j], e_ - 2u, {a.op, kWaitSlotFree, j, -1}, lane, false))
            failed_ = true;
          // The owner read the slot two calls ago with generic loads; the bulk stores below
          // (the async proxy) overwrite it: order them after the acquire.
          if (bulk()) asm volatile("fence.proxy.async.global;" ::: "memory");
          freed_ |= 1u << j;
        }
        char* dst_slot = a.peers.stage[j] + slot * a.slot_bytes;
        const bool to_out = a.mode == 4 || a.mode == 6;
        char* dst = to_out ? a.out + ((row + 16 * s) * a.N + col0) * 2
                           : dst_slot + parity + (brow * a.N + col0) * 2;
        // tensor stores: out's map at the tile's row, or the slot's at its parity's block row
        store_slab(sacc, dst, sm, lane, col0, to_out ? r : j,
                   to_out ? row + 16 * s : (int64_t)(e_ & 1u) * a.m + brow);
        if ((a.mode == 0 || a.mode == 7) && r != a.stall_rank) {
          pending_[h] = tile_slab_flags(dst_slot, a.m, a.N) + flag0;
          pending_n_ = nflags;
        }
        continue;
      }
      // The peers' slabs, in rank order after ours: source r + t sits in staging slot t - 1.
      // Their flags: one acquire per lane (all at once); only if one is not set yet, each in turn
      // with the bounded wait.
      if ((a.mode == 0 || a.mode == 7) && !failed_) {
        if (!__all_sync(0xffffffffu, own_flags_set(brow, col0, nflags, lane)))
          for (int t = 1; t < n; ++t) {
            const int src = (r + t) % n;
            char* src_slot = a.peers.stage[r] + stage_slot(src, r, n) * a.slot_bytes;
            for (int f = 0; f < nflags && !failed_; ++f) {
              const uint32_t* flag = tile_slab_flags(src_slot, a.m, a.N) + flag0 + f;
              if (!warp_wait(flag, e_, {a.op, kWaitTile, src, (int)(flag0 + f)}, lane, true))
                failed_ = true;
            }
          }
        __syncwarp();  // every lane's loads after every lane's acquire
      }
      drain_reads();  // the warp's buffers: no bulk store still reads them
      const int summed = a.mode == 3 || a.mode == 4 || a.mode == 6 ? 0 : n - 1;  // tools: no adds
      const char* first = a.peers.stage[r] + parity + (brow * a.N + col0) * 2;
      if (tensor_loads()) {
        uint64_t* mbar =
            reinterpret_cast<SharedStorage*>(smem)->mbar[kPingpong ? threadIdx.x / 32 - 4 : w];
        if (!mbar_ready_) {  // the warp's first own slab: its mbarriers
          if (lane == 0) {
            for (int b = 0; b < kUnitBufs; ++b) mbar_init(mbar + b, 1);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          }
          __syncwarp();
          mbar_ready_ = true;
        }
        Slab::template sum_store<true>(sacc, first, a.slot_bytes, summed,
                                       a.out + (brow * a.N + col0) * 2, sm, lane, col0, a.N,
                                       a.loads, (int32_t)((e_ & 1u) * a.m + brow), mbar,
                                       &mphase_);
      } else {
        Slab::sum_store(sacc, first, a.slot_bytes, summed, a.out + (brow * a.N + col0) * 2, sm,
                        lane, col0, a.N);
      }
    }
    // The release waits for the slabs' stores to land: a tile late when the warp's next tile is
    // foreign (an MMA runs meanwhile), at once when the next is own (it waits for its peers
    // anyway) or there is none. Ping-pong: decided at the tile's end (end_tile).
    if (!kPingpong && !a.legacy_publish && next_is_own_or_none(k + 1)) flush();
  }

  // The ping-pong kernel's end of each tile (its store_tail, before the epilogue order
  // barrier's arrive): publish now and drain the bulk stores' reads of the warp's buffers (the
  // CTA may exit), unless the warpgroup's next tile (claimed at this epilogue's start,
  // Sched::claim_next) is foreign: its MMA then hides the stores' landing, and its epilogue
  // publishes and reuses the buffers after its waits. (legacy_publish adds only its full fence
  // here.)
  CUTLASS_DEVICE void end_tile() {
    if (kTStoreProbe == 6 && p_->mode == 2) return;  // tools: mode 2 without the tile end's drain
    if constexpr (kPingpong) {
      const uint32_t k = last_k_ + 2;
      if (p_->claims ? Sched::next_tile(k) >= p_->own_first : !next_is_foreign(k)) {
        flush();
        drain_reads();
      }
    }
  }

  // The cooperative kernel's end: the last flags, and no bulk store reading shared memory.
  CUTLASS_DEVICE void end_kernel() {
    flush();
    drain_reads();
  }

  // Publishes the flags of the warp's last foreign slabs: every lane waits for its bulk stores
  // to be performed (wait_group 0, not the .read form), orders them before generic accesses
  // (fence.proxy.async), and __syncwarp orders all lanes' stores before lane 0's release, which
  // is cumulative: one fence.acq_rel.sys for all the warp's flags of the flush, each then a
  // strong relaxed store (kFlagRelease; two-gpu-risks R4: no fence per flag).
  CUTLASS_DEVICE void flush() {
    if (!pending_[0] && !pending_[kSlabsPerWarp - 1]) return;
    if (bulk()) {
      tma_wait_all();
      if constexpr (kFlagRelease != 3) fence_proxy_async();
    }
    __syncwarp();
    if (kPublisher && !p_->legacy_publish) {
      if (threadIdx.x % 32 == 0) post_flags();
      for (int h = 0; h < kSlabsPerWarp; ++h) pending_[h] = nullptr;
      return;
    }
    if (threadIdx.x % 32 == 0) release_flags(p_->legacy_publish);
    for (int h = 0; h < kSlabsPerWarp; ++h) pending_[h] = nullptr;
  }

 private:
  // The CTA's tile k as far as the claim ring knows it: -1 unknown yet (the claimer has not
  // taken it), 1 an own tile or none, 0 foreign.
  CUTLASS_DEVICE int own_or_none(uint32_t k) const {
    uint64_t v;
    asm volatile("ld.volatile.shared.b64 %0, [%1];"
                 : "=l"(v)
                 : "r"((uint32_t)__cvta_generic_to_shared(claim_ring() + k % kRing))
                 : "memory");
    if ((uint32_t)(v >> 32) != k + 1) return -1;
    return (int32_t)(uint32_t)v >= p_->own_first ? 1 : 0;
  }
  CUTLASS_DEVICE bool next_is_own_or_none(uint32_t k) const { return own_or_none(k) == 1; }

  // Whether this lane's flag of an own slab (first row brow of the block, columns col0..) is
  // this call's: lane l < (n - 1) nflags checks source r + 1 + l / nflags's flag l % nflags, with
  // an acquire (lanes past those: true).
  CUTLASS_DEVICE bool own_flags_set(int64_t brow, int64_t col0, int nflags, int lane) const {
    const EpilogueArgs& a = *p_;
    const int n = a.peers.n, r = a.peers.rank;
    if (lane >= (n - 1) * nflags) return true;
    const int src = (r + 1 + lane / nflags) % n;
    char* src_slot = a.peers.stage[r] + stage_slot(src, r, n) * a.slot_bytes;
    const int64_t flag0 = (brow / 16) * a.flag_cols + col0 / kFlagCols;
    return ld_acquire_sys(tile_slab_flags(src_slot, a.m, a.N) + flag0 + lane % nflags) == e_;
  }
  CUTLASS_DEVICE bool next_is_foreign(uint32_t k) const { return own_or_none(k) == 0; }

  // Lane 0 waits (bounded, wait_flag_inline); the warp learns the outcome and is ordered after
  // it. The common case -- the flag was set long ago -- is one acquire load: no fence, which
  // would also wait for this warp's stores still in flight. `exact`: a value beyond the target
  // is not this call's (wait_flag then checks whether the call was given up); else any value
  // at or beyond it will do (a slot released by a later call than needed).
  CUTLASS_DEVICE bool warp_wait(const uint32_t* flag, uint32_t target, WaitSite site, int lane,
                                bool exact) {
    int ok = 1;
    if (lane == 0) {
      const uint32_t v = ld_acquire_sys(flag);
      if (exact ? v != target : (int32_t)(v - target) < 0)
        ok = wait_flag_inline(flag, target, true, p_->timeout_ns, p_->err, p_->peers, site) ? 1
                                                                                             : 0;
    }
    ok = __shfl_sync(0xffffffffu, ok, 0);
    __syncwarp();
    return ok != 0;
  }

  // dst: the slab's first element; map, mrow: its tensor map (EpilogueArgs::maps) and row there.
  template <class Acc>
  CUTLASS_DEVICE void store_slab(Acc& acc, char* dst, float* smf, int lane, int64_t col0, int map,
                                 int64_t mrow) {
    if (tensor())
      Slab::store_tensor(acc, &p_->maps[map], (int32_t)col0, (int32_t)mrow, smf, lane, p_->N,
                         chunk_);
    else if (bulk())
      Slab::store_bulk(acc, dst, smf, lane, col0, p_->N, chunk_);
    else
      Slab::store_lanes(acc, dst, smf, lane, col0, p_->N);
  }

  // Lane 0: the warp's pending flags released (kFlagRelease), after the __syncwarp that orders
  // every lane's stores before it (flush(); post_flags' fallback, never legacy). `legacy`: tools'
  // legacy_publish, a full fence first.
  CUTLASS_DEVICE void release_flags(bool legacy) const {
    if (legacy) __threadfence_system();
    if constexpr (kFlagRelease == 1) fence_acq_rel(/*sys=*/true);
    for (int h = 0; h < kSlabsPerWarp; ++h)
      for (int f = 0; pending_[h] && f < pending_n_; ++f) {
        if constexpr (kFlagRelease == 0)
          st_release_sys(pending_[h] + f, e_);
        else if constexpr (kFlagRelease == 2)
          st_release_gpu(pending_[h] + f, e_);
        else
          st_relaxed_sys(pending_[h] + f, e_);
      }
  }

  // kPublisher: lane 0 hands the warp's pending flags to the publisher warp (flag_mailbox_run):
  // once the previous mail is taken (the publisher always runs, so this ends), the mail's fields,
  // then its sequence number by a CTA-scope release -- after the __syncwarp that orders every
  // lane's stores (and bulk stores' completion) before it. (That link is bar.warp.sync's stated
  // memory ordering among the warp's threads, as main's flush() relies on too; the next one, to
  // another warp's system fence, is what the two-GPU run must test, with a negative control.)
  // The wait for the previous mail is bounded: past kPublisherWaitNs (the publisher lags by a
  // flush at most, a few microseconds) this warp publishes its flags itself, as main's flush()
  // does, and leaves the mailbox to the publisher's pace; no warp of the CTA hangs on another.
  static constexpr uint64_t kPublisherWaitNs = 200 * 1000;
  CUTLASS_DEVICE void post_flags() {
    FlagMail& m = flag_mailbox()->mail[threadIdx.x / 32 - 4];
    const uint64_t t0 = global_ns();
    while (ld_acquire_cta_shared(&m.taken) != posted_) {
      if (global_ns() - t0 > kPublisherWaitNs) {
        release_flags(/*legacy=*/false);
        return;
      }
      __nanosleep(32);
    }
    m.flags[0] = pending_[0];
    m.flags[1] = kSlabsPerWarp > 1 ? pending_[kSlabsPerWarp - 1] : nullptr;
    m.n = pending_n_;
    m.value = e_;
    st_release_cta_shared(&m.seq, ++posted_);
  }

  // Every lane's bulk stores have read their shared buffers (before the warp writes them with
  // generic stores, and before the CTA exits).
  CUTLASS_DEVICE void drain_reads() const {
    if (bulk()) Slab::drain_bulk_reads();
  }

  // The kernel's parameters (grid constants, alive for the whole kernel): read in place, not
  // copied per thread (an array indexed by the peer would go to local memory).
  const EpilogueArgs* p_;
  uint32_t e_ = 0;             // this call's epoch target
  uint32_t k_ = 0;             // tiles of this thread so far
  uint32_t last_k_ = 0;        // the CTA's index of this thread's last tile
  uint32_t* pending_[kSlabsPerWarp] = {};  // flags of the last foreign slabs, published later
  int pending_n_ = 0;
  uint32_t freed_ = 0;         // peers whose staging slot this warp found released
  uint32_t chunk_ = 0;         // chunks this warp has bulk-stored (its next buffer: % kChunkBufs)
  uint32_t mphase_ = 0;        // TMA loads: bit b = the next parity of unit buffer b's mbarrier
  bool mbar_ready_ = false;    // TMA loads: the warp's mbarriers are initialised
  bool failed_ = false;        // a wait of this warp gave up: no more waits this call
  uint32_t posted_ = 0;        // kPublisher: mails this warp posted
};

// CUTLASS's adapter of operator()-style epilogues, plus the last flag at the end of the loop.
template <class Op>
class TileCollective : public cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Op> {
  using Base = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Op>;

 public:
  using Base::Base;
  CUTLASS_HOST_DEVICE TileCollective(typename Op::Params const& p,
                                     typename Base::TensorStorage& s)
      : Base(p, s) {}
  // Cooperative kernel: once, after the last tile. Ping-pong: after every tile.
  CUTLASS_DEVICE auto store_tail(typename Base::LoadPipeline, typename Base::LoadPipelineState ls,
                                 typename Base::StorePipeline, typename Base::StorePipelineState ss) {
    if constexpr (Op::kPerWarpgroupTiles)
      this->end_tile();
    else
      this->end_kernel();
    return cute::make_tuple(ls, ss);
  }
};

}  // namespace jaxoverlap::tile
