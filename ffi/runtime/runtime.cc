#include "runtime/runtime.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/comm.h"

namespace jaxoverlap {
namespace {

std::string cuda_error(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorString(e);
}

// A lazily set-up object and the lock held while it is set up (first use) and looked at.
template <typename T>
struct Cell {
  std::mutex mu;
  std::unique_ptr<T> obj;
  // Workspaces: a creation that failed for one rank's call fails the same call of every other
  // rank too (owed[r]), so no rank counts a call its peers never made (the epochs would stay
  // out of step for good); the next call tries again.
  std::string error;
  bool owed[kMaxRanks] = {};
};
std::mutex g_mu;  // guards the maps' structure only (look-up, insertion); no CUDA call under it
std::map<int, std::unique_ptr<Cell<DeviceRuntime>>> g_devices;
std::map<WsKey, std::unique_ptr<Cell<Workspace>>> g_workspaces;
constexpr int kMaxDevices = 64;
std::atomic<ErrorRecord*> g_errors{nullptr};  // [kMaxDevices], host-mapped
std::once_flag g_errors_once;
std::mutex g_pending_mu;                 // guards g_pending; taken alone or before a seq_mu
std::vector<std::string> g_pending;      // failures noticed, not yet taken by check_errors()

template <typename K, typename T>
Cell<T>* cell(std::map<K, std::unique_ptr<Cell<T>>>& cells, const K& key) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& c = cells[key];
  if (!c) c = std::make_unique<Cell<T>>();
  return c.get();
}

const char* what_name(int what) {
  switch (what) {
    case kWaitGemmChunk: return "its own GEMM to finish the chunk";
    case kWaitSlotFree: return "the peer to release its staging slot from the previous call";
    case kWaitArrival: return "the peer's pushed chunk";
    case kWaitReduced: return "the local sum of the peers' chunk";
    case kWaitAccReady: return "the peer to seed its accumulator with its own block";
    case kWaitCeBlock: return "the peer's block (pushed by its copy engine)";
    case kWaitTile: return "the peer's partial of a tile of this rank's block (chunk = tile)";
  }
  return "a flag";
}

const char* op_name(int op) {
  switch (op) {
    case kOpGemmRs: return "jaxoverlap.matmul_reduce_scatter";
    case kOpAgGemm: return "jaxoverlap.all_gather_matmul";
    case kOpDgradRs: return "jaxoverlap.all_gather_matmul backward (dgrad reduce-scatter)";
    case kOpGemmAr: return "jaxoverlap.matmul_all_reduce";
    case kOpReduceScatter: return "jaxoverlap.tma_reduce_scatter";
  }
  return "a jaxoverlap fused call";
}

}  // namespace

