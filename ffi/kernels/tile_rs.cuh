// The tile-fused GEMM + reduce-scatter (protocol in tile_rs.h): CUTLASS 3.x's Hopper
// warp-specialised persistent kernel, cooperative or ping-pong (TMA mainloop, 128 x kTileN x 64
// tiles, clusters of kClusterM x kClusterN CTAs: one menu entry per choice, tile_rs.cu) with two
// parts of our own plugged into its interfaces:
//   ClaimScheduler  (tile_sched.cuh) hands out tiles from a counter in the order the protocol
//                   needs (foreign blocks first), to whichever cluster asks next.
//   TileEpilogue    (tile_epilogue.cuh) per 16-row slab (one consumer warp): foreign tiles -> the owner's staging
//                   (peer memory) through shared memory, by TMA tensor stores (ping-pong) or
//                   the lanes' coalesced stores (cooperative), neither waited for; the slab's
//                   flags (one per 128 columns: the same layout for every entry) published at
//                   the warp's next tile after the stores have landed (at once if that tile is
//                   own or none); own tiles check each peer's flags of the slab, load the peers'
//                   slabs asynchronously into shared memory (tile_slab.cuh: cp.async, a few
//                   units ahead), add them in rank order to the f32 accumulators, round once,
//                   store.
// Epochs, abort words, timeouts and the error record are those of every jaxoverlap kernel
// (common.cuh). Device code only; included by the instantiation files tile_rs_*.cu.
#pragma once

#include <cudaTypedefs.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/device_kernel.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "kernels/tile_epilogue.cuh"
#include "kernels/tile_rs.h"
#include "kernels/tile_sched.cuh"

namespace jaxoverlap::tile {

// cuTensorMapEncodeTiled from the driver, looked up once (the runtime links no libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// The tensor maps of epi kTileEpiTensorStores / Loads (EpilogueArgs::maps, loads): a 16-bit [rows, N] row-major
// matrix at base, 16 x box_cols boxes, 64-byte swizzle (32 columns: the loads' units, and the
// stores' at kTStoreCols 32) or 128-byte (64 columns) (tile_slab.cuh's store_tensor).
inline cudaError_t encode_store_map(CUtensorMap* map, void* base, int64_t rows, int64_t N,
                                    int box_cols = 32) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (!encode) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {(cuuint64_t)N, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)N * 2};
  const cuuint32_t box[2] = {(cuuint32_t)box_cols, 16}, elem[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, base, dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE,
                            box_cols == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                            CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The end of a call, run by every thread of every CTA of the tile kernel after CUTLASS's kernel:
// the CTA counts itself out (Flags::exits, acq_rel: its writes and reads before the count); the
// grid's last CTA then does what a release kernel and a finish kernel did after the kernel until
// session 12 (two launches less per call): it releases this rank's staging slots to the peers
// (every own tile's loads of them came before some CTA's count), fills the output with NaN if a
// wait of this rank gave up or a peer process poisoned the call, and advances the epoch
// (finish_call, common.cuh). The epoch it reads is the call's: nothing changes it before every
// CTA has counted. No CTA waits for its TMA stores here: in the modes that wait (0, 7: the only
// ones a NaN fill can follow) the output is written by the own tiles' generic stores, which the
// count orders before the fill, and the foreign tiles' bulk stores to the peers completed before
// their flags (TileEpilogue::flush). An emulated group (one flag block for every rank: the
// probes' and the selection's scratch timing) releases for its emulated peers too (the slot
// each foreign tile's store waits for).
CUTLASS_DEVICE void end_call(const EpilogueArgs& a, uint32_t ctas) {
  __syncthreads();
  const Peers& p = a.peers;
  Flags* local = p.flags[p.rank];
  int last = 0;
  if (threadIdx.x == 0) {
    const uint32_t e = *(volatile uint32_t*)&local->epoch + 1u;
    uint32_t before;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;"
                 : "=r"(before)
                 : "l"(&local->exits[e & 1u])
                 : "memory");
    last = before == ctas - 1;
  }
  if (!__syncthreads_or(last)) return;
  const uint32_t e = local->epoch + 1u;
  const int s = (int)threadIdx.x;
  if (s < p.n && s != p.rank) {
    if (p.flags[s] == local)
      st_release_sys(&local->slot_free[s], e);
    else
      st_release_sys(&p.flags[s]->slot_free[p.rank], e);
  }
  // tools modes 2 and 9 write the whole [n m, N] product (a plain GEMM), the others the block
  const int64_t elems = (a.mode == 2 || a.mode == 9 ? p.n : 1) * a.m * a.N;
  finish_call(local, reinterpret_cast<uint16_t*>(a.out), elems, nullptr, 0, 0x7fc0u, 0, a.err,
              p.device, p.rank, nullptr, a.op);
}

