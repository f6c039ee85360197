// Per-device resources created once and shared by every call: green-context SM partitions and
// their streams, fork/join events, the cuBLASLt runner, the host-mapped error records, and the
// symmetric workspaces of each (call kind, group). All entry points are thread-safe: XLA calls
// the handlers from one thread per device, concurrently. First-use setup (allocation, peer
// access, memsets) runs under a lock of the object being set up, never under the process-wide
// lock that every call's look-up takes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <set>
#include <tuple>
#include <vector>

#include "runtime/call_order.h"
#include "runtime/capture.h"
#include "runtime/gemm.h"
#include "runtime/memops.h"
#include "runtime/ws_class.h"
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
  // The stream copy-engine pushes run on (all_gather_matmul, the dgrad reduce-scatter; created by
  // ce_setup) and whether the copy-engine protocol kernels are loaded.
  cudaStream_t copy = nullptr;
  bool ce_kernels_loaded = false;
  // The copy-engine reduce-scatter's GEMM-chunk-done events, one per (peer block, chunk),
  // created by its handler (handlers/gemm_rs_ce.cc).
  std::vector<cudaEvent_t> chunk_done;
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

// The word of this process's spanning workspaces on the current device (Peers::dead): device
// memory, so the waiters' polls never cross PCIe (issue 26, R7), allocated on first use on that
// device (the caller has set it: R1), raised by kernels that time out and by the host
// (write_word); null if it could not be allocated.
uint32_t* spanning_dead_word();

// Host-mapped error record of a device (usable from kernels through UVA).
ErrorRecord* error_record(int ordinal);
// "" if no failure of a fused call in this process is waiting to be reported, else the sentence
// describing the oldest one (op, device, rank, peer, chunk). Does not clear it.
std::string pending_error();
// pending_error(), cleared (jaxoverlap.check_errors()).
std::string take_error();
// Queues a failure found by a host (not a kernel) for pending_error() and schedules its report
// on every workspace, like a kernel's timeout record.
void report_failure(const std::string& what);
// Queues `what` for pending_error() (check_errors() raises it) without scheduling its report on
// the workspaces -- report_failure's first half, which takes no workspace's seq_mu, so it may be
// called under one: for a failure beside another that is reported anyway (write_word).
void note_failure(const std::string& what);

