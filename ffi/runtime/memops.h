// CUDA stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32 / cuStreamBatchMemOp:
// a write or a wait that the GPU's front end executes in stream order, without an SM) and what a
// device supports of them (issue 26, R5; docs/ordering-and-stream-memops.md section 3), and the
// driver's entry points they and the rest of the runtime are reached by (driver_entry), each asked
// for by the version of the signature it is called with. Host code only, no other jaxoverlap
// object needed (the probes link it alone: tools/probes/build_tile_live.sh).
//
// What the fused calls use them for, and what not (the decision, with the measurements, in the
// doc): the copy-engine schedules' arrival signals are stream writes of a constant, the count of
// chunks landed (stream_write_u32; kernels/ce.h, launch_ce_signal_arrival), never a host-side
// epoch; their waits stay bounded kernels (a stream wait cannot time out). The rest serves the
// diagnostics (the capabilities) and the test-only probes (kernels/memops_probe.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace jaxoverlap {

// A driver API function through the runtime's entry-point query (no link against libcuda), or
// null if the driver has none of that name. `version`: the CUDA version whose signature of the
// name the caller uses (cudaTypedefs.h's PFN_<name>_v<version>): a newer one may differ.
void* driver_entry(const char* name, int version = 13000);

// What a device supports of the stream memory operations (cuDeviceGetAttribute; -1: could not
// be asked). Since CUDA 12.0 the 32-bit operations are always available (their attribute was
// removed); `entry_points`: the driver gave the three entry points below.
struct MemopCaps {
  int ordinal = -1;
  int mem_ops_64 = -1;          // CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
  int flush_remote_writes = -1;  // CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES
  int wait_value_nor = -1;      // CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR(_V2)
  bool entry_points = false;
};
// Queried once per device and kept (the copy-engine handlers' set-up asks, so that the
// diagnostics show what the device the calls ran on supports).
const MemopCaps& memop_caps(int ordinal);

// cuStreamWriteValue32(stream, addr, value, CU_STREAM_WRITE_VALUE_DEFAULT): a memory fence
// before the write ("similar to __threadfence_system() but scoped to the stream").
cudaError_t stream_write_u32(cudaStream_t stream, uint32_t* addr, uint32_t value);
// Stream waits until *addr satisfies `value`: geq (cyclic (int32_t)(*addr - value) >= 0) or eq.
// Never times out by itself: only for flags something is sure to write (see the doc).
// The captured-GEQ trap: recorded into a CUDA graph, `value` is frozen at capture. A GEQ on a
// host-side call index (say 1, the call being recorded) passes at once on every later replay --
// the flag already holds 1 -- a silent race, not a hang (tests/gpu/test_stream_memops_gpu.py). So
// nothing captured of ours compares a flag with a host value: captured waits compute their target
// from the device's epoch (kernels), or wait EQ on a constant that is reset in the same batch
// (NCCL's scheme, stream_wait_eq_then_reset_u32).
cudaError_t stream_wait_u32(cudaStream_t stream, uint32_t* addr, uint32_t value, bool geq);
// One cuStreamBatchMemOp of two operations: wait until *addr == value, then write *addr = reset
// (NCCL's captured scheme: the wait's value is a constant, the reset re-arms it for the next
// replay).
cudaError_t stream_wait_eq_then_reset_u32(cudaStream_t stream, uint32_t* addr, uint32_t value,
                                          uint32_t reset);

// The driver's type of a graph node (CUgraphNodeType; -1 on error): the runtime's
// cudaGraphNodeGetType fails on a batch memory-operation node (CU_GRAPH_NODE_TYPE_BATCH_MEM_OP).
int graph_node_type(cudaGraphNode_t node);

}  // namespace jaxoverlap
