// The Python extension jaxoverlap._native: one registry of FFI targets (name -> stage capsules)
// and a few runtime helpers. Loading it touches no CUDA API; the handlers create the per-device
// runtime on first use.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/ce.h"
#include "kernels/tile_rs.h"
#include "runtime/memops.h"
#include "registry_probes.h"
#include "runtime/runtime.h"
#include "xla/ffi/api/ffi.h"

// Each fused handler has four symbols (handlers/fused_call.h, JAXOVERLAP_FUSED_TARGET): Knobs (no
// order token; the test knobs as attributes: _v1 and _v3_knobs), V3 (no token; production
// attributes only), V2 (the order token; production attributes only) and V2Knobs (the token and
// the knobs).
#define JAXOVERLAP_DECLARE(name)                \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(name##Knobs); \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(name##V3);    \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(name##V2);    \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(name##V2Knobs)
JAXOVERLAP_DECLARE(JaxoverlapGemmRs);
JAXOVERLAP_DECLARE(JaxoverlapGemmAr);
JAXOVERLAP_DECLARE(JaxoverlapRs);
JAXOVERLAP_DECLARE(JaxoverlapAgGemm);
JAXOVERLAP_DECLARE(JaxoverlapAgGemmKeep);
JAXOVERLAP_DECLARE(JaxoverlapAgGemmK);
JAXOVERLAP_DECLARE(JaxoverlapDgradRsWgrad);
JAXOVERLAP_DECLARE(JaxoverlapGemmRsCe);
JAXOVERLAP_DECLARE(JaxoverlapGemmRsTile);
JAXOVERLAP_DECLARE(JaxoverlapDgradRsWgradAcc);

namespace nb = nanobind;

namespace {

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
}
float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Test-only: D[m, n] = A[m, k] . B[k, n] (bf16; m, n, k = 128, 384, 256: all distinct, so a
// swapped dimension or leading dimension fails) through the handlers' GEMM runner with every
// operand pointer `offset` bytes past a 256-byte boundary (XLA guarantees only 16 for entry parameters), A and B
// row-major or (`a_col`, `b_col`) column-major. Returns the max error relative to max
// |reference| (a host f64 reference); raises on a runner error.
double gemm_alignment_check(int ordinal, int offset, bool b_col, bool a_col) {
  using namespace jaxoverlap;
  constexpr int64_t m = 128, n = 384, k = 256;
  DeviceGuard guard;
  DeviceRuntime* dev = nullptr;
  if (cudaSetDevice(ordinal)) throw std::runtime_error("cudaSetDevice failed");
  if (std::string e = device_runtime(ordinal, &dev); !e.empty()) throw std::runtime_error(e);
  std::vector<uint16_t> a(m * k), b(k * n), d(m * n);
  for (int64_t i = 0; i < m * k; ++i) a[i] = to_bf16((float)((i * 37 % 101) - 50) / 50.0f);
  for (int64_t i = 0; i < k * n; ++i) b[i] = to_bf16((float)((i * 53 % 97) - 48) / 48.0f);
  const size_t bytes = k * n * 2 + 512;  // the largest operand
  char *pa = nullptr, *pb = nullptr, *pd = nullptr;
  // One stream per device for the life of the process: the runner keeps a cuBLASLt workspace
  // per stream.
  static std::mutex mu;
  static std::map<int, cudaStream_t> streams;
  cudaStream_t s = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!streams.count(ordinal) && !cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking))
      streams[ordinal] = s;
    s = streams.count(ordinal) ? streams[ordinal] : nullptr;
  }
  std::string err;
  if (!s || cudaMalloc(&pa, bytes) || cudaMalloc(&pb, bytes) || cudaMalloc(&pd, bytes))
    err = "allocation failed";
  if (err.empty()) {
    cudaMemcpy(pa + offset, a.data(), m * k * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(pb + offset, b.data(), k * n * 2, cudaMemcpyHostToDevice);
    std::lock_guard<std::mutex> hold(dev->launch_mu);
    err = dev->gemm.run(GemmShape{m, n, k, DType::kBF16, false, 0, b_col, a_col}, pa + offset,
                        pb + offset, nullptr, pd + offset, s);
  }
  if (err.empty()) {
    if (cudaError_t e = cudaStreamSynchronize(s)) err = cudaGetErrorString(e);
    else cudaMemcpy(d.data(), pd + offset, m * n * 2, cudaMemcpyDeviceToHost);
  }
  for (void* p : {(void*)pa, (void*)pb, (void*)pd})
    if (p) cudaFree(p);
  if (!err.empty()) throw std::runtime_error(err);
  double max_err = 0, scale = 1e-30;
  // Column-major A[m, k]: element (i, l) at a[l * m + i]; column-major B[k, n]: (l, j) at
  // b[j * k + l].
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0;
      for (int64_t l = 0; l < k; ++l)
        ref += (double)from_bf16(a[a_col ? l * m + i : i * k + l]) *
               from_bf16(b[b_col ? j * k + l : l * n + j]);
      max_err = std::max(max_err, std::abs(ref - from_bf16(d[i * n + j])));
      scale = std::max(scale, std::abs(ref));
    }
  return max_err / scale;
}

