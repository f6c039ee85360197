// Copy-engine protocol kernels: the data moves with the copy engine (cudaMemcpyAsync, no SMs);
// these one-thread kernels order it across GPUs. Used by the fused all-gather + GEMM
// (jaxoverlap_ag_gemm_v1) and the dgrad reduce-scatter beside the wgrad GEMM (handlers/dgrad_rs_wgrad.cc), which
// pushes blocks of its dgrad partial the same way and sums what arrives (sum_blocks_kernel), and
// by the gather half of the fused GEMM + all-reduce (its own flags, Flags::gathered).
// Protocol, as the all-gather uses it (rank r of n, workspace epoch e = Flags::epoch + 1 of this
// call, never reset):
//   copy stream, for each destination j = r + 1, ..., r - 1 (mod n):
//     wait slot_free[j] >= e - 1 on r (j's GEMMs of the previous call no longer read the slot),
//     and store e into r's signal word (signal_word below);
//     per chunk k: copy x chunk k -> j's slot for r, then copy r's signal word (4 bytes, e) into
//     arrive[r][k][0] on j: the copy engine signals, no SM (kernels/ce.h).
//   GEMM stream: own block first, then for each source s = r - 1, ..., r + 1 (mod n), per chunk:
//     wait arrive[s][k][0] >= e on r, GEMM on the slot; last, release slot_free[r] = e on every
//     peer (launch_release_slots), and the finish kernel advances the epoch after the join.
#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/ce.h"
#include "runtime/capture.h"

