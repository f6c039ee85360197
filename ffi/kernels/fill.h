// A device-side fill with reproducible pseudo-random values: the operands GemmRunner times its
// candidate algorithms on (gemm.cc). Tensor-core GEMMs draw measurably less power on zeros or
// constants than on random data, so timing needs random-looking operands.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jaxoverlap {

enum class FillType : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2 };

// p[i] = uniform in [-1, 1) from a hash of (seed, i), i < elems, stored as `type`.
cudaError_t launch_fill_uniform(void* p, int64_t elems, FillType type, uint32_t seed,
                                cudaStream_t stream);

}  // namespace jaxoverlap
