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

// The backward's operands: dx[i] = mask bit i ? dy[i] : 0 for n elements.
template <typename T>
struct ReluGradArgs {
  const T* dy;
  const uint32_t* mask;
  T* dx;
  int64_t n;
};

// The backward over dy and dx in memory order.
template <typename T>
void reluBackward(const ReluGradArgs<T>& a, cudaStream_t stream);

// Up to kReluMaxDims dims (after ops/cuda/ merges contiguous ones) of a
// tensor read in logical row-major order: sizes, and the element strides of
// the tensors a kernel reads and writes.
constexpr int kReluMaxDims = 10;
struct ReluStrides {
  int ndim;
  int64_t sizes[kReluMaxDims];
  int64_t a[kReluMaxDims];  // y (mask) or dy (backward)
  int64_t b[kReluMaxDims];  // dx (backward)
};

// The mask of !(y <= 0) for y of any strides (s.a): one thread per element
// in logical order, one warp ballot per mask word; writes ceil(n/32) words
// and allocates nothing.
template <typename T>
void reluMaskStrided(
    const T* y,
    const ReluStrides& s,
    uint32_t* mask,
    int64_t n,
    cudaStream_t stream);

// The backward with i the logical index, dy of strides s.a and dx of
// strides s.b.
template <typename T>
void reluBackwardStrided(const ReluGradArgs<T>& a, const ReluStrides& s, cudaStream_t stream);

} // namespace torchfuse::kernels
