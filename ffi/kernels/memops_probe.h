// Test-only (issue 26, R5 and R6): what releases a kernel that holds every SM of a device, what a
// captured stream wait does on replay, the copy-engine signal under such a kernel, and the
// reduce-push beside one (kernels/memops_probe.cu; tests/gpu/test_stream_memops_gpu.py
// through jaxoverlap._native._stream_memops_probe). Host declarations only.
#pragma once

#include <cstdint>
#include <string>

namespace jaxoverlap {

struct MemopsProbe {
  std::string error;     // "" or the CUDA call that failed
  int sms = 0;           // the device's SMs
  int blocks = 0;        // the occupier's blocks (every SM full: 2048 threads each)
  int resident_per_sm = 0;  // occupancy of the occupier (2: no thread slot left on any SM)
  double bound_s = 0;    // how long each occupier block spins before it gives up
  // Release of the occupier from another stream once every block is resident, by:
  int write_value_timeouts = -1;  // cuStreamWriteValue32 (no SM): blocks that timed out
  double write_value_ms = 0;      // the occupier's duration
  int copy_timeouts = -1;         // a 4-byte copy from a device word (run 57's signal)
  double copy_ms = 0;
  int kernel_timeouts = -1;       // a one-thread kernel (today's signal): expected all blocks
  double kernel_ms = 0;
  uint32_t kernel_flag_after = 0;  // the one-thread kernel ran once the occupier left
  // A graph captured once -- wait (EQ, constant) + reset in one batch, then a stream write of
  // the flag -- replayed against a fresh occupier each time (its stream resets the flag after it).
  int replays = 0;
  int replay_timeouts = -1;  // occupier blocks that timed out over all replays
  uint32_t replay_flag_after = 0;  // replays completed in stream order (= replays)
  int graph_memop_nodes = -1;      // batch memory-operation nodes in the captured graph
  int graph_memcpy_nodes = -1;     // memcpy nodes in it (none)
  double replay_ms = 0;            // per replay (occupier + graph), mean
  // The trap: a wait GEQ on the value the host knew at capture (1), replayed for call 2.
  bool trap_first_waited = false;   // replay 1 waited until the flag reached 1
  bool trap_second_waited = true;   // replay 2 waited for call 2 (it does not: the trap)
};

// Runs the whole probe on `ordinal` (a few seconds: three bound_s timeouts at most).
MemopsProbe stream_memops_probe(int ordinal, int replays, double bound_s);

// The copy-engine schedules' own signal (kernels/ce.h, launch_ce_signal_arrival) and waits, on
// one device: two ranks' flag blocks in its memory, both at epoch `epoch` (as if `epoch` calls of
// any op, captured or not, had run on the workspace: the host's call number plays no part), the
// receiver holding the previous call's announcement and landed count.
struct CeSignalProbe {
  std::string error;
  int blocks = 0;            // the occupier's blocks (every thread slot of every SM)
  uint32_t epoch = 0;
  // Before the sender's slot-free wait: the receiver's wait of chunk 0 must time out (the count
  // of the previous call is not this call's) and report the call word it saw and wanted.
  bool early_timed_out = false;
  uint32_t early_seen = 0, early_wanted = 0;
  // After the sender's slot-free wait (launch_ce_wait_slot_free): the receiver's words.
  uint32_t announced_call = 0, announced_landed = 0;
  // The signal of chunk 0 from a highest-priority stream once the occupier holds every SM,
  // the occupier spinning (bounded) until the receiver's landed count reaches 1.
  int signal_timeouts = -1;
  double signal_ms = 0;
  uint32_t landed_after = 0;
  bool wait_passed = false;  // then the receiver's wait of chunk 0 passes (no report, no give-up)
  bool later_chunk_timed_out = false;  // and its wait of chunk 1 (never pushed) times out
  // The same signal captured once into a graph, replayed against a fresh occupier each time.
  int graph_memop_nodes = -1, graph_kernel_nodes = -1, graph_memcpy_nodes = -1;
  int replays = 0;
  int replay_timeouts = -1;
  uint32_t replays_done = 0;
  int64_t fallbacks = -1;  // signals the driver refused as stream writes (ce_signal_fallbacks)
};
CeSignalProbe ce_signal_probe(int ordinal, int replays, double bound_s, uint32_t epoch);

// Issue 26, R6: the standalone reduce-scatter's reduce-push kernel (kernels/comm.cu; n = 2, CTAs
// paired by ticket) of two ranks on one device, while an occupier holds all SMs but `free_sms`
// (one occupier block per SM: it takes an SM's whole shared memory, so no reduce-push CTA fits
// beside it). `calls` calls, each: the occupier starts, then (a stream wait on its blocks) both
// ranks' reduce-push kernels and their finish kernels; the occupier is released after both.
// On one device the two ranks compete for the same free SMs, which two GPUs never do: with
// fewer free SMs than one rank's CTAs, rank 0's resident CTAs wait for rank 1's, which cannot
// start -- bounded by the timeout.
struct ReducePushProbe {
  std::string error;
  int sms = 0, free_sms = 0, ctas = 0, occupier_blocks = 0;
  int64_t block_bytes = 0;
  int calls = 0;
  int timeouts = 0;        // calls in which a wait of either rank reported a timeout
  int wrong = 0;           // calls whose output (either rank) differs from own + peer's block
  double ms_mean = 0, ms_max = 0;  // per call, both ranks' kernels, from an event before them
  uint32_t epochs = 0;     // rank 0's epoch after the calls (= calls)
};
ReducePushProbe reduce_push_probe(int ordinal, int free_sms, int ctas, int64_t block_bytes,
                                  int calls, double timeout_s);

}  // namespace jaxoverlap
