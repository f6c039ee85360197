// The extension's test-only bindings of the device probes (kernels/memops_probe.h), kept out of
// ffi/registry.cc: add_device_probes(m) defines _stream_memops_probe, _ce_signal_probe and
// _reduce_push_probe on the module.
#pragma once

#include <nanobind/nanobind.h>

namespace jaxoverlap {
void add_device_probes(nanobind::module_& m);
}  // namespace jaxoverlap