void* driver_entry(const char* name, int version) {
  cudaDriverEntryPointQueryResult q;
  void* p = nullptr;
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

namespace {

// Each entry point asked for by the version of the signature it is called with: the newest
// version of a name can take other arguments (CUDA 13.0's cuCtxGetDevice takes a context too;
// calling it with the old signature crashed every process in the first one-GPU run of this code).
struct ContextApi {
  PFN_cuCtxGetCurrent_v4000 get = nullptr;
  PFN_cuCtxSetCurrent_v4000 set = nullptr;
  PFN_cuCtxGetDevice_v2000 device = nullptr;
};
const ContextApi& context_api() {
  static const ContextApi api = [] {
    ContextApi a;
    a.get = reinterpret_cast<decltype(a.get)>(driver_entry("cuCtxGetCurrent", 4000));
    a.set = reinterpret_cast<decltype(a.set)>(driver_entry("cuCtxSetCurrent", 4000));
    a.device = reinterpret_cast<decltype(a.device)>(driver_entry("cuCtxGetDevice", 2000));
    if (!a.get || !a.set || !a.device) a = ContextApi{};
    return a;
  }();
  return api;
}

}  // namespace

DeviceGuard::DeviceGuard() {
  const ContextApi& api = context_api();
  CUcontext ctx = nullptr;
  if (!api.get) cudaGetDevice(&saved_device_);
  else if (api.get(&ctx) == CUDA_SUCCESS) saved_ = ctx;  // else none current (not initialised)
}

DeviceGuard::~DeviceGuard() {
  const ContextApi& api = context_api();
  if (api.set) api.set(static_cast<CUcontext>(saved_));  // null restores null
  else if (saved_device_ >= 0) cudaSetDevice(saved_device_);
}

int context_device() {
  const ContextApi& api = context_api();
  CUcontext ctx = nullptr;
  if (!api.get || api.get(&ctx) != CUDA_SUCCESS) return -2;
  if (!ctx) return -1;
  CUdevice d = -1;
  return api.device(&d) == CUDA_SUCCESS ? (int)d : -2;
}

std::string device_runtime(int ordinal, DeviceRuntime** out) {
  Cell<DeviceRuntime>* c = cell(g_devices, ordinal);
  std::lock_guard<std::mutex> lock(c->mu);  // this device's set-up only
  auto& slot = c->obj;
  if (!slot) {
    DeviceGuard guard;
    if (cudaError_t e = cudaSetDevice(ordinal)) return cuda_error("cudaSetDevice", e);
    auto dev = std::make_unique<DeviceRuntime>();
    dev->ordinal = ordinal;
    if (std::string err = outside_capture("setting up the device runtime", [&]() -> std::string {
          if (cudaError_t e = cudaDeviceGetAttribute(&dev->total_sms,
                                                     cudaDevAttrMultiProcessorCount, ordinal))
            return cuda_error("cudaDeviceGetAttribute", e);
          for (cudaEvent_t* ev : {&dev->fork, &dev->gemm_done, &dev->comm_done})
            if (cudaError_t e = cudaEventCreateWithFlags(ev, cudaEventDisableTiming))
              return cuda_error("cudaEventCreate", e);
          return dev->gemm.init();
        });
        !err.empty())
      return err;
    slot = std::move(dev);
  }
  *out = slot.get();
  return "";
}

uint32_t* spanning_dead_word() {
  static uint32_t* word = [] {
    void* p = nullptr;
    if (cudaHostAlloc(&p, sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable))
      return (uint32_t*)nullptr;
    *(volatile uint32_t*)p = 0;
    return (uint32_t*)p;
  }();
  return word;
}

ErrorRecord* error_record(int ordinal) {
  std::call_once(g_errors_once, [] {
    void* p = nullptr;
    if (cudaHostAlloc(&p, sizeof(ErrorRecord) * kMaxDevices,
                      cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess)
      return;
    std::memset(p, 0, sizeof(ErrorRecord) * kMaxDevices);
    g_errors.store(static_cast<ErrorRecord*>(p));
  });
  ErrorRecord* errors = g_errors.load();
  return errors && ordinal >= 0 && ordinal < kMaxDevices ? &errors[ordinal] : nullptr;
}

namespace {

std::string describe(const volatile ErrorRecord& e) {
  char buf[640];
  if (e.what == kPeerGaveUp) {
    std::snprintf(
        buf, sizeof(buf),
        "%s on device %d (rank %d) was given up by a peer process of its group (the peer's "
        "waits timed out or it failed; its copy engine may have overwritten this rank's "
        "staging from call %u on): the output of call %u and later ones were filled with NaN. "
        "The group spans processes: its fused calls stay refused until the processes restart.",
        op_name(e.op), e.device, e.rank, e.seen, e.target);
    return buf;
  }
  std::snprintf(
      buf, sizeof(buf),
      "%s timed out on device %d (rank %d) after %.2f s waiting for %s: peer rank %d, chunk %d "
      "(flag %u, wanted %u). The peer never signalled: it failed, stalled, or is not running the "
      "same program. That call gave up on every rank of its group; the outputs of ranks whose "
      "waits gave up were filled with NaN. Later fused calls run normally.",
      op_name(e.op),
      e.device, e.rank, e.waited_s, what_name(e.what), e.peer, e.chunk, e.seen, e.target);
  return buf;
}

// Runs fn(ws) under ws->seq_mu for every workspace set up so far (no other lock held).
template <typename F>
void for_each_workspace(F fn) {
  std::vector<Cell<Workspace>*> cells;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& [key, c] : g_workspaces) cells.push_back(c.get());
  }
  for (Cell<Workspace>* c : cells) {
    Workspace* ws;
    {
      std::lock_guard<std::mutex> lock(c->mu);
      ws = c->obj.get();
    }
    if (!ws) continue;
    std::lock_guard<std::mutex> lock(ws->seq_mu);
    fn(ws);
  }
}

// Every workspace refuses its call max(issued) + 1 with `found` (runtime.h: begin_call), unless
// an earlier report is still pending there.
void schedule_report(const std::string& found) {
  for_each_workspace([&](Workspace* ws) {
    if (ws->spans) {  // no symmetric refusal across processes: refused from now on (runtime.h)
      if (ws->broken.empty()) ws->broken = found;
      if (uint32_t* dead = ws->peers[ws->local].dead) *(volatile uint32_t*)dead = 1;
      return;
    }
    uint32_t last = 0;
    for (int r = 0; r < ws->n; ++r) last = std::max(last, ws->issued[r]);
    bool pending = false;  // an earlier report not yet refused on every rank
    for (int r = 0; r < ws->n; ++r)
      pending |= ws->refuse_at && (int32_t)(ws->issued[r] - ws->refuse_at) < 0;
    if (pending) return;
    ws->refuse_at = last + 1;
    ws->refuse_msg = found;
  });
}

// Moves kernel-written records into g_pending and schedules their report on every workspace.
void notice_errors() {
  ErrorRecord* errors = g_errors.load();
  if (!errors) return;
  std::string found;
  {
    std::lock_guard<std::mutex> lock(g_pending_mu);
    for (int i = 0; i < kMaxDevices; ++i) {
      volatile ErrorRecord& e = errors[i];
      if (e.set != 1) continue;  // 2: a kernel is still writing it (claim_error_record)
      g_pending.push_back(describe(e));
      if (found.empty()) found = g_pending.back();
      e.set = 0;
    }
  }
  if (!found.empty()) schedule_report(found);
}

}  // namespace

