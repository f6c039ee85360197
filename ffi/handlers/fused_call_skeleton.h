// The skeleton every fused handler runs its call in (issue 22): FusedCall (fused_call.h) is this
// template over the CUDA runtime; tests/native/fused_call_test.cc instantiates it over a fake one
// that records calls, built by the system C++ compiler alone. So this header names no CUDA or XLA
// type: what the call touches comes from `Rt` (fused_call.h: CudaRuntime has the list).
//
// A handler decodes its buffers and attributes, then
//   FusedCall c(kWhat, kOp, call);                // op name and code, XLA's stream, device,
//                                                 // attributes
//   if (auto e = c.check(); e.failure()) return e;  // (1) no CUDA: timeout, group table
//   ... its own shape checks: return c.invalid("...") ...
//   return c.run(spec, output, [&](FusedCall& c) -> std::string { the schedule });
// and run() does, in this order (the protocol order of docs/call-order.md):
//   (2) open: device guard, set the device, capture scope, device runtime, the device's launch
//       lock, the workspace, begin_call -- which answers run, given up (every rank closes the
//       call with a NaN output; success) or refused (the earlier failure, as the error);
//   (3) start: kernels preloaded, then the call's resources (copy engine, SM partition:
//       Spec::uses), the test-only failure, the device's error record;
//   (4) the schedule, which launches through c.fork(), its own launches and c.join(), and
//       returns "" or what failed (CK in fused_call.h; the op name is added here, D18);
//   (5) a failure after begin_call goes through fail_call (the call is given up on every rank,
//       this rank's output filled with NaN, the failure reported) and returns success.
// Whatever open acquired is released in reverse order when the object goes: lock, capture
// scope, device (after fail_call, as before).
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace jaxoverlap {

// The attributes every fused target takes (bind_common_attrs, fused_call.h) and XLA's run id.
template <typename Span>
struct BasicCallAttrs {
  int64_t site;
  Span ordinals, ranks, groups;  // the group table (find_group)
  int64_t n, comm_sms, chunks;
  double timeout_s;
  int64_t stall_rank, profile, call_tag;
  int64_t run_id;
};

// One handler call as XLA makes it: its stream, its device, the common attributes.
template <typename Stream, typename Span>
struct BasicCall {
  Stream stream;
  int32_t device;
  BasicCallAttrs<Span> attrs;
};

// The bound on every cross-GPU wait, in ns: finite, positive and at most a day (the Python side
// rejects anything else first; a hand-built call could still send NaN, which would convert to an
// undefined integer).
inline std::string to_timeout_ns(double timeout_s, uint64_t* ns) {
  if (!(timeout_s > 0.0 && timeout_s <= 86400.0))  // false for NaN
    return "timeout_s=" + std::to_string(timeout_s) + " must be a finite number of seconds in "
           "(0, 86400]";
  *ns = (uint64_t)(timeout_s * 1e9);
  return "";
}

// The lowering sends, for every device of the program in this process, its CUDA ordinal, its
// rank along the reduced axes and its group's ordinals in rank order (rows of `groups`, `n`
// columns; a member in another process as -1 - its global device id). Every rank validates the
// whole table, not only its own row: the table is the same attribute on every rank, so a
// malformed one is rejected by all of them before any launch (a rank that bailed out alone would
// leave its peers spinning until the timeout).
template <typename Span>
std::string find_group(int32_t device, const Span& ordinals, const Span& ranks,
                       const Span& groups, int64_t n, int max_ranks, int* rank,
                       std::vector<int>* group) {
  if (n < 2 || n > max_ranks)
    return "group size " + std::to_string(n) + " is outside 2.." + std::to_string(max_ranks);
  if (ranks.size() != ordinals.size() || groups.size() != ordinals.size() * (size_t)n)
    return "malformed group table";
  for (size_t i = 0; i < ordinals.size(); ++i)  // ranks first: the rows are indexed by them
    if (ranks[i] < 0 || ranks[i] >= n)
      return "group table gives device " + std::to_string(ordinals[i]) + " rank " +
             std::to_string(ranks[i]) + ", outside 0.." + std::to_string(n - 1);
  int found = -1;
  auto row = [&](size_t i, int64_t a) { return groups[i * n + a]; };
  for (size_t i = 0; i < ordinals.size(); ++i) {
    const int32_t r = ranks[i];
    if (row(i, r) != ordinals[i])
      return "group table does not list device " + std::to_string(ordinals[i]) + " at its rank";
    for (int64_t a = 0; a < n; ++a) {
      for (int64_t b = 0; b < a; ++b)
        if (row(i, a) == row(i, b)) return "group table lists a device twice in one group";
      if (row(i, a) < 0) continue;  // -1 - global id: a member in another process (runtime.h)
      // Every member must be in the table with this very group, at its position.
      size_t j = 0;
      while (j < ordinals.size() && ordinals[j] != row(i, a)) ++j;
      bool same = j < ordinals.size() && ranks[j] == a;
      for (int64_t c = 0; same && c < n; ++c) same = row(j, c) == row(i, c);
      if (!same)
        return "group table is inconsistent: device " + std::to_string(row(i, a)) +
               " does not list the same group at rank " + std::to_string(a);
    }
    if (ordinals[i] == device) {
      if (found >= 0) return "group table lists device " + std::to_string(device) + " twice";
      found = (int)i;
    }
  }
  if (found < 0) return "device ordinal " + std::to_string(device) + " is not in the group table";
  *rank = ranks[found];
  group->clear();
  for (int64_t a = 0; a < n; ++a) group->push_back(row(found, a));
  return "";
}

template <typename Rt>
class BasicFusedCall {
 public:
  using Error = typename Rt::Error;
  using Stream = typename Rt::Stream;
  using Call = BasicCall<Stream, typename Rt::Span>;
  using Output = typename Rt::Output;

  // What a call uses besides XLA's stream (Spec::uses): the SM partition or the copy engine's
  // stream, both for the all-reduce, neither for the tile schedule (its handler chooses and loads
  // its kernel in the schedule: runtime/tile_menu.h).
  enum Uses : unsigned { kSmPartition = 1, kCopyEngine = 2 };
  // The call's workspace (runtime.h: workspace) and resources.
  // `exact`: a workspace of this call's own site and size, not one shared by size class
  // (runtime/ws_class.h: the tile schedule's staging layout depends on the shape).
  struct Spec {
    int64_t block_bytes;
    bool partials, gather;
    unsigned uses;
    bool exact = false;
  };

  // `op`: the op's code (OpCode, kernels/common.cuh), which the device's error records carry.
  BasicFusedCall(const char* what, int op, const Call& call, Rt rt = Rt())
      : what_(what), op_(op), call_(call), rt_(std::move(rt)) {}
  BasicFusedCall(const BasicFusedCall&) = delete;
  BasicFusedCall& operator=(const BasicFusedCall&) = delete;

  // (1) No CUDA: the timeout and this device's rank and group, or an invalid-argument error.
  Error check() {
    const auto& a = call_.attrs;
    if (std::string e = to_timeout_ns(a.timeout_s, &timeout_ns_); !e.empty()) return invalid(e);
    if (std::string e = find_group(call_.device, a.ordinals, a.ranks, a.groups, a.n,
                                   Rt::kMaxRanks, &rank_, &group_);
        !e.empty())
      return invalid(e);
    return Rt::success();
  }
  Error invalid(const std::string& msg) const { return Rt::invalid(what_, msg); }

  // (2)-(5); `schedule(*this)` returns "" or what failed.
  template <typename Schedule>
  Error run(const Spec& spec, const Output& out, Schedule&& schedule) {
    if (rank_ < 0) return Rt::internal(what_, "FusedCall::run without a successful check()");
    spec_ = spec;
    out_ = out;
    if (std::optional<Error> answer = open(); answer) return std::move(*answer);
    std::string failed = start();
    if (failed.empty()) failed = schedule(*this);
    // A call that counted on every rank must end with the finish kernel (epoch + 1): join().
    if (failed.empty() && !joined_) failed = "the schedule ended without join()";
    if (failed.empty()) return Rt::success();
    if ((spec_.uses & kCopyEngine) && part_)  // close_call joins the comm stream: the copy's too
      rt_.join_copy(dev_, part_);
    rt_.fail_call(call_.stream, dev_, streams_, ws_, rank_, index_, out_,
                  std::string(what_) + ": " + failed);
    return Rt::success();
  }

  // (4) What the schedule uses.
  const char* what() const { return what_; }
  const BasicCallAttrs<typename Rt::Span>& attrs() const { return call_.attrs; }
  Stream stream() const { return call_.stream; }
  int32_t device() const { return call_.device; }
  int rank() const { return rank_; }
  int n() const { return (int)call_.attrs.n; }
  uint64_t timeout_ns() const { return timeout_ns_; }
  typename Rt::Device* dev() const { return dev_; }
  typename Rt::Workspace* ws() const { return ws_; }
  typename Rt::ErrorRecord* err() const { return err_; }
  // This rank's table of the group's buffers (runtime.h: Workspace::peers).
  const auto& peers() const { return ws_->peers[rank_]; }
  // The streams the call launches on besides XLA's: the SM partition's, or XLA's (GEMMs) and the
  // copy stream (pushes); null for the tile kernels.
  const typename Rt::Partition* streams() const { return streams_; }
  // Whether this workspace's first call on this device runs its warm-up now (fused_call.h).
  bool warm_up_now() const { return rt_.warm_up_now(ws_, rank_); }
  void warmed() { rt_.warmed(ws_, rank_); }
  // Every stream the call launches on waits for XLA's stream and for the workspace's previous
  // call on this device; `gemm`: the partition's GEMM stream too.
  std::string fork(bool gemm) {
    gemm_ = gemm;
    return rt_.fork(call_.stream, dev_, streams_, gemm, spec_.uses, ws_, rank_);
  }
  // XLA's stream waits for the streams forked, the finish kernel (NaN if a wait gave up; a
  // peer's give-up reported as a call of this op), the workspace's done event. `finished`: the
  // call's last kernel finished it itself (the tile kernel): no finish kernel.
  std::string join(bool finished = false) {
    joined_ = true;
    return rt_.join(call_.stream, dev_, streams_, gemm_, ws_, rank_, out_, op_, finished);
  }

 private:
  // (2) No answer: run the call. An answer: return it (given up: success; else the error).
  std::optional<Error> open() {
    guard_.emplace();
    if (std::string e = rt_.set_device(call_.device); !e.empty()) return Rt::internal(what_, e);
    capture_.emplace(call_.stream, what_);
    if (std::string e = rt_.device_runtime(call_.device, &dev_); !e.empty())
      return Rt::internal(what_, e);
    lock_ = std::unique_lock<typename Rt::Mutex>(rt_.launch_mutex(dev_));
    if (std::string e = rt_.workspace(call_.attrs.site, group_, rank_, spec_.block_bytes,
                                      spec_.partials, spec_.gather, spec_.exact, &ws_);
        !e.empty())
      return Rt::internal(what_, e);
    // From here on this call counts on every rank: a failure gives it up on all of them.
    std::string refused;
    bool misordered = false;  // issued out of order (call_order.h): given up on every rank
    index_ = rt_.begin_call(ws_, rank_, call_.attrs.run_id, call_.attrs.call_tag, &refused,
                            &misordered);
    if (refused.empty() && !misordered) return std::nullopt;
    rt_.preload(dev_);  // best effort: this may be the device's first call
    if (refused.empty()) {
      rt_.close_call(call_.stream, dev_, nullptr, ws_, rank_, &out_);
      return Rt::success();
    }
    rt_.close_call(call_.stream, dev_, nullptr, ws_, rank_, nullptr);
    return Rt::aborted(what_, "an earlier fused call failed: " + refused);
  }

  // (3) "" or what failed.
  std::string start() {
    if (std::string e = rt_.preload(dev_); !e.empty()) return e;  // release, finish
    if (spec_.uses & kCopyEngine) {
      if (std::string e = rt_.ce_setup(dev_); !e.empty()) return e;
      if (!(spec_.uses & kSmPartition)) {  // GEMMs on XLA's stream, pushes on the copy stream
        ce_streams_.gemm = call_.stream;
        ce_streams_.comm = rt_.copy_stream(dev_);
        streams_ = &ce_streams_;
      }
    }
    if (spec_.uses & kSmPartition) {
      if (std::string e = rt_.partition(dev_, (int)call_.attrs.comm_sms, &part_); !e.empty())
        return e;
      streams_ = part_;
    }
    const int64_t stall = call_.attrs.stall_rank;
    if (stall <= -2 && rank_ == -2 - stall)  // test-only: fused._failed_rank_for_tests
      return "test-only failure injected on this rank after begin_call";
    err_ = rt_.error_record(call_.device);
    if (!err_) return "could not allocate the host-mapped error record";
    rt_.mark("the start of the schedule");
    return "";
  }

  const char* what_;
  int op_;
  Call call_;
  Rt rt_;
  Spec spec_{};
  Output out_{};
  uint64_t timeout_ns_ = 0;
  int rank_ = -1;
  std::vector<int> group_;
  typename Rt::Device* dev_ = nullptr;
  typename Rt::Workspace* ws_ = nullptr;
  typename Rt::Partition* part_ = nullptr;
  typename Rt::Partition ce_streams_{};
  const typename Rt::Partition* streams_ = nullptr;
  typename Rt::ErrorRecord* err_ = nullptr;
  uint32_t index_ = 0;
  bool gemm_ = false, joined_ = false;
  // Released in reverse: the lock, then the capture scope, then the device.
  std::optional<typename Rt::DeviceGuard> guard_;
  std::optional<typename Rt::CaptureScope> capture_;
  std::unique_lock<typename Rt::Mutex> lock_;
};

}  // namespace jaxoverlap
