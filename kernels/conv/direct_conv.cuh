#pragma once

// custom_conv_relu_add's direct convolution for few channels (float32): one
// kernel computes the convolution and the epilogue, where eager's cuDNN
// convolution plus a separate pass cost more in launches and host overhead
// than in arithmetic (docs/kernels/conv_relu_add.md).  Raw pointers
// only; no dispatcher headers.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/conv/fused_operands.cuh"

namespace torchfuse::kernels {

// A 2-D convolution of one group: x [n][c][h][w] * weight [k][c][r][s]
// -> [n][k][p][q], all contiguous (nchw), with the usual stride, padding
// and dilation per spatial dimension.
struct DirectConv {
  int64_t n, c, h, w, k, r, s;
  int64_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  int64_t p, q;
};

// Whether the kernel takes this problem: k <= 32 output channels, at most
// 2048 multiply-adds per output position (c * r * s * k, k rounded up to
// 8, 16 or 32), the input rows a block reads within 48 KiB of shared
// memory with the weights, and 32-bit element counts.
bool directConvTakes(const DirectConv& g);

// The fused convolution, out nchw; no mask (o.mask is not read).  The
// convolution in float32, each output a fused multiply-add chain over
// (c, r, s) in that order.
void directConvReluAdd(const ConvReluAddOperands& o, const DirectConv& g, cudaStream_t stream);

}  // namespace torchfuse::kernels
