// Host-side declarations of the all-gather + GEMM helper kernels (ffi/kernels/ag.cu): one-thread
// kernels that wait for or release the flags around the copy-engine pushes. Plain CUDA runtime
// types only, so the handler can include it without device code.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace jaxoverlap {

// Force-load every kernel below on the current device (lazy module loading must never happen
// while one of our waits spins).
cudaError_t preload_ag_kernels();
// Copy stream, before pushing x into rank `dst`'s slot: wait until `dst` released that slot in
// the previous call on this workspace (Flags::slot_free[dst] >= epoch).
cudaError_t launch_ag_wait_slot_free(const Peers& peers, int dst, uint64_t timeout_ns,
                                     ErrorRecord* err, cudaStream_t stream);
// Copy stream, after the push of chunk `chunk` into rank `dst`'s slot: release
// Flags::arrive[rank][chunk][0] = epoch + 1 on `dst` (.sys). stall_rank == rank: never (tests).
cudaError_t launch_ag_signal_arrival(const Peers& peers, int dst, int chunk, int stall_rank,
                                     cudaStream_t stream);
// GEMM stream, before the GEMM on rank `src`'s chunk `chunk`: wait for its arrival flag.
cudaError_t launch_ag_wait_arrival(const Peers& peers, int src, int chunk, uint64_t timeout_ns,
                                   ErrorRecord* err, cudaStream_t stream);

}  // namespace jaxoverlap