// The GEMM plans of a device and what the algorithm search chose for each (gemm.h, Choice).
nb::list gemm_plans(int ordinal) {
  using namespace jaxoverlap;
  DeviceRuntime* dev = nullptr;
  nb::list out;
  {
    DeviceGuard guard;
    if (cudaSetDevice(ordinal) || !device_runtime(ordinal, &dev).empty()) return out;
  }
  std::vector<GemmRunner::Choice> choices;
  {
    std::lock_guard<std::mutex> hold(dev->launch_mu);
    choices = dev->gemm.choices();
  }
  for (const auto& c : choices) {
    nb::dict d;
    d["m"] = c.m, d["n"] = c.n, d["k"] = c.k, d["sm_count"] = c.sm_count;
    d["accumulate"] = c.accumulate, d["candidates"] = c.candidates, d["chosen"] = c.chosen;
    d["ms_first"] = c.ms_first, d["ms_best"] = c.ms_best, d["note"] = c.note;
    d["cached"] = c.cached;
    out.append(d);
  }
  return out;
}

// Tools: ms per launch of cuBLASLt's top candidates for a bf16 GEMM m x k x n (row-major, + C
// when `accumulate`), on the GEMM stream of the green-context partition leaving `comm_sms` SMs
// to communication (its SM count targeted), or on the whole device when comm_sms is 0.
nb::tuple gemm_candidates(int ordinal, int64_t m, int64_t n, int64_t k, bool accumulate,
                          int comm_sms) {
  using namespace jaxoverlap;
  DeviceGuard guard;
  DeviceRuntime* dev = nullptr;
  if (cudaSetDevice(ordinal)) throw std::runtime_error("cudaSetDevice failed");
  if (std::string e = device_runtime(ordinal, &dev); !e.empty()) throw std::runtime_error(e);
  static std::mutex mu;
  static std::map<int, cudaStream_t> whole;  // per device, for the life of the process
  cudaStream_t stream = nullptr;
  int sms = 0;
  if (comm_sms > 0) {
    Partition* part = nullptr;
    if (std::string e = partition(dev, comm_sms, &part); !e.empty()) throw std::runtime_error(e);
    stream = part->gemm;
    sms = part->gemm_sms;
  } else {
    std::lock_guard<std::mutex> lock(mu);
    if (!whole.count(ordinal) && cudaStreamCreateWithFlags(&whole[ordinal], cudaStreamNonBlocking))
      throw std::runtime_error("cudaStreamCreate failed");
    stream = whole[ordinal];
  }
  std::vector<float> ms;
  std::string e;
  {
    std::lock_guard<std::mutex> hold(dev->launch_mu);
    e = dev->gemm.candidates_ms(GemmShape{m, n, k, DType::kBF16, accumulate, sms, false}, stream,
                                &ms);
  }
  if (!e.empty()) throw std::runtime_error(e);
  return nb::make_tuple(sms, ms);
}