// The tile kernel: CUTLASS's kernel (cutlass::device_kernel's body), then the call's end.
template <class Kernel>
__global__ void __launch_bounds__(Kernel::MaxThreadsPerBlock, Kernel::MinBlocksPerMultiprocessor)
    tile_kernel(const __grid_constant__ typename Kernel::Params params) {
  extern __shared__ char smem[];
  flag_mailbox_clear();  // kPublisher only
  Kernel op;
  op(params, smem);
  flag_mailbox_run();  // kPublisher only
  end_call(params.epilogue.a, gridDim.x * gridDim.y * gridDim.z);
}

// One menu entry: tiles 128 x kTileN (256 or 128), clusters of kClusterM x kClusterN CTAs (along
// M they share w's tile, along N x's). Cooperative: the two consumer warpgroups share each tile
// (64 rows each). Ping-pong (kPingpong): each warpgroup runs a whole tile, and one's epilogue
// (the stores to the peers, the adds of their slabs) runs under the other's MMA.
// kSched: the claim path of tile_sched.cuh (0: ClaimScheduler's own; entry 4: kClaimLate; tools
// entries: the others, tile_rs.cu).
template <class Element, bool kWColMajor, int kTileN, int kClusterM, int kClusterN,
          bool kPingpong = false, int kSched = 0>
