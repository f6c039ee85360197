// What the FFI handlers share: FusedCall -- the skeleton of fused_call_skeleton.h over the CUDA
// runtime (CudaRuntime below) --, the attributes every fused target binds and how they reach the
// handler (Call, JAXOVERLAP_FUSED_TARGET), dtype mapping and the row GEMM's checks, and CK.
// Host code only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "handlers/fused_call_skeleton.h"
#include "kernels/ce.h"
#include "kernels/comm.h"
#include "kernels/tile_rs.h"
#include "runtime/memops.h"
#include "runtime/runtime.h"
#include "xla/ffi/api/ffi.h"

static_assert(XLA_FFI_API_MAJOR == 0 && XLA_FFI_API_MINOR == 4,
              "jaxoverlap must be built against the jaxlib 0.11.2 XLA FFI headers (API 0.4): "
              "handlers built against newer headers are rejected by jaxlib 0.11.x");

namespace jaxoverlap {
namespace ffi = xla::ffi;

// CK(call), in a schedule or in what it calls (anything returning "" or what failed): returns the
// failed CUDA call and its error; under XLA's graph capture, also a call that invalidated it.
// FusedCall adds the op's name.
#define CK(call)                                                              \
  do {                                                                        \
    if (cudaError_t ce = (call); ce != cudaSuccess)                           \
      return std::string(#call) + ": " + cudaGetErrorString(ce);              \
    if (std::string lost = capture_lost(#call); !lost.empty()) return lost; \
  } while (0)

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

// The outputs a call poisons with NaN when one of its waits gave up (the second one optional:
// the gathered x of all_gather_matmul's variant that returns it, dW of the backward).
struct Output {
  void* data;
  int64_t bytes;
  DType dtype;
  void* data2 = nullptr;
  int64_t bytes2 = 0;
};

// Loads a device's kernels once (`*loaded`): a module loaded lazily while a kernel of ours spins
// could wait for it, and a spinning consumer for a producer not loaded yet (DESIGN.md decision 5).
inline std::string load_once(bool* loaded, const char* what, cudaError_t (*load)()) {
  if (*loaded) return "";
  return outside_capture(what, [=]() -> std::string {
    if (cudaError_t e = load()) return std::string(what) + " failed: " + cudaGetErrorString(e);
    *loaded = true;
    return "";
  });
}

// Our communication kernels (every call: release, finish).
inline std::string preload(DeviceRuntime* dev) {
  return load_once(&dev->kernels_loaded, "loading the communication kernels",
                   preload_comm_kernels);
}

// For the handlers whose pushes ride on the copy engine, once per device, under the device's
// handler lock: the copy-engine protocol kernels and the copy stream (highest priority, so its
// one-thread kernels -- slot-free waits, the all-reduce's signals -- are scheduled ahead of
// queued GEMM blocks; its other signals need no SM, kernels/ce.h).
inline std::string ce_setup(DeviceRuntime* dev) {
  memop_caps(dev->ordinal);  // kept for the diagnostics (runtime/memops.h; no allocation)
  if (std::string e = load_once(&dev->ce_kernels_loaded, "loading the copy-engine kernels",
                                preload_ce_kernels);
      !e.empty() || dev->copy)
    return e;
  return outside_capture("creating the copy stream", [dev]() -> std::string {
    int least = 0, greatest = 0;
    cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (cudaError_t e = cudaStreamCreateWithPriority(&dev->copy, cudaStreamNonBlocking, greatest))
      return std::string("creating the copy stream failed: ") + cudaGetErrorString(e);
    return "";
  });
}

// Ends a call that launches nothing more on this rank but must still count as one call of `ws`
// (epochs stay equal on every rank): after whatever it launched, release the staging slots this
// rank would have consumed and advance the epoch (filling `poison` with NaN first, if given), on
// XLA's stream. Best effort: errors of these CUDA calls are ignored.
inline void close_call(cudaStream_t xla_stream, DeviceRuntime* dev, const Partition* part,
                       Workspace* ws, int rank, const Output* poison) {
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
  if (poison)  // given up: the abort word of the device's epoch too (comm.h)
    launch_finish_poison(local, poison->data, poison->bytes, poison->dtype, xla_stream, true,
                         poison->data2, poison->bytes2, nullptr, -1, -1, ws->abort);
  else
    launch_finish(local, xla_stream);
  record_done(ws->done[rank], xla_stream);
  cudaGetLastError();
}

// What FusedCall runs on (the list a fake runtime provides too: tests/native/fused_call_test.cc).
struct CudaRuntime {
  using Error = ffi::Error;
  using Stream = cudaStream_t;
  using Span = ffi::Span<const int32_t>;
  using Device = DeviceRuntime;
  using Workspace = jaxoverlap::Workspace;
  using Partition = jaxoverlap::Partition;
  using ErrorRecord = jaxoverlap::ErrorRecord;
  using Output = jaxoverlap::Output;
  using DeviceGuard = jaxoverlap::DeviceGuard;
  using CaptureScope = jaxoverlap::CaptureScope;
  using Mutex = std::mutex;
  static constexpr int kMaxRanks = jaxoverlap::kMaxRanks;

  static Error success() { return Error::Success(); }
  static Error invalid(const char* what, const std::string& msg) {
    return Error(ffi::ErrorCode::kInvalidArgument, std::string(what) + ": " + msg);
  }
  static Error internal(const char* what, const std::string& msg) {
    return Error(ffi::ErrorCode::kInternal, std::string(what) + ": " + msg);
  }
  static Error aborted(const char* what, const std::string& msg) {
    return Error(ffi::ErrorCode::kAborted, std::string(what) + ": " + msg);
  }

  static std::string set_device(int device) {
    if (cudaError_t e = cudaSetDevice(device))
      return "cudaSetDevice(" + std::to_string(device) + ") failed: " + cudaGetErrorString(e);
    return "";
  }
  static std::string device_runtime(int device, Device** out) {
    return jaxoverlap::device_runtime(device, out);
  }
  static Mutex& launch_mutex(Device* dev) { return dev->launch_mu; }
  static std::string workspace(int64_t site, const std::vector<int>& group, int rank,
                               int64_t block_bytes, bool partials, bool gather, bool exact,
                               Workspace** out) {
    return jaxoverlap::workspace(site, group, rank, block_bytes, partials, out, gather, exact);
  }
  static uint32_t begin_call(Workspace* ws, int rank, int64_t run, int64_t tag,
                             std::string* refused, bool* misordered) {
    const uint32_t index =
        jaxoverlap::begin_call(ws, rank, CallId{run, tag, under_capture()}, refused, misordered);
    capture_mark("begin_call");
    return index;
  }
  static void close_call(Stream s, Device* dev, const Partition* part, Workspace* ws, int rank,
                         const Output* poison) {
    jaxoverlap::close_call(s, dev, part, ws, rank, poison);
  }
  // A call that failed on this rank after begin_call (its peers may have launched): raise the
  // call's abort word so every rank's waits of this call give up instead of spinning until the
  // timeout, close the call with a NaN output, and report `msg` the way a kernel's timeout is
  // reported (check_errors(), or the next fused call on every rank). FusedCall then returns
  // success to XLA on purpose: an error would stop this rank's program here while its peers'
  // programs go on to their next fused calls, and the ranks' calls would pair up wrongly.
  static void fail_call(Stream s, Device* dev, const Partition* part, Workspace* ws, int rank,
                        uint32_t index, const Output& out, const std::string& msg) {
    capture_mark("the start of fail_call");
    abort_call(ws, index);
    jaxoverlap::close_call(s, dev, part, ws, rank, &out);
    report_failure(msg + " (on device " + std::to_string(ws->ordinals[rank]) + ", rank " +
                   std::to_string(rank) + "; the call was given up on every rank of its group "
                   "and this rank's output filled with NaN)");
  }
  // The all-reduce's copy stream, beside its partition, joined into the comm stream (which
  // close_call joins) when the call fails.
  static void join_copy(Device* dev, const Partition* part) {
    if (!dev->copy) return;
    cudaEventRecord(dev->comm_done, dev->copy);
    cudaStreamWaitEvent(part->comm, dev->comm_done);
  }
  static std::string preload(Device* dev) { return jaxoverlap::preload(dev); }
  static std::string ce_setup(Device* dev) { return jaxoverlap::ce_setup(dev); }
  static Stream copy_stream(Device* dev) { return dev->copy; }
  static std::string partition(Device* dev, int comm_sms, Partition** out) {
    return jaxoverlap::partition(dev, comm_sms, out);
  }
  static ErrorRecord* error_record(int device) { return jaxoverlap::error_record(device); }
  static void mark(const char* where) { capture_mark(where); }

  // Whether a workspace's first call on this device runs its warm-up: drain the device, run the
  // call's GEMMs once on its own buffers (planning them, loading their kernels) and wait, so that
  // no kernel of ours spins while a kernel loads. Not while XLA captures the call: nothing of it
  // runs then, and writing the buffers would race with XLA's work still in flight on them; the
  // GEMMs plan and load themselves on scratch operands instead (gemm.h), and the warm-up stays
  // due for the first uncaptured call.
  // Per site (the call's op and shapes): a workspace shared by size class serves other shapes,
  // whose GEMM kernels its earlier warm-ups did not load.
  static bool warm_up_now(const Workspace* ws, int rank) {
    return !ws->warmed[rank].count(ws->site_now[rank]) && !under_capture();
  }
  static void warmed(Workspace* ws, int rank) { ws->warmed[rank].insert(ws->site_now[rank]); }

  // The fork: the green-context streams the call launches on (the GEMM stream only if `gemm`)
  // wait for XLA's stream and for the previous call of the same workspace on this device
  // (`done`, recorded by join): calls of one workspace never overlap on a device, even when they
  // come from different XLA streams. With the partition, the all-reduce's copy stream too;
  // without it, XLA's stream (GEMMs, or the tile kernel) waits for that previous call.
  static std::string fork(Stream s, Device* dev, const Partition* part, bool gemm, unsigned uses,
                          Workspace* ws, int rank) {
    using FC = BasicFusedCall<CudaRuntime>;
    cudaEvent_t done = ws->done[rank];
    if (part) {
      CK(cudaEventRecord(dev->fork, s));
      for (cudaStream_t p : {part->gemm, part->comm}) {
        if (p == part->gemm && !gemm) continue;
        CK(cudaStreamWaitEvent(p, dev->fork));
        CK(wait_done(p, done));
      }
    }
    if ((uses & FC::kSmPartition) && (uses & FC::kCopyEngine)) {
      CK(cudaStreamWaitEvent(dev->copy, dev->fork));
      CK(wait_done(dev->copy, done));
    }
    if (!(uses & FC::kSmPartition)) CK(wait_done(s, done));
    return "";
  }
  // The join: records the done events on the streams the call forked (the GEMM stream only if
  // `gemm`), makes XLA's stream wait for them, runs the finish kernel on XLA's stream (NaN into
  // the outputs if a wait of this rank gave up; epoch + 1) and records the workspace's done
  // event after it.
  // `op` (OpCode): the call's op, named by the report of a peer's give-up (the error record).
  // `finished`: the call's kernel ran the finish itself (the tile kernel's last CTA): only the
  // done event.
  static std::string join(Stream s, Device* dev, const Partition* part, bool gemm, Workspace* ws,
                          int rank, const Output& out, int op, bool finished) {
    if (part) {
      if (gemm) CK(cudaEventRecord(dev->gemm_done, part->gemm));
      CK(cudaEventRecord(dev->comm_done, part->comm));
      if (gemm) CK(cudaStreamWaitEvent(s, dev->gemm_done));
      CK(cudaStreamWaitEvent(s, dev->comm_done));
    }
    ErrorRecord* err = ws->spans ? error_record(ws->ordinals[rank]) : nullptr;
    if (!finished) {
      CK(launch_finish_poison(ws->peers[rank].flags[rank], out.data, out.bytes, out.dtype, s,
                              false, out.data2, out.bytes2, err, ws->ordinals[rank], rank, nullptr,
                              op));
    }
    CK(record_done(ws->done[rank], s));
    return "";
  }
};

using FusedCall = BasicFusedCall<CudaRuntime>;
using Call = FusedCall::Call;

// The attributes every fused target takes after its own (the lowering, jaxoverlap/fused/call.py,
// sends them by name; XLA matches attributes by name, so their place in the binding is free).
// Production targets (_v3, _v2) bind these only; the test- and tool-only knobs (D17) `stall_rank`
// and `profile` are bound by their `_knobs` twins (_v3_knobs, _v2_knobs) and by every _v1 target.
template <bool kKnobs, typename Binding>
auto bind_common_attrs(Binding&& binding) {
  auto common = std::move(binding)
                    .template Attr<int64_t>("site")
                    .template Attr<ffi::Span<const int32_t>>("ordinals")
                    .template Attr<ffi::Span<const int32_t>>("ranks")
                    .template Attr<ffi::Span<const int32_t>>("groups")
                    .template Attr<int64_t>("n")
                    .template Attr<int64_t>("comm_sms")
                    .template Attr<int64_t>("chunks")
                    .template Attr<double>("timeout_s")
                    // with the run id: which logical call (call_order.h)
                    .template Attr<int64_t>("call_tag");
  if constexpr (kKnobs)
    return std::move(common)
        .template Attr<int64_t>("stall_rank")
        .template Attr<int64_t>("profile")
        .template Ctx<ffi::RunId>();
  else
    return std::move(common).template Ctx<ffi::RunId>();
}

// The entries XLA calls for a handler `ffi::Error Impl(const Call&, buffers..., own
// attributes...)`: XLA's stream and device, Impl's arguments, (_v2: the order token in and out,
// bound after Impl's buffers, so each is the call's last operand and last result), then the common
// attributes and the run id, which they hand on as one Call. Two bindings of the attributes
// (`knobs`: with the knobs, the _v1 = _v3_knobs ABI; `plain`: without, _v3), each also behind the
// token (_v2_knobs, _v2). Production calls (_v3, _v2) carry no test-only knob: Impl sees their
// neutral values (stall_rank -1, profile 0).
template <auto Impl>
struct Entry;
template <typename... T, ffi::Error (*Impl)(const Call&, T...)>
struct Entry<Impl> {
  // No token; the knobs as attributes: _v1 (kept for programs compiled against it) and _v3_knobs.
  static ffi::Error knobs(cudaStream_t stream, int32_t device, T... args, int64_t site,
                          ffi::Span<const int32_t> ordinals, ffi::Span<const int32_t> ranks,
                          ffi::Span<const int32_t> groups, int64_t n, int64_t comm_sms,
                          int64_t chunks, double timeout_s, int64_t call_tag, int64_t stall_rank,
                          int64_t profile, ffi::RunId run_id) {
    return Impl(Call{stream, device,
                     {site, ordinals, ranks, groups, n, comm_sms, chunks, timeout_s, stall_rank,
                      profile, call_tag, run_id.run_id}},
                std::move(args)...);
  }
  // No token, no knob: _v3, the lowering's production target.
  static ffi::Error plain(cudaStream_t stream, int32_t device, T... args, int64_t site,
                          ffi::Span<const int32_t> ordinals, ffi::Span<const int32_t> ranks,
                          ffi::Span<const int32_t> groups, int64_t n, int64_t comm_sms,
                          int64_t chunks, double timeout_s, int64_t call_tag,
                          ffi::RunId run_id) {
    return knobs(stream, device, std::move(args)..., site, ordinals, ranks, groups, n, comm_sms,
                 chunks, timeout_s, call_tag, /*stall_rank=*/-1, /*profile=*/0, run_id);
  }
  // The order token in and out (_v2; the token form, jaxoverlap/fused/call.py ORDER_FORM).
  static ffi::Error v2(cudaStream_t stream, int32_t device, T... args, ffi::Token,
                       ffi::Result<ffi::Token>, int64_t site, ffi::Span<const int32_t> ordinals,
                       ffi::Span<const int32_t> ranks, ffi::Span<const int32_t> groups,
                       int64_t n, int64_t comm_sms, int64_t chunks, double timeout_s,
                       int64_t call_tag, ffi::RunId run_id) {
    return plain(stream, device, std::move(args)..., site, ordinals, ranks, groups, n, comm_sms,
                 chunks, timeout_s, call_tag, run_id);
  }
  static ffi::Error v2_knobs(cudaStream_t stream, int32_t device, T... args, ffi::Token,
                             ffi::Result<ffi::Token>, int64_t site,
                             ffi::Span<const int32_t> ordinals, ffi::Span<const int32_t> ranks,
                             ffi::Span<const int32_t> groups, int64_t n, int64_t comm_sms,
                             int64_t chunks, double timeout_s, int64_t call_tag,
                             int64_t stall_rank, int64_t profile, ffi::RunId run_id) {
    return knobs(stream, device, std::move(args)..., site, ordinals, ranks, groups, n, comm_sms,
                 chunks, timeout_s, call_tag, stall_rank, profile, run_id);
  }
};

}  // namespace jaxoverlap

// The stream and device every fused target gets first.
#define JAXOVERLAP_FFI_PRELUDE                                         \
  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>() \
      .Ctx<xla::ffi::DeviceOrdinal>()
// Defines the four FFI symbols of handler `impl`, whose buffers and own attributes are bound by the
// binding steps `...` (.Arg<>(), .Ret<>(), .Attr<>()): `name`Knobs (no token, the knobs), `name`V3
// (no token, no knob), `name`V2 (the token, no knob) and `name`V2Knobs (the token, the knobs).
// registry.cc names them: `name`Knobs is jaxoverlap_..._v1 and jaxoverlap_..._v3_knobs (one ABI),
// `name`V3 jaxoverlap_..._v3, `name`V2 jaxoverlap_..._v2, `name`V2Knobs jaxoverlap_..._v2_knobs.
#define JAXOVERLAP_FUSED_TARGET(name, impl, ...)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                             \
      name##Knobs, jaxoverlap::Entry<impl>::knobs,                                           \
      jaxoverlap::bind_common_attrs<true>(JAXOVERLAP_FFI_PRELUDE __VA_ARGS__));              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                             \
      name##V3, jaxoverlap::Entry<impl>::plain,                                              \
      jaxoverlap::bind_common_attrs<false>(JAXOVERLAP_FFI_PRELUDE __VA_ARGS__));             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                             \
      name##V2, jaxoverlap::Entry<impl>::v2,                                                 \
      jaxoverlap::bind_common_attrs<false>(JAXOVERLAP_FFI_PRELUDE __VA_ARGS__                \
                                               .Arg<xla::ffi::Token>()                       \
                                               .Ret<xla::ffi::Token>()));                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                             \
      name##V2Knobs, jaxoverlap::Entry<impl>::v2_knobs,                                      \
      jaxoverlap::bind_common_attrs<true>(JAXOVERLAP_FFI_PRELUDE __VA_ARGS__                 \
                                              .Arg<xla::ffi::Token>()                        \
                                              .Ret<xla::ffi::Token>()))

// The buffers of the fused GEMMs over rows: x [..., K], w [K, N] -> out (then the variant's own).
#define JAXOVERLAP_GEMM_BUFFERS \
  .Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Ret<xla::ffi::AnyBuffer>()
