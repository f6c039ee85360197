// Flag kernels of the fused all-gather + GEMM (jaxoverlap_ag_gemm_v1). The data moves with the
// copy engine (cudaMemcpyAsync, no SMs); these one-thread kernels order it across GPUs.
// Protocol (rank r of n, workspace epoch e = Flags::epoch + 1 of this call, never reset):
//   copy stream, for each destination j = r + 1, ..., r - 1 (mod n):
//     wait slot_free[j] >= e - 1 on r (j's GEMMs of the previous call no longer read the slot),
//     per chunk k: copy x chunk k -> j's slot for r, then release arrive[r][k][0] = e on j.
//   GEMM stream: own block first, then for each source s = r - 1, ..., r + 1 (mod n), per chunk:
//     wait arrive[s][k][0] >= e on r, GEMM on the slot; last, release slot_free[r] = e on every
//     peer (launch_release_slots), and the finish kernel advances the epoch after the join.
#include "kernels/ag.h"

namespace jaxoverlap {
namespace {

__global__ void ag_wait_slot_free_kernel(const __grid_constant__ Peers p, int dst,
                                         uint64_t timeout_ns, ErrorRecord* err) {
  const Flags* local = p.flags[p.rank];
  const uint32_t e = local->epoch + 1u;
  // The copy behind this kernel runs whatever it returns, so it must not give up on the call's
  // abort word: `dst` may still be reading the slot for its previous call (a host that failed
  // this call runs ahead of its GPU). Every counted call releases the slot (failed and refused
  // ones too, close_call), so only a peer that truly stalls ends this wait -- at the timeout.
  Peers q = p;
  q.abort = nullptr;
  if (!wait_flag(&local->slot_free[dst], e - 1u, true, timeout_ns, err, q,
                 {kOpAgGemm, kWaitSlotFree, dst, -1}) &&
      p.abort) {
    *(volatile uint32_t*)abort_word(p.abort, e) = e;  // timed out: give it up on every rank
    __threadfence_system();
  }
}

__global__ void ag_signal_arrival_kernel(const __grid_constant__ Peers p, int dst, int chunk,
                                         int stall_rank) {
  const uint32_t e = p.flags[p.rank]->epoch + 1u;
  if (stall_rank == p.rank) return;
  // The copy before this kernel in stream order has completed; the system-scope fence orders its
  // writes (made by the copy engine) before the release as seen from the peer.
  __threadfence_system();
  st_release_sys(&p.flags[dst]->arrive[p.rank][chunk][0], e);
}

__global__ void ag_wait_arrival_kernel(const __grid_constant__ Peers p, int src, int chunk,
                                       uint64_t timeout_ns, ErrorRecord* err) {
  const Flags* local = p.flags[p.rank];
  const uint32_t e = local->epoch + 1u;
  wait_flag(&local->arrive[src][chunk][0], e, true, timeout_ns, err, p,
            {kOpAgGemm, kWaitAgBlock, src, chunk});
  fence_proxy_async();  // the GEMM may read the staged block through TMA
}

}  // namespace

cudaError_t preload_ag_kernels() {
  cudaFuncAttributes attr;
  const void* fns[] = {(const void*)ag_wait_slot_free_kernel, (const void*)ag_signal_arrival_kernel,
                       (const void*)ag_wait_arrival_kernel};
  for (const void* f : fns)
    if (cudaError_t e = cudaFuncGetAttributes(&attr, f)) return e;
  return cudaSuccess;
}

cudaError_t launch_ag_wait_slot_free(const Peers& peers, int dst, uint64_t timeout_ns,
                                     ErrorRecord* err, cudaStream_t stream) {
  ag_wait_slot_free_kernel<<<1, 1, 0, stream>>>(peers, dst, timeout_ns, err);
  return cudaGetLastError();
}

cudaError_t launch_ag_signal_arrival(const Peers& peers, int dst, int chunk, int stall_rank,
                                     cudaStream_t stream) {
  ag_signal_arrival_kernel<<<1, 1, 0, stream>>>(peers, dst, chunk, stall_rank);
  return cudaGetLastError();
}

cudaError_t launch_ag_wait_arrival(const Peers& peers, int src, int chunk, uint64_t timeout_ns,
                                   ErrorRecord* err, cudaStream_t stream) {
  ag_wait_arrival_kernel<<<1, 1, 0, stream>>>(peers, src, chunk, timeout_ns, err);
  return cudaGetLastError();
}

}  // namespace jaxoverlap
