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

namespace jaxoverlap {
namespace {

constexpr const char* kWhat = "jaxoverlap.tma_reduce_scatter";

ffi::Error Rs(const Call& call, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  FusedCall fc(kWhat, kOpReduceScatter, call);
  if (ffi::Error e = fc.check(); e.failure()) return e;
  const int64_t n = call.attrs.n, comm_sms = call.attrs.comm_sms, chunks = call.attrs.chunks;
  DType dtype;
  if (!to_dtype(x.element_type(), &dtype) || out->element_type() != x.element_type())
    return fc.invalid("x and the result must both be bfloat16 or both float16");
  const int64_t bytes = (int64_t)x.size_bytes();
  if (bytes % n || (int64_t)out->size_bytes() != bytes / n)
    return fc.invalid("result must hold 1 / group size of x");
  const int64_t block_bytes = bytes / n;
  if (chunks < 1 || chunks > kMaxChunks || block_bytes % (16 * chunks))
    return fc.invalid("each rank's block must split into `chunks` pieces of 16-byte multiples");
  if (comm_sms < 2) return fc.invalid("comm_sms must be at least 2 (senders + receivers)");
  const Output output{out->untyped_data(), (int64_t)out->size_bytes(), dtype};
  return fc.run({block_bytes, false, false, FusedCall::kSmPartition}, output,
                [&](FusedCall& c) -> std::string {
    const int rank = c.rank();
    const Partition* part = c.streams();
    const int64_t profile = call.attrs.profile;
    const Peers& peers = c.peers();
    const char* xp = static_cast<const char*>(x.untyped_data());
    // TMA bulk copies need 16-byte aligned addresses; XLA guarantees 16 bytes for every buffer,
    // so this never fires on one rank alone unless that guarantee is broken.
    if (reinterpret_cast<uintptr_t>(xp) % 16 ||
        reinterpret_cast<uintptr_t>(out->untyped_data()) % 16)
      return "x and the result must be 16-byte aligned for TMA";

    CommArgs a{};
    a.peers = peers;
    a.src = xp;
    a.own = xp + rank * block_bytes;
    a.out = static_cast<char*>(out->untyped_data());
    a.block_bytes = block_bytes;
    a.chunks = (int)chunks;
    a.senders = (int)std::min<int64_t>(comm_sms / 2, kMaxSenders);
    // profile == 1 (tools only): pushes without the receive-side sum (result is garbage), to
    // measure the NVLink push alone on comm_sms / 2 CTAs.
    a.receivers = profile == 1 ? 0 : (int)std::min<int64_t>(comm_sms - comm_sms / 2, kMaxSenders);
    // n == 2: reduce-push on every comm CTA (the adds happen at the destination, no receivers);
    // profile == 2 (tools only) keeps the senders/receivers schedule for comparison. Both ranks
    // must run the same CTA count (CTA b pairs with the peer's CTA b): the granted partition size
    // is the same on identical devices.
    if (n == 2 && profile == 0) {
      a.reduce_push = 1;
      a.senders = (int)std::min<int64_t>(std::min<int64_t>(comm_sms, part->comm_sms), kMaxSenders);
      a.receivers = 0;
    }
    a.src_by_step = 0;
    a.wait_ready = 0;
    a.signal_reduced = 0;
    a.stall_rank = (int)call.attrs.stall_rank;
    a.op = kOpReduceScatter;
    a.timeout_ns = c.timeout_ns();
    a.err = c.err();
    a.dtype = dtype;

    if (std::string e = c.fork(/*gemm=*/false); !e.empty()) return e;
    CK(launch_comm(a, part->comm));
    CK(launch_release_slots(peers, part->comm));
    return c.join();
  });
}

}  // namespace
}  // namespace jaxoverlap

JAXOVERLAP_FUSED_TARGET(JaxoverlapRs, jaxoverlap::Rs,
                        .Arg<xla::ffi::AnyBuffer>()    // x [rows, ...]
                        .Ret<xla::ffi::AnyBuffer>());  // out [rows / n, ...]
