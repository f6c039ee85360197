// The Python extension jaxoverlap._native: one registry of FFI targets (name -> stage capsules)
// and a few runtime helpers. Loading it touches no CUDA API; the handlers create the per-device
// runtime on first use.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "runtime.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapGemmRsV1);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapRsV1);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxoverlapAgGemmV1);

namespace nb = nanobind;

namespace {

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
  d["jaxoverlap_gemm_rs_v1"] = stages(JaxoverlapGemmRsV1);
  d["jaxoverlap_rs_v1"] = stages(JaxoverlapRsV1);
  d["jaxoverlap_ag_gemm_v1"] = stages(JaxoverlapAgGemmV1);
  return d;
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "jaxoverlap native extension: XLA FFI handlers for the fused GPU ops";
  m.def("registrations", &registrations, "FFI target name -> {stage: handler capsule}");
  m.def("pending_error", &jaxoverlap::pending_error,
        "The timeout a kernel of this process reported ('' if none).");
  m.def(
      "can_access_peer",
      [](int a, int b) {
        int can = 0;
        return cudaDeviceCanAccessPeer(&can, a, b) == cudaSuccess && can != 0;
      },
      "Whether CUDA device `a` can map device `b`'s memory (initialises the CUDA runtime).");
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
}
