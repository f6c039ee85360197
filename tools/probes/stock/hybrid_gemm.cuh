// Hybrid kernels of tools/probes/tile_stock_probe.cu: our TileKernel (ffi/kernels/tile_rs.cuh:
// the same collective mainloop and our TileEpilogue, plain mode 2, or 9: no stores) with
// CUTLASS's own persistent tile scheduler in place of ClaimScheduler (hyb_<name>.cu), or with an
// experiment variant of ClaimScheduler (var<k>_<name>.cu: tile_sched.cuh's
// ClaimedTilesVariant<k>). One instantiation per file.
#pragma once

// tile_rs.cuh first: it includes <cudaTypedefs.h>, which CUTLASS's cuda_host_adapter.hpp includes
// inside namespace cutlass (its include guard would then leave the global PFN_ types undeclared).
#include "kernels/tile_rs.cuh"

#include <cutlass/device_kernel.h>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>
#include "stock_api.h"

namespace stock {

// kVariant < 0: CUTLASS's PersistentScheduler; else ClaimScheduler's variant kVariant.
template <int kTileN, int kClusterM, int kClusterN, bool kPingpong, int kVariant = -1>
struct HybridGemm {
  using Ours = jaxoverlap::tile::TileKernel<cutlass::bfloat16_t, false, kTileN, kClusterM,
                                            kClusterN, kPingpong>;
  using Tag = std::conditional_t<kVariant < 0, cutlass::gemm::PersistentScheduler,
                                 jaxoverlap::tile::ClaimedTilesVariant<(kVariant < 0 ? 0 : kVariant),
                                                                      kPingpong>>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>, typename Ours::Mainloop, typename Ours::Epilogue, Tag>;

  static cudaError_t run(const Problem& p, cudaStream_t stream) {
    using namespace jaxoverlap;
    TileRsArgs a{};
    a.peers.n = 2;
    a.peers.rank = 0;
    a.peers.device = 0;
    for (int r = 0; r < 2; ++r) a.peers.flags[r] = static_cast<Flags*>(p.tile_flags);
    a.x = p.x, a.w = p.w, a.out = p.out, a.m = p.M / 2, a.N = p.N, a.K = p.K;
    a.dtype = DType::kBF16;
    a.sm_count = p.sm_count, a.swizzle = kVariant < 0 ? 1 : p.swizzle, a.mode = p.mode,
    a.epi = p.epi, a.stall_rank = -1;
    const typename Ours::Kernel::Arguments o = Ours::arguments(a);
    typename Kernel::Arguments args{};
    args.mode = o.mode;
    args.problem_shape = o.problem_shape;
    args.mainloop = o.mainloop;
    args.epilogue = o.epilogue;
    // epi 4 (the TMA tensor stores): the plain output's tensor map, as TileKernel::launch does
    if (cudaError_t e = Ours::encode_maps(a, args.epilogue.a)) return e;
    // no counter: the epilogue claims nothing (variant 3: it claims the static order's tiles)
    args.epilogue.a.claims = kVariant == 3 ? 2 : 0;
    args.hw_info = o.hw_info;
    if constexpr (kVariant < 0) {
      args.scheduler.max_swizzle_size = p.swizzle;
      using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
      args.scheduler.raster_order =
          p.raster == 1 ? Raster::AlongN : p.raster == 2 ? Raster::AlongM : Raster::Heuristic;
    } else {  // ours: along N, our raster band p.swizzle (decode), our geometry
      args.scheduler.raster_order = o.scheduler.raster_order;
      args.scheduler.g = o.scheduler.g;
    }
    // Launched as TileKernel::launch does (CUTLASS's device adapter wants a stock epilogue).
    static bool loaded = false;
    if (!loaded) {
      if (cudaError_t e = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               Kernel::SharedStorageSize))
        return e;
      loaded = true;
    }
    if (!Kernel::can_implement(args)) return cudaErrorInvalidValue;
    typename Kernel::Params params = Kernel::to_underlying_arguments(args, p.workspace);
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = kClusterM;
    cluster.val.clusterDim.y = kClusterN;
    cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = Kernel::get_grid_shape(params);
    cfg.blockDim = Kernel::get_block_shape();
    cfg.dynamicSmemBytes = Kernel::SharedStorageSize;
    cfg.stream = stream;
    cfg.attrs = &cluster;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, cutlass::device_kernel<Kernel>, params);
  }
};

}  // namespace stock

#define HYBRID_GEMM(NAME, TN, CM, CN, PP)                                                  \
  namespace stock {                                                                       \
  cudaError_t run_##NAME(const Problem& p, cudaStream_t s) {                              \
    return HybridGemm<TN, CM, CN, PP>::run(p, s);                                         \
  }                                                                                       \
  }
#define VARIANT_GEMM(NAME, TN, CM, CN, PP, V)                                              \
  namespace stock {                                                                       \
  cudaError_t run_##NAME(const Problem& p, cudaStream_t s) {                              \
    return HybridGemm<TN, CM, CN, PP, V>::run(p, s);                                      \
  }                                                                                       \
  }
