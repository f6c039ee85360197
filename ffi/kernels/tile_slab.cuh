// The tile epilogue's data movement of one 16-row slab (one consumer warp; tile_rs.cuh's
// TileEpilogue runs the protocol around it): a foreign or plain slab rounded and stored (the
// lanes' stores or bulk async stores), an own slab's peer data loaded asynchronously into shared
// memory and added to the accumulators in rank order, rounded once, stored. Accumulator layout
// (SM90 64xNx16 f32, per warp): value i = v0 + 2 v1 + 4 v2 at row (lane / 4) + 8 v1 of the slab
// and column 8 v2 + 2 (lane % 4) + v0 -- that of ldmatrix / stmatrix's 8x8 fragments. Device
// code only.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include "kernels/common.cuh"

namespace jaxoverlap::tile {

// A slab leaves in chunks of 16 rows x kChunkCols columns: the warp writes the rounded chunk
// into one of its kChunkBufs shared buffers (stmatrix) and 16 lanes issue one bulk async store
// per row (cp.async.bulk, to local or peer memory alike); a buffer is written again only after
// its store has read it (cp.async.bulk.wait_group.read), so the last chunks of a tile are still
// leaving while the warp runs the next tile's MMA.
// (JAXOVERLAP_TILE_CHUNK_COLS / _BUFS: probe variants only, e.g. 64 / 2, which costs the
// 128 x 256 entries their 4th mainloop stage.)
#ifndef JAXOVERLAP_TILE_CHUNK_COLS
#define JAXOVERLAP_TILE_CHUNK_COLS 32
#endif
#ifndef JAXOVERLAP_TILE_CHUNK_BUFS
#define JAXOVERLAP_TILE_CHUNK_BUFS 3
#endif
constexpr int kChunkCols = JAXOVERLAP_TILE_CHUNK_COLS;  // columns per bulk-stored chunk (32: 64
                                                        // bytes of each row)
static_assert(kChunkCols == 32 || kChunkCols == 64, "chunks of 32 or 64 columns");
constexpr int kChunkPitch = 2 * kChunkCols + 16;  // bytes per shared row of a chunk (+16:
                                  // stmatrix without bank conflicts, rows 16-byte aligned)
constexpr int kChunkBytes = 16 * kChunkPitch;
constexpr int kChunkBufs = JAXOVERLAP_TILE_CHUNK_BUFS;  // chunk buffers per warp (3 x 32 columns x
                                  // 8 warps fit the 4th mainloop stage of the 128 x 256 entries)
// An own tile's peer slabs arrive in units of 16 rows x 32 columns of one source (1 KiB; 64-byte
// rows, their 16-byte pieces XOR-swizzled by row: ldmatrix/stmatrix and the cp.async writes
// without bank conflicts), kUnitBufs buffers per warp, kUnitBufs - 1 units in flight.
// (JAXOVERLAP_TILE_UNIT_BUFS: a probe build option, issue 24: more units in flight per warp; the
// buffers come out of the mainloop's shared memory. 8 cost the ping-pong kernel a stage: its
// prod 0.991 on short K, but plain and long K 1.5-2 % slower, entry 0 slower everywhere; session
// 13, docs/measurements.md.)
#ifndef JAXOVERLAP_TILE_UNIT_BUFS
#define JAXOVERLAP_TILE_UNIT_BUFS 4
#endif
constexpr int kUnitBytes = 1024;
constexpr int kUnitBufs = JAXOVERLAP_TILE_UNIT_BUFS;
static_assert(kUnitBufs >= 2 && kUnitBufs <= 16, "2 to 16 unit buffers per warp");
constexpr int kSlabBytes = kChunkBufs * kChunkBytes > kUnitBufs * kUnitBytes
                               ? kChunkBufs * kChunkBytes
                               : kUnitBufs * kUnitBytes;
constexpr int kSlabWords = kSlabBytes / 4;  // a warp's shared words (the two uses alias)
__device__ __forceinline__ uint32_t unit_off(int row, int piece) {  // byte offset in a unit
  return row * 64 + ((piece ^ ((row >> 1) & 3)) << 4);
}

// CU_TENSOR_MAP_SWIZZLE_64B as TMA applies it: the 16-byte piece (address bits 4-5) XOR bits
// 7-8 of the absolute shared address (unit_off for a 512-byte-aligned unit).
__device__ __forceinline__ uint32_t tensor_swz(uint32_t addr) {
  return addr ^ (((addr >> 7) & 3u) << 4);
}

// The TMA tensor stores' box (kTileEpiTensorStores): 16 rows x kTStoreCols columns, rows of
// 2 kTStoreCols bytes in CU_TENSOR_MAP_SWIZZLE_64B (32 columns) or _128B (64 columns), in
// kTStoreBufs buffers per warp (aliasing the chunk and unit buffers). 64 columns: half the TMA
// operations per tile (16 instead of 32 for a 128 x 128 tile).
#ifndef JAXOVERLAP_TILE_TSTORE_COLS
#define JAXOVERLAP_TILE_TSTORE_COLS 32
#endif
constexpr int kTStoreCols = JAXOVERLAP_TILE_TSTORE_COLS;
static_assert(kTStoreCols == 32 || kTStoreCols == 64, "tensor-store boxes of 32 or 64 columns");
constexpr int kTStoreBytes = 16 * kTStoreCols * 2;
// Tools only (probe builds; the output is wrong): where the tensor stores' cost sits (session 15).
// 1: everything but the cp.async.bulk.tensor itself (the chunk is rounded and written to shared
// memory, fenced and synchronised, then dropped); 2: everything but the rounding and the stmatrix
// (the store sends whatever the buffer holds); 3: everything but the per-chunk waits, fence and
// __syncwarps (a race: timing only); 4: everything but the per-chunk fence.proxy.async; 5 (in
// TileEpilogue): a plain GEMM's epilogue returns before its slabs' stores (what mode 9 skips after
// the tile's indices); 6: a plain GEMM's tiles end without end_tile's flush and drain; 7 (session
// 16): 1 and 3 together -- only the rounding and the stmatrix writes remain.
#ifndef JAXOVERLAP_TILE_TSTORE_PROBE
#define JAXOVERLAP_TILE_TSTORE_PROBE 0
#endif
constexpr int kTStoreProbe = JAXOVERLAP_TILE_TSTORE_PROBE;
constexpr bool kProbeNoTma = kTStoreProbe == 1 || kTStoreProbe == 7;
constexpr bool kProbeNoSync = kTStoreProbe == 3 || kTStoreProbe == 7;
constexpr int kTStoreBufs = kSlabBytes / kTStoreBytes;
static_assert(kTStoreBufs >= 2, "two tensor-store buffers per warp at least");
// The tensor stores' swizzle as TMA applies it: the 16-byte piece (address bits 4-5, or 4-6)
// XOR bits 7-8 (or 7-9) of the absolute shared address.
__device__ __forceinline__ uint32_t tstore_swz(uint32_t addr) {
  return addr ^ (((addr >> 7) & (uint32_t)(kTStoreCols / 8 - 1)) << 4);
}

// The loads of an own slab's peer units -- chunk c (32 columns) of source s, c-major, s in rank
// order -- into a warp's unit buffers (unit u in buffer u % kUnitBufs): each next() loads one
// (the lane's 32 bytes of its row, 16 at a time) and commits it as one cp.async group of every
// lane (empty past the last unit).
struct UnitLoader {
  const char* g;  // the lane's next 16 bytes
  int64_t stride;
  uint32_t sbase;
  int count, chunks, lleft, row, piece, ic = 0, is = 0, iu = 0;
  CUTLASS_DEVICE UnitLoader(const char* src0, int64_t stride_, int count_, int64_t N,
                            int64_t col0, int tile_n, uint32_t sbase_, int lane)
      : stride(stride_), sbase(sbase_), count(count_), row(lane >> 1), piece(2 * (lane & 1)) {
    const int64_t left = N - col0;  // the tile's columns inside the problem
    chunks = count > 0 ? (int)min((int64_t)(tile_n / 32), (left + 31) / 32) : 0;
    lleft = (int)min(left, (int64_t)tile_n) - 8 * piece;  // the lane's columns left
    g = src0 + (row * N + 8 * piece) * 2;
  }
  CUTLASS_DEVICE void next() {
    if (ic < chunks) {
      const uint32_t buf = sbase + (iu % kUnitBufs) * kUnitBytes;
      if (32 * ic < lleft)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(buf + unit_off(row, piece)),
                     "l"(g)
                     : "memory");
      if (32 * ic + 8 < lleft)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                         buf + unit_off(row, piece + 1)),
                     "l"(g + 16)
                     : "memory");
      ++iu;
      g += stride;
      if (++is == count) is = 0, ++ic, g += 64 - count * stride;
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
};