namespace jaxoverlap {
namespace {

// The copy-engine signal's source (issue 26, R5): a word of this rank's Flags that holds the
// value its arrival signals of the running call carry -- the call's epoch target e, or 0 when the
// call must not be signalled (below) -- stored by the slot-free wait that precedes the call's
// pushes on the copy stream, and copied by the copy engine into the peer's arrival flag after each
// push. The value lives on the device, as every epoch does, so a signal recorded into a CUDA graph
// carries the replay's epoch, not the one of the recording (a cuStreamWriteValue32 would freeze
// the host's value at capture: docs/ordering-and-stream-memops.md, section 3). The word is the
// last of Flags::pad0, unused by every kernel (kernels/common.cuh is left alone: editing it
// recompiles every CUTLASS instantiation); it should get its own name there at the next change.
constexpr int kSignalWord = (int)(sizeof(Flags::pad0) / sizeof(uint32_t)) - 1;
__host__ __device__ inline uint32_t* signal_word(Flags* f) { return &f->pad0[kSignalWord]; }

__global__ void ce_wait_slot_free_kernel(const __grid_constant__ Peers p, int dst, int op,
                                         uint64_t timeout_ns, ErrorRecord* err) {
  Flags* local = p.flags[p.rank];
  const uint32_t e = local->epoch + 1u;
  // The copy behind this kernel runs whatever it returns, so it must not give up on the call's
  // abort word: `dst` may still be reading the slot for its previous call (a host that failed
  // this call runs ahead of its GPU). Every counted call releases the slot (failed and refused
  // ones too, close_call), so only a peer that truly stalls ends this wait -- at the timeout.
  Peers q = p;
  q.abort = nullptr;
  if (!wait_flag(&local->slot_free[dst], e - 1u, true, timeout_ns, err, q,
                 {op, kWaitSlotFree, dst, -1})) {
    if (p.abort) *(volatile uint32_t*)abort_word(p.abort, e) = e;  // give it up on every rank
    // A spanning group given up for good (Peers::dead; this wait timed out, or an earlier one):
    // the copy still overwrites the slot, which a peer that is alive but stalled could yet be
    // reading for its previous call. Mark the peer poisoned from that call on (sticky, first
    // mark wins: the calls launched ahead here would each mark a later one), so its finishes
    // fill their outputs with NaN and report it rather than let mixed data pass.
    if (p.dead && e > 1u) atomicCAS_system(&p.flags[dst]->poison_from, 0u, e - 1u);
  }
  // What this call's signals carry (signal_word): e, or 0 -- below every epoch target, so no
  // wait is satisfied by it -- in a spanning group given up for good, or a call given up here
  // (a receiver in another process cannot see this process's abort word). Decided here, before
  // the pushes, not at each signal as the one-thread signal kernel did: the pushed data (x or
  // GEMM partials of this rank's own inputs) does not depend on this rank's waits, so a signal
  // of a call given up later still hands over correct data.
  const bool silent = p.dead && (*(volatile uint32_t*)p.dead ||
                                 (p.abort && *(volatile uint32_t*)abort_word(p.abort, e) == e));
  *(volatile uint32_t*)signal_word(local) = silent ? 0u : e;
  __threadfence_system();
}

__global__ void ce_signal_arrival_kernel(const __grid_constant__ Peers p, int dst, int chunk,
                                         int stall_rank, int gathered) {
  const uint32_t e = p.flags[p.rank]->epoch + 1u;
  if (stall_rank == p.rank) return;
  // A spanning group given up for good, or this call given up here: the pushed data may be
  // garbage, and a receiver in another process cannot see this process's abort word.
  if (p.dead && (*(volatile uint32_t*)p.dead ||
                 (p.abort && *(volatile uint32_t*)abort_word(p.abort, e) == e)))
    return;
  // The copy before this kernel in stream order has completed; the system-scope fence orders its
  // writes (made by the copy engine) before the release as seen from the peer.
  __threadfence_system();
  Flags* f = p.flags[dst];
  st_release_sys(gathered ? &f->gathered[p.rank][chunk] : &f->arrive[p.rank][chunk][0], e);
}

__global__ void ce_wait_arrival_kernel(const __grid_constant__ Peers p, int src, int chunk, int op,
                                       uint64_t timeout_ns, ErrorRecord* err, int gathered) {
  Flags* local = p.flags[p.rank];
  const uint32_t e = local->epoch + 1u;
  const uint32_t* flag = gathered ? &local->gathered[src][chunk] : &local->arrive[src][chunk][0];
  const bool ok = wait_flag(flag, e, true, timeout_ns, err, p, {op, kWaitCeBlock, src, chunk});
  // A reduced chunk is released after the sender's own waits of this call: if one of them gave
  // up, the call's abort word was raised before (and is visible after the acquire above), and
  // the chunk is garbage.
  if (gathered && ok && p.abort && *(volatile uint32_t*)abort_word(p.abort, e) == e)
    local->gave_up = e;
  fence_proxy_async();  // the GEMM may read the staged block through TMA
}

// 8 elements (16 bytes) per thread and step; f32 sums.
template <typename T>
__global__ void sum_blocks_kernel(T* out, const T* own, const T* blocks, int count,
                                  int64_t stride, int64_t elems) {
  const int64_t vecs = elems / 8;
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; v < vecs; v += step) {
    float acc[8];
    uint4 a = reinterpret_cast<const uint4*>(own)[v];
    const T* pa = reinterpret_cast<const T*>(&a);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = (float)pa[i];
    for (int b = 0; b < count; ++b) {
      uint4 x = reinterpret_cast<const uint4*>(blocks + b * stride)[v];
      const T* px = reinterpret_cast<const T*>(&x);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += (float)px[i];
    }
    uint4 o;
    T* po = reinterpret_cast<T*>(&o);
#pragma unroll
    for (int i = 0; i < 8; ++i) po[i] = (T)acc[i];
    reinterpret_cast<uint4*>(out)[v] = o;
  }
  // the tail (elems % 8), by the first threads
  const int64_t t = vecs * 8 + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t < elems && t < vecs * 8 + 8) {
    float acc = (float)own[t];
    for (int b = 0; b < count; ++b) acc += (float)blocks[b * stride + t];
    out[t] = (T)acc;
  }
}

template <typename T>
__global__ void round_f32_kernel(T* out, const float* in, int64_t elems) {
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < elems; i += step)
    out[i] = (T)in[i];
}

}  // namespace

cudaError_t launch_round_f32(void* out, const float* in, int64_t elems, DType dtype,
                             cudaStream_t stream) {
  if (elems < 1) return cudaSuccess;
  const int threads = 256;
  const int grid = (int)std::min<int64_t>((elems + threads - 1) / threads, 132 * 8);
  if (dtype == DType::kBF16)
    round_f32_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(out), in, elems);
  else
    round_f32_kernel<__half><<<grid, threads, 0, stream>>>(static_cast<__half*>(out), in, elems);
  return cudaGetLastError();
}

