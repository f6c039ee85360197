// Host-only driver of the FusedCall skeleton (ffi/handlers/fused_call_skeleton.h), for
// tests/test_fused_call.py: the skeleton over a fake runtime that records every call it makes,
// no CUDA, no XLA. `fused_call_test SCENARIO` runs the scenario's handler calls and prints one
// event a line ("<device>: <event>"), then "result <device> <code> <message>" per call (code 0
// success, 1 invalid argument, 2 internal, 3 aborted). The Python side asserts the order.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "handlers/fused_call_skeleton.h"

namespace {

int g_device = -1;  // the device of the call being run, for the log
void log(const std::string& what) { std::printf("%d: %s\n", g_device, what.c_str()); }

// What the fake runtime answers, per scenario.
struct Script {
  bool set_device_fails = false;
  bool workspace_fails = false;
  bool misordered = false;
  std::string refused;
  bool partition_fails = false;
  bool skip_join = false;  // a schedule that returns "" without join()
  bool finished = false;   // join(/*finished=*/true): the kernel ended the call (the tile kernel)
};
Script g_script;
// The op code the fake handler gives its FusedCall: join() hands it to the runtime (the report of
// a peer's give-up names the op through it).
constexpr int kTestOp = 5;

struct FakeError {
  int code = 0;
  std::string msg;
  bool failure() const { return code != 0; }
};
struct FakePartition {
  int gemm = 0, comm = 0;  // streams: XLA's is 100 + device, the partition's 200+, copy 300+
};
struct FakeMutex {
  void lock() { log("lock"); }
  void unlock() { log("unlock"); }
};
struct FakeDevice {
  int ordinal;
  FakeMutex mu;
};
struct FakeWorkspace {
  bool warmed[8] = {};
};
struct FakeOutput {
  int id = 0;
};
struct FakeErrorRecord {};

std::string join_ints(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}
std::string streams_name(const FakePartition* p) {
  if (!p) return "none";
  return std::to_string(p->gemm) + "/" + std::to_string(p->comm);
}

FakeDevice g_devices[2] = {{0, {}}, {1, {}}};
FakeWorkspace g_ws;
FakeErrorRecord g_err;

struct FakeRuntime {
  using Error = FakeError;
  using Stream = int;
  using Span = std::vector<int32_t>;
  using Device = FakeDevice;
  using Workspace = FakeWorkspace;
  using Partition = FakePartition;
  using ErrorRecord = FakeErrorRecord;
  using Output = FakeOutput;
  using Mutex = FakeMutex;
  static constexpr int kMaxRanks = 8;

  struct DeviceGuard {
    DeviceGuard() { log("save context"); }
    ~DeviceGuard() { log("restore context"); }
  };
  struct CaptureScope {
    CaptureScope(int stream, const char* what) {
      log("capture scope stream=" + std::to_string(stream) + " " + what);
    }
    ~CaptureScope() { log("end capture scope"); }
  };

  static Error success() { return {}; }
  static Error error(int code, const char* what, const std::string& m) {
    return {code, std::string(what) + ": " + m};
  }
  static Error invalid(const char* what, const std::string& m) { return error(1, what, m); }
  static Error internal(const char* what, const std::string& m) { return error(2, what, m); }
  static Error aborted(const char* what, const std::string& m) { return error(3, what, m); }