// Memory that every rank of a group can read and write: allocated once per pool key (ws_class.h:
// the group, the size class of the call's block and its areas; the site too for an exact one) on
// all member devices by the first member to arrive, and reused by every later call with the same
// key. `site` is not a call-site counter: the lowering derives it from what every rank and every
// process knows identically (op, shapes, dtype, settings; jaxoverlap/fused/call.py,
// `_table_attrs`), so fresh jit wrappers and unrolled layers of one op share one workspace; the
// size class makes calls of other shapes (a batch that varies) share it too, so memory grows
// with the number of size classes, not of shapes (docs/workspaces.md).
//
// Ordering of the calls that share a workspace: on each device, every call waits for the
// previous call's `done[rank]` (recorded on XLA's stream after its finish kernel) before it
// forks, so calls from different XLA streams never overlap on one workspace and the epochs
// (Flags::epoch) advance by one per call, in the order the handlers were called (under the
// device's launch_mu). Across ranks, call number k of every rank is one logical call, so every
// rank must issue the calls of a workspace in the same order. Within one SPMD program they do;
// two programs that share a workspace (any two containing the same op and shapes) launched
// from two threads do as long as XLA queues launches in one order on every device (its
// multi-device launches are gang-scheduled today), and control flow that differs between
// devices breaks it. `order` checks it on every call (call_order.h): a call that differs from
// another rank's call of the same number is given up on every rank and reported: no rank
// computes a result from another call's data.
//
// A group that spans processes (one member per process: one process per GPU) has its members
// of other processes in `ordinals` as -1 - (global device id): its workspace is not created by
// the first call but at lowering time, by the Python side of every process (jaxoverlap/xproc.py:
// export_rank here, the handles through the jax.distributed key-value store, import_peer in
// the others), and a call finds it ready or fails. A failure noticed in a process that has such
// a workspace breaks it for good (`broken`, and Peers::dead for the kernels already launched):
// the peer processes cannot be told to refuse the same call, so its calls are refused from then
// on, on this side at once and on the others after their waits of the next call time out.
struct Workspace {
  int n = 0;
  std::vector<int> ordinals;      // by rank; < 0: a member in another process
  int64_t block_bytes = 0;        // a slot's bytes: the size class of its users' blocks
  Peers peers[kMaxRanks];         // the table each rank's kernels get (rank field differs)
  char* part[kMaxRanks] = {};     // GEMM partials of the n - 1 foreign blocks, per rank
  char* acc[kMaxRanks] = {};      // n > 2: sum of peers' contributions, per rank
  char* gather[kMaxRanks] = {};   // all-reduce: n - 1 slots of one block per rank (slot
                                  // stage_slot(src, rank, n)), the peers' reduced blocks
  // Under rank r's DeviceRuntime::launch_mu: the site of its current call (set by workspace())
  // and the sites whose warm-up ran on its device (fused_call.h: warm_up_now) -- per site, not per
  // workspace: calls of other shapes share a workspace (ws_class.h) and load other GEMM kernels.
  int64_t site_now[kMaxRanks] = {};
  std::set<int64_t> warmed[kMaxRanks];
  cudaEvent_t done[kMaxRanks] = {};  // on rank r's device: the last call of this workspace ended
  // The abort ring (Peers::abort, kAbortSlots words) in device memory of `abort_device` (member
  // 0's, or the local member's in a group that spans processes), which the other members of
  // this process read over NVLink; the host raises its words, and a spanning group's dead word,
  // by write_word on `abort_stream` (issue 26, R7: the waiters poll it, never host memory).
  uint32_t* abort = nullptr;
  int abort_device = -1;
  cudaStream_t abort_stream = nullptr;
  // Calls issued per rank (under seq_mu). Every counted call runs the finish kernel exactly once,
  // so issued[r] + 1 is the epoch target of rank r's next call, the same on every rank.
  std::mutex seq_mu;
  uint32_t issued[kMaxRanks] = {};
  CallOrder order;                // under seq_mu: the identity of every rank's call k agrees
  uint32_t refuse_at = 0;         // a failure is reported by call number `refuse_at` on each rank
  std::string refuse_msg;
  // Spanning processes: this process's rank, which peers' memory is mapped (cudaIpc), and the
  // failure every later call raises (under seq_mu).
  bool spans = false;
  int local = -1;
  bool imported[kMaxRanks] = {};
  std::string broken;
};

static_assert(kMaxRanks <= CallOrder::kRanks, "CallOrder tracks fewer ranks than a group has");

// Starts rank `rank`'s next call of `ws`, the logical call `id`: returns its number (= its epoch
// target) and sets `refused` to the report of an earlier failure if this call is the one chosen
// to raise it. A reported failure is scheduled for call max(issued) + 1 on every workspace,
// chosen under seq_mu: no rank has issued it yet, so every rank refuses the same call
// (asynchronous dispatch runs hosts ahead of their GPUs; refusing "the next call" per rank would
// not be symmetric).
// `*misordered` is set when another rank issued a different logical call under this number
// (Workspace::order). Then the call's abort word is already raised -- every rank's waits of it
// give up, the ranks that launched it fill their outputs with NaN -- and the difference is
// reported like a timeout (pending_error, the next call of every workspace); the caller must
// launch nothing for it but close it (handlers/fused_call.h: begin_call). The rank that issued its
// call first has launched it by then, but that call cannot have finished: it waits for this
// rank's data of the same number, which is never sent.
uint32_t begin_call(Workspace* ws, int rank, CallId id, std::string* refused, bool* misordered);

// Gives up call number `index` of `ws` on every rank: raises its abort word (Peers::abort).
void abort_call(Workspace* ws, uint32_t index);
// Host write of a word of `ws`'s abort ring or of its dead word (both in device memory of
// ws->abort_device): a stream write on ws->abort_stream, no SM, not behind any spinning kernel.
// `what` names the word; if it cannot be written at all, that is noted (note_failure): the
// waits it would have ended early then end by their own timeouts.
void write_word(Workspace* ws, uint32_t* word, uint32_t value, const std::string& what);

