// The order guard of one workspace (issue 12 item 6). The epochs pair call number k of every rank
// of a group with call number k of every other rank, so every rank must issue the calls of a
// workspace in the same order. Each call carries an identity that every rank of one logical
// call knows alike -- XLA's run id of the launch, the call's tag in its program (a lowering
// attribute, jaxoverlap/fused/call.py `_call_tag`) and how many calls with that (run, tag) this rank
// issued on this workspace before -- and the first rank to issue call number k records it; every
// later rank compares its own. A difference means the ranks paired two different calls: the
// caller gives that call up on every rank (runtime.h: begin_call).
// Every counter below depends only on the rank's own sequence of calls, so ranks that issue the
// same sequence never disagree, whatever the interleaving of their hosts; at the first number
// where two ranks' sequences differ, their (run, tag) differ. The occurrence tells apart calls
// mispaired after that (one scan body's iterations k and k + 1).
//
// Under XLA's command buffers (JAXOVERLAP_COMMAND_BUFFERS=1) the host no longer sees every call:
// a device that replays a recorded graph runs its calls without the handler, and XLA decides per
// device when to warm up and re-record (a buffer address of that device changed, or compiling
// any new executable in the process evicted every graph: docs/ordering-and-stream-memops.md,
// section 2). Two ranks' host call numbers then count different things, and comparing them
// would report orders that do not differ (the call given up on every rank, NaN). So the first
// call of a workspace that is captured ends the comparison for good (CallId::captured): from
// then on the devices' epochs alone pair the calls, as they do for groups that span processes,
// and a call given up raises the abort word of the epoch its device counted (kernels/comm.h:
// launch_finish_poison), not of its host number.
//
// Host-only, no CUDA: used under Workspace::seq_mu, and compiled alone by the CPU test
// tests/test_call_order.py.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace jaxoverlap {

// What the handler knows of the logical call it runs.
struct CallId {
  int64_t run = 0;  // XLA's RunId: one per launch of a program, the same on all its devices
  int64_t tag = 0;  // the custom call's place in its program, the same on every device
  bool captured = false;  // XLA is capturing it into a command buffer (CUDA graph)
};

class CallOrder {
 public:
  static constexpr int kRanks = 8;             // >= kMaxRanks (checked in runtime.h)
  static constexpr int kRecent = 64;           // (run, tag) pairs counted per rank (LRU)
  static constexpr size_t kMaxOpen = 1 << 16;  // calls not yet issued by every rank, kept

  // Rank `rank` of `n` issues its next call, identified by `id`. Returns false if an earlier
  // rank issued a different logical call under the same number; then `*why` describes both --
  // once per call number (empty for the ranks that find the same difference later).
  // Always true once a call of the workspace was captured.
  bool issue(int rank, int n, CallId id, std::string* why) {
    why->clear();
    if (id.captured && comparing_) {
      comparing_ = false;
      open_.clear();
      for (std::vector<Seen>& s : seen_) s.clear();
    }
    if (!comparing_) return true;
    const Key key{id.run, id.tag, occurrence(rank, id)};
    const uint64_t number = ++calls_[rank];
    auto it = open_.find(number);
    if (it == open_.end()) {
      if (n > 1) open_.emplace(number, Open{key, rank, 1u << rank, false});
      while (open_.size() > kMaxOpen) open_.erase(open_.begin());  // a rank that stopped
      return true;
    }
    Open& o = it->second;
    o.ranks |= 1u << rank;
    const bool same = o.key.run == key.run && o.key.tag == key.tag && o.key.nth == key.nth;
    if (!same && !o.reported) {
      o.reported = true;
      *why = describe(number, o.first_rank, o.key, rank, key);
    }
    if (o.ranks == (1u << n) - 1u) open_.erase(it);
    return same;
  }

 private:
  struct Key {
    int64_t run, tag;
    uint64_t nth;  // 1 for the first call of (run, tag) on this rank
  };
  struct Open {
    Key key;         // of the first rank that issued this call number
    int first_rank;
    uint32_t ranks;  // bit r: rank r issued it
    bool reported;
  };
  struct Seen {
    int64_t run, tag;
    uint64_t count, used;
  };

  uint64_t occurrence(int rank, CallId id) {
    std::vector<Seen>& seen = seen_[rank];
    ++clock_;
    Seen* lru = nullptr;
    for (Seen& s : seen) {
      if (s.run == id.run && s.tag == id.tag) {
        s.used = clock_;
        return ++s.count;
      }
      if (!lru || s.used < lru->used) lru = &s;
    }
    if (seen.size() < (size_t)kRecent) {
      seen.push_back(Seen{id.run, id.tag, 1, clock_});
    } else {
      *lru = Seen{id.run, id.tag, 1, clock_};
    }
    return 1;
  }

  static std::string describe(uint64_t number, int rank_a, const Key& a, int rank_b,
                              const Key& b) {
    char buf[900];
    std::snprintf(
        buf, sizeof(buf),
        "fused calls that share a workspace were issued in different orders on the ranks of "
        "their group: call %llu of the workspace is launch %lld, call tag %lld (its call %llu "
        "there) on rank %d but launch %lld, call tag %lld (its call %llu there) on rank %d, so "
        "the two ranks would have exchanged the data of different calls. Every rank must issue "
        "the fused calls of one op and shape in the same order: do not run two programs "
        "containing the same fused op and shapes concurrently from several threads unless XLA "
        "launches them in one order on every GPU, and keep fused ops out of control flow that "
        "differs between devices (lax.cond or while_loop on a device-varying value). The call "
        "was given up on every rank of the group; its outputs were filled with NaN.",
        (unsigned long long)number, (long long)a.run, (long long)a.tag,
        (unsigned long long)a.nth, rank_a, (long long)b.run, (long long)b.tag,
        (unsigned long long)b.nth, rank_b);
    return buf;
  }

  bool comparing_ = true;  // false once a call was captured: the hosts' numbers no longer pair
  uint64_t calls_[kRanks] = {};
  uint64_t clock_ = 0;
  std::vector<Seen> seen_[kRanks];
  std::map<uint64_t, Open> open_;
};

}  // namespace jaxoverlap