  static std::string set_device(int d) {
    log("set_device " + std::to_string(d));
    return g_script.set_device_fails ? "cudaSetDevice failed" : "";
  }
  static std::string device_runtime(int d, Device** out) {
    log("device_runtime " + std::to_string(d));
    *out = &g_devices[d];
    return "";
  }
  static Mutex& launch_mutex(Device* dev) { return dev->mu; }
  static std::string workspace(int64_t site, const std::vector<int>& group, int rank,
                               int64_t block_bytes, bool partials, bool gather, bool exact,
                               Workspace** out) {
    log("workspace site=" + std::to_string(site) + " group=" + join_ints(group) + " rank=" +
        std::to_string(rank) + " bytes=" + std::to_string(block_bytes) + " partials=" +
        std::to_string(partials) + " gather=" + std::to_string(gather) +
        (exact ? " exact=1" : ""));
    *out = &g_ws;
    return g_script.workspace_fails ? "out of memory" : "";
  }
  static uint32_t begin_call(Workspace*, int rank, int64_t run, int64_t tag, std::string* refused,
                             bool* misordered) {
    log("begin_call rank=" + std::to_string(rank) + " run=" + std::to_string(run) + " tag=" +
        std::to_string(tag));
    *refused = g_script.refused;
    *misordered = g_script.misordered;
    return 7;
  }
  static void close_call(Stream s, Device*, const Partition* p, Workspace*, int rank,
                         const Output* poison) {
    log("close_call stream=" + std::to_string(s) + " streams=" + streams_name(p) + " rank=" +
        std::to_string(rank) + " poison=" + (poison ? std::to_string(poison->id) : "none"));
  }
  static void fail_call(Stream s, Device*, const Partition* p, Workspace*, int rank,
                        uint32_t index, const Output& out, const std::string& msg) {
    log("fail_call stream=" + std::to_string(s) + " streams=" + streams_name(p) + " rank=" +
        std::to_string(rank) + " index=" + std::to_string(index) + " poison=" +
        std::to_string(out.id) + " msg=" + msg);
  }
  static void join_copy(Device*, const Partition* p) { log("join_copy into " + streams_name(p)); }
  static std::string preload(Device*) {
    log("preload");
    return "";
  }
  static std::string ce_setup(Device*) {
    log("ce_setup");
    return "";
  }
  static Stream copy_stream(Device* d) { return 300 + d->ordinal; }
  static std::string partition(Device* d, int comm_sms, Partition** out) {
    log("partition comm_sms=" + std::to_string(comm_sms));
    static FakePartition parts[2];
    parts[d->ordinal] = {200 + 2 * d->ordinal, 201 + 2 * d->ordinal};
    *out = &parts[d->ordinal];
    return g_script.partition_fails ? "green contexts unavailable" : "";
  }
  static ErrorRecord* error_record(int d) {
    log("error_record " + std::to_string(d));
    return &g_err;
  }
  static void mark(const char* where) { log(std::string("mark ") + where); }
  static bool warm_up_now(const Workspace* ws, int rank) { return !ws->warmed[rank]; }
  static void warmed(Workspace* ws, int rank) { ws->warmed[rank] = true; }
  static std::string fork(Stream s, Device*, const Partition* p, bool gemm, unsigned uses,
                          Workspace*, int) {
    log("fork stream=" + std::to_string(s) + " streams=" + streams_name(p) + " gemm=" +
        std::to_string(gemm) + " uses=" + std::to_string(uses));
    return "";
  }
  static std::string join(Stream s, Device*, const Partition* p, bool gemm, Workspace*, int rank,
                          const Output& out, int op, bool finished) {
    log("join stream=" + std::to_string(s) + " streams=" + streams_name(p) + " gemm=" +
        std::to_string(gemm) + " rank=" + std::to_string(rank) + " out=" +
        std::to_string(out.id) + " op=" + std::to_string(op) +
        (finished ? " finished by the kernel" : ""));
    return "";
  }
};

using FusedCall = jaxoverlap::BasicFusedCall<FakeRuntime>;

struct Table {
  std::vector<int32_t> ordinals, ranks, groups;
};

// One handler call on `device`: check, the handler's own check, run with `uses`; the schedule
// forks, launches, and fails with `fail` if given.
void handler(int device, const Table& t, unsigned uses, const char* fail = nullptr,
             double timeout_s = 5.0, int64_t stall_rank = -1, bool exact = false) {
  g_device = device;
  FusedCall::Call call{100 + device, device,
                       {/*site=*/42, t.ordinals, t.ranks, t.groups, /*n=*/2, /*comm_sms=*/16,
                        /*chunks=*/4, timeout_s, stall_rank, /*profile=*/0, /*call_tag=*/9,
                        /*run_id=*/1234}};
  FakeError result;
  {
    FusedCall fc("jaxoverlap.test_op", /*op=*/kTestOp, call);
    result = fc.check();
    if (!result.failure()) {
      log("handler checks rank=" + std::to_string(fc.rank()));
      FakeOutput out{10 + device};
      result = fc.run({4096, true, false, uses, exact}, out, [&](FusedCall& c) -> std::string {
        log("schedule rank=" + std::to_string(c.rank()) + " n=" + std::to_string(c.n()) +
            " timeout_ns=" + std::to_string(c.timeout_ns()) + " streams=" +
            streams_name(c.streams()));
        if (std::string e = c.fork(uses & FusedCall::kSmPartition); !e.empty()) return e;
        if (c.warm_up_now()) {
          log("launch warm-up");
          c.warmed();
        }
        log("launch kernel");
        if (fail) return fail;
        if (g_script.skip_join) return "";
        return c.join(g_script.finished);
      });
    }
    log("handler returns");  // before the object goes: the releases follow
  }
  std::printf("result %d %d %s\n", device, result.code, result.msg.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const std::string s = argc > 1 ? argv[1] : "";
  const Table one_process{{0, 1}, {0, 1}, {0, 1, 0, 1}};  // 1 process x 2 devices
  const Table two_processes{{0}, {1}, {-8, 0}};  // rank 1 here; rank 0 is global device 7
  const unsigned sm = FusedCall::kSmPartition, ce = FusedCall::kCopyEngine;
  if (s == "one_process_two_devices") {
    handler(0, one_process, sm);
    handler(1, one_process, sm);
  } else if (s == "two_processes_one_device") {
    handler(0, two_processes, ce);
  } else if (s == "tile") {
    // The tile schedule: no partition, no copy engine, a workspace of its own shape (exact);
    // its kernel ends the call (no finish kernel in the join).
    g_script.finished = true;
    handler(0, one_process, 0, nullptr, 5.0, -1, /*exact=*/true);
  } else if (s == "given_up") {
    g_script.misordered = true;
    handler(0, one_process, sm);
  } else if (s == "refused") {
    g_script.refused = "op X timed out";
    handler(0, one_process, sm);
  } else if (s == "failure_after_begin_call") {
    handler(0, one_process, sm | ce, "cudaMemcpyAsync(dst, src): invalid argument");
  } else if (s == "failure_in_start") {
    g_script.partition_fails = true;
    handler(0, one_process, sm);
  } else if (s == "injected_failure") {
    handler(1, one_process, ce, nullptr, 5.0, /*stall_rank=*/-3);  // rank 1 fails after begin
  } else if (s == "no_join") {
    g_script.skip_join = true;
    handler(0, one_process, sm);
  } else if (s == "open_fails") {
    g_script.workspace_fails = true;
    handler(0, one_process, sm);
  } else if (s == "set_device_fails") {
    g_script.set_device_fails = true;
    handler(0, one_process, sm);
  } else if (s == "bad_timeout") {
    handler(0, one_process, sm, nullptr, -1.0);
  } else if (s == "bad_group") {
    handler(0, Table{{0, 1}, {0, 1}, {0, 1, 1, 0}}, sm);  // device 1 lists another group
  } else {
    std::fprintf(stderr, "unknown scenario %s\n", s.c_str());
    return 2;
  }
  return 0;
}
