// Per-device resources created once and shared by every call: green-context SM partitions and
// their streams, fork/join events, the cuBLASLt runner, the host-mapped error records, and the
// symmetric workspaces of each (call site, group). All entry points are thread-safe: XLA calls
// the handlers from one thread per device, concurrently.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gemm.h"
#include "kernels/common.cuh"

namespace jaxoverlap {

struct Partition {
  cudaStream_t gemm = nullptr, comm = nullptr;  // green-context streams
  int gemm_sms = 0, comm_sms = 0;               // SMs actually granted
};

struct DeviceRuntime {
  int ordinal = -1;
  int total_sms = 0;
  cudaEvent_t fork = nullptr, gemm_done = nullptr, comm_done = nullptr;
  GemmRunner gemm;
  std::map<int, Partition> partitions;  // by requested comm SMs; created under the global lock
  bool kernels_loaded = false;
  // all_gather_matmul: the stream its copy-engine pushes run on (created by its handler) and
  // whether its flag kernels are loaded.
  cudaStream_t copy = nullptr;
  bool ag_kernels_loaded = false;
  // Held by a handler from setup to its last launch: the fork/join events, the GEMM plans and
  // the workspaces' warm-up state are shared by every call on this device, and XLA runs one
  // thread per device, but nothing stops two programs (two Python threads) from calling a
  // handler on the same device at once. Host-side only: it never waits on GPU work of a peer.
  std::mutex launch_mu;
};

// Lazily created; "" on success.
std::string device_runtime(int ordinal, DeviceRuntime** out);
// Green-context split: the comm partition gets `comm_sms` (rounded so that one side is a
// structured multiple of 8 SMs), the GEMM the rest. Created once per (device, comm_sms).
std::string partition(DeviceRuntime* dev, int comm_sms, Partition** out);

// Host-mapped error record of a device (usable from kernels through UVA).
ErrorRecord* error_record(int ordinal);
// "" if no kernel of this process has reported a timeout, else the sentence describing it.
std::string pending_error();

// Memory that every rank of a group can read and write: allocated once per (call site, group)
// on all member devices by the first member to arrive.
struct Workspace {
  int n = 0;
  std::vector<int> ordinals;      // by rank
  int64_t block_bytes = 0;        // one rank's row block of the output
  Peers peers[kMaxRanks];         // the table each rank's kernels get (rank field differs)
  char* part[kMaxRanks] = {};     // GEMM partials of the n - 1 foreign blocks, per rank
  char* acc[kMaxRanks] = {};      // n > 2: sum of peers' contributions, per rank
  bool warmed[kMaxRanks] = {};    // touched only by the thread of that rank's device
};

std::string workspace(int64_t site, const std::vector<int>& ordinals, int64_t block_bytes,
                      bool with_partials, Workspace** out);

// Keeps the current device of the calling thread across a scope that switches devices.
class DeviceGuard {
 public:
  DeviceGuard() { cudaGetDevice(&saved_); }
  ~DeviceGuard() { cudaSetDevice(saved_); }

 private:
  int saved_ = 0;
};

}  // namespace jaxoverlap
