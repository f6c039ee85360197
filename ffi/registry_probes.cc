// Test-only bindings of the device probes (registry_probes.h): each runs with the GIL released
// under a DeviceGuard and returns its fields as a dict.
#include "registry_probes.h"

#include <cstdint>

#include <nanobind/stl/string.h>

#include "kernels/memops_probe.h"
#include "runtime/runtime.h"

namespace nb = nanobind;

namespace jaxoverlap {

void add_device_probes(nb::module_& m) {
  m.def(
      "_stream_memops_probe",
      [](int ordinal, int replays, double bound_s) {
        const MemopsProbe r = [&] {
          nb::gil_scoped_release unlocked;
          DeviceGuard guard;
          return stream_memops_probe(ordinal, replays, bound_s);
        }();
        nb::dict d;
        d["error"] = r.error, d["sms"] = r.sms, d["blocks"] = r.blocks;
        d["resident_per_sm"] = r.resident_per_sm, d["bound_s"] = r.bound_s;
        d["write_value_timeouts"] = r.write_value_timeouts, d["write_value_ms"] = r.write_value_ms;
        d["copy_timeouts"] = r.copy_timeouts, d["copy_ms"] = r.copy_ms;
        d["kernel_timeouts"] = r.kernel_timeouts, d["kernel_ms"] = r.kernel_ms;
        d["kernel_flag_after"] = r.kernel_flag_after, d["replays"] = r.replays;
        d["replay_timeouts"] = r.replay_timeouts, d["replay_flag_after"] = r.replay_flag_after;
        d["graph_memop_nodes"] = r.graph_memop_nodes;
        d["graph_memcpy_nodes"] = r.graph_memcpy_nodes, d["replay_ms"] = r.replay_ms;
        d["trap_first_waited"] = r.trap_first_waited;
        d["trap_second_waited"] = r.trap_second_waited;
        return d;
      },
      nb::arg("ordinal"), nb::arg("replays") = 200, nb::arg("bound_s") = 0.25,
      "Test-only (issue 26, R5): a kernel holding every SM released by cuStreamWriteValue32, by "
      "a 4-byte copy, by a one-thread kernel; a captured wait+copy replayed; the captured-GEQ "
      "trap (kernels/memops_probe.h says what each field is).");
  m.def(
      "_ce_signal_probe",
      [](int ordinal, int replays, double bound_s, uint32_t epoch) {
        const CeSignalProbe r = [&] {
          nb::gil_scoped_release unlocked;
          DeviceGuard guard;
          return ce_signal_probe(ordinal, replays, bound_s, epoch);
        }();
        nb::dict d;
        d["error"] = r.error, d["blocks"] = r.blocks, d["epoch"] = r.epoch;
        d["early_timed_out"] = r.early_timed_out, d["early_seen"] = r.early_seen;
        d["early_wanted"] = r.early_wanted, d["announced_call"] = r.announced_call;
        d["announced_landed"] = r.announced_landed, d["signal_timeouts"] = r.signal_timeouts;
        d["signal_ms"] = r.signal_ms, d["landed_after"] = r.landed_after;
        d["wait_passed"] = r.wait_passed, d["later_chunk_timed_out"] = r.later_chunk_timed_out;
        d["graph_memop_nodes"] = r.graph_memop_nodes;
        d["graph_kernel_nodes"] = r.graph_kernel_nodes;
        d["graph_memcpy_nodes"] = r.graph_memcpy_nodes, d["replays"] = r.replays;
        d["replay_timeouts"] = r.replay_timeouts, d["replays_done"] = r.replays_done;
        d["fallbacks"] = r.fallbacks;
        return d;
      },
      nb::arg("ordinal"), nb::arg("replays") = 100, nb::arg("bound_s") = 0.25,
      nb::arg("epoch") = 25,
      "Test-only (issue 26, R5): the copy-engine schedules' signal (launch_ce_signal_arrival) "
      "releasing a kernel that holds every SM, uncaptured and replayed from a graph, and the "
      "receiver's waits around it (kernels/memops_probe.h says what each field is).");
  m.def(
      "_reduce_push_probe",
      [](int ordinal, int free_sms, int ctas, int64_t block_bytes, int calls, double timeout_s) {
        const ReducePushProbe r = [&] {
          nb::gil_scoped_release unlocked;
          DeviceGuard guard;
          return reduce_push_probe(ordinal, free_sms, ctas, block_bytes, calls,
                                               timeout_s);
        }();
        nb::dict d;
        d["error"] = r.error, d["sms"] = r.sms, d["free_sms"] = r.free_sms, d["ctas"] = r.ctas;
        d["occupier_blocks"] = r.occupier_blocks, d["block_bytes"] = r.block_bytes;
        d["calls"] = r.calls, d["timeouts"] = r.timeouts, d["wrong"] = r.wrong;
        d["ms_mean"] = r.ms_mean, d["ms_max"] = r.ms_max, d["epochs"] = r.epochs;
        return d;
      },
      nb::arg("ordinal"), nb::arg("free_sms"), nb::arg("ctas") = 16,
      nb::arg("block_bytes") = 8 << 20, nb::arg("calls") = 5, nb::arg("timeout_s") = 1.0,
      "Test-only (issue 26, R6): the reduce-push kernel of two ranks on one device beside an "
      "occupier holding all SMs but free_sms (kernels/memops_probe.h says what each field is).");
}

}  // namespace jaxoverlap
