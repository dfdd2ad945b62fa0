#pragma once

// custom_conv_relu_add's implicit-GEMM convolution for sm_90 (Hopper):
// TF32 tensor-core MMAs (wgmma) fed by TMA, the epilogue fused, the output
// written NCHW (docs/kernels/conv_relu_add.md).  Raw pointers only; no
// dispatcher headers.  Built for sm_90a alone: the caller asks
// implicitGemmConvTakes() before every launch.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/conv/fused_operands.cuh"

namespace torchfuse::kernels {

// A 2-D convolution, stride 1, dilation 1, one group:
// x [n][h][w][c] (nhwc) * weight [k][r][s][c] -> [n][k][p][q] (nchw),
// p = h + 2 pad_h - r + 1, q = w + 2 pad_w - s + 1.
struct ImplicitGemmConv {
  int64_t n, c, h, w, k, r, s, pad_h, pad_w, p, q;
};

// Whether the kernel takes this problem on the current device: an sm_90
// device, c a multiple of 32, k <= 128, q <= 128 with p * q and the tile's
// output run multiples of 4 elements, and tiles that fit in shared memory
// (with_mask: with the mask's bitmap too).
bool implicitGemmConvTakes(const ImplicitGemmConv& g, bool with_mask = false);

// The fused convolution, out nchw, and, where o.mask is not null, the relu
// mask of t in nchw order: bit i % 32 of word i / 32 is !(t <= 0) for
// element i = (n * k + channel) * p * q + position (the positions-inner
// order of conv_relu_add.cuh); the mask must be zeroed before (a word shared
// by two tiles is ORed into), 4-byte aligned.  x and weight hold float32
// values already rounded to TF32 (the MMAs truncate the low mantissa bits).
// x, weight and out 16-byte aligned.  Returns false, launching nothing,
// when the driver refuses the tensor maps.
bool implicitGemmConvReluAdd(
    const ConvReluAddOperands& o,
    const ImplicitGemmConv& g,
    cudaStream_t stream);

// x given nchw [n][c][h][w] (16-byte aligned) to implicitGemmConvReluAddFromNchw.
struct ImplicitGemmNchwInput {
  const float* x;
  uint32_t* workspace; // implicitGemmConvWorkspaceWords(g) words, zeroed by the call
  int lookahead;       // images the conversion runs ahead at most; 0: the kernel's own choice
};

// implicitGemmConvReluAdd with x given nchw: the producer warpgroup's idle
// warps of every CTA convert nchw.x into o.x (nhwc), rounded to TF32, image
// by image ahead of the convolution, so the conversion costs no pass of its
// own.  Needs implicitGemmConvConvertsNchw(g).
bool implicitGemmConvReluAddFromNchw(
    const ImplicitGemmNchwInput& nchw,
    const ConvReluAddOperands& o,
    const ImplicitGemmConv& g,
    cudaStream_t stream);

// Whether implicitGemmConvReluAddFromNchw can read this problem's x nchw:
// h * w a multiple of 4 (rows of whole 16-byte loads).
bool implicitGemmConvConvertsNchw(const ImplicitGemmConv& g);

int64_t implicitGemmConvWorkspaceWords(const ImplicitGemmConv& g);

// out = conv alone, nchw, under implicitGemmConvReluAdd's contract: the data
// gradient of a stride-1 convolution is one (docs/kernels/conv_relu_add.md,
// "Training through the implicit-GEMM kernel").
bool implicitGemmConv(
    const float* x, const float* weight, float* out, const ImplicitGemmConv& g, cudaStream_t stream);

}  // namespace torchfuse::kernels
