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
// as the transposed problem (out.T = w.T @ x.T; jaxoverlap/fused_cols.py).
// All-reduce (out[M, N], the whole sum on every rank): the own GEMM writes rank r's rows of the
// output; as each reduced chunk is done, the copy engine (the device's copy stream, no SMs)
// pushes it into every peer's second staging area (Workspace::gather) and releases the peer's
// Flags::gathered flag (kernels/ce.cu); after its comm kernel, the comm stream waits for each
// peer's reduced chunks and copies them from that area into the peer's rows of the output. Every
// rank holds the owners' rows verbatim: the ranks' outputs are bitwise equal. Both staging areas
// are released by one slot_free release, after the own GEMMs and the gather copies read them.
#include <string>
#include <vector>

#include "handlers/fused_call.h"
#include "kernels/comm.h"
#include "runtime/runtime.h"

namespace jaxoverlap {
namespace {

ffi::Error GemmRs(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                  ffi::AnyBuffer* out, bool all_reduce, int64_t site,
                  ffi::Span<const int32_t> ordinals, ffi::Span<const int32_t> ranks,
                  ffi::Span<const int32_t> groups, int64_t n, int64_t comm_sms, int64_t chunks,
                  double timeout_s, int64_t stall_rank, int64_t profile, int64_t call_tag,
                  ffi::RunId run_id, int64_t w_colmajor, int64_t x_colmajor) {
  const char* kWhat = all_reduce ? "jaxoverlap.matmul_all_reduce (fused)"
                                 : "jaxoverlap.matmul_reduce_scatter (fused)";
  const int op_code = all_reduce ? kOpGemmAr : kOpGemmRs;
  uint64_t timeout_ns = 0;
  if (std::string e = to_timeout_ns(timeout_s, &timeout_ns); !e.empty()) return invalid(kWhat, e);
  RowGemm g;
  if (std::string e = row_gemm(x, w, *out, n, chunks, /*gather=*/false, &g); !e.empty())
    return invalid(kWhat, e);
  const DType dtype = g.dtype;
  const int64_t K = g.K, N = g.N, M = g.rows, m = g.m, mc = g.mc;
  const int64_t elt = 2;
  if ((int64_t)out->element_count() != (all_reduce ? M : m) * N)
    return invalid(kWhat, all_reduce ? "result size is not rows x N"
                                     : "result size is not (rows / group size) x N");
  if (x_colmajor && (x.dimensions().size() != 2 || (mc * elt) % 256))
    return invalid(kWhat, "column-major x must be 2-D with rows per chunk a multiple of 128 "
                          "(256-byte alignment of each chunk's first row)");
  int rank = -1;
  std::vector<int> group;
  if (std::string e = find_group(device, ordinals, ranks, groups, n, &rank, &group); !e.empty())
    return invalid(kWhat, e);

  DeviceGuard guard;
  cudaSetDevice(device);
  DeviceRuntime* dev;
  Partition* part = nullptr;
  Workspace* ws;
  const int64_t block_bytes = m * N * elt;
  CaptureScope capture(xla_stream, kWhat);  // XLA may be capturing this call (capture.h)
  if (std::string e = device_runtime(device, &dev); !e.empty()) return internal(kWhat, e);
  std::lock_guard<std::mutex> hold(dev->launch_mu);
  if (std::string e = workspace(site, group, rank, block_bytes, true, &ws, all_reduce);
      !e.empty())
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
    if (std::string e = all_reduce ? ce_setup(dev) : ""; !e.empty()) return internal(kWhat, e);
    if (std::string e = partition(dev, (int)comm_sms, &part); !e.empty()) return internal(kWhat, e);
    if (stall_rank <= -2 && rank == -2 - stall_rank)  // test-only: fused._failed_rank_for_tests
      return internal(kWhat, "test-only failure injected on this rank after begin_call");
    ErrorRecord* err = error_record(device);
    if (!err) return internal(kWhat, "could not allocate the host-mapped error record");
    const Peers& peers = ws->peers[rank];
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

    // Operand alignment: XLA guarantees 16 bytes for entry parameters, cuBLASLt's fast kernels
    // want 256. Each rank handles its own pointers (the GEMM plans are chosen for the alignment
    // found, gemm.cc), so a misaligned buffer on one rank never makes it bail out alone while its
    // peers launched. Chunk offsets are multiples of 256 bytes (checked above).
    if (GemmRunner::alignment(xp) < 2 || GemmRunner::alignment(wp) < 2 ||
        GemmRunner::alignment(op) < 2)
      return invalid(kWhat, "an operand is not aligned to its 2-byte element");

    if (ffi::Error e = fork_streams(kWhat, xla_stream, dev, part, /*gemm=*/true, ws->done[rank]);
        e.failure())
      return e;
    if (all_reduce) {  // the copy stream too (fork_streams recorded dev->fork)
      CK(cudaStreamWaitEvent(dev->copy, dev->fork));
      CK(wait_done(dev->copy, ws->done[rank]));
    }
    if (warm_up_now(ws, rank)) {
      // Load cuBLASLt's kernels (and pick the plans) before this call's spinning kernels are
      // launched, with the pointers' alignments of the real calls (plans depend on them): the
      // foreign GEMM as below, the own GEMM with C in our memory and D = the output (both are
      // overwritten below). On the GEMM stream after the fork, with that stream's cuBLASLt
      // workspace: ordered with every other GEMM of the stream.
      if (std::string e = dev->gemm.run(foreign, xp, wp, nullptr, partials, part->gemm); !e.empty())
        return internal(kWhat, e);
      if (std::string e = dev->gemm.run(own, xp, wp, partials, own_rows, part->gemm); !e.empty())
        return internal(kWhat, e);
      ws->warmed[rank] = true;
    }

    // Producer first: every GEMM launch precedes the spinning comm kernel in host order.
    for (int t = 0; t < n - 1; ++t) {
      const int j = (rank + 1 + t) % (int)n;
      for (int k = 0; k < chunks; ++k) {
        const char* a = xp + (j * m + k * mc) * row_elems * elt;
        char* d = partials + t * block_bytes + k * mc * N * elt;
        if (std::string e = dev->gemm.run(foreign, a, wp, nullptr, d, part->gemm); !e.empty())
          return internal(kWhat, e);
        CK(launch_signal_ready(local, t * (int)chunks + k, part->gemm));
      }
    }
    CommArgs c{};
    c.peers = peers;
    c.src = partials;
    c.own = nullptr;
    c.out = ws->acc[rank];
    c.block_bytes = block_bytes;
    c.chunks = (int)chunks;
    c.senders = senders;
    c.receivers = receivers;
    c.src_by_step = 1;
    c.wait_ready = 1;
    c.signal_reduced = n > 2;
    c.stall_rank = (int)stall_rank;
    c.op = op_code;
    c.timeout_ns = timeout_ns;
    c.err = err;
    c.dtype = dtype;
    // profile == 1 (tools only): the GEMM schedule alone, no communication -- what the GEMM costs
    // on its partition with this chunking; the result is garbage.
    const bool communicate = profile != 1;
    if (communicate) CK(launch_comm(c, part->comm));
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
        return internal(kWhat, e);
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
    return join(kWhat, xla_stream, dev, part, /*gemm=*/true, ws, rank,
                {op, (int64_t)out->size_bytes(), dtype});
  }();
  if (result.failure()) {
    if (all_reduce && part && dev->copy) {  // close_call joins the comm stream: the copy's too
      cudaEventRecord(dev->comm_done, dev->copy);
      cudaStreamWaitEvent(part->comm, dev->comm_done);
    }
    return fail_call(kWhat, xla_stream, dev, part, ws, rank, index,
                     {out->untyped_data(), (int64_t)out->size_bytes(), dtype}, result);
  }
  return result;
}

// jaxoverlap_gemm_rs_v1 (kAllReduce false) and jaxoverlap_gemm_ar_v1 (true).
template <bool kAllReduce>
ffi::Error GemmRsImpl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer x,
                      ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out, int64_t site,
                      ffi::Span<const int32_t> ordinals, ffi::Span<const int32_t> ranks,
                      ffi::Span<const int32_t> groups, int64_t n, int64_t comm_sms,
                      int64_t chunks, double timeout_s, int64_t stall_rank, int64_t profile,
                      int64_t call_tag, ffi::RunId run_id, int64_t w_colmajor,
                      int64_t x_colmajor) {
  return GemmRs(xla_stream, device, x, w, &*out, kAllReduce, site, ordinals, ranks, groups, n,
                comm_sms, chunks, timeout_s, stall_rank, profile, call_tag, run_id, w_colmajor,
                x_colmajor);
}

// Both targets' binding: x [..., K], w [K, N] -> out, then the common attributes.
auto gemm_rs_binding() {
  return bind_common_attrs(xla::ffi::Ffi::Bind()
                               .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                               .Ctx<xla::ffi::DeviceOrdinal>()
                               .Arg<xla::ffi::AnyBuffer>()   // x [..., K]
                               .Arg<xla::ffi::AnyBuffer>()   // w [K, N]
                               .Ret<xla::ffi::AnyBuffer>())  // out
      .Attr<int64_t>("w_colmajor")                           // w stored column-major
      .Attr<int64_t>("x_colmajor");                          // x stored column-major
}

}  // namespace
}  // namespace jaxoverlap

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapGemmRsV1, jaxoverlap::GemmRsImpl<false>,
                              jaxoverlap::gemm_rs_binding());  // out [rows / n, ..., N]
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapGemmArV1, jaxoverlap::GemmRsImpl<true>,
                              jaxoverlap::gemm_rs_binding());  // out [..., N], the sum
