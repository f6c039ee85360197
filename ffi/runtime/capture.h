// XLA's command buffers (CUDA graphs) as the handlers see them: whether this thread's call is
// being captured, what may not be set up then, the done event across captured and uncaptured
// calls, and diagnostics when a capture breaks (capture.cc). Host code only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>

namespace jaxoverlap {

// XLA's command buffers (CUDA graphs). With JAXOVERLAP_COMMAND_BUFFERS=1 the handlers are
// registered COMMAND_BUFFER_COMPATIBLE (jaxoverlap/runtime.py): XLA captures each handler call
// on a trace stream (thread-local capture mode) and replays the graph without running any host
// code of ours until a buffer address changes. Everything a call needs per launch lives on the
// GPU already (epochs advance in the finish kernel, abort words are indexed by them, the
// workspace's done event becomes a graph node), so a replay is a correct call. XLA usually runs
// a command buffer once uncaptured first, but not always: in a scanned training step a call
// site's first call was captured (docs/measurements.md run 44). So nothing may allocate,
// synchronise or time on this thread under capture, and the one-time set-up a first call needs
// (device runtime, partitions, workspaces, kernel loading, GEMM planning) runs on a helper
// thread instead (outside_capture); the GEMM warm-up on the call's own buffers is skipped
// (handlers/fused_call.h: warm_up_now).
class CaptureScope {  // for the duration of one handler call on this thread
 public:
  // `what` names the op in diagnostics (a string literal: kept, not copied).
  CaptureScope(cudaStream_t xla_stream, const char* what);
  ~CaptureScope();

 private:
  bool saved_;
  cudaStream_t saved_stream_;
  const char* what_;
};
// Whether the handler call running on this thread is being captured.
bool under_capture();
// Under capture, notes `where` (a string literal) if the capture is still intact there: an
// invalidated capture's diagnostic names the last point where it was not yet.
void capture_mark(const char* where);
// Under capture: "" while XLA's capture is intact, else a sentence saying that `what` (the CUDA
// call just made) invalidated it -- CUDA only says so when XLA ends the capture, naming nothing.
std::string capture_lost(const char* what);
// One-time set-up (allocation, green contexts, kernel loading, GEMM planning) that a call needs
// first: run here, or, while this thread's call is being captured, on a helper thread (on the
// same device) and joined -- XLA captures in thread-local mode, which forbids this thread's
// allocations and synchronisations but not another thread's. `what` names it if the capture
// breaks anyway. Returns fn's result.
std::string outside_capture(const char* what, const std::function<std::string()>& fn);
// Host invocations of the handlers since the process started: all, and those under capture
// (tests: a call in a CUDA graph runs on the host once for any number of replays).
struct HandlerCalls {
  int64_t all, captured;
};
HandlerCalls handler_calls();

// The workspace's done event crosses calls: recorded by one call (join, close_call), waited on by
// the next. An event recorded outside a capture cannot be waited on inside it (nor one recorded
// inside a graph outside it) unless both are external event nodes; outside capture the external
// flags are illegal (measured: "operation cannot be performed in the present state"), so they
// are used only on a stream that is capturing.
inline bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &st) == cudaSuccess && st == cudaStreamCaptureStatusActive;
}
inline cudaError_t record_done(cudaEvent_t done, cudaStream_t stream) {
  return stream_capturing(stream) ? cudaEventRecordWithFlags(done, stream, cudaEventRecordExternal)
                                  : cudaEventRecord(done, stream);
}
inline cudaError_t wait_done(cudaStream_t stream, cudaEvent_t done) {
  return cudaStreamWaitEvent(stream, done, stream_capturing(stream) ? cudaEventWaitExternal : 0);
}

}  // namespace jaxoverlap
