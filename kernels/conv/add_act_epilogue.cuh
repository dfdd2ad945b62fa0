#pragma once

// custom_conv_add_act's epilogue on raw device pointers: one in-place pass
// over eager's conv output.  No dispatcher headers here:
// ops/cuda/conv_add_act_kernel.cpp checks arguments, picks the stream and
// maps dtypes.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/activation.h"

namespace torchfuse::kernels {

// out = act(out * scale[c] + shift[c] + bias[c] + alpha * other), computed
// in float and rounded once, over n images x c channels x s positions of
// `out`, in memory order: nchw ([n][c][s], contiguous) when !channels_last,
// else nhwc ([n][s][c]).  bias (c values) and other (the same sizes and
// strides as out) may be null; scale and shift (c floats: an eval
// BatchNorm, kernels/batch_norm/eval_affine.cuh) are both null or both set.
template <typename T>
struct ConvAddActEpilogueArgs {
  T* out;
  const T* bias;
  const T* other;
  float alpha;
  Activation act;
  int64_t n, c, s;
  const float* scale = nullptr;
  const float* shift = nullptr;
};

// 16-byte loads and stores where out and other are 16-byte aligned, else
// scalar ones.
template <typename T>
void convAddActEpilogue(
    const ConvAddActEpilogueArgs<T>& a,
    bool channels_last,
    cudaStream_t stream);

} // namespace torchfuse::kernels
