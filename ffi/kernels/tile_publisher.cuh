// The flags' publisher of the tile kernel's epilogue (JAXOVERLAP_TILE_PUBLISHER; a build option,
// default off): the mailbox in shared memory, its helpers, and the publisher warp's loop. The
// consumer side is TileEpilogue::post_flags (tile_epilogue.cuh); tile_kernel (tile_rs.cuh) runs
// flag_mailbox_clear before CUTLASS's kernel and flag_mailbox_run after it.
#pragma once

#include <cutlass/cutlass.h>

#include "kernels/common.cuh"
#include "kernels/tile_rs.h"

namespace jaxoverlap::tile {

// The flags' publisher (JAXOVERLAP_TILE_PUBLISHER=1; issue 24; a build option, default off): a
// consumer warp's flush() hands its pending flags to an idle producer warp by a CTA-scope release
// (a mail per consumer warp), and that warp issues the system fence and the flag stores, off the
// MMA warps' path. It relies on the system fence's cumulativity over another warp's stores to
// peer memory, which PTX's memory model states (causality order is transitive across the
// CTA-scope and the system-scope synchronisation) but one GPU cannot test: the two-GPU run must,
// with a no-fence negative control, before it may become a default. Measured on one H200
// (session 15, two calls, 8 short-K shapes; docs/measurements.md): prod 0.985-0.987 of main's
// kernels (entry 0), 0.980-0.982 (entry 4, bulk stores), 0.991-0.995 (entry 4, tensor stores),
// about half of what no fence at all gives (0.963-0.987); long K and plain GEMMs 0.4-1.4 %
// slower (idle naps up to 1 or 4 us instead of 64 ns changed nothing: not the polling).
// `check` passes at 2/4/8 ranks.
#ifndef JAXOVERLAP_TILE_PUBLISHER
#define JAXOVERLAP_TILE_PUBLISHER 0
#endif
constexpr bool kPublisher = JAXOVERLAP_TILE_PUBLISHER != 0;
constexpr int kPublisherWarp = 3;  // the producer warpgroup's warp 3: no role in either kernel
struct FlagMail {
  uint32_t* flags[2];  // a consumer warp's pending flags (its two slabs' in the ping-pong kernel)
  int32_t n;           // flags per slab
  uint32_t value;      // the call's epoch
  uint32_t seq;        // mails posted (st.release.cta)
  uint32_t taken;      // mails published (the publisher's st.release.cta)
};
// A multiple of 128 bytes, so that the dynamic shared memory after the static variables (the
// claim ring's 128 bytes and this) still starts 128-byte aligned, as CUTLASS's TMA buffers need
// (the review of bbc7faf: 260 bytes would have put it at 400).
struct alignas(128) FlagMailbox {
  FlagMail mail[kTileSlabs];
  uint32_t done;  // consumer warps past their last tile (red.release.cta)
};
static_assert(sizeof(FlagMailbox) % 128 == 0, "the dynamic shared memory stays 128-byte aligned");
__device__ __forceinline__ FlagMailbox* flag_mailbox() {
  __shared__ FlagMailbox box;
  return &box;
}
__device__ __forceinline__ uint32_t ld_acquire_cta_shared(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.cta.shared.u32 %0, [%1];"
               : "=r"(v)
               : "r"((uint32_t)__cvta_generic_to_shared(p))
               : "memory");
  return v;
}
__device__ __forceinline__ void st_release_cta_shared(uint32_t* p, uint32_t v) {
  asm volatile("st.release.cta.shared.u32 [%0], %1;" ::"r"((uint32_t)__cvta_generic_to_shared(p)),
               "r"(v)
               : "memory");
}

// Every thread, before CUTLASS's kernel: the mailbox cleared (a CTA barrier follows).
CUTLASS_DEVICE void flag_mailbox_clear() {
  if constexpr (kPublisher) {
    uint32_t* w = reinterpret_cast<uint32_t*>(flag_mailbox());
    for (int i = (int)threadIdx.x; i < (int)(sizeof(FlagMailbox) / 4); i += (int)blockDim.x)
      w[i] = 0;
    __syncthreads();
  }
}

// After CUTLASS's kernel: the consumer warps count themselves done (their mails came before, in
// lane 0's program order); the publisher warp publishes every mail until all 8 are done and
// nothing is left. The publisher's one fence.acq_rel.sys covers every mail it acquired before it.
CUTLASS_DEVICE void flag_mailbox_run() {
  if constexpr (kPublisher) {
    FlagMailbox* box = flag_mailbox();
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    if (warp >= 4 && lane == 0) {
      asm volatile("red.release.cta.shared.add.u32 [%0], 1;" ::"r"(
                       (uint32_t)__cvta_generic_to_shared(&box->done))
                   : "memory");
    } else if (warp == kPublisherWarp && lane == 0) {
      // Two passes per sweep (few registers: this warp runs on the producer warpgroup's 40): the
      // mails posted since they were last taken, acquired; one fence; then their flags. A mail
      // seen in the first pass cannot change before the second (its warp waits for `taken`).
      for (;;) {
        const uint32_t done = ld_acquire_cta_shared(&box->done);
        uint32_t mask = 0;
        for (int w = 0; w < kTileSlabs; ++w)
          if (ld_acquire_cta_shared(&box->mail[w].seq) !=
              *(volatile uint32_t*)&box->mail[w].taken)
            mask |= 1u << w;
        if (!mask) {
          if (done == kTileSlabs) break;
          __nanosleep(64);
          continue;
        }
        fence_acq_rel(/*sys=*/true);
        for (int w = 0; w < kTileSlabs; ++w) {
          if (!(mask >> w & 1u)) continue;
          FlagMail& m = box->mail[w];
          const uint32_t seq = *(volatile uint32_t*)&m.seq;
          for (int h = 0; h < 2; ++h)
            for (int f = 0; m.flags[h] && f < m.n; ++f) st_relaxed_sys(m.flags[h] + f, m.value);
          st_release_cta_shared(&m.taken, seq);  // after the reads of the mail
        }
      }
    }
    __syncwarp();
  }
}

}  // namespace jaxoverlap::tile
