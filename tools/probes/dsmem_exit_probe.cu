// One-GPU probe (issue 25 item 3): racecheck's "Potential invalid __shared__ write ... located in a
// block that might have already exited" at ClaimScheduler::publish (ffi/kernels/tile_sched.cuh),
// reproduced with the claim ring's distributed-shared-memory pattern alone, in three modes:
//   0 (the tile kernel's): the leader CTA's thread 0 writes entry k of a 16-entry ring, a 64-bit
//     word ((k + 1) << 32) | tile, into every CTA of its cluster (mapa + st.relaxed.cluster); in
//     every CTA some threads spin (ld.volatile) on entry k until its tag reads k + 1 and take the
//     tile; entry k is rewritten (k + 16) only after every reader passed it (here: a cluster
//     barrier every 16 entries, the tile kernel's mainloop mbarriers in the real one). No cluster
//     barrier before exit: every store into a peer is awaited by a reader there, so the peer
//     cannot exit before it lands (the CUDA guide's requirement: all distributed shared memory
//     operations happen before the target block exits).
//   1: the same with a cluster barrier (barrier.cluster.arrive.release / wait.acquire) before exit.
//   2: a real hazard: mode 0 plus one more store into the peers (tag kEntries + 1) that no reader
//     awaits -- the peer may really have exited before it lands.
// Every reader checks each tile it takes and counts them; the host checks the counts: the
// protocol is exact in every mode. Run each mode under compute-sanitizer --tool racecheck: if
// modes 0 and 2 get the same report and mode 1 none, the report is the tool's rule (a remote
// shared-memory store not followed by a cluster barrier), not evidence of a lost store.
//   nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a \
//        -o build/probes/dsmem_exit_probe tools/probes/dsmem_exit_probe.cu
//   dsmem_exit_probe MODE      (prints "mode M OK ..." or "mode M FAILED ...")
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "probe_check.h"

constexpr int kRing = 16, kEntries = 40, kCluster = 2, kClusters = 4, kThreads = 128;

__device__ __forceinline__ uint32_t cta_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

// The claim ring's store (tile_sched.cuh, ClaimScheduler::publish): entry k into every CTA.
__device__ __forceinline__ void publish(uint64_t* ring, uint32_t k, uint32_t tile) {
  const uint64_t v = ((uint64_t)(k + 1) << 32) | tile;
  const uint32_t local = (uint32_t)__cvta_generic_to_shared(ring + k % kRing);
  for (uint32_t c = 0; c < kCluster; ++c) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(c));
    asm volatile("st.relaxed.cluster.shared::cluster.b64 [%0], %1;" ::"r"(remote), "l"(v)
                 : "memory");
  }
}

// The claim ring's read (ClaimScheduler::claim): spin until entry k's tag reads k + 1.
__device__ __forceinline__ uint32_t take(const uint64_t* ring, uint32_t k) {
  uint64_t v;
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(ring + k % kRing);
  do {
    asm volatile("ld.volatile.shared.b64 %0, [%1];" : "=l"(v) : "r"(a) : "memory");
  } while ((uint32_t)(v >> 32) != k + 1);
  return (uint32_t)v;
}

__global__ void __cluster_dims__(kCluster, 1, 1) ring_kernel(int mode, int* taken, int* wrong) {
  __shared__ uint64_t ring[kRing];
  if (threadIdx.x < kRing) ring[threadIdx.x] = 0;
  asm volatile("fence.acq_rel.cluster;" ::: "memory");
  cluster_sync();  // every ring cleared before the leader writes into it
  const bool leader = cta_rank() == 0 && threadIdx.x == 0;
  const bool reader = threadIdx.x % 32 == 0;  // lane 0 of every warp (the leader's too: below)
  const uint32_t cluster = blockIdx.x / kCluster;
  for (uint32_t k = 0; k < kEntries; ++k) {
    if (k > 0 && k % kRing == 0) cluster_sync();  // every reader past entries k - 16 .. k - 1
    const uint32_t tile = cluster * 1000 + k;
    if (leader) publish(ring, k, tile);
    if (reader) {
      const uint32_t t = take(ring, k);
      if (t != tile) atomicAdd(wrong, 1);
      atomicAdd(taken, 1);
    }
  }
  if (mode == 2 && leader) publish(ring, kEntries, 0);  // awaited by no one
  if (mode == 1) cluster_sync();
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  int *taken, *wrong;
  CK(cudaMalloc(&taken, sizeof(int)));
  CK(cudaMalloc(&wrong, sizeof(int)));
  CK(cudaMemset(taken, 0, sizeof(int)));
  CK(cudaMemset(wrong, 0, sizeof(int)));
  ring_kernel<<<kCluster * kClusters, kThreads>>>(mode, taken, wrong);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  int h_taken = 0, h_wrong = 0;
  CK(cudaMemcpy(&h_taken, taken, sizeof(int), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&h_wrong, wrong, sizeof(int), cudaMemcpyDeviceToHost));
  const int want = kCluster * kClusters * (kThreads / 32) * kEntries;
  const bool ok = h_taken == want && h_wrong == 0;
  std::printf("mode %d %s: %d of %d ring entries taken, %d wrong\n", mode, ok ? "OK" : "FAILED",
              h_taken, want, h_wrong);
  return ok ? 0 : 1;
}
