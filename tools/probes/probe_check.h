// The standalone probes' CUDA check (tile_rs_probe.cu, tile_live.cu): a failed call prints where
// and exits.
#pragma once

#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);    \
      std::fflush(stdout);                                                                    \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
