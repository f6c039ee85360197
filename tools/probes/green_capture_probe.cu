// One-GPU probe (issue 12 item 9): can work on green-context streams be stream-captured into a
// CUDA graph the way XLA captures an FFI handler (a capture on XLA's stream in thread-local mode,
// the handler forking onto its own streams with events and joining back), and does each kernel
// node keep its partition's SMs on replay? Also: may a capturing stream wait on an event
// recorded outside the capture (a previous call's "done" event), with and without
// cudaEventWaitExternal?
//   nvcc -arch=sm_90a -o build/green_capture_probe tools/probes/green_capture_probe.cu
// (driver entry points loaded through the runtime: no libcuda needed at link time)
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <set>
#include <vector>

__global__ void where(int* sm, int iters) {
  int id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  if (threadIdx.x == 0) sm[blockIdx.x] = id;
  for (volatile int i = 0; i < iters; ++i) {
  }
}

template <typename F>
F sym(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q;
  cudaGetDriverEntryPointByVersion(name, &p, 13000, cudaEnableDefault, &q);
  if (!p) printf("FAIL driver symbol %s not found\n", name);
  return reinterpret_cast<F>(p);
}
#define D(name) static auto name##_ = sym<decltype(&name)>(#name)

#define CU(x)                                                              \
  if (CUresult r = (x)) {                                                  \
    printf("FAIL %s -> CUresult %d (line %d)\n", #x, (int)r, __LINE__);   \
    return 1;                                                              \
  }
#define RT(x)                                                                         \
  if (cudaError_t e = (x)) {                                                          \
    printf("FAIL %s -> %s (line %d)\n", #x, cudaGetErrorString(e), __LINE__);         \
    return 1;                                                                         \
  }

int main() {
  RT(cudaSetDevice(0));
  RT(cudaFree(nullptr));
  D(cuDeviceGet);
  D(cuDeviceGetDevResource);
  D(cuDevSmResourceSplitByCount);
  D(cuDevResourceGenerateDesc);
  D(cuGreenCtxCreate);
  D(cuGreenCtxStreamCreate);
  CUdevice dev;
  CU(cuDeviceGet_(&dev, 0));
  CUdevResource all, group, rest;
  CU(cuDeviceGetDevResource_(dev, &all, CU_DEV_RESOURCE_TYPE_SM));
  unsigned n = 1;
  CU(cuDevSmResourceSplitByCount_(&group, &n, &all, &rest, 0, 16));  // comm: 16 SMs
  CUstream streams[2];
  CUdevResource* parts[2] = {&rest, &group};  // gemm, comm
  for (int i = 0; i < 2; ++i) {
    CUdevResourceDesc desc;
    CUgreenCtx ctx;
    CU(cuDevResourceGenerateDesc_(&desc, parts[i], 1));
    CU(cuGreenCtxCreate_(&ctx, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM));
    CU(cuGreenCtxStreamCreate_(&streams[i], ctx, CU_STREAM_NON_BLOCKING, 0));
  }
  printf("partitions: gemm %u SMs, comm %u SMs (of %u)\n", rest.sm.smCount, group.sm.smCount,
         all.sm.smCount);
  cudaStream_t gemm = (cudaStream_t)streams[0], comm = (cudaStream_t)streams[1], xla;
  RT(cudaStreamCreateWithFlags(&xla, cudaStreamNonBlocking));
  cudaEvent_t fork, g_done, c_done, prev;
  for (cudaEvent_t* ev : {&fork, &g_done, &c_done, &prev})
    RT(cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
  const int blocks = 264;
  int *sm_g, *sm_c;
  RT(cudaMalloc(&sm_g, blocks * 4));
  RT(cudaMalloc(&sm_c, blocks * 4));
  RT(cudaMemset(sm_g, 0xff, blocks * 4));
  RT(cudaMemset(sm_c, 0xff, blocks * 4));
  RT(cudaEventRecord(prev, xla));  // "the previous call's done event", outside any capture
  RT(cudaStreamSynchronize(xla));

  // (a) waiting on an outside event from a capturing stream, plain and external
  for (int ext = 0; ext < 2; ++ext) {
    RT(cudaStreamBeginCapture(xla, cudaStreamCaptureModeThreadLocal));
    cudaError_t w = cudaStreamWaitEvent(xla, prev, ext ? cudaEventWaitExternal : 0);
    cudaGraph_t g = nullptr;
    cudaError_t end = cudaStreamEndCapture(xla, &g);
    printf("outside event waited in capture (%s): wait=%s end=%s\n",
           ext ? "cudaEventWaitExternal" : "plain", cudaGetErrorString(w),
           cudaGetErrorString(end));
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
  }

  // (b) fork onto both green streams, join, as a handler under XLA's capture
  RT(cudaStreamBeginCapture(xla, cudaStreamCaptureModeThreadLocal));
  RT(cudaEventRecord(fork, xla));
  RT(cudaStreamWaitEvent(gemm, fork));
  RT(cudaStreamWaitEvent(comm, fork));
  RT(cudaStreamWaitEvent(gemm, prev, cudaEventWaitExternal));
  where<<<blocks, 64, 0, gemm>>>(sm_g, 20000);
  RT(cudaGetLastError());
  where<<<blocks, 64, 0, comm>>>(sm_c, 20000);
  RT(cudaGetLastError());
  RT(cudaEventRecord(g_done, gemm));
  RT(cudaEventRecord(c_done, comm));
  RT(cudaStreamWaitEvent(xla, g_done));
  RT(cudaStreamWaitEvent(xla, c_done));
  RT(cudaEventRecordWithFlags(prev, xla, cudaEventRecordExternal));
  cudaGraph_t graph;
  RT(cudaStreamEndCapture(xla, &graph));
  size_t nodes = 0;
  RT(cudaGraphGetNodes(graph, nullptr, &nodes));
  cudaGraphExec_t exec;
  RT(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    RT(cudaMemset(sm_g, 0xff, blocks * 4));
    RT(cudaMemset(sm_c, 0xff, blocks * 4));
    RT(cudaGraphLaunch(exec, xla));
    RT(cudaStreamSynchronize(xla));
    std::vector<int> g(blocks), c(blocks);
    RT(cudaMemcpy(g.data(), sm_g, blocks * 4, cudaMemcpyDeviceToHost));
    RT(cudaMemcpy(c.data(), sm_c, blocks * 4, cudaMemcpyDeviceToHost));
    std::set<int> sg(g.begin(), g.end()), sc(c.begin(), c.end());
    int overlap = 0;
    for (int s : sc) overlap += sg.count(s);
    printf("replay %d: graph of %zu nodes; gemm kernel on %zu SMs, comm kernel on %zu SMs, "
           "shared %d%s\n", rep, nodes, sg.size(), sc.size(), overlap,
           sg.count(-1) || sc.count(-1) ? " (a kernel did not run!)" : "");
  }
  printf("green_capture_probe: done\n");
  return 0;
}
