// Green-context SM partitions (runtime.h: partition): the GEMM's and the comm kernels' streams
// on disjoint SM sets of one device, through the driver API.
#include <cuda.h>

#include <string>

#include "runtime/runtime.h"

namespace jaxoverlap {
namespace {

// Driver API through the runtime's entry-point query: no link against libcuda.
struct Driver {
  decltype(&cuDeviceGet) DeviceGet = nullptr;
  decltype(&cuDeviceGetDevResource) DeviceGetDevResource = nullptr;
  decltype(&cuDevSmResourceSplitByCount) DevSmResourceSplitByCount = nullptr;
  decltype(&cuDevResourceGenerateDesc) DevResourceGenerateDesc = nullptr;
  decltype(&cuGreenCtxCreate) GreenCtxCreate = nullptr;
  decltype(&cuGreenCtxStreamCreate) GreenCtxStreamCreate = nullptr;
  std::string error;
};

template <typename F>
void load_symbol(const char* name, F* fn, std::string* error) {
  void* p = driver_entry(name);
  if (!p) {
    *error += std::string(error->empty() ? "" : "; ") + name + " not found in the CUDA driver";
    return;
  }
  *fn = reinterpret_cast<F>(p);
}

const Driver& driver() {
  static Driver d = [] {
    Driver r;
    load_symbol("cuDeviceGet", &r.DeviceGet, &r.error);
    load_symbol("cuDeviceGetDevResource", &r.DeviceGetDevResource, &r.error);
    load_symbol("cuDevSmResourceSplitByCount", &r.DevSmResourceSplitByCount, &r.error);
    load_symbol("cuDevResourceGenerateDesc", &r.DevResourceGenerateDesc, &r.error);
    load_symbol("cuGreenCtxCreate", &r.GreenCtxCreate, &r.error);
    load_symbol("cuGreenCtxStreamCreate", &r.GreenCtxStreamCreate, &r.error);
    return r;
  }();
  return d;
}

std::string cu_error(const char* what, CUresult r) {
  return std::string(what) + " failed with CUresult " + std::to_string((int)r);
}

}  // namespace

static std::string create_partition(DeviceRuntime* dev, int comm_sms, Partition** out) {
  const Driver& d = driver();
  if (!d.error.empty()) return "green contexts unavailable: " + d.error;
  CUdevice cu_dev;
  CUresult r;
  if ((r = d.DeviceGet(&cu_dev, dev->ordinal))) return cu_error("cuDeviceGet", r);
  CUdevResource all, group, rest;
  if ((r = d.DeviceGetDevResource(cu_dev, &all, CU_DEV_RESOURCE_TYPE_SM)))
    return cu_error("cuDeviceGetDevResource", r);
  const int total = (int)all.sm.smCount;
  if (comm_sms < 1 || comm_sms > total - 8)
    return "comm_sms=" + std::to_string(comm_sms) + " leaves no GEMM partition on a " +
           std::to_string(total) + "-SM device";
  // The structured group (a multiple of 8 SMs) is whichever side the request makes a multiple
  // of 8; the other side gets the remainder, whose size is free.
  const bool comm_is_group = comm_sms % 8 == 0;
  const unsigned want = comm_is_group ? comm_sms : ((total - comm_sms) / 8) * 8;
  unsigned groups = 1;
  if ((r = d.DevSmResourceSplitByCount(&group, &groups, &all, &rest, 0, want)))
    return cu_error("cuDevSmResourceSplitByCount", r);
  CUdevResource gemm_res = comm_is_group ? rest : group;
  CUdevResource comm_res = comm_is_group ? group : rest;
  Partition p;
  p.gemm_sms = (int)gemm_res.sm.smCount;
  p.comm_sms = (int)comm_res.sm.smCount;
  CUdevResource* parts[2] = {&gemm_res, &comm_res};
  cudaStream_t* streams[2] = {&p.gemm, &p.comm};
  for (int i = 0; i < 2; ++i) {
    CUdevResourceDesc desc;
    CUgreenCtx ctx;
    CUstream s;
    if ((r = d.DevResourceGenerateDesc(&desc, parts[i], 1)))
      return cu_error("cuDevResourceGenerateDesc", r);
    if ((r = d.GreenCtxCreate(&ctx, desc, cu_dev, CU_GREEN_CTX_DEFAULT_STREAM)))
      return cu_error("cuGreenCtxCreate", r);
    if ((r = d.GreenCtxStreamCreate(&s, ctx, CU_STREAM_NON_BLOCKING, 0)))
      return cu_error("cuGreenCtxStreamCreate", r);
    *streams[i] = (cudaStream_t)s;
  }
  auto [pos, _] = dev->partitions.emplace(comm_sms, p);
  *out = &pos->second;
  return "";
}

std::string partition(DeviceRuntime* dev, int comm_sms, Partition** out) {
  auto it = dev->partitions.find(comm_sms);
  if (it != dev->partitions.end()) {
    *out = &it->second;
    return "";
  }
  return outside_capture("creating an SM partition",
                         [&] { return create_partition(dev, comm_sms, out); });
}

}  // namespace jaxoverlap