void report_failure(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(g_pending_mu);
    g_pending.push_back(what);
  }
  schedule_report(what);
}

std::string pending_error() {
  notice_errors();
  std::lock_guard<std::mutex> lock(g_pending_mu);
  return g_pending.empty() ? "" : g_pending.front();
}

namespace {

// `msg` was reported (taken by check_errors() or refused to a fused call): it leaves g_pending,
// and the refusals armed with it that no rank has reached yet are cancelled -- or re-armed with
// the next pending report -- so each failure is raised once, not once per workspace. Under each
// workspace's seq_mu: a rank either reached the refusal already (then it stands for every rank
// of that workspace) or never will.
void delivered(const std::string& msg) {
  std::string next;
  {
    std::lock_guard<std::mutex> lock(g_pending_mu);
    auto it = std::find(g_pending.begin(), g_pending.end(), msg);
    if (it != g_pending.end()) g_pending.erase(it);
    if (!g_pending.empty()) next = g_pending.front();
  }
  for_each_workspace([&](Workspace* ws) {
    if (!ws->refuse_at || ws->refuse_msg != msg) return;
    bool reached = false;
    for (int r = 0; r < ws->n; ++r) reached |= (int32_t)(ws->issued[r] - ws->refuse_at) >= 0;
    if (reached) return;
    if (next.empty()) ws->refuse_at = 0;
    else ws->refuse_msg = next;
  });
}

}  // namespace

std::string take_error() {
  notice_errors();
  std::string e;
  {
    std::lock_guard<std::mutex> lock(g_pending_mu);
    if (g_pending.empty()) return "";
    e = g_pending.front();
  }
  delivered(e);
  return e;
}

uint32_t begin_call(Workspace* ws, int rank, CallId id, std::string* refused, bool* misordered) {
  notice_errors();
  uint32_t index;
  refused->clear();
  std::string why;
  std::string broken;
  {
    std::lock_guard<std::mutex> lock(ws->seq_mu);
    index = ++ws->issued[rank];
    if (ws->refuse_at == index) *refused = ws->refuse_msg;
    broken = ws->broken;
    if (!broken.empty())
      *refused = broken + " [this group spans processes: its fused calls stay refused until "
                 "the processes restart]";
    // Across processes the order of calls is not compared (each process sees its own rank's
    // calls only): a spanning group relies on every process issuing its calls in one order, as
    // XLA's own collectives do (docs/call-order.md).
    *misordered = !ws->spans && !ws->order.issue(rank, ws->n, id, &why);
    if (*misordered) abort_call(ws, index);  // before anything else: peers may be spinning
  }
  // Not under seq_mu: delivered() and report_failure() take every workspace's.
  if (!refused->empty()) delivered(broken.empty() ? *refused : broken);
  if (!why.empty()) {
    std::string where;
    for (int r = 0; r < ws->n; ++r)
      where += (r ? ", " : "") + member_name(ws->ordinals[r]);
    report_failure(why + " (group of devices " + where + "; found by rank " +
                   std::to_string(rank) + ")");
  }
  return index;
}

