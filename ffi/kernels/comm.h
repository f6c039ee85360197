// Host-side declarations of the communication kernels (ffi/kernels/comm.cu). Plain CUDA runtime
// types only, so the handler files can include it without device code.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace jaxoverlap {

enum class DType : int32_t { kBF16 = 0, kF16 = 1 };

constexpr uint32_t kPieceBytes = 32 * 1024;  // one TMA transfer
constexpr int kStages = 6;                   // smem pipeline depth of a sender CTA
constexpr int kCommThreads = 256;            // receivers use all threads, senders one
constexpr int kRecvStages = 4;               // smem pipeline depth of a receiver CTA
constexpr int kCommSmem = 192 * 1024;        // dynamic smem of every comm CTA (1 CTA per SM)
static_assert(kStages * kPieceBytes <= kCommSmem, "sender pipeline exceeds the smem budget");
static_assert(kRecvStages <= kStages, "receivers reuse the senders' mbarriers");

// Receiver piece: kRecvStages x (n inputs + 1 output) pieces fit the smem budget.
__host__ __device__ inline uint32_t recv_piece_bytes(int n) {
  uint32_t p = kCommSmem / (kRecvStages * (n + 1));
  p = p > 32u * 1024 ? 32u * 1024 : p;
  return p / 1024 * 1024;
}

// One launch of the persistent communication kernel. CTAs [0, senders) push finished blocks to
// their owners with TMA; CTAs [senders, senders + receivers) sum what arrived, in rank order.
struct CommArgs {
  Peers peers;
  const char* src;        // blocks to push (block index = step t if src_by_step, else dest rank)
  const char* own;        // this rank's own block, summed in its rank position (nullptr: none)
  char* out;              // receivers write the sum of chunk k here (+ k * chunk_bytes)
  int64_t block_bytes;    // bytes of one rank's row block
  int32_t chunks;         // sub-chunks per block (each signalled separately)
  int32_t senders, receivers;
  int32_t src_by_step;    // 1: src block t is sent at step t (GEMM partials), 0: block j to rank j
  int32_t wait_ready;     // 1: wait for Flags::ready[t * chunks + k] before pushing (GEMM driver)
  int32_t signal_reduced; // 1: receivers release Flags::reduced[k][cta] when chunk k is summed
  int32_t stall_rank;     // test-only: this rank never signals its pushes (-1: none; <= -2:
                          // the handler of rank -2 - stall_rank fails instead, see *_ffi.cc)
  int32_t op;
  uint64_t timeout_ns;
  ErrorRecord* err;
  DType dtype;
  int32_t reduce_push;    // n == 2 only: the reduce-push schedule (reduce_push_kernel), not the
                          // senders/receivers one; senders = CTAs, receivers unused
};

// Reduce-push schedule (standalone reduce-scatter, n == 2): every CTA b seeds its pieces of the
// own block into the local accumulator (staging slot) and signals acc_ready to the peer, pushes
// its pieces of the peer's block with a TMA bulk add into the peer's accumulator and signals
// arrive, then copies its pieces of the finished accumulator to the output. One add of two
// operands per element: bitwise deterministic.
constexpr int kReducePushThreads = 64;  // warp 0: push, warp 1: seed + copy-out
constexpr int kPushStages = 3, kLocalStages = 3;
static_assert(kPushStages + kLocalStages <= kStages, "reduce-push shares the sender mbarriers");
constexpr int kReducePushSmem = (kPushStages + kLocalStages) * kPieceBytes;
static_assert(kReducePushSmem <= kCommSmem, "reduce-push smem");

cudaError_t preload_comm_kernels();  // force-load every kernel below on the current device
cudaError_t launch_comm(const CommArgs& a, cudaStream_t stream);
// GEMM-stream helpers: signal a finished chunk, wait for a chunk's inputs, release the staging
// slots this rank consumed, and (on XLA's stream after the join) poison a given-up call's output
// and advance the epoch.
cudaError_t launch_signal_ready(Flags* local, int index, cudaStream_t stream);
cudaError_t launch_wait_chunk(const Peers& peers, int chunk, int count, int from_reduced,
                              int op, uint64_t timeout_ns, ErrorRecord* err, cudaStream_t stream);
cudaError_t launch_release_slots(const Peers& peers, cudaStream_t stream);
cudaError_t launch_finish(Flags* local, cudaStream_t stream);
// launch_finish for a call with outputs: first fills out[0, bytes) (and out2[0, bytes2), a
// second output, if given) with NaN if a wait of this rank gave up in the current call
// (Flags::gave_up), or always if `force`.
// `err` (groups that span processes only): where to report a poisoning by a peer process
// (Flags::poison_from), as device `device`, rank `rank`, a call of `op` (OpCode, common.cuh; 0:
// "a jaxoverlap fused call"). `abort` (with `force`: a call given
// up by its host): the workspace's abort ring (Peers::abort), whose word of the call's epoch
// target -- as the device counts it -- is raised first, so the peers' waits of this call give
// up even when the host's call number is not the device's epoch (issue 26, R3: under XLA's
// command buffers a device replays calls its host never sees).
cudaError_t launch_finish_poison(Flags* local, void* out, int64_t bytes, DType dtype,
                                 cudaStream_t stream, bool force = false, void* out2 = nullptr,
                                 int64_t bytes2 = 0, ErrorRecord* err = nullptr, int device = -1,
                                 int rank = -1, uint32_t* abort = nullptr, int op = 0);

}  // namespace jaxoverlap
