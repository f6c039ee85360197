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

// A lazily set-up device runtime and the lock held while it is set up (first use) and looked at.
struct DeviceCell {
  std::mutex mu;
  std::unique_ptr<DeviceRuntime> obj;
};
std::mutex g_mu;  // guards g_devices' structure only (look-up, insertion); no CUDA call under it
std::map<int, std::unique_ptr<DeviceCell>> g_devices;
constexpr int kMaxDevices = 64;
std::atomic<ErrorRecord*> g_errors{nullptr};  // [kMaxDevices], host-mapped
std::once_flag g_errors_once;
std::mutex g_pending_mu;                 // guards g_pending; never held while taking a seq_mu (note_failure takes it under one)
std::vector<std::string> g_pending;      // failures noticed, not yet taken by check_errors()

DeviceCell* device_cell(int ordinal) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& c = g_devices[ordinal];
  if (!c) c = std::make_unique<DeviceCell>();
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

std::string cuda_error(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorString(e);
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
  DeviceCell* c = device_cell(ordinal);
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
  static std::mutex mu;
  static std::map<int, uint32_t*> words;  // by device ordinal
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) return nullptr;
  std::lock_guard<std::mutex> lock(mu);
  uint32_t*& word = words[device];
  if (word) return word;
  void* p = nullptr;
  cudaStream_t s = nullptr;
  if (cudaMalloc(&p, sizeof(uint32_t)) != cudaSuccess ||
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    if (p) cudaFree(p);
    cudaGetLastError();
    return nullptr;
  }
  // A private stream: the synchronisation waits for this memset only.
  const bool ok = cudaMemsetAsync(p, 0, sizeof(uint32_t), s) == cudaSuccess &&
                  cudaStreamSynchronize(s) == cudaSuccess;
  cudaStreamDestroy(s);
  if (!ok) {
    cudaFree(p);
    cudaGetLastError();
    return nullptr;
  }
  word = static_cast<uint32_t*>(p);
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
// Every workspace refuses its call max(issued) + 1 with `found` (runtime.h: begin_call), unless
// an earlier report is still pending there.
void schedule_report(const std::string& found) {
  for_each_workspace([&](Workspace* ws) {
    if (ws->spans) {  // no symmetric refusal across processes: refused from now on (runtime.h)
      if (ws->broken.empty()) ws->broken = found;
      if (uint32_t* dead = ws->peers[ws->local].dead)
        write_word(ws, dead, 1, "the dead word of a workspace spanning processes");
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

void note_failure(const std::string& what) {
  std::lock_guard<std::mutex> lock(g_pending_mu);
  g_pending.push_back(what);
}

void report_failure(const std::string& what) {
  note_failure(what);
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

}  // namespace jaxoverlap