void abort_call(Workspace* ws, uint32_t index) {
  // A peer process cannot see this process's abort ring: for a spanning group the dead word
  // goes first, so this rank's kernels of the call (signals included) stop before the abort
  // lets its waits give up and its pushes carry garbage (ce.cu, ce_signal_arrival_kernel).
  if (ws->spans && ws->peers[ws->local].dead) {
    *(volatile uint32_t*)ws->peers[ws->local].dead = 1;
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  *(volatile uint32_t*)abort_word(ws->abort, index) = index;
}

std::string allocate_abort(Workspace* ws) {
  // The first allocation of a workspace: with no context current it would create device 0's
  // (R1), so the caller must have chosen a member's device.
  if (context_device() == -1)
    return "allocating a workspace's abort words with no CUDA device current on this thread";
  if (cudaError_t e = cudaHostAlloc((void**)&ws->abort, sizeof(uint32_t) * kAbortSlots,
                                    cudaHostAllocMapped | cudaHostAllocPortable))
    return cuda_error("cudaHostAlloc (abort words)", e);
  for (uint32_t i = 0; i < kAbortSlots; ++i) ws->abort[i] = i ^ 1u;  // no epoch of slot i
  return "";
}

std::string allocate_member(Workspace* ws, int i, bool with_partials, bool with_gather) {
  const int n = ws->n;
  const int64_t block_bytes = ws->block_bytes;
  Peers& p = ws->peers[i];
  p.n = n;
  p.rank = i;
  p.device = ws->ordinals[i];
  // With unified addressing (64-bit, every supported GPU) the host pointer is the device one.
  p.abort = ws->abort;
  cudaError_t e;
  if ((e = cudaSetDevice(ws->ordinals[i]))) return cuda_error("cudaSetDevice", e);
  if ((e = cudaEventCreateWithFlags(&ws->done[i], cudaEventDisableTiming)))
    return cuda_error("cudaEventCreate (workspace)", e);
  if ((e = cudaMalloc(&p.stage[i], (n - 1) * block_bytes)))
    return cuda_error("cudaMalloc (staging)", e);
  if ((e = cudaMalloc(&p.flags[i], sizeof(Flags)))) return cuda_error("cudaMalloc (flags)", e);
  if (with_partials && (e = cudaMalloc(&ws->part[i], (n - 1) * block_bytes)))
    return cuda_error("cudaMalloc (partials)", e);
  if (with_partials && n > 2 && (e = cudaMalloc(&ws->acc[i], block_bytes)))
    return cuda_error("cudaMalloc (peer sum)", e);
  if (with_gather && (e = cudaMalloc(&ws->gather[i], (n - 1) * block_bytes)))
    return cuda_error("cudaMalloc (gather staging)", e);
  p.gather[i] = ws->gather[i];
  // A private stream: the synchronisation below waits for this memset only, never for work of
  // other calls (which may be waiting on peers).
  cudaStream_t s;
  if ((e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)))
    return cuda_error("cudaStreamCreate", e);
  cudaMemsetAsync(p.flags[i], 0, sizeof(Flags), s);
  // The staging too: the tile schedule keeps its slab flags in it (kernels/tile_rs.h).
  cudaMemsetAsync(p.stage[i], 0, (n - 1) * block_bytes, s);
  e = cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  if (e) return cuda_error("clearing the flags", e);
  return "";
}

void free_workspace(Workspace* ws) {
  for (int i = 0; i < ws->n; ++i) {
    // Another process's member, or a device that cannot be made current: nothing to free here.
    if (ws->ordinals[i] < 0 || cudaSetDevice(ws->ordinals[i]) != cudaSuccess) continue;
    const Peers& mine = ws->peers[i];
    for (void* p : {(void*)mine.stage[i], (void*)mine.flags[i], (void*)ws->part[i],
                    (void*)ws->acc[i], (void*)ws->gather[i]})
      if (p) cudaFree(p);
    if (ws->done[i]) cudaEventDestroy(ws->done[i]);
    if (ws->spans)  // the peers' buffers mapped into this process
      for (int j = 0; j < ws->n; ++j)
        if (j != i && ws->imported[j])
          for (void* p : {(void*)mine.stage[j], (void*)mine.flags[j], (void*)mine.gather[j]})
            if (p) cudaIpcCloseMemHandle(p);
  }
  if (ws->abort) cudaFreeHost(ws->abort);
  cudaGetLastError();
}

