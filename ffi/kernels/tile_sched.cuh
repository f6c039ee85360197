// The tile-fused GEMM + reduce-scatter's tile scheduler (tile_rs.cuh has the kernel): CUTLASS's
// persistent SM90 scheduler with the tiles handed out from a counter, in the order the protocol
// needs (foreign blocks first, own block last), to whichever cluster asks next. The leader CTA's
// mainloop producer claims and broadcasts each tile to both CTAs' shared-memory rings. A CTA
// that never starts (its SMs busy with other kernels) holds no tile, so every own tile's wait is
// for a foreign tile that a running CTA computes without waiting: no deadlock whatever the
// residency. The cooperative kernel's two consumer warpgroups share each tile; the ping-pong
// kernel's take turns (warpgroup w runs the CTA's tiles w, w + 2, ...). Device code only.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include "kernels/tile_rs.h"

namespace jaxoverlap::tile {

constexpr int kRing = 16;  // claimed tiles in flight per CTA (> mainloop stages)
#ifndef JAXOVERLAP_TILE_RING_SLEEP_NS
#define JAXOVERLAP_TILE_RING_SLEEP_NS 512
#endif
// A consumer's sleeps while its tile is not in the claim ring yet: 64 ns, doubling up to this
// (0: poll without sleeping).
constexpr unsigned kRingSleepNs = JAXOVERLAP_TILE_RING_SLEEP_NS;

// What the scheduler needs to order and hand out tiles.
struct Geometry {
  Flags* local;          // this rank's flags: epoch, claim counters
  const char* stage;     // this rank's staging (the peers' partials of its own tiles)
  int64_t m, N, slot_bytes;
  int32_t n, rank;
  int32_t cluster_rows;  // cluster rows (kTileM * kClusterM rows) per rank block
  int32_t cluster_cols;  // cluster columns (kTileN * kClusterN columns, the last partial)
  int32_t swizzle;
  int32_t total;         // cluster tiles of the whole problem
  int32_t plain;         // mode 2: natural block order
  int32_t prefetch;      // own tiles' peer partials pulled into L2 ahead (tools modes 7, 8)
  // decode's divisors, their multipliers computed on the host (set_divisors): a runtime `/` is a
  // software division sequence on the GPU (I2F.RP, MUFU.RCP, F2I), ~25 instructions each, where
  // CUTLASS's own scheduler multiplies (issue 23, session 11: the one systematic SASS difference
  // between our static order and CUTLASS's scheduler outside the identical k-loops).
  cutlass::FastDivmod per_block{1};  // cluster_rows * cluster_cols: cluster tiles per rank block
  cutlass::FastDivmod band{1};       // swizzle * cluster_cols: cluster tiles per full band
  cutlass::FastDivmod rows{1};       // swizzle: cluster rows of a full band
  cutlass::FastDivmod last_rows{1};  // cluster_rows % swizzle (the last band's rows), or 1
  int32_t full_bands;                // cluster_rows / swizzle

