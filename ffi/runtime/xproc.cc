// Workspaces of groups that span processes (one member per process): this process allocates its
// member's buffers and exports the peer-visible ones by CUDA IPC (export_rank); the handles
// travel through the jax.distributed key-value store (jaxoverlap/xproc.py); each process maps
// its peers' (import_peer). Legacy cudaIpc handles: plain bytes that any channel can carry, for
// cudaMalloc memory, which the kernels and the copy engine address like local peer memory. A
// mapping keeps the exporter's memory alive when the exporter exits (measured: run 28), so a
// dead peer makes the waits time out, not fault.
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>

#include "runtime/runtime.h"

namespace jaxoverlap {
namespace {

std::string check_key(const WsKey& key, int rank) {
  const int n = (int)key.group.size();
  if (n < 2 || n > kMaxRanks)
    return "group size " + std::to_string(n) + " is outside 2.." + std::to_string(kMaxRanks);
  if (rank < 0 || rank >= n) return "rank " + std::to_string(rank) + " is outside the group";
  for (int r = 0; r < n; ++r)
    if ((key.group[r] >= 0) != (r == rank))
      return "a group that spans processes must have exactly one member in this process (its "
             "rank " + std::to_string(rank) + "); found member " + member_name(key.group[r]) +
             " at rank " + std::to_string(r);
  return "";
}

int local_rank(const WsKey& key) {
  for (int r = 0; r < (int)key.group.size(); ++r)
    if (key.group[r] >= 0) return r;
  return -1;
}

}  // namespace

std::string export_rank(const WsKey& key, int rank, std::string* handles) {
  if (std::string e = check_key(key, rank); !e.empty()) return e;
  return with_workspace_slot(key, [&](std::unique_ptr<Workspace>& slot) -> std::string {
    if (!slot) {
      auto ws = std::make_unique<Workspace>();
      ws->n = (int)key.group.size();
      ws->ordinals = key.group;
      ws->block_bytes = pool_key(key).block_bytes;  // the slot this key shares (ws_class.h)
      ws->spans = true;
      ws->local = rank;
      // This member's device first: the abort words are the first allocation, and with no
      // device chosen the lowering thread would create a context on device 0 (R1).
      DeviceGuard guard;
      std::string e;
      if (cudaError_t ce = cudaSetDevice(key.group[rank]))
        e = std::string("cudaSetDevice: ") + cudaGetErrorString(ce);
      if (e.empty()) e = allocate_abort(ws.get());
      if (e.empty()) e = allocate_member(ws.get(), rank, key.partials, key.gather);
      if (e.empty()) ws->peers[rank].dead = spanning_dead_word();  // this member's device's
      if (e.empty() && !ws->peers[rank].dead) e = "could not allocate the dead word";
      if (!e.empty()) {
        free_workspace(ws.get());
        return e;
      }
      slot = std::move(ws);
    }
    const Peers& mine = slot->peers[rank];
    void* buffers[3] = {mine.stage[rank], mine.flags[rank], mine.gather[rank]};
    handles->assign(kIpcBytes, '\0');
    DeviceGuard guard;
    if (cudaError_t e = cudaSetDevice(slot->ordinals[rank]))
      return std::string("cudaSetDevice: ") + cudaGetErrorString(e);
    for (int i = 0; i < 3; ++i) {
      if (!buffers[i]) continue;  // no gather staging: its handle stays all zero
      cudaIpcMemHandle_t h;
      if (cudaError_t e = cudaIpcGetMemHandle(&h, buffers[i]))
        return std::string("cudaIpcGetMemHandle failed: ") + cudaGetErrorString(e);
      static_assert(sizeof(h) == 64, "cudaIpcMemHandle_t is 64 bytes");
      std::memcpy(&(*handles)[i * 64], &h, 64);
    }
    return "";
  });
}

std::string import_peer(const WsKey& key, int peer, const std::string& handles) {
  const int rank = local_rank(key);
  if (std::string e = check_key(key, rank); !e.empty()) return e;
  if (peer < 0 || peer >= (int)key.group.size() || peer == rank)
    return "peer rank " + std::to_string(peer) + " is not another member of the group";
  if (handles.size() != (size_t)kIpcBytes)
    return "peer rank " + std::to_string(peer) + " sent " + std::to_string(handles.size()) +
           " bytes of handles, not " + std::to_string(kIpcBytes);
  return with_workspace_slot(key, [&](std::unique_ptr<Workspace>& slot) -> std::string {
    if (!slot) return "import before export: this process's member is not allocated";
    Workspace* ws = slot.get();
    if (ws->imported[peer]) return "";
    Peers& mine = ws->peers[rank];
    char** targets[3] = {&mine.stage[peer], (char**)&mine.flags[peer], &mine.gather[peer]};
    const bool wanted[3] = {true, true, key.gather};
    DeviceGuard guard;
    if (cudaError_t e = cudaSetDevice(ws->ordinals[rank]))
      return std::string("cudaSetDevice: ") + cudaGetErrorString(e);
    std::string err;
    for (int i = 0; i < 3 && err.empty(); ++i) {
      cudaIpcMemHandle_t h;
      std::memcpy(&h, handles.data() + i * 64, 64);
      const bool present = std::string(handles.data() + i * 64, 64) != std::string(64, '\0');
      if (present != wanted[i]) {
        err = "peer rank " + std::to_string(peer) + "'s handles do not match this workspace";
      } else if (present) {
        void* p = nullptr;
        if (cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess)) {
          cudaGetLastError();
          err = "mapping peer rank " + std::to_string(peer) + "'s memory (cudaIpcOpenMemHandle) "
                "failed: " + cudaGetErrorString(e) + ". Its GPU must be reachable by peer "
                "access (NVLink) from device " + std::to_string(ws->ordinals[rank]);
        }
        *targets[i] = static_cast<char*>(p);
      }
    }
    if (err.empty()) {
      ws->imported[peer] = true;
      return "";
    }
    for (char** t : targets) {  // a retry starts from nothing mapped
      if (*t) cudaIpcCloseMemHandle(*t);
      *t = nullptr;
    }
    cudaGetLastError();
    return err;
  });
}

}  // namespace jaxoverlap
