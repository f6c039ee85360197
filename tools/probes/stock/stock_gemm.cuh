// Stock CUTLASS 4.2 Hopper GEMMs for tools/probes/tile_stock_probe.cu: the mainloop AND the
// epilogue from CUTLASS's collective builders (TMA warp-specialised epilogue, D = acc rounded to
// bf16, no C), CUTLASS's own persistent (or stream-K) tile scheduler. The yardstick for our tile
// kernel's scheduler and epilogue (ffi/kernels/tile_rs.cuh): same TMA mainloop, same tile shape.
// One instantiation per file (stock_<name>.cu), x [M, K] row-major, w [K, N] row- or
// column-major (as TileKernel's LayoutB), out [M, N] row-major.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "stock_api.h"

namespace stock {

template <bool kWCol, int kTileM, int kTileN, int kClusterM, int kClusterN, bool kPingpong,
          bool kStreamK>
struct StockGemm {
  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::_64>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using LayoutB = std::conditional_t<kWCol, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, 8, Element, cutlass::layout::RowMajor, 8,
      std::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                         cutlass::epilogue::TmaWarpSpecializedCooperative>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8,
      Element, LayoutB, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      std::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperative>>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>, Mainloop, Epilogue,
      std::conditional_t<kStreamK, cutlass::gemm::StreamKScheduler,
                         cutlass::gemm::PersistentScheduler>>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(const Problem& p) {
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {(int)p.M, (int)p.N, (int)p.K, 1};
    args.mainloop.ptr_A = static_cast<const Element*>(p.x);
    args.mainloop.dA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {(int)p.M, (int)p.K, 1});
    args.mainloop.ptr_B = static_cast<const Element*>(p.w);
    args.mainloop.dB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {(int)p.N, (int)p.K, 1});
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, {(int)p.M, (int)p.N, 1});
    args.epilogue.ptr_D = static_cast<Element*>(p.out);
    args.epilogue.dD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {(int)p.M, (int)p.N, 1});
    args.hw_info.device_id = 0;
    args.hw_info.sm_count = p.sm_count;
    args.scheduler.max_swizzle_size = p.swizzle;
    using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.raster_order =
        p.raster == 1 ? Raster::AlongN : p.raster == 2 ? Raster::AlongM : Raster::Heuristic;
    return args;
  }

  // cudaSuccess, or why not: can_implement, the workspace (p.workspace, p.workspace_bytes).
  static cudaError_t run(const Problem& p, cudaStream_t stream) {
    Gemm gemm;
    typename Gemm::Arguments args = arguments(p);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
    if (Gemm::get_workspace_size(args) > p.workspace_bytes) return cudaErrorMemoryAllocation;
    if (gemm.initialize(args, p.workspace, stream) != cutlass::Status::kSuccess)
      return cudaErrorInvalidConfiguration;
    if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
    return cudaGetLastError();
  }
};

}  // namespace stock

// stock_<NAME>.cu: one instantiation, registered under NAME (both w layouts in one file would
// double its compile time: the column-major twin is its own file).
#define STOCK_GEMM(NAME, WCOL, TM, TN, CM, CN, PP, SK)                                     \
  namespace stock {                                                                       \
  cudaError_t run_##NAME(const Problem& p, cudaStream_t s) {                              \
    return StockGemm<WCOL, TM, TN, CM, CN, PP, SK>::run(p, s);                           \
  }                                                                                       \
  }