  void set_divisors() {
    per_block = cutlass::FastDivmod(cluster_rows * cluster_cols);
    band = cutlass::FastDivmod(swizzle * cluster_cols);
    rows = cutlass::FastDivmod(swizzle);
    full_bands = cluster_rows / swizzle;
    last_rows = cutlass::FastDivmod(cluster_rows % swizzle ? cluster_rows % swizzle : 1);
  }
};

// One ring per CTA: entry k % kRing holds ((k + 1) << 32) | tile of the CTA's k-th tile.
__device__ __forceinline__ uint64_t* claim_ring() {
  __shared__ uint64_t ring[kRing];
  return ring;
}

// The scheduler tags (TileSchedulerSelector below): the cooperative and the ping-pong kernel.
struct ClaimedTiles {};
struct ClaimedTilesPingpong {};
// Experiment variants of the scheduler (tools/probes/stock/, never in the menu): kVariant 1 =
// a static order (cluster c takes the claim-order tiles c, c + clusters, ..., decoded as
// production decodes a claimed one: no counter, no ring; not safe against clusters that never
// start, so a plain GEMM only); kVariant 2 = that static order handed out through the ring as
// the cooperative kernel's claims are (the leader's producer publishes every tile of the CTA,
// everyone else reads the ring; no counter): variant 1 -> 2 is the ring's cost; kVariant 3
// (ping-pong only) = production's claims and their timing (tiles 0 and 1 by the producer, tile
// k >= 2 by the consumer warpgroup at the start of its epilogue of tile k - 2, the epilogue's
// `claims` = 2) but each claim takes the static order's tile instead of the counter's: 3 -> 0 is
// the counter's atomic, 2 -> 3 the claims' timing.
template <int kVariant, bool kPingpong>
struct ClaimedTilesVariant {};
// Other claim paths of the ping-pong kernel (issue 23, session 8), selected by TileKernel's kSched
// and the epilogue's `claims`; kClaimLate is menu entry 4's since session 9 (2.2 % faster in prod
// on 36 of 36 judged shapes), the others are tools entries (tile_rs.cu):
//   kClaimPairs: the leader's warpgroup 0 claims two tiles per atomic (tiles k + 2, k + 3, at
//     the start of its epilogue of tile k); warpgroup 1 never claims: half the atomics, and
//     warpgroup 1's epilogue never waits for one.
//   kClaimLate: each warpgroup claims after its epilogue (get_current_work, after the order
//     barrier's arrive, where it would wait for the other warpgroup's MMA anyway), kClaimAhead
//     tiles ahead (4: tile k + 4 after its epilogue of tile k; the producer claims tiles 0-3): the
//     atomic's round trip leaves the epilogue, and tile k + 2 is in the ring at its end_tile.
//   kClaimLatePairs: kClaimLate by warpgroup 0 only, two tiles per atomic (k + 4, k + 5).
//   kClaimLateSpread: kClaimLate with the own block's tiles spread through the claim order
//     (issue 24): kSpreadSegments segments per block, segment s of every foreign block in the
//     usual order, then segment s of the own block (spread_tile). An own segment's peer data
//     is the peers' same segment, which each peer claims before its own segment s, so every
//     own tile waits only for tiles claimed earlier (by induction over the segments, no wait
//     cycle; a CTA that never starts still holds nothing).
constexpr int kClaimPairs = 4, kClaimLate = 5, kClaimLatePairs = 6, kClaimLateSpread = 7;
// kClaimLate*'s look-ahead: after its epilogue of tile k a consumer warpgroup claims tile
// k + kClaimAhead (the producer claims tiles 0 .. kClaimAhead - 1). Even (a warpgroup claims its
// own tiles) and well inside the ring: the claimer writes entry k + kClaimAhead while the
// slowest reader of the cluster may still be a tile behind k. (JAXOVERLAP_TILE_CLAIM_AHEAD: a
// probe build option, issue 23 session 12: the claims' cost is the ring handoff, call 7.)
#ifndef JAXOVERLAP_TILE_CLAIM_AHEAD
#define JAXOVERLAP_TILE_CLAIM_AHEAD 4
#endif
constexpr uint32_t kClaimAhead = JAXOVERLAP_TILE_CLAIM_AHEAD;
static_assert(kClaimAhead >= 4 && kClaimAhead % 2 == 0 && (int)kClaimAhead + 4 <= kRing,
              "an even claim look-ahead of 4 to kRing - 4 tiles");
constexpr int kSpreadSegments = 4;

// The ping-pong kernel asks for its first tile before it waits at the cluster barrier, and it
// constructs the epilogue after arriving there: the ring is cleared here instead, by the
// scheduler pipeline's constructor (an empty pipeline otherwise), which every thread runs before
// the arrival (a __syncthreads for clusters of one CTA), fenced like the epilogue's clearing.
class RingClearPipeline : public cutlass::PipelineEmpty {
 public:
  CUTLASS_DEVICE RingClearPipeline(SharedStorage&& s, Params const& p)
      : cutlass::PipelineEmpty(static_cast<SharedStorage&&>(s), p) {
    if (threadIdx.x < kRing) {
      claim_ring()[threadIdx.x] = 0;
      asm volatile("fence.acq_rel.cluster;" ::: "memory");
    }
  }
};

template <int kTileN, int kClusterM, int kClusterN, bool kPingpong, int kVariant = 0>
class ClaimScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  using Tile = typename Base::WorkTileInfo;
  // The ping-pong kernel asks for its first tile before the cluster barrier, when a cluster
  // peer's ring may not be cleared yet (the claimer writes into it): with clusters of more than
  // one CTA its first tile is claimed lazily, at its first is_valid(), which every role asks
  // after the barrier before it uses the tile. (It holds the geometry's address in the
  // kernel's parameters, not the scheduler's: a pointer to the scheduler put the whole object in
  // local memory, 248 bytes of stack, loaded and stored around every tile.)
  static constexpr bool kLazyFirst = kPingpong && kClusterM * kClusterN > 1 && kVariant != 1;
  struct LazyTile : Tile {
    const Geometry* g = nullptr;  // set: tile k not claimed yet
    uint32_t k = 0;
    CUTLASS_DEVICE bool is_valid() {
      if (g) {
        const Geometry* gg = g;
        g = nullptr;
        uint32_t e = 0;
        int32_t next = 0;
        static_cast<Tile&>(*this) = claim(*gg, k, e, next);
      }
      return this->is_valid_tile;
    }
  };

