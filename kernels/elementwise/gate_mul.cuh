#pragma once

// custom_gate_mul's pass on raw device pointers: a squeeze-and-excitation
// gate applied to its input, out = act(gate[n][c]) * x[n][c][p].  No
// dispatcher headers here: ops/cuda/gate_mul_kernel.cpp checks arguments,
// picks the stream and maps dtypes.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/activation.h"

namespace torchfuse::kernels {

// x and out: n images x c channels x s positions in memory order, nchw
// ([n][c][s], contiguous) when !channels_last, else nhwc ([n][s][c]); out
// may not overlap x.  gate: the element of (image i, channel j) at
// gate[i * gate_image_stride + j * gate_channel_stride] (a stride of 0
// broadcasts).  act(gate) is rounded to T before the product, which is
// rounded again: eager's act, then mul.  act: sigmoid or hardsigmoid.
template <typename T>
struct GateMulArgs {
  const T* x;
  const T* gate;
  T* out;
  Activation act;
  int64_t n, c, s;
  int64_t gate_image_stride, gate_channel_stride;
};

// 16-byte loads and stores where x and out are 16-byte aligned and no
// vector spans two images, else scalar ones.  The gate's activation is
// sigmoid or hardsigmoid; false, launching nothing, for any other.
template <typename T>
bool gateMul(const GateMulArgs<T>& a, bool channels_last, cudaStream_t stream);

} // namespace torchfuse::kernels
