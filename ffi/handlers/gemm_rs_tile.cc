// FFI handler of the fused GEMM + reduce-scatter's tile schedule (jaxoverlap_gemm_rs_tile_v1;
// Config(schedule="tile")): one persistent GEMM kernel over the whole device whose epilogue
// does the communication (ffi/kernels/tile_rs.h has the protocol). No SM partition, no
// communication kernel and no split GEMM; on XLA's stream:
//   wait for the previous call of the workspace -> the tile kernel -> release the staging slots
//   this rank read -> the finish kernel (NaN if a wait gave up; epoch + 1) -> the done event.
// The workspace is one staging slot per source (two parities of a block + the source's slab
// flags), shared by every call site of the same op and shapes like the other handlers'.
#include <string>

#include "handlers/fused_call.h"
#include "kernels/comm.h"
#include "kernels/tile_rs.h"
#include "runtime/gemm.h"
#include "runtime/tile_menu.h"

namespace jaxoverlap {
namespace {

constexpr const char* kWhat = "jaxoverlap.matmul_reduce_scatter (fused, tile schedule)";

// The menu entry (its swizzle and epilogue variant) of this problem, timed at its first execution
// and published like the GEMM plans (runtime/tile_menu.h: tile_rs_choose); under capture, timed
// on a side stream and not published. Then only that entry's kernel is loaded (DESIGN.md
// decision 5: before a kernel of ours spins).
std::string tile_setup(TileRsArgs* a, cudaStream_t stream) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(stream, &cs);
  const bool capturing = cs != cudaStreamCaptureStatusNone;
  return outside_capture("choosing and loading the tile-fused GEMM kernel", [&]() -> std::string {
    cudaStream_t s = stream;
    const bool side = capturing && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == 0;
    TileChoice c;
    const std::string e =
        tile_rs_choose(*a, s, !capturing || side, !capturing, GemmRunner::get_cache_dir(), &c);
    if (side) cudaStreamSynchronize(s), cudaStreamDestroy(s);
    if (!e.empty()) return e;
    a->entry = c.entry, a->swizzle = c.swizzle, a->epi = c.epi;
    if (cudaError_t e = preload_tile_entry(c.entry, a->w_colmajor != 0))
      return std::string("loading the tile-fused GEMM kernel failed: ") + cudaGetErrorString(e);
    return "";
  });
}

ffi::Error GemmRsTile(const Call& call, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Result<ffi::AnyBuffer> out, int64_t w_colmajor, int64_t swizzle) {
  FusedCall fc(kWhat, kOpGemmRs, call);  // comm_sms, chunks unused: one kernel, whole device
  if (ffi::Error e = fc.check(); e.failure()) return e;
  const int64_t n = call.attrs.n;
  DType dtype;
  if (!to_dtype(x.element_type(), &dtype) || w.element_type() != x.element_type() ||
      out->element_type() != x.element_type())
    return fc.invalid("x, w and the result must all be bfloat16");
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() < 1 || wd.size() != 2 || xd.back() != wd[0])
    return fc.invalid("expected x[..., K] and w[K, N]");
  const int64_t K = wd[0], N = wd[1];
  const int64_t rows = K ? (int64_t)x.element_count() / K : 0;
  if (rows % n) return fc.invalid("the rows of x are not divisible by the group size");
  const int64_t m = rows / n;
  if ((int64_t)out->element_count() != m * N)
    return fc.invalid("result size is not (rows / group size) x N");
  if (swizzle < 1 || swizzle > 64) return fc.invalid("swizzle must be in 1..64");
  if (std::string e = tile_rs_unsupported(dtype, (int)n, m, N, K, x.untyped_data(),
                                          w.untyped_data(), out->untyped_data());
      !e.empty())
    return fc.invalid(e);
  const int64_t slot_bytes = tile_rs_slot_bytes(m, N);
  const Output output{out->untyped_data(), (int64_t)out->size_bytes(), dtype};
  // An exact workspace: the slab flags sit after the two parities' m x N blocks of each slot
  // (kernels/tile_rs.h), a place that moves with the shape (runtime/ws_class.h).
  return fc.run({slot_bytes, false, false, 0, /*exact=*/true}, output,
                [&](FusedCall& c) -> std::string {
    const Peers& peers = c.peers();
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
    a.sm_count = c.dev()->total_sms;
    a.swizzle = (int32_t)swizzle;
    a.mode = call.attrs.profile == 1 ? 1 : 0;  // tools only: the kernel's traffic without waits
    a.stall_rank = (int32_t)call.attrs.stall_rank;
    a.op = kOpGemmRs;
    a.timeout_ns = c.timeout_ns();
    a.err = c.err();
    if (std::string e = tile_setup(&a, c.stream()); !e.empty()) return e;
    // No fork: XLA's stream waits for the previous call of the workspace and runs it all.
    if (std::string e = c.fork(/*gemm=*/false); !e.empty()) return e;
    // The kernel ends the call itself (its last CTA releases the slots, fills NaN if a wait
    // gave up, advances the epoch): the join launches no finish kernel.
    CK(launch_tile_rs(a, c.stream()));
    return c.join(/*finished=*/true);
  });
}

}  // namespace
}  // namespace jaxoverlap

// x [..., K], w [K, N] -> out [rows / n, ..., N]; w_colmajor: w stored column-major; swizzle:
// cluster rows per band.
JAXOVERLAP_FUSED_TARGET(JaxoverlapGemmRsTile, jaxoverlap::GemmRsTile,
                        JAXOVERLAP_GEMM_BUFFERS.Attr<int64_t>("w_colmajor")
                            .Attr<int64_t>("swizzle"));
