// Which workspace a call gets (issue 25 item 4; docs/workspaces.md): the pool shares one
// workspace per size class instead of keeping one per (op, shape) forever, so a serving loop
// whose batch varies allocates O(log(largest block)) workspaces, not one per batch size.
// Host-only (no CUDA): tests/native/ws_class_test.cc checks the policy with the system compiler.
//
// Both sides of every agreement derive the class from the same inputs: every rank of a group
// from its own call's (site, group, block_bytes, partials, gather, exact) -- equal on every rank,
// since the lowering sends one site and the handlers size blocks from equal shapes -- and every
// process of a group that spans processes from the same key at lowering (jaxoverlap/xproc.py
// through ws_export / ws_import) and at execution (the handler).
#pragma once

#include <cstdint>
#include <tuple>
#include <vector>

namespace jaxoverlap {

// The key of a workspace as a call asks for it: what the lowering sends (site, group as in
// Workspace::ordinals) and what the handler derives from its buffers. `exact`: the call's
// protocol depends on where its data lies in the staging (the tile schedule keeps its flags
// after the two parities' blocks, at an offset that depends on the shape: a shape switch on a
// shared staging would read another shape's data as flags), so it gets a workspace of its own
// site and size.
struct WsKey {
  int64_t site;
  std::vector<int> group;
  int64_t block_bytes;
  bool partials, gather;
  bool exact = false;
};
inline bool operator<(const WsKey& a, const WsKey& b) {
  return std::tie(a.site, a.group, a.block_bytes, a.partials, a.gather, a.exact) <
         std::tie(b.site, b.group, b.block_bytes, b.partials, b.gather, b.exact);
}

// Smallest class: blocks below it share it (a few KiB of rounding on small ops).
constexpr int64_t kMinClassBytes = 64 * 1024;
// The site of every shared workspace (sites are 63-bit hashes, never negative).
constexpr int64_t kClassSite = -1;
// Exact workspaces (the tile schedule's) a process keeps at most, over all groups: each is one
// shape's for good, so a loop over many shapes on that schedule fails at this many with a
// sentence saying what to do (workspace.cc) instead of exhausting device memory.
constexpr int kMaxExactWorkspaces = 32;

// The size class of a block of `bytes`: the smallest of 2^k and 3 * 2^(k-1) that holds it, at
// least kMinClassBytes. Consecutive classes differ by 1.5x and 4/3x, so a workspace is at most
// 1.5x its largest user and a run of sizes up to B touches about 2 log2(B / kMinClassBytes)
// classes.
inline int64_t size_class(int64_t bytes) {
  if (bytes <= kMinClassBytes) return kMinClassBytes;
  int64_t p = kMinClassBytes;
  while (p < bytes) {
    const int64_t mid = p + p / 2;  // 3 * 2^(k-1) between p = 2^(k-1) and 2p
    if (mid >= bytes) return mid;
    p *= 2;
  }
  return p;
}

// The pool's key for a call's key: shared by size class (site kClassSite, the class's bytes)
// unless `exact`. Calls of different ops may share a class: every protocol other than the tile
// schedule's releases a whole staging slot before a peer pushes into it (Flags::slot_free >=
// e - 1, or acc_ready of the call), keeps its flags in the Flags block at places that do not
// depend on the shape, and stamps them with the workspace's epoch, which grows by one per call
// of any op: a flag of an earlier call is always below the target of a later one.
inline WsKey pool_key(const WsKey& k) {
  if (k.exact) return k;
  return WsKey{kClassSite, k.group, size_class(k.block_bytes), k.partials, k.gather, false};
}

}  // namespace jaxoverlap