 public:
  using WorkTileInfo = std::conditional_t<kLazyFirst, LazyTile, Tile>;
  using Pipeline = std::conditional_t<kPingpong, RingClearPipeline, cutlass::PipelineEmpty>;
  struct Arguments : Base::Arguments {
    Geometry g{};
  };
  struct Params : Base::Params {
    Geometry g{};
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem, TileShape tile,
                                        ClusterShape cluster, cutlass::KernelHardwareInfo const& hw,
                                        Arguments const& args, void* workspace = nullptr,
                                        uint32_t subtiles = 1, uint32_t k_align = 1) {
    Params p;
    static_cast<Base::Params&>(p) =
        Base::to_underlying_arguments(problem, tile, cluster, hw, args, workspace, subtiles, k_align);
    p.g = args.g;
    return p;
  }
  static bool can_implement(Arguments const& args) { return Base::can_implement(args); }

  // p: the kernel's parameters (a __grid_constant__): the geometry is read there, not copied
  // into every thread's registers.
  CUTLASS_DEVICE explicit ClaimScheduler(Params const& p) : Base(p), g_(p.g) {}

  // Tile k_ of the CTA: 0 at first, 1 for the ping-pong kernel's second warpgroup, which advances
  // once before asking.
  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    WorkTileInfo w{};
    if constexpr (kLazyFirst) {
      w.g = &g_;
      w.k = k_;
    } else {
      w = take(k_);
    }
    return w;
  }
  // The cooperative kernel's interface: every role takes every tile.
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) { return cute::make_tuple(take(++k_), true); }
  // The ping-pong kernel's: the producer advances by one, each consumer warpgroup by two.
  CUTLASS_DEVICE void advance_to_next_work(uint32_t count = 1) { k_ += count; }
  CUTLASS_DEVICE WorkTileInfo get_current_work() {
    WorkTileInfo w{};
    static_cast<Tile&>(w) = take(k_);
    if constexpr (kVariant == kClaimLate || kVariant == kClaimLatePairs ||
                  kVariant == kClaimLateSpread) {
      // A consumer warpgroup after its epilogue (at k_ - 2): it claims tile k_ - 2 + kClaimAhead
      // (k_ + 2 by default; with kClaimLatePairs warpgroup 0 only, that tile and the next) once
      // the tile before it is in the ring (claims in counter order). Tile k_ was claimed
      // kClaimAhead tiles back (the producer: tiles 0 .. kClaimAhead - 1).
      if (threadIdx.x >= 128 && threadIdx.x % 128 == 0 && cute::block_rank_in_cluster() == 0 &&
          w.is_valid() && (kVariant != kClaimLatePairs || !(k_ & 1u))) {
        const uint32_t k = k_ - 2 + kClaimAhead;
        wait_ring(k - 1, true);
        uint32_t* counter = &g_.local->claim[e_ & 1u];
        if constexpr (kVariant != kClaimLatePairs) {
          publish(k, order_tile(g_, (int32_t)atom_add(counter, 1u)));
        } else {
          const int32_t t = (int32_t)atom_add(counter, 2u);
          publish(k, t), publish(k + 1, t + 1);
        }
      }
    }
    return w;
  }
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo w, Pipeline&, PipelineState) {
    return fetch_next_work(w);
  }

  // The ping-pong kernel's claim of the CTA's tile k >= 2, by the warpgroup that will run it:
  // the leader CTA's first thread of the warpgroup claims it at the start of its epilogue of
  // tile k - 2 (TileEpilogue::operator()), and every thread of the warpgroup reads it at that
  // epilogue's end (end_tile, before the order barrier's arrive), where it decides whether to
  // publish its flags now (a foreign next tile defers them; until 2026-12-02 the claim came
  // after the arrive, so the entry was never there and every tile flushed). Tile k - 1 is in
  // the ring at the claim: the other warpgroup claimed it at the start of its epilogue of tile
  // k - 3, which ran before this one (tile 1: the producer), so claims stay in counter order.
  // (claims = 2: tools variant 3, the static order's tile instead of the counter's.)
  static CUTLASS_DEVICE void claim_next(Flags* local, uint32_t e, uint32_t k, int claims = 1) {
    if (claims >= kClaimLate) return;  // claimed in get_current_work
    if (claims == kClaimPairs && (k & 1u)) return;  // warpgroup 0 claimed it with tile k - 1
    if (cute::block_rank_in_cluster() == 0 && threadIdx.x % 128 == 0) {
      wait_ring(k - 1, true);
      if (claims == kClaimPairs) {
        const int32_t t = (int32_t)atom_add(&local->claim[e & 1u], 2u);
        publish(k, t), publish(k + 1, t + 1);
        return;
      }
      publish(k, claims == 2 ? static_tile(k) : (int32_t)atomicAdd(&local->claim[e & 1u], 1u));
    }
  }
  // One thread's atomic add (no warp aggregation: the compiler's atomicAdd adds a vote, a
  // leader election and a shuffle).
  static CUTLASS_DEVICE uint32_t atom_add(uint32_t* p, uint32_t v) {
    uint32_t old;
    asm volatile("atom.add.relaxed.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
  }
  // The CTA's tile k once it is in the ring (a cluster peer's leader is at the same tile).
  // (Its tile k - 1 too, the later of the two: with the own tiles spread through the order
  // (kClaimLateSpread) the other warpgroup's next tile may be own while this one's is foreign,
  // and its wait must not hold back this warpgroup's flags; in counter order tile k is the later.)
  // Only in builds with tools entry 9 (the default build: tile k alone, unchanged).
  static CUTLASS_DEVICE int32_t next_tile(uint32_t k) {
#if defined(JAXOVERLAP_TILE_MENU_MASK) && ((JAXOVERLAP_TILE_MENU_MASK >> 9) & 1)
    return max(wait_ring(k - 1, true), wait_ring(k, true));
#else
    return wait_ring(k, true);
#endif
  }

  // The cluster tile (decode's numbering: block-major, the own block last) of the claim
  // counter's value i: i itself, or with kClaimLateSpread the spread order.
  static CUTLASS_DEVICE int32_t order_tile(const Geometry& g, int32_t i) {
    if constexpr (kVariant != kClaimLateSpread) {
      return i;
    } else {
      if (i >= g.total) return i;
      const int32_t per_block = g.cluster_rows * g.cluster_cols;
      const int32_t seg = (per_block + kSpreadSegments - 1) / kSpreadSegments;
      const int32_t head = (kSpreadSegments - 1) * g.n * seg;  // all but the last segments
      if (seg * (kSpreadSegments - 1) >= per_block) return i;  // too few tiles to spread
      if (i < head) {
        const int32_t s = i / (g.n * seg), r = i - s * g.n * seg;
        return (r / seg) * per_block + s * seg + r % seg;
      }
      const int32_t last = per_block - (kSpreadSegments - 1) * seg, j = i - head;
      return (j / last) * per_block + (kSpreadSegments - 1) * seg + j % last;
    }
  }

  // Tools variants 1-3: the static order's k-th tile of this CTA's cluster (c + k clusters).
  static CUTLASS_DEVICE int32_t static_tile(uint32_t k) {
    const uint32_t clusters = gridDim.x * gridDim.y / (kClusterM * kClusterN);
    const dim3 cid = cute::cluster_id_in_grid();
    const uint32_t c = cid.x + cid.y * (gridDim.x / kClusterM);
    return (int32_t)(c + k * clusters);
  }

 private:
  // The k-th tile of this CTA. Tiles are claimed from the counter by the leader CTA and written
  // into every CTA's ring of the cluster; everyone else waits for the ring entry.
  //   Cooperative: the mainloop producer warp (warp 0; it runs ahead of every other role: the
  //   others fetch tile k only after consuming tile k - 1, which that warp loaded) claims one
  //   ahead -- the atomic for tile k + 1 is issued as tile k is published.
  //   Ping-pong: the producer claims tiles 0 and 1; tile k >= 2 is claimed by the consumer
  //   warpgroup that will run it (claim_next), at the start of its epilogue of tile k - 2 --
  //   while the other warpgroup's MMA runs, a mainloop before the producer needs it -- and only
  //   once tile k - 1 is in the ring (claims stay in counter order). The producer
  //   then never waits for an atomic: its 40 registers spill the claimer's state, and the
  //   compiler's warp-aggregated atomicAdd consumes the result at once, so its claims stalled the
  //   loads for an atomic's round trip per tile (issue 23: 1.16-1.18x cuBLASLt as a plain GEMM,
  //   CUTLASS's own scheduler with our mainloop and epilogue 1.02x).
  // Entry k is overwritten by tile k + kRing only when every reader is past tile k: the producer
  // is at most one mainloop pipeline (< kRing - 1 tiles) ahead of them (ping-pong: a warpgroup
  // reads entry k before its MMA of tile k, which the producer's loads of later tiles wait for
  // once the pipeline is full). A CTA holds at most its current tile and the next (ping-pong:
  // the next two); a later tile of a foreign tile may be an own tile, never the other way round,
  // so no claimed foreign tile waits behind an own tile's wait (the ping-pong kernel runs its
  // warpgroups' epilogues in tile order).
  // Writes tile t as the CTA's k-th into every CTA's ring of the cluster.
  static CUTLASS_DEVICE void publish(uint32_t k, int32_t t) {
    const uint64_t v = ((uint64_t)(k + 1) << 32) | (uint32_t)t;
    const uint32_t local = (uint32_t)__cvta_generic_to_shared(claim_ring() + k % kRing);
    for (uint32_t c = 0; c < (uint32_t)(kClusterM * kClusterN); ++c) {
      uint32_t remote;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(c));
      asm volatile("st.relaxed.cluster.shared::cluster.b64 [%0], %1;" ::"r"(remote), "l"(v)
                   : "memory");
    }
  }

  // Waits for the CTA's tile k in the ring and returns it; `sleep`: back off between looks.
  static CUTLASS_DEVICE int32_t wait_ring(uint32_t k, bool sleep) {
    const uint32_t slot = (uint32_t)__cvta_generic_to_shared(claim_ring() + k % kRing);
    uint64_t v;
    for (unsigned ns = 64;; ns = min(2 * ns, kRingSleepNs)) {
      asm volatile("ld.volatile.shared.b64 %0, [%1];" : "=l"(v) : "r"(slot) : "memory");
      if ((uint32_t)(v >> 32) == k + 1) return (int32_t)(uint32_t)v;
      if (kRingSleepNs > 0 && sleep) __nanosleep(ns);
    }
  }

  // The CTA's tile k.
  CUTLASS_DEVICE Tile take(uint32_t k) { return claim(g_, k, e_, next_); }

  // e: this call's epoch target (0: not read yet); next: the cooperative claimer's next tile.
  static CUTLASS_DEVICE Tile claim(const Geometry& g, uint32_t k, uint32_t& e, int32_t& next) {
    const int lane = threadIdx.x % 32;
    const bool producer = threadIdx.x / 32 == 0;
    const bool leader = cute::block_rank_in_cluster() == 0;
    if constexpr (kVariant == 1 || kVariant == 2) {  // static: cluster c's k-th tile, c + k clusters
      int32_t t = static_tile(k);
      if constexpr (kVariant == 2) {
        if (producer && leader) {
          if (lane == 0) publish(k, t);
        } else {
          t = wait_ring(k, !producer);
        }
      }
      return decode(g, t);
    }
    if (e == 0) e = *(volatile uint32_t*)&g.local->epoch + 1u;
    uint32_t* counter = &g.local->claim[e & 1u];
    int32_t t = 0;
    if constexpr (kVariant == 3) {  // production's claims, the static order's tiles (no counter)
      if (producer && leader && k == 0) {
        if (lane == 0) publish(0, static_tile(0)), publish(1, static_tile(1));
        t = static_tile(0);
      } else {
        t = wait_ring(k, !producer);
      }
      return decode(g, t);
    }
    if constexpr (kPingpong && kVariant >= kClaimPairs) {
      // kClaimPairs / kClaimLate*: the producer claims the first two (kClaimPairs) or
      // kClaimAhead tiles with one atomic; the consumers claim the rest (claim_next,
      // get_current_work).
      if (producer && leader && k == 0) {
        if (lane == 0) {
          *(volatile uint32_t*)&g.local->claim[(e + 1u) & 1u] = 0;  // for the next call
          constexpr uint32_t first = kVariant == kClaimPairs ? 2u : kClaimAhead;
          const int32_t i0 = (int32_t)atom_add(counter, first);
          for (uint32_t i = 0; i < first; ++i) publish(i, order_tile(g, i0 + (int32_t)i));
          t = order_tile(g, i0);
        }
        t = __shfl_sync(0xffffffffu, t, 0);
      } else {
        t = wait_ring(k, !producer);
      }
      return decode(g, t);
    }
    if (producer && leader && (!kPingpong || k == 0)) {
      if (lane == 0) {
        if (k == 0) {
          *(volatile uint32_t*)&g.local->claim[(e + 1u) & 1u] = 0;  // for the next call
          next = (int32_t)atomicAdd(counter, 1u);
        }
        t = next;
        next = (int32_t)atomicAdd(counter, 1u);  // ping-pong: tile 1
        publish(k, t);
        if (kPingpong) publish(1, next);
      }
      t = __shfl_sync(0xffffffffu, t, 0);
    } else {
      // A consumer's miss sleeps before the next look (64 ns, doubling up to kRingSleepNs): a
      // ping-pong warpgroup asks for its next tile while the other warpgroup's mainloop runs,
      // and polling all along would take shared-memory cycles from that MMA (wgmma reads its
      // operands there); the tile is in the ring a few k-blocks before that mainloop ends. (A
      // producer warp polls: it needs the tile at once to issue its loads.)
      t = wait_ring(k, !producer);
    }
    const Tile w = decode(g, t);
    if (threadIdx.x >= 128 && w.is_valid()) prefetch_peer_slabs(g, e, w, lane);  // consumer warps
    return w;
  }

  // An own tile's epilogue reads every peer's partial of it from this rank's staging. Each
  // consumer warp pulls its slabs' lines (cooperative: one slab; ping-pong: its warpgroup's tile,
  // slabs w and w + 4) into L2 when it learns the tile, a mainloop before its epilogue needs them (L2 is coherent with the peers' NVLink writes: data that lands later
  // updates the lines). Line prefetches, not bulk ones: those queue in the TMA unit ahead of the
  // mainloop's loads (measured: 11-18 % slower GEMMs). Tools modes 7 and 8 only since
  // 2026-12-02's last call: the fused op was 3.4 % faster without it, on 19 of 19 shapes.
  static CUTLASS_DEVICE void prefetch_peer_slabs(const Geometry& g, uint32_t e, Tile w,
                                                 int lane) {
    if (!g.prefetch) return;
    const int64_t row = (int64_t)w.M_idx * kTileM, col0 = (int64_t)w.N_idx * kTileN;
    const int32_t j = (int32_t)(row / g.m);
    if (j != g.rank || col0 >= g.N) return;
    const int64_t bytes = min((int64_t)kTileN, g.N - col0) * 2;
    const int64_t parity = (e & 1u) * g.m * g.N * 2;
    constexpr int kSlabs = kPingpong ? 2 : 1;
    for (int q = 0; q < kSlabs; ++q) {
      // The warp's slab (each consumer warp prefetches one slab's worth per tile it learns).
      const int s = kPingpong ? (threadIdx.x % 128) / 32 + 4 * q : (threadIdx.x % 256) / 32;
      for (int t = 1; t < g.n; ++t) {
        const char* base = g.stage +
                           stage_slot((g.rank + t) % g.n, g.rank, g.n) * g.slot_bytes +
                           parity + ((row - j * g.m + 16 * s) * g.N + col0) * 2;
        for (int line = lane; line < 16 * 4; line += 32) {  // 16 rows x 4 lines of 128 bytes
          const int64_t off = (int64_t)(line % 4) * 128;
          if (off < bytes)
            asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(base + (line / 4) * g.N * 2 + off));
        }
      }
    }
  }

  // Cluster tile t -> this CTA's tile. Block-major in the order r+1, r+2, ..., r; within a
  // block, bands of `swizzle` cluster rows, column-major inside a band.
  static CUTLASS_DEVICE Tile decode(const Geometry& g, int32_t t) {
    if (t >= g.total) return Tile::invalid_work_tile();
    int vb, i, band, ii, cn, cmb;
    g.per_block(vb, i, t);
    g.band(band, ii, i);
    // a full band of g.swizzle cluster rows, or the block's last, shorter one
    (band < g.full_bands ? g.rows : g.last_rows)(cn, cmb, ii);
    const int32_t cm = band * g.swizzle + cmb;
    const int32_t vr = vb + g.rank + 1;  // < 2 n
    const int32_t block = g.plain ? vb : (vr >= g.n ? vr - g.n : vr);
    const dim3 c = cute::block_id_in_cluster();
    const int32_t m_idx = (block * g.cluster_rows + cm) * kClusterM + (int32_t)c.x;
    return {m_idx, cn * kClusterN + (int32_t)c.y, 0, true};
  }

  const Geometry& g_;  // in the kernel's parameters
  uint32_t k_ = 0;
  uint32_t e_ = 0;     // this call's epoch target (read at the first tile)
  int32_t next_ = 0;   // the claimer's next tile (its atomic may still be in flight)
};

}  // namespace jaxoverlap::tile

