// FFI handler of the fused GEMM + reduce-scatter with copy-engine pushes
// (jaxoverlap_gemm_rs_ce_v1; Config(comm_sms=0)): the schedule of handlers/gemm_rs.cc without an SM
// partition -- the GEMMs run on XLA's stream over the whole device, and the copy engine
// (cudaMemcpyAsync on the device's copy stream) moves the partials. For rank r of n:
//   XLA's stream: the GEMM computes the row blocks of ranks r+1, ..., r-1 chunk by chunk into
//     the partials buffer, recording an event per chunk; then, per chunk of its own block, a
//     bounded wait for every peer's partial of that chunk and the own GEMM with C = a peer's
//     partial (beta = 1: the reduction costs no extra pass; n > 2 adds the other peers' partials
//     in one sum pass), into the output.
//   copy stream: first a bounded wait per peer for its slot (released by its previous call),
//     then per chunk, once its event fired, the push into its owner's slot and the release of
//     the owner's arrival flag (kernels/ce.cu).
// Cross-GPU ordering by flags only, as in handlers/ag_gemm.cc.
#include <string>
#include <vector>

#include "handlers/fused_call.h"
#include "kernels/ce.h"
#include "kernels/comm.h"
#include "runtime/runtime.h"

namespace jaxoverlap {
namespace {

constexpr const char* kWhat = "jaxoverlap.matmul_reduce_scatter (fused, copy engine)";

// One event per (peer block, chunk) on this device, created once under the handler lock.
std::string chunk_events(DeviceRuntime* dev, int count) {
  while ((int)dev->chunk_done.size() < count) {
    cudaEvent_t e;
    if (cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming))
      return std::string("cudaEventCreate: ") + cudaGetErrorString(err);
    dev->chunk_done.push_back(e);
  }
  return "";
}

ffi::Error GemmRsCeImpl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer x,
                        ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                        JAXOVERLAP_GEMM_ATTR_PARAMS) {
  (void)comm_sms;  // the copy engine needs no SMs
  uint64_t timeout_ns = 0;
  if (std::string e = to_timeout_ns(timeout_s, &timeout_ns); !e.empty()) return invalid(kWhat, e);
  RowGemm g;
  if (std::string e = row_gemm(x, w, *out, n, chunks, /*gather=*/false, &g); !e.empty())
    return invalid(kWhat, e);
  const DType dtype = g.dtype;
  const int64_t K = g.K, N = g.N, m = g.m, mc = g.mc;
  const int64_t elt = 2;
  if ((int64_t)out->element_count() != m * N)
    return invalid(kWhat, "result size is not (rows / group size) x N");
  int rank = -1;
  std::vector<int> group;
  if (std::string e = find_group(device, ordinals, ranks, groups, n, &rank, &group); !e.empty())
    return invalid(kWhat, e);

  DeviceGuard guard;
  cudaSetDevice(device);
  DeviceRuntime* dev;
  Workspace* ws;
  const int64_t block_bytes = m * N * elt;  // one rank's block of the output = one slot
  const int64_t chunk_bytes = mc * N * elt;
  CaptureScope capture(xla_stream, kWhat);  // XLA may be capturing this call (capture.h)
  if (std::string e = device_runtime(device, &dev); !e.empty()) return internal(kWhat, e);
  std::lock_guard<std::mutex> hold(dev->launch_mu);
  if (std::string e = workspace(site, group, rank, block_bytes, true, &ws); !e.empty())
    return internal(kWhat, e);
  // From here on this call counts on every rank: a failure below gives it up on all of them.
  uint32_t index = 0;
  bool given_up = false;  // issued out of order (call_order.h): given up on every rank
  char* op = static_cast<char*>(out->untyped_data());
  const Output output{op, (int64_t)out->size_bytes(), dtype};
  if (ffi::Error e = begin_call(kWhat, xla_stream, dev, ws, rank, {run_id.run_id, call_tag},
                                output, &index, &given_up);
      e.failure() || given_up)
    return e;
  Partition streams;  // the join's view: GEMMs on XLA's stream, the pushes on `copy`
  streams.gemm = xla_stream;
  ffi::Error result = [&]() -> ffi::Error {
    ErrorRecord* err = nullptr;
    if (ffi::Error e = ce_call_start(kWhat, dev, device, rank, stall_rank, &streams, &err);
        e.failure())
      return e;
    if (std::string e = chunk_events(dev, (int)(n - 1) * (int)chunks); !e.empty())
      return internal(kWhat, e);
    const Peers& peers = ws->peers[rank];
    const char* xp = static_cast<const char*>(x.untyped_data());
    const void* wp = w.untyped_data();
    char* partials = ws->part[rank];
    if (GemmRunner::alignment(xp) < 2 || GemmRunner::alignment(wp) < 2 ||
        GemmRunner::alignment(op) < 16)
      return invalid(kWhat, "x and w must be aligned to their 2-byte elements, the result to "
                            "16 bytes (XLA's buffers are)");
    const GemmShape foreign{mc, N, K, dtype, false, /*sm_count=*/0, w_colmajor != 0};
    const GemmShape own{mc, N, K, dtype, true, /*sm_count=*/0, w_colmajor != 0};
    // The slot each source's partials land in on this rank; slot 0 is the own GEMM's C, the
    // others (n > 2) follow it contiguously and are summed in.
    char* slots = peers.stage[rank];

    // First call of this workspace on this device: drain the device, then load both GEMMs'
    // kernels with the real pointers' alignments (garbage into the partials and the output,
    // both overwritten below) and wait for them, before anything of this call can spin.
    if (warm_up_now(ws, rank)) {
      CK(cudaDeviceSynchronize());
      if (std::string e = dev->gemm.run(foreign, xp, wp, nullptr, partials, xla_stream);
          !e.empty())
        return internal(kWhat, e);
      if (std::string e = dev->gemm.run(own, xp, wp, slots, op, xla_stream); !e.empty())
        return internal(kWhat, e);
      CK(cudaStreamSynchronize(xla_stream));
      ws->warmed[rank] = true;
    }
    const bool communicate = profile != 1;  // tools only: the GEMM schedule alone
    if (ffi::Error e = fork_streams(kWhat, xla_stream, dev, &streams, /*gemm=*/false,
                                    ws->done[rank]);
        e.failure())
      return e;
    CK(wait_done(xla_stream, ws->done[rank]));
    for (int t = 0; communicate && t < n - 1; ++t)
      CK(launch_ce_wait_slot_free(peers, (rank + 1 + t) % (int)n, kOpGemmRs, timeout_ns, err,
                                  dev->copy));
    for (int t = 0; t < n - 1; ++t) {
      const int j = (rank + 1 + t) % (int)n;
      char* dst = peers.stage[j] + stage_slot(rank, j, (int)n) * block_bytes;
      for (int k = 0; k < chunks; ++k) {
        const char* a = xp + (j * m + k * mc) * K * elt;
        char* d = partials + t * block_bytes + k * chunk_bytes;
        if (std::string e = dev->gemm.run(foreign, a, wp, nullptr, d, xla_stream); !e.empty())
          return internal(kWhat, e);
        if (!communicate) continue;
        cudaEvent_t done = dev->chunk_done[t * chunks + k];
        CK(cudaEventRecord(done, xla_stream));
        CK(cudaStreamWaitEvent(dev->copy, done));
        CK(cudaMemcpyAsync(dst + k * chunk_bytes, d, chunk_bytes, cudaMemcpyDefault, dev->copy));
        CK(launch_ce_signal_arrival(peers, j, k, (int)stall_rank, dev->copy));
      }
    }
    for (int k = 0; k < chunks; ++k) {
      for (int t = 1; communicate && t < n; ++t)
        CK(launch_ce_wait_arrival(peers, (rank - t + (int)n) % (int)n, k, kOpGemmRs, timeout_ns,
                                  err, xla_stream));
      const char* a = xp + (rank * m + k * mc) * K * elt;
      char* d = op + k * chunk_bytes;
      if (std::string e = dev->gemm.run(own, a, wp, slots + k * chunk_bytes, d, xla_stream);
          !e.empty())
        return internal(kWhat, e);
      if (n > 2)
        CK(launch_sum_blocks(d, d, slots + block_bytes + k * chunk_bytes, (int)n - 2, m * N,
                             mc * N, dtype, dev->total_sms, xla_stream));
    }
    if (communicate) CK(launch_release_slots(peers, xla_stream));
    return join(kWhat, xla_stream, dev, &streams, /*gemm=*/false, ws, rank, output);
  }();
  if (result.failure())
    return fail_call(kWhat, xla_stream, dev, streams.comm ? &streams : nullptr, ws, rank, index,
                     output, result);
  return result;
}

}  // namespace
}  // namespace jaxoverlap

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapGemmRsCeV1, jaxoverlap::GemmRsCeImpl,
                              jaxoverlap::bind_common_attrs(
                                  xla::ffi::Ffi::Bind()
                                      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                      .Ctx<xla::ffi::DeviceOrdinal>()
                                      .Arg<xla::ffi::AnyBuffer>()   // x [..., K]
                                      .Arg<xla::ffi::AnyBuffer>()   // w [K, N]
                                      .Ret<xla::ffi::AnyBuffer>())  // out [rows / n, ..., N]
                                  .Attr<int64_t>("w_colmajor"));
