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
#include <vector>

#include "handlers/fused_call.h"
#include "kernels/ce.h"
#include "kernels/comm.h"
#include "runtime/runtime.h"

namespace jaxoverlap {
namespace {

constexpr const char* kWhat = "jaxoverlap.all_gather_matmul backward (fused dgrad reduce-scatter)";

// `addend`: null, or e[M, K], added to ct @ w.T.
ffi::Error DgradRsWgrad(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer ct,
                        ffi::AnyBuffer wt, ffi::AnyBuffer g, const ffi::AnyBuffer* addend,
                        ffi::AnyBuffer* dx, ffi::AnyBuffer* dw, ffi::AnyBuffer* scratch,
                        int64_t site, ffi::Span<const int32_t> ordinals,
                        ffi::Span<const int32_t> ranks, ffi::Span<const int32_t> groups, int64_t n,
                        int64_t comm_sms, int64_t chunks, double timeout_s, int64_t stall_rank,
                        int64_t profile, int64_t call_tag, ffi::RunId run_id,
                        int64_t w_colmajor) {
  (void)comm_sms;  // the copy engine needs no SMs
  (void)chunks;    // one block per peer: neither GEMM is split
  uint64_t timeout_ns = 0;
  if (std::string e = to_timeout_ns(timeout_s, &timeout_ns); !e.empty()) return invalid(kWhat, e);
  DType dtype;
  const auto t = ct.element_type();
  if (!to_dtype(t, &dtype) || wt.element_type() != t || g.element_type() != t ||
      (addend && addend->element_type() != t) || dx->element_type() != t ||
      dw->element_type() != t || scratch->element_type() != t)
    return invalid(kWhat, "every operand and result must be bfloat16, or every one float16");
  auto wd = wt.dimensions();
  if (wd.size() != 2 || ct.dimensions().size() < 1 || ct.dimensions().back() != wd[0])
    return invalid(kWhat, "expected ct[..., N] and w.T[N, K]");
  const int64_t N = wd[0], K = wd[1];
  const int64_t M = N ? (int64_t)ct.element_count() / N : 0;
  const int64_t elt = 2;
  if (M < 1 || M % n || (int64_t)g.element_count() != M * K ||
      (int64_t)dx->element_count() != M / n * K || (int64_t)dw->element_count() != K * N ||
      (int64_t)scratch->element_count() != M * K ||
      (addend && (int64_t)addend->element_count() != M * K))
    return invalid(kWhat, "shapes: expected ct[M, N], g[M, K], dx[M / n, K], dW[K, N] and a "
                          "scratch of M x K elements, with M divisible by the group size");
  const int64_t m = M / n;
  const int64_t block_bytes = m * K * elt;
  if (block_bytes % 256)
    return invalid(kWhat, "rows per rank x K must be a multiple of 128 elements (256-byte "
                          "alignment of every block)");
  int rank = -1;
  std::vector<int> group;
  if (std::string e = find_group(device, ordinals, ranks, groups, n, &rank, &group); !e.empty())
    return invalid(kWhat, e);

  DeviceGuard guard;
  cudaSetDevice(device);
  DeviceRuntime* dev;
  Workspace* ws;
  CaptureScope capture(xla_stream, kWhat);  // XLA may be capturing this call (capture.h)
  if (std::string e = device_runtime(device, &dev); !e.empty()) return internal(kWhat, e);
  std::lock_guard<std::mutex> hold(dev->launch_mu);
  if (std::string e = workspace(site, group, rank, block_bytes, false, &ws); !e.empty())
    return internal(kWhat, e);
  // From here on this call counts on every rank: a failure below gives it up on all of them.
  uint32_t index = 0;
  bool given_up = false;  // issued out of order (call_order.h): given up on every rank
  char* dxp = static_cast<char*>(dx->untyped_data());
  const Output output{dxp, (int64_t)dx->size_bytes(), dtype, dw->untyped_data(),
                      (int64_t)dw->size_bytes()};
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
    const Peers& peers = ws->peers[rank];
    const char* ctp = static_cast<const char*>(ct.untyped_data());
    const void* wtp = wt.untyped_data();
    const void* gp = g.untyped_data();
    const void* ep = addend ? addend->untyped_data() : nullptr;
    char* pp = static_cast<char*>(scratch->untyped_data());
    void* dwp = dw->untyped_data();
    for (const void* p : {(const void*)ctp, wtp, gp, (const void*)pp, (const void*)dwp})
      if (GemmRunner::alignment(p) < 2 || (ep && GemmRunner::alignment(ep) < 2))
        return invalid(kWhat, "an operand is not aligned to its 2-byte element");
    if (GemmRunner::alignment(dxp) < 16 || GemmRunner::alignment(pp) < 16)
      return invalid(kWhat, "dx and the scratch must be 16-byte aligned (XLA's buffers are)");
    const GemmShape dgrad{M, K, N, dtype, ep != nullptr, /*sm_count=*/0, w_colmajor != 0};
    GemmShape wgrad{K, N, M, dtype, false, /*sm_count=*/0, /*b_col=*/false};
    wgrad.a_col = true;  // g.T, read in place
    // The dgrad GEMM, then the event the copy stream's pushes wait for.
    auto dgrad_gemm = [&]() -> std::string {
      if (std::string err = dev->gemm.run(dgrad, ctp, wtp, ep, pp, xla_stream); !err.empty())
        return err;
      if (cudaError_t err = cudaEventRecord(dev->gemm_done, xla_stream))
        return std::string("cudaEventRecord: ") + cudaGetErrorString(err);
      return "";
    };
    auto wgrad_gemm = [&]() { return dev->gemm.run(wgrad, gp, ctp, nullptr, dwp, xla_stream); };

    // First call of this workspace on this device: load both GEMMs' kernels (and pick their
    // plans) and wait for them before anything of this call can spin (as in handlers/ag_gemm.cc).
    if (warm_up_now(ws, rank)) {
      CK(cudaDeviceSynchronize());
      if (std::string e = dgrad_gemm(); !e.empty()) return internal(kWhat, e);
      if (std::string e = wgrad_gemm(); !e.empty()) return internal(kWhat, e);
      CK(cudaStreamSynchronize(xla_stream));
      ws->warmed[rank] = true;
    }
    const bool communicate = profile != 1;  // tools only: the GEMMs alone, dx is garbage
    if (ffi::Error e = fork_streams(kWhat, xla_stream, dev, &streams, /*gemm=*/false,
                                    ws->done[rank]);
        e.failure())
      return e;
    CK(wait_done(xla_stream, ws->done[rank]));
    if (std::string e = dgrad_gemm(); !e.empty()) return internal(kWhat, e);
    CK(cudaStreamWaitEvent(dev->copy, dev->gemm_done));
    // Every slot-free wait first: behind a wgrad GEMM that fills the device, each one-thread
    // kernel of the copy stream may wait for a GEMM block to retire before it runs, so the
    // pushes get as few of them as possible between them (n > 2).
    for (int s = 1; communicate && s < n; ++s)
      CK(launch_ce_wait_slot_free(peers, (rank + s) % (int)n, kOpDgradRs, timeout_ns, err,
                                  dev->copy));
    for (int s = 1; communicate && s < n; ++s) {
      const int j = (rank + s) % (int)n;
      char* dst = peers.stage[j] + stage_slot(rank, j, (int)n) * block_bytes;
      CK(cudaMemcpyAsync(dst, pp + j * block_bytes, block_bytes, cudaMemcpyDefault, dev->copy));
      CK(launch_ce_signal_arrival(peers, j, 0, (int)stall_rank, dev->copy));
    }
    if (std::string e = wgrad_gemm(); !e.empty()) return internal(kWhat, e);
    for (int s = 1; communicate && s < n; ++s)
      CK(launch_ce_wait_arrival(peers, (rank - s + (int)n) % (int)n, 0, kOpDgradRs, timeout_ns,
                                err, xla_stream));
    CK(launch_sum_blocks(dxp, pp + rank * block_bytes, peers.stage[rank], (int)n - 1, m * K,
                         m * K, dtype, dev->total_sms, xla_stream));
    if (communicate) CK(launch_release_slots(peers, xla_stream));
    return join(kWhat, xla_stream, dev, &streams, /*gemm=*/false, ws, rank, output);
  }();
  if (result.failure())
    return fail_call(kWhat, xla_stream, dev, streams.comm ? &streams : nullptr, ws, rank, index,
                     output, result);
  return result;
}

ffi::Error DgradRsWgradImpl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer ct,
                            ffi::AnyBuffer wt, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> scratch,
                            JAXOVERLAP_GEMM_ATTR_PARAMS) {
  return DgradRsWgrad(xla_stream, device, ct, wt, g, nullptr, &*dx, &*dw, &*scratch,
                      JAXOVERLAP_GEMM_ATTR_ARGS);
}