std::string member_name(int v) {
  return v >= 0 ? std::to_string(v) : "id " + std::to_string(-1 - v) + " (another process)";
}

bool spanning_ready(const Workspace* ws) {
  if (!ws->spans) return false;
  for (int r = 0; r < ws->n; ++r)
    if (r != ws->local && !ws->imported[r]) return false;
  return true;
}

std::string with_workspace_slot(
    const WsKey& key, const std::function<std::string(std::unique_ptr<Workspace>&)>& fn) {
  Cell<Workspace>* c = cell(g_workspaces, key);
  std::lock_guard<std::mutex> lock(c->mu);
  return fn(c->obj);
}

namespace {

// Enables peer access, allocates and clears every member's buffers; on failure frees them.
std::string create_workspace(Workspace* ws, bool with_partials, bool with_gather) {
  const int n = ws->n;
  const std::vector<int>& ordinals = ws->ordinals;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      int can = 0;
      cudaDeviceCanAccessPeer(&can, ordinals[i], ordinals[j]);
      if (!can)
        return "device " + std::to_string(ordinals[i]) + " cannot access device " +
               std::to_string(ordinals[j]) + " (no peer access)";
      if (cudaError_t e = cudaSetDevice(ordinals[i])) return cuda_error("cudaSetDevice", e);
      cudaError_t e = cudaDeviceEnablePeerAccess(ordinals[j], 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
      else if (e) return cuda_error("cudaDeviceEnablePeerAccess", e);
    }
  }
  if (std::string e = allocate_abort(ws); !e.empty()) return e;
  for (int i = 0; i < n; ++i)
    if (std::string e = allocate_member(ws, i, with_partials, with_gather); !e.empty()) return e;
  for (int i = 0; i < n; ++i)  // every member's table points at every member's buffers
    for (int j = 0; j < n; ++j) {
      ws->peers[i].stage[j] = ws->peers[j].stage[j];
      ws->peers[i].flags[j] = ws->peers[j].flags[j];
      ws->peers[i].gather[j] = ws->peers[j].gather[j];
    }
  return "";
}

}  // namespace

std::string workspace(int64_t site, const std::vector<int>& ordinals, int rank,
                      int64_t block_bytes, bool with_partials, Workspace** out,
                      bool with_gather) {
  // The process-wide lock covers the look-up only; set-up runs under this workspace's own lock,
  // so calls on other workspaces (and their hot paths) never wait for it.
  Cell<Workspace>* c =
      cell(g_workspaces, WsKey{site, ordinals, block_bytes, with_partials, with_gather});
  std::lock_guard<std::mutex> lock(c->mu);
  if (std::any_of(ordinals.begin(), ordinals.end(), [](int o) { return o < 0; })) {
    // Spanning processes: set up at lowering (xproc.cc), never here.
    if (c->obj && c->obj->local == rank && spanning_ready(c->obj.get())) {
      *out = c->obj.get();
      return "";
    }
    return "the workspace of this call spans processes and was not set up in this process "
           "(site " + std::to_string(site) + ", " + std::to_string(block_bytes) + "-byte blocks"
           "): it is mapped when the program is lowered (jaxoverlap/xproc.py), so a program "
           "that was not lowered in this process (a deserialized jax.export) cannot run it";
  }
  if (rank >= 0 && rank < kMaxRanks && c->owed[rank]) {
    c->owed[rank] = false;
    return c->error;
  }
  if (!c->obj) {
    auto ws = std::make_unique<Workspace>();
    ws->n = (int)ordinals.size();
    ws->ordinals = ordinals;
    ws->block_bytes = block_bytes;
    DeviceGuard guard;
    if (std::string err = outside_capture("creating a workspace", [&] {
          return create_workspace(ws.get(), with_partials, with_gather);
        });
        !err.empty()) {
      free_workspace(ws.get());
      c->error = err;
      for (int r = 0; r < ws->n && r < kMaxRanks; ++r) c->owed[r] = r != rank;
      return err;
    }
    c->obj = std::move(ws);
  }
  *out = c->obj.get();
  return "";
}

int64_t memory_in_use(int ordinal) {
  DeviceGuard guard;
  size_t free_b = 0, total_b = 0;
  if (cudaSetDevice(ordinal) || cudaMemGetInfo(&free_b, &total_b)) return -1;
  return (int64_t)(total_b - free_b);
}

}  // namespace jaxoverlap
