// What the two FFI handlers share: the static group table sent by the lowering, dtype mapping,
// turning runtime sentences and CUDA errors into ffi::Error, the join back onto XLA's stream and
// the attributes both bind. Host code only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/comm.h"
#include "runtime.h"
#include "xla/ffi/api/ffi.h"

static_assert(XLA_FFI_API_MAJOR == 0 && XLA_FFI_API_MINOR == 4,
              "jaxoverlap must be built against the jaxlib 0.11.2 XLA FFI headers (API 0.4): "
              "handlers built against newer headers are rejected by jaxlib 0.11.x");

namespace jaxoverlap {
namespace ffi = xla::ffi;

inline ffi::Error internal(const std::string& what, const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInternal, what + ": " + msg);
}
inline ffi::Error invalid(const std::string& what, const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, what + ": " + msg);
}

// CK(call): returns the failed CUDA call and its error as an internal error of the op named by
// `kWhat`, which must be in scope.
#define CK(call)                                                                \
  if (cudaError_t ce = (call); ce != cudaSuccess) {                             \
    return internal(kWhat, std::string(#call) + ": " + cudaGetErrorString(ce)); \
  }

// The lowering sends, for every device of the program, its CUDA ordinal, its rank along the
// reduced axes and its group's ordinals in rank order (rows of `groups`, `n` columns).
inline std::string find_group(int32_t device, ffi::Span<const int32_t> ordinals,
                              ffi::Span<const int32_t> ranks, ffi::Span<const int32_t> groups,
                              int64_t n, int* rank, std::vector<int>* group) {
  if (n < 2 || n > kMaxRanks)
    return "group size " + std::to_string(n) + " is outside 2.." + std::to_string(kMaxRanks);
  if (ranks.size() != ordinals.size() || groups.size() != ordinals.size() * (size_t)n)
    return "malformed group table";
  for (size_t i = 0; i < ordinals.size(); ++i) {
    if (ordinals[i] != device) continue;
    *rank = ranks[i];
    group->assign(groups.begin() + i * n, groups.begin() + (i + 1) * n);
    if ((*group)[*rank] != device) return "group table does not list this device at its rank";
    return "";
  }
  return "device ordinal " + std::to_string(device) + " is not in the group table";
}

inline bool to_dtype(ffi::DataType t, DType* out) {
  if (t == ffi::DataType::BF16) *out = DType::kBF16;
  else if (t == ffi::DataType::F16) *out = DType::kF16;
  else return false;
  return true;
}

// Preloads our kernels on this device once (lazy module loading can deadlock a spinning
// consumer against a producer that is not loaded yet).
inline std::string preload(DeviceRuntime* dev) {
  if (dev->kernels_loaded) return "";
  if (cudaError_t e = preload_comm_kernels())
    return std::string("preloading the communication kernels failed: ") + cudaGetErrorString(e);
  dev->kernels_loaded = true;
  return "";
}

// The handlers' join: records the done events on the green-context streams they launched on (the
// GEMM stream only if `gemm`), makes XLA's stream wait for them, then runs the finish kernel on
// XLA's stream. `kWhat` names the op in errors.
inline ffi::Error join(const char* kWhat, cudaStream_t xla_stream, DeviceRuntime* dev,
                       const Partition* part, bool gemm, Flags* local) {
  if (gemm) CK(cudaEventRecord(dev->gemm_done, part->gemm));
  CK(cudaEventRecord(dev->comm_done, part->comm));
  if (gemm) CK(cudaStreamWaitEvent(xla_stream, dev->gemm_done));
  CK(cudaStreamWaitEvent(xla_stream, dev->comm_done));
  CK(launch_finish(local, xla_stream));
  return ffi::Error::Success();
}

// The attributes both handlers take after their buffers, in this order (the lowering,
// jaxoverlap/fused.py, sends them by name).
template <typename Binding>
auto bind_common_attrs(Binding&& binding) {
  return std::move(binding)
      .template Attr<int64_t>("site")
      .template Attr<ffi::Span<const int32_t>>("ordinals")
      .template Attr<ffi::Span<const int32_t>>("ranks")
      .template Attr<ffi::Span<const int32_t>>("groups")
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("comm_sms")
      .template Attr<int64_t>("chunks")
      .template Attr<double>("timeout_s")
      .template Attr<int64_t>("stall_rank")
      .template Attr<int64_t>("profile");
}

}  // namespace jaxoverlap
