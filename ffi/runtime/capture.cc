// Handler calls that XLA captures into its command buffers (runtime.h: CaptureScope): whether
// this thread's call is being captured, what may not be set up then, and diagnostics when a
// capture breaks. Host code only.
#include <atomic>
#include <cstdio>
#include <string>
#include <thread>

#include "runtime/capture.h"

namespace jaxoverlap {

namespace {
thread_local bool t_capturing = false;
thread_local cudaStream_t t_capture_stream = nullptr;
thread_local const char* t_intact_at = nullptr;  // the last mark that found the capture intact
std::atomic<int64_t> g_calls{0}, g_captured_calls{0};
}  // namespace

CaptureScope::CaptureScope(cudaStream_t xla_stream, const char* what)
    : saved_(t_capturing), saved_stream_(t_capture_stream), what_(what) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(xla_stream, &st);
  if (st == cudaStreamCaptureStatusInvalidated)
    fprintf(stderr, "jaxoverlap: XLA's CUDA graph capture was invalidated before a call of %s\n",
            what);
  t_capturing = st == cudaStreamCaptureStatusActive;
  t_capture_stream = xla_stream;
  t_intact_at = "the start of the call";
  ++g_calls;
  if (t_capturing) ++g_captured_calls;
}
CaptureScope::~CaptureScope() {
  // CUDA reports an invalidated capture only when XLA ends it, naming nothing: say whether it
  // broke during this handler call.
  if (t_capturing && !stream_capturing(t_capture_stream))
    fprintf(stderr, "jaxoverlap: XLA's CUDA graph capture was invalidated during a call of %s, "
            "after %s (last CUDA error: %s)\n", what_, t_intact_at,
            cudaGetErrorString(cudaPeekAtLastError()));
  t_capturing = saved_;
  t_capture_stream = saved_stream_;
}

bool under_capture() { return t_capturing; }

void capture_mark(const char* where) {
  if (t_capturing && stream_capturing(t_capture_stream)) t_intact_at = where;
}

std::string capture_lost(const char* what) {
  if (!t_capturing) return "";
  if (stream_capturing(t_capture_stream)) {
    t_intact_at = what;
    return "";
  }
  return std::string("XLA's CUDA graph capture of this call was invalidated by ") + what +
         " (last CUDA error: " + cudaGetErrorString(cudaPeekAtLastError()) + ")";
}

std::string outside_capture(const char* what, const std::function<std::string()>& fn) {
  if (!t_capturing) return fn();
  int device = 0;
  cudaGetDevice(&device);
  std::string result;
  std::thread([&] {
    if (cudaError_t e = cudaSetDevice(device))
      result = std::string("cudaSetDevice on a set-up thread: ") + cudaGetErrorString(e);
    else
      result = fn();
  }).join();
  if (result.empty())
    if (std::string lost = capture_lost(what); !lost.empty()) return lost;
  return result;
}

HandlerCalls handler_calls() { return {g_calls.load(), g_captured_calls.load()}; }

}  // namespace jaxoverlap
