// FFI handler of the fused GEMM + reduce-scatter's tile schedule (jaxoverlap_gemm_rs_tile_v1;
// Config(schedule="tile")): one persistent GEMM kernel over the whole device whose epilogue
// does the communication (ffi/kernels/tile_rs.h has the protocol). No SM partition, no
// communication kernel and no split GEMM; on XLA's stream:
//   wait for the previous call of the workspace -> the tile kernel -> release the staging slots
//   this rank read -> the finish kernel (NaN if a wait gave up; epoch + 1) -> the done event.
// The workspace is one staging slot per source (two parities of a block + the source's slab
// flags), shared by every call site of the same op and shapes like the other handlers'.
#include <string>
#include <vector>

#include "gemm.h"
#include "handler_common.h"
#include "kernels/comm.h"
#include "kernels/tile_rs.h"
#include "runtime.h"

namespace jaxoverlap {
namespace {

constexpr const char* kWhat = "jaxoverlap.matmul_reduce_scatter (fused, tile schedule)";

// The menu entry (and swizzle) of this problem, timed at its first execution and published like
// the GEMM plans (kernels/tile_rs.h: tile_rs_choose); under capture, timed on a side stream and
// not published. Then only that entry's kernel is loaded (DESIGN.md decision 5: before a kernel
// of ours spins).
std::string tile_setup(TileRsArgs* a, cudaStream_t stream) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(stream, &cs);
  const bool capturing = cs != cudaStreamCaptureStatusNone;
  return outside_capture("choosing and loading the tile-fused GEMM kernel", [&]() -> std::string {
    cudaStream_t s = stream;
    const bool side = capturing && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == 0;
    TileChoice c;
    tile_rs_choose(*a, s, !capturing || side, !capturing, GemmRunner::get_cache_dir(), &c);
    if (side) cudaStreamSynchronize(s), cudaStreamDestroy(s);
    a->entry = c.entry, a->swizzle = c.swizzle;
    if (cudaError_t e = preload_tile_entry(c.entry, a->w_colmajor != 0))
      return std::string("loading the tile-fused GEMM kernel failed: ") + cudaGetErrorString(e);
    return "";
  });
}

ffi::Error GemmRsTileImpl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer x,
                          ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                          JAXOVERLAP_GEMM_ATTR_PARAMS, int64_t swizzle) {
  (void)comm_sms, (void)chunks;  // one kernel over the whole device, no chunks
  uint64_t timeout_ns = 0;
  if (std::string e = to_timeout_ns(timeout_s, &timeout_ns); !e.empty()) return invalid(kWhat, e);
  DType dtype;
  if (!to_dtype(x.element_type(), &dtype) || w.element_type() != x.element_type() ||
      out->element_type() != x.element_type())
    return invalid(kWhat, "x, w and the result must all be bfloat16");
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() < 1 || wd.size() != 2 || xd.back() != wd[0])
    return invalid(kWhat, "expected x[..., K] and w[K, N]");
  const int64_t K = wd[0], N = wd[1];
  const int64_t rows = K ? (int64_t)x.element_count() / K : 0;
  if (n < 2 || rows % n) return invalid(kWhat, "the rows of x are not divisible by the group size");
  const int64_t m = rows / n;
  if ((int64_t)out->element_count() != m * N)
    return invalid(kWhat, "result size is not (rows / group size) x N");
  if (swizzle < 1 || swizzle > 64) return invalid(kWhat, "swizzle must be in 1..64");
  if (std::string e = tile_rs_unsupported(dtype, (int)n, m, N, K, x.untyped_data(),
                                          w.untyped_data(), out->untyped_data());
      !e.empty())
    return invalid(kWhat, e);
  int rank = -1;
  std::vector<int> group;
  if (std::string e = find_group(device, ordinals, ranks, groups, n, &rank, &group); !e.empty())
    return invalid(kWhat, e);

  DeviceGuard guard;
  cudaSetDevice(device);
  DeviceRuntime* dev;
  Workspace* ws;
  const int64_t slot_bytes = tile_rs_slot_bytes(m, N);
  CaptureScope capture(xla_stream, kWhat);  // XLA may be capturing this call (capture.h)
  if (std::string e = device_runtime(device, &dev); !e.empty()) return internal(kWhat, e);
  std::lock_guard<std::mutex> hold(dev->launch_mu);
  if (std::string e = workspace(site, group, rank, slot_bytes, false, &ws); !e.empty())
    return internal(kWhat, e);
  // From here on this call counts on every rank: a failure below gives it up on all of them.
  uint32_t index = 0;
  bool given_up = false;  // issued out of order (call_order.h): given up on every rank
  const Output output{out->untyped_data(), (int64_t)out->size_bytes(), dtype};
  if (ffi::Error e = begin_call(kWhat, xla_stream, dev, ws, rank, {run_id.run_id, call_tag},
                                output, &index, &given_up);
      e.failure() || given_up)
    return e;
  ffi::Error result = [&]() -> ffi::Error {
    if (std::string e = preload(dev); !e.empty()) return internal(kWhat, e);  // release, finish
    if (stall_rank <= -2 && rank == -2 - stall_rank)  // test-only: fused._failed_rank_for_tests
      return internal(kWhat, "test-only failure injected on this rank after begin_call");
    ErrorRecord* err = error_record(device);
    if (!err) return internal(kWhat, "could not allocate the host-mapped error record");
    const Peers& peers = ws->peers[rank];
    TileRsArgs a{};
    a.peers = peers;
    a.x = x.untyped_data();
    a.w = w.untyped_data();
    a.out = out->untyped_data();
    a.m = m;
    a.N = N;
    a.K = K;
    a.w_colmajor = (int32_t)w_colmajor;
    a.dtype = dtype;
    a.slot_bytes = slot_bytes;
    a.sm_count = dev->total_sms;
    a.swizzle = (int32_t)swizzle;
    a.mode = profile == 1 ? 1 : 0;  // tools only: the kernel's traffic without the waits
    a.stall_rank = (int32_t)stall_rank;
    a.op = kOpGemmRs;
    a.timeout_ns = timeout_ns;
    a.err = err;
    if (std::string e = tile_setup(&a, xla_stream); !e.empty()) return internal(kWhat, e);
    CK(wait_done(xla_stream, ws->done[rank]));
    CK(launch_tile_rs(a, xla_stream));
    CK(launch_release_slots(peers, xla_stream));
    ErrorRecord* spans_err = ws->spans ? err : nullptr;
    CK(launch_finish_poison(peers.flags[rank], output.data, output.bytes, dtype, xla_stream,
                            false, nullptr, 0, spans_err, ws->ordinals[rank], rank));
    CK(record_done(ws->done[rank], xla_stream));
    return ffi::Error::Success();
  }();
  if (result.failure())
    return fail_call(kWhat, xla_stream, dev, nullptr, ws, rank, index, output, result);
  return result;
}

}  // namespace
}  // namespace jaxoverlap

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxoverlapGemmRsTileV1, jaxoverlap::GemmRsTileImpl,
                              jaxoverlap::bind_common_attrs(
                                  xla::ffi::Ffi::Bind()
                                      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                      .Ctx<xla::ffi::DeviceOrdinal>()
                                      .Arg<xla::ffi::AnyBuffer>()   // x [..., K]
                                      .Arg<xla::ffi::AnyBuffer>()   // w [K, N]
                                      .Ret<xla::ffi::AnyBuffer>())  // out [rows / n, ..., N]
                                  .Attr<int64_t>("w_colmajor")      // w stored column-major
                                  .Attr<int64_t>("swizzle"));       // cluster rows per band
