// Test-only (issue 26, R5 and R6; kernels/memops_probe.h). A kernel that takes every thread slot
// of every SM spins (bounded) on a flag, and the flag is released from another stream by
// cuStreamWriteValue32, by a 4-byte copy of a device word, or by a one-thread kernel: only the
// first needs no SM (measured). Then a graph captured once -- NCCL's captured wait (EQ on a
// constant, reset in the same batch) and a stream write -- replayed against a fresh occupier each
// time; the trap a captured GEQ wait on a host-side index falls into on replay; the copy-engine
// schedules' own signal and waits (kernels/ce.h) under such an occupier, uncaptured and replayed.
// (The reduce-push kernel beside an occupier, R6: kernels/reduce_push_probe.cu.)
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/ce.h"
#include "kernels/comm.h"
#include "kernels/memops_probe.h"
#include "kernels/probe_util.cuh"
#include "runtime/memops.h"

namespace jaxoverlap {
namespace {

constexpr int kThreads = 1024;  // x 2 blocks per SM = 2048, every thread slot of an H100/H200 SM

// Thread 0 of each block: count itself in `started` (block 0 first stores `value` into `word`,
// the device-side value a signal copies), then spin until `flag` reaches `target` or `bound_ns`
// passes (counted in `timeouts`). The other 1,023 threads hold their slots at the barrier.
__global__ void __launch_bounds__(kThreads, 2)
    occupy_kernel(const uint32_t* flag, uint32_t target, uint64_t bound_ns, uint32_t* started,
                  uint32_t* timeouts, uint32_t* word, uint32_t value) {
  if (threadIdx.x == 0) {
    if (blockIdx.x == 0 && word) {
      *(volatile uint32_t*)word = value;
      __threadfence_system();
    }
    atomicAdd(started, 1u);
    const uint64_t t0 = now_ns();
    while ((int32_t)(*(const volatile uint32_t*)flag - target) < 0) {
      if (now_ns() - t0 > bound_ns) {
        atomicAdd(timeouts, 1u);
        break;
      }
      __nanosleep(256);
    }
  }
  __syncthreads();
}

__global__ void signal_kernel(uint32_t* flag, uint32_t value) {
  __threadfence_system();
  *(volatile uint32_t*)flag = value;
}

struct Words {
  uint32_t flag, started, timeouts, word, trap;
};

}  // namespace

MemopsProbe stream_memops_probe(int ordinal, int replays, double bound_s) {
  MemopsProbe r;
  r.bound_s = bound_s;
  r.replays = replays;
  const uint64_t bound_ns = (uint64_t)(bound_s * 1e9);
  Words* d = nullptr;
  cudaStream_t k = nullptr, s = nullptr, t = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  cudaGraph_t graph = nullptr, trap = nullptr;
  cudaGraphExec_t exec = nullptr, trap_exec = nullptr;
  const FirstError fail{r.error};
  auto words = [&]() {
    Words w{};
    fail("cudaMemcpy", cudaMemcpy(&w, d, sizeof(w), cudaMemcpyDeviceToHost));
    return w;
  };
  auto reset = [&]() {
    return !fail("cudaMemset", cudaMemset(d, 0, sizeof(Words))) &&
           !fail("cudaDeviceSynchronize", cudaDeviceSynchronize());
  };
  auto elapsed_ms = [&]() {
    float ms = 0;
    fail("cudaEventElapsedTime", cudaEventElapsedTime(&ms, e0, e1));
    return (double)ms;
  };
  auto occupy = [&](uint32_t target, uint32_t* word, uint32_t value) {
    fail("cudaEventRecord", cudaEventRecord(e0, k));
    occupy_kernel<<<r.blocks, kThreads, 0, k>>>(&d->flag, target, bound_ns, &d->started,
                                                &d->timeouts, word, value);
    fail("occupy_kernel", cudaGetLastError());
    fail("cudaEventRecord", cudaEventRecord(e1, k));
  };
  do {
    if (fail("cudaSetDevice", cudaSetDevice(ordinal))) break;
    cudaDeviceGetAttribute(&r.sms, cudaDevAttrMultiProcessorCount, ordinal);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r.resident_per_sm, occupy_kernel, kThreads, 0);
    r.blocks = r.sms * r.resident_per_sm;
    int least = 0, greatest = 0;
    cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (fail("cudaMalloc", cudaMalloc(&d, sizeof(Words))) ||
        fail("cudaStreamCreate", cudaStreamCreateWithFlags(&k, cudaStreamNonBlocking)) ||
        fail("cudaStreamCreate",  // the release stream: highest priority, like the copy stream
             cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest)) ||
        fail("cudaStreamCreate", cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking)) ||
        fail("cudaEventCreate", cudaEventCreate(&e0)) ||
        fail("cudaEventCreate", cudaEventCreate(&e1)))
      break;
    const uint32_t all = (uint32_t)r.blocks;

    // (1) Releases, each once every occupier block is resident (a stream wait, no SM).
    if (!reset()) break;
    occupy(1, nullptr, 0);
    fail("stream_wait_u32", stream_wait_u32(s, &d->started, all, true));
    fail("stream_write_u32", stream_write_u32(s, &d->flag, 1));
    if (fail("sync", cudaDeviceSynchronize())) break;
    r.write_value_timeouts = (int)words().timeouts;
    r.write_value_ms = elapsed_ms();

    if (!reset()) break;
    occupy(1, &d->word, 1);
    fail("stream_wait_u32", stream_wait_u32(s, &d->started, all, true));
    fail("cudaMemcpyAsync", cudaMemcpyAsync(&d->flag, &d->word, 4, cudaMemcpyDeviceToDevice, s));
    if (fail("sync", cudaDeviceSynchronize())) break;
    r.copy_timeouts = (int)words().timeouts;
    r.copy_ms = elapsed_ms();

    if (!reset()) break;
    occupy(1, nullptr, 0);
    fail("stream_wait_u32", stream_wait_u32(s, &d->started, all, true));
    signal_kernel<<<1, 1, 0, s>>>(&d->flag, 1);
    fail("signal_kernel", cudaGetLastError());
    if (fail("sync", cudaDeviceSynchronize())) break;
    Words w = words();
    r.kernel_timeouts = (int)w.timeouts;
    r.kernel_flag_after = w.flag;
    r.kernel_ms = elapsed_ms();

    // (2) Captured once, replayed (NCCL's captured scheme: constants and resets): wait until
    // started == all and reset it in one batch, then write the flag 1; after each occupier, its
    // stream resets the flag to 0 for the next replay.
    if (fail("cudaStreamBeginCapture", cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal)))
      break;
    fail("capture wait+reset", stream_wait_eq_then_reset_u32(s, &d->started, all, 0));
    fail("capture write", stream_write_u32(s, &d->flag, 1));
    if (fail("cudaStreamEndCapture", cudaStreamEndCapture(s, &graph))) break;
    size_t count = 0;
    fail("cudaGraphGetNodes", cudaGraphGetNodes(graph, nullptr, &count));
    std::vector<cudaGraphNode_t> nodes(count);
    fail("cudaGraphGetNodes", cudaGraphGetNodes(graph, nodes.data(), &count));
    r.graph_memop_nodes = r.graph_memcpy_nodes = 0;
    for (cudaGraphNode_t n : nodes) {
      const int type = graph_node_type(n);
      r.graph_memop_nodes += type == 12;  // CU_GRAPH_NODE_TYPE_BATCH_MEM_OP
      r.graph_memcpy_nodes += type == cudaGraphNodeTypeMemcpy;
    }
    if (fail("cudaGraphInstantiate", cudaGraphInstantiate(&exec, graph, 0)) || !reset()) break;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 1; i <= replays && r.error.empty(); ++i) {
      occupy(1, nullptr, 0);
      fail("cudaGraphLaunch", cudaGraphLaunch(exec, s));
      fail("stream_write_u32", stream_write_u32(k, &d->flag, 0));  // after the occupier
      fail("stream_write_u32", stream_write_u32(k, &d->word, (uint32_t)i));  // replays done
    }
    if (fail("sync", cudaDeviceSynchronize())) break;
    r.replay_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                      .count() / std::max(replays, 1);
    w = words();
    r.replay_timeouts = (int)w.timeouts;
    r.replay_flag_after = w.word;

    // (3) The trap: GEQ on the index the host knew at capture (1).
    if (!reset()) break;
    if (fail("cudaStreamBeginCapture", cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal)))
      break;
    fail("capture wait", stream_wait_u32(s, &d->trap, 1, true));
    if (fail("cudaStreamEndCapture", cudaStreamEndCapture(s, &trap)) ||
        fail("cudaGraphInstantiate", cudaGraphInstantiate(&trap_exec, trap, 0)))
      break;
    fail("cudaGraphLaunch", cudaGraphLaunch(trap_exec, s));  // call 1: waits for the flag 1
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    r.trap_first_waited = cudaStreamQuery(s) == cudaErrorNotReady;
    fail("stream_write_u32", stream_write_u32(t, &d->trap, 1));  // call 1's signal
    if (fail("sync", cudaDeviceSynchronize())) break;
    fail("cudaGraphLaunch", cudaGraphLaunch(trap_exec, s));  // call 2: nobody signals it
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    r.trap_second_waited = cudaStreamQuery(s) == cudaErrorNotReady;
    if (r.trap_second_waited) stream_write_u32(t, &d->trap, 2);  // not the trap: let it end
    fail("sync", cudaDeviceSynchronize());
  } while (false);
  cudaGetLastError();
  if (exec) cudaGraphExecDestroy(exec);
  if (trap_exec) cudaGraphExecDestroy(trap_exec);
  if (graph) cudaGraphDestroy(graph);
  if (trap) cudaGraphDestroy(trap);
  for (cudaStream_t x : {k, s, t})
    if (x) cudaStreamDestroy(x);
  for (cudaEvent_t x : {e0, e1})
    if (x) cudaEventDestroy(x);
  if (d) cudaFree(d);
  return r;
}

