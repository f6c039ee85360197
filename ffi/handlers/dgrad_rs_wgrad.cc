// FFI handler of the column-parallel layer's backward (jaxoverlap_dgrad_rs_wgrad_v1): for
// y = all_gather(x) @ w, given the cotangent ct[M, N] (all M gathered rows), w.T[N, K] and the
// gathered x g[M, K] kept from the forward, it returns dx = reduce_scatter(ct @ w.T) (this rank's
// m = M / n rows of the sum over the group) and dW = g.T @ ct. The reduce-scatter hides behind
// the weight-gradient GEMM, and neither GEMM is split (the "bulk" overlap of Transformer Engine's
// backward, with the copy engine instead of SMs):
//   XLA's stream: dgrad GEMM P = ct @ w.T (all M rows, into a scratch result); then the wgrad
//     GEMM dW = g.T @ ct (cuBLASLt reads g transposed in place); then, per peer, a bounded wait
//     for its block of P to land; last dx = P[own rows] + the peers' blocks (one f32-sum pass).
//   copy stream, once P is done: per peer j, wait until j released its slot (previous call),
//     push P[j's rows] into it and release j's arrival flag (kernels/ce.cu).
// Cross-GPU ordering is by flags only, as in handlers/ag_gemm.cc. `w_colmajor`: w.T[N, K] is stored
// column-major (it is the transpose of a row-major w[K, N]; XLA passes w as is).
// jaxoverlap_dgrad_rs_wgrad_acc_v1 takes a fourth operand e[M, K], added to ct @ w.T before the
// reduce-scatter (C of the dgrad GEMM, beta = 1): the other matmuls' contributions to dx when one
// gathered x fed several weights (separate Q/K/V), so one reduce-scatter serves them all.
#include <string>

#include "handlers/fused_call.h"
#include "kernels/ce.h"
#include "kernels/comm.h"

