// Stream memory operations through the driver's entry points, and what a device supports of them
// (runtime/memops.h).
#include "runtime/memops.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <map>
#include <mutex>
#include <string>

namespace jaxoverlap {

void* driver_entry(const char* name, int version) {
  cudaDriverEntryPointQueryResult q;
  void* p = nullptr;
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

namespace {

// Each asked for by the version of the signature called (driver_entry): the _v2
// memory operations of CUDA 11.7, the device queries of CUDA 2.0.
struct MemopApi {
  PFN_cuStreamWriteValue32_v11070 write = nullptr;
  PFN_cuStreamWaitValue32_v11070 wait = nullptr;
  PFN_cuStreamBatchMemOp_v11070 batch = nullptr;
  PFN_cuDeviceGet_v2000 device = nullptr;
  PFN_cuDeviceGetAttribute_v2000 attribute = nullptr;
  PFN_cuGraphNodeGetType_v10000 node_type = nullptr;
};
const MemopApi& api() {
  static const MemopApi a = [] {
    MemopApi m;
    m.write = reinterpret_cast<decltype(m.write)>(driver_entry("cuStreamWriteValue32", 11070));
    m.wait = reinterpret_cast<decltype(m.wait)>(driver_entry("cuStreamWaitValue32", 11070));
    m.batch = reinterpret_cast<decltype(m.batch)>(driver_entry("cuStreamBatchMemOp", 11070));
    m.device = reinterpret_cast<decltype(m.device)>(driver_entry("cuDeviceGet", 2000));
    m.attribute =
        reinterpret_cast<decltype(m.attribute)>(driver_entry("cuDeviceGetAttribute", 2000));
    m.node_type =
        reinterpret_cast<decltype(m.node_type)>(driver_entry("cuGraphNodeGetType", 10000));
    return m;
  }();
  return a;
}

// CUresult -> the runtime's error space (the values of the shared codes agree; anything else is
// reported as unknown), so callers handle one kind of error.
cudaError_t to_runtime(CUresult r) {
  if (r == CUDA_SUCCESS) return cudaSuccess;
  if (r == CUDA_ERROR_INVALID_VALUE) return cudaErrorInvalidValue;
  if (r == CUDA_ERROR_NOT_SUPPORTED) return cudaErrorNotSupported;
  if (r == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) return cudaErrorStreamCaptureUnsupported;
  if (r == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED) return cudaErrorStreamCaptureInvalidated;
  return cudaErrorUnknown;
}

}  // namespace

const MemopCaps& memop_caps(int ordinal) {
  static std::mutex mu;
  static std::map<int, MemopCaps> caps;
  std::lock_guard<std::mutex> lock(mu);
  auto it = caps.find(ordinal);
  if (it != caps.end()) return it->second;
  MemopCaps c;
  c.ordinal = ordinal;
  const MemopApi& a = api();
  c.entry_points = a.write && a.wait && a.batch;
  CUdevice dev;
  if (a.device && a.attribute && a.device(&dev, ordinal) == CUDA_SUCCESS) {
    auto ask = [&](CUdevice_attribute what) {
      int v = -1;
      return a.attribute(&v, what, dev) == CUDA_SUCCESS ? v : -1;
    };
    c.mem_ops_64 = ask(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS);
    c.flush_remote_writes = ask(CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES);
    c.wait_value_nor = ask(CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR);
  }
  return caps.emplace(ordinal, c).first->second;
}

int graph_node_type(cudaGraphNode_t node) {
  CUgraphNodeType t;
  if (!api().node_type || api().node_type(reinterpret_cast<CUgraphNode>(node), &t) != CUDA_SUCCESS)
    return -1;
  return (int)t;
}

cudaError_t stream_write_u32(cudaStream_t stream, uint32_t* addr, uint32_t value) {
  if (!api().write) return cudaErrorNotSupported;
  return to_runtime(api().write(reinterpret_cast<CUstream>(stream),
                                reinterpret_cast<CUdeviceptr>(addr), value,
                                CU_STREAM_WRITE_VALUE_DEFAULT));
}

cudaError_t stream_wait_u32(cudaStream_t stream, uint32_t* addr, uint32_t value, bool geq) {
  if (!api().wait) return cudaErrorNotSupported;
  return to_runtime(api().wait(reinterpret_cast<CUstream>(stream),
                               reinterpret_cast<CUdeviceptr>(addr), value,
                               geq ? CU_STREAM_WAIT_VALUE_GEQ : CU_STREAM_WAIT_VALUE_EQ));
}

cudaError_t stream_wait_eq_then_reset_u32(cudaStream_t stream, uint32_t* addr, uint32_t value,
                                          uint32_t reset) {
  if (!api().batch) return cudaErrorNotSupported;
  CUstreamBatchMemOpParams ops[2] = {};
  ops[0].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
  ops[0].waitValue.address = reinterpret_cast<CUdeviceptr>(addr);
  ops[0].waitValue.value = value;
  ops[0].waitValue.flags = CU_STREAM_WAIT_VALUE_EQ;
  ops[1].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
  ops[1].writeValue.address = reinterpret_cast<CUdeviceptr>(addr);
  ops[1].writeValue.value = reset;
  ops[1].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return to_runtime(api().batch(reinterpret_cast<CUstream>(stream), 2, ops, 0));
}

}  // namespace jaxoverlap