// GemmUniversal<..., ClaimedTiles[Pingpong]> runs ClaimScheduler.
namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t Stages, class ProblemShapeType>
struct TileSchedulerSelector<jaxoverlap::tile::ClaimedTiles, arch::Sm90, TileShape, ClusterShape,
                             Stages, ProblemShapeType> {
  using Scheduler = jaxoverlap::tile::ClaimScheduler<cute::size<1>(TileShape{}),
                                                     cute::size<0>(ClusterShape{}),
                                                     cute::size<1>(ClusterShape{}), false>;
};
template <class TileShape, class ClusterShape, uint32_t Stages, class ProblemShapeType>
struct TileSchedulerSelector<jaxoverlap::tile::ClaimedTilesPingpong, arch::Sm90, TileShape,
                             ClusterShape, Stages, ProblemShapeType> {
  using Scheduler = jaxoverlap::tile::ClaimScheduler<cute::size<1>(TileShape{}),
                                                     cute::size<0>(ClusterShape{}),
                                                     cute::size<1>(ClusterShape{}), true>;
};
template <int kVariant, bool kPingpong, class TileShape, class ClusterShape, uint32_t Stages,
          class ProblemShapeType>
struct TileSchedulerSelector<jaxoverlap::tile::ClaimedTilesVariant<kVariant, kPingpong>, arch::Sm90,
                             TileShape, ClusterShape, Stages, ProblemShapeType> {
  using Scheduler = jaxoverlap::tile::ClaimScheduler<cute::size<1>(TileShape{}),
                                                     cute::size<0>(ClusterShape{}),
                                                     cute::size<1>(ClusterShape{}), kPingpong,
                                                     kVariant>;
};
}  // namespace cutlass::gemm::kernel::detail