struct TileKernel {
  static_assert(kTileRowAlign % (kTileM * kClusterM) == 0, "a rank's rows fill whole clusters");
  using TileShape = cute::Shape<cute::_128, cute::Int<kTileN>, cute::_64>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using Op = TileEpilogue<Element, kTileN, kPingpong, kClusterM * kClusterN>;
  using Epilogue = TileCollective<Op>;
  using LayoutB =
      std::conditional_t<kWColMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8,
      Element, LayoutB, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Op::SharedStorage) + kRing * sizeof(uint64_t) +
                           (kPublisher ? sizeof(FlagMailbox) : 0))>,
      std::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperative>>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>, Mainloop, Epilogue,
      std::conditional_t<kSched != 0, ClaimedTilesVariant<kSched, kPingpong>,
                         std::conditional_t<kPingpong, ClaimedTilesPingpong, ClaimedTiles>>>;
  static_assert(Mainloop::DispatchPolicy::Stages < kRing, "the claim ring must outlast the pipeline");

  static cudaError_t preload() {
    cudaFuncAttributes attr;
    if (cudaError_t e = cudaFuncGetAttributes(&attr, tile_kernel<Kernel>)) return e;
    return cudaFuncSetAttribute(tile_kernel<Kernel>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                Kernel::SharedStorageSize);
  }

  static typename Kernel::Arguments arguments(const TileRsArgs& a) {
    const int n = a.peers.n;
    const int64_t rows = n * a.m;
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    typename Kernel::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {(int)rows, (int)a.N, (int)a.K, 1};
    args.mainloop.ptr_A = static_cast<const Element*>(a.x);
    args.mainloop.dA = cutlass::make_cute_packed_stride(StrideA{}, {(int)rows, (int)a.K, 1});
    args.mainloop.ptr_B = static_cast<const Element*>(a.w);
    args.mainloop.dB = cutlass::make_cute_packed_stride(StrideB{}, {(int)a.N, (int)a.K, 1});
    const int32_t tiles_n = (int32_t)((a.N + kTileN - 1) / kTileN);
    const int32_t flag_cols = (int32_t)((a.N + kFlagCols - 1) / kFlagCols);
    EpilogueArgs& e = args.epilogue.a;
    e.peers = a.peers;
    e.out = static_cast<char*>(a.out);
    e.m = a.m;
    e.N = a.N;
    e.slot_bytes = a.slot_bytes;
    e.flag_cols = flag_cols;
    e.legacy_publish = a.legacy_publish;
    e.claims = kSched == 1 ? 0 : kSched != 0 ? kSched : 1;  // 1: a static order claims nothing
    e.epi = a.epi;
    e.mode = a.mode;
    e.stall_rank = a.stall_rank;
    e.op = a.op;
    e.timeout_ns = a.timeout_ns;
    e.err = a.err;
    args.hw_info.device_id = a.peers.device;
    args.hw_info.sm_count = a.sm_count;
    args.scheduler.raster_order =
        cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90::RasterOrderOptions::AlongN;
    Geometry& g = args.scheduler.g;
    g.local = a.peers.flags[a.peers.rank];
    g.stage = a.peers.stage[a.peers.rank];
    g.m = a.m;
    g.N = a.N;
    g.slot_bytes = a.slot_bytes;
    g.n = n;
    g.rank = a.peers.rank;
    g.cluster_rows = (int32_t)(a.m / (kTileM * kClusterM));
    g.cluster_cols = (tiles_n + kClusterN - 1) / kClusterN;
    g.swizzle = a.swizzle > 0 ? a.swizzle : 1;
    g.total = g.cluster_rows * n * g.cluster_cols;
    g.set_divisors();
    e.own_first = (n - 1) * g.cluster_rows * g.cluster_cols;  // claim order: own block last
    g.plain = a.mode == 2 || a.mode == 9;
    // The own tiles' L2 prefetch of their peer data: tools modes 7 and 8 only. Measured slower in
    // the fused op (docs/tile-schedule.md, "The own tiles' L2 prefetch"): off in production.
    g.prefetch = a.mode == 7 || a.mode == 8;
    return args;
  }

  // epi kTileEpiTensorStores or Op::kTensorOnly (a ping-pong kernel of the default build): the
  // stores' tensor maps (EpilogueArgs::maps), else nothing. The
  // staging slot this rank fills on rank j holds the block of both epoch parities one after the
  // other: one map of 2m rows, the parity chosen by the row (TileEpilogue).
  static cudaError_t encode_maps(const TileRsArgs& a, EpilogueArgs& e) {
    const int n = a.peers.n, r = a.peers.rank;
    const bool plain = a.mode == 2 || a.mode == 5 || a.mode == 9;
    if ((a.epi & kTileEpiTensorLoads) && !plain)
      for (int i = 0; i < n - 1; ++i)
        if (cudaError_t err = encode_store_map(&e.loads[i], a.peers.stage[r] + i * a.slot_bytes,
                                               2 * a.m, a.N))
          return err;
    if (!(a.epi & kTileEpiTensorStores) && !Op::kTensorOnly) return cudaSuccess;
    const bool to_out = plain || a.mode == 4 || a.mode == 6;
    if (to_out)
      if (cudaError_t err = encode_store_map(&e.maps[r], a.out, n * a.m, a.N, kTStoreCols))
        return err;
    if (plain) return cudaSuccess;
    for (int j = 0; j < n; ++j)
      if (j != r)
        if (cudaError_t err = encode_store_map(
                &e.maps[j], a.peers.stage[j] + stage_slot(r, j, n) * a.slot_bytes, 2 * a.m, a.N,
                kTStoreCols))
          return err;
    return cudaSuccess;
  }

  // The launch configuration of `params` (cluster attribute in *cluster).
  static cudaLaunchConfig_t config(typename Kernel::Params const& params, cudaStream_t stream,
                                   cudaLaunchAttribute* cluster) {
    cluster->id = cudaLaunchAttributeClusterDimension;
    cluster->val.clusterDim.x = kClusterM;
    cluster->val.clusterDim.y = kClusterN;
    cluster->val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = Kernel::get_grid_shape(params);
    cfg.blockDim = Kernel::get_block_shape();
    cfg.dynamicSmemBytes = Kernel::SharedStorageSize;
    cfg.stream = stream;
    cfg.attrs = cluster;
    cfg.numAttrs = 1;
    return cfg;
  }

  // Whether this entry can launch the problem: CUTLASS's can_implement, and a cluster of it fits
  // on the GPU (the kernel must be loaded: preload). cudaSuccess or why not.
  static cudaError_t check(const TileRsArgs& a) {
    typename Kernel::Arguments args = arguments(a);
    if (cudaError_t e = encode_maps(a, args.epilogue.a)) return e;
    if (!Kernel::can_implement(args)) return cudaErrorInvalidValue;
    if (kClusterM * kClusterN == 1) return cudaSuccess;
    typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);
    cudaLaunchAttribute cluster;
    cudaLaunchConfig_t cfg = config(params, nullptr, &cluster);
    int clusters = 0;
    if (cudaError_t e =
            cudaOccupancyMaxActiveClusters(&clusters, tile_kernel<Kernel>, &cfg))
      return e;
    return clusters > 0 ? cudaSuccess : cudaErrorInvalidClusterSize;
  }

  static cudaError_t launch(const TileRsArgs& a, cudaStream_t stream) {
    typename Kernel::Arguments args = arguments(a);
    if (cudaError_t e = encode_maps(a, args.epilogue.a)) return e;
    if (!Kernel::can_implement(args)) return cudaErrorInvalidValue;
    typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);
    cudaLaunchAttribute cluster;
    cudaLaunchConfig_t cfg = config(params, stream, &cluster);
    return cudaLaunchKernelEx(&cfg, tile_kernel<Kernel>, params);
  }
};

}  // namespace jaxoverlap::tile


