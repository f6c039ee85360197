// FFI handler of the standalone TMA reduce-scatter (jaxoverlap_rs_v1), used by the bandwidth
// benchmark: x [rows, ...] on each rank, result [rows / n, ...] = sum over ranks of block r, in
// rank order. n == 2: every comm CTA seeds its part of the own block into the staging slot and
// adds its part of the peer's block into the peer's slot with TMA bulk adds (reduce_push_kernel),
// then copies the finished slot out. n > 2: half of the comm partition's CTAs push blocks to their
// owners with TMA, the other half sum the arrived chunks in rank order.
#include <algorithm>
#include <string>
#include <vector>

#include "handlers/fused_call.h"
#include "kernels/comm.h"
#include "runtime/runtime.h"

namespace jaxoverlap {
namespace {

constexpr const char* kWhat = "jaxoverlap.tma_reduce_scatter";

ffi::Error RsImpl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer x,
                  ffi::Result<ffi::AnyBuffer> out, int64_t site, ffi::Span<const int32_t> ordinals,
                  ffi::Span<const int32_t> ranks, ffi::Span<const int32_t> groups, int64_t n,
                  int64_t comm_sms, int64_t chunks, double timeout_s, int64_t stall_rank,
                  int64_t profile, int64_t call_tag, ffi::RunId run_id) {
  uint64_t timeout_ns = 0;
  if (std::string e = to_timeout_ns(timeout_s, &timeout_ns); !e.empty()) return invalid(kWhat, e);
  DType dtype;
  if (!to_dtype(x.element_type(), &dtype) || out->element_type() != x.element_type())
    return invalid(kWhat, "x and the result must both be bfloat16 or both float16");
  const int64_t bytes = (int64_t)x.size_bytes();
  if (bytes % n || (int64_t)out->size_bytes() != bytes / n)
    return invalid(kWhat, "result must hold 1 / group size of x");
  const int64_t block_bytes = bytes / n;
  if (chunks < 1 || chunks > kMaxChunks || block_bytes % (16 * chunks))
    return invalid(kWhat, "each rank's block must split into `chunks` pieces of 16-byte multiples");
  if (comm_sms < 2) return invalid(kWhat, "comm_sms must be at least 2 (senders + receivers)");
  int rank = -1;
  std::vector<int> group;
  if (std::string e = find_group(device, ordinals, ranks, groups, n, &rank, &group); !e.empty())
    return invalid(kWhat, e);

  DeviceGuard guard;
  cudaSetDevice(device);
  DeviceRuntime* dev;
  Partition* part = nullptr;
  Workspace* ws;
  CaptureScope capture(xla_stream, kWhat);  // XLA may be capturing this call (capture.h)
  if (std::string e = device_runtime(device, &dev); !e.empty()) return internal(kWhat, e);
  std::lock_guard<std::mutex> hold(dev->launch_mu);
  if (std::string e = workspace(site, group, rank, block_bytes, false, &ws); !e.empty())
    return internal(kWhat, e);
  // From here on this call counts on every rank: a failure below gives it up on all of them.
  uint32_t index = 0;
  bool given_up = false;  // issued out of order (call_order.h): given up on every rank
  if (ffi::Error e = begin_call(kWhat, xla_stream, dev, ws, rank, {run_id.run_id, call_tag},
                                {out->untyped_data(), (int64_t)out->size_bytes(), dtype}, &index,
                                &given_up);
      e.failure() || given_up)
    return e;
  ffi::Error result = [&]() -> ffi::Error {
    if (std::string e = preload(dev); !e.empty()) return internal(kWhat, e);
    if (std::string e = partition(dev, (int)comm_sms, &part); !e.empty()) return internal(kWhat, e);
    if (stall_rank <= -2 && rank == -2 - stall_rank)  // test-only: fused._failed_rank_for_tests
      return internal(kWhat, "test-only failure injected on this rank after begin_call");
    ErrorRecord* err = error_record(device);
    if (!err) return internal(kWhat, "could not allocate the host-mapped error record");
    const Peers& peers = ws->peers[rank];
    const char* xp = static_cast<const char*>(x.untyped_data());
    // TMA bulk copies need 16-byte aligned addresses; XLA guarantees 16 bytes for every buffer,
    // so this never fires on one rank alone unless that guarantee is broken.
    if (reinterpret_cast<uintptr_t>(xp) % 16 ||
        reinterpret_cast<uintptr_t>(out->untyped_data()) % 16)
      return invalid(kWhat, "x and the result must be 16-byte aligned for TMA");

    CommArgs c{};
    c.peers = peers;
    c.src = xp;
    c.own = xp + rank * block_bytes;
    c.out = static_cast<char*>(out->untyped_data());
    c.block_bytes = block_bytes;
    c.chunks = (int)chunks;
    c.senders = (int)std::min<int64_t>(comm_sms / 2, kMaxSenders);
    // profile == 1 (tools only): pushes without the receive-side sum (result is garbage), to
    // measure the NVLink push alone on comm_sms / 2 CTAs.
    c.receivers = profile == 1 ? 0 : (int)std::min<int64_t>(comm_sms - comm_sms / 2, kMaxSenders);
    // n == 2: reduce-push on every comm CTA (the adds happen at the destination, no receivers);
    // profile == 2 (tools only) keeps the senders/receivers schedule for comparison. Both ranks
    // must run the same CTA count (CTA b pairs with the peer's CTA b): the granted partition size
    // is the same on identical devices.
    if (n == 2 && profile == 0) {
      c.reduce_push = 1;
      c.senders = (int)std::min<int64_t>(std::min<int64_t>(comm_sms, part->comm_sms), kMaxSenders);
      c.receivers = 0;
    }
    c.src_by_step = 0;
    c.wait_ready = 0;
    c.signal_reduced = 0;
    c.stall_rank = (int)stall_rank;
    c.op = kOpReduceScatter;
    c.timeout_ns = timeout_ns;
    c.err = err;
    c.dtype = dtype;

    if (ffi::Error e = fork_streams(kWhat, xla_stream, dev, part, /*gemm=*/false, ws->done[rank]);
        e.failure())
      return e;
    CK(launch_comm(c, part->comm));
    CK(launch_release_slots(peers, part->comm));
    return join(kWhat, xla_stream, dev, part, /*gemm=*/false, ws, rank,
                {c.out, (int64_t)out->size_bytes(), dtype});
  }();
  if (result.failure())
    return fail_call(kWhat, xla_stream, dev, part, ws, rank, index,
                     {out->untyped_data(), (int64_t)out->size_bytes(), dtype}, result);
  return result;
}

}  // namespace
}  // namespace jaxoverlap

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapRsV1, jaxoverlap::RsImpl,
                              jaxoverlap::bind_common_attrs(
                                  xla::ffi::Ffi::Bind()
                                      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                      .Ctx<xla::ffi::DeviceOrdinal>()
                                      .Arg<xla::ffi::AnyBuffer>()    // x [rows, ...]
                                      .Ret<xla::ffi::AnyBuffer>()));  // out [rows / n, ...]
