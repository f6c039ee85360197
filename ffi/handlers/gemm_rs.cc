// FFI handler of the fused GEMM + reduce-scatter (jaxoverlap_gemm_rs_v1) and of its all-reduce
// mode (jaxoverlap_gemm_ar_v1): decode, validate, fork onto the GEMM and comm green-context
// streams, launch, join back onto XLA's stream.
// Schedule for rank r of n ("decomposed", DESIGN.md section 5): the GEMM computes the row
// blocks of ranks r+1, ..., r-1 chunk by chunk into the partials buffer and signals each chunk;
// the comm kernel pushes each finished chunk to its owner's staging slot; last, the GEMM computes
// its own block chunk by chunk with C = the peers' contribution (beta = 1), so the reduction
// costs no extra pass. n > 2: the comm kernel's receivers first sum the peers' chunks in rank
// order. `w_colmajor`: w[K, N] is stored column-major (the transpose of a row-major [N, K]
// array, as in the backward's ct @ w.T), read as cuBLASLt's transposed operand. `x_colmajor`:
// x[rows, K] is stored column-major too (a row block is then a block of a taller column-major
// matrix: leading dimension `rows`) -- the reduce-scatter over the last dimension of x @ w, run
// as the transposed problem (out.T = w.T @ x.T; jaxoverlap/fused/last_dim.py).
// All-reduce (out[M, N], the whole sum on every rank): the own GEMM writes rank r's rows of the
// output; as each reduced chunk is done, the copy engine (the device's copy stream, no SMs)
// pushes it into every peer's second staging area (Workspace::gather) and releases the peer's
// Flags::gathered flag (kernels/ce.cu); after its comm kernel, the comm stream waits for each
// peer's reduced chunks and copies them from that area into the peer's rows of the output. Every
// rank holds the owners' rows verbatim: the ranks' outputs are bitwise equal. Both staging areas
// are released by one slot_free release, after the own GEMMs and the gather copies read them.
#include <algorithm>
#include <string>

#include "handlers/fused_call.h"
#include "kernels/comm.h"