// The workspace of a call (site, `ordinals`, its block of `block_bytes`) from the pool: shared by
// every call of the same group, size class and areas (ws_class.h: pool_key), or `exact`: its
// own. Allocated on every member on first use; a creation that fails fails the same call on
// every rank (`rank`: the caller's), never just one. `with_gather`: also the second staging
// area `gather` (the GEMM + all-reduce). Records `site` as rank `rank`'s current call
// (Workspace::site_now; the caller holds that rank's launch_mu).
std::string workspace(int64_t site, const std::vector<int>& ordinals, int rank,
                      int64_t block_bytes, bool with_partials, Workspace** out,
                      bool with_gather = false, bool exact = false);

// Cross-process set-up (xproc.cc) of the workspace `key` whose rank `rank` is this process's:
// allocates that rank's buffers (once) and returns the CUDA IPC handles of its peer-visible ones
// (staging, flags, gather staging) as kIpcBytes bytes.
constexpr int kIpcBytes = 3 * 64;
std::string export_rank(const WsKey& key, int rank, std::string* handles);
// Maps the buffers of `peer` (its export_rank bytes) into this process's rank of `key`.
std::string import_peer(const WsKey& key, int peer, const std::string& handles);
// True when `ws` spans processes and every peer of its local rank is mapped.
bool spanning_ready(const Workspace* ws);
// A member of Workspace::ordinals in messages: its CUDA ordinal, or the global id of another
// process's device.
std::string member_name(int ordinal);

// Runs fn on the slot of pool_key(key) (ws_class.h) under its set-up lock (creating the slot, not the
// workspace): what xproc.cc builds cross-process workspaces with.
std::string with_workspace_slot(const WsKey& key,
                                const std::function<std::string(std::unique_ptr<Workspace>&)>& fn);
// The abort ring of `ws` (Peers::abort) on the current device, and member `i`'s buffers on its
// device (cleared flags; ws->peers[i]'s own entries): the pieces both creations are built of.
std::string allocate_abort(Workspace* ws);
std::string allocate_member(Workspace* ws, int i, bool with_partials, bool with_gather);
// Frees what a workspace holds on this process's devices (its own allocations, the peers'
// mappings); for a creation that failed half way.
void free_workspace(Workspace* ws);
// Runs fn(ws) under ws->seq_mu for every workspace set up so far (no other lock held): how a
// reported failure reaches every workspace (runtime.cc).
void for_each_workspace(const std::function<void(Workspace*)>& fn);

// "<what> failed: <CUDA's description of e>".
std::string cuda_error(const char* what, cudaError_t e);

// Device memory in use on `ordinal` (total - free, cudaMemGetInfo), in bytes; -1 on error.
int64_t memory_in_use(int ordinal);

// What the workspace pool holds now (issue 25 item 4; docs/workspaces.md), counted from the
// buffers each workspace actually has, without a CUDA call: `own_bytes` allocated by this
// process (staging, flags, partials, peer sum, gather staging of its members), by CUDA ordinal
// in `own_by_device`; `mapped_bytes`, its peers' buffers mapped into this process by CUDA IPC
// (another process's allocations, counted there); one entry of `block_bytes` per workspace (its
// class, or an exact workspace's own size). `flags_bytes`: one member's flag block. Not counted:
// a workspace's abort ring (kAbortSlots words).
struct PoolStats {
  int workspaces = 0, exact = 0, spanning = 0;
  int64_t own_bytes = 0, mapped_bytes = 0, flags_bytes = 0;
  std::map<int, int64_t> own_by_device;
  std::vector<int64_t> block_bytes;
};
PoolStats pool_stats();

// Keeps the calling thread's current CUDA context across a scope that switches devices: the
// driver's current context (cuCtxGetCurrent), restored as it was. A thread that had none (the
// Python thread that lowers a program and exports its workspaces) is left with none: restoring
// a device instead (cudaSetDevice) would create that device's primary context, on device 0 in
// every process whatever its GPU (issue 26, R1).
class DeviceGuard {
 public:
  DeviceGuard();
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  void* saved_ = nullptr;  // CUcontext; null: none current
  int saved_device_ = -1;  // only when the driver's entry points are missing: the device
};

// The device of the driver context current on this thread: -1 if none, -2 if it cannot tell.
int context_device();

}  // namespace jaxoverlap