ffi::Error DgradRsWgradAccImpl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer ct,
                               ffi::AnyBuffer wt, ffi::AnyBuffer g, ffi::AnyBuffer e,
                               ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dw,
                               ffi::Result<ffi::AnyBuffer> scratch,
                               JAXOVERLAP_GEMM_ATTR_PARAMS) {
  return DgradRsWgrad(xla_stream, device, ct, wt, g, &e, &*dx, &*dw, &*scratch,
                      JAXOVERLAP_GEMM_ATTR_ARGS);
}

}  // namespace
}  // namespace jaxoverlap

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapDgradRsWgradAccV1, jaxoverlap::DgradRsWgradAccImpl,
                              jaxoverlap::bind_common_attrs(
                                  xla::ffi::Ffi::Bind()
                                      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                      .Ctx<xla::ffi::DeviceOrdinal>()
                                      .Arg<xla::ffi::AnyBuffer>()   // ct [M, ..., N]
                                      .Arg<xla::ffi::AnyBuffer>()   // w.T [N, K]
                                      .Arg<xla::ffi::AnyBuffer>()   // g [M, ..., K]
                                      .Arg<xla::ffi::AnyBuffer>()   // e [M, ..., K]
                                      .Ret<xla::ffi::AnyBuffer>()   // dx [M / n, ..., K]
                                      .Ret<xla::ffi::AnyBuffer>()   // dW [K, N]
                                      .Ret<xla::ffi::AnyBuffer>())  // scratch [M, K]
                                  .Attr<int64_t>("w_colmajor"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapDgradRsWgradV1, jaxoverlap::DgradRsWgradImpl,
                              jaxoverlap::bind_common_attrs(
                                  xla::ffi::Ffi::Bind()
                                      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                      .Ctx<xla::ffi::DeviceOrdinal>()
                                      .Arg<xla::ffi::AnyBuffer>()   // ct [M, ..., N]
                                      .Arg<xla::ffi::AnyBuffer>()   // w.T [N, K]
                                      .Arg<xla::ffi::AnyBuffer>()   // g [M, ..., K]
                                      .Ret<xla::ffi::AnyBuffer>()   // dx [M / n, ..., K]
                                      .Ret<xla::ffi::AnyBuffer>()   // dW [K, N]
                                      .Ret<xla::ffi::AnyBuffer>())  // scratch [M, K]
                                  .Attr<int64_t>("w_colmajor"));
