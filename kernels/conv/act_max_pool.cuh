#pragma once

// custom_conv_act_max_pool's pooling pass on raw device pointers: bias and
// activation applied to each element of the window as it is read, so the
// conv output is read once and only the pooled result is written.  No
// dispatcher headers here: ops/cuda/conv_act_max_pool_kernel.cpp checks
// arguments, picks the stream and maps dtypes.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/activation.h"

namespace torchfuse::kernels {

// out[n][c][y][x] = max over the window of act(in[n][c][h][w] + bias[c]),
// computed in float and rounded once; NaN propagates as in ATen's
// max_pool2d.  in: n x c x h x w, out: n x c x ho x wo, both nchw
// (contiguous) when !channels_last, else both nhwc.  bias may be null.
template <typename T>
struct ActMaxPoolArgs {
  const T* in;
  const T* bias;
  T* out;
  Activation act;
  int64_t n, c, h, w, ho, wo;
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
};

// nhwc: 16-byte vectors of channels where c allows and in and out are
// 16-byte aligned, else one channel a thread.
template <typename T>
void actMaxPool(const ActMaxPoolArgs<T>& a, bool channels_last, cudaStream_t stream);

} // namespace torchfuse::kernels
