// Test-only (issue 26, R6; kernels/memops_probe.h): the reduce-push kernel of two ranks on one
// device beside an occupier holding all SMs but `free_sms`, each call checked.
#include <algorithm>
#include <cstring>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/comm.h"
#include "kernels/memops_probe.h"
#include "kernels/probe_util.cuh"
#include "runtime/memops.h"

namespace jaxoverlap {
namespace {

// One block per SM (it takes the SM's whole shared memory): thread 0 counts itself in `started`
// and spins until `stop` is set or `bound_ns` passes.
__global__ void hold_sm_kernel(const uint32_t* stop, uint64_t bound_ns, uint32_t* started) {
  extern __shared__ char hold[];
  if (threadIdx.x == 0) {
    hold[0] = 0;
    atomicAdd(started, 1u);
    const uint64_t t0 = now_ns();
    while (*(const volatile uint32_t*)stop == 0 && now_ns() - t0 < bound_ns) __nanosleep(256);
  }
}

}  // namespace

ReducePushProbe reduce_push_probe(int ordinal, int free_sms, int ctas, int64_t block_bytes,
                                  int calls, double timeout_s) {
  ReducePushProbe r;
  r.free_sms = free_sms, r.ctas = ctas, r.block_bytes = block_bytes, r.calls = calls;
  const int64_t elems = block_bytes / 2;  // bf16
  Flags* f = nullptr;
  char *stage = nullptr, *src = nullptr, *out = nullptr;
  uint32_t* words = nullptr;  // [0] started, [1] stop
  ErrorRecord* err = nullptr;
  cudaStream_t k = nullptr, s[2] = {};
  cudaEvent_t e0 = nullptr, e1 = nullptr, done1 = nullptr;
  const FirstError fail{r.error};
  do {
    if (fail("cudaSetDevice", cudaSetDevice(ordinal))) break;
    cudaDeviceGetAttribute(&r.sms, cudaDevAttrMultiProcessorCount, ordinal);
    int smem_optin = 0;
    cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ordinal);
    r.occupier_blocks = std::max(0, r.sms - free_sms);
    if (elems % (2 * 8) || ctas < 1) {
      r.error = "block_bytes must be a multiple of 32 and ctas positive";
      break;
    }
    if (fail("preload_comm_kernels", preload_comm_kernels()) ||
        fail("cudaFuncSetAttribute",
             cudaFuncSetAttribute(hold_sm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  smem_optin)) ||
        fail("cudaMalloc", cudaMalloc(&f, 2 * sizeof(Flags))) ||
        fail("cudaMalloc", cudaMalloc(&stage, 2 * block_bytes)) ||
        fail("cudaMalloc", cudaMalloc(&src, 4 * block_bytes)) ||  // [rank][block]
        fail("cudaMalloc", cudaMalloc(&out, 2 * block_bytes)) ||
        fail("cudaMalloc", cudaMalloc(&words, 2 * sizeof(uint32_t))) ||
        fail("cudaHostAlloc", cudaHostAlloc((void**)&err, sizeof(ErrorRecord),
                                            cudaHostAllocMapped | cudaHostAllocPortable)) ||
        fail("cudaStreamCreate", cudaStreamCreateWithFlags(&k, cudaStreamNonBlocking)) ||
        fail("cudaStreamCreate", cudaStreamCreateWithFlags(&s[0], cudaStreamNonBlocking)) ||
        fail("cudaStreamCreate", cudaStreamCreateWithFlags(&s[1], cudaStreamNonBlocking)) ||
        fail("cudaEventCreate", cudaEventCreate(&e0)) ||
        fail("cudaEventCreate", cudaEventCreate(&e1)) ||
        fail("cudaEventCreate", cudaEventCreate(&done1)))
      break;
    std::memset(err, 0, sizeof(ErrorRecord));
    fail("cudaMemset", cudaMemset(f, 0, 2 * sizeof(Flags)));
    fail("cudaMemset", cudaMemset(stage, 0, 2 * block_bytes));
    // src[rank r][block j][i] = (i % 7) + r + 2 j: small integers, every sum exact in bf16.
    std::vector<__nv_bfloat16> h(4 * elems);
    for (int rj = 0; rj < 4; ++rj)
      for (int64_t i = 0; i < elems; ++i)
        h[rj * elems + i] = __float2bfloat16((float)((i % 7) + rj / 2 + 2 * (rj % 2)));
    fail("cudaMemcpy", cudaMemcpy(src, h.data(), 4 * block_bytes, cudaMemcpyHostToDevice));
    if (fail("sync", cudaDeviceSynchronize())) break;
    CommArgs a[2] = {};
    for (int i = 0; i < 2; ++i) {
      Peers& p = a[i].peers;
      p.n = 2, p.rank = i, p.device = ordinal;
      p.flags[0] = &f[0], p.flags[1] = &f[1];
      p.stage[0] = stage, p.stage[1] = stage + block_bytes;
      a[i].src = src + i * 2 * block_bytes;
      a[i].own = a[i].src + i * block_bytes;
      a[i].out = out + i * block_bytes;
      a[i].block_bytes = block_bytes;
      a[i].chunks = 1;
      a[i].senders = ctas;
      a[i].stall_rank = -1;
      a[i].op = kOpReduceScatter;
      a[i].timeout_ns = (uint64_t)(timeout_s * 1e9);
      a[i].err = err;
      a[i].dtype = DType::kBF16;
      a[i].reduce_push = 1;
    }
    std::vector<__nv_bfloat16> got(2 * elems);
    double total = 0;
    for (int c = 0; c < calls && r.error.empty(); ++c) {
      fail("cudaMemset", cudaMemset(out, 0xff, 2 * block_bytes));  // NaN until written
      fail("cudaMemset", cudaMemset(words, 0, 2 * sizeof(uint32_t)));
      if (fail("sync", cudaDeviceSynchronize())) break;
      if (r.occupier_blocks > 0) {
        hold_sm_kernel<<<r.occupier_blocks, 128, smem_optin, k>>>(
            &words[1], (uint64_t)((timeout_s * 3 + 1) * 1e9), &words[0]);
        fail("hold_sm_kernel", cudaGetLastError());
      }
      for (int i = 0; i < 2; ++i)
        fail("stream_wait_u32", stream_wait_u32(s[i], &words[0], (uint32_t)r.occupier_blocks,
                                                true));
      fail("cudaEventRecord", cudaEventRecord(e0, s[0]));
      fail("cudaStreamWaitEvent", cudaStreamWaitEvent(s[1], e0));
      for (int i = 0; i < 2; ++i) {
        fail("launch_comm", launch_comm(a[i], s[i]));
        fail("launch_finish", launch_finish(&f[i], s[i]));
      }
      fail("cudaEventRecord", cudaEventRecord(done1, s[1]));
      fail("cudaStreamWaitEvent", cudaStreamWaitEvent(s[0], done1));
      fail("cudaEventRecord", cudaEventRecord(e1, s[0]));
      fail("stream_write_u32", stream_write_u32(s[0], &words[1], 1));  // release the occupier
      if (fail("sync", cudaDeviceSynchronize())) break;
      float ms = 0;
      fail("cudaEventElapsedTime", cudaEventElapsedTime(&ms, e0, e1));
      total += ms;
      r.ms_max = std::max(r.ms_max, (double)ms);
      if (err->set) ++r.timeouts;
      std::memset(err, 0, sizeof(ErrorRecord));
      for (int i = 0; i < 2; ++i) {  // gave_up of either rank: fine for the next call
        uint32_t zero = 0;
        cudaMemcpy(&f[i].gave_up, &zero, 4, cudaMemcpyHostToDevice);
      }
      fail("cudaMemcpy", cudaMemcpy(got.data(), out, 2 * block_bytes, cudaMemcpyDeviceToHost));
      bool bad = false;
      for (int i = 0; i < 2 && !bad; ++i)  // rank i: its own block i plus the peer's block i
        for (int64_t x = 0; x < elems && !bad; ++x) {
          const float want = (float)(2 * (x % 7) + 1 + 4 * i);
          bad = __bfloat162float(got[i * elems + x]) != want;
        }
      r.wrong += bad;
    }
    r.ms_mean = total / std::max(calls, 1);
    fail("cudaMemcpy", cudaMemcpy(&r.epochs, &f[0].epoch, 4, cudaMemcpyDeviceToHost));
  } while (false);
  cudaGetLastError();
  cudaDeviceSynchronize();
  for (cudaStream_t x : {k, s[0], s[1]})
    if (x) cudaStreamDestroy(x);
  for (cudaEvent_t x : {e0, e1, done1})
    if (x) cudaEventDestroy(x);
  for (void* p : {(void*)f, (void*)stage, (void*)src, (void*)out, (void*)words})
    if (p) cudaFree(p);
  if (err) cudaFreeHost(err);
  return r;
}

}  // namespace jaxoverlap
