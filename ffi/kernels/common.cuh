// Device-side building blocks shared by the jaxoverlap kernels: the per-workspace flag block,
// the peer table, the error record, .sys/.gpu release/acquire, bounded waits, TMA wrappers.
// Device code only: never include XLA or nanobind headers here.
#pragma once

#include <cstdint>
#include <cstdio>

namespace jaxoverlap {

constexpr int kMaxRanks = 8;     // peers in one group (NVLink domain of one host)
constexpr int kMaxChunks = 16;   // sub-chunks a row block is split into
constexpr int kMaxSenders = 32;  // sender CTAs of one comm kernel (one arrival flag each)

enum OpCode : int32_t {
  kOpGemmRs = 1,
  kOpReduceScatter = 2,
  kOpAgGemm = 3,
  kOpDgradRs = 4,  // the dgrad reduce-scatter beside the wgrad GEMM (handlers/dgrad_rs_wgrad.cc)
  kOpGemmAr = 5,   // the fused GEMM + all-reduce (handlers/gemm_rs.cc, all-reduce mode)
};
enum WaitWhat : int32_t {
  kWaitGemmChunk = 1,  // comm kernel waited for the local GEMM to finish a chunk
  kWaitSlotFree = 2,   // comm kernel waited for a peer to release its staging slot (last call)
  kWaitArrival = 3,    // a consumer waited for a peer's pushed chunk
  kWaitReduced = 4,    // the GEMM waited for the locally reduced peer sum (n > 2)
  kWaitAccReady = 5,   // reduce-push: waited for the owner to seed its accumulator
  kWaitCeBlock = 6,    // a block pushed by a peer's copy engine (x for the all-gather + GEMM)
  kPeerGaveUp = 7,     // no wait: a peer process gave up and marked this call (Flags::poison_from)
  kWaitTile = 8,       // an own tile waited for a peer's slab of the same tile (tile_rs.cuh)
};

// Lives in host-mapped pinned memory so the host reads it without synchronising with the GPU.
struct ErrorRecord {
  int32_t set;  // 0 free, 2 being written by a kernel, 1 written (claim_error_record)
  int32_t op, what, device, rank, peer, chunk;
  uint32_t target, seen;
  double waited_s;
};

// One per (workspace, device); in device memory of that device; peers write into it over
// NVLink. Flags are monotonic epochs: never reset, compared as (int32_t)(value - target) >= 0.
struct Flags {
  uint32_t epoch;    // calls completed on this workspace (incremented by the finish kernel)
  uint32_t gave_up;  // epoch target of the last call in which a wait of this rank gave up
  // Groups that span processes: set once (0 -> epoch target) by a peer whose copy engine may have
  // overwritten this rank's staging while that call or a later one could still read it
  // (ce.cu, ce_wait_slot_free_kernel); every finish from that call on fills its output with NaN
  // and reports it. Sticky: the group is given up for good by then.
  uint32_t poison_from;
  // The tile-fused GEMM + reduce-scatter (tile_rs.cuh): tiles handed out so far in the call of
  // each epoch parity (the call of one parity zeroes the other's).
  uint32_t claim[2];
  // The tile kernel's CTAs that have ended in the call of each epoch parity (tile_rs.cuh,
  // end_call: the last one finishes the call); zeroed as claim is.
  uint32_t exits[2];
  uint32_t pad0[25];
  uint32_t ready[kMaxRanks * kMaxChunks];                  // local GEMM chunk finished
  uint32_t arrive[kMaxRanks][kMaxChunks][kMaxSenders];    // [source rank][chunk][sender CTA]
  uint32_t slot_free[kMaxRanks];                           // [dest rank]: dest consumed my data
  uint32_t reduced[kMaxChunks][kMaxSenders];               // n > 2: [chunk][receiver CTA]
  uint32_t acc_ready[kMaxRanks][kMaxChunks][kMaxSenders];  // [owner rank][chunk][CTA]: the
                                                           // owner's accumulator holds its block
  // [source rank][chunk]: the source's reduced chunk pushed by its copy engine (the gather half
  // of the GEMM + all-reduce; apart from `arrive`, which its reduce-scatter half uses in the
  // same call).
  uint32_t gathered[kMaxRanks][kMaxChunks];
};

// The group as a kernel sees it (passed by value, __grid_constant__).
struct Peers {
  int32_t n, rank, device;
  char* stage[kMaxRanks];  // staging area on each rank (n - 1 slots of one block)
  Flags* flags[kMaxRanks];  // flag block on each rank
  char* gather[kMaxRanks];  // the all-reduce's gather staging on each rank (host-side pushes)
  // Host-mapped, one ring of kAbortSlots words per workspace, polled by every wait: slot
  // e % kAbortSlots holds e when the call with epoch target e was given up by some rank (a wait
  // timed out, its host failed after the peers launched, or it was issued out of order). Every
  // wait of that call then gives up too, so no rank spins on a partner that left. A ring, not
  // one word: consecutive calls given up (two programs' calls paired in opposite orders) must
  // not overwrite each other's abort before the waits saw it. Slot i starts at i ^ 1, a value
  // no epoch of that slot has. One ring per process: in a group that spans processes, a peer
  // process's abort is not seen here; the waits of its call end by their timeout instead.
  uint32_t* abort;
  // Groups that span processes only (else null): a host-mapped word of this process, shared by
  // all its spanning workspaces, set to 1 by the first wait that times out in any of them (or by
  // the host when it reports a failure): the peer process may be dead, so from then on every
  // wait of every spanning call gives up at once instead of waiting out its own timeout (the
  // calls already launched ahead, e.g. the rest of a lax.scan, would each take one).
  uint32_t* dead;
};

constexpr uint32_t kAbortSlots = 64;  // a power of 2
// The abort word of the call with epoch target `e` (Peers::abort).
__host__ __device__ inline uint32_t* abort_word(uint32_t* abort, uint32_t e) {
  return abort + (e & (kAbortSlots - 1));
}

// Staging slot on rank `dst` that holds the data sent by rank `src`.
__host__ __device__ inline int stage_slot(int src, int dst, int n) { return (src - dst - 1 + n) % n; }

#ifdef __CUDACC__

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_relaxed(const uint32_t* p, bool sys) {
  uint32_t v;
  if (sys)
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// fence.acq_rel: an acquire after relaxed loads, or (followed by a strong store) a release.
__device__ __forceinline__ void fence_acq_rel(bool sys) {
  if (sys)
    asm volatile("fence.acq_rel.sys;" ::: "memory");
  else
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}
__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async;" ::: "memory"); }

// The error record has one writer per report: the first thread to claim it (set 0 -> 2, "being
// written"; hundreds of warps may time out within microseconds), which fills the fields and then
// publishes it (set = 1). The host reads a record only once it is 1 (runtime.cc) and clears it to
// 0. Null: not claimed (no record, or another thread's report stands).
__device__ __forceinline__ volatile ErrorRecord* claim_error_record(ErrorRecord* err) {
  if (!err || atomicCAS_system(&err->set, 0, 2) != 0) return nullptr;
  return err;
}
__device__ __forceinline__ void publish_error_record(volatile ErrorRecord* r) {
  __threadfence_system();
  r->set = 1;
}

// Every counted call ends with one finish: comm.cu's finish kernels (the join, close_call), or the
// tile kernel's last CTA (tile_rs.cuh, end_call). The epoch advances, and the ticket counters of
// the next call (Flags::claim of its epoch parity: the reduce-push CTAs, the tile schedule's
// tiles; Flags::exits) are zeroed -- here, not by the next call's kernel, because a call refused
// or given up before its launch runs no kernel but this one, and the counter of the call after
// it would otherwise still hold the count of two calls before.
__device__ __forceinline__ void finish_epoch(Flags* local, uint32_t epoch) {
  local->claim[(epoch + 2u) & 1u] = 0;  // the next call's target is epoch + 2
  local->exits[(epoch + 2u) & 1u] = 0;
  local->epoch = epoch + 1u;
}

// The finish of a call with an output, by every thread of one CTA: if a wait of this rank gave
// up in this call (or `force`: its host failed), or a peer process poisoned it
// (Flags::poison_from; reported in `err` if given, as a call of `op`), the output is wrong: fill
// it with NaN (16-bit pattern `nan`) so it cannot pass for a result; then advance the epoch.
// `abort` (with `force`): raise the call's abort word first, by the epoch the device counted
// (close_call, handlers/fused_call.h).
__device__ inline void finish_call(Flags* local, uint16_t* out, int64_t elems, uint16_t* out2,
                                   int64_t elems2, uint16_t nan, int force, ErrorRecord* err,
                                   int device, int rank, uint32_t* abort, int op) {
  const uint32_t epoch = local->epoch;
  if (force && abort && threadIdx.x == 0) {
    *(volatile uint32_t*)abort_word(abort, epoch + 1u) = epoch + 1u;
    __threadfence_system();
  }
  const uint32_t from = *(volatile uint32_t*)&local->poison_from;
  const bool poisoned = from && (int32_t)(epoch + 1u - from) >= 0;
  if (poisoned && err && threadIdx.x == 0) {
    if (volatile ErrorRecord* r = claim_error_record(err)) {
      r->op = op;  // the call's op (OpCode), so the report names it
      r->what = kPeerGaveUp;
      r->device = device;
      r->rank = rank;
      r->peer = -1;
      r->chunk = -1;
      r->target = epoch + 1u;
      r->seen = from;
      r->waited_s = 0;
      publish_error_record(r);
    }
  }
  if (force || poisoned || local->gave_up == epoch + 1u) {
    for (int64_t i = threadIdx.x; i < elems; i += blockDim.x) out[i] = nan;
    for (int64_t i = threadIdx.x; i < elems2; i += blockDim.x) out2[i] = nan;
  }
  __syncthreads();
  if (threadIdx.x == 0) finish_epoch(local, epoch);
}

struct WaitSite {
  int32_t op, what, peer, chunk;
};

// Spins until *p reaches `target` (monotonic epochs) and returns true. Gives up and returns
// false when the call is aborted (its abort word, abort_word(Peers::abort, e), holds the call's
// epoch target `e`, set by another wait or by a host; also checked when the flag was satisfied
// only by a later call's value) or after `timeout_ns`; a timeout fills the host-mapped error
// record, prints it and sets the abort word. Either way it marks this rank's Flags::gave_up = e
// (the join then fills the outputs with NaN). Callers stop issuing work, drain their TMA
// operations and return: no __trap, so the CUDA context stays usable and the next call works.
// Polls with relaxed loads and a short sleep (acquire loads in a tight loop slow the memory
// traffic of everything else on the GPU), then makes the observation an acquire with a fence.
// kPrint: also print the timeout (a function call: kernels issuing wgmma use wait_flag_inline,
// which does not, or ptxas serialises their wgmma; the host reports the record either way).
template <bool kPrint>
__device__ __forceinline__ bool wait_flag_impl(const uint32_t* p, uint32_t target, bool sys,
                                               uint64_t timeout_ns, ErrorRecord* err,
                                               const Peers& peers, WaitSite site) {
  uint32_t v = ld_relaxed(p, sys);
  if ((int32_t)(v - target) < 0) {
    Flags* local = peers.flags[peers.rank];
    const uint32_t e = ld_relaxed(&local->epoch, false) + 1u;
    volatile uint32_t* abort = peers.abort ? abort_word(peers.abort, e) : nullptr;
    volatile uint32_t* dead = peers.dead;
    const uint64_t t0 = global_ns();
    uint32_t spins = 0;
    while (true) {
      __nanosleep(32);
      v = ld_relaxed(p, sys);
      if ((int32_t)(v - target) >= 0) break;
      if ((++spins & 63u) == 0) {
        // The abort word is in host memory (a PCIe read): look at it every 1024 polls only.
        if ((spins & 1023u) == 0 && ((abort && *abort == e) || (dead && *dead))) {
          local->gave_up = e;
          return false;
        }
        const uint64_t dt = global_ns() - t0;
        if (dt > timeout_ns) {
          if (volatile ErrorRecord* r = claim_error_record(err)) {
            r->op = site.op;
            r->what = site.what;
            r->device = peers.device;
            r->rank = peers.rank;
            r->peer = site.peer;
            r->chunk = site.chunk;
            r->target = target;
            r->seen = v;
            r->waited_s = dt * 1e-9;
            publish_error_record(r);
          }
          local->gave_up = e;
          if (dead) {  // before the abort word: see runtime.cc, abort_call
            *dead = 1;
            __threadfence_system();
          }
          if (abort) *abort = e;
          __threadfence_system();
          if (kPrint)
            printf("jaxoverlap: timeout: op %d rank %d (device %d) waited %.2f s for peer %d "
                   "chunk %d (wait kind %d, flag %u, wanted %u); giving up this call\n",
                   site.op, peers.rank, peers.device, dt * 1e-9, site.peer, site.chunk,
                   site.what, v, target);
          return false;
        }
      }
    }
  }
  fence_acq_rel(sys);
  if ((int32_t)(v - target) > 0 && peers.abort) {
    // A value beyond this call's: the peer has moved on to a later call, which only happens if
    // this call was given up there (its abort word was raised before, so it is visible now).
    // Its later data must not pass for this call's.
    Flags* local = peers.flags[peers.rank];
    const uint32_t e = ld_relaxed(&local->epoch, false) + 1u;
    if (*(volatile uint32_t*)abort_word(peers.abort, e) == e) {
      local->gave_up = e;
      return false;
    }
  }
  return true;
}
__device__ __noinline__ inline bool wait_flag(const uint32_t* p, uint32_t target, bool sys,
                                              uint64_t timeout_ns, ErrorRecord* err,
                                              const Peers& peers, WaitSite site) {
  return wait_flag_impl<true>(p, target, sys, timeout_ns, err, peers, site);
}
__device__ __forceinline__ bool wait_flag_inline(const uint32_t* p, uint32_t target, bool sys,
                                                 uint64_t timeout_ns, ErrorRecord* err,
                                                 const Peers& peers, WaitSite site) {
  return wait_flag_impl<false>(p, target, sys, timeout_ns, err, peers, site);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t* m, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(m)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* m, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(m)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* m, uint32_t phase) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(smem_u32(m)),
      "r"(phase)
      : "memory");
}
// global (local or peer) -> shared, completes on an mbarrier
__device__ __forceinline__ void tma_load(void* smem, const void* gmem, uint32_t bytes, uint64_t* m) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(smem)),
      "l"(gmem), "r"(bytes), "r"(smem_u32(m))
      : "memory");
}
// shared -> global (local or peer), bulk-group completion
__device__ __forceinline__ void tma_store(void* gmem, const void* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem),
               "r"(smem_u32(smem)), "r"(bytes)
               : "memory");
}
// shared -> global (local or peer) element-wise add, done at the destination; 16-bit floats
// need .noftz. Each element's add is a single correctly rounded operation.
__device__ __forceinline__ void tma_reduce_add_bf16(void* gmem, const void* smem, uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [%0], [%1], %2;" ::"l"(gmem),
      "r"(smem_u32(smem)), "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void tma_reduce_add_f16(void* gmem, const void* smem, uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.f16 [%0], [%1], %2;" ::"l"(gmem),
      "r"(smem_u32(smem)), "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void tma_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void tma_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Writes complete and visible (not only the smem source reusable): required before a release.
__device__ __forceinline__ void tma_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

#endif  // __CUDACC__

}  // namespace jaxoverlap
