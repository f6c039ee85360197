// Copy-engine protocol kernels: the data moves with the copy engine (cudaMemcpyAsync, no SMs);
// these one-thread kernels and stream writes order it across GPUs. Used by the fused all-gather +
// GEMM (jaxoverlap_ag_gemm_v1), the copy-engine GEMM + reduce-scatter (handlers/gemm_rs_ce.cc) and
// the dgrad reduce-scatter beside the wgrad GEMM (handlers/dgrad_rs_wgrad.cc), which pushes blocks
// of its dgrad partial the same way and sums what arrives (sum_blocks_kernel), and by the gather
// half of the fused GEMM + all-reduce (its own flags, Flags::gathered).
// Protocol, as the all-gather uses it (rank r of n, workspace epoch e = Flags::epoch + 1 of this
// call, never reset; `call` and `landed` are words of the receiver's Flags, below):
//   copy stream, for each destination j = r + 1, ..., r - 1 (mod n):
//     wait slot_free[j] >= e - 1 on r (j's waits of the previous call are over), then on j:
//     landed[r] = 0, then call[r] = e (a release: "r's pushes of call e follow");
//     per chunk k: copy x chunk k -> j's slot for r, then landed[r] = k + 1 on j by a stream
//     write (cuStreamWriteValue32: no SM, and a constant, so a CUDA graph replays it right).
//   GEMM stream: own block first, then for each source s = r - 1, ..., r + 1 (mod n), per chunk:
//     wait call[s] >= e, then landed[s] >= k + 1, on r; GEMM on the slot; last, release
//     slot_free[r] = e on every peer (launch_release_slots), and the finish kernel advances the
//     epoch after the join.
#include <algorithm>
#include <atomic>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/ce.h"
#include "runtime/memops.h"