// Test-only: out = own + the sum of `count` blocks (bf16, `elems` each, blocks `stride` elements
// apart) through the copy-engine handlers' sum kernel (kernels/ce.cu), in place when `in_place`
// (out aliases own, as the copy-engine reduce-scatter uses it). Returns the max error relative
// to max |reference| (a host f64 sum of the bf16 inputs); raises on a CUDA error.
double sum_blocks_check(int ordinal, int count, int64_t elems, int64_t stride, bool in_place) {
  using namespace jaxoverlap;
  DeviceGuard guard;
  if (cudaSetDevice(ordinal)) throw std::runtime_error("cudaSetDevice failed");
  std::vector<uint16_t> own(elems), blocks(count * stride), out(elems);
  for (int64_t i = 0; i < elems; ++i) own[i] = to_bf16((float)((i * 29 % 89) - 44) / 44.0f);
  for (int64_t i = 0; i < count * stride; ++i)
    blocks[i] = to_bf16((float)((i * 41 % 83) - 41) / 41.0f);
  uint16_t *pown = nullptr, *pblocks = nullptr, *pout = nullptr;
  std::string err;
  if (cudaMalloc(&pown, elems * 2) || cudaMalloc(&pblocks, count * stride * 2 + 2) ||
      cudaMalloc(&pout, elems * 2))
    err = "allocation failed";
  if (err.empty()) {
    cudaMemcpy(pown, own.data(), elems * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(pblocks, blocks.data(), count * stride * 2, cudaMemcpyHostToDevice);
    uint16_t* dst = in_place ? pown : pout;
    if (cudaError_t e = launch_sum_blocks(dst, pown, pblocks, count, stride, elems, DType::kBF16,
                                          132, nullptr))
      err = cudaGetErrorString(e);
    else if (cudaError_t e2 = cudaDeviceSynchronize())
      err = cudaGetErrorString(e2);
    else
      cudaMemcpy(out.data(), dst, elems * 2, cudaMemcpyDeviceToHost);
  }
  for (void* p : {(void*)pown, (void*)pblocks, (void*)pout})
    if (p) cudaFree(p);
  if (!err.empty()) throw std::runtime_error(err);
  double max_err = 0, scale = 1e-30;
  for (int64_t i = 0; i < elems; ++i) {
    double ref = from_bf16(own[i]);
    for (int b = 0; b < count; ++b) ref += from_bf16(blocks[b * stride + i]);
    max_err = std::max(max_err, std::abs(ref - from_bf16(out[i])));
    scale = std::max(scale, std::abs(ref));
  }
  return max_err / scale;
}

// Test-only (issue 26, R1): on a fresh thread, which has no CUDA context current, a DeviceGuard
// round trip onto `ordinal`, then the export of a workspace (key `site`, 4 KiB blocks) whose
// member in this process is `ordinal`, as the lowering thread runs it. Returns the device of the
// thread's current context before, after the round trip and after the export (-1: none), the
// export's error ('' if none) and the device the workspace's first allocation (its abort words,
// in device memory since issue 26's R7) belongs to.
nb::dict context_check(int ordinal, int64_t site) {
  using namespace jaxoverlap;
  int before = -2, after_guard = -2, after_export = -2, alloc_device = -2;
  std::string error;
  std::thread([&] {
    before = context_device();
    {
      DeviceGuard guard;
      if (cudaError_t e = cudaSetDevice(ordinal)) error = cudaGetErrorString(e);
    }
    after_guard = context_device();
    const WsKey key{site, {ordinal, -1 - 1000}, 4096, false, false};
    std::string handles;
    if (error.empty()) error = export_rank(key, 0, &handles);
    after_export = context_device();
    with_workspace_slot(key, [&](std::unique_ptr<Workspace>& slot) -> std::string {
      DeviceGuard guard;
      cudaPointerAttributes attr{};
      if (slot && slot->abort && cudaSetDevice(ordinal) == cudaSuccess &&
          cudaPointerGetAttributes(&attr, slot->abort) == cudaSuccess)
        alloc_device = attr.device;
      cudaGetLastError();
      return "";
    });
  }).join();
  nb::dict d;
  d["before"] = before, d["after_guard"] = after_guard, d["after_export"] = after_export;
  d["error"] = error, d["alloc_device"] = alloc_device;
  return d;
}

template <typename T>
nb::capsule capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "an FFI handler must take an XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict registrations() {
  nb::dict d;
  auto stages = [](auto* fn) {
    nb::dict s;
    s["execute"] = capsule(fn);
    return s;
  };
  // jaxoverlap/fused/targets.py derives every name from the op's; the lowering emits _v3 (order
  // off, or its barrier form) or _v2 (the order's token form), a `_knobs` twin under a test knob.
  // The _v1 targets stay registered, unchanged, for programs compiled against them
  // (docs/ordering-and-stream-memops.md, section 1); _v1 and _v3_knobs are one ABI, one symbol.
#define JAXOVERLAP_REGISTER(name, text)                    \
  d["jaxoverlap_" text "_v1"] = stages(name##Knobs);       \
  d["jaxoverlap_" text "_v3"] = stages(name##V3);          \
  d["jaxoverlap_" text "_v3_knobs"] = stages(name##Knobs); \
  d["jaxoverlap_" text "_v2"] = stages(name##V2);          \
  d["jaxoverlap_" text "_v2_knobs"] = stages(name##V2Knobs)
  JAXOVERLAP_REGISTER(JaxoverlapGemmRs, "gemm_rs");
  JAXOVERLAP_REGISTER(JaxoverlapGemmAr, "gemm_ar");
  JAXOVERLAP_REGISTER(JaxoverlapRs, "rs");
  JAXOVERLAP_REGISTER(JaxoverlapAgGemm, "ag_gemm");
  JAXOVERLAP_REGISTER(JaxoverlapAgGemmKeep, "ag_gemm_keep");
  JAXOVERLAP_REGISTER(JaxoverlapAgGemmK, "ag_gemm_k");
  JAXOVERLAP_REGISTER(JaxoverlapDgradRsWgrad, "dgrad_rs_wgrad");
  JAXOVERLAP_REGISTER(JaxoverlapGemmRsCe, "gemm_rs_ce");
  JAXOVERLAP_REGISTER(JaxoverlapGemmRsTile, "gemm_rs_tile");
  JAXOVERLAP_REGISTER(JaxoverlapDgradRsWgradAcc, "dgrad_rs_wgrad_acc");
#undef JAXOVERLAP_REGISTER
  return d;
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "jaxoverlap native extension: XLA FFI handlers for the fused GPU ops";
  m.def("registrations", &registrations, "FFI target name -> {stage: handler capsule}");
  m.def("pending_error", &jaxoverlap::pending_error,
        "The oldest unreported failure of a fused call in this process ('' if none).");
  m.def("take_error", &jaxoverlap::take_error,
        "pending_error(), and forget it (jaxoverlap.check_errors()).");
  m.def("_gemm_alignment_check", &gemm_alignment_check, nb::arg("ordinal"), nb::arg("offset"),
        nb::arg("b_col") = false, nb::arg("a_col") = false,
        "Test-only: relative error of the GEMM runner with operand pointers `offset` bytes off "
        "256-byte alignment.");
  m.def("_sum_blocks_check", &sum_blocks_check, nb::arg("ordinal"), nb::arg("count"),
        nb::arg("elems"), nb::arg("stride"), nb::arg("in_place") = false,
        "Test-only: relative error of the copy-engine handlers' sum of pushed blocks.");
  m.def("_context_check", &context_check, nb::arg("ordinal"), nb::arg("site"),
        "Test-only: a fresh thread's current CUDA context around a DeviceGuard round trip and a "
        "workspace export (issue 26, R1).");
  jaxoverlap::add_device_probes(m);
  m.def(
      "stream_memop_caps",
      [](int ordinal) {
        const jaxoverlap::MemopCaps& c = jaxoverlap::memop_caps(ordinal);
        nb::dict d;
        d["mem_ops_64"] = c.mem_ops_64, d["flush_remote_writes"] = c.flush_remote_writes;
        d["wait_value_nor"] = c.wait_value_nor, d["entry_points"] = c.entry_points;
        d["signal_fallbacks"] = jaxoverlap::ce_signal_fallbacks();
        return d;
      },
      nb::arg("ordinal"),
      "What a CUDA ordinal supports of the stream memory operations (-1: could not be asked): "
      "64-bit operations, CU_STREAM_WAIT_VALUE_FLUSH, wait NOR; whether the driver gave the "
      "entry points; and (process-wide) how many copy-engine signals the driver refused as "
      "stream writes, sent by a one-thread kernel instead.");
  m.def("gemm_plans", &gemm_plans, nb::arg("ordinal"),
        "The GEMM plans of a CUDA ordinal: shape, SM target, and which of cuBLASLt's candidates "
        "the timing chose (ms of the heuristic's first choice and of the kept one).");
  m.def(
      "tile_menu",
      [] {
        std::vector<nb::tuple> out;
        for (int e = 0; e < jaxoverlap::tile_rs_menu_size(); ++e)
          out.push_back(nb::make_tuple(std::string(jaxoverlap::tile_rs_entry_name(e)),
                                       jaxoverlap::tile_rs_entry_alt_epi(e)));
        return out;
      },
      "The tile schedule's menu: [(entry name, the epilogue variants its selection also times, "
      "kTileEpi* bits)]; JAXOVERLAP_TILE_ENTRY=<name>[:<epi>] forces one (tests, tuning runs).");
  m.def("set_gemm_cache_dir", &jaxoverlap::GemmRunner::set_cache_dir, nb::arg("path"),
        "The directory where GEMM algorithm choices are shared between processes ('': none).");
  m.def("_gemm_candidates", &gemm_candidates, nb::arg("ordinal"), nb::arg("m"), nb::arg("n"),
        nb::arg("k"), nb::arg("accumulate") = false, nb::arg("comm_sms") = 0,
        "Tools: (SM target, [ms per launch of each of cuBLASLt's top candidates]) for a bf16 "
        "GEMM on random data, on the partition leaving comm_sms SMs (0: the whole device).");
  m.def(
      "handler_calls",
      [] {
        const jaxoverlap::HandlerCalls c = jaxoverlap::handler_calls();
        return nb::make_tuple(c.all, c.captured);
      },
      "(all, captured): host invocations of the fused handlers so far, and how many of them "
      "XLA was capturing into a CUDA graph (replays of a graph invoke nothing on the host).");
  m.def(
      "workspace_pool",
      [] {
        const jaxoverlap::PoolStats st = jaxoverlap::pool_stats();
        nb::dict d, by_device;
        d["workspaces"] = st.workspaces, d["exact"] = st.exact, d["spanning"] = st.spanning;
        d["own_bytes"] = st.own_bytes, d["mapped_bytes"] = st.mapped_bytes;
        d["flags_bytes"] = st.flags_bytes, d["block_bytes"] = st.block_bytes;
        for (auto [ordinal, bytes] : st.own_by_device) by_device[nb::int_(ordinal)] = bytes;
        d["own_by_device"] = by_device;
        return d;
      },
      "What the workspace pool holds now, counted from its buffers (no CUDA call): workspaces, "
      "exact, spanning; own_bytes (this process's allocations; own_by_device by CUDA ordinal), "
      "mapped_bytes (peers' buffers mapped by CUDA IPC), flags_bytes (one member's flag block), "
      "block_bytes (each workspace's size class, or an exact one's size).");
  m.def("ws_size_class", &jaxoverlap::size_class, nb::arg("block_bytes"),
        "The size class of a workspace block of `block_bytes` (ws_class.h): the slot bytes of "
        "the shared workspace a call with that block gets.");
  m.def("memory_in_use", &jaxoverlap::memory_in_use,
        "Device memory in use on a CUDA ordinal (total - free, cudaMemGetInfo), bytes; -1 on error.");
  m.def(
      "compute_capability",
      [](int ordinal) {
        int major = -1, minor = -1;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal) ||
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal))
          return nb::make_tuple(-1, -1);
        return nb::make_tuple(major, minor);
      },
      "(major, minor) compute capability of a CUDA ordinal; (-1, -1) on error.");
  m.def(
      "peer_link",
      [](int a, int b) {
        // Native atomics over the link are reported for NVLink(/NVSwitch/C2C)-connected peers
        // only; PCIe peer access reports 0 (PCIe has no CUDA-native peer atomics).
        int access = 0, atomics = 0, rank = -1;
        cudaDeviceGetP2PAttribute(&access, cudaDevP2PAttrAccessSupported, a, b);
        cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, a, b);
        cudaDeviceGetP2PAttribute(&rank, cudaDevP2PAttrPerformanceRank, a, b);
        cudaGetLastError();
        nb::dict d;
        d["access"] = access != 0;
        d["native_atomics"] = atomics != 0;
        d["performance_rank"] = rank;
        return d;
      },
      "Peer link a -> b: {'access', 'native_atomics', 'performance_rank'} "
      "(cudaDeviceGetP2PAttribute).");
  m.def(
      "can_access_peer",
      [](int a, int b) {
        int can = 0;
        return cudaDeviceCanAccessPeer(&can, a, b) == cudaSuccess && can != 0;
      },
      "Whether CUDA device `a` can map device `b`'s memory (initialises the CUDA runtime).");
  m.def(
      "devices",
      [] {
        // (ordinal, PCI bus id) of every GPU this process can see: what another process of the
        // same host compares its own GPUs' bus ids with (jaxoverlap/xproc.py).
        nb::list out;
        int count = 0;
        if (cudaGetDeviceCount(&count)) count = 0;
        for (int i = 0; i < count; ++i) {
          char bus[32] = {};
          if (cudaDeviceGetPCIBusId(bus, sizeof(bus), i) == cudaSuccess)
            out.append(nb::make_tuple(i, std::string(bus)));
        }
        cudaGetLastError();
        return out;
      },
      "[(ordinal, PCI bus id)] of the GPUs visible to this process.");
  auto key = [](int64_t site, std::vector<int> group, int64_t block_bytes, bool partials,
                bool gather, bool exact) {
    return jaxoverlap::WsKey{site, group, block_bytes, partials, gather, exact};
  };
  // `exact`: the workspace is not shared by size class (runtime/ws_class.h), as the handler of
  // the same call decides (the tile schedule's).
  m.def(
      "ws_export",
      [key](int64_t site, std::vector<int> group, int64_t block_bytes, bool partials, bool gather,
            int rank, bool exact) {
        std::string handles;
        std::string e = jaxoverlap::export_rank(
            key(site, group, block_bytes, partials, gather, exact), rank, &handles);
        if (!e.empty()) throw std::runtime_error(e);
        return nb::bytes(handles.data(), handles.size());
      },
      "Allocates this process's rank of a workspace that spans processes; its CUDA IPC handles.");
  m.def(
      "ws_import",
      [key](int64_t site, std::vector<int> group, int64_t block_bytes, bool partials, bool gather,
            int peer, nb::bytes handles, bool exact) {
        std::string e = jaxoverlap::import_peer(
            key(site, group, block_bytes, partials, gather, exact), peer,
            std::string(static_cast<const char*>(handles.data()), handles.size()));
        if (!e.empty()) throw std::runtime_error(e);
      },
      "Maps peer rank `peer`'s workspace buffers (its ws_export bytes) into this process.");
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
}