// The same loads by TMA (TileRsArgs::epi kTileEpiTensorLoads): lane 0 issues one
// cp.async.bulk.tensor load per unit (the 16 x 32 box of source s's map at (x0 + 32 c, y0); the
// map's 64-byte swizzle is unit_off's, tensor_swz) into its buffer, completing on the buffer's
// mbarrier (1 KiB of transactions; columns past N arrive as zeros, added to columns never
// stored). No lane holds or issues anything else while they fly.
struct TmaUnitLoader {
  const CUtensorMap* maps;  // source s: maps[s]
  uint32_t sbase, mbar;     // the warp's unit buffers and their mbarriers (shared addresses)
  int32_t x0, y0;
  int count, chunks, lane, ic = 0, is = 0, iu = 0;
  CUTLASS_DEVICE void next() {
    if (ic < chunks) {
      if (lane == 0) {
        const uint32_t b = iu % kUnitBufs, bar = mbar + 8 * b;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                     "r"(kUnitBytes)
                     : "memory");
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3}], [%4];" ::"r"(sbase + b * kUnitBytes),
            "l"(maps + is), "r"(x0 + 32 * ic), "r"(y0), "r"(bar)
            : "memory");
      }
      ++iu;
      if (++is == count) is = 0, ++ic;
    }
  }
};

