// FFI handler of the fused all-gather + GEMM (jaxoverlap_ag_gemm_v1), gathering rows:
// out[n * m, N] = concat over ranks p of x_p[m, K] @ w, rank p's rows at p * m.
// Schedule for rank r of n: the copy engine pushes x_r (cudaMemcpyAsync into each peer's
// symmetric staging slot for r, no SMs) on a side stream, each push followed by a one-thread
// kernel releasing the peer's arrival flag; meanwhile XLA's stream runs the GEMM of the own block
// straight from x, then, source by source in the order the pushes arrive (r - 1, r - 2, ...), a
// bounded wait for the block and the GEMM reading the staging slot, and last releases the slots.
// Cross-GPU ordering is by flags only (kernels/ce.cu): the two devices' handler threads run with
// no host ordering between them, so no stream ever waits on another device's event.
// The variant jaxoverlap_ag_gemm_keep_v1 also returns the gathered x (what a weight gradient
// needs): the copy stream, after its pushes, copies x and then each arrived block from its slot
// into that output while the GEMMs run; the slots are released only after those copies.
// `w_colmajor`: w[K, N] is stored column-major (the transpose of a row-major [N, K] array).
// The variant jaxoverlap_ag_gemm_k_v1 gathers along K (x_p [M, K / n], the contracted dimension):
// out = sum over p of x_p @ w[rows of block p], with the same pushes and waits; each GEMM adds
// its block into a float32 scratch (C = D, beta = 1; the first, the own block, overwrites it),
// rounded once into `out` at the end -- as XLA's single GEMM over the gathered x rounds once.
#include <string>

#include "handlers/fused_call.h"
#include "kernels/ce.h"
#include "kernels/comm.h"