namespace jaxoverlap {
namespace {

// jaxoverlap_gemm_rs_v1 (kAllReduce false) and jaxoverlap_gemm_ar_v1 (true).
template <bool kAllReduce>
ffi::Error GemmRs(const Call& call, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::Result<ffi::AnyBuffer> res, int64_t w_colmajor, int64_t x_colmajor) {
  constexpr bool all_reduce = kAllReduce;
  const char* kWhat = all_reduce ? "jaxoverlap.matmul_all_reduce (fused)"
                                 : "jaxoverlap.matmul_reduce_scatter (fused)";
  const int op_code = all_reduce ? kOpGemmAr : kOpGemmRs;
  ffi::AnyBuffer* out = &*res;
  FusedCall fc(kWhat, op_code, call);
  if (ffi::Error e = fc.check(); e.failure()) return e;
  const int64_t n = call.attrs.n, comm_sms = call.attrs.comm_sms, chunks = call.attrs.chunks;
  RowGemm g;
  if (std::string e = row_gemm(x, w, *out, n, chunks, /*gather=*/false, &g); !e.empty())
    return fc.invalid(e);
  const DType dtype = g.dtype;
  const int64_t K = g.K, N = g.N, M = g.rows, m = g.m, mc = g.mc;
  const int64_t elt = 2;
  if ((int64_t)out->element_count() != (all_reduce ? M : m) * N)
    return fc.invalid(all_reduce ? "result size is not rows x N"
                                 : "result size is not (rows / group size) x N");
  if (x_colmajor && (x.dimensions().size() != 2 || (mc * elt) % 256))
    return fc.invalid("column-major x must be 2-D with rows per chunk a multiple of 128 "
                      "(256-byte alignment of each chunk's first row)");
  const int64_t block_bytes = m * N * elt;
  const unsigned uses = FusedCall::kSmPartition | (all_reduce ? FusedCall::kCopyEngine : 0u);
  const Output output{out->untyped_data(), (int64_t)out->size_bytes(), dtype};
  return fc.run({block_bytes, true, all_reduce, uses}, output, [&](FusedCall& c) -> std::string {
    const int rank = c.rank();
    DeviceRuntime* dev = c.dev();
    Workspace* ws = c.ws();
    const Partition* part = c.streams();
    const Peers& peers = c.peers();
    Flags* local = peers.flags[rank];
    const char* xp = static_cast<const char*>(x.untyped_data());
    const void* wp = w.untyped_data();
    char* op = static_cast<char*>(out->untyped_data());
    char* own_rows = all_reduce ? op + rank * block_bytes : op;  // where the own GEMM writes
    const int64_t chunk_bytes = mc * N * elt;
    char* partials = ws->part[rank];
    const bool a_col = x_colmajor != 0;
    const int64_t lda = a_col ? M : 0;
    const GemmShape foreign{mc, N, K, dtype, false, part->gemm_sms, w_colmajor != 0, a_col, lda};
    const GemmShape own{mc, N, K, dtype, true, part->gemm_sms, w_colmajor != 0, a_col, lda};
    // Row r of x: r * K elements in, or r alone when x is column-major.
    const int64_t row_elems = a_col ? 1 : K;
    const int senders =
        n == 2 ? (int)std::min<int64_t>(comm_sms, kMaxSenders)
               : (int)std::max<int64_t>(1, std::min<int64_t>(comm_sms / 2, kMaxSenders));
    const int receivers = n == 2 ? 0 : (int)std::min<int64_t>(comm_sms - senders, kMaxSenders);
    const int64_t stall_rank = call.attrs.stall_rank;
    const uint64_t timeout_ns = c.timeout_ns();
    ErrorRecord* err = c.err();

    // Operand alignment: XLA guarantees 16 bytes for entry parameters, cuBLASLt's fast kernels
    // want 256. Each rank handles its own pointers (the GEMM plans are chosen for the alignment
    // found, gemm.cc), so a misaligned buffer on one rank never makes it bail out alone while its
    // peers launched. Chunk offsets are multiples of 256 bytes (checked above).
    if (GemmRunner::alignment(xp) < 2 || GemmRunner::alignment(wp) < 2 ||
        GemmRunner::alignment(op) < 2)
      return "an operand is not aligned to its 2-byte element";

    if (std::string e = c.fork(/*gemm=*/true); !e.empty()) return e;  // the all-reduce's copy too
    if (c.warm_up_now()) {
      // Load cuBLASLt's kernels (and pick the plans) before this call's spinning kernels are
      // launched, with the pointers' alignments of the real calls (plans depend on them): the
      // foreign GEMM as below, the own GEMM with C in our memory and D = the output (both are
      // overwritten below). On the GEMM stream after the fork, with that stream's cuBLASLt
      // workspace: ordered with every other GEMM of the stream.
      if (std::string e = dev->gemm.run(foreign, xp, wp, nullptr, partials, part->gemm); !e.empty())
        return e;
      if (std::string e = dev->gemm.run(own, xp, wp, partials, own_rows, part->gemm); !e.empty())
        return e;
      c.warmed();
    }

    // Producer first: every GEMM launch precedes the spinning comm kernel in host order.
    for (int t = 0; t < n - 1; ++t) {
      const int j = (rank + 1 + t) % (int)n;
      for (int k = 0; k < chunks; ++k) {
        const char* a = xp + (j * m + k * mc) * row_elems * elt;
        char* d = partials + t * block_bytes + k * mc * N * elt;
        if (std::string e = dev->gemm.run(foreign, a, wp, nullptr, d, part->gemm); !e.empty())
          return e;
        CK(launch_signal_ready(local, t * (int)chunks + k, part->gemm));
      }
    }
    CommArgs ca{};
    ca.peers = peers;
    ca.src = partials;
    ca.own = nullptr;
    ca.out = ws->acc[rank];
    ca.block_bytes = block_bytes;
    ca.chunks = (int)chunks;
    ca.senders = senders;
    ca.receivers = receivers;
    ca.src_by_step = 1;
    ca.wait_ready = 1;
    ca.signal_reduced = n > 2;
    ca.stall_rank = (int)stall_rank;
    ca.op = op_code;
    ca.timeout_ns = timeout_ns;
    ca.err = err;
    ca.dtype = dtype;
    // profile == 1 (tools only): the GEMM schedule alone, no communication -- what the GEMM costs
    // on its partition with this chunking; the result is garbage.
    const bool communicate = call.attrs.profile != 1;
    if (communicate) CK(launch_comm(ca, part->comm));
    const int peer = (rank + 1) % (int)n;  // n == 2: the only peer
    const bool gather = all_reduce && communicate;
    for (int k = 0; k < chunks; ++k) {
      if (communicate)
        CK(launch_wait_chunk(peers, k, n == 2 ? senders : receivers, n > 2, op_code, timeout_ns,
                             err, part->gemm));
      const char* cin = n == 2 ? peers.stage[rank] +
                                     stage_slot(peer, rank, (int)n) * block_bytes + k * chunk_bytes
                               : ws->acc[rank] + k * chunk_bytes;
      const char* a = xp + (rank * m + k * mc) * row_elems * elt;
      if (std::string e = dev->gemm.run(own, a, wp, cin, own_rows + k * chunk_bytes, part->gemm);
          !e.empty())
        return e;
      if (!gather) continue;
      // The reduced chunk k, pushed to every peer behind its GEMM (dev->gemm_done is re-recorded
      // per chunk: each wait below captures the record just before it). Peers in the order
      // r + 1, r + 2, ..., the order in which they wait for the sources (below).
      CK(cudaEventRecord(dev->gemm_done, part->gemm));
      CK(cudaStreamWaitEvent(dev->copy, dev->gemm_done));
      for (int t = 1; t < n; ++t) {
        const int j = (rank + t) % (int)n;
        if (k == 0) CK(launch_ce_wait_slot_free(peers, j, op_code, timeout_ns, err, dev->copy));
        char* dst = peers.gather[j] + stage_slot(rank, j, (int)n) * block_bytes + k * chunk_bytes;
        CK(cudaMemcpyAsync(dst, own_rows + k * chunk_bytes, chunk_bytes, cudaMemcpyDefault,
                           dev->copy));
        CK(launch_ce_signal_arrival(peers, j, k, (int)stall_rank, dev->copy, /*gathered=*/true));
      }
    }
    if (gather) {
      // The peers' reduced chunks into their rows of the output, on the comm stream behind the
      // comm kernel (which needs nothing of this, so no wait below can hold up a push a peer
      // waits for).
      for (int k = 0; k < chunks; ++k)
        for (int t = 1; t < n; ++t) {
          const int s = (rank - t + (int)n) % (int)n;
          CK(launch_ce_wait_arrival(peers, s, k, op_code, timeout_ns, err, part->comm,
                                    /*gathered=*/true));
          const char* src =
              peers.gather[rank] + stage_slot(s, rank, (int)n) * block_bytes + k * chunk_bytes;
          CK(cudaMemcpyAsync(op + s * block_bytes + k * chunk_bytes, src, chunk_bytes,
                             cudaMemcpyDefault, part->comm));
        }
      // Release the slots on the comm stream once the own GEMMs (the RS slots) and the copy
      // stream's pushes (joined here for the join below) are done too.
      CK(cudaEventRecord(dev->gemm_done, part->gemm));
      CK(cudaStreamWaitEvent(part->comm, dev->gemm_done));
      CK(cudaEventRecord(dev->comm_done, dev->copy));
      CK(cudaStreamWaitEvent(part->comm, dev->comm_done));
      CK(launch_release_slots(peers, part->comm));
    } else if (communicate) {
      CK(launch_release_slots(peers, part->gemm));
    }
    return c.join();
  });
}

}  // namespace
}  // namespace jaxoverlap

// Both targets: x [..., K], w [K, N] -> out ([rows / n, ..., N], or the sum [..., N]);
// w_colmajor, x_colmajor: w, x stored column-major.
JAXOVERLAP_FUSED_TARGET(JaxoverlapGemmRs, jaxoverlap::GemmRs<false>,
                        JAXOVERLAP_GEMM_BUFFERS.Attr<int64_t>("w_colmajor")
                            .Attr<int64_t>("x_colmajor"));
JAXOVERLAP_FUSED_TARGET(JaxoverlapGemmAr, jaxoverlap::GemmRs<true>,
                        JAXOVERLAP_GEMM_BUFFERS.Attr<int64_t>("w_colmajor")
                            .Attr<int64_t>("x_colmajor"));