// 16-bit float helpers of the epilogue.
template <class T>
struct Half2;
template <>
struct Half2<cutlass::bfloat16_t> {
  __device__ static uint32_t pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static float2 unpack(uint32_t u) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
  }
};
template <>
struct Half2<cutlass::half_t> {
  __device__ static uint32_t pack(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static float2 unpack(uint32_t u) {
    return __half22float2(*reinterpret_cast<__half2*>(&u));
  }
};

// How an own slab's rounded chunks leave (JAXOVERLAP_TILE_OWN_STORE; issue 24, session 14): 1
// (production) each row's 64 bytes by 4 lanes, 8 rows per store instruction (16 whole sectors);
// 0 row lane / 2's 16-byte pieces at columns 16 (lane % 2) + 8 i, 16 rows per instruction (32
// half-written sectors: twice the L2 sectors and 4x the L1 requests, ncu): 1 is 0.990-0.994 of
// 0 in the fused op on short K, 0.976 with no adds (tools mode 4). (Storing the whole slab by
// store_lanes after its sums, 128-byte rows, was no faster than 0 and made the plain GEMM 2 %
// slower: docs/measurements.md, session 14.)
#ifndef JAXOVERLAP_TILE_OWN_STORE
#define JAXOVERLAP_TILE_OWN_STORE 1
#endif
constexpr int kOwnStore = JAXOVERLAP_TILE_OWN_STORE;
static_assert(kOwnStore == 0 || kOwnStore == 1, "JAXOVERLAP_TILE_OWN_STORE: 0 or 1");

// A warp's slab I/O (static: the slab's accumulators, its shared buffers, the lane in, no state).
template <class Element, int kTileN>
struct SlabIO {
  // Stores acc + the `count` 16-bit slabs at src + i * stride (added in that order in f32,
  // rounded once) at dst (row pitch N), 32 columns (a chunk) at a time. The sources' units
  // (chunk c of source s, in that order) are loaded asynchronously into the warp's unit buffers
  // (cp.async, 16 bytes per lane: no registers held while they fly), kUnitBufs - 1 ahead of the
  // one being added; each unit is read back in the accumulators' own layout (ldmatrix) and added
  // to them. A chunk's rounded sum goes back through the buffer its last unit left (stmatrix),
  // so that every 4 lanes store one row's 64 contiguous bytes (kOwnStore).
  //
  // kTma (TileRsArgs::epi kTileEpiTensorLoads): the units come by TMA (TmaUnitLoader: source s
  // from maps[s] at row y0), completing on the warp's mbarriers mbar[kUnitBufs], whose phases
  // the warp tracks in *phase (bit b: buffer b's next parity); the units then sit at
  // tensor_swz(unit_off) -- the same bytes where the buffers are 512-byte aligned.
  template <bool kTma = false, class Acc>
  CUTLASS_DEVICE static void sum_store(Acc& acc, const char* src0, int64_t stride, int count,
                                       char* dst, float* smf, int lane, int64_t col0,
                                       int64_t N, const CUtensorMap* maps = nullptr,
                                       int32_t y0 = 0, uint64_t* mbar = nullptr,
                                       uint32_t* phase = nullptr) {
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smf);
    const int64_t left = N - col0;  // the tile's columns inside the problem
    const int chunks = (int)min((int64_t)(kTileN / 32), (left + 31) / 32);
    const int lrow = lane >> 1, lhalf = lane & 1;  // the lane's row and 32 bytes of a unit
    const int mrow = (lane & 7) + 8 * ((lane >> 3) & 1), mpiece = lane >> 4;  // ldmatrix rows
    // the unit buffers' swizzle: unit_off's, or TMA's from the absolute address
    auto uaddr = [&](uint32_t buf, int row, int piece) -> uint32_t {
      return kTma ? tensor_swz(buf + row * 64 + 16 * piece) : buf + unit_off(row, piece);
    };
    const uint32_t mbase = kTma ? (uint32_t)__cvta_generic_to_shared(mbar) : 0u;
    using Loader = std::conditional_t<kTma, TmaUnitLoader, UnitLoader>;
    Loader ld = [&] {
      if constexpr (kTma) {
        if (count > 0 && lane == 0)  // the flags' acquires (generic proxy) before TMA's reads
          asm volatile("fence.proxy.async.global;" ::: "memory");
        return TmaUnitLoader{maps, sbase, mbase, (int32_t)col0, y0, count,
                             count > 0 ? chunks : 0, lane};
      } else {
        return UnitLoader(src0, stride, count, N, col0, kTileN, sbase, lane);
      }
    }();
    if (count > 0)
      for (int u = 0; u < kUnitBufs - 1; ++u) ld.next();
    int u = 0;
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kTileN / 32; ++c) {
      if (c >= chunks) break;
#pragma unroll 1
      for (int s = 0; s < count; ++s, ++u) {
        ld.next();  // unit u + kUnitBufs - 1, into the buffer unit u - 1 left
        if constexpr (kTma) {
          const uint32_t b = u % kUnitBufs;
          mbar_wait(mbar + b, (*phase >> b) & 1u);  // unit u has landed
          *phase ^= 1u << b;
        } else {
          asm volatile("cp.async.wait_group %0;" ::"n"(kUnitBufs - 1) : "memory");
          __syncwarp();  // unit u: every lane's pieces
        }
        const uint32_t buf = sbase + (u % kUnitBufs) * kUnitBytes;
        CUTLASS_PRAGMA_UNROLL
        for (int gp = 0; gp < 2; ++gp) {
          uint32_t r[4];
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                       : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                       : "r"(uaddr(buf, mrow, 2 * gp + mpiece))
                       : "memory");
          CUTLASS_PRAGMA_UNROLL
          for (int mi = 0; mi < 4; ++mi) {
            const int i = 4 * (4 * c + 2 * gp + mi / 2) + 2 * (mi % 2);
            const float2 p = Half2<Element>::unpack(r[mi]);
            acc(i) += p.x;
            acc(i + 1) += p.y;
          }
        }
        __syncwarp();  // every lane has read the unit before its buffer is refilled
      }
      // The rounded chunk, through the buffer unit u - 1 left (refilled only at the next unit).
      const uint32_t obuf = sbase + ((u + kUnitBufs - 1) % kUnitBufs) * kUnitBytes;
      CUTLASS_PRAGMA_UNROLL
      for (int gp = 0; gp < 2; ++gp) {
        uint32_t r[4];
        CUTLASS_PRAGMA_UNROLL
        for (int mi = 0; mi < 4; ++mi) {
          const int i = 4 * (4 * c + 2 * gp + mi / 2) + 2 * (mi % 2);
          r[mi] = Half2<Element>::pack(acc(i), acc(i + 1));
        }
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                         uaddr(obuf, mrow, 2 * gp + mpiece)),
                     "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                     : "memory");
      }
      __syncwarp();
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 2; ++i) {
        // kOwnStore 1: rows 8 i + lane / 4, each row's 64 bytes by 4 lanes (whole sectors);
        // 0: row lane / 2, 16 bytes at columns 16 (lane % 2) + 8 i (half sectors)
        const int row = kOwnStore == 1 ? 8 * i + (lane >> 2) : lrow;
        const int piece = kOwnStore == 1 ? (lane & 3) : 2 * lhalf + i;
        const int64_t col = 32 * c + 8 * piece;
        if (col < left) {
          uint4 v;
          asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                       : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                       : "r"(uaddr(obuf, row, piece))
                       : "memory");
          *reinterpret_cast<uint4*>(dst + (row * N + col) * 2) = v;
        }
      }
      __syncwarp();
    }
    if constexpr (!kTma)
      asm volatile("cp.async.wait_group 0;" ::: "memory");  // the look-ahead's empty groups
  }

  // Rounds the slab to 16 bits and stores it at dst (row pitch N) asynchronously, kChunkCols
  // columns at a time: the warp writes the chunk into its next shared buffer (two stmatrix.x4:
  // the accumulators' layout is stmatrix's), and lane r < 16 issues row r's bulk store (64
  // contiguous bytes; fewer in a partial tile, N % 8 == 0 keeps them 16-byte multiples). Each
  // chunk is one bulk group of every lane; the buffer is reused kChunkBufs chunks later, after
  // wait_group.read. Nothing here waits for the stores to land (TileEpilogue::flush does,
  // before a flag). chunk: the warp's chunks so far (its next buffer).
  template <class Acc>
  CUTLASS_DEVICE static void store_bulk(Acc& acc, char* dst, float* smf, int lane, int64_t col0,
                                        int64_t N, uint32_t& chunk) {
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smf);
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kTileN / kChunkCols; ++c) {
      const int64_t cols = N - col0 - kChunkCols * c;  // the chunk's valid columns (warp-uniform)
      if (cols <= 0) break;
      const uint32_t buf = sbase + (chunk % kChunkBufs) * kChunkBytes;
      ++chunk;
      tma_wait_read<kChunkBufs - 1>();  // the store that used this buffer has read it
      __syncwarp();
      CUTLASS_PRAGMA_UNROLL
      for (int gp = 0; gp < kChunkCols / 16; ++gp) {  // matrices (rows 8 v1.., columns 8 g..):
        uint32_t r[4];                                    // g = 2 gp + mi / 2 of the chunk
        CUTLASS_PRAGMA_UNROLL
        for (int mi = 0; mi < 4; ++mi) {
          const int i = 4 * (kChunkCols / 8 * c + 2 * gp + mi / 2) + 2 * (mi % 2);
          r[mi] = Half2<Element>::pack(acc(i), acc(i + 1));
        }
        const uint32_t addr = buf + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kChunkPitch +
                              16 * (2 * gp + (lane >> 4));
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
                     "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                     : "memory");
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic smem -> bulk copy
      __syncwarp();
      if (lane < 16) {
        const uint32_t bytes = (uint32_t)(cols < kChunkCols ? cols : kChunkCols) * 2;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                         dst + (lane * N + kChunkCols * c) * 2),
                     "r"(buf + lane * kChunkPitch), "r"(bytes)
                     : "memory");
      }
      tma_commit();
    }
  }

  // Rounds the slab to 16 bits and stores it by TMA tensor stores (TileRsArgs::epi
  // kTileEpiTensorStores), 32 columns at a time: the warp writes the chunk into its next unit
  // buffer (1 KiB, kUnitBufs per warp, aliasing the chunk buffers) in the layout of
  // CU_TENSOR_MAP_SWIZZLE_64B (stmatrix: 64-byte rows, 16-byte pieces XOR-swizzled by address bits
  // 7-8, which TMA takes from the absolute shared address: tensor_swz), and lane 0 issues one
  // cp.async.bulk.tensor store of the 16 x 32 box at (x0 + 32 c, y0) of `map` (columns past N
  // are clipped by TMA: partial tiles need nothing) -- one TMA operation per chunk instead of 16
  // row copies. Each chunk is one bulk group of lane 0; a buffer is written again kUnitBufs
  // chunks later, after lane 0's wait_group.read and __syncwarp. Nothing waits for the stores to
  // land (TileEpilogue::flush does, in lane 0, the only issuer, before its release).
  template <class Acc>
  CUTLASS_DEVICE static void store_tensor(Acc& acc, const void* map, int32_t x0, int32_t y0,
                                          float* smf, int lane, int64_t N, uint32_t& chunk) {
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smf);
    const int mrow = (lane & 7) + 8 * ((lane >> 3) & 1), mpiece = lane >> 4;
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kTileN / kTStoreCols; ++c) {
      if (x0 + kTStoreCols * c >= N) break;  // warp-uniform
      const uint32_t buf = sbase + (chunk % kTStoreBufs) * kTStoreBytes;
      ++chunk;
      if constexpr (!kProbeNoSync) {
        if (lane == 0) tma_wait_read<kTStoreBufs - 1>();  // the store that used this buffer read it
        __syncwarp();
      }
      CUTLASS_PRAGMA_UNROLL
      for (int gp = 0; gp < kTStoreCols / 16; ++gp) {
        if constexpr (kTStoreProbe == 2) break;
        uint32_t r[4];
        CUTLASS_PRAGMA_UNROLL
        for (int mi = 0; mi < 4; ++mi) {
          const int i = 4 * (kTStoreCols / 8 * c + 2 * gp + mi / 2) + 2 * (mi % 2);
          r[mi] = Half2<Element>::pack(acc(i), acc(i + 1));
        }
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                         tstore_swz(buf + mrow * (2 * kTStoreCols) + 16 * (2 * gp + mpiece))),
                     "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                     : "memory");
      }
      if constexpr (!kProbeNoSync && kTStoreProbe != 4)
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic smem -> TMA
      if constexpr (!kProbeNoSync) __syncwarp();
      if (lane == 0 && !kProbeNoTma) {
        asm volatile(
            "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                map),
            "r"(x0 + kTStoreCols * c), "r"(y0), "r"(buf)
            : "memory");
        tma_commit();
      }
    }
  }

  // Rounds the slab to 16 bits and stores it at dst (row pitch N) with the lanes' stores, 64
  // columns at a time through the warp's shared rows (stmatrix; 144-byte rows), so that each 8
  // lanes store 128 contiguous bytes of a row.
  template <class Acc>
  CUTLASS_DEVICE static void store_lanes(Acc& acc, char* dst, float* smf, int lane,
                                         int64_t col0, int64_t N) {
    constexpr int kPitch = 144;
    static_assert(16 * kPitch <= kSlabBytes, "a 64-column chunk fits the warp's buffers");
    const uint32_t buf = (uint32_t)__cvta_generic_to_shared(smf);
    const int mrow = (lane & 7) + 8 * ((lane >> 3) & 1), mpiece = lane >> 4;
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kTileN / 64; ++c) {
      if (col0 + 64 * c >= N) break;
      CUTLASS_PRAGMA_UNROLL
      for (int gp = 0; gp < 4; ++gp) {
        uint32_t r[4];
        CUTLASS_PRAGMA_UNROLL
        for (int mi = 0; mi < 4; ++mi) {
          const int i = 4 * (8 * c + 2 * gp + mi / 2) + 2 * (mi % 2);
          r[mi] = Half2<Element>::pack(acc(i), acc(i + 1));
        }
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                         buf + mrow * kPitch + 16 * (2 * gp + mpiece)),
                     "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                     : "memory");
      }
      __syncwarp();
      CUTLASS_PRAGMA_UNROLL
      for (int it = 0; it < 4; ++it) {
        const int rr = 4 * it + lane / 8, cv = lane % 8;
        const int64_t col = 64 * c + 8 * cv;
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(buf + rr * kPitch + 16 * cv)
                     : "memory");
        if (col0 + col < N) *reinterpret_cast<uint4*>(dst + (rr * N + col) * 2) = v;
      }
      __syncwarp();
    }
  }

  // Every lane's bulk stores have read their shared buffers (before the warp writes them with
  // generic stores, and before the CTA exits).
  CUTLASS_DEVICE static void drain_bulk_reads() {
    tma_wait_read<0>();
    __syncwarp();
  }
};

}  // namespace jaxoverlap::tile