namespace jaxoverlap {
namespace {

constexpr const char* kWhat = "jaxoverlap.all_gather_matmul (fused)";

ffi::Error AgGemm(const Call& call, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer* out,
                  ffi::AnyBuffer* gathered, ffi::AnyBuffer* acc, int64_t w_colmajor) {
  FusedCall fc(kWhat, kOpAgGemm, call);  // comm_sms unused: the copy engine needs no SMs
  if (ffi::Error e = fc.check(); e.failure()) return e;
  const int64_t n = call.attrs.n, chunks = call.attrs.chunks;
  RowGemm g;
  if (acc) {  // along K: x [M, K / n], w [K, N], out [M, N], acc float32 [M, N]; one chunk
    auto xd = x.dimensions();
    auto wd = w.dimensions();
    if (!to_dtype(x.element_type(), &g.dtype) || w.element_type() != x.element_type() ||
        out->element_type() != x.element_type() || acc->element_type() != ffi::DataType::F32)
      return fc.invalid("x, w and the result must be bfloat16 or float16, the scratch f32");
    if (xd.size() < 1 || wd.size() != 2 || wd[0] != n * xd.back() || chunks != 1)
      return fc.invalid("along K: expected x[..., K / n], w[K, N] and one chunk");
    g.K = xd.back();
    g.N = wd[1];
    g.rows = g.m = g.mc = g.K ? (int64_t)x.element_count() / g.K : 0;
    if (g.m < 1 || g.N < 1 || (int64_t)out->element_count() != g.m * g.N ||
        (int64_t)acc->element_count() != g.m * g.N)
      return fc.invalid("along K: the result and the scratch must be rows x N, not empty");
    // Every source's operands as aligned as the own block's (the warm-up plans one source only):
    // the staging slots (rows x K / n each) and w's blocks of K / n rows.
    if ((g.m * g.K) % 128 || (w_colmajor ? g.K : g.K * g.N) % 128)
      return fc.invalid("along K: rows x K / n and w's block of K / n rows must be multiples of "
                        "128 elements");
  } else if (std::string e = row_gemm(x, w, *out, n, chunks, /*gather=*/true, &g); !e.empty()) {
    return fc.invalid(e);
  }
  const DType dtype = g.dtype;
  const int64_t K = g.K, N = g.N, m = g.m, mc = g.mc;  // m: rows per rank
  const int64_t elt = 2;
  if (!acc && (int64_t)out->element_count() != n * m * N)
    return fc.invalid("result size is not (group size x rows) x N");
  if (acc && gathered) return fc.invalid("along K there is no gathered-x result");
  if (gathered && (gathered->element_type() != x.element_type() ||
                   (int64_t)gathered->element_count() != n * m * K))
    return fc.invalid("the gathered-x result is not (group size x rows) x K of x's dtype");
  const int64_t block_bytes = m * K * elt;  // one rank's block of x = one staging slot
  const int64_t chunk_bytes = mc * K * elt;
  char* gp = gathered ? static_cast<char*>(gathered->untyped_data()) : nullptr;
  const Output output{out->untyped_data(), (int64_t)out->size_bytes(), dtype, gp,
                      gathered ? (int64_t)gathered->size_bytes() : 0};
  return fc.run({block_bytes, false, false, FusedCall::kCopyEngine}, output,
                [&](FusedCall& c) -> std::string {
    const int rank = c.rank();
    DeviceRuntime* dev = c.dev();
    cudaStream_t xla_stream = c.stream();
    const uint64_t timeout_ns = c.timeout_ns();
    ErrorRecord* err = c.err();
    const Peers& peers = c.peers();
    const char* xp = static_cast<const char*>(x.untyped_data());
    const void* wp = w.untyped_data();
    char* op = static_cast<char*>(out->untyped_data());
    if (GemmRunner::alignment(xp) < 2 || GemmRunner::alignment(wp) < 2 ||
        GemmRunner::alignment(op) < 2 || (gp && GemmRunner::alignment(gp) < 2))
      return "an operand is not aligned to its 2-byte element";
    const GemmShape shape{mc, N, K, dtype, false, /*sm_count=*/0, w_colmajor != 0};  // whole device
    float* ap = acc ? static_cast<float*>(acc->untyped_data()) : nullptr;
    GemmShape k_shape = shape;  // along K: into the f32 sum, B = rows of block `row` of w
    k_shape.f32_out = true;
    k_shape.ldb = w_colmajor ? n * K : 0;
    auto gemm = [&](const char* a, int64_t row) -> std::string {
      if (!ap) return dev->gemm.run(shape, a, wp, nullptr, op + row * N * elt, xla_stream);
      const int64_t source = row / m;
      GemmShape s = k_shape;
      s.accumulate = source != rank;  // the own block comes first and overwrites the sum
      const char* b = static_cast<const char*>(wp) + source * K * (w_colmajor ? 1 : N) * elt;
      return dev->gemm.run(s, a, b, ap, ap, xla_stream);
    };

    // First call of this workspace on this device: drain the device (nothing of ours may spin
    // while a kernel loads: lazy loading can wait for every kernel in flight, and a spinning
    // wait only ends when a peer runs), then compute the own block, which loads cuBLASLt's
    // kernel for this shape, and wait for it. Only then may this call's waits be enqueued. The
    // lock held here is this device's only: the peer's handler thread goes on meanwhile.
    bool own_done = false;
    if (c.warm_up_now()) {
      CK(cudaDeviceSynchronize());
      // Also the plan for an A operand in a staging slot (its alignment may differ from x's):
      // garbage into the rows of the peer block that the real GEMM below overwrites (along K:
      // into the sum, before the own block's GEMM overwrites it).
      const int s = (rank + (int)n - 1) % (int)n;
      const char* slot = peers.stage[rank] + stage_slot(s, rank, (int)n) * block_bytes;
      if (std::string e = gemm(slot, s * m); !e.empty()) return e;
      for (int k = 0; k < chunks; ++k)
        if (std::string e = gemm(xp + k * chunk_bytes, rank * m + k * mc); !e.empty()) return e;
      CK(cudaStreamSynchronize(xla_stream));
      c.warmed();
      own_done = true;
    }

    // profile == 1 (tools only): the GEMM schedule alone, no communication -- the foreign rows
    // are computed from whatever the staging slots hold (garbage).
    const bool communicate = call.attrs.profile != 1;
    // The copy stream waits for XLA's stream and for the previous call of this workspace; so
    // does XLA's stream (a no-op when that call ran on it). Then, in host order, every push and
    // signal a peer needs from this call is enqueued before any wait of this call.
    if (std::string e = c.fork(/*gemm=*/false); !e.empty()) return e;
    for (int t = 1; communicate && t < n; ++t) {
      const int j = (rank + t) % (int)n;
      CK(launch_ce_wait_slot_free(peers, j, kOpAgGemm, timeout_ns, err, dev->copy));
      char* dst = peers.stage[j] + stage_slot(rank, j, (int)n) * block_bytes;
      for (int k = 0; k < chunks; ++k) {
        CK(cudaMemcpyAsync(dst + k * chunk_bytes, xp + k * chunk_bytes, chunk_bytes,
                           cudaMemcpyDefault, dev->copy));
        CK(launch_ce_signal_arrival(peers, j, k, (int)call.attrs.stall_rank, dev->copy));
      }
    }
    // The gathered x: the own block, then each peer block as it lands, on the copy stream
    // behind this call's pushes (so no peer waits for them); XLA's stream waits for these copies
    // before it releases the slots.
    if (gp) {
      CK(cudaMemcpyAsync(gp + rank * block_bytes, xp, block_bytes, cudaMemcpyDefault, dev->copy));
      for (int t = 1; t < n; ++t) {
        const int s = (rank - t + (int)n) % (int)n;
        const char* slot = peers.stage[rank] + stage_slot(s, rank, (int)n) * block_bytes;
        for (int k = 0; k < chunks; ++k) {
          if (communicate)
            CK(launch_ce_wait_arrival(peers, s, k, kOpAgGemm, timeout_ns, err, dev->copy));
          CK(cudaMemcpyAsync(gp + s * block_bytes + k * chunk_bytes, slot + k * chunk_bytes,
                             chunk_bytes, cudaMemcpyDefault, dev->copy));
        }
      }
      CK(cudaEventRecord(dev->comm_done, dev->copy));  // re-recorded by the join
    }
    for (int k = 0; !own_done && k < chunks; ++k)
      if (std::string e = gemm(xp + k * chunk_bytes, rank * m + k * mc); !e.empty()) return e;
    // Rank s pushes to s + 1 first, so this rank's blocks arrive from r - 1, r - 2, ...
    for (int t = 1; t < n; ++t) {
      const int s = (rank - t + (int)n) % (int)n;
      const char* slot = peers.stage[rank] + stage_slot(s, rank, (int)n) * block_bytes;
      for (int k = 0; k < chunks; ++k) {
        if (communicate)
          CK(launch_ce_wait_arrival(peers, s, k, kOpAgGemm, timeout_ns, err, xla_stream));
        if (std::string e = gemm(slot + k * chunk_bytes, s * m + k * mc); !e.empty()) return e;
      }
    }
    if (ap) CK(launch_round_f32(op, ap, m * N, dtype, xla_stream));
    if (gp) CK(cudaStreamWaitEvent(xla_stream, dev->comm_done));
    if (communicate) CK(launch_release_slots(peers, xla_stream));
    return c.join();
  });
}

ffi::Error AgGemmImpl(const Call& call, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Result<ffi::AnyBuffer> out, int64_t w_colmajor) {
  return AgGemm(call, x, w, &*out, nullptr, nullptr, w_colmajor);
}

ffi::Error AgGemmKImpl(const Call& call, ffi::AnyBuffer x, ffi::AnyBuffer w,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> acc,
                       int64_t w_colmajor) {
  return AgGemm(call, x, w, &*out, nullptr, &*acc, w_colmajor);
}

ffi::Error AgGemmKeepImpl(const Call& call, ffi::AnyBuffer x, ffi::AnyBuffer w,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> gathered,
                          int64_t w_colmajor) {
  return AgGemm(call, x, w, &*out, &*gathered, nullptr, w_colmajor);
}

}  // namespace
}  // namespace jaxoverlap

// x [m, ..., K] (along K: [..., K / n]), w [K, N] -> out [n * m, ..., N] (along K: [..., N]),
// the variant's second result; w_colmajor: w stored column-major.
JAXOVERLAP_FUSED_TARGET(JaxoverlapAgGemm, jaxoverlap::AgGemmImpl,
                        JAXOVERLAP_GEMM_BUFFERS.Attr<int64_t>("w_colmajor"));
JAXOVERLAP_FUSED_TARGET(JaxoverlapAgGemmKeep, jaxoverlap::AgGemmKeepImpl,
                        JAXOVERLAP_GEMM_BUFFERS
                            .Ret<xla::ffi::AnyBuffer>()  // gathered x [n * m, ..., K]
                            .Attr<int64_t>("w_colmajor"));
JAXOVERLAP_FUSED_TARGET(JaxoverlapAgGemmK, jaxoverlap::AgGemmKImpl,
                        JAXOVERLAP_GEMM_BUFFERS
                            .Ret<xla::ffi::AnyBuffer>()  // f32 scratch [rows, N]
                            .Attr<int64_t>("w_colmajor"));
