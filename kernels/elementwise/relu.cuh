#pragma once

// ReLU kernels on raw device pointers.  No dispatcher headers here: callers
// in ops/cuda/ check arguments, pick the stream and map dtypes.
//
// Mask layout: bit i of 32-bit word i/32 is !(y[i] <= 0) (ops/common/relu_mask.h).

#include <cuda_runtime_api.h>

#include <cstdint>

namespace torchfuse::kernels {

// y[i] = x[i] <= 0 ? 0 : x[i] over n elements in memory order (NaN stays
// NaN).  When mask is not null, also writes ceil(n/32) mask words.
template <typename T>
void reluForward(
    const T* x,
    T* y,
    uint32_t* mask,
    int64_t n,
    cudaStream_t stream);

// dx[i] = mask bit i ? dy[i] : 0.
template <typename T>
void reluBackward(
    const T* dy,
    const uint32_t* mask,
    T* dx,
    int64_t n,
    cudaStream_t stream);

} // namespace torchfuse::kernels