cudaError_t launch_sum_blocks(void* out, const void* own, const void* blocks, int count,
                              int64_t stride, int64_t elems, DType dtype, int sms,
                              cudaStream_t stream) {
  const int threads = 256;
  const int64_t vecs = std::max<int64_t>(1, elems / 8);
  const int grid = (int)std::min<int64_t>((vecs + threads - 1) / threads, std::max(sms, 1) * 8);
  if (dtype == DType::kBF16)
    sum_blocks_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(out), static_cast<const __nv_bfloat16*>(own),
        static_cast<const __nv_bfloat16*>(blocks), count, stride, elems);
  else
    sum_blocks_kernel<__half><<<grid, threads, 0, stream>>>(
        static_cast<__half*>(out), static_cast<const __half*>(own),
        static_cast<const __half*>(blocks), count, stride, elems);
  return cudaGetLastError();
}

cudaError_t preload_ce_kernels() {
  cudaFuncAttributes attr;
  const void* fns[] = {(const void*)ce_wait_slot_free_kernel,
                       (const void*)ce_signal_arrival_kernel,
                       (const void*)ce_wait_arrival_kernel,
                       (const void*)sum_blocks_kernel<__nv_bfloat16>,
                       (const void*)sum_blocks_kernel<__half>,
                       (const void*)round_f32_kernel<__nv_bfloat16>,
                       (const void*)round_f32_kernel<__half>};
  for (const void* f : fns)
    if (cudaError_t e = cudaFuncGetAttributes(&attr, f)) return e;
  return cudaSuccess;
}

cudaError_t launch_ce_wait_slot_free(const Peers& peers, int dst, int op, uint64_t timeout_ns,
                                     ErrorRecord* err, cudaStream_t stream) {
  ce_wait_slot_free_kernel<<<1, 1, 0, stream>>>(peers, dst, op, timeout_ns, err);
  return cudaGetLastError();
}

cudaError_t launch_ce_signal_arrival(const Peers& peers, int dst, int chunk, int stall_rank,
                                     cudaStream_t stream, bool gathered) {
  if (gathered) {  // a reduced chunk: whether to signal is decided when it is sent (the kernel)
    ce_signal_arrival_kernel<<<1, 1, 0, stream>>>(peers, dst, chunk, stall_rank, 1);
    return cudaGetLastError();
  }
  if (stall_rank == peers.rank) return cudaSuccess;  // tests: this rank never signals
  Flags* local = peers.flags[peers.rank];
  uint32_t* flag = &peers.flags[dst]->arrive[peers.rank][chunk][0];
  // 4 bytes from this rank's signal word, read when the copy runs, so a replay carries its own
  // epoch (a captured stream write would carry the recording's: the trap in runtime/memops.h).
  // NCCL's copy-engine collectives signal peers by such a copy too. Measured on one GPU: a copy
  // within one device runs on an SM, like the kernel; whether a copy to a peer GPU does is for
  // the two-GPU run. Outside capture a stream write (cuStreamWriteValue32) of the host's call
  // number needs no SM, but that number is the device's epoch only while no call of the
  // workspace was ever captured -- by any op, now that workspaces are shared by size class --
  // and the final run of 2026-12-02 timed out on exactly that (flag 8, wanted 26): not used
  // until the workspace records its captures (docs/ordering-and-stream-memops.md section 3).
  return cudaMemcpyAsync(flag, signal_word(local), sizeof(uint32_t), cudaMemcpyDefault, stream);
}


cudaError_t launch_ce_wait_arrival(const Peers& peers, int src, int chunk, int op,
                                   uint64_t timeout_ns, ErrorRecord* err, cudaStream_t stream,
                                   bool gathered) {
  ce_wait_arrival_kernel<<<1, 1, 0, stream>>>(peers, src, chunk, op, timeout_ns, err,
                                              gathered ? 1 : 0);
  return cudaGetLastError();
}

}  // namespace jaxoverlap
