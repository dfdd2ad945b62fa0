#pragma once

// custom_add_layer_norm's CUDA kernel on raw device pointers.  No dispatcher
// headers here: ops/cuda/add_layer_norm_kernel.cpp checks arguments, picks
// the stream and maps dtypes.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace torchfuse::kernels {

// Over `rows` contiguous rows of `cols` elements:
//   s = round_T(input + alpha * other)        (add, in float, rounded once)
//   out = (s - mean(s)) * rsqrt(var(s) + eps) * weight + bias
// mean and the biased variance in float, two passes over the row held in
// registers; out rounded to T.  weight, bias (cols values) may be null; sum
// (the rows of s) is written when not null.
template <typename T>
struct AddLayerNormRows {
  const T* input;
  const T* other;
  float alpha;
  const T* weight;
  const T* bias;
  float eps;
  T* out;
  T* sum;
  int64_t rows, cols;
};

// Whether addLayerNormRows takes this row length and these pointers: 16-byte
// aligned pointers, cols a multiple of the 16-byte vector and at most
// kAddLayerNormMaxCols elements (the row fits the registers of one block).
template <typename T>
bool addLayerNormRowsSupported(const AddLayerNormRows<T>& a);

// At most 32 elements per thread, 1024 threads per row.
constexpr int64_t kAddLayerNormMaxCols = 32 * 1024;

// Launches the kernel: one warp per row for rows of up to 32 x 32 elements,
// else one block per row.  Requires addLayerNormRowsSupported.
template <typename T>
void addLayerNormRows(const AddLayerNormRows<T>& a, cudaStream_t stream);

} // namespace torchfuse::kernels
