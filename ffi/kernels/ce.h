// Host-side declarations of the copy-engine protocol kernels (ffi/kernels/ce.cu), shared by the
// fused all-gather + GEMM and the backward's dgrad reduce-scatter beside the wgrad GEMM: the data
// moves with cudaMemcpyAsync (no SMs); one-thread kernels wait for the flags around those
// pushes, and stream writes release them (no SM either: launch_ce_signal_arrival). Plus the sum
// of pushed blocks. Plain CUDA runtime types only, so the handlers can include it without device
// code. `op` (OpCode) names the op in a timeout's report.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/comm.h"

namespace jaxoverlap {

// The receiver's words of the copy-engine signals from source rank `src` (ce.cu says how they
// pair a push with its call): Flags::pad0[src] holds the epoch target of the call whose pushes
// from `src` follow, pad0[kMaxRanks + src] how many of its chunks have landed. pad0 is unused by
// every other kernel; kernels/common.cuh is left alone (editing it recompiles every CUTLASS
// instantiation): give them names there at its next change.
static_assert(2 * kMaxRanks <= (int)(sizeof(Flags::pad0) / sizeof(uint32_t)),
              "Flags::pad0 cannot hold the copy-engine signal words");
__host__ __device__ inline uint32_t* ce_call_word(Flags* f, int src) { return &f->pad0[src]; }
__host__ __device__ inline uint32_t* ce_landed_word(Flags* f, int src) {
  return &f->pad0[kMaxRanks + src];
}

// Force-load every kernel below on the current device (lazy module loading must never happen
// while one of our waits spins).
cudaError_t preload_ce_kernels();
// Copy stream, before pushing into rank `dst`'s slot: wait until `dst` released that slot in
// the previous call on this workspace (Flags::slot_free[dst] >= epoch), then announce this call's
// pushes on `dst` (ce_call_word = epoch + 1, its landed count zeroed first).
cudaError_t launch_ce_wait_slot_free(const Peers& peers, int dst, int op, uint64_t timeout_ns,
                                     ErrorRecord* err, cudaStream_t stream);
// Copy stream, after the push of chunk `chunk` into rank `dst`'s slot: count it landed on `dst`
// (ce_landed_word = chunk + 1) by a stream write of a constant (cuStreamWriteValue32: no SM, right
// under capture), or a one-thread kernel if the driver refuses the write (counted:
// ce_signal_fallbacks). The fallback helps outside capture only: under XLA's capture a stream
// operation the driver refuses can invalidate the capture (CUDA invalidates a capture on an
// operation it cannot record), and then the kernel launched after it is not recorded either --
// the caller's CK reports the lost capture (capture_lost) and the call fails, the fallback
// counted but useless. Not seen: tests/gpu/test_xproc_gpu.py's command-buffer test asserts 0. The call's launch_ce_wait_slot_free for `dst` must precede it on `stream`
// (it announces the call: every copy-engine schedule waits for its slots first).
// stall_rank == rank: never (tests). `gathered`: Flags::gathered[rank][chunk] = epoch + 1 instead
// (the all-reduce's reduced chunks), by a one-thread kernel that decides when it runs whether the
// chunk may be signalled (it is computed after this rank's own waits).
cudaError_t launch_ce_signal_arrival(const Peers& peers, int dst, int chunk, int stall_rank,
                                     cudaStream_t stream, bool gathered = false);
// Signals of this process that the driver refused as stream writes (launch_ce_signal_arrival).
int64_t ce_signal_fallbacks();
// Before reading rank `src`'s chunk `chunk` from this rank's slot: wait until `src` announced
// this call and counted the chunk landed (ce_call_word, ce_landed_word; one timeout for both).
// `gathered`: the flag Flags::gathered[src][chunk]; and since a reduced chunk is computed after
// the sender's own waits, the data is garbage if the call was given up (its abort word raised)
// by then: this rank then gives the call up too (Flags::gave_up, NaN output).
cudaError_t launch_ce_wait_arrival(const Peers& peers, int src, int chunk, int op,
                                   uint64_t timeout_ns, ErrorRecord* err, cudaStream_t stream,
                                   bool gathered = false);
// out[i] = own[i] + sum over `count` blocks b of blocks[b * stride + i], i < elems, in f32, for
// bf16 or f16 data. Every pointer and `stride` 16-byte aligned (elems: any).
cudaError_t launch_sum_blocks(void* out, const void* own, const void* blocks, int count,
                              int64_t stride, int64_t elems, DType dtype, int sms,
                              cudaStream_t stream);
// out[i] = (bf16 or f16) in[i], i < elems: the single rounding of a sum kept in float32 (the
// all-gather along K, handlers/ag_gemm.cc).
cudaError_t launch_round_f32(void* out, const float* in, int64_t elems, DType dtype,
                             cudaStream_t stream);

}  // namespace jaxoverlap
