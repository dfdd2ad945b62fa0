#pragma once

// BatchNorm in eval mode folded into the convolution before it, for one
// call: w_out[c, k] = w[c, k] * s_c and shift[c] = (b[c] - mean[c]) * s_c +
// beta[c], with s_c = gamma[c] / sqrt(var[c] + eps), in float.  The weight's
// out-channel is its outermost dimension: channel c's `per_channel` elements
// are one block at c * per_channel, in any order that w and w_out share.
// bias, gamma and beta may be null (no bias: 0; affine=False: 1 and 0).

#include <cuda_runtime_api.h>

#include <cstdint>

namespace torchfuse::kernels::batch_norm {

struct FoldArgs {
  int64_t channels;
  int64_t per_channel;
  float eps;
};

template <typename T>
void foldIntoConv(
    const T* w,
    const T* bias,
    const T* gamma,
    const T* beta,
    const T* mean,
    const T* var,
    T* w_out,
    T* shift_out,
    FoldArgs args,
    cudaStream_t stream);

} // namespace torchfuse::kernels::batch_norm