namespace jaxoverlap {
namespace {

constexpr const char* kWhat = "jaxoverlap.all_gather_matmul backward (fused dgrad reduce-scatter)";

// `addend`: null, or e[M, K], added to ct @ w.T.
ffi::Error DgradRsWgrad(const Call& call, ffi::AnyBuffer ct, ffi::AnyBuffer wt, ffi::AnyBuffer g,
                        const ffi::AnyBuffer* addend, ffi::AnyBuffer* dx, ffi::AnyBuffer* dw,
                        ffi::AnyBuffer* scratch, int64_t w_colmajor) {
  // comm_sms and chunks unused: the copy engine needs no SMs, and neither GEMM is split.
  FusedCall fc(kWhat, kOpDgradRs, call);
  if (ffi::Error e = fc.check(); e.failure()) return e;
  const int64_t n = call.attrs.n;
  DType dtype;
  const auto t = ct.element_type();
  if (!to_dtype(t, &dtype) || wt.element_type() != t || g.element_type() != t ||
      (addend && addend->element_type() != t) || dx->element_type() != t ||
      dw->element_type() != t || scratch->element_type() != t)
    return fc.invalid("every operand and result must be bfloat16, or every one float16");
  auto wd = wt.dimensions();
  if (wd.size() != 2 || ct.dimensions().size() < 1 || ct.dimensions().back() != wd[0])
    return fc.invalid("expected ct[..., N] and w.T[N, K]");
  const int64_t N = wd[0], K = wd[1];
  const int64_t M = N ? (int64_t)ct.element_count() / N : 0;
  const int64_t elt = 2;
  if (M < 1 || M % n || (int64_t)g.element_count() != M * K ||
      (int64_t)dx->element_count() != M / n * K || (int64_t)dw->element_count() != K * N ||
      (int64_t)scratch->element_count() != M * K ||
      (addend && (int64_t)addend->element_count() != M * K))
    return fc.invalid("shapes: expected ct[M, N], g[M, K], dx[M / n, K], dW[K, N] and a scratch "
                      "of M x K elements, with M divisible by the group size");
  const int64_t m = M / n;
  const int64_t block_bytes = m * K * elt;
  if (block_bytes % 256)
    return fc.invalid("rows per rank x K must be a multiple of 128 elements (256-byte alignment "
                      "of every block)");
  char* dxp = static_cast<char*>(dx->untyped_data());
  const Output output{dxp, (int64_t)dx->size_bytes(), dtype, dw->untyped_data(),
                      (int64_t)dw->size_bytes()};
  return fc.run({block_bytes, false, false, FusedCall::kCopyEngine}, output,
                [&](FusedCall& c) -> std::string {
    const int rank = c.rank();
    DeviceRuntime* dev = c.dev();
    cudaStream_t xla_stream = c.stream();
    const Peers& peers = c.peers();
    const char* ctp = static_cast<const char*>(ct.untyped_data());
    const void* wtp = wt.untyped_data();
    const void* gp = g.untyped_data();
    const void* ep = addend ? addend->untyped_data() : nullptr;
    char* pp = static_cast<char*>(scratch->untyped_data());
    void* dwp = dw->untyped_data();
    for (const void* p : {(const void*)ctp, wtp, gp, (const void*)pp, (const void*)dwp})
      if (GemmRunner::alignment(p) < 2 || (ep && GemmRunner::alignment(ep) < 2))
        return "an operand is not aligned to its 2-byte element";
    if (GemmRunner::alignment(dxp) < 16 || GemmRunner::alignment(pp) < 16)
      return "dx and the scratch must be 16-byte aligned (XLA's buffers are)";
    const GemmShape dgrad{M, K, N, dtype, ep != nullptr, /*sm_count=*/0, w_colmajor != 0};
    GemmShape wgrad{K, N, M, dtype, false, /*sm_count=*/0, /*b_col=*/false};
    wgrad.a_col = true;  // g.T, read in place
    // The dgrad GEMM, then the event the copy stream's pushes wait for.
    auto dgrad_gemm = [&]() -> std::string {
      if (std::string e = dev->gemm.run(dgrad, ctp, wtp, ep, pp, xla_stream); !e.empty()) return e;
      CK(cudaEventRecord(dev->gemm_done, xla_stream));
      return "";
    };
    auto wgrad_gemm = [&]() { return dev->gemm.run(wgrad, gp, ctp, nullptr, dwp, xla_stream); };

    // First call of this workspace on this device: load both GEMMs' kernels (and pick their
    // plans) and wait for them before anything of this call can spin (as in handlers/ag_gemm.cc).
    if (c.warm_up_now()) {
      CK(cudaDeviceSynchronize());
      if (std::string e = dgrad_gemm(); !e.empty()) return e;
      if (std::string e = wgrad_gemm(); !e.empty()) return e;
      CK(cudaStreamSynchronize(xla_stream));
      c.warmed();
    }
    const bool communicate = call.attrs.profile != 1;  // tools only: the GEMMs alone, dx garbage
    if (std::string e = c.fork(/*gemm=*/false); !e.empty()) return e;
    if (std::string e = dgrad_gemm(); !e.empty()) return e;
    CK(cudaStreamWaitEvent(dev->copy, dev->gemm_done));
    // Every slot-free wait first: behind a wgrad GEMM that fills the device, each one-thread
    // kernel of the copy stream may wait for a GEMM block to retire before it runs, so the
    // pushes get as few of them as possible between them (n > 2).
    for (int s = 1; communicate && s < n; ++s)
      CK(launch_ce_wait_slot_free(peers, (rank + s) % (int)n, kOpDgradRs, c.timeout_ns(), c.err(),
                                  dev->copy));
    for (int s = 1; communicate && s < n; ++s) {
      const int j = (rank + s) % (int)n;
      char* dst = peers.stage[j] + stage_slot(rank, j, (int)n) * block_bytes;
      CK(cudaMemcpyAsync(dst, pp + j * block_bytes, block_bytes, cudaMemcpyDefault, dev->copy));
      CK(launch_ce_signal_arrival(peers, j, 0, (int)call.attrs.stall_rank, dev->copy));
    }
    if (std::string e = wgrad_gemm(); !e.empty()) return e;
    for (int s = 1; communicate && s < n; ++s)
      CK(launch_ce_wait_arrival(peers, (rank - s + (int)n) % (int)n, 0, kOpDgradRs,
                                c.timeout_ns(), c.err(), xla_stream));
    CK(launch_sum_blocks(dxp, pp + rank * block_bytes, peers.stage[rank], (int)n - 1, m * K,
                         m * K, dtype, dev->total_sms, xla_stream));
    if (communicate) CK(launch_release_slots(peers, xla_stream));
    return c.join();
  });
}

ffi::Error DgradRsWgradImpl(const Call& call, ffi::AnyBuffer ct, ffi::AnyBuffer wt,
                            ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> scratch,
                            int64_t w_colmajor) {
  return DgradRsWgrad(call, ct, wt, g, nullptr, &*dx, &*dw, &*scratch, w_colmajor);
}

ffi::Error DgradRsWgradAccImpl(const Call& call, ffi::AnyBuffer ct, ffi::AnyBuffer wt,
                               ffi::AnyBuffer g, ffi::AnyBuffer e, ffi::Result<ffi::AnyBuffer> dx,
                               ffi::Result<ffi::AnyBuffer> dw,
                               ffi::Result<ffi::AnyBuffer> scratch, int64_t w_colmajor) {
  return DgradRsWgrad(call, ct, wt, g, &e, &*dx, &*dw, &*scratch, w_colmajor);
}

}  // namespace
}  // namespace jaxoverlap

// ct [M, ..., N], w.T [N, K], g [M, ..., K] (, e [M, ..., K]) -> dx [M / n, ..., K], dW [K, N],
// scratch [M, K]; w_colmajor: w.T stored column-major.
#define JAXOVERLAP_DGRAD_TARGET(symbol, impl, ...)                                              \
  JAXOVERLAP_FUSED_TARGET(                                                                      \
      symbol, impl,                                                                             \
      .Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>()         \
          __VA_ARGS__.Ret<xla::ffi::AnyBuffer>().Ret<xla::ffi::AnyBuffer>()                     \
          .Ret<xla::ffi::AnyBuffer>()                                                           \
          .Attr<int64_t>("w_colmajor"))
JAXOVERLAP_DGRAD_TARGET(JaxoverlapDgradRsWgrad, jaxoverlap::DgradRsWgradImpl);
JAXOVERLAP_DGRAD_TARGET(JaxoverlapDgradRsWgradAcc, jaxoverlap::DgradRsWgradAccImpl,
                        .Arg<xla::ffi::AnyBuffer>());  // e