namespace jaxoverlap {
namespace {

// The copy-engine signals (issue 26, R5; docs/ordering-and-stream-memops.md section 3), in words
// of the receiver's Flags, per source rank s:
//   call[s]   -- the epoch target of the call whose pushes from s follow, written by s's slot-free
//                wait kernel (a kernel reads the device's epoch, so a graph replay writes the
//                replay's);
//   landed[s] -- how many chunks of that call have landed, written after each push by a stream
//                write of a constant (k + 1): no SM, and right on every replay of a captured call
//                whatever ran on the workspace between (the host's call number is not the
//                device's epoch once any op sharing the workspace was captured: run 57).
// The slot-free kernel zeroes landed[s] before it raises call[s], with a release; the receiver
// waits call[s] >= e before landed[s] >= k + 1, so a count of an earlier call is never taken for
// this one. The words are Flags::pad0[0, 2 kMaxRanks), unused by every other kernel
// (kernels/common.cuh is left alone: editing it recompiles every CUTLASS instantiation; give them
// names there at its next change).
// (ce.h: ce_call_word, ce_landed_word).

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
  // Announce this call's pushes to `dst` (ce.h: ce_call_word): its count of landed chunks back
  // to 0, then, with a release, the call. `dst` read both words of the previous call before it
  // released the slot, so nothing of that call is overwritten under its waits. Not announced --
  // the receiver's wait then gives up on its own dead word or times out -- in a spanning group
  // given up for good, or a call given up here (a receiver in another process cannot see this
  // process's abort word). Decided here, before the pushes, not at each signal as the one-thread
  // signal kernel did: the pushed data (x or GEMM partials of this rank's own inputs) does not
  // depend on this rank's waits, so a signal of a call given up later still hands over correct
  // data.
  const bool silent = p.dead && (*(volatile uint32_t*)p.dead ||
                                 (p.abort && *(volatile uint32_t*)abort_word(p.abort, e) == e));
  if (silent) return;
  Flags* peer = p.flags[dst];
  *(volatile uint32_t*)ce_landed_word(peer, p.rank) = 0u;
  __threadfence_system();
  st_release_sys(ce_call_word(peer, p.rank), e);
}

// The reduced chunks of the all-reduce (Flags::gathered), and the landed count of a chunk when the
// driver refuses the stream write (launch_ce_signal_arrival): one thread, so an SM.
__global__ void ce_signal_arrival_kernel(const __grid_constant__ Peers p, int dst, int chunk,
                                         int stall_rank, int gathered) {
  const uint32_t e = p.flags[p.rank]->epoch + 1u;
  if (stall_rank == p.rank) return;
  // The copy before this kernel in stream order has completed; the system-scope fence orders its
  // writes (made by the copy engine) before the release as seen from the peer.
  if (!gathered) {
    __threadfence_system();
    st_release_sys(ce_landed_word(p.flags[dst], p.rank), (uint32_t)chunk + 1u);
    return;
  }
  // A spanning group given up for good, or this call given up here: the reduced chunk is
  // computed after this rank's own waits and may be garbage, and a receiver in another process
  // cannot see this process's abort word.
  if (p.dead && (*(volatile uint32_t*)p.dead ||
                 (p.abort && *(volatile uint32_t*)abort_word(p.abort, e) == e)))
    return;
  __threadfence_system();
  st_release_sys(&p.flags[dst]->gathered[p.rank][chunk], e);
}

__global__ void ce_wait_arrival_kernel(const __grid_constant__ Peers p, int src, int chunk, int op,
                                       uint64_t timeout_ns, ErrorRecord* err, int gathered) {
  Flags* local = p.flags[p.rank];
  const uint32_t e = local->epoch + 1u;
  const WaitSite site{op, kWaitCeBlock, src, chunk};
  if (!gathered) {
    // The source announced this call (its slot-free wait ran), then chunk `chunk` landed. One
    // timeout for both: the second wait gets what the first left of it. A report of the second
    // shows the count of landed chunks as its flag (wanted: chunk + 1).
    const uint64_t t0 = global_ns();
    if (wait_flag(ce_call_word(local, src), e, true, timeout_ns, err, p, site)) {
      const uint64_t spent = global_ns() - t0;
      wait_flag(ce_landed_word(local, src), (uint32_t)chunk + 1u, true,
                spent < timeout_ns ? timeout_ns - spent : 0, err, p, site);
    }
    fence_proxy_async();  // the GEMM may read the staged block through TMA
    return;
  }
  const bool ok = wait_flag(&local->gathered[src][chunk], e, true, timeout_ns, err, p, site);
  // A reduced chunk is released after the sender's own waits of this call: if one of them gave
  // up, the call's abort word was raised before (and is visible after the acquire above), and
  // the chunk is garbage.
  if (ok && p.abort && *(volatile uint32_t*)abort_word(p.abort, e) == e) local->gave_up = e;
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

namespace {
std::atomic<int64_t> g_signal_fallbacks{0};
}  // namespace

cudaError_t launch_ce_signal_arrival(const Peers& peers, int dst, int chunk, int stall_rank,
                                     cudaStream_t stream, bool gathered) {
  if (gathered) {  // a reduced chunk: whether to signal is decided when it is sent (the kernel)
    ce_signal_arrival_kernel<<<1, 1, 0, stream>>>(peers, dst, chunk, stall_rank, 1);
    return cudaGetLastError();
  }
  if (stall_rank == peers.rank) return cudaSuccess;  // tests: this rank never signals
  // A stream write of a constant, in stream order after the push, with the default fence before
  // it: no SM (measured: a kernel holding every SM of the device does not delay it), and, being
  // a constant, right on every replay of a captured call (docs/ordering-and-stream-memops.md,
  // section 3). A driver that refuses it (an address it cannot write by a stream operation: not
  // seen; CUDA documents none for peer or IPC mappings) gets the one-thread kernel instead,
  // counted (ce_signal_fallbacks).
  uint32_t* landed = ce_landed_word(peers.flags[dst], peers.rank);
  if (stream_write_u32(stream, landed, (uint32_t)chunk + 1u) == cudaSuccess) return cudaSuccess;
  cudaGetLastError();
  g_signal_fallbacks.fetch_add(1, std::memory_order_relaxed);
  ce_signal_arrival_kernel<<<1, 1, 0, stream>>>(peers, dst, chunk, stall_rank, 0);
  return cudaGetLastError();
}

int64_t ce_signal_fallbacks() { return g_signal_fallbacks.load(std::memory_order_relaxed); }

cudaError_t launch_ce_wait_arrival(const Peers& peers, int src, int chunk, int op,
                                   uint64_t timeout_ns, ErrorRecord* err, cudaStream_t stream,
                                   bool gathered) {
  ce_wait_arrival_kernel<<<1, 1, 0, stream>>>(peers, src, chunk, op, timeout_ns, err,
                                              gathered ? 1 : 0);
  return cudaGetLastError();
}

}  // namespace jaxoverlap
