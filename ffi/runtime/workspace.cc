// The pool of workspaces (runtime.h: Workspace): their look-up and first-use creation, the
// buffers every member needs, and the abort of a call.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/memops.h"
#include "runtime/runtime.h"

namespace jaxoverlap {
namespace {

// A workspace's slot and the lock held while it is set up (first use) and looked at. A creation
// that failed for one rank's call fails the same call of every other rank too (owed[r]), so no
// rank counts a call its peers never made (the epochs would stay out of step for good); the
// next call tries again.
struct WsCell {
  std::mutex mu;
  std::unique_ptr<Workspace> obj;
  std::string error;
  bool owed[kMaxRanks] = {};
};
std::mutex g_mu;  // guards g_workspaces' structure only (look-up, insertion); no CUDA call under it
std::map<WsKey, std::unique_ptr<WsCell>> g_workspaces;  // by pool key (ws_class.h)
int g_exact = 0;                                        // exact keys in g_workspaces

// The cell of the pool key of `key`, created if new; "" or why not (too many exact workspaces).
std::string ws_cell(const WsKey& key, WsCell** out) {
  const WsKey pk = pool_key(key);
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_workspaces.find(pk);
  if (it == g_workspaces.end()) {
    if (pk.exact && g_exact >= kMaxExactWorkspaces)
      return "this process already holds " + std::to_string(g_exact) + " workspaces of the tile "
             "schedule, one per shape (its staging's layout depends on the shape, so shapes "
             "cannot share one; docs/workspaces.md), the most it keeps. A loop over many shapes "
             "(a varying batch) should use schedule='chunked' (Config(schedule=...)), whose "
             "workspaces are shared by size class, or pad its batch to a few sizes";
    g_exact += pk.exact;
    it = g_workspaces.emplace(pk, std::make_unique<WsCell>()).first;
  }
  *out = it->second.get();
  return "";
}

}  // namespace

// Runs fn(ws) under ws->seq_mu for every workspace set up so far (no other lock held).
void for_each_workspace(const std::function<void(Workspace*)>& fn) {
  std::vector<WsCell*> cells;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& [key, c] : g_workspaces) cells.push_back(c.get());
  }
  for (WsCell* c : cells) {
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

void write_word(Workspace* ws, uint32_t* word, uint32_t value, const std::string& what) {
  // A stream write on the ring's side stream (no SM, not behind any kernel of the device's other
  // streams), or, if the driver refuses it, a 4-byte copy from pageable memory (staged before
  // cudaMemcpyAsync returns). If neither can be issued, the word stays down: the waits it would
  // have ended end by their own timeouts, and the failure is noted for check_errors() (noted,
  // not reported: the callers hold a workspace's seq_mu, and they report the failure that made
  // them raise it anyway).
  DeviceGuard guard;
  std::string failed;
  if (cudaError_t e = cudaSetDevice(ws->abort_device)) {
    failed = cuda_error("cudaSetDevice", e);
  } else if (cudaError_t w = stream_write_u32(ws->abort_stream, word, value)) {
    cudaGetLastError();
    if (cudaError_t c = cudaMemcpyAsync(word, &value, sizeof(value), cudaMemcpyHostToDevice,
                                        ws->abort_stream))
      failed = cuda_error("the stream write", w) + "; " + cuda_error("the 4-byte copy", c);
  }
  cudaGetLastError();
  if (!failed.empty())
    note_failure("raising " + what + " on device " + std::to_string(ws->abort_device) +
                 " failed (" + failed + "): the waits it would have ended at once end by their "
                 "own timeouts");
}

void abort_call(Workspace* ws, uint32_t index) {
  // A peer process cannot see this process's abort ring: for a spanning group the dead word
  // goes first (the same stream: in that order), so this rank's kernels of the call (signals
  // included) stop before the abort lets its waits give up and its pushes carry garbage (ce.cu,
  // ce_wait_slot_free_kernel).
  if (ws->spans && ws->peers[ws->local].dead)
    write_word(ws, ws->peers[ws->local].dead, 1, "the dead word of a workspace spanning processes");
  write_word(ws, abort_word(ws->abort, index), index,
             "the abort word of call " + std::to_string(index));
}

std::string allocate_abort(Workspace* ws) {
  // The first allocation of a workspace: with no context current it would create device 0's
  // (R1), so the caller must have chosen a member's device -- the ring's (issue 26, R7: device
  // memory, so the waiters' polls never cross PCIe; members in this process read it over NVLink).
  if (context_device() == -1)
    return "allocating a workspace's abort words with no CUDA device current on this thread";
  if (cudaError_t e = cudaGetDevice(&ws->abort_device)) return cuda_error("cudaGetDevice", e);
  int least = 0, greatest = 0;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (cudaError_t e =
          cudaStreamCreateWithPriority(&ws->abort_stream, cudaStreamNonBlocking, greatest))
    return cuda_error("cudaStreamCreate (abort words)", e);
  if (cudaError_t e = cudaMalloc((void**)&ws->abort, sizeof(uint32_t) * kAbortSlots))
    return cuda_error("cudaMalloc (abort words)", e);
  uint32_t init[kAbortSlots];
  for (uint32_t i = 0; i < kAbortSlots; ++i) init[i] = i ^ 1u;  // no epoch of slot i
  // Checked: a ring left holding its allocation's old contents could hold a future epoch and
  // abort that call on every rank.
  if (cudaError_t e = cudaMemcpyAsync(ws->abort, init, sizeof(init), cudaMemcpyHostToDevice,
                                      ws->abort_stream))
    return cuda_error("initialising the abort words", e);
  if (cudaError_t e = cudaStreamSynchronize(ws->abort_stream))
    return cuda_error("initialising the abort words", e);
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
  // The staging too: the tile schedule keeps its slab flags in it (kernels/tile_rs.h). And every
  // other area, once, so that no byte of a workspace is ever undefined: each call writes what it
  // reads of them first (cuBLASLt's GEMM the partials, the peers' pushes the gather staging), but
  // compute-sanitizer's initcheck reported every comm-kernel load of the partials as a read of
  // uninitialized memory after the GEMM had written them (issue 25, call D; the results were
  // right): it apparently does not follow cuBLASLt's (TMA) stores.
  cudaMemsetAsync(p.stage[i], 0, (n - 1) * block_bytes, s);
  if (ws->part[i]) cudaMemsetAsync(ws->part[i], 0, (n - 1) * block_bytes, s);
  if (ws->acc[i]) cudaMemsetAsync(ws->acc[i], 0, block_bytes, s);
  if (ws->gather[i]) cudaMemsetAsync(ws->gather[i], 0, (n - 1) * block_bytes, s);
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
  if (ws->abort_device >= 0 && cudaSetDevice(ws->abort_device) == cudaSuccess) {
    if (ws->abort) cudaFree(ws->abort);
    if (ws->abort_stream) cudaStreamDestroy(ws->abort_stream);
  }
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
  WsCell* c = nullptr;
  if (std::string e = ws_cell(key, &c); !e.empty()) return e;
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
  // The abort ring on member 0's device (allocate_abort), read by the others over NVLink.
  if (cudaError_t e = cudaSetDevice(ordinals[0])) return cuda_error("cudaSetDevice", e);
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
                      bool with_gather, bool exact) {
  // The process-wide lock covers the look-up only; set-up runs under this workspace's own lock,
  // so calls on other workspaces (and their hot paths) never wait for it.
  const WsKey key{site, ordinals, block_bytes, with_partials, with_gather, exact};
  WsCell* c = nullptr;
  if (std::string e = ws_cell(key, &c); !e.empty()) return e;
  std::lock_guard<std::mutex> lock(c->mu);
  if (std::any_of(ordinals.begin(), ordinals.end(), [](int o) { return o < 0; })) {
    // Spanning processes: set up at lowering (xproc.cc), never here.
    if (c->obj && c->obj->local == rank && spanning_ready(c->obj.get())) {
      *out = c->obj.get();
      (*out)->site_now[rank] = site;
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
    ws->block_bytes = pool_key(key).block_bytes;
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
  if (rank >= 0 && rank < kMaxRanks) (*out)->site_now[rank] = site;
  return "";
}

PoolStats pool_stats() {
  std::vector<std::pair<bool, WsCell*>> cells;  // (exact, cell)
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& [key, c] : g_workspaces) cells.emplace_back(key.exact, c.get());
  }
  PoolStats st;
  st.flags_bytes = sizeof(Flags);
  for (auto [exact, c] : cells) {
    std::lock_guard<std::mutex> lock(c->mu);  // buffers and mappings change under it only
    const Workspace* ws = c->obj.get();
    if (!ws) continue;
    const int64_t slots = (int64_t)(ws->n - 1) * ws->block_bytes;
    ++st.workspaces;
    st.exact += exact;
    st.spanning += ws->spans;
    st.block_bytes.push_back(ws->block_bytes);
    for (int i = 0; i < ws->n; ++i) {
      if (ws->ordinals[i] < 0) continue;  // another process's member
      const Peers& p = ws->peers[i];
      const int64_t own = (p.stage[i] ? slots : 0) + (p.flags[i] ? (int64_t)sizeof(Flags) : 0) +
                          (ws->part[i] ? slots : 0) + (ws->acc[i] ? ws->block_bytes : 0) +
                          (ws->gather[i] ? slots : 0);
      st.own_bytes += own;
      st.own_by_device[ws->ordinals[i]] += own;
      if (ws->spans)
        for (int j = 0; j < ws->n; ++j)
          if (j != i && ws->imported[j])
            st.mapped_bytes += (p.stage[j] ? slots : 0) +
                               (p.flags[j] ? (int64_t)sizeof(Flags) : 0) +
                               (p.gather[j] ? slots : 0);
    }
  }
  return st;
}

int64_t memory_in_use(int ordinal) {
  DeviceGuard guard;
  size_t free_b = 0, total_b = 0;
  if (cudaSetDevice(ordinal) || cudaMemGetInfo(&free_b, &total_b)) return -1;
  return (int64_t)(total_b - free_b);
}

}  // namespace jaxoverlap