// One instantiation file per menu entry and w layout (tile_rs_e<k>_<wrow|wcol>.cu): the entry's
// preload and launch, declared in tile_rs.cu's menu.
// (JAXOVERLAP_TILE_ENTRY_SCHED: an entry with another claim path, kSched: entry 4, tools entries.)
#define JAXOVERLAP_TILE_ENTRY(NAME, WCOL, TILE_N, CLUSTER_M, CLUSTER_N, PINGPONG) \
  JAXOVERLAP_TILE_ENTRY_SCHED(NAME, WCOL, TILE_N, CLUSTER_M, CLUSTER_N, PINGPONG, 0)
#define JAXOVERLAP_TILE_ENTRY_SCHED(NAME, WCOL, TILE_N, CLUSTER_M, CLUSTER_N, PINGPONG, SCHED)   \
  namespace jaxoverlap {                                                                         \
  using TileKernel_##NAME = tile::TileKernel<cutlass::bfloat16_t, WCOL, TILE_N, CLUSTER_M,       \
                                             CLUSTER_N, PINGPONG, SCHED>;                        \
  cudaError_t tile_rs_preload_##NAME() { return TileKernel_##NAME::preload(); }                  \
  cudaError_t tile_rs_check_##NAME(const TileRsArgs& a) { return TileKernel_##NAME::check(a); } \
  cudaError_t tile_rs_launch_##NAME(const TileRsArgs& a, cudaStream_t stream) {                  \
    return TileKernel_##NAME::launch(a, stream);                                                 \
  }                                                                                              \
  }
