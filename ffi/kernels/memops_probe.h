// Test-only (issue 26, R5): what releases a kernel that holds every SM of a device, and what a
// captured stream wait does on replay (kernels/memops_probe.cu; tests/gpu/test_stream_memops_gpu.py
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
  int copy_timeouts = -1;         // a 4-byte copy from a device word (the copy-engine signal)
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

}  // namespace jaxoverlap
