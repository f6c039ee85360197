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

#include "handlers/fused_call.h"
#include "kernels/ce.h"
#include "kernels/comm.h"

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

ffi::Error GemmRsCe(const Call& call, ffi::AnyBuffer x, ffi::AnyBuffer w,
                    ffi::Result<ffi::AnyBuffer> out, int64_t w_colmajor) {
  FusedCall fc(kWhat, kOpGemmRs, call);  // comm_sms unused: the copy engine needs no SMs
  if (ffi::Error e = fc.check(); e.failure()) return e;
  const int64_t n = call.attrs.n, chunks = call.attrs.chunks;
  RowGemm g;
  if (std::string e = row_gemm(x, w, *out, n, chunks, /*gather=*/false, &g); !e.empty())
    return fc.invalid(e);
  const DType dtype = g.dtype;
  const int64_t K = g.K, N = g.N, m = g.m, mc = g.mc;
  const int64_t elt = 2;
  if ((int64_t)out->element_count() != m * N)
    return fc.invalid("result size is not (rows / group size) x N");
  const int64_t block_bytes = m * N * elt;  // one rank's block of the output = one slot
  const int64_t chunk_bytes = mc * N * elt;
  char* op = static_cast<char*>(out->untyped_data());
  const Output output{op, (int64_t)out->size_bytes(), dtype};
  return fc.run({block_bytes, true, false, FusedCall::kCopyEngine}, output,
                [&](FusedCall& c) -> std::string {
    const int rank = c.rank();
    DeviceRuntime* dev = c.dev();
    Workspace* ws = c.ws();
    cudaStream_t xla_stream = c.stream();
    const uint64_t timeout_ns = c.timeout_ns();
    ErrorRecord* err = c.err();
    const int stall_rank = (int)call.attrs.stall_rank;
    if (std::string e = chunk_events(dev, (int)(n - 1) * (int)chunks); !e.empty()) return e;
    const Peers& peers = c.peers();
    const char* xp = static_cast<const char*>(x.untyped_data());
    const void* wp = w.untyped_data();
    char* partials = ws->part[rank];
    if (GemmRunner::alignment(xp) < 2 || GemmRunner::alignment(wp) < 2 ||
        GemmRunner::alignment(op) < 16)
      return "x and w must be aligned to their 2-byte elements, the result to 16 bytes (XLA's "
             "buffers are)";
    const GemmShape foreign{mc, N, K, dtype, false, /*sm_count=*/0, w_colmajor != 0};
    const GemmShape own{mc, N, K, dtype, true, /*sm_count=*/0, w_colmajor != 0};
    // The slot each source's partials land in on this rank; slot 0 is the own GEMM's C, the
    // others (n > 2) follow it contiguously and are summed in.
    char* slots = peers.stage[rank];

    // First call of this workspace on this device: drain the device, then load both GEMMs'
    // kernels with the real pointers' alignments (garbage into the partials and the output,
    // both overwritten below) and wait for them, before anything of this call can spin.
    if (c.warm_up_now()) {
      CK(cudaDeviceSynchronize());
      if (std::string e = dev->gemm.run(foreign, xp, wp, nullptr, partials, xla_stream);
          !e.empty())
        return e;
      if (std::string e = dev->gemm.run(own, xp, wp, slots, op, xla_stream); !e.empty()) return e;
      CK(cudaStreamSynchronize(xla_stream));
      c.warmed();
    }
    const bool communicate = call.attrs.profile != 1;  // tools only: the GEMM schedule alone
    if (std::string e = c.fork(/*gemm=*/false); !e.empty()) return e;
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
          return e;
        if (!communicate) continue;
        cudaEvent_t done = dev->chunk_done[t * chunks + k];
        CK(cudaEventRecord(done, xla_stream));
        CK(cudaStreamWaitEvent(dev->copy, done));
        CK(cudaMemcpyAsync(dst + k * chunk_bytes, d, chunk_bytes, cudaMemcpyDefault, dev->copy));
        CK(launch_ce_signal_arrival(peers, j, k, stall_rank, dev->copy));
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
        return e;
      if (n > 2)
        CK(launch_sum_blocks(d, d, slots + block_bytes + k * chunk_bytes, (int)n - 2, m * N,
                             mc * N, dtype, dev->total_sms, xla_stream));
    }
    if (communicate) CK(launch_release_slots(peers, xla_stream));
    return c.join();
  });
}

}  // namespace
}  // namespace jaxoverlap

// x [..., K], w [K, N] -> out [rows / n, ..., N]; w_colmajor: w stored column-major.
JAXOVERLAP_FUSED_TARGET(JaxoverlapGemmRsCe, jaxoverlap::GemmRsCe,
                        JAXOVERLAP_GEMM_BUFFERS.Attr<int64_t>("w_colmajor"));
