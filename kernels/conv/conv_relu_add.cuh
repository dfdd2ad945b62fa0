#pragma once

// The elementwise passes around eager's convolution for
// custom_conv_relu_add, on raw device pointers.  No dispatcher headers here:
// ops/cuda/conv_relu_add_kernel.cpp checks arguments, picks the stream and
// maps dtypes.
//
// Shapes: N images, C channels, S spatial positions (the product of the
// spatial sizes).  "nchw" is [N][C][S] (contiguous), "nhwc" is [N][S][C]
// (channels-last).
//
// Mask layout (ops/conv_relu_add.h): bits in channels-last order, each
// position's channels padded to whole 32-bit words: bit c % 32 of word
// (n * S + s) * ceil(C / 32) + c / 32 is !(t <= 0) for the pre-activation t.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace torchfuse::kernels {

// From the conv output `conv` (nchw when nchw, else nhwc), in one pass:
//   t = conv + bias[c];  out = (t <= 0 ? 0 : t) + alpha * other[c]
// in the same layout, and the mask of t.  bias, other (C values each) and
// mask may be null; out may be conv.
template <typename T>
void convReluAddEpilogue(
    const T* conv,
    const T* bias,
    const T* other,
    float alpha,
    T* out,
    bool nchw,
    uint32_t* mask,
    int64_t n,
    int64_t c,
    int64_t s,
    cudaStream_t stream);

// Partial sums convReluAddGradPrologue writes: `parts` rows of C doubles each.
int64_t convReluAddGradParts(int64_t n, int64_t c, int64_t s);

// From grad_output `dy` (nchw when dy_nchw, else nhwc), in one pass:
//   g = mask ? dy : 0 written nchw when g_nchw, else nhwc,
// and per-channel partial sums of g and of dy into sum_g and sum_dy
// (convReluAddGradParts rows of C each; either may be null).
template <typename T>
void convReluAddGradPrologue(
    const T* dy,
    bool dy_nchw,
    const uint32_t* mask,
    T* g,
    bool g_nchw,
    double* sum_g,
    double* sum_dy,
    int64_t n,
    int64_t c,
    int64_t s,
    cudaStream_t stream);

} // namespace torchfuse::kernels
