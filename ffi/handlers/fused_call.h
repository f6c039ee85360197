// What the FFI handlers share: the static group table sent by the lowering (validated whole),
// the timeout, dtype mapping, turning runtime sentences and CUDA errors into ffi::Error, the fork
// onto the green-context streams and the join back onto XLA's stream, and the attributes every
// handler binds. Host code only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/ce.h"
#include "kernels/comm.h"
#include "runtime/runtime.h"
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
// `kWhat`, which must be in scope; under XLA's graph capture, also a call that invalidated it.
#define CK(call)                                                                \
  if (cudaError_t ce = (call); ce != cudaSuccess) {                             \
    return internal(kWhat, std::string(#call) + ": " + cudaGetErrorString(ce)); \
  } else if (std::string lost = capture_lost(#call); !lost.empty()) {           \
    return internal(kWhat, lost);                                               \
  }

// The lowering sends, for every device of the program in this process, its CUDA ordinal, its
// rank along the reduced axes and its group's ordinals in rank order (rows of `groups`, `n`
// columns; a member in another process as -1 - its global device id). Every
// rank validates the whole table, not only its own row: the table is the same attribute on every
// rank, so a malformed one is rejected by all of them before any launch (a rank that bailed out
// alone would leave its peers spinning until the timeout).
inline std::string find_group(int32_t device, ffi::Span<const int32_t> ordinals,
                              ffi::Span<const int32_t> ranks, ffi::Span<const int32_t> groups,
                              int64_t n, int* rank, std::vector<int>* group) {
  if (n < 2 || n > kMaxRanks)
    return "group size " + std::to_string(n) + " is outside 2.." + std::to_string(kMaxRanks);
  if (ranks.size() != ordinals.size() || groups.size() != ordinals.size() * (size_t)n)
    return "malformed group table";
  for (size_t i = 0; i < ordinals.size(); ++i)  // ranks first: the rows are indexed by them
    if (ranks[i] < 0 || ranks[i] >= n)
      return "group table gives device " + std::to_string(ordinals[i]) + " rank " +
             std::to_string(ranks[i]) + ", outside 0.." + std::to_string(n - 1);
  int found = -1;
  for (size_t i = 0; i < ordinals.size(); ++i) {
    const int32_t r = ranks[i];
    const int32_t* row = groups.begin() + i * n;
    if (row[r] != ordinals[i])
      return "group table does not list device " + std::to_string(ordinals[i]) + " at its rank";
    for (int64_t a = 0; a < n; ++a) {
      for (int64_t b = 0; b < a; ++b)
        if (row[a] == row[b]) return "group table lists a device twice in one group";
      if (row[a] < 0) continue;  // -1 - global id: a member in another process (runtime.h)
      // Every member must be in the table with this very group, at its position.
      size_t j = 0;
      while (j < ordinals.size() && ordinals[j] != row[a]) ++j;
      if (j == ordinals.size() || ranks[j] != a ||
          !std::equal(row, row + n, groups.begin() + j * n))
        return "group table is inconsistent: device " + std::to_string(row[a]) +
               " does not list the same group at rank " + std::to_string(a);
    }
    if (ordinals[i] == device) {
      if (found >= 0) return "group table lists device " + std::to_string(device) + " twice";
      found = (int)i;
    }
  }
  if (found < 0) return "device ordinal " + std::to_string(device) + " is not in the group table";
  *rank = ranks[found];
  group->assign(groups.begin() + found * n, groups.begin() + (found + 1) * n);
  return "";
}

// The bound on every cross-GPU wait, in ns: finite, positive and at most a day (the Python side
// rejects anything else first; a hand-built call could still send NaN, which would convert to an
// undefined integer).
inline std::string to_timeout_ns(double timeout_s, uint64_t* ns) {
  if (!(timeout_s > 0.0 && timeout_s <= 86400.0))  // false for NaN
    return "timeout_s=" + std::to_string(timeout_s) + " must be a finite number of seconds in "
           "(0, 86400]";
  *ns = (uint64_t)(timeout_s * 1e9);
  return "";
}

inline bool to_dtype(ffi::DataType t, DType* out) {
  if (t == ffi::DataType::BF16) *out = DType::kBF16;
  else if (t == ffi::DataType::F16) *out = DType::kF16;
  else return false;
  return true;
}

// The GEMM of a handler over blocks of rows, validated alike everywhere: x[..., K] and w[K, N]
// (bf16 or f16; `out` of the same type), `rows` = x's rows, `m` = the rows of one rank's block
// (rows / n, or, `gather`, x's own rows), `chunks` chunks of `mc` rows whose operands all stay
// 256-byte aligned. Returns "" or what is wrong; the caller checks its results' sizes.
struct RowGemm {
  DType dtype;
  int64_t K, N, rows, m, mc;
};
inline std::string row_gemm(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                            const ffi::AnyBuffer& out, int64_t n, int64_t chunks, bool gather,
                            RowGemm* g) {
  if (!to_dtype(x.element_type(), &g->dtype) || w.element_type() != x.element_type() ||
      out.element_type() != x.element_type())
    return "x, w and the result must all be bfloat16 or all float16";
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() < 1 || wd.size() != 2 || xd.back() != wd[0])
    return "expected x[..., K] and w[K, N]";
  g->K = wd[0];
  g->N = wd[1];
  g->rows = g->K ? (int64_t)x.element_count() / g->K : 0;
  if (!gather && g->rows % n) return "the rows of x are not divisible by the group size";
  g->m = gather ? g->rows : g->rows / n;
  if (g->m < 1) return "x has no rows";
  if (chunks < 1 || chunks > kMaxChunks || g->m % chunks)
    return "chunks must divide the rows per rank and be at most 16";
  g->mc = g->m / chunks;
  if ((g->mc * g->K * 2) % 256 || (g->mc * g->N * 2) % 256)
    return "rows per chunk x K and rows per chunk x N must be multiples of 128 elements "
           "(256-byte alignment of every GEMM operand)";
  return "";
}

// Preloads our kernels on this device once (lazy module loading can deadlock a spinning
// consumer against a producer that is not loaded yet).
inline std::string preload(DeviceRuntime* dev) {
  if (dev->kernels_loaded) return "";
  return outside_capture("loading the communication kernels", [dev]() -> std::string {
    if (cudaError_t e = preload_comm_kernels())
      return std::string("preloading the communication kernels failed: ") + cudaGetErrorString(e);
    dev->kernels_loaded = true;
    return "";
  });
}

// For the handlers whose pushes ride on the copy engine, once per device, under the device's
// handler lock: the copy stream (highest priority, so its one-thread signal kernels are scheduled
// ahead of queued GEMM blocks) and the copy-engine protocol kernels.
inline std::string ce_setup(DeviceRuntime* dev) {
  if (dev->ce_kernels_loaded && dev->copy) return "";
  return outside_capture("setting up the copy engine's stream and kernels", [dev]() -> std::string {
    if (!dev->ce_kernels_loaded) {
      if (cudaError_t e = preload_ce_kernels())
        return std::string("preloading the copy-engine kernels failed: ") + cudaGetErrorString(e);
      dev->ce_kernels_loaded = true;
    }
    if (!dev->copy) {
      int least = 0, greatest = 0;
      cudaDeviceGetStreamPriorityRange(&least, &greatest);
      if (cudaError_t e = cudaStreamCreateWithPriority(&dev->copy, cudaStreamNonBlocking, greatest))
        return std::string("creating the copy stream failed: ") + cudaGetErrorString(e);
    }
    return "";
  });
}

// The start of a copy-engine handler's call, after begin_call: our kernels loaded, the copy
// stream as `streams->comm` (the join's), the test-only failure (fused._failed_rank_for_tests),
// the device's error record in `*err`.
inline ffi::Error ce_call_start(const char* kWhat, DeviceRuntime* dev, int32_t device, int rank,
                                int64_t stall_rank, Partition* streams, ErrorRecord** err) {
  if (std::string e = preload(dev); !e.empty()) return internal(kWhat, e);  // release, finish
  if (std::string e = ce_setup(dev); !e.empty()) return internal(kWhat, e);
  streams->comm = dev->copy;
  if (stall_rank <= -2 && rank == -2 - stall_rank)
    return internal(kWhat, "test-only failure injected on this rank after begin_call");
  *err = error_record(device);
  if (!*err) return internal(kWhat, "could not allocate the host-mapped error record");
  capture_mark("ce_call_start");
  return ffi::Error::Success();
}

// Whether a workspace's first call on this device runs its warm-up: drain the device, run the
// call's GEMMs once on its own buffers (planning them, loading their kernels) and wait, so that
// no kernel of ours spins while a kernel loads. Not while XLA captures the call: nothing of it
// runs then, and writing the buffers would race with XLA's work still in flight on them; the
// GEMMs plan and load themselves on scratch operands instead (gemm.h), and the warm-up stays
// due for the first uncaptured call.
inline bool warm_up_now(const Workspace* ws, int rank) {
  return !ws->warmed[rank] && !under_capture();
}

// The handlers' fork: the green-context streams they launch on (the GEMM stream only if `gemm`)
// wait for XLA's stream and for the previous call of the same workspace on this device
// (`ws_done`, recorded by `join`): calls of one workspace never overlap on a device, even when
// they come from different XLA streams. `kWhat` names the op in errors.
inline ffi::Error fork_streams(const char* kWhat, cudaStream_t xla_stream, DeviceRuntime* dev,
                               const Partition* part, bool gemm, cudaEvent_t ws_done) {
  CK(cudaEventRecord(dev->fork, xla_stream));
  for (cudaStream_t s : {part->gemm, part->comm}) {
    if (s == part->gemm && !gemm) continue;
    CK(cudaStreamWaitEvent(s, dev->fork));
    CK(wait_done(s, ws_done));
  }
  return ffi::Error::Success();
}

// The outputs a call poisons with NaN when one of its waits gave up (the second one optional:
// the gathered x of all_gather_matmul's variant that returns it).
struct Output {
  void* data;
  int64_t bytes;
  DType dtype;
  void* data2 = nullptr;
  int64_t bytes2 = 0;
};

// The handlers' join: records the done events on the green-context streams they launched on (the
// GEMM stream only if `gemm`), makes XLA's stream wait for them, runs the finish kernel on XLA's
// stream (NaN into `out` if a wait of this rank gave up; epoch + 1) and records the workspace's
// done event after it.
inline ffi::Error join(const char* kWhat, cudaStream_t xla_stream, DeviceRuntime* dev,
                       const Partition* part, bool gemm, Workspace* ws, int rank, Output out) {
  if (gemm) CK(cudaEventRecord(dev->gemm_done, part->gemm));
  CK(cudaEventRecord(dev->comm_done, part->comm));
  if (gemm) CK(cudaStreamWaitEvent(xla_stream, dev->gemm_done));
  CK(cudaStreamWaitEvent(xla_stream, dev->comm_done));
  ErrorRecord* err = ws->spans ? error_record(ws->ordinals[rank]) : nullptr;
  CK(launch_finish_poison(ws->peers[rank].flags[rank], out.data, out.bytes, out.dtype,
                          xla_stream, false, out.data2, out.bytes2, err, ws->ordinals[rank], rank));
  CK(record_done(ws->done[rank], xla_stream));
  return ffi::Error::Success();
}

// Ends a call that launches nothing more on this rank but must still count as one call of `ws`
// (epochs stay equal on every rank): after whatever it launched, release the staging slots this
// rank would have consumed and advance the epoch (filling `poison` with NaN first, if given), on
// XLA's stream. Best effort: errors of these CUDA calls are ignored.
inline void close_call(cudaStream_t xla_stream, DeviceRuntime* dev, const Partition* part,
                       Workspace* ws, int rank, const Output* poison = nullptr) {
  // Join the streams this call launched on. Under XLA's capture, a stream the call never forked
  // holds nothing of it, and waiting for it would invalidate the capture (an event recorded
  // outside it): only the forked ones join.
  const bool capturing = stream_capturing(xla_stream);
  for (cudaStream_t s : {part ? part->gemm : nullptr, part ? part->comm : nullptr}) {
    if (!s || s == xla_stream || (capturing && !stream_capturing(s))) continue;
    cudaEventRecord(dev->comm_done, s);
    cudaStreamWaitEvent(xla_stream, dev->comm_done);
  }
  wait_done(xla_stream, ws->done[rank]);
  launch_release_slots(ws->peers[rank], xla_stream);
  Flags* local = ws->peers[rank].flags[rank];
  if (poison)
    launch_finish_poison(local, poison->data, poison->bytes, poison->dtype, xla_stream, true,
                         poison->data2, poison->bytes2);
  else
    launch_finish(local, xla_stream);
  record_done(ws->done[rank], xla_stream);
  cudaGetLastError();
}

// Starts this rank's call of `ws`, the logical call `id` (runtime.h: begin_call). If the call is
// the one chosen to report an earlier failure, every rank refuses it alike: it launches nothing
// but close_call and returns that report as its error. If another rank issued a different
// logical call under the same number (calls issued in different orders), the call is given up
// on every rank: this rank launches nothing but close_call with `out` filled with NaN, and sets
// `*given_up`; the handler then returns success (like fail_call: an error would stop this
// rank's program alone) and the report is raised by check_errors() or the next fused call.
inline ffi::Error begin_call(const char* kWhat, cudaStream_t xla_stream, DeviceRuntime* dev,
                             Workspace* ws, int rank, CallId id, const Output& out,
                             uint32_t* index, bool* given_up) {
  std::string refused;
  bool misordered = false;
  *index = begin_call(ws, rank, id, &refused, &misordered);
  capture_mark("begin_call");
  *given_up = misordered && refused.empty();
  if (!*given_up && refused.empty()) return ffi::Error::Success();
  preload(dev);  // best effort: this may be the device's first call (its kernels not loaded yet)
  if (*given_up) {
    close_call(xla_stream, dev, nullptr, ws, rank, &out);
    return ffi::Error::Success();
  }
  close_call(xla_stream, dev, nullptr, ws, rank);
  return ffi::Error(ffi::ErrorCode::kAborted,
                    std::string(kWhat) + ": an earlier fused call failed: " + refused);
}

// A call that failed on this rank after begin_call (its peers may have launched): raise the
// call's abort word so every rank's waits of this call give up instead of spinning until the
// timeout, close the call with a NaN output, and report `err` the way a kernel's timeout is
// reported (check_errors(), or the next fused call on every rank). It returns success to XLA on
// purpose: an error would stop this rank's program here while its peers' programs go on to
// their next fused calls, and the ranks' calls would pair up wrongly from then on.
inline ffi::Error fail_call(const char* kWhat, cudaStream_t xla_stream, DeviceRuntime* dev,
                            const Partition* part, Workspace* ws, int rank, uint32_t index,
                            const Output& out, const ffi::Error& err) {
  capture_mark("the start of fail_call");
  abort_call(ws, index);
  close_call(xla_stream, dev, part, ws, rank, &out);
  report_failure(err.message() + " (on device " + std::to_string(ws->ordinals[rank]) +
                 ", rank " + std::to_string(rank) + "; the call was given up on every rank of "
                 "its group and this rank's output filled with NaN)");
  return ffi::Error::Success();
}

// The parameters and arguments of bind_common_attrs' attributes (and the run id) followed by
// `w_colmajor`, for handlers with variants of different buffer lists that forward to one
// implementation (handlers/ag_gemm.cc, handlers/dgrad_rs_wgrad.cc).
#define JAXOVERLAP_GEMM_ATTR_PARAMS                                                           \
  int64_t site, ffi::Span<const int32_t> ordinals, ffi::Span<const int32_t> ranks,            \
      ffi::Span<const int32_t> groups, int64_t n, int64_t comm_sms, int64_t chunks,           \
      double timeout_s, int64_t stall_rank, int64_t profile, int64_t call_tag,                \
      ffi::RunId run_id, int64_t w_colmajor
#define JAXOVERLAP_GEMM_ATTR_ARGS                                                             \
  site, ordinals, ranks, groups, n, comm_sms, chunks, timeout_s, stall_rank, profile, call_tag, \
      run_id, w_colmajor

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
      .template Attr<int64_t>("profile")
      .template Attr<int64_t>("call_tag")  // with the run id: which logical call (call_order.h)
      .template Ctx<ffi::RunId>();
}

}  // namespace jaxoverlap