CeSignalProbe ce_signal_probe(int ordinal, int replays, double bound_s, uint32_t epoch) {
  CeSignalProbe r;
  r.epoch = epoch;
  r.replays = replays;
  const uint64_t bound_ns = (uint64_t)(bound_s * 1e9);
  Words* d = nullptr;
  Flags* f = nullptr;  // f[0]: the sender's (rank 0), f[1]: the receiver's (rank 1)
  ErrorRecord* err = nullptr;
  cudaStream_t k = nullptr, s = nullptr, t = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  const FirstError fail{r.error};
  auto sync = [&]() { return !fail("cudaDeviceSynchronize", cudaDeviceSynchronize()); };
  auto get = [&](const uint32_t* p) {
    uint32_t v = 0;
    fail("cudaMemcpy", cudaMemcpy(&v, p, 4, cudaMemcpyDeviceToHost));
    return v;
  };
  auto set = [&](uint32_t* p, uint32_t v) {
    fail("cudaMemcpy", cudaMemcpy(p, &v, 4, cudaMemcpyHostToDevice));
  };
  do {
    if (fail("cudaSetDevice", cudaSetDevice(ordinal))) break;
    int sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, occupy_kernel, kThreads, 0);
    r.blocks = sms * per_sm;
    int least = 0, greatest = 0;
    cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (fail("preload_ce_kernels", preload_ce_kernels()) ||
        fail("cudaMalloc", cudaMalloc(&d, sizeof(Words))) ||
        fail("cudaMalloc", cudaMalloc(&f, 2 * sizeof(Flags))) ||
        fail("cudaHostAlloc", cudaHostAlloc((void**)&err, sizeof(ErrorRecord),
                                            cudaHostAllocMapped | cudaHostAllocPortable)) ||
        fail("cudaStreamCreate", cudaStreamCreateWithFlags(&k, cudaStreamNonBlocking)) ||
        fail("cudaStreamCreate",  // the copy stream's priority
             cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest)) ||
        fail("cudaStreamCreate", cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking)) ||
        fail("cudaEventCreate", cudaEventCreate(&e0)) ||
        fail("cudaEventCreate", cudaEventCreate(&e1)))
      break;
    std::memset(err, 0, sizeof(ErrorRecord));
    fail("cudaMemset", cudaMemset(d, 0, sizeof(Words)));
    fail("cudaMemset", cudaMemset(f, 0, 2 * sizeof(Flags)));
    // `epoch` calls done on both ranks; the receiver released the slot of the last one, which
    // announced itself and landed its one chunk.
    set(&f[0].epoch, epoch);
    set(&f[1].epoch, epoch);
    set(&f[0].slot_free[1], epoch);
    set(ce_call_word(&f[1], 0), epoch);
    set(ce_landed_word(&f[1], 0), 1);
    if (!sync()) break;
    Peers p[2] = {};
    for (int i = 0; i < 2; ++i) {
      p[i].n = 2, p[i].rank = i, p[i].device = ordinal;
      p[i].flags[0] = &f[0], p[i].flags[1] = &f[1];
    }
    const uint64_t short_ns = 50'000'000;  // 50 ms
    uint32_t* landed = ce_landed_word(&f[1], 0);

    // The receiver, before the sender announced the call: times out on the call word.
    fail("launch_ce_wait_arrival",
         launch_ce_wait_arrival(p[1], 0, 0, kOpAgGemm, short_ns, err, t));
    if (!sync()) break;
    r.early_timed_out = err->set == 1;
    r.early_seen = err->seen, r.early_wanted = err->target;
    std::memset(err, 0, sizeof(ErrorRecord));
    set(&f[1].gave_up, 0);

    // The sender's slot-free wait announces the call on the receiver.
    fail("launch_ce_wait_slot_free",
         launch_ce_wait_slot_free(p[0], 1, kOpAgGemm, short_ns, err, s));
    if (!sync()) break;
    r.announced_call = get(ce_call_word(&f[1], 0));
    r.announced_landed = get(landed);

    // The signal, once every occupier block runs.
    fail("cudaEventRecord", cudaEventRecord(e0, k));
    occupy_kernel<<<r.blocks, kThreads, 0, k>>>(landed, 1, bound_ns, &d->started, &d->timeouts,
                                                nullptr, 0);
    fail("occupy_kernel", cudaGetLastError());
    fail("cudaEventRecord", cudaEventRecord(e1, k));
    fail("stream_wait_u32", stream_wait_u32(s, &d->started, (uint32_t)r.blocks, true));
    fail("launch_ce_signal_arrival", launch_ce_signal_arrival(p[0], 1, 0, -1, s));
    if (!sync()) break;
    float ms = 0;
    fail("cudaEventElapsedTime", cudaEventElapsedTime(&ms, e0, e1));
    r.signal_ms = ms;
    r.signal_timeouts = (int)get(&d->timeouts);
    r.landed_after = get(landed);
    fail("launch_ce_wait_arrival", launch_ce_wait_arrival(p[1], 0, 0, kOpAgGemm, short_ns, err, t));
    if (!sync()) break;
    r.wait_passed = err->set == 0 && get(&f[1].gave_up) == 0;
    fail("launch_ce_wait_arrival", launch_ce_wait_arrival(p[1], 0, 1, kOpAgGemm, short_ns, err, t));
    if (!sync()) break;
    r.later_chunk_timed_out = err->set == 1 && err->seen == 1 && err->target == 2;
    std::memset(err, 0, sizeof(ErrorRecord));

    // Captured once, replayed: each replay's occupier spins until the landed count reaches 1
    // (its stream zeroes the count first); the graph runs once all its blocks do.
    if (fail("cudaStreamBeginCapture", cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal)))
      break;
    fail("capture launch_ce_signal_arrival", launch_ce_signal_arrival(p[0], 1, 0, -1, s));
    if (fail("cudaStreamEndCapture", cudaStreamEndCapture(s, &graph))) break;
    size_t count = 0;
    fail("cudaGraphGetNodes", cudaGraphGetNodes(graph, nullptr, &count));
    std::vector<cudaGraphNode_t> nodes(count);
    fail("cudaGraphGetNodes", cudaGraphGetNodes(graph, nodes.data(), &count));
    r.graph_memop_nodes = r.graph_kernel_nodes = r.graph_memcpy_nodes = 0;
    for (cudaGraphNode_t n : nodes) {
      const int type = graph_node_type(n);
      r.graph_memop_nodes += type == 12;  // CU_GRAPH_NODE_TYPE_BATCH_MEM_OP
      r.graph_kernel_nodes += type == cudaGraphNodeTypeKernel;
      r.graph_memcpy_nodes += type == cudaGraphNodeTypeMemcpy;
    }
    if (fail("cudaGraphInstantiate", cudaGraphInstantiate(&exec, graph, 0))) break;
    fail("cudaMemset", cudaMemset(d, 0, sizeof(Words)));
    if (!sync()) break;
    for (int i = 1; i <= replays && r.error.empty(); ++i) {
      fail("stream_write_u32", stream_write_u32(k, landed, 0));
      occupy_kernel<<<r.blocks, kThreads, 0, k>>>(landed, 1, bound_ns, &d->started,
                                                  &d->timeouts, nullptr, 0);
      fail("occupy_kernel", cudaGetLastError());
      fail("stream_write_u32", stream_write_u32(k, &d->word, (uint32_t)i));  // replays done
      fail("wait+reset", stream_wait_eq_then_reset_u32(s, &d->started, (uint32_t)r.blocks, 0));
      fail("cudaGraphLaunch", cudaGraphLaunch(exec, s));
      // the next replay's occupier must not start before this graph ran (it would see 1)
      fail("cudaEventRecord", cudaEventRecord(e0, s));
      fail("cudaStreamWaitEvent", cudaStreamWaitEvent(k, e0));
    }
    if (!sync()) break;
    r.replay_timeouts = (int)get(&d->timeouts);
    r.replays_done = get(&d->word);
  } while (false);
  r.fallbacks = ce_signal_fallbacks();
  cudaGetLastError();
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  for (cudaStream_t x : {k, s, t})
    if (x) cudaStreamDestroy(x);
  for (cudaEvent_t x : {e0, e1})
    if (x) cudaEventDestroy(x);
  if (d) cudaFree(d);
  if (f) cudaFree(f);
  if (err) cudaFreeHost(err);
  return r;
}

}  // namespace jaxoverlap
