// Communication kernels of the fused GEMM + reduce-scatter and of the standalone TMA
// reduce-scatter. Protocol (rank r of n, epoch target e = Flags::epoch + 1 of this call):
//   sender CTA b, step t = 0 .. n-2, destination j = r + 1 + t (mod n):
//     wait slot_free[j] >= e - 1 (j consumed what we sent last call), then per chunk k:
//     [wait ready[t * chunks + k] >= e]  TMA: local block -> smem -> stage slot on rank j,
//     wait_group 0 (writes visible), st.release.sys arrive[r][k][b] = e on rank j.
//   receiver CTA: per chunk k, wait arrive[s][k][*] >= e for every s != r, then sum the n
//     contributions in rank order (f32), store, optionally release reduced[k][cta] = e.
// Sums are taken in a fixed order, never in arrival order, so results are bitwise repeatable.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/comm.h"

namespace jaxoverlap {
namespace {

__device__ __forceinline__ uint32_t call_target(const Peers& p) {
  return p.flags[p.rank]->epoch + 1u;
}

__device__ void sender(const CommArgs& a, char* smem, uint64_t* mbar, int b) {
  const Peers& p = a.peers;
  const int n = p.n, r = p.rank;
  Flags* local = p.flags[r];
  const uint32_t e = call_target(p);
  const int64_t chunk_bytes = a.block_bytes / a.chunks;
  const int64_t pieces = (chunk_bytes + kPieceBytes - 1) / kPieceBytes;
  for (int s = 0; s < kStages; ++s) mbar_init(&mbar[s], 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  uint32_t it = 0;  // loads issued by this CTA so far (stage = it % kStages)
  for (int t = 0; t < n - 1; ++t) {
    const int j = (r + 1 + t) % n;
    // Giving up here or below is clean: every earlier chunk's stores completed (wait_group 0).
    if (!wait_flag(&local->slot_free[j], e - 1u, true, a.timeout_ns, a.err, p,
                   {a.op, kWaitSlotFree, j, -1}))
      return;
    // The peer read its slot (generic proxy) before releasing it; our TMA stores (async proxy)
    // overwrite it. With wait_ready the fence after each ready wait below orders them too.
    if (!a.wait_ready) fence_proxy_async();
    const char* block = a.src + (int64_t)(a.src_by_step ? t : j) * a.block_bytes;
    char* dst_block = p.stage[j] + (int64_t)stage_slot(r, j, n) * a.block_bytes;
    for (int k = 0; k < a.chunks; ++k) {
      if (a.wait_ready) {
        if (!wait_flag(&local->ready[t * a.chunks + k], e, false, a.timeout_ns, a.err, p,
                       {a.op, kWaitGemmChunk, r, t * a.chunks + k}))
          return;
        fence_proxy_async();  // generic-proxy GEMM writes -> async-proxy (TMA) reads
      }
      const char* src = block + k * chunk_bytes;
      char* dst = dst_block + k * chunk_bytes;
      // my pieces: b, b + senders, ...
      const int64_t mine = pieces > b ? (pieces - 1 - b) / a.senders + 1 : 0;
      auto piece_off = [&](int64_t i) { return (b + i * a.senders) * (int64_t)kPieceBytes; };
      auto piece_len = [&](int64_t i) {
        const int64_t off = piece_off(i);
        return (uint32_t)(chunk_bytes - off < kPieceBytes ? chunk_bytes - off : kPieceBytes);
      };
      auto load = [&](int64_t i) {
        const uint32_t st = (it + i) % kStages;
        mbar_expect_tx(&mbar[st], piece_len(i));
        tma_load(smem + st * kPieceBytes, src + piece_off(i), piece_len(i), &mbar[st]);
      };
      for (int64_t i = 0; i < mine && i < kStages; ++i) load(i);
      for (int64_t i = 0; i < mine; ++i) {
        const uint32_t st = (it + i) % kStages;
        mbar_wait(&mbar[st], ((it + i) / kStages) & 1u);
        tma_store(dst + piece_off(i), smem + st * kPieceBytes, piece_len(i));
        tma_commit();
        // refill the stage of the previous piece once its store has read smem (keep one store
        // in flight while the next load is issued)
        if (i >= 1 && i - 1 + kStages < mine) {
          tma_wait_read<1>();
          load(i - 1 + kStages);
        }
      }
      // the last stage's refill (i = mine - 1 + 1) never happens inside the loop
      it += (uint32_t)mine;
      tma_wait_all();
      if (a.stall_rank != r) st_release_sys(&p.flags[j]->arrive[r][k][b], e);
    }
  }
}

// 8 packed 16-bit floats <-> f32, on whole 32-bit words (element access through a T* would make
// the compiler split 16-byte shared loads into 2-byte ones, with bank conflicts).
__device__ __forceinline__ float2 unpack2(uint32_t w, const __nv_bfloat16*) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
__device__ __forceinline__ float2 unpack2(uint32_t w, const __half*) {
  __half2 h;
  memcpy(&h, &w, sizeof(h));
  return __half22float2(h);
}
__device__ __forceinline__ uint32_t pack2(float a, float b, const __nv_bfloat16*) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);  // round to nearest even, like static_cast
  uint32_t w;
  memcpy(&w, &h, sizeof(w));
  return w;
}
__device__ __forceinline__ uint32_t pack2(float a, float b, const __half*) {
  __half2 h = __floats2half2_rn(a, b);
  uint32_t w;
  memcpy(&w, &h, sizeof(w));
  return w;
}

template <typename T>
__device__ __forceinline__ void add8(float* acc, const uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = unpack2(w[i], (const T*)nullptr);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float* acc) {
  return make_uint4(pack2(acc[0], acc[1], (const T*)nullptr), pack2(acc[2], acc[3], (const T*)nullptr),
                    pack2(acc[4], acc[5], (const T*)nullptr), pack2(acc[6], acc[7], (const T*)nullptr));
}

// Receiver CTA: per chunk, wait for every peer's arrival, then for each of its pieces TMA-load
// the n contributions (own block + staged peer blocks) into smem, sum them in rank order in f32,
// and TMA-store the sum. kRecvStages smem stages, so later loads overlap the sum of piece i; bulk
// copies keep enough bytes in flight per SM that a few CTAs keep up with NVLink.
template <typename T>
__device__ void receiver(const CommArgs& a, char* smem, uint64_t* mbar, int rb) {
  const Peers& p = a.peers;
  const int n = p.n, r = p.rank;
  const int nsrc = n;  // own block (if any) + n - 1 peers, each in its rank position
  Flags* local = p.flags[r];
  const uint32_t e = call_target(p);
  const int64_t chunk_bytes = a.block_bytes / a.chunks;
  const uint32_t piece = recv_piece_bytes(n);
  const int64_t pieces = (chunk_bytes + piece - 1) / piece;
  const int64_t mine = pieces > rb ? (pieces - 1 - rb) / a.receivers + 1 : 0;
  // smem: [stage][source] inputs, then [stage] outputs
  auto in_buf = [&](int st, int s) { return smem + ((int64_t)st * nsrc + s) * piece; };
  auto out_buf = [&](int st) { return smem + ((int64_t)kRecvStages * nsrc + st) * piece; };
  if (threadIdx.x == 0) {
    for (int st = 0; st < kRecvStages; ++st) mbar_init(&mbar[st], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  uint32_t it = 0;
  for (int k = 0; k < a.chunks; ++k) {
    bool ok = true;
    for (int idx = threadIdx.x; ok && idx < n * a.senders; idx += blockDim.x) {
      const int s = idx / a.senders, q = idx % a.senders;
      if (s != r)
        ok = wait_flag(&local->arrive[s][k][q], e, true, a.timeout_ns, a.err, p,
                       {a.op, kWaitArrival, s, k});
    }
    // The whole CTA gives up together; clean here: the previous chunk's stores completed.
    if (__syncthreads_or(!ok)) return;
    const char* srcs[kMaxRanks];
    for (int s = 0; s < n; ++s) {
      const char* base = s == r ? a.own
                                : p.stage[r] + (int64_t)stage_slot(s, r, n) * a.block_bytes;
      srcs[s] = base ? base + k * chunk_bytes : nullptr;
    }
    char* dst = a.out + k * chunk_bytes;
    auto off = [&](int64_t i) { return (rb + i * a.receivers) * (int64_t)piece; };
    auto len = [&](int64_t i) {
      return (uint32_t)(chunk_bytes - off(i) < piece ? chunk_bytes - off(i) : piece);
    };
    auto load = [&](int64_t i) {  // thread 0 only
      const int st = (it + i) % kRecvStages;
      uint32_t total = 0;
      for (int s = 0; s < n; ++s) total += srcs[s] ? len(i) : 0;
      mbar_expect_tx(&mbar[st], total);
      for (int s = 0; s < n; ++s)
        if (srcs[s]) tma_load(in_buf(st, s), srcs[s] + off(i), len(i), &mbar[st]);
    };
    if (threadIdx.x == 0) {
      fence_proxy_async();  // peers' staged data was acquired by generic loads of the flags
      for (int64_t i = 0; i < mine && i < kRecvStages; ++i) load(i);
    }
    for (int64_t i = 0; i < mine; ++i) {
      const int st = (it + i) % kRecvStages;
      if (threadIdx.x == 0) tma_wait_read<kRecvStages - 1>();  // out_buf(st) free again
      mbar_wait(&mbar[st], ((it + i) / kRecvStages) & 1u);
      __syncthreads();
      const int vecs = len(i) / 16;
      for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int s = 0; s < n; ++s)
          if (srcs[s]) add8<T>(acc, reinterpret_cast<const uint4*>(in_buf(st, s))[v]);
        reinterpret_cast<uint4*>(out_buf(st))[v] = pack8<T>(acc);
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic smem -> TMA store
      __syncthreads();
      if (threadIdx.x == 0) {
        tma_store(dst + off(i), out_buf(st), len(i));
        tma_commit();
        if (i + kRecvStages < mine) load(i + kRecvStages);
      }
    }
    it += (uint32_t)mine;
    if (threadIdx.x == 0) {
      tma_wait_all();
      if (a.signal_reduced) st_release_gpu(&local->reduced[k][rb], e);
    }
    __syncthreads();
  }
}

// One thread moves `bytes` from src to dst (either may be on a peer) through `stages` smem
// pieces of kPieceBytes: its pieces are b, b + nb, ... of kPieceBytes each. Loads run ahead;
// one store stays in flight while the stage before it is refilled. `before_store` runs once
// after the first loads are issued and before the first store (the place for a flag wait); if
// it returns false, the issued loads are drained and bulk_move returns false without storing.
// add: the store is a TMA bulk add at the destination (bf16 / f16, .noftz).
template <typename Pre>
__device__ bool bulk_move(char* dst, const char* src, int64_t bytes, int b, int nb, char* smem,
                          uint64_t* mbar, int stages, uint32_t& it, bool add, DType dt,
                          Pre before_store) {
  const int64_t pieces = (bytes + kPieceBytes - 1) / kPieceBytes;
  const int64_t mine = pieces > b ? (pieces - 1 - b) / nb + 1 : 0;
  auto off = [&](int64_t i) { return (b + i * nb) * (int64_t)kPieceBytes; };
  auto len = [&](int64_t i) {
    return (uint32_t)(bytes - off(i) < kPieceBytes ? bytes - off(i) : kPieceBytes);
  };
  auto load = [&](int64_t i) {
    const uint32_t st = (it + i) % stages;
    mbar_expect_tx(&mbar[st], len(i));
    tma_load(smem + st * kPieceBytes, src + off(i), len(i), &mbar[st]);
  };
  tma_wait_read<0>();  // the previous call's last stores have read their stages
  for (int64_t i = 0; i < mine && i < stages; ++i) load(i);
  if (!before_store()) {
    for (int64_t i = 0; i < mine && i < stages; ++i)
      mbar_wait(&mbar[(it + i) % stages], ((it + i) / stages) & 1u);
    return false;
  }
  for (int64_t i = 0; i < mine; ++i) {
    const uint32_t st = (it + i) % stages;
    mbar_wait(&mbar[st], ((it + i) / stages) & 1u);
    if (!add)
      tma_store(dst + off(i), smem + st * kPieceBytes, len(i));
    else if (dt == DType::kBF16)
      tma_reduce_add_bf16(dst + off(i), smem + st * kPieceBytes, len(i));
    else
      tma_reduce_add_f16(dst + off(i), smem + st * kPieceBytes, len(i));
    tma_commit();
    if (i >= 1 && i - 1 + stages < mine) {
      tma_wait_read<1>();  // the store of piece i - 1 has read its stage
      load(i - 1 + stages);
    }
  }
  it += (uint32_t)mine;
  return true;
}

// Reduce-push (n == 2), CTA b of nb; accumulator = this rank's staging slot. Warp 1's lane 0
// seeds the accumulator with the own block (chunk by chunk, releasing acc_ready to the peer),
// then copies each chunk of the accumulator to the output once the peer's add has arrived. Warp
// 0's lane 0 adds its pieces of the peer's block into the peer's accumulator (after the peer's
// acc_ready) and releases arrive. The pair (rank r, CTA b) only ever waits on (peer, CTA b).
// b is not blockIdx.x but the CTA's place in the order the CTAs started (a ticket of
// Flags::claim, as the tile schedule hands out tiles; issue 26, R6): the comm partition does not
// keep other kernels out (XLA's NCCL, other streams), so each GPU may run only a subset of the
// CTAs at first. With fixed indices two GPUs could run disjoint subsets, each CTA waiting on a
// peer CTA that cannot start until the timeout; with tickets the CTAs running on each GPU hold
// the smallest b, so the pairs below the smaller count always both run, finish and make room.
__global__ void __launch_bounds__(kReducePushThreads, 1)
    reduce_push_kernel(const __grid_constant__ CommArgs a) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t mbar[kPushStages + kLocalStages];
  __shared__ int ticket;
  const Peers& p = a.peers;
  Flags* local = p.flags[p.rank];
  const uint32_t e = call_target(p);
  if (threadIdx.x == 0) {
    // The call of epoch target e counts in claim[e & 1], which the finish of the previous call
    // zeroed (finish_epoch, common.cuh): every counted call ends with one, launched or not.
    ticket = (int)atomicAdd(&local->claim[e & 1u], 1u);
  }
  __syncthreads();
  const int r = p.rank, s = 1 - r, b = ticket, nb = gridDim.x;
  if (threadIdx.x % 32 != 0) return;
  const int64_t chunk_bytes = a.block_bytes / a.chunks;
  const bool signal = a.stall_rank != r;
  uint32_t it = 0;
  if (threadIdx.x == 0) {  // push: my block for the peer, added into its accumulator
    uint64_t* mb = mbar;
    for (int i = 0; i < kPushStages; ++i) mbar_init(&mb[i], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const char* src = a.src + (int64_t)s * a.block_bytes;
    char* acc = p.stage[s];  // n == 2: the peer's only slot
    for (int k = 0; k < a.chunks; ++k) {
      const bool ok = bulk_move(
          acc + k * chunk_bytes, src + k * chunk_bytes, chunk_bytes, b, nb, smem, mb, kPushStages,
          it, true, a.dtype, [&] {
            if (!wait_flag(&local->acc_ready[s][k][b], e, true, a.timeout_ns, a.err, p,
                           {a.op, kWaitAccReady, s, k}))
              return false;
            fence_proxy_async();  // the peer's seed (acquired above) before our adds
            return true;
          });
      if (!ok) return;  // the earlier chunks' adds completed (wait_group 0 below)
      tma_wait_all();  // adds complete and visible before the release
      if (signal) st_release_sys(&p.flags[s]->arrive[r][k][b], e);
    }
  } else if (threadIdx.x == 32) {  // seed, then copy out
    char* st = smem + kPushStages * kPieceBytes;
    uint64_t* mb = mbar + kPushStages;
    for (int i = 0; i < kLocalStages; ++i) mbar_init(&mb[i], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    char* acc = p.stage[r];
    for (int k = 0; k < a.chunks; ++k) {
      bulk_move(acc + k * chunk_bytes, a.own + k * chunk_bytes, chunk_bytes, b, nb, st, mb,
                kLocalStages, it, false, a.dtype, [] { return true; });
      tma_wait_all();
      if (signal) st_release_sys(&p.flags[s]->acc_ready[r][k][b], e);
    }
    for (int k = 0; k < a.chunks; ++k) {
      if (!wait_flag(&local->arrive[s][k][b], e, true, a.timeout_ns, a.err, p,
                     {a.op, kWaitArrival, s, k})) {
        tma_wait_all();  // the previous chunk's copy-out stores
        return;
      }
      fence_proxy_async();  // the peer's adds (acquired above) before our TMA reads
      bulk_move(a.out + k * chunk_bytes, acc + k * chunk_bytes, chunk_bytes, b, nb, st, mb,
                kLocalStages, it, false, a.dtype, [] { return true; });
    }
    tma_wait_all();
  }
}

template <typename T>
__global__ void __launch_bounds__(kCommThreads, 1) comm_kernel(const __grid_constant__ CommArgs a) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t mbar[kStages];
  if ((int)blockIdx.x < a.senders) {
    if (threadIdx.x == 0) sender(a, smem, mbar, blockIdx.x);
  } else {
    receiver<T>(a, smem, mbar, blockIdx.x - a.senders);
  }
}

__global__ void signal_ready_kernel(Flags* local, int index) {
  st_release_gpu(&local->ready[index], local->epoch + 1u);
}

__global__ void wait_chunk_kernel(const __grid_constant__ Peers p, int chunk, int count,
                                  int from_reduced, int op, uint64_t timeout_ns,
                                  ErrorRecord* err) {
  Flags* local = p.flags[p.rank];
  const uint32_t e = local->epoch + 1u;
  for (int s = 0; s < p.n; ++s) {
    if (s == p.rank) continue;
    const int q = threadIdx.x;
    if (q < count) {
      const uint32_t* f = from_reduced ? &local->reduced[chunk][q] : &local->arrive[s][chunk][q];
      if (!wait_flag(f, e, !from_reduced, timeout_ns, err, p,
                     {op, from_reduced ? kWaitReduced : kWaitArrival, s, chunk}))
        return;  // the GEMM that follows reads garbage; the join poisons the output
    }
    if (from_reduced) break;
  }
  fence_proxy_async();  // the GEMM may read the staged data through TMA
}

__global__ void release_slots_kernel(const __grid_constant__ Peers p) {
  const int s = threadIdx.x;
  const uint32_t e = p.flags[p.rank]->epoch + 1u;
  if (s < p.n && s != p.rank) st_release_sys(&p.flags[s]->slot_free[p.rank], e);
}

// The finish kernels (finish_epoch, finish_call: common.cuh).
__global__ void finish_kernel(Flags* local) { finish_epoch(local, local->epoch); }

// The finish kernel of a call with an output (finish_call, common.cuh). One block: the common case
// costs what finish_kernel costs.
__global__ void finish_poison_kernel(Flags* local, uint16_t* out, int64_t elems, uint16_t* out2,
                                     int64_t elems2, uint16_t nan, int force, ErrorRecord* err,
                                     int device, int rank, uint32_t* abort, int op) {
  finish_call(local, out, elems, out2, elems2, nan, force, err, device, rank, abort, op);
}

}  // namespace

cudaError_t preload_comm_kernels() {
  cudaFuncAttributes attr;
  cudaError_t e;
  if ((e = cudaFuncSetAttribute(comm_kernel<__nv_bfloat16>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, kCommSmem)))
    return e;
  if ((e = cudaFuncSetAttribute(comm_kernel<__half>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                kCommSmem)))
    return e;
  if ((e = cudaFuncSetAttribute(reduce_push_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                kReducePushSmem)))
    return e;
  const void* fns[] = {(const void*)comm_kernel<__nv_bfloat16>, (const void*)comm_kernel<__half>,
                       (const void*)signal_ready_kernel,        (const void*)wait_chunk_kernel,
                       (const void*)release_slots_kernel,       (const void*)finish_kernel,
                       (const void*)reduce_push_kernel,         (const void*)finish_poison_kernel};
  for (const void* f : fns)
    if ((e = cudaFuncGetAttributes(&attr, f))) return e;
  return cudaSuccess;
}

cudaError_t launch_comm(const CommArgs& a, cudaStream_t stream) {
  if (a.reduce_push) {
    reduce_push_kernel<<<a.senders, kReducePushThreads, kReducePushSmem, stream>>>(a);
    return cudaGetLastError();
  }
  const int grid = a.senders + a.receivers;
  if (a.dtype == DType::kBF16)
    comm_kernel<__nv_bfloat16><<<grid, kCommThreads, kCommSmem, stream>>>(a);
  else
    comm_kernel<__half><<<grid, kCommThreads, kCommSmem, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_signal_ready(Flags* local, int index, cudaStream_t stream) {
  signal_ready_kernel<<<1, 1, 0, stream>>>(local, index);
  return cudaGetLastError();
}

cudaError_t launch_wait_chunk(const Peers& peers, int chunk, int count, int from_reduced, int op,
                              uint64_t timeout_ns, ErrorRecord* err, cudaStream_t stream) {
  wait_chunk_kernel<<<1, kMaxSenders, 0, stream>>>(peers, chunk, count, from_reduced, op,
                                                   timeout_ns, err);
  return cudaGetLastError();
}

cudaError_t launch_release_slots(const Peers& peers, cudaStream_t stream) {
  release_slots_kernel<<<1, kMaxRanks, 0, stream>>>(peers);
  return cudaGetLastError();
}

cudaError_t launch_finish_poison(Flags* local, void* out, int64_t bytes, DType dtype,
                                 cudaStream_t stream, bool force, void* out2, int64_t bytes2,
                                 ErrorRecord* err, int device, int rank, uint32_t* abort,
                                 int op) {
  const uint16_t nan = dtype == DType::kBF16 ? 0x7fc0u : 0x7e00u;
  finish_poison_kernel<<<1, 256, 0, stream>>>(local, static_cast<uint16_t*>(out), bytes / 2,
                                              static_cast<uint16_t*>(out2), out2 ? bytes2 / 2 : 0,
                                              nan, force ? 1 : 0, err, device, rank, abort, op);
  return cudaGetLastError();
}

cudaError_t launch_finish(Flags* local, cudaStream_t stream) {
  finish_kernel<<<1, 1, 0, stream>>>(local);
  return cudaGetLastError();
}

}  // namespace jaxoverlap
