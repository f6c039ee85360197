// Handler calls that XLA captures into its command buffers (runtime.h: CaptureScope): whether
// this thread's call is being captured, what may not be set up then, and diagnostics when a
// capture breaks. Host code only.
#include <atomic>
#include <cstdio>
#include <string>

#include "runtime.h"

namespace jaxoverlap {

namespace {
thread_local bool t_capturing = false;
thread_local cudaStream_t t_capture_stream = nullptr;
std::atomic<int64_t> g_calls{0}, g_captured_calls{0};
}  // namespace

CaptureScope::CaptureScope(cudaStream_t xla_stream)
    : saved_(t_capturing), saved_stream_(t_capture_stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(xla_stream, &st);
  if (st == cudaStreamCaptureStatusInvalidated)
    fprintf(stderr, "jaxoverlap: XLA's CUDA graph capture was invalidated before a fused call\n");
  t_capturing = st == cudaStreamCaptureStatusActive;
  t_capture_stream = xla_stream;
  ++g_calls;
  if (t_capturing) ++g_captured_calls;
}
CaptureScope::~CaptureScope() {
  // CUDA reports an invalidated capture only when XLA ends it, naming nothing: say whether it
  // broke during this handler call.
  if (t_capturing && !stream_capturing(t_capture_stream))
    fprintf(stderr, "jaxoverlap: XLA's CUDA graph capture was invalidated during a fused call "
            "(last CUDA error: %s)\n", cudaGetErrorString(cudaPeekAtLastError()));
  t_capturing = saved_;
  t_capture_stream = saved_stream_;
}

bool under_capture() { return t_capturing; }

std::string capture_lost(const char* what) {
  if (!t_capturing || stream_capturing(t_capture_stream)) return "";
  return std::string("XLA's CUDA graph capture of this call was invalidated by ") + what +
         " (last CUDA error: " + cudaGetErrorString(cudaPeekAtLastError()) + ")";
}

std::string capture_setup_error(const std::string& what) {
  if (!t_capturing) return "";
  return "first use of " + what + " while XLA captures a CUDA graph: set-up cannot be captured, "
         "and XLA runs every command buffer once uncaptured first, so this call site skipped "
         "it. Run the program without command buffers (JAXOVERLAP_COMMAND_BUFFERS=0, the "
         "default, or XLA_FLAGS=--xla_gpu_enable_command_buffer=) and report this";
}

HandlerCalls handler_calls() { return {g_calls.load(), g_captured_calls.load()}; }

}  // namespace jaxoverlap
